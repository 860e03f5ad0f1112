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
from yogastore.order import Shuffle
from yogastore.progress import NullProgress, Progress
from yogastore.spec import ComponentSpec, Kind, RaggedValue, SparseValue
from yogastore.store import DatasetInfo, DatasetRef, Store
from yogastore.stream import Stream, StreamState
from yogastore.work_queue import QueueStatus, QueueStream, WorkQueue, WorkQueueState

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
    "QueueStatus",
    "QueueStream",
    "RaggedValue",
    "Shuffle",
    "SparseValue",
    "StorageError",
    "Store",
    "Stream",
    "StreamState",
    "UnsupportedElementError",
    "WorkQueue",
    "WorkQueueState",
    "YogaStoreError",
    "__version__",
]
