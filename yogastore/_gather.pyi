import numpy as np

_Buf = np.ndarray | bytes | bytearray | memoryview

def gather_rows(dst: _Buf, src: _Buf, starts: _Buf, row_bytes: int, /) -> None: ...
