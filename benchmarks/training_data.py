"""Training on data against timing synthetic batches, and checkpoint save / load times.

For a data-parallel plan and a two-stage pipeline on two CPU workers: the median step of
`run --steps` reading an in-memory dataset (a map-style dataset whose items are tensor views,
collated by default_collate on the prefetch thread) against the median iteration of
`run --iters` on make_batch, alternated `--repeats` times; target: the ratio <= 1.05 (loading
overlapped). Then one checkpoint's save and load time (torch.distributed.checkpoint) of each.

    python benchmarks/training_data.py [--repeats 3] [--steps 40] [--hidden 1024] [--batch 256]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
import benchmarks.paths  # noqa: E402,F401  (the commands it starts import benchmarks.* too)


class InMemory(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.x, self.y = torch.randn(n, 784, generator=g), torch.randint(0, 10, (n,), generator=g)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def data_mlp(hidden: int = 1024, depth: int = 4, n: int = 16384):
    from hetplan.planner.workload.builtin import mlp
    w = mlp(hidden=hidden, depth=depth)
    w.train_data = InMemory(n)
    return w


def plans(hidden: int, depth: int, batch: int) -> dict[str, dict]:
    model = {"spec": "benchmarks.training_data:data_mlp", "args": {"hidden": hidden, "depth": depth}}
    L = depth + 1
    base = {"schema": "hetplan.plan/1", "model": model, "global_batch": batch,
            "optimizer": {"name": "adam", "lr": 1e-3}, "sync": {"granularity": "fine"}}
    return {
        "data-parallel": {**base, "replicas": [
            {"batch_fraction": 0.5, "microbatches": 1, "stages": [{"device": "cpu:0", "layers": [0, L]}]},
            {"batch_fraction": 0.5, "microbatches": 1, "stages": [{"device": "cpu:1", "layers": [0, L]}]}]},
        "pipeline": {**base, "schedule": "1f1b", "replicas": [
            {"batch_fraction": 1.0, "microbatches": 4, "stages": [
                {"device": "cpu:0", "layers": [0, L // 2]}, {"device": "cpu:1", "layers": [L // 2, L]}]}]},
    }


def run(path: Path, steps: int, data: bool, ck: str | None = None, resume: bool = False) -> dict:
    from hetplan.planner.files.plan import load_plan
    from hetplan.runtime.launch import launch
    from hetplan.runtime.train import TrainConfig
    from hetplan.runtime.worker import RunConfig
    train = TrainConfig(steps=steps, log_every=steps, checkpoint_dir=ck, checkpoint_every=steps if ck else None,
                        resume=resume).to_dict() if data else None
    cfg = RunConfig(plan=str(path), iters=steps, warmup=min(5, steps - 1), timeout_s=120, train=train,
                    threads={"cpu:0": 1, "cpu:1": 1})
    return launch(cfg, load_plan(path).devices)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch", type=int, default=256)
    a = p.parse_args(argv)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, plan in plans(a.hidden, a.depth, a.batch).items():
            path = Path(tmp) / f"{name}.json"
            path.write_text(json.dumps(plan))
            ratios, synth, real = [], [], []
            for _ in range(a.repeats):                         # alternated: synthetic, then data
                s = run(path, a.steps, data=False)["iteration_s"]
                d = statistics.median(run(path, a.steps, data=True)["iterations_s"][5:])
                synth.append(s), real.append(d), ratios.append(d / s)
            ck = str(Path(tmp) / f"ck-{name}")
            saved = run(path, 2, data=True, ck=ck)
            loaded = run(path, 3, data=True, ck=ck, resume=True)
            out[name] = {"synthetic_ms": [round(x * 1e3, 2) for x in synth],
                         "data_ms": [round(x * 1e3, 2) for x in real],
                         "ratio_median": round(statistics.median(ratios), 3),
                         "ratio_spread": [round(min(ratios), 3), round(max(ratios), 3)],
                         "checkpoint_save_s": round(saved["checkpoint_save_s"][0], 3),
                         "checkpoint_load_s": round(loaded["checkpoint_load_s"], 3)}
            print(f"{name}: data / synthetic {out[name]['ratio_median']:.3f}x (spread "
                  f"{out[name]['ratio_spread'][0]:.3f}-{out[name]['ratio_spread'][1]:.3f}; synthetic "
                  f"{out[name]['synthetic_ms']} ms, data {out[name]['data_ms']} ms); checkpoint save "
                  f"{out[name]['checkpoint_save_s']:.3f} s, load {out[name]['checkpoint_load_s']:.3f} s", flush=True)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
