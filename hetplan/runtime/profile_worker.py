"""The worker side of `hetplan profile`: what one worker process measures.

`profile_worker` reads RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT (env://), so the same
function runs under `torchrun`; hetplan.runtime.profile launches it. Every worker runs the device
benchmarks at the same time (as during training), then pairs of workers are measured one pair
at a time, then an all-reduce over all of them; each worker writes its raw tables to
`out_dir/rankR.json` for hetplan.runtime.profile.assemble.
"""
from __future__ import annotations

import datetime
import itertools
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from hetplan.planner.files.io import write_json_atomic
from hetplan.planner.files.progress import clock
from hetplan.planner.hardware.cores import bind_worker
from hetplan.planner.hardware.fit import host_copy_fit
from hetplan.planner.hardware.device import STANDIN_ENV, TorchDevice, torch_device
from hetplan.planner.hardware.host_memory import keep_freed_memory
from hetplan.runtime.gloo_threads import lower_gloo_loop_priority, short_slices
from hetplan.runtime import profile_bench as bench

KiB, MiB = 1 << 10, 1 << 20
FAIL_ENV = "HETPLAN_PROFILE_FAIL_RANK"  # fault injection for tests: that rank raises after init


@dataclass(frozen=True)
class Settings:
    """How thoroughly to measure; `quick()` targets ~20 s, `full()` ~2 min on 2 cores."""
    cpu_matmul_sizes: tuple[int, ...]
    cuda_matmul_sizes: tuple[int, ...]
    cpu_low_precision_sizes: tuple[int, ...]    # bf16 matmuls (the last: the device's figure)
    cuda_low_precision_sizes: tuple[int, ...]   # tf32 and bf16 matmuls
    comm_sizes: tuple[int, ...]       # bytes, ping-pong and all-reduce
    cpu_copy_bytes: int               # memory-bandwidth tensor; larger than last-level caches
    cuda_copy_bytes: int
    repeats: int                      # samples per measurement (median + spread)
    min_time_s: float                 # shortest sample

    @staticmethod
    def quick() -> "Settings":
        return Settings(cpu_matmul_sizes=(64, 256, 1024), cuda_matmul_sizes=(256, 1024, 4096),
                        cpu_low_precision_sizes=(256, 1024), cuda_low_precision_sizes=(1024, 4096),
                        comm_sizes=(4 * KiB, 64 * KiB, 1 * MiB, 16 * MiB, 64 * MiB),
                        cpu_copy_bytes=64 * MiB, cuda_copy_bytes=256 * MiB,
                        repeats=3, min_time_s=0.02)

    @staticmethod
    def full() -> "Settings":
        return Settings(cpu_matmul_sizes=(64, 128, 256, 512, 1024, 2048),
                        cuda_matmul_sizes=(256, 512, 1024, 2048, 4096, 8192),
                        cpu_low_precision_sizes=(512, 2048), cuda_low_precision_sizes=(2048, 8192),
                        comm_sizes=tuple(4 * KiB * 4 ** i for i in range(8)),  # 4 KiB .. 64 MiB
                        cpu_copy_bytes=128 * MiB, cuda_copy_bytes=1024 * MiB,
                        repeats=9, min_time_s=0.1)


@dataclass(frozen=True)
class WorkerSpec:
    """One profile worker: the device it measures and its intra-op threads."""
    name: str            # device name, "cpu:1" / "cuda:0"
    kind: str
    index: int
    threads: int


def log(msg: str) -> None:
    print(f"profile: {msg}", file=sys.stderr, flush=True)


class Steps:
    """Rank 0's steps of the profile, counted: 'profile: [k/n] what (0:12 elapsed, ETA 0:20)'."""

    def __init__(self, total: int):
        self.total, self.done, self.t0 = total, 0, time.monotonic()

    def __call__(self, msg: str) -> None:
        elapsed = time.monotonic() - self.t0
        eta = f"ETA {clock(elapsed / self.done * max(self.total - self.done, 0))}" if self.done else "ETA ?"
        self.done += 1
        log(f"[{self.done}/{max(self.total, self.done)}] {msg} ({clock(elapsed)} elapsed, {eta})")

    @staticmethod
    def planned(s: "Settings", dev, world: int) -> int:
        """The steps rank 0 announces: each matmul size, the copy, each low-precision sweep, the
        two calibrations, the point-to-point and the all-reduce (two workers or more)."""
        low = s.cuda_low_precision_sizes if dev.native else s.cpu_low_precision_sizes
        sizes = s.cuda_matmul_sizes if dev.native else s.cpu_matmul_sizes
        sweeps = (1 + dev.accelerator) if low else 0
        return len(sizes) + 1 + sweeps + 2 + (2 if world > 1 else 0)


announce = log   # rank 0's steps: counted (Steps) once profile_worker knows its device


def available_ram_bytes() -> int:
    """Available host memory (MemAvailable), in bytes."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def profile_worker(workers: list[WorkerSpec], settings: Settings, out_dir: str) -> None:
    """Measure this rank's device, its pairs and the all-reduce; write `out_dir/rankR.json`."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    me = workers[rank]
    keep_freed_memory()          # as the runtime's workers do
    _, line = bind_worker([(w.name, w.threads) for w in workers], me.name)  # as `run`'s workers
    short_slices()               # as `run`'s workers
    if rank == 0:
        log(line)
    torch.set_num_threads(me.threads)
    device = torch_device(me.name)
    device.set_current()
    global announce
    announce = Steps(Steps.planned(settings, device, world))
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    lower_gloo_loop_priority()   # as the runtime's workers do
    try:
        if os.environ.get(FAIL_ENV) == str(rank):
            raise RuntimeError(f"injected failure ({FAIL_ENV}={rank})")
        # the reference step alone and together in three bursts spread over the profile: two
        # one-core workers on a VM slow each other or not for tens of seconds at a time
        step = bench.reference_step() if me.kind == "cpu" else None
        rounds = _reference_rounds(step, workers, settings, 0)
        result = {"device": _device_tables(me, device, settings), "links": {}}
        rounds = _reference_rounds(step, workers, settings, 1, rounds)
        result["calibration"] = _calibration_tables(workers, settings)
        if rank == 0 and world > 1:
            announce(f"point-to-point between {world * (world - 1) // 2} pair(s) of workers")
        for first, second in itertools.combinations(range(world), 2):
            dist.barrier()  # one pair at a time: an uncontended link
            if rank in (first, second):
                rows = bench.ping_pong(rank, first, second, list(settings.comm_sizes), device,
                                       settings.repeats)
                if rows is not None:
                    result["links"][workers[second].name] = rows
        if rank == 0 and world > 1:
            announce(f"all-reduce over {world} workers")
        # three times the samples: one size's time is bimodal on a loaded host (1 MiB: ~0.5 or
        # ~1.8 ms), and its median must land on the mode training sees
        result["allreduce"] = bench.allreduce_table(list(settings.comm_sizes),
                                                    3 * settings.repeats) if world > 1 else []
        if world > 1 and all(w.kind == "cpu" for w in workers):   # the curve's smallest size, queued
            result["calibration"]["allreduce_queued_s"] = bench.allreduce_queued(
                settings.comm_sizes[0], max(20, 4 * settings.repeats))
            # ZeRO's gathers (hetplan.runtime.shard), which gloo runs slower than half an all-reduce;
            # within the all-reduce's announced step
            result["allgather"] = bench.allgather_table(list(settings.comm_sizes), settings.repeats)
        alone, together = _reference_rounds(step, workers, settings, 2, rounds)
        if step is not None:
            result["calibration"].update(reference_alone_s=bench.stats(alone)[0],
                                         reference_together_s=bench.stats(together)[0],
                                         reference_ratios=[t / a for a, t in zip(alone, together)])
        write_json_atomic(Path(out_dir) / f"rank{rank}.json", result)
        # Tear down together: a rank that destroys its gloo group while a peer is still inside
        # the last collective can abort the peer ("terminate called without an active exception").
        dist.barrier()
    except Exception as e:
        # Recorded before this process group goes down: the peers then fail too ("connection
        # closed"), and the launcher reports the earliest error, the cause.
        first_line = (str(e).strip().splitlines() or [""])[0]
        write_json_atomic(Path(out_dir) / f"rank{rank}.error",
                          {"time": time.time(), "error": f"{type(e).__name__}: {first_line}"})
        raise
    finally:
        dist.destroy_process_group()


def _device_tables(me: WorkerSpec, dev: TorchDevice, s: Settings) -> dict:
    """This worker's device tables (matmul per size and precision, memory copy, per-op overhead;
    on an accelerator its host copies and memory), every worker running each size at once."""
    device = dev.device
    sizes = s.cuda_matmul_sizes if dev.native else s.cpu_matmul_sizes
    table = []
    for n in sizes:
        if dist.get_rank() == 0:
            announce(f"matmul n={n} on {dist.get_world_size()} worker(s) at once")
        dist.barrier()  # every worker runs the same size at the same time
        table.append(bench.matmul_row(n, dev, s.min_time_s, s.repeats))
    if dist.get_rank() == 0:
        announce("memory copy and per-op overhead")
    dist.barrier()
    copy_bytes = s.cuda_copy_bytes if dev.native else s.cpu_copy_bytes
    copy = bench.memory_copy(copy_bytes, dev, s.min_time_s, s.repeats)
    dist.barrier()
    overhead = bench.op_overhead(dev, s.min_time_s, s.repeats)
    out = {"matmul_table": table, "memory_copy": copy, "op_overhead": overhead,
           **_low_precision_matmuls(dev, s, table[-1]["flops_per_s"])}
    if dev.accelerator:
        out["host_copy_table"] = bench.host_copy_table(dev, list(s.comm_sizes), s.min_time_s,
                                                       s.repeats)
        out["host_copy"] = host_copy_fit(out["host_copy_table"])
        # a step's host work and launches, not only its memory traffic (CostModel.optimizer_s)
        out["optimizer_table"] = bench.optimizer_table(s.repeats, s.min_time_s, dev=dev)
        if dev.native:
            out["memory_bytes"] = torch.cuda.get_device_properties(device).total_memory
            out["model"] = torch.cuda.get_device_name(device)
        else:   # a CPU stand-in (hetplan.planner.hardware.device): host memory, shared with the CPU workers
            out["memory_bytes"] = available_ram_bytes() // dist.get_world_size()
            out["model"] = f"CPU stand-in ({STANDIN_ENV})"
    log(f"[{me.name}] {me.threads} thread(s): matmul {table[-1]['flops_per_s'] / 1e9:.1f} GFLOP/s "
        f"at n={table[-1]['n']}, copy {copy['bytes_per_s'] / 1e9:.1f} GB/s, "
        f"op {overhead['s'] * 1e6:.1f} us")
    return out


MAX_LOW_PRECISION_CALL_S = 0.5   # a larger size is skipped when one call would take longer


def _any_worker(flag: bool) -> bool:
    """True on every worker when `flag` is true on any (so that all take the same branch)."""
    t = torch.tensor([1.0 if flag else 0.0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _low_precision_matmuls(dev: TorchDevice, s: Settings, fp32_flops_per_s: float) -> dict:
    """`matmul_<p>_table` for tf32 (accelerators only: on a CPU worker tf32 is fp32, so the fp32
    figure is copied) and bf16 (measured for real everywhere: a CPU without native bf16 is slow at
    it and is priced so), and `matmul_flops_per_s_by_precision` from each table's largest size."""
    sizes = s.cuda_low_precision_sizes if dev.native else s.cpu_low_precision_sizes
    out: dict = {}
    rates = {"fp32": fp32_flops_per_s}
    for p in ("tf32", "bf16"):
        mine = sizes if p == "bf16" or dev.accelerator else ()
        if dist.get_rank() == 0 and mine:
            announce(f"{p} matmul n={', '.join(map(str, mine))}")
        rows = _matmul_rounds(mine, lambda n: bench.matmul_row(n, dev, s.min_time_s, s.repeats,
                                                               precision=p))
        if rows:
            out[f"matmul_{p}_table"] = rows
        rates[p] = rows[-1]["flops_per_s"] if rows else fp32_flops_per_s
    out["matmul_flops_per_s_by_precision"] = rates
    return out


def _matmul_rounds(sizes, measure) -> list[dict]:
    """`measure(n)` for each of this worker's `sizes` in turn, in rounds that every worker takes
    part in whatever its own list (a GPU times tf32, a CPU does not; their sizes differ): a round
    runs while any worker has a size left, each measuring its own at once. A worker stops at a
    size whose one call would take over MAX_LOW_PRECISION_CALL_S (bf16 on a CPU without it:
    minutes); its smaller size's rate stands."""
    rows: list[dict] = []
    left = list(sizes)
    while True:
        if left and rows and 2 * left[0] ** 3 / rows[-1]["flops_per_s"] > MAX_LOW_PRECISION_CALL_S:
            left = []
        if not _any_worker(bool(left)):   # also starts the round on every worker at once
            return rows
        if left:
            rows.append(measure(left.pop(0)))


def _reference_rounds(step, workers: list[WorkerSpec], s: Settings, burst: int,
                      rounds: tuple[list[float], list[float]] | None = None) -> tuple[list[float], list[float]]:
    """Burst `burst` of 3 (0, 1, 2) of the contention measurement, added to `rounds`: a third of
    `s.repeats` rounds (at least one), each the reference step alone on one worker at a time (the
    others waiting in a barrier), then on every worker at once, as in training; per round this
    worker's (alone, together) seconds per step. Every rank takes part (a GPU worker only waits)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    alone, together = rounds or ([], [])
    if rank == 0 and burst == 0:
        announce("calibration: reference step alone and with all workers busy, in three bursts")
    window_s = 2 * s.min_time_s
    n = s.repeats // 3 + (burst < s.repeats % 3) if s.repeats >= 3 else 1
    for _ in range(n):       # alternate, so slow drift of the machine hits both alike
        for r in range(world):
            dist.barrier()   # one worker at a time
            if r == rank and step is not None:
                alone.append(bench.per_call_in_window(step, window_s))
        dist.barrier()       # every worker at once
        if step is not None:
            together.append(bench.per_call_in_window(step, window_s))
    dist.barrier()
    return alone, together


def _calibration_tables(workers: list[WorkerSpec], s: Settings) -> dict:
    """What hetplan.planner.hardware.calibration fits (CPU workers only), besides the reference step's
    rounds (`_reference_rounds`): rank 0 times torch.optim steps alone
    (hetplan.planner.hardware.calibration.fit_optimizer) and with every worker stepping at once, and
    the wake-up, message and DDP costs of the runtime's patterns."""
    rank, world = dist.get_rank(), dist.get_world_size()
    me, out = workers[rank], {}
    if rank == 0:
        announce("calibration: optimizer steps alone and with all workers busy")
    if rank == 0 and me.kind == "cpu":
        out["optimizer"] = bench.optimizer_table(s.repeats, s.min_time_s)
    dist.barrier()
    if world > 1 and all(w.kind == "cpu" for w in workers):   # every worker stepping at once
        together = bench.optimizer_table(s.repeats, s.min_time_s, barrier=dist.barrier)
        if rank == 0:
            out["optimizer_together"] = together
    dist.barrier()
    if world > 1 and workers[0].kind == workers[1].kind == "cpu":
        out["wake_latency_s"] = bench.wake_latency(max(20, 4 * s.repeats))
        issue = bench.message_issue(max(40, 8 * s.repeats))
        held = bench.held_send(max(60, 10 * s.repeats))
        cold = bench.cold_compute(max(40, 8 * s.repeats))
        if rank == 0 and held:
            out["held_send_curve"] = held
        if rank == 0:                # the others wait in the barrier below
            out["send_issue_s"], out["recv_post_s"] = issue
            out["cold_compute_s"] = cold
            out["action_overhead_s"] = bench.action_overhead(max(40, 8 * s.repeats))
            out["iteration_overhead_s"] = bench.iteration_overhead(max(40, 8 * s.repeats),
                                                                   out["action_overhead_s"])
            out["grad_accumulate_s_per_byte"] = bench.grad_accumulate(max(40, 8 * s.repeats))
    dist.barrier()
    if world > 1 and workers[0].kind == "cpu":
        solo = dist.new_group([0])   # collective: every rank creates it; rank 0 measures alone
        if rank == 0:
            out["ddp"] = bench.ddp_costs(solo, max(40, 8 * s.repeats))
            out["ddp_forward_s"] = out["ddp"]["ddp_forward_s"]
            out["grad_copy_s_per_byte"] = out["ddp"]["grad_copy_s_per_byte"]
    dist.barrier()
    return out
