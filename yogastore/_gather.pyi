import numpy as np

_Buf = np.ndarray | bytes | bytearray | memoryview

def gather_rows(dst: _Buf, src: _Buf, starts: _Buf, row_bytes: int, /) -> None: ...
def feistel(
    out: _Buf, values: _Buf, keys: _Buf, high_bits: int, low_bits: int, wide: bool, n: int, /
) -> None: ...
