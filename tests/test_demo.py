"""`hetplan demo --quick` end to end on a tiny workload, in a temporary directory."""
from __future__ import annotations

import json

import pytest

from hetplan.cli import main as cli_main


def test_demo_quick_end_to_end(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HETPLAN_CACHE_DIR", str(tmp_path / "cache"))   # measured layer costs
    profile, out = tmp_path / "profiles" / "here.json", tmp_path / "demo"
    argv = ["demo", "--quick", "--model", "mlp", "--model-arg", "hidden=64", "--batch", "16",
            "--iters", "3", "--cpu-workers", "2", "--profile", str(profile), "--out", str(out), "--json"]
    assert cli_main(argv) == 0
    io = capsys.readouterr()
    got = json.loads(io.out)                       # --json: one object on stdout, the rest on stderr
    assert profile.exists()                        # profiled because no profile existed
    assert "hetplan profile" in io.err and "hetplan plan" in io.err and "hetplan run" in io.err
    assert json.loads((out / "summary.json").read_text()) == got
    plan = json.loads((out / "plan.json").read_text())
    names = [b["name"] for b in plan["predicted"]["baselines"] if b["feasible"]]
    assert got["baseline_name"] in names
    runs = ["plan"] + ([] if got["baseline_is_plan"] else ["baseline"])
    for label in runs:
        r = got["runs"][label]
        assert (out / f"{label}.measured.json").exists() and (out / f"{label}.png").exists()
        m = json.loads((out / f"{label}.measured.json").read_text())
        assert r["measured_s"] == m["iteration_s"]
        assert r["error_pct"] == pytest.approx(100 * (r["predicted_s"] - m["iteration_s"]) / m["iteration_s"])
    assert set(got["runs"]) == set(runs)
    plan_r, base_r = got["runs"]["plan"], got["runs"].get("baseline", got["runs"]["plan"])
    assert got["measured_speedup"] == pytest.approx(base_r["measured_s"] / plan_r["measured_s"])
    assert got["predicted_speedup"] == pytest.approx(base_r["predicted_s"] / plan_r["predicted_s"])
    if not got["baseline_is_plan"]:
        b = json.loads((out / "baseline.json").read_text())
        assert b["predicted"]["baseline"] == got["baseline_name"]


@pytest.mark.parametrize("argv,expect", [
    (["--batch", "0"], "--batch: expected an integer in [1, "),
    (["--iters", "1"], "--iters: expected an integer >= 2"),
    (["--iters", "3", "--warmup", "3"], "--warmup: expected an integer in [0, --iters)"),
])
def test_demo_bad_flags(tmp_path, capsys, argv, expect):
    assert cli_main(["demo", "--out", str(tmp_path / "o"), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expect in err, err


def test_demo_out_must_be_a_directory(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    assert cli_main(["demo", "--out", str(f)]) == 2
    assert "--out: expected a directory" in capsys.readouterr().err
