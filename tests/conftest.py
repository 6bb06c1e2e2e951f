"""Shared pytest setup: the repository root on sys.path (so `tests.factories:...` specs import), a
cache folder of the session's own, and CUDA tests skipped without a GPU."""
import os
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
# tests never read or write the user's cache (~/.cache/hetplan): profiles and layer timings of this
# session go to a folder of its own, which the commands the tests start inherit
if not os.environ.get("HETPLAN_CACHE_DIR"):
    os.environ["HETPLAN_CACHE_DIR"] = tempfile.mkdtemp(prefix="hetplan-test-cache-")


def pytest_collection_modifyitems(config, items):
    try:
        import torch
        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=["standin", pytest.param("real", marks=pytest.mark.cuda)])
def gpu(request, monkeypatch):
    """One GPU for a test: 'standin': the CPU standing in for cuda:0 (hetplan.planner.hardware.device); 'real': this GPU."""
    if request.param == "standin":
        from hetplan.planner.hardware.device import STANDIN_ENV
        monkeypatch.setenv(STANDIN_ENV, "1")
    return request.param
