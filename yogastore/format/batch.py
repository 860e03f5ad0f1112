"""Gathered batches as callers get them: one column of a batch, strings as objects or buffers."""

from __future__ import annotations

import dataclasses
import enum
import itertools
import math
from typing import Any

import numpy as np

from storage_backends.errors import CorruptCacheError, UnsupportedElementError
from yogastore.arrays import IntArray
from yogastore.format.layout import ColumnSpec

try:  # compiled loops; without them the string split falls back to Python
    from yogastore import _gather
except ImportError:  # pragma: no cover - the package builds it on install
    _gather = None  # type: ignore[assignment]

__all__ = [
    "ColumnBatch",
    "StringBuffer",
    "StringFormat",
    "StringRanges",
    "reshape_values",
    "split_strings",
]


class StringFormat(enum.Enum):
    """How a batch hands over strings.

    ``OBJECTS``: a numpy object array of ``bytes`` (one Python object per
    string). ``BUFFERS``: a ``StringBuffer``, all bytes in one array plus
    offsets, with no Python object per string. ``RANGES``: a ``StringRanges``,
    the strings where they lie: a read-only byte array plus each string's start
    and length (from a local store, a view of the stored chunks: no copy).
    """

    OBJECTS = "objects"
    BUFFERS = "buffers"
    RANGES = "ranges"


def _check_parts(kind: str, shape: Any, data: Any, **index: Any) -> tuple[int, ...]:
    """Return ``shape`` as Python ints if a string batch's parts suit its kernels.

    ``data`` must be a 1-D ``uint8`` array, each of ``index`` a 1-D ``int64`` array,
    all C-contiguous, and ``shape`` a tuple of non-negative ints (numpy ints are
    taken as Python ints, so that its product cannot wrap around).

    Raises:
        UnsupportedElementError: naming the part that is of the wrong kind.
    """
    if not isinstance(shape, tuple) or not all(
        isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise UnsupportedElementError(
            f"{kind} shape must be a tuple of non-negative ints, got {shape!r}"
        )
    if not _is_flat(data, np.uint8):
        raise UnsupportedElementError(
            f"{kind} data must be a contiguous 1-D numpy uint8 array, got {_describe(data)}"
        )
    for name, arr in index.items():
        if not _is_flat(arr, np.int64):
            raise UnsupportedElementError(
                f"{kind} {name} must be a contiguous 1-D numpy int64 array, got {_describe(arr)}"
            )
    return tuple(int(d) for d in shape)


def _is_flat(value: Any, dtype: type) -> bool:
    return (
        isinstance(value, np.ndarray)
        and value.dtype == dtype
        and value.ndim == 1
        and value.flags.c_contiguous
    )


def _describe(value: Any) -> str:
    if isinstance(value, np.ndarray):
        strided = "" if value.flags.c_contiguous else "non-contiguous "
        return f"a {strided}{value.ndim}-D {value.dtype} array"
    return f"a {type(value).__name__}"


@dataclasses.dataclass(frozen=True, slots=True)
class StringBuffer:
    """Strings as one byte buffer plus offsets: string ``i`` is ``data[offsets[i]:offsets[i + 1]]``.

    Attributes:
        data: ``uint8`` array holding every string's bytes, back to back.
        offsets: ``int64`` array of ``n + 1`` ascending byte offsets from 0.
        shape: the shape of the string array (its product is ``n``), e.g.
            ``(batch,)`` for a batch of scalar strings.
    """

    data: np.ndarray
    offsets: np.ndarray
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        shape = _check_parts("StringBuffer", self.shape, self.data, offsets=self.offsets)
        object.__setattr__(self, "shape", shape)
        n = len(self.offsets) - 1
        if n < 0 or math.prod(shape) != n:
            raise UnsupportedElementError(
                f"StringBuffer of shape {shape} needs {math.prod(shape) + 1} offsets, "
                f"got {len(self.offsets)}"
            )
        if n and (self.offsets[0] != 0 or self.offsets[-1] > len(self.data)):
            raise CorruptCacheError(
                f"StringBuffer offsets run from {self.offsets[0]} to {self.offsets[-1]}, "
                f"the buffer holds {len(self.data)} bytes"
            )
        if n > 1 and bool(np.any(self.offsets[1:] < self.offsets[:-1])):
            at = int(np.flatnonzero(self.offsets[1:] < self.offsets[:-1])[0])
            raise CorruptCacheError(
                f"StringBuffer offsets must ascend: offset {at + 1} ({self.offsets[at + 1]}) "
                f"is below offset {at} ({self.offsets[at]})"
            )

    @classmethod
    def _made(cls, data: np.ndarray, offsets: np.ndarray, shape: tuple[int, ...]) -> StringBuffer:
        """One made by the library from parts it checked or built (no checks: per batch)."""
        out = object.__new__(cls)
        object.__setattr__(out, "data", data)
        object.__setattr__(out, "offsets", offsets)
        object.__setattr__(out, "shape", shape)
        return out

    def __len__(self) -> int:
        return self.shape[0] if self.shape else 1

    def lengths(self) -> IntArray:
        """Return the length in bytes of every string (flat)."""
        return np.diff(self.offsets)

    def to_numpy(self) -> np.ndarray:
        """Return the strings as a numpy object array of ``bytes`` of ``shape``."""
        return split_strings(self.data, self.offsets).reshape(self.shape)


@dataclasses.dataclass(frozen=True, slots=True)
class StringRanges:
    """Strings where they lie: string ``i`` is ``data[starts[i]:starts[i] + lengths[i]]``.

    Attributes:
        data: read-only ``uint8`` array the strings lie in (from a local store,
            a view of the mapped chunks; it keeps them alive).
        starts: ``int64`` start of every string in ``data`` (flat).
        lengths: ``int64`` length of every string in bytes (flat).
        shape: the shape of the string array (its product is ``len(starts)``).
    """

    data: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        shape = _check_parts(
            "StringRanges", self.shape, self.data, starts=self.starts, lengths=self.lengths
        )
        object.__setattr__(self, "shape", shape)
        n = len(self.starts)
        if len(self.lengths) != n or math.prod(shape) != n:
            raise UnsupportedElementError(
                f"StringRanges of shape {shape} needs {math.prod(shape)} starts and "
                f"lengths, got {n} and {len(self.lengths)}"
            )
        # starts > size - lengths, not starts + lengths > size: the sum may wrap around.
        if n and (
            int(self.starts.min()) < 0
            or int(self.lengths.min()) < 0
            or bool(np.any(self.starts > len(self.data) - self.lengths))
        ):
            raise CorruptCacheError(
                f"StringRanges reach outside the {len(self.data)} bytes they lie in"
            )

    @classmethod
    def _made(
        cls, data: np.ndarray, starts: np.ndarray, lengths: np.ndarray, shape: tuple[int, ...]
    ) -> StringRanges:
        """One made by the library from parts it checked or built (no checks: per batch)."""
        out = object.__new__(cls)
        object.__setattr__(out, "data", data)
        object.__setattr__(out, "starts", starts)
        object.__setattr__(out, "lengths", lengths)
        object.__setattr__(out, "shape", shape)
        return out

    def __len__(self) -> int:
        return self.shape[0] if self.shape else 1

    def to_buffer(self) -> StringBuffer:
        """Return the strings copied back to back (a ``StringBuffer`` of the same shape)."""
        offsets = np.zeros(len(self.lengths) + 1, dtype=np.int64)
        np.cumsum(self.lengths, out=offsets[1:])
        from yogastore.format.memory import MappedFault, copy_ranges  # (memory imports this)

        out = np.empty(int(offsets[-1]), dtype=np.uint8)
        try:
            copy_ranges(out, self.data, self.starts, self.lengths)
        except MappedFault as err:
            raise CorruptCacheError(
                f"StringRanges.to_buffer: the stored bytes these strings lie in are gone "
                f"(their file was cut short after the batch was handed out): {err}"
            ) from err
        return StringBuffer._made(out, offsets, self.shape)

    def to_numpy(self) -> np.ndarray:
        """Return the strings as a numpy object array of ``bytes`` of ``shape``."""
        return self.to_buffer().to_numpy()


def split_strings(data: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Return ``data[offsets[i]:offsets[i + 1]]`` for each ``i`` as a flat object array."""
    n = len(offsets) - 1
    out = np.empty(max(n, 0), dtype=object)
    if n <= 0:
        return out
    if _gather is not None:
        try:
            out[:] = _gather.split_bytes(data, np.ascontiguousarray(offsets, dtype=np.int64))
        except IndexError as err:
            raise CorruptCacheError(f"string offsets out of bounds: {err}") from err
        return out
    raw = data.tobytes()  # pragma: no cover - the package builds the extension
    bounds = offsets.tolist()  # pragma: no cover
    out[:] = [raw[a:b] for a, b in itertools.pairwise(bounds)]  # pragma: no cover
    return out  # pragma: no cover


@dataclasses.dataclass(slots=True)
class ColumnBatch:
    """One column of a batch of records, in batch order."""

    spec: ColumnSpec
    data: np.ndarray
    shapes: np.ndarray  # [B, ndim]
    offsets: np.ndarray | None = None
    boffsets: np.ndarray | None = None
    # Strings left where they lie (``data`` a view of the chunks): start and
    # length of each string instead of ``boffsets``.
    ranges: tuple[np.ndarray, np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self.shapes)

    def _copied(self) -> ColumnBatch:
        """This batch with its strings copied back to back (itself if they are)."""
        if self.ranges is None:
            return self
        buf = StringRanges(self.data, *self.ranges, (len(self.ranges[0]),)).to_buffer()
        return ColumnBatch(self.spec, buf.data, self.shapes, self.offsets, buf.offsets)

    def record(self, i: int) -> Any:
        """Return record ``i`` as numpy (bytes for scalar strings)."""
        if self.spec.layout == "fixed":
            return self.data[i]
        if self.offsets is None:  # pragma: no cover - var/bytes always have offsets
            raise CorruptCacheError("column batch lacks offsets")
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        shape = tuple(int(d) for d in self.shapes[i])
        if self.spec.layout == "var":
            return self.data[a:b].reshape(shape)
        if self.ranges is not None:
            return self._copied().record(i)
        if self.boffsets is None:  # pragma: no cover
            raise CorruptCacheError("string column batch lacks byte offsets")
        bo = self.boffsets
        strings = [self.data[int(bo[j]) : int(bo[j + 1])].tobytes() for j in range(a, b)]
        if not shape:
            return strings[0]
        out = np.empty(len(strings), dtype=object)
        out[:] = strings
        return out.reshape(shape)

    def strings(self) -> np.ndarray:
        """Return all strings of the batch as a flat object array."""
        if self.ranges is not None:
            return self._copied().strings()
        if self.boffsets is None:
            raise UnsupportedElementError("not a string column")
        return split_strings(self.data, self.boffsets)

    def values(self, strings: StringFormat = StringFormat.OBJECTS) -> Any:
        """Return the flat values: numbers, or strings as ``strings`` says."""
        if self.spec.layout != "bytes":
            return self.data.reshape(-1)
        if strings is StringFormat.RANGES:
            if self.ranges is not None:
                starts, lengths = self.ranges
            elif self.boffsets is not None:
                starts, lengths = self.boffsets[:-1], np.diff(self.boffsets)
            else:  # pragma: no cover - bytes columns have one or the other
                raise UnsupportedElementError("not a string column")
            return StringRanges._made(self.data, starts, lengths, (len(starts),))
        if self.ranges is not None:
            return self._copied().values(strings)
        if strings is StringFormat.BUFFERS:
            if self.boffsets is None:  # pragma: no cover - bytes columns have them
                raise UnsupportedElementError("not a string column")
            return StringBuffer._made(self.data, self.boffsets, (len(self.boffsets) - 1,))
        return self.strings()

    def stacked(self, where: str, strings: StringFormat = StringFormat.OBJECTS) -> Any:
        """Return the batch as one dense ``[B, *shape]`` array (shapes must agree).

        Strings come as ``strings`` says (a ``StringBuffer`` of that shape for
        ``BUFFERS``).
        """
        if self.spec.layout == "fixed":
            return self.data
        if len(self) and np.any(self.shapes != self.shapes[:1]):
            raise UnsupportedElementError(
                f"{where}: cannot batch records of different shapes into one dense array "
                "(as tf.data.Dataset.batch would fail); pass batching=Batching.PADDED or "
                "Batching.RAGGED (yogastore.train.tf_map) to to_tf_dataset, or read them unbatched"
            )
        shape = (
            tuple(int(d) for d in self.shapes[0])
            if len(self)
            else tuple(d or 0 for d in self.spec.shape)
        )
        return reshape_values(self.values(strings), (len(self), *shape))


def reshape_values(values: Any, shape: tuple[int, ...]) -> Any:
    """Reshape flat values (an array, ``StringBuffer`` or ``StringRanges``); one dim may be -1."""
    if not isinstance(values, StringBuffer | StringRanges):
        return values.reshape(shape)
    if -1 in shape:
        known = math.prod(d for d in shape if d != -1)
        count = math.prod(values.shape)
        missing = count // known if known else 0
        shape = tuple(missing if d == -1 else d for d in shape)
    shape = tuple(int(d) for d in shape)
    if min(shape, default=0) < 0 or math.prod(shape) != math.prod(values.shape):
        raise UnsupportedElementError(f"cannot reshape {values.shape} strings to {shape}")
    if isinstance(values, StringRanges):
        return StringRanges._made(values.data, values.starts, values.lengths, shape)
    return StringBuffer._made(values.data, values.offsets, shape)
