"""Overhead of `hetplan run` over plain PyTorch, on CPU workers.

1. one device: our single-stage run vs a plain training loop (same model, batch, threads);
2. two devices, even data parallel: our run (fine sync) vs torch DDP on the same two workers.

Both sides time the same way (hetplan.runtime.results): one barrier, then each rank times from the end
of one iteration to the end of the next, less the time spent making its batch; iteration 0 is
the max over ranks, a later one the mean; a run's figure is the median after warm-up. The two
sides alternate (`--repeats` runs each, interleaved, so load from other processes hits both);
printed: the median of the runs, their spread (max - min over median) and the ratio. Targets
(issue 15): one device <= 1.03x the plain loop, DP x2 <= 1.05x torch DDP. Usage:

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
import benchmarks.paths  # noqa: E402,F401  (the commands it starts import benchmarks.* too)
from hetplan.planner.workload.load import load_workload  # noqa: E402
from hetplan.runtime.launch import launch  # noqa: E402
from hetplan.runtime.rendezvous import env_vars, free_port  # noqa: E402
from hetplan.runtime.results import iteration_times  # noqa: E402
from hetplan.runtime.worker import RunConfig  # noqa: E402


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
    if world > 1:
        dist.barrier()
    end = time.perf_counter()
    for i in range(iters):
        t_load = time.perf_counter()
        x, y = w.make_batch(batch, i)
        x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        load_s = time.perf_counter() - t_load
        _plain_step(w, opt, x, y)
        times.append(time.perf_counter() - end - load_s)
        end = time.perf_counter()
    Path(out, f"rank{rank}.json").write_text(json.dumps(times))
    if world > 1:
        dist.destroy_process_group()


def plain(model, batch, iters, warmup, world, threads) -> float:
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(plain_rank, args=(world, free_port(), model, batch, iters, threads, d),
                           nprocs=world, start_method="spawn")
        per_rank = [json.loads(Path(d, f"rank{r}.json").read_text()) for r in range(world)]
    return statistics.median(iteration_times(per_rank)[warmup:])


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
    ap.add_argument("--repeats", type=int, default=5, help="runs of each side, interleaved")
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
        bb, oo = statistics.median(b), statistics.median(o)
        target = 1.03 if world == 1 else 1.05
        print(f"{label}: {base} {bb * 1e3:.2f} ms (spread {_spread(b):.0%}), hetplan {oo * 1e3:.2f} ms "
              f"(spread {_spread(o):.0%}); ratio {oo / bb:.3f} (target <= {target})", flush=True)


def _spread(xs: list[float]) -> float:
    return (max(xs) - min(xs)) / statistics.median(xs)


if __name__ == "__main__":
    main()
