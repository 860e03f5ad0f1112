"""yogastore: cache a dataset once, give every rank its own shard every epoch.

Importing this package imports neither TensorFlow, boto3 nor lmdb; they are
imported when first needed.
"""

from __future__ import annotations

from storage_backends.errors import (
    AccessDeniedError,
    BackendUnavailableError,
    BuildLimitError,
    BuildTimeoutError,
    CoordinationError,
    CorruptCacheError,
    DatasetChangedError,
    DatasetNotFoundError,
    InvalidArgumentError,
    LockLostError,
    LockTimeoutError,
    RankMismatchError,
    StaleCacheError,
    StorageError,
    UnsupportedElementError,
    YogaStoreError,
)
from storage_backends.s3_options import Coordination
from yogastore.build.batches import Batches
from yogastore.build.progress import NullProgress, Progress
from yogastore.format import StringBuffer, StringFormat, StringRanges
from yogastore.queue.jobs import (
    QueueJob,
    QueueJobNotFoundError,
    delete_queue_jobs,
    list_queue_jobs,
    open_queue_runs,
)
from yogastore.queue.work_queue import QueueStatus, QueueStream, WorkQueue, WorkQueueState, lockstep
from yogastore.read.order import Shuffle
from yogastore.read.read_options import ReadOptions
from yogastore.read.stream import Stream, StreamState
from yogastore.spec import ComponentSpec, Kind, RaggedValue, SparseValue
from yogastore.store import DatasetInfo, DatasetRef, GcEntry, Store

__version__ = "0.1.0"

__all__ = [
    "AccessDeniedError",
    "BackendUnavailableError",
    "Batches",
    "BuildLimitError",
    "BuildTimeoutError",
    "ComponentSpec",
    "Coordination",
    "CoordinationError",
    "CorruptCacheError",
    "DatasetInfo",
    "GcEntry",
    "DatasetNotFoundError",
    "DatasetRef",
    "InvalidArgumentError",
    "Kind",
    "LockLostError",
    "LockTimeoutError",
    "NullProgress",
    "Progress",
    "QueueJob",
    "QueueJobNotFoundError",
    "QueueStatus",
    "QueueStream",
    "RaggedValue",
    "RankMismatchError",
    "ReadOptions",
    "Shuffle",
    "SparseValue",
    "StaleCacheError",
    "DatasetChangedError",
    "StorageError",
    "Store",
    "Stream",
    "StreamState",
    "StringBuffer",
    "StringRanges",
    "StringFormat",
    "UnsupportedElementError",
    "WorkQueue",
    "WorkQueueState",
    "YogaStoreError",
    "__version__",
    "delete_queue_jobs",
    "list_queue_jobs",
    "lockstep",
    "open_queue_runs",
]
