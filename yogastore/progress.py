"""Progress reporting: a tiny protocol with a no-op default and tqdm on a terminal."""

from __future__ import annotations

import sys
from typing import Any, Protocol

__all__ = ["NullProgress", "Progress", "default_progress"]


class Progress(Protocol):
    """Receives the number of records processed since the last call."""

    def update(self, n: int) -> None: ...

    def close(self) -> None: ...


class NullProgress:
    """Reports nothing."""

    def update(self, n: int) -> None:
        """Ignore ``n``."""

    def close(self) -> None:
        """Do nothing."""


def default_progress(description: str, total: int | None = None) -> Progress:
    """Return a tqdm bar when stderr is a terminal, else a no-op."""
    if not sys.stderr.isatty():
        return NullProgress()
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency
        return NullProgress()
    bar: Any = tqdm(total=total, desc=description, unit="rec", unit_scale=True, leave=False)
    return bar  # type: ignore[no-any-return]
