"""A plain `pip install .` (no -e) into a fresh folder: one top-level package, `hetplan`, whose
shipped topologies are found by name from an empty directory."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """hetplan installed with `pip install --target` from a copy of the source (no build folders
    left in the checkout); torch and the other dependencies are the ones already installed."""
    base = tmp_path_factory.mktemp("install")
    src = base / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", "tests", "benchmarks", "out", "profiles", "*.egg-info", "__pycache__", ".hetplan-cache", "build"))
    target = base / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                        "--no-index", "--target", str(target), str(src)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return target


def _env(site: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)
    return env


def test_only_hetplan_at_the_top(installed):
    top = {p.name for p in installed.iterdir() if not p.name.endswith((".dist-info", ".egg-info"))}
    assert top - {"bin", "__pycache__"} == {"hetplan"}
    assert (installed / "hetplan" / "topologies" / "dgx-8gpu.json").is_file()
    assert (installed / "hetplan" / "schemas" / "plan.schema.json").is_file()


@pytest.mark.slow
def test_plan_and_explain_by_topology_name_from_an_empty_directory(installed, tmp_path):
    env = _env(installed)
    plan = subprocess.run([sys.executable, "-m", "hetplan", "plan", "--model", "gpt", "--batch", "16",
                           "--topology", "dgx-8gpu", "--time-limit", "5", "-o", "p.json"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert plan.returncode == 0, plan.stderr
    ex = subprocess.run([sys.executable, "-m", "hetplan", "explain", "p.json", "--topology", "dgx-8gpu", "--json"],
                        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert ex.returncode == 0, ex.stderr
    out = json.loads(ex.stdout)
    total = sum(seg["seconds"] for seg in out["critical_path"])
    assert total == pytest.approx(out["iteration_s"], rel=0.01)
    # the package came from the fresh folder, not from the checkout
    where = subprocess.run([sys.executable, "-c", "import hetplan; print(hetplan.__file__)"], cwd=tmp_path,
                           env=env, capture_output=True, text=True)
    assert where.stdout.strip().startswith(str(installed))


def test_an_unknown_topology_name_is_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "hetplan", "plan", "--model", "gpt", "--batch", "16",
                        "--topology", "dgx-9gpu", "-o", "p.json"], cwd=tmp_path, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0
    assert "dgx-9gpu" in r.stderr and "dgx-8gpu" in r.stderr
    assert not (tmp_path / "p.json").exists()
