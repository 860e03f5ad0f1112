from collections.abc import Sequence

import numpy as np

_Buf = np.ndarray | bytes | bytearray | memoryview

def gather_rows(dst: _Buf, src: _Buf, starts: _Buf, row_bytes: int, /) -> None: ...
def gather_rows_at(
    dst: _Buf,
    src: _Buf,
    addresses: _Buf,
    chunks: _Buf,
    local: _Buf,
    lowest: int,
    row_bytes: int,
    stride: int = ...,
    /,
) -> None: ...
def feistel(
    out: _Buf, values: _Buf, keys: _Buf, high_bits: int, low_bits: int, wide: bool, n: int, /
) -> None: ...
def blocks_verified(
    chunks: _Buf, starts: _Buf, ends: _Buf, base: _Buf, size: _Buf, slot: _Buf, bits: _Buf, /
) -> bool: ...
def hash_blocks(
    out: _Buf, views: Sequence[_Buf], which: _Buf, starts: _Buf, ends: _Buf, /
) -> None: ...
def gather_ranges(dst: _Buf, src: _Buf, starts: _Buf, lengths: _Buf, /) -> int: ...
def ranges_at(
    starts: _Buf,
    lengths: _Buf,
    offsets: _Buf,
    src: _Buf,
    pairs: _Buf,
    rows: _Buf,
    limits: _Buf,
    data: _Buf,
    chunks: _Buf,
    local: _Buf,
    lowest: int,
    item: int,
    /,
) -> tuple[int, int]: ...
def split_bytes(data: _Buf, offsets: _Buf, /) -> list[bytes]: ...
def join_into(dst: _Buf, pieces: Sequence[_Buf], /) -> int: ...

class MappedFault(OSError): ...
