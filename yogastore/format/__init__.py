"""Chunk bytes <-> columns, numpy only.

One module per concept:

* ``layout``: the columns that store a component and the byte layout of a
  chunk (magic, header prefix, 64-byte aligned regions, index first).
* ``encode``: records in, chunk bytes out (``ChunkBuilder``, ``encode_chunk``).
* ``decode``: chunk bytes in, bounds-checked column views out
  (``parse_header``, ``ChunkView``).
* ``batch``: a gathered batch as callers get it (``ColumnBatch``, strings as
  objects or one ``StringBuffer``).
* ``memory``: the gathers from views into pooled buffers; the read path's
  memory tricks (buffer reuse by reference count, strided views across
  chunks) live there and only there, with their invariants written at its top.

The names below are the package's interface; importers need not know which
module holds what.
"""

from __future__ import annotations

from yogastore.format.batch import (
    ColumnBatch,
    StringBuffer,
    StringFormat,
    StringRanges,
    reshape_values,
    split_strings,
)
from yogastore.format.decode import ChunkView, parse_header
from yogastore.format.encode import ChunkBuilder, encode_chunk
from yogastore.format.layout import ALIGN, MAGIC, ColumnSpec, columns_for
from yogastore.format.memory import gather_views as gather

__all__ = [
    "ALIGN",
    "MAGIC",
    "ChunkBuilder",
    "ChunkView",
    "ColumnBatch",
    "ColumnSpec",
    "StringBuffer",
    "StringRanges",
    "StringFormat",
    "columns_for",
    "encode_chunk",
    "gather",
    "parse_header",
    "reshape_values",
    "split_strings",
]
