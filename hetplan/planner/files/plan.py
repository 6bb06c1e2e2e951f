"""The plan file (`hetplan.plan/1`): one schema, one loader, read by simulate, run and compare.

A plan is a set of data-parallel replicas; each replica is a pipeline of stages over distinct
devices; each stage holds a half-open layer range [start, end). See docs/formats.md.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any

from hetplan.planner.files.io import InputError, Reader, read_json, write_json_atomic

SCHEMA = "hetplan.plan/1"
# zb-h1: zero-bubble, backward split into I and W; hippie: GPipe order but the last stage alternates
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "hippie")
GRANULARITIES = ("coarse", "fine")
# sync.mode: synchronous training, or one of the asynchronous strategies of the contract
SYNC_MODES = ("sync", "pipedream", "pipedream-2bw", "local-sgd", "easgd", "hogwild", "parameter-server")
PIPEDREAM_MODES = ("pipedream", "pipedream-2bw")   # asynchronous pipelines (hetplan.runtime.pipedream)
MODE_PARAMS = {"local-sgd": ("period",), "easgd": ("period", "alpha"), "parameter-server": ("server",)}
OPTIMIZERS = ("sgd", "adam")
PLACEMENTS = ("device", "cpu", "split")
PRECISIONS = ("fp32", "tf32", "bf16")  # bf16: torch.autocast over fp32 master weights (hetplan.planner.workload.precision)
# "shard": {"stage": N}: what the data-parallel replicas of a stage keep 1/N of, ZeRO's stages
# (stage 3, parameters too, is not priced or run in this version)
SHARD_STAGES = {0: "nothing", 1: "optimizer state", 2: "optimizer state and gradients",
                3: "optimizer state, gradients and parameters"}
DEFAULT_BUCKET_BYTES = 25 * 2**20  # torch DDP's default bucket_cap_mb=25
MAX_THREADS = 65536                # a CPU worker's intra-op threads (plan and topology files; torch takes a C int)
MAX_GLOBAL_BATCH = 2**20           # samples per iteration (plan files and --batch): a larger batch
                                   # is a typo, and enumerating or allocating it would not end


def check_batch(batch: int, where: str) -> None:
    """A global batch in [1, MAX_GLOBAL_BATCH]; InputError naming `where` otherwise."""
    if not 1 <= batch <= MAX_GLOBAL_BATCH:
        raise InputError(f"{where}: expected an integer in [1, {MAX_GLOBAL_BATCH}], got {batch}")


def min_microbatches(stages: int, schedule: str, devices: int | None = None) -> int:
    """The fewest microbatches a pipeline of `stages` stages may run: 1F1B and ZB-H1 need one per
    stage (their warm-up holds one per stage), interleaved 1F1B one per device (`devices`; and a
    multiple of it), GPipe and Hippie one."""
    if schedule == "interleaved-1f1b":
        return devices or stages
    return stages if schedule in ("1f1b", "zb-h1") else 1


@dataclass(frozen=True)
class Share:
    """One device of a tensor-split stage and its share of the split linear operators."""
    device: str
    share: float                       # in (0, 1]; a stage's shares sum to 1


@dataclass(frozen=True)
class Stage:
    device: str                        # the stage's device; under `split` the first listed
    layers: tuple[int, int]  # half-open [start, end)
    offload_activations: bool = False  # saved activations in host memory between F and B
    split: tuple[Share, ...] = ()      # the file's "devices": linear pairs split between them
                                       # (hetplan.planner.workload.tensor_split); () = on `device` alone

    @property
    def devices(self) -> tuple[str, ...]:
        """Every device running the stage: its split's, or its one device."""
        return tuple(s.device for s in self.split) if self.split else (self.device,)

    @property
    def start(self) -> int:
        return self.layers[0]

    @property
    def end(self) -> int:
        return self.layers[1]


@dataclass(frozen=True)
class Replica:
    batch_fraction: float
    microbatches: int
    stages: tuple[Stage, ...]

    @cached_property
    def devices(self) -> tuple[str, ...]:
        return tuple(d for s in self.stages for d in s.devices)

    @property
    def pipeline_devices(self) -> tuple[str, ...]:
        """The distinct devices in stage order (interleaved-1f1b: device r holds stages r, r + p, ...)."""
        return tuple(dict.fromkeys(self.devices))


@dataclass(frozen=True)
class Sync:
    granularity: str = "fine"          # "coarse": once after backward; "fine": per bucket
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    mode: str = "sync"                 # one of SYNC_MODES; "sync": gradients summed every iteration
    period: int | None = None          # local-sgd, easgd: iterations between two exchanges
    alpha: float | None = None         # easgd: the elastic force, in [0, 1]
    server: str | None = None          # parameter-server: the device holding the parameters
    average: str | None = None         # pipedream: "swa" (each stage's weights averaged over an
                                       # iteration's versions; hetplan.runtime.pipedream)


@dataclass(frozen=True)
class Optimizer:
    name: str = "adam"                 # how it is priced: "sgd" or "adam" (hetplan.planner.workload.optimizer)
    lr: float = 1e-3
    placement: str = "device"          # "device", "cpu" (ZeRO-Offload style) or "split" (CoTrain)
    cpu_fraction: float | None = None  # "split" only: the share of each stage's parameter bytes
                                       # updated on the host CPU (hetplan.planner.cost.split)
    torch_class: str | None = None     # the torch.optim class that runs ("AdamW"); None: SGD / Adam
    args: tuple[tuple[str, Any], ...] = ()   # its keyword arguments besides lr (hashable: see kwargs)
    clip_grad_norm: float | None = None   # clip the global gradient norm (every stage and replica)

    @property
    def kwargs(self) -> dict[str, Any]:
        return dict(self.args)


def frozen_args(args: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """Keyword arguments as sorted (key, value) pairs, lists as tuples (betas=[0.9, 0.95])."""
    def freeze(v):
        return tuple(freeze(x) for x in v) if isinstance(v, (list, tuple)) else v
    return tuple(sorted((str(k), freeze(v)) for k, v in args.items()))


@dataclass(frozen=True)
class ModelRef:
    spec: str                          # built-in name or "package.module:function"
    args: dict[str, Any] = field(default_factory=dict)
    layers: str | None = None          # layer pattern (hetplan.planner.workload.layers); None: automatic


@dataclass(frozen=True)
class TopologyRef:
    """The topology a plan was priced on, and the conditions `run` reproduces without it."""
    name: str
    sha256: str
    threads: tuple[tuple[str, int], ...] = ()   # each CPU worker's intra-op threads as priced
    host: str | None = None                     # the profiled host's name (None: a what-if topology)
    cpu_cores: int | None = None                # its cores


@dataclass(frozen=True)
class Predicted:
    iteration_s: float
    peak_memory_bytes: dict[str, float] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)  # baselines, per-device busy, ...
    # [lo, hi] expected to hold the measured median with interval_probability (hetplan.planner.sim.interval)
    iteration_s_interval: tuple[float, float] | None = None
    interval_probability: float | None = None


@dataclass(frozen=True)
class Plan:
    model: ModelRef
    global_batch: int
    replicas: tuple[Replica, ...]
    schedule: str = "1f1b"
    sync: Sync = Sync()
    optimizer: Optimizer = Optimizer()
    recompute: bool = False
    precision: str = "fp32"            # one of PRECISIONS
    shard: int = 0                     # ZeRO stage over the replicas (SHARD_STAGES)
    topology: TopologyRef | None = None
    predicted: Predicted | None = None

    @cached_property
    def devices(self) -> tuple[str, ...]:
        """Every device the plan runs on, once: its stages' (a split stage's every device), then a
        parameter server's (kept on the frozen plan once asked for)."""
        stages = tuple(dict.fromkeys(d for r in self.replicas for d in r.devices))
        server = self.sync.server if self.sync.mode == "parameter-server" else None
        return stages + (server,) if server is not None and server not in stages else stages

    @property
    def num_layers(self) -> int:
        return self.replicas[0].stages[-1].end

    def replica_batches(self) -> list[int]:
        """Samples per replica: round(fraction * global_batch), as the contract says."""
        return [round(r.batch_fraction * self.global_batch) for r in self.replicas]

    def replica_offsets(self) -> list[int]:
        """Index of each replica's first sample in the global batch (contiguous slices)."""
        out, acc = [], 0
        for b in self.replica_batches():
            out.append(acc)
            acc += b
        return out

    def without_prediction(self) -> "Plan":
        return replace(self, predicted=None)


# --- validation -----------------------------------------------------------------------------
def _validate_torch_optimizer(o: Optimizer, err) -> None:
    """torch_class names a torch.optim optimizer priced as `name`; clip_grad_norm is positive."""
    from hetplan.planner.files.optimizer_spec import OptimizerSpecError, check_spec
    try:
        check_spec(o.name, o.torch_class, o.kwargs)
    except OptimizerSpecError as e:
        raise err(f"optimizer.{e.field}", str(e)) from None
    c = o.clip_grad_norm
    if c is not None and not (isinstance(c, (int, float)) and 0 < c < float("inf")):
        raise err("optimizer.clip_grad_norm", f"expected a positive number, got {c!r}")


def validate_plan(plan: Plan, file: str = "<plan>", num_layers: int | None = None,
                  device_names: set[str] | None = None) -> None:
    """Check every rule of the contract; raise InputError with one line naming the field."""
    def err(field_: str, msg: str) -> InputError:
        return InputError(f"{file}: {field_}: {msg}")

    check_batch(plan.global_batch, f"{file}: global_batch")
    if not plan.replicas:
        raise err("replicas", "expected at least one replica")
    if plan.schedule not in SCHEDULES:
        raise err("schedule", f"expected one of {', '.join(SCHEDULES)}, got {plan.schedule!r}")
    if plan.sync.granularity not in GRANULARITIES:
        raise err("sync.granularity", f"expected one of {', '.join(GRANULARITIES)}, got {plan.sync.granularity!r}")
    if plan.sync.bucket_bytes < 1:
        raise err("sync.bucket_bytes", f"expected a positive integer, got {plan.sync.bucket_bytes}")
    _validate_mode(plan, err)
    if plan.optimizer.name not in OPTIMIZERS:
        raise err("optimizer.name", f"expected one of {', '.join(OPTIMIZERS)}, got {plan.optimizer.name!r}")
    if plan.optimizer.placement not in PLACEMENTS:
        raise err("optimizer.placement", f"expected one of {', '.join(PLACEMENTS)}, got {plan.optimizer.placement!r}")
    f = plan.optimizer.cpu_fraction
    if plan.optimizer.placement == "split" and (f is None or not 0 < f < 1):
        raise err("optimizer.cpu_fraction", f"expected a number in (0, 1) with placement \"split\", got {f}")
    if plan.optimizer.placement != "split" and f is not None:
        raise err("optimizer.cpu_fraction", f"expected only with placement \"split\", got it with "
                                            f"{plan.optimizer.placement!r}")
    if plan.precision not in PRECISIONS:
        raise err("precision", f"expected one of {', '.join(PRECISIONS)}, got {plan.precision!r}")
    _validate_shard(plan, err)
    if plan.schedule == "zb-h1" and plan.recompute:
        raise err("recompute", "expected false with schedule \"zb-h1\" (recomputing for a split "
                               "backward is not supported)")
    if not plan.optimizer.lr > 0:
        raise err("optimizer.lr", f"expected a positive number, got {plan.optimizer.lr}")
    _validate_torch_optimizer(plan.optimizer, err)
    L = num_layers if num_layers is not None else plan.num_layers
    seen: dict[str, str] = {}   # device -> the first stage field naming it
    batches = plan.replica_batches()
    for i, rep in enumerate(plan.replicas):
        _validate_replica(plan, i, batches[i], L, seen, device_names, err)
    total = sum(rep.batch_fraction for rep in plan.replicas)
    if abs(total - 1.0) > 1e-6:
        raise err("replicas", f"batch_fraction values sum to {total:.6g}; expected 1")
    server = plan.sync.server
    if server is not None and device_names is not None and server not in device_names:
        raise err("sync.server", f"expected a device of the topology ({', '.join(sorted(device_names))}), got {server!r}")
    if sum(batches) != plan.global_batch:
        raise err("replicas", f"replica batches {batches} (round(fraction * global_batch)) sum to "
                              f"{sum(batches)}; expected global_batch {plan.global_batch}")


def _validate_replica(plan: Plan, i: int, batch: int, L: int, seen: dict[str, str], device_names, err) -> None:
    """Replica i (of `batch` samples): its fraction, microbatches and stages covering [0, L) in order."""
    rep = plan.replicas[i]
    where = f"replicas[{i}]"
    if not 0 < rep.batch_fraction <= 1:
        raise err(f"{where}.batch_fraction", f"expected a number in (0, 1], got {rep.batch_fraction}")
    if rep.microbatches < 1:
        raise err(f"{where}.microbatches", f"expected a positive integer, got {rep.microbatches}")
    if batch < 1:
        raise err(f"{where}.batch_fraction",
                  f"gives round({rep.batch_fraction} * {plan.global_batch}) = 0 samples; expected at least 1")
    if batch % rep.microbatches:
        raise err(f"{where}.microbatches",
                  f"expected a divisor of the replica's batch {batch}, got {rep.microbatches}")
    if not rep.stages:
        raise err(f"{where}.stages", "expected at least one stage")
    if plan.schedule in ("interleaved-1f1b", "zb-h1") and any(st.split for st in rep.stages):
        raise err("schedule", f"expected gpipe, 1f1b or hippie with a tensor-split stage ({plan.schedule} is not "
                              "supported together in this version)")
    if plan.schedule == "interleaved-1f1b":
        _validate_interleaved(rep, where, err)
    elif rep.microbatches < min_microbatches(len(rep.stages), plan.schedule):
        raise err(f"{where}.microbatches",
                  f"{plan.schedule} needs microbatches >= stages ({len(rep.stages)}), got {rep.microbatches}")
    expect_start = 0
    for j, st in enumerate(rep.stages):
        sw = f"{where}.stages[{j}]"
        start, end = st.layers
        if start != expect_start:
            raise err(f"{sw}.layers", f"expected to start at layer {expect_start} (stages cover [0, L) in order), got {start}")
        if end <= start:
            raise err(f"{sw}.layers", f"expected a non-empty range [start, end), got [{start}, {end}]")
        expect_start = end
        _validate_stage(plan, i, j, seen, device_names, err)
    if expect_start != L:
        raise err(f"{where}.stages[{len(rep.stages) - 1}].layers",
                  f"expected the last stage to end at layer {L} (the model has {L} layers), got {expect_start}")


def _validate_stage(plan: Plan, i: int, j: int, seen: dict[str, str], device_names, err) -> None:
    """Stage j of replica i: its split, its devices (of the topology, each in one stage but
    for interleaved 1F1B), its activation offload."""
    where, st = f"replicas[{i}]", plan.replicas[i].stages[j]
    sw = f"{where}.stages[{j}]"
    if st.split:
        _validate_split(plan, i, j, err)
    for k, d in enumerate(st.devices):
        df = f"{sw}.devices[{k}].device" if st.split else f"{sw}.device"
        if device_names is not None and d not in device_names:
            raise err(df, f"expected a device of the topology ({', '.join(sorted(device_names))}), got {d!r}")
        if d in seen and not (plan.schedule == "interleaved-1f1b" and not st.split
                              and seen[d].startswith(where + ".")):
            raise err(df, f"device {d!r} is already used by {seen[d]}; expected distinct devices"
                          + ("" if plan.schedule == "interleaved-1f1b" else
                             " (a device holds several stages of one replica only under "
                             "schedule \"interleaved-1f1b\")"))
        seen.setdefault(d, sw)
    if st.offload_activations and st.device.split("/")[-1].startswith("cpu:"):
        raise err(f"{sw}.offload_activations", f"expected only on an accelerator stage "
                                               f"(a CPU's activations are in host memory), got it on {st.device!r}")
    if st.offload_activations and plan.schedule == "zb-h1":
        raise err(f"{sw}.offload_activations", "expected false with schedule \"zb-h1\" (its "
                                               "weight-gradient pass reads the activations again; not supported)")
    if st.offload_activations and plan.recompute:
        raise err(f"{sw}.offload_activations", "expected false with recompute (recompute keeps "
                                               "only the stage input; offload it or recompute, not both)")


def _validate_split(plan: Plan, i: int, j: int, err) -> None:
    """A tensor-split stage ("devices"): two or more entries, shares in (0, 1] summing to 1, and
    what this version runs: one replica, synchronous, optimizer on the devices, neither
    recompute nor activation offload on the split stage (nor interleaved-1f1b: validate_plan)."""
    st, sw = plan.replicas[i].stages[j], f"replicas[{i}].stages[{j}]"
    if len(st.split) < 2:
        raise err(f"{sw}.devices", f"expected at least two devices to split the stage between, got {len(st.split)}")
    for k, sh in enumerate(st.split):
        if not 0 < sh.share <= 1:
            raise err(f"{sw}.devices[{k}].share", f"expected a number in (0, 1], got {sh.share}")
    total = sum(sh.share for sh in st.split)
    if abs(total - 1.0) > 1e-6:
        raise err(f"{sw}.devices", f"share values sum to {total:.6g}; expected 1")
    if len(plan.replicas) > 1:
        raise err(f"{sw}.devices", "a tensor-split stage needs a plan of one replica (one pipeline) "
                                   f"in this version; got {len(plan.replicas)} replicas")
    if st.offload_activations:
        raise err(f"{sw}.offload_activations", "expected false on a tensor-split stage (not supported)")
    if plan.recompute:
        raise err("recompute", "expected false with a tensor-split stage (not supported)")
    if plan.optimizer.placement != "device":
        raise err("optimizer.placement", f"expected \"device\" with a tensor-split stage, got "
                                         f"{plan.optimizer.placement!r}")
    if plan.sync.mode != "sync":
        raise err("sync.mode", f"expected \"sync\" with a tensor-split stage, got {plan.sync.mode!r}")


def _validate_interleaved(rep: Replica, where: str, err) -> None:
    """interleaved-1f1b: p distinct devices hold v = stages / p virtual stages each, stage k on
    the device of stage k mod p (so consecutive stages are on different devices); microbatches
    a multiple of p (Megatron's rule); no offloaded activations (not modelled for it)."""
    devs = rep.pipeline_devices
    p, n = len(devs), len(rep.stages)
    if n > 1 and p < 2:
        raise err(f"{where}.stages", f"interleaved-1f1b needs at least 2 devices in a pipeline of several "
                                     f"stages; got {n} stages all on {devs[0]!r}")
    for k, st in enumerate(rep.stages):
        if st.device != devs[k % p]:
            raise err(f"{where}.stages[{k}].device",
                      f"interleaved-1f1b expects stage {k} on {devs[k % p]!r} (stage k on the device of "
                      f"stage k mod {p}, the first {p} stages' distinct devices), got {st.device!r}")
        if st.offload_activations:
            raise err(f"{where}.stages[{k}].offload_activations",
                      "expected false under interleaved-1f1b (not supported together in this version)")
    if n % p:
        raise err(f"{where}.stages", f"interleaved-1f1b expects a multiple of the {p} devices' count of "
                                     f"stages (v virtual stages per device), got {n}")
    if rep.microbatches % p:
        raise err(f"{where}.microbatches", f"interleaved-1f1b needs microbatches a multiple of the pipeline's "
                                           f"{p} devices, got {rep.microbatches}")


def _validate_mode(plan: Plan, err) -> None:
    """sync.mode and its parameters: known, present where the mode needs them, absent elsewhere;
    and the plan's shape one the mode runs in this version."""
    sync = plan.sync
    if sync.mode not in SYNC_MODES:
        raise err("sync.mode", f"expected one of {', '.join(SYNC_MODES)}, got {sync.mode!r}")
    needed = MODE_PARAMS.get(sync.mode, ())
    given = {"period": sync.period, "alpha": sync.alpha, "server": sync.server, "average": sync.average}
    for name, value in given.items():
        if value is None and name in needed:
            raise err(f"sync.{name}", f"expected a value: sync.mode {sync.mode!r} needs it")
        allowed = needed + (("average",) if sync.mode == "pipedream" else ())
        if value is not None and name not in allowed:
            raise err(f"sync.{name}", f"applies only to sync.mode "
                      f"{' or '.join(m for m, ps in MODE_PARAMS.items() if name in ps) or 'pipedream'}; "
                      f"this plan's mode is {sync.mode!r}")
    if sync.period is not None and sync.period < 1:
        raise err("sync.period", f"expected a positive integer, got {sync.period}")
    if sync.alpha is not None and not 0 <= sync.alpha <= 1:
        raise err("sync.alpha", f"expected a number in [0, 1], got {sync.alpha}")
    if sync.average is not None and sync.average != "swa":
        raise err("sync.average", f"expected \"swa\", got {sync.average!r}")
    if sync.mode in PIPEDREAM_MODES:
        _validate_pipedream(plan, err)
    elif sync.mode != "sync":
        for i, rep in enumerate(plan.replicas):
            if len(rep.stages) > 1:
                raise err(f"replicas[{i}].stages", f"sync.mode {sync.mode!r} needs one-stage replicas "
                                                   f"(data parallel) in this version; got {len(rep.stages)} stages")
    if sync.mode == "parameter-server":
        if any(st.device == sync.server for r in plan.replicas for st in r.stages):
            raise err("sync.server", f"expected a device no replica uses (a dedicated server), got {sync.server!r}")
    if sync.mode == "hogwild":      # the replicas share one copy of the parameters in memory
        nodes = {d.split("/", 1)[0] if "/" in d else "" for d in plan.devices}
        cpus = all(d.split("/")[-1].startswith("cpu:") for d in plan.devices)
        if len(nodes) > 1 or not cpus:
            raise err("sync.mode", f"hogwild needs CPU devices of one node (they share the parameters "
                                   f"in memory); got {', '.join(plan.devices)}")


def _validate_shard(plan: Plan, err) -> None:
    """Sharding (ZeRO stages 1 to 3) needs what it shards over: two or more synchronous replicas
    whose stages hold the same layers (stage j's shard group is stage j of every replica), each
    stage on one device, the optimizer on the devices or their hosts (not split); stage 3 without recompute (its gathers
    are wired into the forward that recompute would run again) and with as many microbatches in
    every replica (their gathers and releases are the group's collectives)."""
    if plan.shard not in SHARD_STAGES:
        raise err("shard.stage", f"expected one of {', '.join(map(str, SHARD_STAGES))}, got {plan.shard!r}")
    if plan.shard == 0:
        return
    why = f"with shard.stage {plan.shard}"
    if plan.shard == 3 and plan.recompute:
        raise err("recompute", f"expected false {why} in this version")
    for i, rep in enumerate(plan.replicas):     # each microbatch's gathers are collectives of the group
        if plan.shard == 3 and rep.microbatches != plan.replicas[0].microbatches:
            raise err(f"replicas[{i}].microbatches", f"expected replicas[0]'s {plan.replicas[0].microbatches} "
                                                     f"{why} (each microbatch gathers the parameters), got {rep.microbatches}")
    if len(plan.replicas) < 2:
        raise err("shard.stage", f"expected two or more replicas to shard over {why}, got {len(plan.replicas)}")
    if plan.sync.mode != "sync":
        raise err("sync.mode", f"expected \"sync\" {why}, got {plan.sync.mode!r}")
    if plan.optimizer.placement == "split":
        raise err("optimizer.placement", f"expected \"device\" or \"cpu\" {why} (a split of sharded state "
                                         f"is not supported), got \"split\"")
    from hetplan.planner.files.optimizer_spec import ELEMENTWISE, DEFAULT_CLASS
    cls = plan.optimizer.torch_class or DEFAULT_CLASS.get(plan.optimizer.name)
    if cls is not None and cls.split(".")[-1] not in ELEMENTWISE:
        raise err("optimizer.torch_class", f"expected an element-wise optimizer {why} (each replica steps "
                                           f"slices of the tensors): one of {', '.join(ELEMENTWISE)}; got {cls!r}")
    layers = [tuple(st.layers for st in r.stages) for r in plan.replicas]
    for i, rep in enumerate(plan.replicas):
        if layers[i] != layers[0]:
            raise err(f"replicas[{i}].stages", f"expected the layers of replicas[0]'s stages {why} "
                                               f"({[list(x) for x in layers[0]]}), got {[list(x) for x in layers[i]]}")
        for j, st in enumerate(rep.stages):
            if st.split:
                raise err(f"replicas[{i}].stages[{j}].devices", f"expected one device a stage {why}")
            if st.offload_activations:
                raise err(f"replicas[{i}].stages[{j}].offload_activations", f"expected false {why}")


def _validate_pipedream(plan: Plan, err) -> None:
    """PipeDream and 2BW run one pipeline (1F1B without flush) whose stages update their own
    weights on the device; what this version does not combine with them is refused."""
    mode = plan.sync.mode
    if len(plan.replicas) != 1:
        raise err("replicas", f"sync.mode {mode!r} needs one replica (a single pipeline) in this version; "
                              f"got {len(plan.replicas)}")
    if plan.schedule != "1f1b":
        raise err("schedule", f"sync.mode {mode!r} runs 1f1b (without flush); got {plan.schedule!r}")
    if plan.recompute:
        raise err("recompute", f"expected false with sync.mode {mode!r} in this version")
    if plan.optimizer.placement != "device":
        raise err("optimizer.placement", f"expected \"device\" with sync.mode {mode!r} in this version "
                                         f"(each stage steps after its backwards); got {plan.optimizer.placement!r}")
    for j, st in enumerate(plan.replicas[0].stages):
        if st.offload_activations:
            raise err(f"replicas[0].stages[{j}].offload_activations",
                      f"expected false with sync.mode {mode!r} in this version")


# --- file format ---------------------------------------------------------------------------
def plan_from_dict(data: Any, file: str = "<plan>") -> Plan:
    r = Reader(data, file)
    r.only(_FIELDS[""])
    schema = r.get("schema", str, default=SCHEMA)
    if schema != SCHEMA:
        raise r.error("schema", f"expected {SCHEMA!r}, got {schema!r}")
    m = r.sub("model")
    m.only(_FIELDS["model"])
    model = ModelRef(spec=m.get("spec", str), args=dict(m.get("args", dict, default={})),
                     layers=m.get("layers", str, default=None, check=lambda v: bool(v.strip()),
                                  expected="a module name pattern such as \"model.layers.*\""))
    replicas = []
    for rr in r.readers("replicas"):
        rr.only(_FIELDS["replica"])
        stages = []
        for s in rr.readers("stages"):
            s.only(_FIELDS["stage"])
            lay = s.get("layers", list, check=lambda v: len(v) == 2 and all(
                isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v),
                expected="[start, end] with non-negative integers")
            split = _read_split(s)
            stages.append(Stage(device=split[0].device if split else s.get("device", str),
                                layers=(lay[0], lay[1]),
                                offload_activations=s.get("offload_activations", bool, default=False),
                                split=split))
        replicas.append(Replica(batch_fraction=rr.get("batch_fraction", float),
                                microbatches=rr.get("microbatches", int, default=1),
                                stages=tuple(stages)))
    sync = Sync()
    if r.has("sync"):
        s = r.sub("sync")
        s.only(_FIELDS["sync"])
        sync = Sync(granularity=s.get("granularity", str, default=sync.granularity),
                    bucket_bytes=s.get("bucket_bytes", int, default=sync.bucket_bytes),
                    mode=s.get("mode", str, default=sync.mode),
                    period=s.get("period", int, default=None),
                    alpha=s.get("alpha", float, default=None),
                    server=s.get("server", str, default=None),
                    average=s.get("average", str, default=None))
    opt = Optimizer()
    if r.has("optimizer"):
        o = r.sub("optimizer")
        o.only(_FIELDS["optimizer"])
        opt = Optimizer(name=o.get("name", str, default=opt.name), lr=o.get("lr", float, default=opt.lr),
                        placement=o.get("placement", str, default=opt.placement),
                        cpu_fraction=o.get("cpu_fraction", float, default=None),
                        torch_class=o.get("torch_class", str, default=None),
                        args=frozen_args(o.get("args", dict, default={})),
                        clip_grad_norm=o.get("clip_grad_norm", float, default=None))
    topo = None
    if r.has("topology"):
        t = r.sub("topology")
        t.only(_FIELDS["topology"])
        threads = t.get("threads", dict, default={})
        for d, n in threads.items():
            if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_THREADS:
                raise t.error(f"threads.{d}", f"expected an integer in [1, {MAX_THREADS}], got {json.dumps(n)}")
        topo = TopologyRef(name=t.get("name", str), sha256=t.get("sha256", str),
                           threads=tuple(sorted(threads.items())), host=t.get("host", str, default=None),
                           cpu_cores=t.get("cpu_cores", int, default=None, check=lambda v: v >= 1,
                                           expected="a positive integer"))
    pred = _read_predicted(r.sub("predicted")) if r.has("predicted") else None
    shard = 0
    if r.has("shard"):
        sh = r.sub("shard")
        sh.only(_FIELDS["shard"])
        shard = sh.get("stage", int, check=lambda v: v in SHARD_STAGES,
                       expected=f"one of {', '.join(map(str, SHARD_STAGES))}")
    plan = Plan(model=model, global_batch=r.get("global_batch", int), replicas=tuple(replicas),
                schedule=r.get("schedule", str, default="1f1b"), sync=sync, optimizer=opt,
                recompute=r.get("recompute", bool, default=False),
                precision=r.get("precision", str, default="fp32"), shard=shard, topology=topo, predicted=pred)
    validate_plan(plan, file)
    return plan


# each object's fields (Reader.only); `model.args`, `optimizer.args`, `topology.threads` and
# `predicted`'s extras (baselines, search, time_to_loss, ...) are free-form
_FIELDS = {
    "": ("schema", "model", "global_batch", "topology", "replicas", "schedule", "sync", "optimizer",
         "recompute", "precision", "shard", "predicted"),
    "model": ("spec", "args", "layers"),
    "shard": ("stage",),
    "replica": ("batch_fraction", "microbatches", "stages"),
    "stage": ("device", "devices", "layers", "offload_activations"),
    "share": ("device", "share"),
    "sync": ("granularity", "bucket_bytes", "mode", "period", "alpha", "server", "average"),
    "optimizer": ("name", "lr", "placement", "cpu_fraction", "torch_class", "args", "clip_grad_norm"),
    "topology": ("name", "sha256", "threads", "host", "cpu_cores"),
}


def _read_predicted(p: Reader) -> Predicted:
    """`predicted`: a positive iteration time, non-negative finite memory figures per device and,
    when the plan was chosen by time to loss, its target, iterations and seconds as numbers."""
    peak = p.sub("peak_memory_bytes") if p.has("peak_memory_bytes") else None
    memory = {str(k): peak.get(k, float, check=lambda v: v >= 0, expected="a non-negative number of bytes")
              for k in peak.data} if peak is not None else {}
    if p.has("time_to_loss"):
        t = p.sub("time_to_loss")
        t.get("target_loss", float)
        for key in ("iterations", "time_s"):
            t.get(key, float, check=lambda v: v >= 0, expected="a non-negative number")
    interval, probability = None, None
    if p.has("iteration_s_interval") or p.has("interval_probability"):
        bounds = p.get("iteration_s_interval", list)
        if not (len(bounds) == 2 and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in bounds)
                and 0 < bounds[0] <= bounds[1] < math.inf):
            raise p.error("iteration_s_interval", f"expected [lo, hi] with 0 < lo <= hi, finite, got {str(bounds)[:60]}")
        interval = (float(bounds[0]), float(bounds[1]))
        probability = p.get("interval_probability", float, check=lambda v: 0 < v < 1,
                            expected="a probability between 0 and 1")
    own = ("iteration_s", "peak_memory_bytes", "iteration_s_interval", "interval_probability")
    return Predicted(iteration_s=p.get("iteration_s", float, check=lambda v: v > 0, expected="a positive number"),
                     peak_memory_bytes=memory, extra={k: v for k, v in p.data.items() if k not in own},
                     iteration_s_interval=interval, interval_probability=probability)


def _read_split(s: Reader) -> tuple[Share, ...]:
    """A stage's "devices" ([{"device", "share"}, ...]), or () when it has "device" instead."""
    if not s.has("devices"):
        return ()
    if s.has("device"):
        raise s.error("devices", "expected either \"device\" or \"devices\", not both")
    shares = s.readers("devices")
    for e in shares:
        e.only(_FIELDS["share"])
    return tuple(Share(e.get("device", str), e.get("share", float)) for e in shares)


def _stage_dict(s: Stage) -> dict[str, Any]:
    where = ({"devices": [{"device": x.device, "share": x.share} for x in s.split]} if s.split
             else {"device": s.device})
    return {**where, "layers": list(s.layers), **({"offload_activations": True} if s.offload_activations else {})}


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    out: dict[str, Any] = {
        "schema": SCHEMA,
        "model": {"spec": plan.model.spec, "args": dict(plan.model.args)},
        "global_batch": plan.global_batch,
    }
    if plan.model.layers is not None:
        out["model"]["layers"] = plan.model.layers
    if plan.topology is not None:
        t = plan.topology
        out["topology"] = {"name": t.name, "sha256": t.sha256,
                           **({"threads": dict(t.threads)} if t.threads else {}),
                           **({"host": t.host} if t.host is not None else {}),
                           **({"cpu_cores": t.cpu_cores} if t.cpu_cores is not None else {})}
    out["replicas"] = [
        {"batch_fraction": r.batch_fraction, "microbatches": r.microbatches,
         "stages": [_stage_dict(s) for s in r.stages]}
        for r in plan.replicas]
    out["schedule"] = plan.schedule
    out["sync"] = {"granularity": plan.sync.granularity, "bucket_bytes": plan.sync.bucket_bytes}
    if plan.sync.mode != "sync":     # a synchronous plan's file stays as before modes existed
        out["sync"]["mode"] = plan.sync.mode
        for name in ("period", "alpha", "server", "average"):
            if getattr(plan.sync, name) is not None:
                out["sync"][name] = getattr(plan.sync, name)
    out["optimizer"] = {"name": plan.optimizer.name, "lr": plan.optimizer.lr,
                        "placement": plan.optimizer.placement}
    for key in ("cpu_fraction", "torch_class", "clip_grad_norm"):
        if getattr(plan.optimizer, key) is not None:
            out["optimizer"][key] = getattr(plan.optimizer, key)
    if plan.optimizer.args:
        out["optimizer"]["args"] = {k: list(v) if isinstance(v, tuple) else v for k, v in plan.optimizer.args}
    out["recompute"] = plan.recompute
    out["precision"] = plan.precision
    if plan.shard:                     # an unsharded plan's file stays as before sharding existed
        out["shard"] = {"stage": plan.shard}
    if plan.predicted is not None:
        pr = plan.predicted
        out["predicted"] = {"iteration_s": pr.iteration_s,
                            **({"iteration_s_interval": list(pr.iteration_s_interval),
                                "interval_probability": pr.interval_probability}
                               if pr.iteration_s_interval is not None else {}),
                            "peak_memory_bytes": dict(pr.peak_memory_bytes), **_finite_or_null(pr.extra)}
    return out


def _finite_or_null(v: Any) -> Any:
    """`v` with every infinite or NaN float of it as None (JSON null): in `predicted`'s extras an
    infinite time is a baseline that needs a link the topology lacks, or a target loss a candidate
    never reaches, and a JSON file has no infinity."""
    if isinstance(v, float):
        return v if v == v and abs(v) != float("inf") else None
    if isinstance(v, dict):
        return {k: _finite_or_null(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_finite_or_null(x) for x in v]
    return v


def load_plan(path: str | Path) -> Plan:
    return plan_from_dict(read_json(path, "plan file"), str(path))


def save_plan(plan: Plan, path: str | Path) -> None:
    write_json_atomic(path, plan_to_dict(plan))


def plan_key(plan: Plan) -> str:
    """A stable identity of the strategy (no prediction), for caches and dedup in search."""
    d = plan_to_dict(plan.without_prediction())
    d.pop("topology", None)
    return json.dumps(d, sort_keys=True)


__all__ = ["Plan", "Replica", "Stage", "Share", "Sync", "Optimizer", "ModelRef", "TopologyRef", "Predicted",
           "validate_plan", "check_batch", "MAX_GLOBAL_BATCH", "min_microbatches", "plan_from_dict", "plan_to_dict", "load_plan", "save_plan",
           "plan_key", "InputError", "SCHEDULES", "GRANULARITIES", "SYNC_MODES", "PIPEDREAM_MODES", "OPTIMIZERS", "PLACEMENTS", "PRECISIONS", "SHARD_STAGES"]
