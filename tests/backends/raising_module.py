"""A backend module that fails while being imported (a broken third-party package)."""

raise RuntimeError("boom at import")
