"""Entry point of ``python -m yogastore``."""

from yogastore.cli import main

raise SystemExit(main())
