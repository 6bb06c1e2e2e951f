"""Train a model defined in this script on scikit-learn's handwritten digits (shipped inside the
package: nothing is downloaded) with a hetplan plan, from Python.

    torchrun --nproc_per_node 2 examples/train_digits.py      # two CPU workers, unequal shares
    python examples/train_digits.py --plan PLAN.json           # a one-device plan of yours

Without --plan it writes a data-parallel plan over cpu:0 and cpu:1 (40 % / 60 % of each batch of
64) to --out and trains it with AdamW, a cosine schedule and clipping; the eval rows report
accuracy on 297 held-out digits. `hetplan plan --model __main__:digits` cannot import this file:
plan it as `--model train_digits:digits` from this directory instead.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import hetplan
from hetplan.planner.workload import Workload


class Digits(torch.utils.data.Dataset):
    """8x8 images as 64 features scaled to [0, 1], and their digit; samples [a, b) of the 1,797."""

    def __init__(self, a: int, b: int):
        from sklearn.datasets import load_digits
        d = load_digits()
        self.x = torch.tensor(d.data[a:b], dtype=torch.float32) / 16.0
        self.y = torch.tensor(d.target[a:b], dtype=torch.long)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def digits(hidden: int = 128) -> Workload:
    """An MLP over the first 1,500 digits; the last 297 evaluate it."""
    model = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                          nn.Linear(hidden, 10))
    train = Digits(0, 1500)

    def make_batch(batch_size: int, seed: int):      # for planning: batches drawn from the data
        i = torch.randint(0, len(train), (batch_size,), generator=torch.Generator().manual_seed(seed))
        return train.x[i], train.y[i]

    def accuracy(output, target):
        return {"accuracy": (output.argmax(-1) == target).float().mean()}

    return Workload(model=model, make_batch=make_batch, loss_fn=F.cross_entropy, optimizer="adam", lr=3e-3,
                    train_data=train, eval_data=Digits(1500, 1797), metrics=accuracy)


def default_plan(path: Path) -> None:
    plan = {"schema": "hetplan.plan/1", "model": {"spec": "__main__:digits", "args": {}}, "global_batch": 64,
            "replicas": [{"batch_fraction": 0.375, "microbatches": 1, "stages": [{"device": "cpu:0", "layers": [0, 5]}]},
                         {"batch_fraction": 0.625, "microbatches": 2, "stages": [{"device": "cpu:1", "layers": [0, 5]}]}],
            "optimizer": {"name": "adam", "lr": 3e-3, "torch_class": "AdamW", "args": {"weight_decay": 0.01},
                          "clip_grad_norm": 1.0}}
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(plan, indent=1))
    os.replace(tmp, path)          # every rank writes the same file; the last rename wins


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plan", default=None)
    p.add_argument("--out", default="out/digits")
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--steps", type=int, default=None)
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    plan = Path(a.plan) if a.plan else out / "plan.json"
    if not a.plan:
        default_plan(plan)
    rows = hetplan.train(plan, digits, epochs=None if a.steps else a.epochs, steps=a.steps, log_every=20,
                         eval_every=100, lr_schedule="cosine", warmup_steps=10, metrics=str(out / "metrics.jsonl"),
                         checkpoint_dir=str(out / "checkpoints"), checkpoint_every=100,
                         save_params=str(out / "params.pt"))
    if os.environ.get("RANK", "0") == "0":
        last = rows[-1]
        print(f"digits: step {last['step']}, eval loss {last['eval_loss']:.4f}, "
              f"eval accuracy {last['eval_accuracy']:.3f}")


if __name__ == "__main__":
    main()
