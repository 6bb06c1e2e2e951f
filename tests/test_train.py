"""Training with a plan on the workload's data (hetplan.runtime.train, `hetplan run --steps`, hetplan.train):
plans train like one device with AdamW, clipping and an LR schedule; a stopped or killed run resumed
from its checkpoint ends with the uninterrupted run's parameters, also under another plan; an epoch
reads every sample once; bad input is one line and exit 2 with nothing written."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from equivalence import AdamSlack, Trained, assert_params_match
from hetplan.planner.files.plan import load_plan
from hetplan.runtime.launch import RunError, launch
from hetplan.runtime.train import TrainConfig
from hetplan.runtime.worker import FAULT_ENV, RunConfig
from test_cli_inputs import one_error_line

ROOT = Path(__file__).resolve().parent.parent
MODEL = {"spec": "tests.runtime_models:mlp_data", "args": {}}   # mlp 784-16-16-16-10 on 60 samples
G = 12                                                         # 5 steps an epoch
PLANS = {
    "dp-unequal": [(0.25, 1, [("cpu:0", (0, 4))]), (0.75, 3, [("cpu:1", (0, 4))])],
    "pipeline": [(1.0, 2, [("cpu:0", (0, 2)), ("cpu:1", (2, 4))])],
    "hybrid": [(0.25, 1, [("cpu:0", (0, 4))]), (0.75, 3, [("cpu:1", (0, 2)), ("cpu:2", (2, 4))])],
}


def plan(replicas, optimizer=None, model=MODEL) -> dict:
    return {"schema": "hetplan.plan/1", "model": model, "global_batch": G,
            "replicas": [{"batch_fraction": f, "microbatches": m,
                          "stages": [{"device": d, "layers": list(r)} for d, r in stages]}
                         for f, m, stages in replicas],
            "sync": {"granularity": "fine", "bucket_bytes": 1024},
            "optimizer": optimizer or {"name": "adam", "lr": 0.01}}


def train(tmp_path: Path, p: dict, name: str = "run", **train_args) -> tuple[list[dict], dict]:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(p))
    params = tmp_path / f"{name}.pt"
    cfg = RunConfig(plan=str(path), save_params=str(params), timeout_s=30,
                    train=TrainConfig(log_every=1, **train_args).to_dict())
    result = launch(cfg, load_plan(path).devices)
    return result["rows"], torch.load(params)


def reference(steps: int, optimizer: dict, schedule=None, clip=None, seed: int = 0) -> Trained:
    """One process on the whole global batch of each step, the same shuffles."""
    from hetplan.runtime.data import DataFeed
    from hetplan.runtime.lr_schedule import factor
    from tests.runtime_models import mlp_data
    torch.manual_seed(0)
    w = mlp_data()
    feed = DataFeed(w.train_data, G, seed)
    cls = getattr(torch.optim, optimizer.get("torch_class", "Adam"))
    o = cls(w.model.parameters(), lr=optimizer["lr"], **optimizer.get("args", {}))
    slack, losses = AdamSlack(o, dict(w.model.named_parameters())), []
    for s in range(steps):
        for g in o.param_groups:
            g["lr"] = optimizer["lr"] * (factor(s, steps, *schedule) if schedule else 1.0)
        x, y = feed(G, s)
        o.zero_grad()
        loss = w.loss_fn(w.model(x), y)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(w.model.parameters(), clip)
        o.step()
        slack.after_step()
        losses.append(loss.item())
    return Trained(losses, {n: t.detach().clone() for n, t in w.model.named_parameters()}, slack.slack)


def test_hybrid_trains_like_one_device_with_adamw_clipping_and_a_cosine_schedule(tmp_path):
    opt = {"name": "adam", "lr": 0.01, "torch_class": "AdamW", "args": {"weight_decay": 0.1},
           "clip_grad_norm": 0.5}
    rows, params = train(tmp_path, plan(PLANS["hybrid"], opt), steps=7, lr_schedule="cosine", warmup_steps=2)
    ref = reference(7, opt, schedule=("cosine", 2, 0.0), clip=0.5)
    assert [r["step"] for r in rows] == list(range(1, 8))
    assert [r["loss"] for r in rows] == pytest.approx(ref.losses, rel=1e-5)
    assert all(r["grad_norm"] > 0.5 for r in rows)            # every step clipped
    assert rows[0]["lr"] == pytest.approx(0.005) and rows[-1]["lr"] < 0.001
    assert_params_match(params, ref, rtol=1e-5, atol=1e-5)


def assert_resumed_equals_uninterrupted(tmp_path: Path, p: dict) -> None:
    """6 steps in one run against 3, a checkpoint, and 3 more resumed from it: the same parameters."""
    _, whole = train(tmp_path, p, "whole", steps=6)
    ck = str(tmp_path / "ck")
    train(tmp_path, p, "first", steps=3, checkpoint_dir=ck, checkpoint_every=3)
    rows, resumed = train(tmp_path, p, "second", steps=6, checkpoint_dir=ck, resume=True)
    assert [r["step"] for r in rows] == [4, 5, 6]
    for n, t in whole.items():
        torch.testing.assert_close(resumed[n], t, rtol=1e-6, atol=0, msg=n)


@pytest.mark.parametrize("name", sorted(PLANS))
def test_stopped_then_resumed_equals_uninterrupted(tmp_path, name):
    assert_resumed_equals_uninterrupted(tmp_path, plan(PLANS[name]))


@pytest.mark.parametrize("name", sorted(PLANS))
def test_sigkilled_runs_resume_from_the_last_complete_checkpoint(tmp_path, monkeypatch, name):
    p, ck = plan(PLANS[name]), str(tmp_path / "ck")
    _, whole = train(tmp_path, p, "whole", steps=7)
    monkeypatch.setenv(FAULT_ENV, "1:5:kill")                   # rank 1 killed after step 5
    with pytest.raises(RunError, match="rank 1 .*signal 9"):
        train(tmp_path, p, "a", steps=7, checkpoint_dir=ck, checkpoint_every=2)
    monkeypatch.setenv(FAULT_ENV, "0:6:kill-in-save")           # rank 0 killed inside step 6's save
    with pytest.raises(RunError, match="rank 0 .*signal 9"):
        train(tmp_path, p, "b", steps=7, checkpoint_dir=ck, checkpoint_every=2, resume=True)
    names = sorted(x.name for x in Path(ck).iterdir())
    assert names == [".step-00000006.partial", "step-00000002", "step-00000004"]
    monkeypatch.delenv(FAULT_ENV)
    rows, resumed = train(tmp_path, p, "c", steps=7, checkpoint_dir=ck, resume=True)
    assert [r["step"] for r in rows] == [5, 6, 7]
    for n, t in whole.items():
        torch.testing.assert_close(resumed[n], t, rtol=1e-6, atol=0, msg=n)


def test_a_checkpoint_of_one_plan_resumes_under_another(tmp_path):
    ck = str(tmp_path / "ck")
    train(tmp_path, plan(PLANS["dp-unequal"]), "a", steps=3, checkpoint_dir=ck, checkpoint_every=3)
    rows, params = train(tmp_path, plan(PLANS["pipeline"]), "b", steps=7, checkpoint_dir=ck, resume=True)
    ref = reference(7, {"name": "adam", "lr": 0.01})
    assert [r["loss"] for r in rows] == pytest.approx(ref.losses[3:], rel=1e-5)
    assert_params_match(params, ref, rtol=1e-5, atol=1e-5)


def test_an_epoch_reads_every_sample_once_across_the_replicas(tmp_path):
    log = tmp_path / "reads.txt"
    p = plan(PLANS["hybrid"], model={**MODEL, "args": {"log": str(log)}})
    rows, _ = train(tmp_path, p, epochs=1)
    assert [r["epoch"] for r in rows] == [0] * 5
    reads: dict[str, list[int]] = {}
    for line in log.read_text().split("\n"):
        if line and not line.startswith("-"):                  # the launcher's own check reads "-"
            rank, i = line.split()
            reads.setdefault(rank, []).append(int(i))
    # ranks 0 and 1 take inputs (replica 0, replica 1's first stage), rank 2 replica 1's targets
    assert sorted(reads["0"] + reads["1"]) == list(range(60))
    assert sorted(reads["2"]) == sorted(reads["1"]) and len(reads["0"]) == 5 * 3


def test_eval_rows_hold_loss_and_the_workloads_metrics(tmp_path):
    rows, _ = train(tmp_path, plan(PLANS["hybrid"]), steps=4, eval_every=2)
    evals = [r for r in rows if "eval_loss" in r]
    assert [r["step"] for r in evals] == [2, 4]
    assert all(0 <= r["eval_accuracy"] <= 1 and math.isfinite(r["eval_loss"]) for r in evals)


def _hetplan(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "hetplan", *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, timeout=120)


def test_bad_training_input_is_one_line_exit_2_and_writes_nothing(tmp_path):
    good = tmp_path / "p.json"
    good.write_text(json.dumps(plan(PLANS["dp-unequal"])))

    def with_args(**args):
        f = tmp_path / f"p{len(list(tmp_path.glob('p*.json')))}.json"
        f.write_text(json.dumps(plan(PLANS["dp-unequal"], model={**MODEL, "args": args})))
        return f
    out = ["--metrics", tmp_path / "m.jsonl", "-o", tmp_path / "measured.json"]
    one_error_line(_hetplan("run", good, "--steps", 2, "--epochs", 1, *out), "--steps, --epochs")
    one_error_line(_hetplan("run", with_args(n=0), "--steps", 2, *out), "train_data", "empty")
    one_error_line(_hetplan("run", with_args(n=5), "--steps", 2, *out), "train_data", "global_batch 12")
    one_error_line(_hetplan("run", with_args(features=10), "--steps", 2, *out), "train_data", "do not fit")
    one_error_line(_hetplan("run", good, "--steps", 2, "--resume", "--checkpoint-dir", tmp_path / "none", *out),
                   "--resume", "no complete checkpoint")
    ck = tmp_path / "ck"
    assert _hetplan("run", good, "--steps", 2, "--checkpoint-dir", ck, "--checkpoint-every", 2).returncode == 0
    one_error_line(_hetplan("run", with_args(hidden=8), "--steps", 4, "--resume", "--checkpoint-dir", ck, *out),
                   "hetplan.json: model", "expected the plan's")
    (ck / "step-00000002" / "hetplan.json").write_text("{not json")
    one_error_line(_hetplan("run", good, "--steps", 4, "--resume", "--checkpoint-dir", ck, *out),
                   "step-00000002/hetplan.json", "not a readable checkpoint")
    assert not (tmp_path / "m.jsonl").exists() and not (tmp_path / "measured.json").exists()


def test_a_script_trains_with_hetplan_train_under_torchrun(tmp_path):
    pytest.importorskip("sklearn")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                        "examples/train_digits.py", "--out", str(tmp_path), "--epochs", "3"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 3 * (1500 // 64) and rows[-1]["eval_accuracy"] > 0.8
    params = torch.load(tmp_path / "params.pt")
    sys.path.insert(0, str(ROOT / "examples"))
    from train_digits import digits
    digits().model.load_state_dict(params)        # the model's own state_dict keys


def test_a_cpu_and_gpu_pipeline_trains_on_data_and_resumes(tmp_path, gpu):
    # the GPU stage takes the targets (pinned on a real GPU), clips, steps its optimizer on the host
    # (placement cpu: master copies) and checkpoints through the host
    opt = {"name": "adam", "lr": 0.01, "clip_grad_norm": 0.5, "placement": "cpu"}
    p = plan([(1.0, 2, [("cpu:0", (0, 2)), ("cuda:0", (2, 4))])], opt)
    ck = str(tmp_path / "ck")
    train(tmp_path, p, "a", steps=3, checkpoint_dir=ck, checkpoint_every=3, eval_every=3)
    rows, params = train(tmp_path, p, "b", steps=5, checkpoint_dir=ck, resume=True)
    ref = reference(5, opt, clip=0.5)
    tol = 1e-5 if gpu == "standin" else 1e-3
    assert [r["loss"] for r in rows] == pytest.approx(ref.losses[3:], rel=tol)
    assert_params_match(params, ref, rtol=tol, atol=tol)


def test_torchrun_workers_take_the_training_flags(tmp_path):
    p = tmp_path / "p.json"
    p.write_text(json.dumps(plan(PLANS["dp-unequal"])))
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m",
                        "hetplan.runtime.worker", str(p), "-o", str(tmp_path / "out.json"), "--steps", "4",
                        "--log-every", "2", "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "4"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads((tmp_path / "out.json").read_text())
    assert [row["step"] for row in out["rows"]] == [2, 4]
    assert out["rows"][-1]["loss"] == pytest.approx(reference(4, {"name": "adam", "lr": 0.01}).losses[3], rel=1e-5)
    assert (tmp_path / "ck" / "step-00000004" / "hetplan.json").is_file()
    bad = subprocess.run([sys.executable, "-m", "hetplan.runtime.worker", str(p), "--steps", "2", "--epochs", "1"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--steps, --epochs" in bad.stderr
