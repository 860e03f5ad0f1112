"""yogastore: cache a dataset once, give every rank its own shard every epoch.

Importing this package imports neither TensorFlow, boto3 nor lmdb; they are
imported when first needed.
"""

from __future__ import annotations

from storage_backends.errors import (
    AccessDeniedError,
    BackendUnavailableError,
    CorruptCacheError,
    DatasetNotFoundError,
    InvalidArgumentError,
    LockLostError,
    LockTimeoutError,
    StorageError,
    UnsupportedElementError,
    YogaStoreError,
)
from yogastore.format import StringBuffer, StringFormat
from yogastore.order import Shuffle
from yogastore.progress import NullProgress, Progress
from yogastore.spec import ComponentSpec, Kind, RaggedValue, SparseValue
from yogastore.store import DatasetInfo, DatasetRef, Store
from yogastore.stream import Stream, StreamState

__version__ = "0.1.0"

__all__ = [
    "AccessDeniedError",
    "BackendUnavailableError",
    "ComponentSpec",
    "CorruptCacheError",
    "DatasetInfo",
    "DatasetNotFoundError",
    "DatasetRef",
    "InvalidArgumentError",
    "Kind",
    "LockLostError",
    "LockTimeoutError",
    "NullProgress",
    "Progress",
    "RaggedValue",
    "Shuffle",
    "SparseValue",
    "StorageError",
    "Store",
    "Stream",
    "StreamState",
    "StringBuffer",
    "StringFormat",
    "UnsupportedElementError",
    "YogaStoreError",
    "__version__",
]
