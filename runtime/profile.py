"""`hetplan profile`: measure this machine's devices and links for real.

One worker process per device: CPU worker groups `cpu:0..cpu:N-1` share the cores left after
keeping one core per GPU to drive it (`torch.set_num_threads`), and every CUDA GPU gets its own
process. All workers run the device benchmarks at the same time, as they will run during
training: CPU workers compete for memory bandwidth and caches, so a figure measured alone would
be too optimistic. Pairs of workers are then measured one pair at a time (uncontended links),
then an all-reduce over all of them. Workers talk over gloo on 127.0.0.1.

`profile_worker` reads RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT (env://), so the same
function runs under `torchrun`; `measure` launches it with torch.multiprocessing spawn.

Not modelled: NUMA placement and core pinning (workers are not pinned, like `run`'s workers),
NCCL between GPUs (GPU workers exchange data through pinned host buffers over gloo, the path of a
CPU+GPU runtime). A GPU's host copies are measured both pageable and pinned (`host_copy`).
"""
from __future__ import annotations

import datetime
import itertools
import json
import os
import platform
import socket
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

from planner.hardware.device import STANDIN_ENV, TorchDevice, gpu_count, torch_device
from planner.files.io import InputError, write_json_atomic
from planner.hardware.fit import fit_latency_bandwidth, host_copy_fit
from planner.hardware.topology import Device, Link, Topology
from runtime import profile_bench as bench

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
    name: str            # device name, "cpu:1" / "cuda:0"
    kind: str
    index: int
    threads: int


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def plan_workers(cpu_workers: int, cores: int, gpus: int) -> list[WorkerSpec]:
    """cpu:0..N-1 split the cores left after one per GPU (the first ones get the remainder);
    each GPU worker gets one thread. Raises InputError when N does not fit."""
    cpu_cores = max(1, cores - gpus)
    if not 1 <= cpu_workers <= cpu_cores:
        kept = f", {gpus} kept to drive GPUs" if gpus else ""
        raise InputError(f"--cpu-workers: expected an integer from 1 to {cpu_cores} "
                         f"(this machine has {cores} cores{kept}), got {cpu_workers}")
    base, extra = divmod(cpu_cores, cpu_workers)
    specs = [WorkerSpec(f"cpu:{i}", "cpu", i, base + (i < extra)) for i in range(cpu_workers)]
    specs += [WorkerSpec(f"cuda:{g}", "cuda", g, 1) for g in range(gpus)]
    return specs


def _log(msg: str) -> None:
    print(f"profile: {msg}", file=sys.stderr, flush=True)


# --- the worker (env://) --------------------------------------------------------------------
def profile_worker(workers: list[WorkerSpec], settings: Settings, out_dir: str) -> None:
    """Measure this rank's device, its pairs and the all-reduce; write `out_dir/rankR.json`."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    me = workers[rank]
    torch.set_num_threads(me.threads)
    device = torch_device(me.name)
    device.set_current()
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    try:
        if os.environ.get(FAIL_ENV) == str(rank):
            raise RuntimeError(f"injected failure ({FAIL_ENV}={rank})")
        result = {"device": _measure_device(me, device, settings), "links": {}}
        result["calibration"] = _measure_calibration(workers, settings)
        if rank == 0 and world > 1:
            _log(f"point-to-point between {world * (world - 1) // 2} pair(s) of workers")
        for first, second in itertools.combinations(range(world), 2):
            dist.barrier()  # one pair at a time: an uncontended link
            if rank in (first, second):
                rows = bench.ping_pong(rank, first, second, list(settings.comm_sizes), device,
                                       settings.repeats)
                if rows is not None:
                    result["links"][workers[second].name] = rows
        if rank == 0 and world > 1:
            _log(f"all-reduce over {world} workers")
        result["allreduce"] = bench.allreduce_table(list(settings.comm_sizes), settings.repeats) \
            if world > 1 else []
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


def _measure_device(me: WorkerSpec, dev: TorchDevice, s: Settings) -> dict:
    device = dev.device
    sizes = s.cuda_matmul_sizes if dev.native else s.cpu_matmul_sizes
    table = []
    for n in sizes:
        if dist.get_rank() == 0:
            _log(f"matmul n={n} on {dist.get_world_size()} worker(s) at once")
        dist.barrier()  # every worker runs the same size at the same time
        table.append(bench.matmul_row(n, device, s.min_time_s, s.repeats))
    if dist.get_rank() == 0:
        _log("memory copy and per-op overhead")
    dist.barrier()
    copy_bytes = s.cuda_copy_bytes if dev.native else s.cpu_copy_bytes
    copy = bench.memory_copy(copy_bytes, device, s.min_time_s, s.repeats)
    dist.barrier()
    overhead = bench.op_overhead(device, s.min_time_s, s.repeats)
    out = {"matmul_table": table, "memory_copy": copy, "op_overhead": overhead,
           **_low_precision_matmuls(device, s, table[-1]["flops_per_s"])}
    if dev.accelerator:
        out["host_copy_table"] = bench.host_copy_table(dev, list(s.comm_sizes), s.min_time_s,
                                                       s.repeats)
        out["host_copy"] = host_copy_fit(out["host_copy_table"])
        if dev.native:
            out["memory_bytes"] = torch.cuda.get_device_properties(device).total_memory
            out["model"] = torch.cuda.get_device_name(device)
        else:   # a CPU stand-in (planner.hardware.device): host memory, shared with the CPU workers
            out["memory_bytes"] = _available_ram_bytes() // dist.get_world_size()
            out["model"] = f"CPU stand-in ({STANDIN_ENV})"
    _log(f"[{me.name}] {me.threads} thread(s): matmul {table[-1]['flops_per_s'] / 1e9:.1f} GFLOP/s "
         f"at n={table[-1]['n']}, copy {copy['bytes_per_s'] / 1e9:.1f} GB/s, "
         f"op {overhead['s'] * 1e6:.1f} us")
    return out


def _low_precision_matmuls(device: torch.device, s: Settings, fp32_flops_per_s: float) -> dict:
    """`matmul_<p>_table` for tf32 (CUDA only: on a CPU, a stand-in GPU's included, tf32 is fp32,
    so the fp32 figure is copied) and bf16 (measured for real everywhere: a CPU without native
    bf16 is slow at it and is priced so), and `matmul_flops_per_s_by_precision` from each
    table's largest size."""
    native = device.type == "cuda"
    sizes = s.cuda_low_precision_sizes if native else s.cpu_low_precision_sizes
    out: dict = {}
    rates = {"fp32": fp32_flops_per_s}
    for p in ("tf32", "bf16"):
        if p == "tf32" and not native:
            rates[p] = fp32_flops_per_s
            continue
        if dist.get_rank() == 0:
            _log(f"{p} matmul n={', '.join(map(str, sizes))}")
        rows = []
        for n in sizes:
            dist.barrier()   # every worker runs the same size at the same time
            rows.append(bench.matmul_row(n, device, s.min_time_s, s.repeats, precision=p))
        out[f"matmul_{p}_table"] = rows
        rates[p] = rows[-1]["flops_per_s"]
    out["matmul_flops_per_s_by_precision"] = rates
    return out


def _measure_calibration(workers: list[WorkerSpec], s: Settings) -> dict:
    """What planner.hardware.calibration fits (CPU workers only): a reference training step timed alone
    (one worker at a time, the others waiting in a barrier) and with every worker running it at
    once; rank 0 also times torch.optim steps alone (planner.hardware.fit.fit_optimizer)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    me, out = workers[rank], {}
    step = bench.reference_step() if me.kind == "cpu" else None
    if rank == 0:
        _log("calibration: reference step alone and with all workers busy; optimizer steps")
    window_s = 2 * s.min_time_s
    alone, together = [], []
    for _ in range(s.repeats):   # alternate, so slow drift of the machine hits both alike
        for r in range(world):
            dist.barrier()       # one worker at a time
            if r == rank and step is not None:
                alone.append(bench.per_call_in_window(step, window_s))
        dist.barrier()           # every worker at once, as during training
        if step is not None:
            together.append(bench.per_call_in_window(step, window_s))
    dist.barrier()
    if step is not None:
        out["reference_alone_s"] = bench.stats(alone)[0]
        out["reference_together_s"] = bench.stats(together)[0]
    if rank == 0 and me.kind == "cpu":
        out["optimizer"] = bench.optimizer_table(s.repeats, s.min_time_s)
    dist.barrier()
    if world > 1 and all(w.kind == "cpu" for w in workers):   # every worker stepping at once
        together = bench.optimizer_table(s.repeats, s.min_time_s, barrier=dist.barrier)
        if rank == 0:
            out["optimizer_together"] = together
    dist.barrier()
    out["multi_worker_overhead_s"] = _multi_worker_overhead(max(20, 4 * s.repeats)) if world > 1 else 0.0
    return out


def _multi_worker_overhead(repeats: int, busy_s: float = 0.010) -> float:
    """What a multi-worker iteration of `hetplan run` costs beyond its work, in the runtime's
    own pattern: ranks reach a gloo barrier apart (rank 1 sleeps 10 ms first, as when data
    loading differs), time from their own barrier exit, compute for busy_s (rank 0) or
    busy_s / 2 (the others, who then wait), meet in a 4-byte all-reduce; the iteration is the max
    over ranks. Returns the median of (iteration - busy_s - a hot 4-byte all-reduce). On the
    2-vCPU VM this is milliseconds, not the microseconds of a hot barrier: a process that
    sleeps in a blocking wait is woken late (the idle vCPU must be rescheduled)."""
    rank = dist.get_rank()
    t, span = torch.zeros(1), torch.zeros(1)
    a = torch.randn(128, 128)
    hot, over = [], []
    for i in range(repeats + 1):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(t)                      # both ranks hot: the all-reduce itself
        hot.append(time.perf_counter() - t0)
        if rank == 1:
            time.sleep(0.010)
        dist.barrier()
        t0 = time.perf_counter()
        mine = busy_s if rank == 0 else busy_s / 2
        while time.perf_counter() - t0 < mine:
            torch.mm(a, a)
        dist.all_reduce(t)
        span[0] = time.perf_counter() - t0
        dist.all_reduce(span, op=dist.ReduceOp.MAX)
        over.append(float(span[0]) - busy_s)
    return max(0.0, bench.stats(over[1:])[0] - bench.stats(hot[1:])[0])


def calibration(workers: list[WorkerSpec], results: list[dict], allreduce: list[dict]) -> dict:
    """The topology's "calibration" object (planner.hardware.calibration) from the workers' raw results."""
    from planner.hardware.calibration import Calibration, calibration_to_dict
    from planner.hardware.fit import contention_factor, fit_optimizer, memory_contention_factor
    cpus = [(w, r.get("calibration", {})) for w, r in zip(workers, results) if w.kind == "cpu"]
    timed = [c for _, c in cpus if "reference_alone_s" in c and "reference_together_s" in c]
    factor = contention_factor([c["reference_alone_s"] for c in timed],
                               [c["reference_together_s"] for c in timed]) if len(cpus) > 1 and timed else 1.0
    lat = bw = None
    if allreduce and all(w.kind == "cpu" for w in workers):
        lat, bw = fit_latency_bandwidth(allreduce)
    opt_rows = results[0].get("calibration", {}).get("optimizer", {})
    together_rows = results[0].get("calibration", {}).get("optimizer_together", {})
    mem = memory_contention_factor(opt_rows.get("adam", []), together_rows.get("adam", []))
    skew = results[0].get("calibration", {}).get("multi_worker_overhead_s", 0.0)
    c = Calibration(cpu_workers=len(cpus), cpu_contention_factor=factor, allreduce_latency_s=lat,
                    allreduce_bytes_per_s=bw, multi_worker_overhead_s=skew,
                    memory_contention_factor=mem,
                    optimizer={k: fit_optimizer(v) for k, v in opt_rows.items() if len(v) >= 2})
    tables = ("optimizer", "optimizer_together")
    raw = {"reference": [{"device": w.name, **{k: v for k, v in r.items() if k not in tables}}
                         for w, r in cpus],
           "optimizer": opt_rows, "optimizer_together": together_rows}
    return {**calibration_to_dict(c), "raw": raw}


def _spawn_entry(local_rank: int, workers: list[WorkerSpec], settings: Settings, out_dir: str) -> None:
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank),
                      WORLD_SIZE=str(len(workers)))
    profile_worker(workers, settings, out_dir)
    # The results are on disk. Skip the interpreter's teardown: about one run in three on this
    # 2-vCPU VM, a C++ static destructor of torch aborted the process after every byte was
    # written ("terminate called without an active exception", SIGABRT), failing the profile.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# --- the launcher ---------------------------------------------------------------------------
class ProfileError(RuntimeError):
    """A worker failed; the message is one line naming the worker and its error."""


def _root_cause(e: ProcessException, workers: list[WorkerSpec], out_dir: Path) -> str:
    """One line: the earliest error a worker recorded, else what spawn saw (e.g. a signal)."""
    errors = [(json.loads(p.read_text()), int(p.stem[4:])) for p in out_dir.glob("rank*.error")]
    if errors:
        (first, rank) = min(errors, key=lambda x: x[0]["time"])
        return f"worker {rank} ({workers[rank].name}) failed: {first['error']}"
    lines = [l.strip() for l in str(e).splitlines() if l.strip()]
    return f"worker {e.error_index} ({workers[e.error_index].name}) failed: {lines[-1]}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _available_ram_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _cpu_bf16_native() -> bool:
    """Whether the CPU has native bf16 matmul instructions (x86 flags avx512_bf16 / amx_bf16)."""
    try:
        flags = next((l.split(":", 1)[1].split() for l in Path("/proc/cpuinfo").read_text().splitlines()
                      if l.startswith("flags")), [])
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def measure(cpu_workers: int, quick: bool = False) -> Topology:
    """Spawn the workers, collect their results, return the measured topology."""
    t0 = time.perf_counter()
    settings = Settings.quick() if quick else Settings.full()
    cores, gpus = usable_cores(), gpu_count()
    workers = plan_workers(cpu_workers, cores, gpus)
    ram_bytes = _available_ram_bytes()
    _log(f"{len(workers)} worker(s): " + ", ".join(f"{w.name} ({w.threads} thr)" for w in workers)
         + (" [quick]" if quick else ""))
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(_free_port())
    with tempfile.TemporaryDirectory(prefix="hetplan-profile-") as out_dir:
        try:
            mp.spawn(_spawn_entry, args=(workers, settings, out_dir), nprocs=len(workers), join=True)
        except ProcessException as e:
            raise ProfileError(_root_cause(e, workers, Path(out_dir))) from None
        results = [json.loads((Path(out_dir) / f"rank{r}.json").read_text())
                   for r in range(len(workers))]
    host = {"hostname": socket.gethostname(), "cpu_model": _cpu_model(), "cores": cores,
            "cpu_bf16_native": _cpu_bf16_native(),
            "torch": torch.__version__, "python": platform.python_version(),
            "profiled_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "quick": quick, "duration_s": round(time.perf_counter() - t0, 2)}
    return assemble(workers, results, settings, host, ram_bytes)


def assemble(workers: list[WorkerSpec], results: list[dict], settings: Settings, host: dict,
             ram_bytes: int) -> Topology:
    """Workers' raw results -> Topology. Scalars: matmul_flops_per_s = the median at the
    largest size (sustained), matmul_flops_per_s_by_precision as the worker measured it (same
    rule per precision), memory_bytes_per_s = the copy (read + write), op_overhead_s =
    the tiny-op time, memory_bytes = the worker's share of available RAM (CPU) or the GPU's
    total memory; each link's latency and bandwidth are fitted to its ping-pong table."""
    n_cpu = sum(w.kind == "cpu" for w in workers)
    devices, links = [], []
    for w, res in zip(workers, results):
        d = res["device"]
        extra = {k: v for k, v in d.items() if k not in ("memory_bytes", "matmul_flops_per_s_by_precision")}
        if w.kind == "cpu":
            extra["measured_concurrently_with"] = [x.name for x in workers if x is not w]
        devices.append(Device(
            name=w.name, kind=w.kind,
            memory_bytes=float(d["memory_bytes"] if w.kind == "cuda" else ram_bytes // n_cpu),
            matmul_flops_per_s=d["matmul_table"][-1]["flops_per_s"],
            memory_bytes_per_s=d["memory_copy"]["bytes_per_s"],
            op_overhead_s=d["op_overhead"]["s"],
            threads=w.threads, measured=extra,
            matmul_flops_per_s_by_precision=d.get("matmul_flops_per_s_by_precision")))
        for peer, rows in res["links"].items():
            latency_s, bandwidth = fit_latency_bandwidth(rows)
            links.append(Link(a=w.name, b=peer, bandwidth_bytes_per_s=bandwidth, latency_s=latency_s,
                              measured={"p2p_table": rows,
                                        "method": "gloo ping-pong, one-way = round trip / 2; "
                                                  "fit latency + bytes/bandwidth, weights 1/time"}))
    extra = {
        "host": host,
        "collectives": {"allreduce": results[0]["allreduce"],
                        "allreduce_devices": [w.name for w in workers]},
        "calibration": calibration(workers, results, results[0]["allreduce"]),
        "settings": asdict(settings),
        "notes": ["all workers measured their device concurrently, as during training",
                  "spread = (p75 - p25) / median over `samples` repeats",
                  "memory bandwidth: a large tensor copy counted as read + write"],
    }
    return Topology(name=host["hostname"], devices=tuple(devices), links=tuple(links), measured=extra)


def max_spread(t: Topology) -> float:
    """The largest spread of any measurement in a measured topology (a noise summary)."""
    spreads = []
    for d in t.devices:
        spreads += [r["spread"] for r in d.measured.get("matmul_table", [])]
        spreads += [d.measured[k]["spread"] for k in ("memory_copy", "op_overhead") if k in d.measured]
    for l in t.links:
        spreads += [r["spread"] for r in l.measured.get("p2p_table", [])]
    spreads += [r["spread"] for r in t.measured.get("collectives", {}).get("allreduce", [])]
    return max(spreads, default=0.0)
