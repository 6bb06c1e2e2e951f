"""Training with a plan: the user's data, for a number of steps or epochs, logged, evaluated,
checkpointed and resumable (one rank's loop; hetplan.runtime.worker runs it when `RunConfig.train` is set).

Every rank runs the same steps; the collectives added here (the logged loss, the clipping norm,
evaluation, checkpoints) happen at steps every rank computes the same way, so they pair up. They
run on a gloo group of their own: the pipeline's receives, posted ahead on the world group, would
otherwise take their messages.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hetplan.planner.files.io import InputError


@dataclass(frozen=True)
class TrainConfig:
    steps: int | None = None            # the run's total steps (a resumed run continues to it)
    epochs: int | None = None           # or whole passes over train_data (its last partial batch dropped)
    seed: int = 0                       # the per-epoch shuffles' seed
    log_every: int = 10                 # a stderr line and a metrics row every K steps (and the last)
    metrics: str | None = None          # JSON lines, one row per logged step, flushed as written
    eval_every: int | None = None       # eval_data's loss and metrics every K steps (and the last)
    checkpoint_dir: str | None = None
    checkpoint_every: int | None = None  # save every K steps (and after the last)
    resume: bool = False                # continue from the latest complete checkpoint
    lr_schedule: str = "constant"       # hetplan.runtime.lr_schedule: constant, cosine, linear or a torch class
    lr_schedule_args: dict = field(default_factory=dict)
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    tensorboard: str | None = None      # a SummaryWriter directory (needs the tensorboard package)
    rebalance: int | None = None        # re-solve the batch shares every K steps (hetplan.runtime.rebalance)
    runs: int | None = None             # the steps this run makes (set by the launcher's checks): the
                                        # pipeline runners post receives ahead for exactly these

    def to_dict(self) -> dict:
        return asdict(self)


def total_steps(cfg: TrainConfig, steps_per_epoch: int | None) -> int:
    if cfg.steps is not None:
        return cfg.steps
    if steps_per_epoch is None:
        raise InputError("--epochs: the workload has no train_data; expected --steps")
    return cfg.epochs * steps_per_epoch


# --- clipping by the global norm ------------------------------------------------------------------
class GlobalNormClip:
    """torch.nn.utils.clip_grad_norm_ over the whole model: each rank sums the squares of the
    gradients it alone holds (a replicated or tied parameter on its lowest rank, a tensor-split
    slice on each, ZeRO-2/3's reduce-scattered slices on each), one all-reduce gives the norm, every
    rank scales by max_norm / (norm + 1e-6)."""

    def __init__(self, built, max_norm: float, group=None):
        self.built, self.max_norm, self.group = built, max_norm, group
        from hetplan.runtime.checkpoint import built_full_shape
        mine = [(n, tuple(p.shape) != built_full_shape(built, n, p))
                for n, p in built.named_params if p.requires_grad]
        everyone: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, mine, group=group)
        rank = dist.get_rank(group)
        owner: dict[str, int] = {}
        for r, names in enumerate(everyone):
            for n, sliced in names or []:
                owner.setdefault(n, -1 if sliced else r)     # -1: a slice, counted by its holder
        named = dict(built.named_params)
        self.counted = [named[n] for n, sliced in mine if owner[n] in (rank, -1)]
        self.params = [p for _, p in built.named_params if p.requires_grad]
        self.norm = 0.0

    def _grads(self, params) -> list[torch.Tensor]:
        sharded = getattr(self.built.optimizer, "sharded", None)   # ZeRO-2/3: the reduce-scattered slices
        if sharded is not None and sharded.scattered is not None:
            return [t for t in sharded.scattered if t is not None]
        return [p.grad for p in params if p.grad is not None]

    def __call__(self) -> None:
        sq = torch.zeros((), dtype=torch.float64)
        for g in self._grads(self.counted):
            sq += g.detach().double().pow(2).sum().cpu()
        dist.all_reduce(sq.reshape(1), group=self.group)
        self.norm = float(sq.sqrt())
        coef = self.max_norm / (self.norm + 1e-6)
        if coef < 1.0:
            for g in self._grads(self.params):
                g.mul_(coef)


# --- the loop ---------------------------------------------------------------------------------------
def train(tcfg: TrainConfig, plan, plan_sha256: str, built, rank: int, world: int, device) -> dict[str, Any]:
    """Train rank `rank`; returns {"rows": logged rows, "steps": [first, total], "iter_s": each
    step's seconds, "checkpoint_save_s": [...], "checkpoint_load_s": seconds or None}."""
    from hetplan.runtime.data import Prefetcher, pin
    from hetplan.runtime.rebalance import injected_slowdown
    run = _Run(tcfg, plan, plan_sha256, built, rank, world)
    pinned = device.native           # a real accelerator: its copies from pinned memory do not block
    reb = run.rebalancer

    def make(s: int):                # read with the shares of step s (their key kept)
        if reb is not None:
            reb.wait_known(s)
        at = reb.slice if reb is not None else None
        return at, (pin if pinned else _same)(built.microbatches(plan.global_batch, s, at))
    prefetch = Prefetcher(make, range(run.start, run.total))
    log = _Log(tcfg, rank, run.total) if rank == 0 else None
    dist.barrier(run.group)
    run.t_window = run.t0 = time.perf_counter()
    try:
        for step in range(run.start, run.total):
            lr = run.schedule.apply(step)
            t = time.perf_counter()
            at, batch = prefetch.get()
            if reb is not None and at != reb.slice:      # not expected: read under the shares in force
                batch = make(step)[1]
            built.begin()
            injected_slowdown(rank, step, built)
            loss = built.step(batch)
            local = float(loss) if loss is not None else 0.0
            _fault(rank, step + 1, "kill")
            run.iter_s.append(time.perf_counter() - t)
            row = run.after_step(step, local, lr)     # with the shares this step ran with
            if row is not None:
                run.rows.append(row)
                if log is not None:
                    log.write(row)
            if reb is not None:
                reb.after_step(step + 1)
            run.maybe_save(step + 1)
    finally:
        prefetch.close()
        if log is not None:
            log.close()
    return {"rows": run.rows, "steps": [run.start, run.total], "iter_s": run.iter_s,
            "checkpoint_save_s": run.save_s, "checkpoint_load_s": run.load_s,
            "shares": reb.history if reb is not None else [{"step": run.start, "shares": run.shares()}]}


class _Run:
    """One rank's training state besides the model: the data, the step range, the schedule, the
    clipping, what was logged and timed."""

    def __init__(self, tcfg: TrainConfig, plan, plan_sha256: str, built, rank: int, world: int):
        from hetplan.runtime import checkpoint
        from hetplan.runtime.data import DataFeed
        from hetplan.runtime.lr_schedule import LRSchedule
        from hetplan.runtime.pipeline import StageRunner
        self.tcfg, self.plan, self.sha, self.built, self.rank, self.world = tcfg, plan, plan_sha256, built, rank, world
        w = built.workload
        self.group = dist.new_group(backend="gloo")      # collective: every rank, in the same order
        self.feed = (DataFeed(w.train_data, plan.global_batch, tcfg.seed, w.collate_fn, check_items=False)
                     if w.train_data is not None else None)
        self.total = total_steps(tcfg, self.feed.steps_per_epoch if self.feed is not None else None)
        if self.feed is not None:
            w.make_batch = self.feed   # every kind of stage reads the data (a plain stage: its slice only)
        self.start, self.load_s, self.save_s = 0, None, []
        if tcfg.resume:
            meta = checkpoint.check_resumable(tcfg.checkpoint_dir, _model_ref(plan))
            t = time.perf_counter()
            checkpoint.load(meta["path"], built, rank, world, meta, plan_sha256, self.group)
            self.load_s, self.start = time.perf_counter() - t, meta["step"]
        if type(built.runner) is StageRunner:        # its receives posted ahead: for these steps only
            built.runner.runs_left = self.total - self.start
        opt = built.optimizer
        self.schedule = LRSchedule([opt.device_opt, opt.host_opt], plan.optimizer.lr, self.total,
                                   tcfg.lr_schedule, tcfg.lr_schedule_args, tcfg.warmup_steps, tcfg.min_lr_ratio)
        c = plan.optimizer.clip_grad_norm
        self.clip = GlobalNormClip(built, c, self.group) if c else None
        built.before_optimizer = self.clip
        self.rows, self.iter_s, self.n_window = [], [], 0
        self.t0 = self.t_window = 0.0
        from hetplan.runtime.rebalance import Rebalancer
        self.rebalancer = (Rebalancer(plan, built, tcfg.rebalance, self.group, self.start)
                           if tcfg.rebalance else None)

    def shares(self) -> dict[str, float]:
        """The batch shares in force: {device: fraction}."""
        if self.rebalancer is not None:
            return self.rebalancer.shares()
        G = self.plan.global_batch
        return {"+".join(st.device for st in r.stages): b / G
                for r, b in zip(self.plan.replicas, self.plan.replica_batches())}

    def epoch(self, step: int) -> int:
        return self.feed.position(step)[0] if self.feed else 0

    def after_step(self, step: int, local_loss: float, lr: float) -> dict | None:
        """The row of 0-based `step` where it is logged or evaluated (collectives on every rank)."""
        done, tcfg = step + 1, self.tcfg
        last, row = done == self.total, None
        self.n_window += 1
        if done % tcfg.log_every == 0 or last:
            now = time.perf_counter()
            row = {"step": done, "epoch": self.epoch(step), "loss": _sum(local_loss, self.group), "lr": lr,
                   "samples_per_s": self.plan.global_batch * self.n_window / max(now - self.t_window, 1e-9),
                   "eta_s": (now - self.t0) / (done - self.start) * (self.total - done), "shares": self.shares()}
            if self.clip is not None:
                row["grad_norm"] = self.clip.norm
            self.t_window, self.n_window = now, 0
        if tcfg.eval_every and (done % tcfg.eval_every == 0 or last):
            row = {**(row or {"step": done}), **evaluate(self.built, self.plan, self.group)}
        return row

    def maybe_save(self, done: int) -> None:
        from hetplan.runtime import checkpoint
        tcfg = self.tcfg
        if not tcfg.checkpoint_every or not (done % tcfg.checkpoint_every == 0 or done == self.total):
            return
        t = time.perf_counter()
        feed = self.feed
        checkpoint.save(tcfg.checkpoint_dir, done, self.built, self.rank, {
            "epoch": self.epoch(done - 1), "seed": tcfg.seed, "model": _model_ref(self.plan),
            "params": _full_shapes(self.built, self.world, self.group), "world_size": self.world,
            "plan_sha256": self.sha, "data": {"global_batch": self.plan.global_batch,
                                              "steps_per_epoch": feed.steps_per_epoch if feed else None}},
            self.group, written=lambda: _fault(self.rank, done, "kill-in-save"))
        self.save_s.append(time.perf_counter() - t)


def _fault(rank: int, step: int, where: str) -> None:
    """Test only (hetplan.runtime.startup.FAULT_ENV = "RANK:STEP:kill|kill-in-save"): SIGKILL this rank
    after step STEP, or inside the checkpoint save of step STEP once its files are written."""
    from hetplan.runtime.startup import FAULT_ENV
    spec = os.environ.get(FAULT_ENV, "")
    if spec and spec.split(":")[2] == where and (int(spec.split(":")[0]), int(spec.split(":")[1])) == (rank, step):
        os.kill(os.getpid(), signal.SIGKILL)


def _same(x):
    return x


def _sum(x: float, group) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, group=group)
    return float(t)


def _model_ref(plan) -> dict[str, Any]:
    return {"spec": plan.model.spec, "args": dict(plan.model.args), "layers": plan.model.layers}


def _full_shapes(built, world: int, group) -> dict[str, list[int]]:
    """Every parameter's full shape, gathered from the ranks (each holds its stage's)."""
    from hetplan.runtime.checkpoint import built_full_shape
    mine = {n: list(built_full_shape(built, n, p)) for n, p in built.named_params}
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine, group=group)
    out: dict[str, list[int]] = {}
    for d in everyone:
        out.update(d or {})
    return out


# --- evaluation ----------------------------------------------------------------------------------
def evaluate(built, plan, group) -> dict[str, float]:
    """eval_data's mean loss (and the workload's metrics) over every sample once, on the plan's
    devices: each replica its share of each batch, through its stages without gradients."""
    from hetplan.planner.workload.inputs import slice_inputs
    from hetplan.runtime.data import eval_batches
    w = built.workload
    runner = built.runner
    prev, nxt = getattr(runner.prev, "peer", None), getattr(runner.next, "peer", None)
    first, lastst = runner.prev is None, runner.next is None
    sums: dict[str, float] = {}
    count = 0
    G = plan.global_batch
    offsets = plan.replica_offsets() + [G]
    a_frac, b_frac = offsets[built.replica], offsets[built.replica + 1]
    was_training = built.module.training
    built.module.eval()
    with torch.no_grad(), built.whole_parameters():
        for x, y in eval_batches(w.eval_data, G, w.collate_fn):
            n = len(y)
            a, b = a_frac * n // G, b_frac * n // G
            for c in range(a, b, max(1, built.micro)):
                e = min(b, c + max(1, built.micro))
                if first:
                    args, kwargs = built._call_args(slice_inputs(x, c, e))
                    from hetplan.planner.workload.inputs import to_device
                    args, kwargs = to_device((args, kwargs), runner.device)
                    out = built.module(*args, **kwargs)
                else:
                    got = [None]
                    dist.recv_object_list(got, src=prev, group=group)
                    out = built.module(*[t.to(runner.device) for t in got[0]])
                if not lastst:
                    dist.send_object_list([[t.detach().cpu() for t in out]], dst=nxt, group=group)
                    continue
                target = slice_inputs(y, c, e).to(runner.device)
                k = e - c
                sums["eval_loss"] = sums.get("eval_loss", 0.0) + float(w.loss_fn(out[0], target)) * k
                for name, v in (w.metrics(out[0], target) if w.metrics else {}).items():
                    sums[f"eval_{name}"] = sums.get(f"eval_{name}", 0.0) + float(v) * k
                count += k
    if was_training:
        built.module.train()
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (sums, count), group=group)
    total = sum(c for _, c in everyone)
    merged: dict[str, float] = {}
    for s, _ in everyone:
        for k, v in s.items():
            merged[k] = merged.get(k, 0.0) + v
    return {k: v / max(total, 1) for k, v in sorted(merged.items())}


# --- what rank 0 writes ------------------------------------------------------------------------------
class _Log:
    """stderr lines, the metrics JSON lines file and TensorBoard scalars (where installed)."""

    def __init__(self, cfg: TrainConfig, rank: int, total: int):
        self.total = total
        self.file = open(cfg.metrics, "a" if cfg.resume else "w") if cfg.metrics else None
        self.tb = None
        if cfg.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.tb = SummaryWriter(cfg.tensorboard)
            except ImportError:
                print("hetplan run: --tensorboard: the tensorboard package is not installed; "
                      "writing no TensorBoard files", file=sys.stderr, flush=True)

    def write(self, row: dict[str, Any]) -> None:
        parts = [f"step {row['step']}/{self.total}"]
        if "loss" in row:
            parts += [f"loss {row['loss']:.4f}", f"lr {row['lr']:.3g}", f"{row['samples_per_s']:.0f} samples/s",
                      f"ETA {_eta(row['eta_s'])}"]
        parts += [f"{k} {v:.4f}" for k, v in row.items() if k.startswith("eval_")]
        print("hetplan run: " + ", ".join(parts), file=sys.stderr, flush=True)
        if self.file is not None:
            self.file.write(json.dumps(row) + "\n")
            self.file.flush()
        if self.tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, row["step"])

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.tb is not None:
            self.tb.close()


def _eta(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"
