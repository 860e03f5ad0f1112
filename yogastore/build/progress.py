"""Progress reporting: a tiny protocol, a no-op, tqdm on a terminal, log lines elsewhere.

Under ``horovodrun``, in batch jobs and in CI stderr is not a terminal, so a
bar would be invisible or garble the log; there a line every ~10 seconds
(records, bytes, rate, ETA when the total is known) says the first pass is
alive and how long it will take.
"""

from __future__ import annotations

import sys
import time
from typing import IO, Any, Protocol

__all__ = ["LineProgress", "NullProgress", "Progress", "default_progress"]

LOG_INTERVAL = 10.0  # seconds between lines of LineProgress


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


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"  # pragma: no cover - loop always returns


def _duration(seconds: float) -> str:
    s = round(seconds)
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class LineProgress:
    """Writes one plain line every ``interval`` seconds, and a last one on ``close``.

    Args:
        description: prefix of every line (e.g. ``caching d/1``).
        total: records expected, if known (adds percent and ETA).
        interval: seconds between lines.
        stream: where lines go (default: ``sys.stderr``).
        clock: time source (monotonic seconds), replaceable in tests.
    """

    def __init__(
        self,
        description: str,
        total: int | None = None,
        *,
        interval: float = LOG_INTERVAL,
        stream: IO[str] | None = None,
        clock: Any = time.monotonic,
    ) -> None:
        self.description = description
        self.total = total if total is not None and total >= 0 else None
        self.interval = interval
        self.stream = stream
        self.clock = clock
        self.records = 0
        self.nbytes = 0
        self.started = clock()
        self._last = self.started
        self._closed = False

    def update(self, n: int) -> None:
        """Count ``n`` more records; write a line if ``interval`` has passed."""
        self.records += n
        now = self.clock()
        if now - self._last >= self.interval:
            self._last = now
            self._write(now, final=False)

    def add_bytes(self, n: int) -> None:
        """Count ``n`` more bytes written."""
        self.nbytes += n

    def set_bytes(self, n: int) -> None:
        """Set the bytes written so far (shown by the next line)."""
        self.nbytes = n

    def close(self) -> None:
        """Write the final line (once)."""
        if not self._closed:
            self._closed = True
            self._write(self.clock(), final=True)

    def line(self, now: float, final: bool = False) -> str:
        """Return the line describing the progress at time ``now``."""
        elapsed = max(now - self.started, 1e-9)
        rate = self.records / elapsed
        parts = [f"{self.description}: {self.records}"]
        if self.total is not None:
            parts[0] += f"/{self.total} records"
            if self.total:
                parts.append(f"{100.0 * self.records / self.total:.1f}%")
        else:
            parts[0] += " records"
        parts.append(_size(self.nbytes))
        parts.append(f"{rate:.0f} records/s")
        if final:
            parts.append(f"done in {_duration(elapsed)}")
        elif self.total is not None and rate > 0:
            parts.append(f"ETA {_duration(max(0, self.total - self.records) / rate)}")
        return ", ".join(parts)

    def _write(self, now: float, final: bool) -> None:
        out = self.stream if self.stream is not None else sys.stderr
        out.write(self.line(now, final) + "\n")
        out.flush()


def default_progress(description: str, total: int | None = None) -> Progress:
    """Return a tqdm bar when stderr is a terminal, else a ``LineProgress``.

    Args:
        description: what is in progress.
        total: records expected, if known (shown as the bar's total and used for the ETA).
    """
    if total is not None and total < 0:
        total = None
    if not sys.stderr.isatty():
        return LineProgress(description, total)
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency
        return LineProgress(description, total)
    bar: Any = tqdm(total=total, desc=description, unit="rec", unit_scale=True, leave=False)
    return bar  # type: ignore[no-any-return]
