"""The read path's gathers, now ``yogastore.format.memory``; kept so importers need no change."""

from __future__ import annotations

from yogastore.format.memory import (
    BufferPool,
    FixedRows,
    VarRows,
    copy_ranges,
    copy_rows,
    gather_views,
)

__all__ = [
    "BufferPool",
    "FixedRows",
    "VarRows",
    "copy_ranges",
    "copy_rows",
    "gather_views",
]
