"""hetplan's cache folder: this machine's profiles (`profiles/<fingerprint>.json`), layer timings and
layer maps. $HETPLAN_CACHE_DIR, else $XDG_CACHE_HOME/hetplan, else ~/.cache/hetplan: the user's, not
the working directory's, so every directory sees the same cache."""
from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "HETPLAN_CACHE_DIR"


def cache_dir() -> Path:
    """$HETPLAN_CACHE_DIR, else $XDG_CACHE_HOME/hetplan, else ~/.cache/hetplan."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "hetplan"


__all__ = ["CACHE_ENV", "cache_dir"]
