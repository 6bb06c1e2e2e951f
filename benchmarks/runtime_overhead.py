"""Overhead of `hetplan run` over plain PyTorch, on CPU workers.

1. one device: our single-stage run vs a plain training loop (same model, batch, threads);
2. two devices, even data parallel: our run (fine sync) vs torch DDP on the same two workers.

Both sides time the same thing: batch made beforehand, then (barrier,) forward, backward,
gradient all-reduce and optimizer step; an iteration's time is the max over ranks; the figure is
the median after warm-up. Target: ours at most 3% slower. Usage:

    python benchmarks/runtime_overhead.py [--hidden 1024] [--depth 4] [--batch 128] [--iters 30]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from planner.workload.load import load_workload  # noqa: E402
from runtime.launch import launch  # noqa: E402
from runtime.rendezvous import env_vars, free_port  # noqa: E402
from runtime.worker import RunConfig  # noqa: E402


BUCKET_BYTES = 5 * 2**20   # same gradient bucket cap on both sides (DDP's bucket_cap_mb)


def _plain_step(w, opt, x, y):
    opt.zero_grad(set_to_none=True)
    w.loss_fn(w.model(x), y).backward()
    opt.step()


def plain_rank(rank, world, port, model, batch, iters, threads, out):
    """Plain loop (world 1) or torch DDP (world > 1): per-iteration step times of this rank."""
    torch.set_num_threads(threads)
    if world > 1:
        os.environ.update(env_vars(rank, world, "127.0.0.1", port))
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    w = load_workload(model["spec"], model["args"])
    net = w.model
    if world > 1:
        w.model = torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=BUCKET_BYTES / 2**20)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    times = []
    per = batch // world
    for i in range(iters):
        x, y = w.make_batch(batch, i)
        x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        if world > 1:
            dist.barrier()
        t0 = time.perf_counter()
        _plain_step(w, opt, x, y)
        times.append(time.perf_counter() - t0)
    Path(out, f"rank{rank}.json").write_text(json.dumps(times))
    if world > 1:
        dist.destroy_process_group()


def plain(model, batch, iters, warmup, world, threads) -> float:
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(plain_rank, args=(world, free_port(), model, batch, iters, threads, d),
                           nprocs=world, start_method="spawn")
        per_rank = [json.loads(Path(d, f"rank{r}.json").read_text()) for r in range(world)]
    its = [max(r[i] for r in per_rank) for i in range(iters)]
    return statistics.median(its[warmup:])


def ours(model, batch, iters, warmup, world, threads) -> float:
    devices = [f"cpu:{r}" for r in range(world)]
    p = {"schema": "hetplan.plan/1", "model": model, "global_batch": batch, "schedule": "gpipe",
         "replicas": [{"batch_fraction": 1 / world, "microbatches": 1,
                       "stages": [{"device": d, "layers": [0, model["args"]["depth"] + 1]}]} for d in devices],
         "sync": {"granularity": "fine", "bucket_bytes": BUCKET_BYTES}, "optimizer": {"name": "adam", "lr": 1e-3}}
    with tempfile.TemporaryDirectory() as d:
        path = Path(d, "plan.json")
        path.write_text(json.dumps(p))
        cfg = RunConfig(plan=str(path), iters=iters, warmup=warmup, threads={x: threads for x in devices})
        return launch(cfg, tuple(devices))["iteration_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3, help="alternate runs; report the best of each")
    a = ap.parse_args()
    model = {"spec": "mlp", "args": {"hidden": a.hidden, "depth": a.depth}}
    cores = os.cpu_count() or 1
    for world, label, base in ((1, "single device", "plain loop"), (2, "even DP x2", "torch DDP")):
        threads = max(1, cores // world)
        b, o = [], []
        for _ in range(a.repeats):   # alternate, so load from other processes hits both sides
            print(f"{label}: running...", file=sys.stderr, flush=True)
            b.append(plain(model, a.batch, a.iters, a.warmup, world, threads))
            o.append(ours(model, a.batch, a.iters, a.warmup, world, threads))
        bb, oo = min(b), min(o)
        print(f"{label}: {base} {bb * 1e3:.2f} ms, hetplan {oo * 1e3:.2f} ms, "
              f"overhead {(oo / bb - 1) * 100:+.1f}% (target <= +3%)")


if __name__ == "__main__":
    main()
