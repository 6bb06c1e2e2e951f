"""gloo's collectives on this machine: all-reduce, reduce-scatter and all-gather of the same
bytes between N processes, the median of `--repeats` calls after two warm-ups, each after a
barrier. What sharded data parallel (hetplan.runtime.shard) chooses between on gloo; and
`zero3_gather`: ZeRO-3's gather of the same bytes as `--units` parameters, one unit each
(hetplan.runtime.shard.ParamShards: a unit's buffer regrown, every rank's chunk all-gathered
into it, the next unit's gather started), then freed.

    python benchmarks/gloo_collectives.py [--world 2] [--mb 1 16] [--units 4] [--repeats 10]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def _zero3(n: int, units: int):
    """A ParamShards over `units` parameters of n/units floats each: gather and free them all."""
    import torch
    from hetplan.runtime.shard import ParamShards
    params = [torch.nn.Parameter(torch.randn(n // units)) for _ in range(units)]
    shards = ParamShards(params, None, [[i] for i in range(units)])

    def call():
        for u in range(units):
            shards.gather(u)
            shards.release(u - 1)
        shards.release_all()
    return call


def _worker(rank: int, world: int, port: int, sizes_mb: list[float], repeats: int, units: int) -> None:
    import torch
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    out = {}
    for mb in sizes_mb:
        n = int(mb * 2**20) // 4 // world * world
        x, part = torch.randn(n), torch.empty(n // world)
        parts = [torch.empty(n // world) for _ in range(world)]
        from hetplan.runtime.shard import reduce_scatter_single
        calls = {"all_reduce": lambda: dist.all_reduce(x),
                 "reduce_scatter": lambda: reduce_scatter_single(part, x),
                 "all_gather": lambda: dist.all_gather(parts, part),
                 "zero3_gather": _zero3(n, units)}
        row = {}
        for name, call in calls.items():
            times = []
            for _ in range(repeats + 2):
                dist.barrier()
                t = time.perf_counter()
                call()
                times.append(time.perf_counter() - t)
            row[f"{name}_ms"] = statistics.median(times[2:]) * 1e3
        out[f"{mb:g} MB"] = row
    if rank == 0:
        print(json.dumps({"world": world, "repeats": repeats, "sizes": out}, indent=1))
    dist.destroy_process_group()


def main(argv=None) -> int:
    import torch.multiprocessing as mp
    from hetplan.runtime.rendezvous import free_port
    a = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a.add_argument("--world", type=int, default=2)
    a.add_argument("--mb", type=float, nargs="+", default=[1.0, 16.0])
    a.add_argument("--repeats", type=int, default=10)
    a.add_argument("--units", type=int, default=4, help="zero3_gather: the bytes as this many parameters")
    args = a.parse_args(argv)
    if args.world < 2 or args.repeats < 1 or args.units < 1 or any(m <= 0 for m in args.mb):
        a.error("expected --world >= 2, --repeats >= 1, --units >= 1 and positive --mb")
    mp.spawn(_worker, args=(args.world, free_port(), args.mb, args.repeats, args.units), nprocs=args.world)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
