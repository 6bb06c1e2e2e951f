"""The strategy space: every choice a plan makes, the search's moves, and exhaustive enumeration.

A `Strategy` is a plan without its batch split: which devices form which pipelines, where the
stage boundaries are, the desired microbatch count of each pipeline, and the global choices
(schedule, sync granularity and bucket size, optimizer placement and a split optimizer's host
share, recompute, activation offload, precision), and a tensor split of one stage of a lone
pipeline (the whole model, or one stage of a pipeline) between devices with their shares
(`Strategy.tensor`, solved by the search like the batch split:
hetplan.planner.search.mcmc.Searcher.solve_shares). Under interleaved 1F1B a pipeline's `devices`
name every virtual stage, a device appearing v times (stage k on the device of stage k mod p,
as the plan file says). A plan is a
strategy plus integer replica batches (`to_plan`). Keeping the batch split apart lets the
search solve it directly (hetplan.planner.search.mcmc.solve_batches) instead of random-walking fractions.

Every move rewrites one choice and returns a strategy that `to_plan` can turn into a valid plan
(validate_plan), or None when the move does not apply (e.g. no unused device to add).
"""
from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Iterator

from hetplan.planner.files.plan import ModelRef, Optimizer, Plan, Replica, Share, Stage, Sync, min_microbatches

MiB = 2**20
BUCKET_CHOICES_BYTES = (1 * MiB, 4 * MiB, 25 * MiB, 100 * MiB)
CPU_FRACTIONS = (0.1, 0.25, 0.5, 0.75, 0.9)   # shares of a split optimizer's update on the host CPU


@dataclass(frozen=True)
class Space:
    """What may be chosen for one workload on one topology."""
    devices: tuple[str, ...]               # in a sensible pipeline order (see baselines.device_order)
    kinds: dict[str, str]                  # device -> "cpu" / "cuda"
    num_layers: int
    global_batch: int
    model: ModelRef
    optimizer_name: str = "adam"
    lr: float = 1e-3
    bucket_choices_bytes: tuple[int, ...] = BUCKET_CHOICES_BYTES
    schedules: tuple[str, ...] = ("1f1b", "gpipe", "zb-h1", "hippie")
    granularities: tuple[str, ...] = ("fine", "coarse")
    recompute_choices: tuple[bool, ...] = (False, True)
    precisions: tuple[str, ...] = ("fp32",)  # what the user allows (`plan --precision`); the
                                             # baselines use the first
    max_microbatches: int = 64             # more microbatches than this only add overhead
    cpu_fractions: tuple[float, ...] = CPU_FRACTIONS
    interleave: bool = True                # the `interleave` move may turn 1F1B pipelines into
                                           # interleaved ones with v = 2 virtual stages per device
    tensor_split: bool = False             # the model has linear pairs to split between devices
                                           # (ModelGraph.pairs): the tensor move is drawn
    shard_choices: tuple[int, ...] = (0,)  # ZeRO stages the walk may draw (plan `shard`): 0-3
                                           # where replicated data parallel does not fit

    @property
    def has_gpu(self) -> bool:
        return any(k == "cuda" for k in self.kinds.values())

    @property
    def has_host(self) -> bool:
        # A GPU's optimizer or activations go to a CPU device of its node (cost.model.host_cpu):
        # without any CPU device the simulator refuses every such plan.
        return self.has_gpu and any(k == "cpu" for k in self.kinds.values())

    @property
    def placements(self) -> tuple[str, ...]:
        # Offloading the optimizer to the CPU only means something for GPU-resident parameters.
        return ("device", "cpu", "split") if self.has_host else ("device",)

    @property
    def offload_choices(self) -> tuple[bool, ...]:
        # Activation offload moves an accelerator's saved activations to its host.
        return (False, True) if self.has_host else (False,)

    def optimizer_choices(self) -> list[tuple[str, float | None]]:
        """(placement, cpu_fraction) pairs: every fraction under "split", None otherwise."""
        return [(p, f) for p in self.placements for f in (self.cpu_fractions if p == "split" else (None,))]


@dataclass(frozen=True)
class Pipeline:
    devices: tuple[str, ...]               # stage k runs on devices[k]
    cuts: tuple[int, ...]                  # len(devices) - 1 strictly increasing layers in (0, L)
    microbatches: int = 1                  # desired; realised as a divisor of the replica batch

    @property
    def distinct(self) -> tuple[str, ...]:
        """Its devices once each, in stage order (p; fewer than stages only when interleaved)."""
        return tuple(dict.fromkeys(self.devices))

    def ranges(self, num_layers: int) -> list[tuple[int, int]]:
        bounds = (0, *self.cuts, num_layers)
        return list(zip(bounds, bounds[1:]))


@dataclass(frozen=True)
class Strategy:
    pipelines: tuple[Pipeline, ...]
    schedule: str = "1f1b"
    granularity: str = "fine"
    bucket_bytes: int = 25 * MiB
    placement: str = "device"
    recompute: bool = False
    precision: str = "fp32"
    cpu_fraction: float | None = None      # placement "split" only
    offload: bool = False                  # offload_activations on every accelerator stage
                                           # (not under recompute, nor zb-h1)
    tensor: tuple[tuple[str, float], ...] = ()   # (device, share): stage `tensor_stage` of the
                                           # one pipeline split between them, its device first
    tensor_stage: int = 0
    shard: int = 0                         # ZeRO stage over the pipelines (all alike)

    @property
    def used(self) -> frozenset[str]:
        """The pipelines' devices (a tensor split's others are not: moves other than
        `tensor_move` leave a split strategy only to be refused by `fits`)."""
        return frozenset(d for p in self.pipelines for d in p.devices)


# --- strategy -> plan ---------------------------------------------------------------------
def min_batch(p: Pipeline, schedule: str) -> int:
    """Smallest replica batch a pipeline can take: one sample per microbatch it needs."""
    return min_microbatches(len(p.devices), schedule, len(p.distinct))


@lru_cache(maxsize=4096)
def divisors(n: int) -> tuple[int, ...]:
    """The divisors of `n` in increasing order, by trial division up to its square root: never a
    loop up to the batch (2^20 samples: 1,024 trials, not a million)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return tuple(small + [n // d for d in reversed(small) if d * d != n])


def realise_microbatches(desired: int, batch: int, stages: int, schedule: str, devices: int | None = None) -> int:
    """The divisor m of `batch` closest to `desired` (in ratio; ties -> smaller) with m >= stages
    under 1F1B, m a multiple of the `devices` under interleaved 1F1B. Raises ValueError when
    none exists (batch < stages under 1F1B; no multiple of p divides the batch)."""
    low = min_microbatches(stages, schedule, devices)
    step = low if schedule == "interleaved-1f1b" else 1
    divs = [m for m in divisors(batch) if m >= low and m % step == 0]
    if not divs:
        raise ValueError(f"no microbatch count >= {low}{' (a multiple of it)' if step > 1 else ''} "
                         f"divides batch {batch}")
    return min(divs, key=lambda m: (abs(math.log(m / max(desired, 1))), m))


@lru_cache(maxsize=8192)
def _stages(devices: tuple[str, ...], ranges: tuple[tuple[int, int], ...], offloads: tuple[bool, ...] | None,
            tensor: tuple[tuple[str, float], ...], tensor_stage: int) -> tuple[Stage, ...]:
    """A pipeline's stages (`to_plan`), made once: a search makes the same ones again and again."""
    split = tuple(Share(d, x) for d, x in tensor)
    return tuple(Stage(d, r, bool(offloads and offloads[k]), split if k == tensor_stage else ())
                 for k, (d, r) in enumerate(zip(devices, ranges)))


def to_plan(space: Space, s: Strategy, batches: tuple[int, ...] | list[int]) -> Plan:
    """The plan of strategy `s` with replica batches `batches` (summing to the global batch).

    Fractions are b / B, so round(fraction * B) gives back b exactly. Raises ValueError when
    `s.precision` is not one the space allows (a precision is never chosen silently)."""
    if s.precision not in space.precisions:
        raise ValueError(f"precision {s.precision!r} is not allowed here ({', '.join(space.precisions)})")
    B = space.global_batch
    replicas = []
    ms = [realise_microbatches(p.microbatches, b, len(p.devices), s.schedule, len(p.distinct))
          for p, b in zip(s.pipelines, batches, strict=True)]
    if s.shard == 3:      # as many microbatches in every replica (hetplan.planner.files.plan)
        ms = [common_microbatches(ms, batches, min(min_batch(p, s.schedule) for p in s.pipelines))] * len(ms)
    for p, b, m in zip(s.pipelines, batches, ms):
        offload = s.offload and not s.recompute and s.schedule != "zb-h1"
        offloads = tuple(space.kinds[d] != "cpu" for d in p.devices) if offload else None
        stages = _stages(p.devices, tuple(p.ranges(space.num_layers)), offloads, s.tensor, s.tensor_stage)
        replicas.append(Replica(batch_fraction=b / B, microbatches=m, stages=stages))
    return Plan(model=space.model, global_batch=B, replicas=tuple(replicas), schedule=s.schedule,
                sync=Sync(s.granularity, s.bucket_bytes),
                optimizer=Optimizer(space.optimizer_name, space.lr, s.placement,
                                          s.cpu_fraction if s.placement == "split" else None),
                recompute=s.recompute, precision=s.precision, shard=s.shard)


def common_microbatches(ms: list[int], batches, least: int) -> int:
    """One microbatch count for every replica: the largest divisor of every batch that is at
    most the largest of `ms` and at least `least`; else the largest of `ms`."""
    common = [d for d in divisors(math.gcd(*batches)) if least <= d <= max(ms)]
    return common[-1] if common else max(ms)


def from_plan(plan: Plan) -> tuple[Strategy, tuple[int, ...]]:
    """Inverse of to_plan (microbatches as realised)."""
    pipes = tuple(Pipeline(devices=tuple(st.device for st in r.stages), cuts=tuple(st.start for st in r.stages[1:]),
                           microbatches=r.microbatches) for r in plan.replicas)
    s = Strategy(pipes, plan.schedule, plan.sync.granularity, plan.sync.bucket_bytes,
                 plan.optimizer.placement, plan.recompute, plan.precision, plan.optimizer.cpu_fraction,
                 any(st.offload_activations for r in plan.replicas for st in r.stages),
                 *next(((tuple((x.device, x.share) for x in st.split), k) for r in plan.replicas
                        for k, st in enumerate(r.stages) if st.split), ((), 0)), plan.shard)
    return s, tuple(plan.replica_batches())


def _layout_ok(p: Pipeline, schedule: str) -> bool:
    """Distinct devices; under interleaved 1F1B stage k on the device of stage k mod p (p >= 2
    unless one stage)."""
    devs = p.distinct
    if schedule != "interleaved-1f1b":
        return len(devs) == len(p.devices)
    n = len(devs)
    return ((len(p.devices) == 1 or n >= 2) and len(p.devices) % n == 0
            and all(d == devs[k % n] for k, d in enumerate(p.devices)))


def _interleavable(space: Space, s: Strategy) -> bool:
    """The search interleaves one pipeline taking the whole batch, a multiple of its p devices
    (so every batch split and microbatch count it draws is valid), without activation offload.
    Plan files may hold more (data-parallel interleaved pipelines): the simulator and runtime
    run them; the search does not propose them."""
    return (len(s.pipelines) == 1 and not s.offload
            and space.global_batch % len(s.pipelines[0].distinct) == 0)


def fits(space: Space, s: Strategy) -> bool:
    """Structural validity: distinct devices (an interleaved pipeline's virtual stages apart),
    cuts inside (0, L), batch enough for every pipeline, no recompute under zb-h1
    (hetplan.planner.files.plan refuses it)."""
    if s.schedule == "zb-h1" and s.recompute:
        return False
    used = [d for p in s.pipelines for d in p.distinct]
    if not s.pipelines or len(used) != len(set(used)):
        return False
    if s.schedule == "interleaved-1f1b" and not _interleavable(space, s):
        return False
    if s.tensor and not _tensor_fits(s):
        return False
    if s.shard and not _shard_fits(space, s):
        return False
    for p in s.pipelines:
        if len(p.cuts) != len(p.devices) - 1 or not p.devices or not _layout_ok(p, s.schedule):
            return False
        bounds = (0, *p.cuts, space.num_layers)
        if any(a >= b for a, b in zip(bounds, bounds[1:])):
            return False
    return sum(min_batch(p, s.schedule) for p in s.pipelines) <= space.global_batch


def _shard_fits(space: Space, s: Strategy) -> bool:
    """Sharding as the plan file and the runtime allow it: two or more pipelines cut alike over
    as many devices, the optimizer on the devices or their hosts (not split), no tensor split,
    offload or interleaving; ZeRO-3 without recompute."""
    first = s.pipelines[0]
    return (len(s.pipelines) >= 2 and all(p.cuts == first.cuts and len(p.devices) == len(first.devices)
                                          for p in s.pipelines)
            and s.placement in ("device", "cpu") and not s.tensor and not s.offload
            and s.schedule != "interleaved-1f1b" and not (s.shard == 3 and s.recompute))


def _tensor_fits(s: Strategy) -> bool:
    """A tensor split as the plan file allows it (hetplan.planner.files.plan): a stage of the one
    replica, its device first among two or more devices no other stage uses, shares in (0, 1]
    summing to 1, the optimizer on the devices, neither recompute nor offload nor interleaving."""
    devices = [d for d, _ in s.tensor]
    if len(s.pipelines) != 1 or not 0 <= s.tensor_stage < len(s.pipelines[0].devices):
        return False
    pipe = s.pipelines[0].devices
    return (pipe[s.tensor_stage] == devices[0] and len(devices) >= 2 and len(set(devices)) == len(devices)
            and not set(devices[1:]) & set(pipe) and all(0 < x <= 1 for _, x in s.tensor)
            and abs(sum(x for _, x in s.tensor) - 1) <= 1e-9 and s.placement == "device"
            and not s.recompute and not s.offload and s.schedule not in ("interleaved-1f1b", "zb-h1"))


def with_split(s: Strategy, stage: int, devices) -> Strategy:
    """`s`'s one pipeline with stage `stage` on devices[0] and split between `devices` at equal
    shares (the search solves them: hetplan.planner.search.mcmc.Searcher.solve_shares); one device: no
    split."""
    devices = tuple(devices)
    p = s.pipelines[0]
    pipe = replace(p, devices=p.devices[:stage] + devices[:1] + p.devices[stage + 1:])
    if len(devices) == 1:
        return replace(s, pipelines=(pipe,), tensor=(), tensor_stage=0)
    shares = tuple((d, 1 / len(devices)) for d in devices)
    return replace(s, pipelines=(pipe,), tensor=shares, tensor_stage=stage, placement="device",
                   cpu_fraction=None, recompute=False, offload=False)


def even_split(s: Strategy, devices) -> Strategy:
    """`s` as a tensor split of the whole model between `devices` (see `with_split`)."""
    m = s.pipelines[0].microbatches if len(s.pipelines) == 1 else 1
    return with_split(replace(s, pipelines=(Pipeline(tuple(devices)[:1], (), m),)), 0, devices)


# --- moves ----------------------------------------------------------------------------------
def _set_pipe(s: Strategy, i: int, p: Pipeline | None) -> Strategy:
    pipes = list(s.pipelines)
    if p is None:
        del pipes[i]
    else:
        pipes[i] = p
    return replace(s, pipelines=tuple(pipes))


def _even_cuts(n_stages: int, num_layers: int) -> tuple[int, ...]:
    return tuple(round(k * num_layers / n_stages) for k in range(1, n_stages))


def move_cut(space: Space, s: Strategy, rng: random.Random) -> Strategy | None:
    """Shift one stage boundary by a few layers."""
    cands = [i for i, p in enumerate(s.pipelines) if p.cuts]
    if not cands:
        return None
    i = rng.choice(cands)
    p = s.pipelines[i]
    k = rng.randrange(len(p.cuts))
    step = rng.choice((-1, 1)) * (1 if rng.random() < 0.7 else rng.randint(2, max(2, space.num_layers // 4)))
    cuts = list(p.cuts)
    cuts[k] += step
    return _set_pipe(s, i, replace(p, cuts=tuple(cuts)))


def split_stage(space: Space, s: Strategy, rng: random.Random) -> Strategy | None:
    """Give half of one stage's layers to an unused device (a new stage right after it)."""
    free = [d for d in space.devices if d not in s.used]
    cands = [(i, k) for i, p in enumerate(s.pipelines)
             for k, (a, b) in enumerate(p.ranges(space.num_layers)) if b - a >= 2]
    if not free or not cands:
        return None
    i, k = rng.choice(cands)
    p = s.pipelines[i]
    a, b = p.ranges(space.num_layers)[k]
    mid = rng.randint(a + 1, b - 1) if rng.random() < 0.3 else (a + b) // 2
    d = rng.choice(free)
    devices = (*p.devices[:k + 1], d, *p.devices[k + 1:])
    cuts = tuple(sorted((*p.cuts, mid)))
    return _set_pipe(s, i, replace(p, devices=devices, cuts=cuts,
                                   microbatches=max(p.microbatches, len(devices))))


def merge_stages(space: Space, s: Strategy, rng: random.Random) -> Strategy | None:
    """Merge two adjacent stages onto one of their devices (the other becomes unused)."""
    cands = [(i, k) for i, p in enumerate(s.pipelines) for k in range(len(p.cuts))]
    if not cands:
        return None
    i, k = rng.choice(cands)
    p = s.pipelines[i]
    keep = k if rng.random() < 0.5 else k + 1
    drop = k + 1 if keep == k else k
    devices = tuple(d for j, d in enumerate(p.devices) if j != drop)
    cuts = tuple(c for j, c in enumerate(p.cuts) if j != k)
    return _set_pipe(s, i, replace(p, devices=devices, cuts=cuts))


def swap_devices(space: Space, s: Strategy, rng: random.Random) -> Strategy | None:
    """Exchange two devices' places (either may be unused: then it replaces the other)."""
    a = rng.choice([d for p in s.pipelines for d in p.devices])
    b = rng.choice([d for d in space.devices if d != a] or [a])
    if a == b:
        return None
    swap = {a: b, b: a}
    pipes = tuple(replace(p, devices=tuple(swap.get(d, d) for d in p.devices)) for p in s.pipelines)
    return replace(s, pipelines=pipes)


def add_replica(space: Space, s: Strategy, rng: random.Random) -> Strategy | None:
    """An unused device becomes a new one-stage data-parallel replica."""
    free = [d for d in space.devices if d not in s.used]
    if not free:
        return None
    return replace(s, pipelines=(*s.pipelines, Pipeline((rng.choice(free),), ())))


def _without(s: Strategy, d: str, rng: random.Random) -> Strategy:
    """`s` without device d: its one-stage replica disappears, or its stage merges into a neighbour."""
    i = next(i for i, p in enumerate(s.pipelines) if d in p.devices)
    p = s.pipelines[i]
    if len(p.devices) == 1:
        return _set_pipe(s, i, None)
    k = p.devices.index(d)
    cut = k - 1 if k == len(p.devices) - 1 or (k > 0 and rng.random() < 0.5) else k
    devices = tuple(x for x in p.devices if x != d)
    return _set_pipe(s, i, replace(p, devices=devices, cuts=tuple(c for j, c in enumerate(p.cuts) if j != cut)))


def remove_device(space: Space, s: Strategy, rng: random.Random) -> Strategy | None:
    """Leave one device unused."""
    if len(s.used) <= 1:
        return None
    return _without(s, rng.choice(sorted(s.used, key=space.devices.index)), rng)


def move_device(space: Space, s: Strategy, rng: random.Random) -> Strategy | None:
    """Take a device out of its replica and make it a stage of another replica (or a new one)."""
    if len(s.used) <= 1:
        return None
    d = rng.choice(sorted(s.used, key=space.devices.index))
    t = _without(s, d, rng)
    if not t.pipelines or rng.random() < 0.25:
        return replace(t, pipelines=(*t.pipelines, Pipeline((d,), ())))
    i = rng.randrange(len(t.pipelines))
    p = t.pipelines[i]
    ranges = p.ranges(space.num_layers)
    cands = [k for k, (a, b) in enumerate(ranges) if b - a >= 2]
    if not cands:
        return None
    k = rng.choice(cands)
    a, b = ranges[k]
    devices = (*p.devices[:k + 1], d, *p.devices[k + 1:])
    return _set_pipe(t, i, replace(p, devices=devices, cuts=tuple(sorted((*p.cuts, (a + b) // 2))),
                                   microbatches=max(p.microbatches, len(devices))))


def change_microbatches(space: Space, s: Strategy, rng: random.Random) -> Strategy | None:
    i = rng.randrange(len(s.pipelines))
    p = s.pipelines[i]
    m = p.microbatches * 2 if rng.random() < 0.5 else p.microbatches // 2
    m = max(1, min(m, space.max_microbatches))
    return None if m == p.microbatches else _set_pipe(s, i, replace(p, microbatches=m))


def _other(choices: tuple, current, rng: random.Random):
    others = [c for c in choices if c != current]
    return rng.choice(others) if others else None


def toggle_global(space: Space, s: Strategy, rng: random.Random) -> Strategy | None:
    """Change one global choice: schedule, sync granularity, bucket size, placement, recompute,
    precision when the space allows more than one, the host's share of a split optimizer
    (a new "split" placement draws one), and activation offload where a GPU can have a host CPU."""
    options = (("schedule", space.schedules), ("granularity", space.granularities),
               ("bucket_bytes", space.bucket_choices_bytes),
               ("placement", space.placements), ("recompute", space.recompute_choices))
    if len(space.precisions) > 1:   # else the walk draws exactly as before precision existed
        options += (("precision", space.precisions),)
    if s.placement == "split":
        options += (("cpu_fraction", space.cpu_fractions),)
    if len(space.offload_choices) > 1:
        options += (("offload", space.offload_choices),)
    if len(space.shard_choices) > 1:     # else the walk draws exactly as before sharding existed
        options += (("shard", space.shard_choices),)
    name, choices = rng.choice(options)
    v = _other(tuple(choices), getattr(s, name), rng)
    if v is None:
        return None
    if name == "placement":
        return replace(s, placement=v, cpu_fraction=rng.choice(space.cpu_fractions) if v == "split" else None)
    return replace(s, **{name: v})


def global_neighbours(space: Space, s: Strategy) -> list[Strategy]:
    """Every strategy one global choice away from `s` (each value `toggle_global` can draw, a
    split placement at each host share), and `s` interleaved or joined back to 1F1B, joined
    also under each other schedule: the neighbourhood the search's final descent tries in full."""
    options = [("schedule", space.schedules), ("granularity", space.granularities),
               ("bucket_bytes", space.bucket_choices_bytes), ("recompute", space.recompute_choices),
               ("precision", space.precisions), ("offload", space.offload_choices),
               ("shard", space.shard_choices)]
    if s.placement == "split":
        options.append(("cpu_fraction", space.cpu_fractions))
    out = [replace(s, **{name: v}) for name, choices in options for v in choices if v != getattr(s, name)]
    out += [replace(s, placement=p, cpu_fraction=f) for p, f in space.optimizer_choices()
            if p != s.placement]
    t = interleave(space, s, random.Random(0))
    if t is not None:
        out.append(t)
        if s.schedule == "interleaved-1f1b":
            out += [replace(t, schedule=x) for x in space.schedules if x != t.schedule]
    return [t for t in out if t != s and fits(space, t)]


def tensor_move(space: Space, s: Strategy, rng: random.Random) -> Strategy | None:
    """Split the whole model, or one stage of a lone pipeline with unused devices, between two
    or more devices; or change a split's devices (add or drop one), or end it on one of them.
    Shares start equal (solved by the search)."""
    free = [d for d in space.devices if d not in s.used and d not in dict(s.tensor)]
    if not s.tensor:
        if len(s.pipelines) == 1 and len(s.pipelines[0].devices) > 1 and free and rng.random() < 0.5:
            k = rng.randrange(len(s.pipelines[0].devices))
            return with_split(s, k, (s.pipelines[0].devices[k], *rng.sample(free, rng.randint(1, len(free)))))
        n = rng.randint(2, len(space.devices)) if len(space.devices) >= 2 else 0
        return even_split(s, rng.sample(space.devices, n)) if n else None
    devices, k = [d for d, _ in s.tensor], s.tensor_stage
    r = rng.random()
    if r < 0.3:
        return with_split(s, k, (rng.choice(devices),))
    if r < 0.65 and free:
        return with_split(s, k, devices + [rng.choice(free)])
    if len(devices) > 2:
        devices.remove(rng.choice(devices))
        return with_split(s, k, devices)
    return None


def interleave(space: Space, s: Strategy, rng: random.Random) -> Strategy | None:
    """1F1B -> interleaved 1F1B with v = 2: each device's layers split into two chunks (the
    first the larger), virtual stage c*p + j holding device j's chunk c, so every device keeps
    its share of the layers; back from interleaved to 1F1B, each device's chunks joined. Only
    for one pipeline of several devices, each holding at least 2 layers (see _interleavable)."""
    if s.schedule == "interleaved-1f1b":
        pipes = []
        for p in s.pipelines:
            devs, ranges = p.distinct, p.ranges(space.num_layers)
            sizes = [sum(b - a for (a, b), d in zip(ranges, p.devices) if d == x) for x in devs]
            pipes.append(replace(p, devices=devs, cuts=tuple(itertools.accumulate(sizes[:-1]))))
        return replace(s, schedule="1f1b", pipelines=tuple(pipes))
    if not space.interleave or s.schedule != "1f1b" or len(s.pipelines) != 1 or len(s.pipelines[0].devices) < 2:
        return None
    p = s.pipelines[0]
    sizes = [b - a for a, b in p.ranges(space.num_layers)]
    if min(sizes) < 2:
        return None
    chunks = [n - n // 2 for n in sizes] + [n // 2 for n in sizes]
    p = replace(p, devices=p.devices * 2, cuts=tuple(itertools.accumulate(chunks[:-1])))
    return replace(s, schedule="interleaved-1f1b", pipelines=(p,))


# (move, weight): structural moves dominate; global toggles are few and cheap to try.
MOVES = ((move_cut, 4), (split_stage, 1), (merge_stages, 1), (swap_devices, 2), (add_replica, 1),
         (remove_device, 1), (move_device, 1), (change_microbatches, 2), (toggle_global, 2))
TENSOR_MOVE = (tensor_move, 1)   # drawn only where the space allows a tensor split
INTERLEAVE_WEIGHT = 1   # drawn only where `interleave` applies, so other walks draw as before it


def _moves(space: Space, s: Strategy) -> tuple:
    out = MOVES
    if space.interleave and (s.schedule == "interleaved-1f1b" or (
            s.schedule == "1f1b" and len(s.pipelines) == 1 and len(s.pipelines[0].devices) > 1)):
        out = (*out, (interleave, INTERLEAVE_WEIGHT))
    return (*out, TENSOR_MOVE) if space.tensor_split else out


def propose(space: Space, s: Strategy, rng: random.Random, tries: int = 8) -> Strategy | None:
    """One random rewrite of one choice of `s` that stays structurally valid (or None)."""
    moves, weights = zip(*_moves(space, s))
    for _ in range(tries):
        move = rng.choices(moves, weights)[0]
        t = move(space, s, rng)
        if t is not None and t != s and fits(space, t):
            return t
    return None


# --- exhaustive enumeration (small spaces: tests and ground truth) ----------------------------
def _compositions(total: int, parts: int, lows: list[int]) -> Iterator[tuple[int, ...]]:
    if parts == 1:
        if total >= lows[0]:
            yield (total,)
        return
    for b in range(lows[0], total - sum(lows[1:]) + 1):
        for rest in _compositions(total - b, parts - 1, lows[1:]):
            yield (b, *rest)


def _pipeline_groupings(devices: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], ...]]:
    """Every set of disjoint ordered device sequences over a subset of `devices` (each set once)."""
    n = len(devices)
    for r in range(1, n + 1):
        for subset in itertools.combinations(devices, r):
            for perm in itertools.permutations(subset):
                # split the permutation into groups; canonical order: groups sorted by first element
                for mask in range(2 ** (r - 1)):
                    groups, cur = [], [perm[0]]
                    for j in range(1, r):
                        if mask >> (j - 1) & 1:
                            groups.append(tuple(cur))
                            cur = []
                        cur.append(perm[j])
                    groups.append(tuple(cur))
                    if all(devices.index(a[0]) < devices.index(b[0]) for a, b in zip(groups, groups[1:])):
                        yield tuple(groups)


def enumerate_plans(space: Space) -> Iterator[Plan]:
    """Every valid plan of a small space (all structures, cuts, batch splits, microbatch
    counts and global choices). Exponential: meant for <= 3 devices and a few layers."""
    L, B = space.num_layers, space.global_batch
    globals_ = list(itertools.product(space.schedules, space.granularities, space.bucket_choices_bytes,
                                      space.optimizer_choices(), space.recompute_choices, space.precisions,
                                      space.offload_choices))
    for groups in _pipeline_groupings(space.devices):
        cut_sets = [list(itertools.combinations(range(1, L), len(g) - 1)) for g in groups]
        for cuts in itertools.product(*cut_sets):
            for sched, gran, bucket, place, rec, prec, off in globals_:
                if off and (rec or sched == "zb-h1"):
                    continue   # offload is not used under recompute nor zb-h1 (to_plan)
                if rec and sched == "zb-h1":
                    continue   # not a valid plan (fits)
                pipes = tuple(Pipeline(g, c) for g, c in zip(groups, cuts))
                lows = [min_batch(p, sched) for p in pipes]
                if sum(lows) > B:
                    continue
                for batches in _compositions(B, len(pipes), lows):
                    mb_sets = [[m for m in range(lo, b + 1) if b % m == 0] for lo, b in zip(lows, batches)]
                    for mbs in itertools.product(*mb_sets):
                        s = Strategy(tuple(replace(p, microbatches=m) for p, m in zip(pipes, mbs)),
                                     sched, gran, bucket, place[0], rec, prec, place[1], off)
                        yield to_plan(space, s, batches)
