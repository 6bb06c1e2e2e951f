"""Bad input at the command line: one line naming the file or flag, exit 2, nothing written."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hetplan.planner.files.io import InputError, write_json_atomic

ROOT = Path(__file__).resolve().parent.parent
WORKSTATION = ROOT / "hetplan" / "topologies" / "workstation-gtx1650.json"


def _hetplan(*args, cwd=None):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "hetplan", *map(str, args)], capture_output=True,
                          text=True, env=env, cwd=cwd, timeout=120)


def one_error_line(r, *needles):
    assert r.returncode == 2, r.stderr
    lines = [l for l in r.stderr.splitlines() if "error" in l]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def test_write_json_atomic_refuses_nan_and_unwritable_paths(tmp_path):
    for obj, path, needle in (({"x": float("nan")}, tmp_path / "a.json", "NaN"),
                              ({"x": 1}, tmp_path, "cannot write")):   # a folder
        try:
            write_json_atomic(path, obj)
        except InputError as e:
            assert needle in str(e) and str(path) in str(e)
        else:
            raise AssertionError("expected InputError")
    assert not list(tmp_path.glob("*"))          # nothing half-written
    write_json_atomic(tmp_path / "ok.json", {"x": 1})
    assert (tmp_path / "ok.json").stat().st_mode & 0o044   # readable by others, not 0600


def test_plan_rejects_infinite_lr_and_unwritable_output(tmp_path):
    base = ["plan", "--model", "mlp", "--model-arg", "hidden=16", "--model-arg", "depth=1",
            "--batch", "8", "--topology", WORKSTATION, "--iterations", "5"]
    one_error_line(_hetplan(*base, "--lr", "inf", "-o", tmp_path / "p.json"), "--lr")
    one_error_line(_hetplan(*base, "--time-limit", "nan", "-o", tmp_path / "p.json"), "--time-limit")
    one_error_line(_hetplan(*base, "--chains", "0", "-o", tmp_path / "p.json"), "--chains")
    one_error_line(_hetplan(*base, "--chains", "6", "-o", tmp_path / "p.json"), "--chains", "--iterations (5)")
    one_error_line(_hetplan(*base, "--workers", "0", "-o", tmp_path / "p.json"), "--workers")
    one_error_line(_hetplan(*base, "-o", tmp_path), str(tmp_path), "cannot write")
    assert not list(tmp_path.glob("*"))


def test_plan_file_model_errors_name_the_plan_field(tmp_path):
    plan = {"model": {"spec": "nosuchmodel"}, "global_batch": 4,
            "replicas": [{"batch_fraction": 1.0, "stages": [{"device": "cpu:0", "layers": [0, 3]}]}]}
    path = tmp_path / "p.json"
    path.write_text(json.dumps(plan))
    one_error_line(_hetplan("simulate", path, "--topology", WORKSTATION), str(path), "model.spec")
    plan["model"] = {"spec": "mlp", "args": {"nosucharg": 1}}
    path.write_text(json.dumps(plan))
    one_error_line(_hetplan("simulate", path, "--topology", WORKSTATION), str(path), "model.args")


def test_user_factory_in_the_working_directory(tmp_path):
    (tmp_path / "mymodels.py").write_text(
        "import torch\n"
        "from hetplan.planner.workload import Workload\n"
        "def tiny(width=4):\n"
        "    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, 2))\n"
        "    def make_batch(b, seed):\n"
        "        g = torch.Generator().manual_seed(seed)\n"
        "        return torch.randn(b, width, generator=g), torch.randint(0, 2, (b,), generator=g)\n"
        "    return Workload(model, make_batch, torch.nn.functional.cross_entropy)\n")
    r = _hetplan("graph", "--model", "mymodels:tiny", "--model-arg", "width=8", "--batch", "2", "--json",
                 cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    layers = json.loads(r.stdout)["layers"]
    assert [l["fwd_flops"] for l in layers] == [2 * 2 * 8 * 8, 2 * 2 * 8 * 2]   # 2·B·in·out; bias adds not counted


def test_fifo_huge_batch_and_typo_are_one_line(tmp_path):
    """A FIFO as the plan (must not block), `--batch 10**30` and a typo'd plan field: exit 2 and
    one line each. Broken by: opening before the regular-file check, no batch bound, or a plan
    loader that drops unknown keys (the typo'd plan would simulate with exit 0)."""
    fifo = tmp_path / "plan.json"
    os.mkfifo(fifo)
    one_error_line(_hetplan("simulate", fifo, "--topology", WORKSTATION), str(fifo), "not a regular file")
    one_error_line(_hetplan("graph", "--model", "mlp", "--batch", 10**30), "--batch", "expected an integer in [1, ")
    plan = {"model": {"spec": "mlp"}, "global_batch": 4, "schedul": "gpipe",
            "replicas": [{"batch_fraction": 1.0, "stages": [{"device": "cpu:0", "layers": [0, 3]}]}]}
    path = tmp_path / "typo.json"
    path.write_text(json.dumps(plan))
    one_error_line(_hetplan("simulate", path, "--topology", WORKSTATION), str(path), "did you mean `schedule`?")


GOOD_FACTORY = (
    "import torch\n"
    "from hetplan.planner.workload import Workload\n"
    "def f():\n"
    "    def make_batch(b, seed):\n"
    "        return MAKE\n"
    "    return Workload(torch.nn.Linear(4, 2), make_batch, torch.nn.functional.cross_entropy)\n")


@pytest.mark.parametrize("source,spec,needle", [
    ("raise RuntimeError('no GPU here')\n", "M:f", "importing module 'M' of 'M:f' failed: RuntimeError: no GPU here"),
    ("def f(:\n", "M:f", "importing module 'M' of 'M:f' failed: SyntaxError"),
    ("", ":f", "expected package.module:function"),
    ("def f():\n    raise KeyError('weights')\n", "M:f", "the factory M:f failed: KeyError"),
    (GOOD_FACTORY.replace("MAKE", "1 / 0"), "M:f", "M:f's make_batch(2, 0) failed: ZeroDivisionError"),
    (GOOD_FACTORY.replace("MAKE", "None"), "M:f", "M:f's make_batch(2, 0) returned NoneType; expected (inputs, target)"),
])
def test_user_code_that_fails_is_one_line(tmp_path, monkeypatch, source, spec, needle):
    """A model module or factory that fails names which part failed. Broken by: load.py letting
    the user's exception through (a traceback, exit 1)."""
    from hetplan.planner.workload.load import load_workload
    name = f"usermod_{abs(hash((source, spec))) % 10**8}"     # a fresh module each case
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    spec, needle = spec.replace("M", name), needle.replace("M", name)
    with pytest.raises(InputError) as e:
        w = load_workload(spec)
        w.make_batch(2, 0)
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


STEP_FACTORY = (
    "import torch\n"
    "from hetplan.planner.workload import Workload\n"
    "def f():\n"
    "    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))\n"
    "    def make_batch(b, seed):\n"
    "        g = torch.Generator().manual_seed(seed)\n"
    "        n = ROWS\n"
    "        return torch.randn(n, WIDTH, generator=g), torch.randint(0, 2, (n,), generator=g)\n"
    "    return Workload(model, make_batch, LOSS)\n")


def step_factory(rows="b", width="4", loss="torch.nn.functional.cross_entropy"):
    return STEP_FACTORY.replace("ROWS", rows).replace("WIDTH", width).replace("LOSS", loss)


@pytest.mark.parametrize("source,needle", [
    (step_factory(width="5"), "M:f's forward failed on make_batch(2, 0)'s inputs: RuntimeError: mat1 and mat2"),
    (step_factory(rows="3"), "M:f's make_batch(2, 0) returned inputs of shape (3, 4); expected every tensor "
                             "to lead with the batch size 2"),
    (step_factory(rows="8"), "M:f's make_batch(2, 0) returned inputs of shape (8, 4)"),  # the capture's batch
    (step_factory(rows="2"), "M:f's make_batch(3, 0) returned inputs of shape (2, 4)"),  # the checked one
    (step_factory(loss="lambda o, t: None"), "M:f's loss_fn returned NoneType; expected a floating-point scalar"),
    (step_factory(loss="lambda o, t: torch.nn.functional.cross_entropy(o, t, reduction='none')"),
     "M:f's loss_fn returned a tensor of shape (2,)"),
    (step_factory(loss="lambda o, t: torch.nn.functional.cross_entropy(o, t) * float('nan')"),
     "M:f's loss_fn returned nan on make_batch(2, 0); expected a finite scalar"),
    (step_factory(loss="lambda o, t: torch.tensor(1.0)"), "does not depend on the model's parameters"),
    (step_factory(loss="lambda o, t: 1 / 0"), "M:f's loss_fn failed on the forward's output: ZeroDivisionError"),
])
@pytest.mark.parametrize("weights", [True, False])
def test_one_training_step_is_checked(tmp_path, monkeypatch, source, needle, weights):
    """check_step refuses a model that cannot train one step, in fake tensors (no weights: the
    model as plan builds it for a what-if topology) and on values. Broken by: a forward or loss
    called unguarded (a traceback), a batch size not checked on every tensor, or no real step
    for a small model (the NaN loss passes)."""
    from hetplan.planner.workload.load import load_workload
    from hetplan.planner.workload.step_check import check_step
    name = f"stepmod_{abs(hash(source)) % 10**8}"
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    w = load_workload(f"{name}:f", weights=weights)
    with pytest.raises(InputError) as e:
        check_step(w, 8, "--model", f"{name}:f")
    assert needle.replace("M", name) in str(e.value) and "\n" not in str(e.value), str(e.value)
    check_step(load_workload("mlp", {"hidden": 16, "depth": 1}, weights=weights), 8)   # a good one passes


def test_plan_simulate_and_run_check_the_step(tmp_path):
    """A loss returning None: `plan` exits 2 before writing, `simulate` of a plan naming it exits 2,
    and `run` of that plan exits 2 with the worker's one line (not 'worker failed', exit 1). Broken
    by: plan_problem, simulate_plan_file or hetplan.runtime.stage.check_model not calling check_step, or the
    launcher (or a torchrun worker, exit 1) losing a worker's InputError."""
    (tmp_path / "lossmod.py").write_text(step_factory(loss="lambda o, t: None"))
    out = tmp_path / "plan.json"
    one_error_line(_hetplan("plan", "--model", "lossmod:f", "--batch", "8", "--topology", WORKSTATION,
                            "--iterations", "5", "-o", out, cwd=tmp_path), "--model: lossmod:f's loss_fn returned NoneType")
    assert not out.exists()
    plan = {"schema": "hetplan.plan/1", "model": {"spec": "lossmod:f"}, "global_batch": 4,
            "replicas": [{"batch_fraction": 1.0, "stages": [{"device": "cpu:0", "layers": [0, 3]}]}]}
    out.write_text(json.dumps(plan))
    one_error_line(_hetplan("simulate", out, "--topology", WORKSTATION, cwd=tmp_path),
                   f"{out}: model.spec: lossmod:f's loss_fn returned NoneType")
    measured = tmp_path / "m.json"
    r = _hetplan("run", out, "--iters", "2", "-o", measured, cwd=tmp_path)
    one_error_line(r, f"{out}: model.spec: lossmod:f's loss_fn returned NoneType")
    assert "worker failed" not in r.stderr and not measured.exists()
    env = dict(os.environ, PYTHONPATH=str(ROOT), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT="29531")    # one rank as torchrun starts it
    r = subprocess.run([sys.executable, "-m", "hetplan.runtime.worker", str(out), "-o", str(measured), "--iters", "2"],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    one_error_line(r, f"{out}: model.spec: lossmod:f's loss_fn returned NoneType")
    assert not measured.exists()


def test_plan_at_the_largest_batch_stops_at_its_time_limit(tmp_path):
    """`plan --batch 1048576 --time-limit 2` on a tiny model: the search ends within a second or
    two of its limit, and --batch 10**9 is refused at once. Broken by: anything the search
    enumerates up to the batch (microbatch counts were: 25 s of a 2 s limit)."""
    import re
    import time
    out = tmp_path / "p.json"
    t0 = time.monotonic()
    r = _hetplan("plan", "--model", "mlp", "--model-arg", "hidden=16", "--model-arg", "depth=1", "--batch", 2**20,
                 "--time-limit", "2", "--topology", ROOT / "hetplan" / "topologies" / "dgx-8gpu.json", "-o", out)
    assert r.returncode == 0 and out.exists(), r.stderr
    searched = float(re.search(r"simulations in ([0-9.]+) s", r.stdout).group(1))
    assert searched < 4.0 and time.monotonic() - t0 < 90, (searched, r.stdout)
    one_error_line(_hetplan("plan", "--model", "mlp", "--batch", 10**9, "--time-limit", "2", "--topology",
                            WORKSTATION, "-o", tmp_path / "q.json"), "--batch", "expected an integer in [1, 1048576]")


def test_run_refuses_plan_devices_the_topology_lacks(tmp_path):
    """`run --topology T` of a plan on cpu:7, which T does not have: exit 2 naming the stage's
    device, before any worker starts (no measured file), as `simulate` refuses it. Broken by: run
    reading T for thread shares only (it ran the plan, exit 0)."""
    plan = {"model": {"spec": "mlp", "args": {"hidden": 16, "depth": 1}}, "global_batch": 4,
            "replicas": [{"batch_fraction": 1.0, "stages": [{"device": "cpu:7", "layers": [0, 3]}]}]}
    path, measured = tmp_path / "p.json", tmp_path / "m.json"
    path.write_text(json.dumps(plan))
    for command in (["simulate", path], ["run", path, "--iters", "2", "-o", measured]):
        one_error_line(_hetplan(*command, "--topology", WORKSTATION), f"{path}: replicas[0].stages[0].device",
                       "expected a device of the topology (cpu:0, cuda:0), got 'cpu:7'")
    assert not measured.exists()


def _topology(tmp_path, name, devices, links, memory_bytes=4e9):
    gpu = {"kind": "cuda", "memory_bytes": memory_bytes, "matmul_flops_per_s": 2.9e12,
           "memory_bytes_per_s": 1.28e11, "op_overhead_s": 1e-5}
    t = {"schema": "hetplan.topology/1", "name": name, "devices": [dict(gpu, name=d) for d in devices],
         "links": [{"a": a, "b": b, "bandwidth_bytes_per_s": 1.2e10, "latency_s": 1e-5} for a, b in links]}
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(t))
    return path


def test_a_device_without_links_is_planned_around(tmp_path):
    """cuda:2 has no link: the baselines that need it are infeasible (null in the file, never
    chosen), the plan uses the linked devices; with every baseline infeasible (each GPU too small
    for the model, cuda:2 unreachable) the search's plan over cuda:0 and cuda:1 is still
    written; with nothing feasible at all, one line, exit 2. Broken by: an infinite baseline
    time reaching the file ("a value is NaN or infinite", nothing written)."""
    base = ["plan", "--model", "mlp", "--batch", "64", "--iterations", "300"]
    linked = _topology(tmp_path, "linked", ["cuda:0", "cuda:1", "cuda:2"], [("cuda:0", "cuda:1")])
    out = tmp_path / "p.json"
    r = _hetplan(*base, "--topology", linked, "-o", out)
    assert r.returncode == 0, r.stderr
    plan = json.loads(out.read_text())
    assert "cuda:2" not in json.dumps(plan["replicas"])
    baselines = {b["name"]: b for b in plan["predicted"]["baselines"]}
    assert baselines["data parallel, equal shares"] == {"name": "data parallel, equal shares", "iteration_s": None,
                                                         "feasible": False, "peak_memory_bytes": {}}
    assert baselines["fastest single device (cuda:0)"]["feasible"]
    # the mlp at batch 64 peaks at 66 MB on one GPU, 31 + 35 MB as a pipeline of two: 45 MB fits only that
    small = _topology(tmp_path, "small", ["cuda:0", "cuda:1", "cuda:2"], [("cuda:0", "cuda:1")], memory_bytes=45e6)
    out.unlink()
    r = _hetplan(*base, "--topology", small, "-o", out)
    assert r.returncode == 0, r.stderr
    plan = json.loads(out.read_text())
    assert not any(b["feasible"] for b in plan["predicted"]["baselines"])
    used = json.dumps(plan["replicas"])
    assert "cuda:0" in used and "cuda:1" in used and "cuda:2" not in used    # a pipeline or a tensor split
    out.unlink()
    alone = _topology(tmp_path, "alone", ["cuda:0", "cuda:1"], [], memory_bytes=45e6)
    one_error_line(_hetplan(*base, "--topology", alone, "-o", out), f"{alone}: devices: ")
    assert not out.exists()


def test_a_huge_horizon_is_refused_not_emulated(tmp_path):
    """`--horizon 10**9` with --objective time-to-loss: exit 2 naming --horizon, nothing written.
    Broken by: the emulation looping to the flag's number (hours)."""
    out = tmp_path / "p.json"
    one_error_line(_hetplan("plan", "--model", "mlp", "--model-arg", "hidden=16", "--model-arg", "depth=1",
                            "--batch", "8", "--topology", WORKSTATION, "--iterations", "20", "--objective",
                            "time-to-loss", "--target-loss", "1", "--horizon", 10**9, "-o", out),
                   "--horizon: expected an integer from 16 to 10000 iterations, got 1000000000")
    assert not out.exists()


@pytest.mark.parametrize("flags,needle", [
    (("--horizon", "50"), "--horizon: applies only with --objective time-to-loss"),
    (("--optimizer", ""), "--optimizer: expected sgd, adam or a torch.optim class"),
])
def test_plan_refuses_flags_it_would_ignore(tmp_path, flags, needle):
    out = tmp_path / "p.json"
    one_error_line(_hetplan("plan", "--model", "mlp", "--batch", "8", "--topology", WORKSTATION, *flags,
                            "-o", out), needle)
    assert not out.exists()
