"""One rank of `hetplan run`: the single env:// worker function.

It runs the same way under the local launcher (hetplan.runtime.launch sets RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT and calls `run_worker`) and under torchrun
(`torchrun ... -m hetplan.runtime.worker PLAN [-o MEASURED] [--iters N] ...`). Each rank maps itself to
one plan device (hetplan.runtime.placement.my_device), builds its stage, trains `iters` iterations as
the plan says, and rank 0 gathers every rank's record and writes the measured file atomically.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path

from hetplan.planner.hardware.cores import bind_worker
from hetplan.runtime.placement import local_threads, my_device, threads_affinity
from hetplan.runtime.startup import FAULT_ENV


@dataclass(frozen=True)
class RunConfig:
    plan: str                                 # plan file path
    iters: int = 10                           # iterations to run
    warmup: int = 2                           # iterations left out of the median
    out: str = "measured.json"                # rank 0 writes the measured file here
    trace_dir: str | None = None              # torch.profiler Chrome trace per rank
    save_params: str | None = None            # rank 0 saves the final parameters (torch.save)
    threads: dict[str, int] = field(default_factory=dict)   # device -> intra-op threads
    timeout_s: float = 60.0                   # collective timeout (a dead peer ends a wait)
    error_dir: str | None = None              # each failing rank writes rank<R>.txt here
    extra: dict = field(default_factory=dict)  # copied into the measured file (e.g. topology)
    train: dict | None = None                 # hetplan.runtime.train.TrainConfig as a dict: train on the
                                              # workload's data instead of timing `iters` batches
    quiet: bool = False                       # no progress lines (`plan --confirm`'s runs)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(text: str) -> "RunConfig":
        return RunConfig(**json.loads(text))


def run_worker(cfg: RunConfig, marks=None, given=None) -> list | None:
    """Train the plan on this rank (env:// rendezvous) and, on rank 0, write the results.
    `marks` (hetplan.runtime.startup.Marks) collects the start-up marks; saved as startup-rank<R>.json
    in `cfg.error_dir` when the run ends well. `given`: the workload (hetplan.train) instead of
    the plan's model.spec. Training (cfg.train) returns the logged rows."""
    import torch
    import torch.distributed as dist

    from hetplan.planner.hardware.device import memory_cap, torch_device
    from hetplan.planner.hardware.host_memory import keep_freed_memory
    from hetplan.planner.files.io import file_sha256
    from hetplan.planner.files.plan import load_plan
    from hetplan.runtime import stage
    from hetplan.runtime.gloo_threads import NICE, lower_gloo_loop_priority, short_slices, threads_slices
    from hetplan.runtime.rebalance import SHARED_NICE
    from hetplan.runtime.results import build_measured

    from hetplan.runtime.startup import Marks
    marks = marks or Marks()
    marks.mark("imported")
    keep_freed_memory()
    env = os.environ
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    plan = load_plan(cfg.plan)
    if world != len(plan.devices):
        raise ValueError(f"WORLD_SIZE is {world} but the plan has {len(plan.devices)} devices")
    name = my_device(plan.devices, env)
    device = torch_device(name)
    # before the worker starts any thread: they all inherit its cores
    local = local_threads(plan.devices, name, cfg.threads)
    cores, cores_line = bind_worker(local, name)
    short_slices()                 # inherited by every thread it starts (hetplan.runtime.gloo_threads)
    torch.set_num_threads(dict(local)[name])
    device.set_current()
    if (cap := memory_cap()) is not None:
        device.cap_memory(cap)     # a smaller card (benchmarks/capped.py)
    timeout = timedelta(seconds=cfg.timeout_s)
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world, timeout=timeout)
    try:
        names: list = [None] * world
        dist.all_gather_object(names, name)
        if sorted(names) != sorted(plan.devices):
            raise ValueError(f"ranks map to devices {names}; expected each plan device once")
        marks.mark("rendezvous")
        runs = (cfg.train or {}).get("runs") or cfg.iters     # training: the steps to make
        built = stage.build(plan, names, rank, device, timeout, marks, file=cfg.plan, iterations=runs,
                            given=given)
        # after every group exists (hetplan.runtime.gloo_threads); rebalancing expects other loads
        lower_gloo_loop_priority(SHARED_NICE if (cfg.train or {}).get("rebalance") else NICE)
        marks.mark("stages")
        if cfg.train is not None:
            return _train_with_data(cfg, plan, built, rank, world, device, cores_line)
        if rank == 0 and not cfg.quiet:      # after the model check: bad input stays one line on stderr
            print(f"hetplan run: {world} worker(s) on {', '.join(plan.devices)}; {cfg.iters} iterations; "
                  f"{cores_line}", file=sys.stderr, flush=True)
        record = {**_train(cfg, plan, built, rank, device, name, marks), "cores": cores,
                  "affinity": threads_affinity(), "slices_ns": threads_slices()}
        records: list = [None] * world if rank == 0 else None
        dist.gather_object(record, records, dst=0)
        params = _gather_params(cfg, built, rank, world)
        if rank == 0:
            result = build_measured(file_sha256(cfg.plan), records, cfg.warmup, {
                "iters": cfg.iters, "warmup": cfg.warmup, "world_size": world,
                "timing": "iteration 0: max over ranks from a common barrier; then the mean over ranks of the time between iteration ends, data loading left out", **cfg.extra})
            if params is not None:
                import torch
                from hetplan.planner.files.io import replace_atomically
                replace_atomically(cfg.save_params, lambda tmp: torch.save(params, tmp))
            from hetplan.planner.files.measured import measured_from_dict, save_measured
            save_measured(measured_from_dict({"schema": "hetplan.measured/1", **result}, cfg.out),
                          cfg.out)
        # Tear down together: a rank that destroys its gloo groups while a peer is still inside
        # the last gather aborted that peer (SIGABRT, "terminate called without an active
        # exception"), and torchrun's other agent then waited for ever (test_torchrun_two_nodes).
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if cfg.error_dir:
        marks.save(Path(cfg.error_dir, f"startup-rank{rank}.json"))


def _train_with_data(cfg, plan, built, rank, world, device, cores_line) -> list:
    """hetplan.runtime.train's loop; rank 0 writes {"rows", "steps", "iteration_s"} to cfg.out and the
    final parameters to cfg.save_params."""
    import statistics

    import torch.distributed as dist

    from hetplan.planner.files.io import file_sha256, write_json_atomic
    from hetplan.runtime.train import TrainConfig, train
    tcfg = TrainConfig(**cfg.train)
    if rank == 0:
        print(f"hetplan run: {world} worker(s) on {', '.join(plan.devices)}; training; {cores_line}",
              file=sys.stderr, flush=True)
    out = train(tcfg, plan, file_sha256(cfg.plan), built, rank, world, device)
    params = _gather_params(cfg, built, rank, world)
    if rank == 0:
        if params is not None:
            import torch
            from hetplan.planner.files.io import replace_atomically
            replace_atomically(cfg.save_params, lambda tmp: torch.save(params, tmp))
        kept = out["iter_s"][min(cfg.warmup, max(len(out["iter_s"]) - 1, 0)):]
        if cfg.out:
            import torch
            from hetplan.planner.files.measured import SCHEMA
            # a measured file (`compare` reads it) with the training run's own record beside
            write_json_atomic(cfg.out, {"schema": SCHEMA, "plan_sha256": file_sha256(cfg.plan),
                                        "losses": [r["loss"] for r in out["rows"] if "loss" in r],
                                        "torch": torch.__version__,
                                        "rows": out["rows"], "steps": out["steps"],
                                        "iteration_s": statistics.median(kept) if kept else None,
                                        "iterations_s": out["iter_s"],
                                        "checkpoint_save_s": out["checkpoint_save_s"],
                                        "checkpoint_load_s": out["checkpoint_load_s"],
                                        "shares": out["shares"]})
    dist.barrier()
    return out["rows"]


def _train(cfg, plan, built, rank, device, name, marks) -> dict:
    import torch

    from hetplan.runtime.instruments import MemoryTracker, minor_faults
    param_bytes = sum(p.numel() * p.element_size() for p in built.params)
    timer, mem = built.timer, MemoryTracker(device.device, param_bytes)
    fault = os.environ.get(FAULT_ENV, "")
    iter_s, busy_s, losses, faults, events = [], [], [], [], None
    shown = -1e9                                   # progress on stderr at most once a second
    prof = _profiler(cfg, device)
    with prof:
        built.groups.barrier()              # one barrier: the ranks start together, then run
        device.synchronize()                # free, as under torchrun (see hetplan.runtime.results)
        end = time.perf_counter()
        faulted = minor_faults()
        for i in range(cfg.iters):
            if fault:
                _maybe_fail(fault, rank, i)
            t_load = time.perf_counter()
            batch = built.microbatches(plan.global_batch, i)      # data loading: not timed
            load_s = time.perf_counter() - t_load
            if i == cfg.iters - 1:          # the last (post-warm-up) iteration's timeline
                timer.start_recording()     # and its saved activations
                built.runner.track = True
                built.runner.saved_tracker.reset()
            built.begin()
            loss = built.step(batch)
            device.synchronize()
            iter_s.append(time.perf_counter() - end - load_s)
            end = time.perf_counter()
            faults.append(minor_faults() - faulted)
            faulted += faults[-1]
            busy_s.append(timer.take())
            if i == cfg.iters - 1:
                events = timer.take_spans()
            losses.append(float(loss) if loss is not None else 0.0)
            if i == 0:
                marks.mark("first_iteration")
            if rank == 0 and not cfg.quiet and (time.monotonic() - shown > 1.0 or i + 1 == cfg.iters):
                shown = time.monotonic()
                print(f"hetplan run: iteration {i + 1}/{cfg.iters}: {iter_s[-1] * 1e3:.2f} ms (rank 0)",
                      file=sys.stderr, flush=True)
    marks.mark("trained")
    if cfg.trace_dir:
        Path(cfg.trace_dir).mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(Path(cfg.trace_dir) / f"rank{rank}.json"))
    saved = built.runner.saved_tracker.peak_bytes
    grad_bytes = sum(p.numel() * p.element_size() for p in built.params if p.requires_grad)
    if hasattr(built.sync, "peak_bytes"):     # ZeRO-2/3: slices, and whole gradients a bucket at a time
        grad_bytes = built.sync.peak_bytes()
        param_bytes = built.sync.param_peak_bytes() or param_bytes    # ZeRO-3: slices, units in use
    on_host = device.device.type == "cpu"   # a CPU worker or a stand-in: no allocator statistics
    peak = (param_bytes + grad_bytes + built.optimizer.state_bytes() + saved + built.held_peak_bytes() if on_host
            else mem.peak_bytes())
    return {"rank": rank, "device": name, "iter_s": iter_s, "busy_s": busy_s, "loss": losses,
            "page_faults": faults,
            "peak_memory_bytes": peak, "rss_growth_bytes": (mem.peak_bytes() - param_bytes) if on_host else None,
            "saved_activation_peak_bytes": saved, "threads": torch.get_num_threads(),
            "param_bytes": param_bytes,
            "optimizer_state_bytes": built.optimizer.state_bytes(),
            "events": events, "events_iteration": cfg.iters - 1}


def _profiler(cfg, device):
    import contextlib

    if not cfg.trace_dir:
        return contextlib.nullcontext()
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.device.type == "cuda" else [])
    return profile(activities=acts)


def _maybe_fail(fault: str, rank: int, iteration: int) -> None:
    r, it, kind = fault.split(":")
    if int(r) == rank and int(it) == iteration:
        if kind == "exit":
            os._exit(17)   # a crash: no cleanup, no error message
        if kind == "hang":
            time.sleep(3600)  # a stuck rank: its peers' collectives must time out
        raise RuntimeError(f"injected fault at iteration {iteration}")


def _gather_params(cfg, built, rank, world):
    """Replica 0's parameters (every replica holds the same after a synchronous step)."""
    import torch.distributed as dist
    if not cfg.save_params:
        return None
    full = getattr(built, "full_parameters", None)    # a tensor-split rank: its slices joined
    if full is not None:
        mine = full() or {}
    else:
        with built.whole_parameters():
            mine = ({n: p.detach().cpu().clone() for n, p in built.named_params} if built.replica == 0 else {})
    out: list = [None] * world if rank == 0 else None
    dist.gather_object(mine, out, dst=0)
    if rank != 0:
        return None
    merged = {}
    for d in out:
        merged.update(d)
    return merged


def report_error(cfg: RunConfig, exc: BaseException) -> str:
    """One line naming the rank and device; written to error_dir for the launcher."""
    rank = os.environ.get("RANK", "?")
    try:
        from hetplan.planner.files.plan import load_plan
        dev = my_device(load_plan(cfg.plan).devices, os.environ)
    except Exception:  # noqa: BLE001 - the error line must still be written
        dev = "?"
    msg = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    line = f"rank {rank} ({dev}): {type(exc).__name__}: {msg}"
    if cfg.error_dir:
        Path(cfg.error_dir, f"rank{rank}.txt").write_text(line + "\n")
        if is_input_error(exc):   # bad input (the plan's model): the launcher exits 2 with it
            Path(cfg.error_dir, f"input-rank{rank}.txt").write_text(msg + "\n")
    return line


def is_input_error(exc: BaseException) -> bool:
    from hetplan.planner.files.io import InputError
    return isinstance(exc, InputError)


def _cli(argv=None) -> int:
    """Entry point under torchrun: python -m hetplan.runtime.worker PLAN [options]."""
    p = argparse.ArgumentParser(prog="hetplan.runtime.worker", description="one rank of hetplan run (torchrun)")
    p.add_argument("plan")
    p.add_argument("-o", "--output", default="measured.json")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--trace", default=None)
    p.add_argument("--save-params", default=None)
    p.add_argument("--threads", type=int, default=None, help="intra-op threads of every worker (default: see default_threads)")
    p.add_argument("--timeout", type=float, default=60.0)
    from hetplan.runtime.train_flags import add_training_arguments
    add_training_arguments(p)                     # --steps / --epochs: train on the workload's data
    a = p.parse_args(argv)
    threads = {}
    from hetplan.planner.files.io import InputError
    from hetplan.planner.files.plan import load_plan
    try:
        plan = load_plan(a.plan)
        from hetplan.runtime.train_flags import train_config
        training = train_config(a, plan)
    except InputError as e:
        print(f"hetplan run: error: {e}", file=sys.stderr)
        return 2
    if a.threads:
        threads = {d: a.threads for d in plan.devices}
    cfg = RunConfig(plan=a.plan, iters=a.iters, warmup=a.warmup, out=a.output, trace_dir=a.trace,
                    save_params=a.save_params, threads=threads, timeout_s=a.timeout,
                    train=training.to_dict() if training is not None else None)
    try:
        run_worker(cfg)
    except Exception as e:
        line = report_error(cfg, e)
        if is_input_error(e):     # bad input (the plan's model): its one line and exit 2, as `hetplan run`
            print(f"hetplan run: error: {' '.join(str(e).split())}", file=sys.stderr)
            return 2
        print(f"hetplan run: error: {line}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(_cli())
