"""Numpy array types shared by the read path: one definition each."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

__all__ = ["BoolArray", "IntArray"]

#: Record positions, offsets, chunk numbers: always ``int64``.
IntArray = npt.NDArray[np.int64]
#: Per-record or per-chunk flags.
BoolArray = npt.NDArray[np.bool_]
