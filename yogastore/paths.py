"""Where yogastore keeps things by default; shared by the store and the readers."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["default_root"]


def default_root() -> Path:
    """Return ``$YOGASTORE_HOME``, else ``~/.cache/yogastore``."""
    home = os.environ.get("YOGASTORE_HOME")
    return Path(home).expanduser() if home else Path.home() / ".cache" / "yogastore"
