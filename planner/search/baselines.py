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
from typing import Callable, Sequence

from planner.search.space import Pipeline, Space, Strategy, realise_microbatches


def device_order(names: Sequence[str], kinds: dict[str, str]) -> tuple[str, ...]:
    """Pipeline order: by node in natural order ('node10' after 'node9'), GPUs before CPUs, then
    by index ('cuda:10' after 'cuda:9')."""
    from planner.hardware.topology import natural_key, parse_device_name

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


def hybrid_seeds(space: Space, single_s: dict[str, float], shares: dict[str, tuple[float, ...]],
                 cut_s: Callable[[str, str, int], float] | None = None) -> list[Strategy]:
    """Starting points for the walk (not baselines): k identical-width pipelines over
    consecutive devices in `device_order`, for every k dividing the device count (the DP x PP
    grids of Megatron-LM / PipeDream). On a large cluster random rewrites of one choice at a
    time take long to reach such regular structures; starting there costs a few simulations."""
    n = len(space.devices)
    out = []
    for k in range(2, n):
        width = n // k
        if n % k or width > space.num_layers or k * width > space.global_batch:
            continue
        pipes = tuple(balanced_pipeline(space, space.devices[i * width:(i + 1) * width], single_s, shares, cut_s)
                      for i in range(k))
        out.append(Strategy(tuple(Pipeline(p.devices, p.cuts, 2 * width) for p in pipes),
                            precision=space.precisions[0]))
    return out
