"""Progress of the long waits (hetplan.planner.files.progress): plain lines with k of n and an ETA
when stderr is not a terminal, a bar only on one, nothing on stdout under --json."""
from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

from hetplan.planner.files import progress
from hetplan.planner.files.progress import Progress

ROOT = Path(__file__).resolve().parent.parent


def test_plain_lines_say_k_of_n_and_an_eta():
    out = io.StringIO()
    with Progress(3, "timing 5 layers", unit="size", stream=out, every_s=0.0) as bar:
        for b in (8, 16, 32):
            bar.update(note=f"cpu:0 at batch {b}")
    lines = out.getvalue().splitlines()
    assert [l.split(",")[0] for l in lines] == [f"timing 5 layers: {k}/3 sizes" for k in (1, 2, 3)]
    assert all(" elapsed, ETA " in l for l in lines) and lines[-1].endswith("ETA 0:00, cpu:0 at batch 32")


def test_plain_lines_are_throttled_but_the_last_is_written():
    out = io.StringIO()
    with Progress(100, "x", stream=out, every_s=3600.0) as bar:
        for _ in range(100):
            bar.update()
    assert [l.split(",")[0] for l in out.getvalue().splitlines()] == ["x: 1/100 steps", "x: 100/100 steps"]


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_a_terminal_gets_a_bar_unless_plain(monkeypatch):
    monkeypatch.setattr(progress, "_PLAIN", False)
    with Progress(2, "x", stream=_Terminal()) as bar:
        assert bar.bar is not None
    progress.plain()
    with Progress(2, "x", stream=_Terminal()) as bar:
        assert bar.bar is None


def test_json_keeps_stdout_to_the_json(tmp_path):
    r = subprocess.run([sys.executable, "-m", "hetplan", "plan", "--model", "mlp", "--batch", "32", "--topology",
                        "workstation-gtx1650", "--time-limit", "3", "-o", str(tmp_path / "p.json"), "--json"],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["output"] == str(tmp_path / "p.json")
