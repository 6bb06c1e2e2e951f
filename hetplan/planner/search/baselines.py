"""The plans a user would try by hand, and the partition heuristics they rest on.

Baselines (all evaluated by the search, which starts from the best of them, so the plan it
returns is never predicted slower than any of them — FlexFlow issue #217 returned a plan slower
than data parallelism):

- fastest single device: the whole model on one device;
- data parallel over all devices with equal shares of the batch;
- data parallel with shares proportional to each device's single-device throughput;
- data parallel over the GPUs only, equal shares (when there are GPUs and CPUs);
- a balanced pipeline over all devices: stage boundaries from a dynamic-programming partition
  that minimises the slowest stage (PipeDream, Narayanan et al. 2019, section 3.1), devices in
  `device_order` (GPUs first, grouped by node, so neighbouring stages share fast links).
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable, NamedTuple, Sequence

from hetplan.planner.search.space import Pipeline, Space, Strategy, realise_microbatches


def device_order(names: Sequence[str], kinds: dict[str, str]) -> tuple[str, ...]:
    """Pipeline order: by node in natural order ('node10' after 'node9'), GPUs before CPUs, then
    by index ('cuda:10' after 'cuda:9')."""
    from hetplan.planner.hardware.topology import natural_key, parse_device_name

    def key(name: str):
        node, kind, index = parse_device_name(name)
        return (natural_key(node or ""), kinds.get(name, kind) != "cuda", index)
    return tuple(sorted(names, key=key))


def proportional_batches(total: int, weights: Sequence[float], lows: Sequence[int]) -> tuple[int, ...]:
    """Integer batches >= lows summing to `total`, proportional to `weights`: floors of the
    ideal shares, then the remaining samples by largest remainder (ties: larger weight first)."""
    if total < sum(lows):
        raise ValueError(f"batch {total} is smaller than the minimum {sum(lows)}")
    w = sum(weights)
    ideal = [total * x / w for x in weights]
    out = [max(lo, math.floor(x)) for lo, x in zip(lows, ideal)]
    while sum(out) > total:  # lows pushed some up: take from the most over-served
        i = max((i for i in range(len(out)) if out[i] > lows[i]), key=lambda i: (out[i] - ideal[i], -i))
        out[i] -= 1
    order = sorted(range(len(out)), key=lambda i: (-(ideal[i] - out[i]), -weights[i], i))
    for i in order[:total - sum(out)]:
        out[i] += 1
    return tuple(out)


def partition_min_max(stage_s: Callable[[int, int, int], float], n_stages: int,
                      num_layers: int) -> tuple[tuple[int, ...], float]:
    """Cuts of [0, L) into n_stages non-empty ranges minimising max_k stage_s(k, start, end).

    Dynamic programming: best[k][j] = min_i max(best[k-1][i], stage_s(k-1, i, j)), O(S·L²).
    Returns (cuts, the minimised max stage time)."""
    L, S = num_layers, n_stages
    INF = math.inf
    best = [[INF] * (L + 1) for _ in range(S + 1)]
    arg = [[0] * (L + 1) for _ in range(S + 1)]
    best[0][0] = 0.0
    for k in range(1, S + 1):
        for j in range(k, L - (S - k) + 1):
            for i in range(k - 1, j):
                if best[k - 1][i] == INF:
                    continue
                v = max(best[k - 1][i], stage_s(k - 1, i, j))
                if v < best[k][j]:
                    best[k][j], arg[k][j] = v, i
    cuts, j = [], L
    for k in range(S, 1, -1):
        j = arg[k][j]
        cuts.append(j)
    return tuple(reversed(cuts)), best[S][L]


def balanced_pipeline(space: Space, devices: Sequence[str], single_s: dict[str, float],
                      shares: dict[str, tuple[float, ...]],
                      cut_s: Callable[[str, str, int], float] | None = None) -> Pipeline:
    """A pipeline over `devices` (at most one per layer) with DP-balanced stage boundaries.

    Stage k on device d over [i, j) costs single_s[d] * sum(shares[d][i:j]) plus the
    activation transfer into it (cut_s(prev, d, i)), all at the full batch; only the ratio
    between stages matters for the partition."""
    devices = tuple(devices[:space.num_layers])
    prefix = {d: [0.0] for d in devices}
    for d in devices:
        for x in shares[d]:
            prefix[d].append(prefix[d][-1] + x)

    def stage_s(k: int, i: int, j: int) -> float:
        d = devices[k]
        t = single_s[d] * (prefix[d][j] - prefix[d][i])
        if k > 0 and cut_s is not None:
            t += cut_s(devices[k - 1], d, i)
        return t

    cuts, _ = partition_min_max(stage_s, len(devices), space.num_layers)
    return Pipeline(devices, cuts, microbatches=4 * len(devices))


def baseline_strategies(space: Space, single_s: dict[str, float], shares: dict[str, tuple[float, ...]],
                        cut_s: Callable[[str, str, int], float] | None = None
                        ) -> list[tuple[str, Strategy, tuple[int, ...]]]:
    """(name, strategy, batches) of every baseline except the single-device ones (which the
    search evaluates first, to get `single_s`: each device's time for the whole model)."""
    B = space.global_batch
    devs = space.devices[:B]                     # data parallelism needs a sample per replica
    out = []
    first = space.precisions[0]   # baselines are what a user runs by hand: the first precision
    dp = Strategy(tuple(Pipeline((d,), ()) for d in devs), precision=first)
    if len(devs) > 1:
        out.append(("data parallel, equal shares", dp, proportional_batches(B, [1.0] * len(devs), [1] * len(devs))))
        speed = [1.0 / single_s[d] for d in devs]
        out.append(("data parallel, proportional shares", dp, proportional_batches(B, speed, [1] * len(devs))))
    gpus = [d for d in space.devices if space.kinds[d] == "cuda"][:B]
    # replicated data parallel does not fit: what DeepSpeed and FSDP users run, over devices of
    # one kind (a shard group's collectives run on one backend): the GPUs where there are any
    zero = devs if len({space.kinds[d] for d in devs}) == 1 else gpus
    if len(zero) > 1:
        dz = Strategy(tuple(Pipeline((d,), ()) for d in zero), precision=first)
        for k in (1, 3):
            if k in space.shard_choices:
                out.append((f"data parallel, ZeRO-{k}", replace(dz, shard=k),
                            proportional_batches(B, [1.0] * len(zero), [1] * len(zero))))
    if 1 < len(gpus) < len(space.devices):
        # what most users run on a GPU server: DDP over the GPUs, CPUs idle
        gpu_dp = Strategy(tuple(Pipeline((d,), ()) for d in gpus), precision=first)
        out.append(("data parallel over GPUs", gpu_dp,
                    proportional_batches(B, [1.0] * len(gpus), [1] * len(gpus))))
    pipe_devs = space.devices[:min(space.num_layers, B)]
    if len(pipe_devs) > 1:
        p = balanced_pipeline(space, pipe_devs, single_s, shares, cut_s)
        m = realise_microbatches(p.microbatches, B, len(p.devices), "1f1b")
        out.append(("balanced pipeline", Strategy((Pipeline(p.devices, p.cuts, m),), precision=first), (B,)))
    return out


def grid_orders(space: Space) -> list[tuple[str, tuple[str, ...]]]:
    """The device orders whose consecutive groups make the grid shapes: node by node
    ("within nodes"), and, with several nodes of one size, rail by rail (the i-th device of
    every node in turn: "across nodes", rail-aligned)."""
    from hetplan.planner.hardware.topology import parse_device_name
    nodes: dict[str, list[str]] = {}
    for d in space.devices:
        nodes.setdefault(parse_device_name(d)[0] or "", []).append(d)
    out = [("within nodes", space.devices)]
    sizes = {len(v) for v in nodes.values()}
    if len(nodes) > 1 and len(sizes) == 1 and sizes != {1}:
        rails = tuple(v[i] for i in range(sizes.pop()) for v in nodes.values())
        out.append(("across nodes", rails))
    return out


class GridShape(NamedTuple):
    name: str
    degree: int                  # pipeline degree (stages per pipeline)
    order: str                   # "within nodes" or "across nodes" (grid_orders)
    strategy: Strategy
    batches: tuple[int, ...]
    baseline: bool               # one of the two node-level hybrids reported as baselines


def grid_shapes(space: Space, single_s: dict[str, float], shares: dict[str, tuple[float, ...]],
                cut_s: Callable[[str, str, int], float] | None = None) -> list[GridShape]:
    """The pipeline x data-parallel grids engineers build (Megatron-LM, PipeDream): for every
    pipeline degree p dividing the device count and each order of `grid_orders`, n/p
    pipelines of p consecutive devices, DP-balanced cuts, 4p microbatches desired, equal
    batches; p = 1 (data parallel) and p = n (one pipeline) from the first order only. With
    several nodes, a pipeline per node x DP across nodes and a pipeline per rail x DP within
    nodes are marked as baselines."""
    from hetplan.planner.hardware.topology import parse_device_name
    n, B, L = len(space.devices), space.global_batch, space.num_layers
    first = space.precisions[0]
    parts: dict[tuple, tuple[int, ...]] = {}   # identical pipelines (speeds, shares, cuts) are cut alike

    def pipeline(devs: tuple[str, ...], m: int) -> Pipeline:
        pairs = list(zip(devs, devs[1:]))
        sig = (tuple(single_s[d] for d in devs), tuple(shares[d] for d in devs),
               tuple(tuple(cut_s(a, b, i) for i in range(1, L)) for a, b in pairs) if cut_s else ())
        if sig not in parts:
            parts[sig] = balanced_pipeline(space, devs, single_s, shares, cut_s).cuts
        return Pipeline(devs, parts[sig], m)
    out = []
    orders = grid_orders(space)
    n_nodes = len({parse_device_name(d)[0] for d in space.devices})
    hand = {("within nodes", n // n_nodes), ("across nodes", n_nodes)} if len(orders) > 1 else set()
    for k, (order_name, order) in enumerate(orders):
        for p in range(1, n + 1):
            dp = n // p
            if n % p or p > L or (k and p in (1, n)):
                continue
            b = B // dp
            if b < p or dp > B:
                continue
            batches = proportional_batches(B, [1.0] * dp, [p] * dp)
            pipes = []
            for r in range(dp):
                m = realise_microbatches(4 * p if p > 1 else 1, batches[r], p, "1f1b")
                pipes.append(pipeline(order[r * p:(r + 1) * p], m))
            if (order_name, p) in hand:
                name = (f"pipeline within nodes x data parallel across nodes ({p} x {dp})" if k == 0 else
                        f"pipeline across nodes x data parallel within nodes ({p} x {dp})")
            else:
                name = f"pipeline {p} x data parallel {dp}, pipelines {order_name}"
            out.append(GridShape(name, p, order_name, Strategy(tuple(pipes), precision=first), batches,
                                 (order_name, p) in hand))
    return out

__all__ = ["device_order", "proportional_batches", "partition_min_max", "balanced_pipeline",
           "baseline_strategies", "grid_orders", "GridShape", "grid_shapes"]
