"""``python -m shardkit``: the same as the ``shardkit`` command."""

from __future__ import annotations

from .tools.cli import main

raise SystemExit(main())
