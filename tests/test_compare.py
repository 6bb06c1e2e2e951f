"""`hetplan compare`: the comparison arithmetic (hetplan/planner/files/report.py) and a real tiny run end to end."""
from __future__ import annotations

import json

import pytest

from hetplan.cli import main as cli_main
from hetplan.planner.files.measured import Measured
from hetplan.planner.files.report import compare, error_pct, measured_phases, table_rows

TOPOLOGY = {"schema": "hetplan.topology/1", "name": "two-cpu what-if", "devices": [
    {"name": f"cpu:{i}", "kind": "cpu", "threads": 1, "memory_bytes": 4e9, "matmul_flops_per_s": 2e10,
     "memory_bytes_per_s": 5e9, "op_overhead_s": 2e-5} for i in range(2)],
    "links": [{"a": "cpu:0", "b": "cpu:1", "bandwidth_bytes_per_s": 2e9, "latency_s": 5e-5}]}


# --- the arithmetic ------------------------------------------------------------------------------
def test_error_pct_sign_and_missing():
    assert error_pct(3.0, 2.0) == 50.0          # predicted too slow: positive
    assert error_pct(1.0, 4.0) == -75.0         # optimistic: negative
    assert error_pct(None, 1.0) is None and error_pct(1.0, None) is None and error_pct(1.0, 0) is None


def test_compare_rows_from_hand_made_inputs():
    sim = {"iteration_s": 0.004, "per_device": {
        "cpu:0": {"busy_s": 0.003, "fwd_s": 0.001, "bwd_s": 0.0015, "optimizer_s": 0.0005,
                  "peak_memory_bytes": 1e6},
        "cpu:1": {"busy_s": 0.002, "fwd_s": 0.0005, "bwd_s": 0.001, "optimizer_s": 0.0005,
                  "peak_memory_bytes": 2e6}}}
    events = [{"name": "F0", "kind": "forward", "start_s": 0.0, "end_s": 0.002},
              {"name": "recv grad 0", "kind": "transfer", "start_s": 0.002, "end_s": 0.003},
              {"name": "B0", "kind": "backward", "start_s": 0.003, "end_s": 0.006},
              {"name": "optimizer", "kind": "optimizer", "start_s": 0.006, "end_s": 0.0065}]
    assert measured_phases(events) == pytest.approx({"forward": 0.002, "backward": 0.003, "optimizer": 0.0005})
    m = Measured(plan_sha256="x", iterations_s=(0.01, 0.008), iteration_s=0.008,
                 per_device={"cpu:0": {"busy_s": 0.006, "peak_memory_bytes": 4e6, "events": events},
                             "cpu:2": {"busy_s": 0.001, "peak_memory_bytes": 1}})
    c = compare(0.005, sim, m, plan_matches=True)
    assert (c.predicted_s, c.simulated_s, c.prediction_source) == (0.005, 0.004, "plan")
    assert c.error_pct == pytest.approx(-37.5)                      # 100 * (5 - 8) / 8
    j = c.to_json()
    assert list(j["per_device"]) == ["cpu:0", "cpu:1", "cpu:2"]      # simulated order, then measured-only
    d0 = j["per_device"]["cpu:0"]
    assert d0["busy_error_pct"] == pytest.approx(-50.0)             # 100 * (3 - 6) / 6
    assert d0["memory_error_pct"] == pytest.approx(-75.0)
    assert d0["phases"]["forward"]["error_pct"] == pytest.approx(-50.0)   # 1 ms vs 2 ms
    assert d0["phases"]["backward"]["error_pct"] == pytest.approx(-50.0)
    assert d0["phases"]["optimizer"]["error_pct"] == pytest.approx(0.0)
    assert j["per_device"]["cpu:1"]["measured_busy_s"] is None      # not measured: no error
    assert j["per_device"]["cpu:1"]["busy_error_pct"] is None and "phases" not in j["per_device"]["cpu:1"]
    assert j["per_device"]["cpu:2"]["predicted_busy_s"] is None
    rows = table_rows(c)
    assert [r["quantity"] for r in rows[:2]] == ["iteration", "iteration (simulated now)"]
    assert rows[0]["predicted"] == pytest.approx(5.0) and rows[0]["measured"] == pytest.approx(8.0)
    assert compare(None, sim, m, True).prediction_source == "simulator"
    assert compare(None, sim, m, True).predicted_s == 0.004


# --- a real run --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def run_files(tmp_path_factory):
    """A two-stage pipeline of a tiny MLP on cpu:0 and cpu:1, run for 3 iterations with gloo."""
    from hetplan.planner.files.io import file_sha256
    d = tmp_path_factory.mktemp("compare")
    topo = d / "topo.json"
    topo.write_text(json.dumps(TOPOLOGY))
    plan = {"schema": "hetplan.plan/1", "model": {"spec": "mlp", "args": {"hidden": 64}}, "global_batch": 16,
            "topology": {"name": TOPOLOGY["name"], "sha256": file_sha256(topo)},
            "replicas": [{"batch_fraction": 1.0, "microbatches": 2,
                          "stages": [{"device": "cpu:0", "layers": [0, 3]}, {"device": "cpu:1", "layers": [3, 5]}]}],
            "schedule": "1f1b", "sync": {"granularity": "fine", "bucket_bytes": 1 << 20},
            "optimizer": {"name": "adam", "lr": 1e-3, "placement": "device"},
            "predicted": {"iteration_s": 0.0025, "peak_memory_bytes": {"cpu:0": 1e6, "cpu:1": 1e5}}}
    plan_path = d / "plan.json"
    plan_path.write_text(json.dumps(plan, indent=1))
    measured = d / "measured.json"
    assert cli_main(["run", str(plan_path), "--iters", "3", "--warmup", "1", "-o", str(measured),
                     "--topology", str(topo)]) == 0
    return d, plan_path, measured, topo


def _json_out(capsys, argv) -> dict:
    capsys.readouterr()
    assert cli_main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_compare_json_on_a_real_run(run_files, capsys):
    d, plan, measured, topo = run_files
    got = _json_out(capsys, ["compare", str(plan), str(measured), "--topology", str(topo), "--json"])
    sim = _json_out(capsys, ["simulate", str(plan), "--topology", str(topo), "--json"])
    m = json.loads(measured.read_text())
    assert got["predicted_s"] == 0.0025 and got["prediction_source"] == "plan"   # recorded in the plan
    assert got["measured_s"] == m["iteration_s"]
    assert got["error_pct"] == 100 * (0.0025 - m["iteration_s"]) / m["iteration_s"]
    assert got["simulated_s"] == sim["iteration_s"] and got["plan_matches"] is True
    assert set(got["per_device"]) == {"cpu:0", "cpu:1"}
    for dev, v in got["per_device"].items():
        pred, meas = sim["per_device"][dev]["busy_s"], m["per_device"][dev]["busy_s"]
        assert (v["predicted_busy_s"], v["measured_busy_s"]) == (pred, meas)
        assert v["busy_error_pct"] == 100 * (pred - meas) / meas
        assert v["predicted_peak_memory_bytes"] == sim["per_device"][dev]["peak_memory_bytes"]
        assert v["measured_peak_memory_bytes"] == m["per_device"][dev]["peak_memory_bytes"]
        # the runtime recorded the last iteration's spans: both microbatches forward and backward
        names = [e["name"] for e in m["per_device"][dev]["events"]]
        assert {"F0", "F1", "B0", "B1", "optimizer"} <= set(names), names
        assert m["per_device"][dev]["events_iteration"] == 2
        for e in m["per_device"][dev]["events"]:     # within this rank's own iteration
            assert 0 <= e["start_s"] <= e["end_s"] <= m["per_device"][dev]["iterations_s"][2] * 1.01 + 1e-3
        assert set(v["phases"]) == {"forward", "backward", "optimizer"}
    assert sum(e["end_s"] - e["start_s"] for e in m["per_device"]["cpu:0"]["events"]
               if e["kind"] != "transfer" and e["kind"] != "allreduce") == pytest.approx(
        m["per_device"]["cpu:0"]["busy_per_iteration_s"][2], rel=1e-6)


def test_compare_table_and_plot(run_files, capsys):
    d, plan, measured, topo = run_files
    png = d / "timeline.png"
    capsys.readouterr()
    assert cli_main(["compare", str(plan), str(measured), "--topology", str(topo), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("iteration: predicted 2.500 ms (recorded in the plan)")
    assert "peak memory" in out and "cpu:1" in out
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and 5_000 < len(data) < 300_000
    assert not list(d.glob(".*tmp*"))


def test_compare_warns_when_measured_for_another_plan(run_files, tmp_path, capsys):
    d, plan, measured, topo = run_files
    other = tmp_path / "other.json"
    other.write_text(plan.read_text() + "\n")          # same plan, different bytes
    capsys.readouterr()
    assert cli_main(["compare", str(other), str(measured), "--topology", str(topo), "--json"]) == 0
    io = capsys.readouterr()
    assert "warning" in io.err and "measured for another plan file" in io.err
    assert json.loads(io.out)["plan_matches"] is False


@pytest.mark.parametrize("measured,expect", [
    (None, "missing.json: measured file not found"),
    ({"schema": "hetplan.measured/1", "plan_sha256": "x", "iterations_s": [0.1], "iteration_s": -1},
     "iteration_s: expected a positive number"),
    ({"schema": "hetplan.plan/1"}, "schema: expected 'hetplan.measured/1'"),
    ({"schema": "hetplan.measured/1", "plan_sha256": "x", "iterations_s": ["a"], "iteration_s": 1},
     "iterations_s[0]: expected a non-negative number"),
])
def test_bad_measured_file_one_line_exit_2(run_files, tmp_path, capsys, measured, expect):
    d, plan, _, topo = run_files
    path = tmp_path / "missing.json"
    if measured is not None:
        path = tmp_path / "bad.json"
        path.write_text(json.dumps(measured))
    capsys.readouterr()
    assert cli_main(["compare", str(plan), str(path), "--topology", str(topo)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expect in err and err.startswith("hetplan compare: error:"), err


def test_plot_must_be_png(run_files, capsys):
    d, plan, measured, topo = run_files
    assert cli_main(["compare", str(plan), str(measured), "--topology", str(topo), "--plot", str(d / "x.svg")]) == 2
    assert "--plot: expected a file name ending in .png" in capsys.readouterr().err


def test_plan_without_topology_needs_flag(run_files, tmp_path, capsys):
    d, plan, measured, _ = run_files
    p = json.loads(plan.read_text())
    del p["topology"]
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps(p))
    assert cli_main(["compare", str(bare), str(measured)]) == 2
    assert "topology: the plan names no topology; pass --topology FILE" in capsys.readouterr().err
