"""Benchmarks run from any directory: importing this puts the repository's root on the path of
the commands a benchmark starts (`hetplan run` of a plan whose model is `benchmarks.*`), as each
benchmark puts it on its own."""
from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
