"""Microbenchmarks behind `hetplan profile`: one device (matmul, memory copy, per-op overhead,
host<->device copies) and one pair or group of worker processes (ping-pong, all-reduce).

Every measurement is repeated; a table row holds the median and its spread, the relative
inter-quartile range `(p75 - p25) / median`. Timing uses `time.perf_counter` around a batch of
calls, with a device synchronisation before and after on CUDA (`TorchDevice.synchronize`), so
one sample is never shorter than `min_time_s` (short samples are dominated by timer and
scheduler noise). Device benchmarks take the worker's TorchDevice. Rows also keep
the best sample (`best_s`, `best_flops_per_s`): on a loaded machine the median is what training
will see, the best is what the hardware can do.
"""
from __future__ import annotations

import time
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from hetplan.planner.hardware.device import TorchDevice
from hetplan.planner.workload.optimizer import make_optimizer
from hetplan.runtime import ddp
from hetplan.runtime.gloo_threads import lower_gloo_loop_priority

MAX_CALLS = 100_000  # cap on calls per sample (op-overhead timing of ~1 us ops)


def stats(samples: list[float]) -> tuple[float, float]:
    """(median, spread) where spread = (p75 - p25) / median, the relative IQR."""
    a = np.asarray(samples, dtype=float)
    med = float(np.median(a))
    p25, p75 = np.percentile(a, [25, 75])
    return med, float((p75 - p25) / med) if med > 0 else 0.0


def trimmed_mean(samples: list[float], cut: float = 0.1) -> float:
    """The mean of `samples` without the lowest and highest `cut` of them (each side)."""
    a = np.sort(np.asarray(samples, dtype=float))
    k = int(len(a) * cut)
    return float(a[k:len(a) - k].mean())


def time_per_call(fn: Callable[[], object], dev: TorchDevice, min_time_s: float,
                  repeats: int) -> list[float]:
    """`repeats` samples of the seconds per call of `fn`; the call count per sample is
    calibrated (after one warm-up call) so that each sample lasts at least `min_time_s`."""
    sync = dev.synchronize
    fn()  # warm-up: allocations, kernel selection, thread-pool start
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    one_s = max(time.perf_counter() - t0, 1e-7)
    calls = int(min(MAX_CALLS, max(1, min_time_s / one_s)))
    out = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        out.append((time.perf_counter() - t0) / calls)
    return out


def matmul_row(n: int, dev: TorchDevice, min_time_s: float, repeats: int,
               precision: str = "fp32") -> dict:
    """n x n @ n x n at `precision`: 2 n^3 FLOPs (a multiply-add counts 2, as
    torch.utils.flop_counter). fp32 and tf32 on float32 tensors (tf32 with CUDA's allow_tf32,
    hetplan.planner.workload.precision); bf16 on bfloat16 tensors, the kernel autocast runs."""
    from hetplan.planner.workload.precision import autocast
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    device = dev.device
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    with autocast(device.type, "fp32" if precision == "bf16" else precision):   # tf32 switches
        samples = time_per_call(lambda: torch.matmul(a, b, out=out), dev, min_time_s, repeats)
    rates = [2 * n ** 3 / s for s in samples]
    med, spread = stats(rates)
    return {"n": n, "flops_per_s": med, "spread": spread, "best_flops_per_s": max(rates),
            "samples": repeats}


def memory_copy(n_bytes: int, dev: TorchDevice, min_time_s: float, repeats: int) -> dict:
    """dst.copy_(src) of n_bytes: counted as 2 n_bytes moved (read + write), as STREAM copy."""
    src = torch.ones(n_bytes // 4, device=dev.device)
    dst = torch.empty_like(src)
    samples = time_per_call(lambda: dst.copy_(src), dev, min_time_s, repeats)
    med, spread = stats([2 * src.numel() * 4 / s for s in samples])
    return {"bytes": src.numel() * 4, "bytes_per_s": med, "spread": spread, "samples": repeats}


def op_overhead(dev: TorchDevice, min_time_s: float, repeats: int) -> dict:
    """Time of one tiny eager op (torch.add on 1-element tensors, allocating its result):
    dispatch + allocation + launch; on CUDA, launches are timed back to back (throughput)."""
    x = torch.ones(1, device=dev.device)
    samples = time_per_call(lambda: torch.add(x, x), dev, min_time_s, repeats)
    med, spread = stats(samples)
    return {"s": med, "spread": spread, "samples": repeats}


def host_copy_table(dev: TorchDevice, sizes: list[int], min_time_s: float,
                    repeats: int) -> list[dict]:
    """Host memory <-> `dev` copies, one row per size with the median seconds of each direction:
    pageable (`.to()`, what a plain loop does) and pinned (`TorchDevice.host_buffer` filled or
    read by non-blocking copies, what the runtime does; the same as pageable on a stand-in)."""
    device = dev.device
    rows = []
    for n in sizes:
        pageable = torch.ones(n // 4)
        pinned = dev.host_buffer((n // 4,), torch.float32)
        on_dev = pageable.to(device)

        def timed(fn) -> tuple[float, float]:
            return stats(time_per_call(fn, dev, min_time_s, repeats))

        row = {"bytes": n}
        row["h2d_s"], row["h2d_spread"] = timed(lambda: pageable.to(device))
        row["d2h_s"], row["d2h_spread"] = timed(lambda: on_dev.cpu())
        row["pinned_h2d_s"], row["pinned_h2d_spread"] = timed(
            lambda: on_dev.copy_(pinned, non_blocking=True))
        row["pinned_d2h_s"], row["pinned_d2h_spread"] = timed(
            lambda: (pinned.copy_(on_dev, non_blocking=True), dev.wait_queued()))
        rows.append(row)
    return rows


# --- between worker processes ---------------------------------------------------------------
def round_trips(n_bytes: int) -> int:
    """Round trips per sample: enough to move ~4 MiB, 1..50. A pure function of the size, so
    both ends of a ping-pong agree on it without talking."""
    return int(min(50, max(1, (4 << 20) // n_bytes)))


def _send(dev: TorchDevice, buf: torch.Tensor, host: torch.Tensor, peer: int) -> None:
    # gloo moves host memory: an accelerator worker stages through a pinned host buffer, as the
    # runtime's pipeline links do
    if dev.accelerator:
        host.copy_(buf, non_blocking=True)
        dev.wait_queued()
        buf = host
    dist.send(buf, peer)


def _recv(dev: TorchDevice, buf: torch.Tensor, host: torch.Tensor, peer: int) -> None:
    dist.recv(host if dev.accelerator else buf, peer)
    if dev.accelerator:
        buf.copy_(host, non_blocking=True)


def ping_pong(rank: int, first: int, second: int, sizes: list[int], dev: TorchDevice,
              repeats: int) -> list[dict] | None:
    """One-way time between ranks `first` and `second` = half a round trip (send n bytes,
    get n bytes back), over `sizes`. Returns the table on `first`, None on `second`."""
    peer = second if rank == first else first
    sync = dev.synchronize
    rows = []
    for n in sizes:
        host = dev.host_buffer((n,), torch.uint8).zero_()
        buf = host.to(dev.device, copy=True)
        trips = round_trips(n)
        samples = []
        for rep in range(repeats + 1):  # the first one is a warm-up
            sync()
            t0 = time.perf_counter()
            for _ in range(trips):
                if rank == first:
                    _send(dev, buf, host, peer)
                    _recv(dev, buf, host, peer)
                else:
                    _recv(dev, buf, host, peer)
                    _send(dev, buf, host, peer)
            sync()
            if rep:
                samples.append((time.perf_counter() - t0) / trips / 2)
        med, spread = stats(samples)
        rows.append({"bytes": n, "s": med, "spread": spread, "best_s": min(samples), "samples": repeats})
    return rows if rank == first else None


def _compute_for(seconds: float, a: torch.Tensor) -> None:
    """Keep this worker busy (matmuls of `a`) for `seconds`: a peer arriving late."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        torch.mm(a, a)


def allreduce_table(sizes: list[int], repeats: int, busy_s: float = 0.0005) -> list[dict]:
    """Sum all-reduce of n bytes (float32, host memory) in the runtime's pattern (hetplan.runtime.sync,
    hetplan.runtime.ddp): launched async on its own group and waited for, every rank arriving at once
    from `busy_s` of compute, as data parallel replicas arrive from their backward. Rank 0
    times from its launch to the end of its wait: what the simulator's all-reduce task lasts
    (it starts at the last arrival). The sizes take turns, round after round, so that a slow
    spell of the host lands on every size a little, not on one size's every sample. The caller
    keeps rank 0's table."""
    buffers = {n: torch.zeros(n // 4) for n in sizes}
    return _collective_table(sizes, repeats, busy_s,
                             lambda n, group: dist.all_reduce(buffers[n], group=group, async_op=True))


def allgather_table(sizes: list[int], repeats: int, busy_s: float = 0.0005) -> list[dict]:
    """All-gather of n bytes in all (each rank's n / world into one float32 tensor of n, host
    memory) in ZeRO's pattern (hetplan.runtime.shard.all_gather_single, launched async and
    waited for), timed as `allreduce_table` times its all-reduce. The caller keeps rank 0's table."""
    from hetplan.runtime.shard import all_gather_single
    world = dist.get_world_size()
    out = {n: torch.zeros(max(1, n // 4 // world) * world) for n in sizes}
    mine = {n: torch.zeros(max(1, n // 4 // world)) for n in sizes}
    return _collective_table(sizes, repeats, busy_s,
                             lambda n, group: all_gather_single(out[n], mine[n], group=group, async_op=True))


def _collective_table(sizes: list[int], repeats: int, busy_s: float, launch) -> list[dict]:
    """`launch(n, group)` (a collective of n bytes, returning its work) timed from launch to
    the end of its wait after `busy_s` of compute, the sizes taking turns round after round,
    on a gloo group of its own: {bytes, s (median), spread, best_s, samples} per size."""
    group = dist.new_group(backend="gloo")
    lower_gloo_loop_priority()    # a new group may start its own loop thread
    a = torch.randn(64, 64)
    samples: dict[int, list[float]] = {n: [] for n in sizes}
    for rep in range(repeats + 1):
        for n in sizes:
            trips = max(1, round_trips(n) // 5)
            dist.barrier()
            total = 0.0
            for _ in range(trips):
                _compute_for(busy_s, a)
                t0 = time.perf_counter()
                launch(n, group).wait()
                total += time.perf_counter() - t0
            if rep:
                samples[n].append(total / trips)
    dist.destroy_process_group(group)
    rows = []
    for n in sizes:
        med, spread = stats(samples[n])
        rows.append({"bytes": n, "s": med, "spread": spread, "best_s": min(samples[n]), "samples": repeats})
    return rows


def allreduce_queued(n_bytes: int, repeats: int, queued: int = 4, lead_s: float = 0.002) -> float:
    """Seconds an all-reduce of n bytes adds when it is issued right behind others of its group
    (DDP's buckets, launched during a backward, run back to back once the worker waits): in
    a pattern of its own (rank 0 arriving `lead_s` late), `queued` + 1 async all-reduces
    launched together and waited for, against one alone, alternating; (trimmed mean of the
    burst - that of one) / queued, >= 0, timed on rank 0 (every rank returns its own). A mean,
    not a median: on bound CPU workers a burst takes ~0.6 or ~3 ms, and a median of a few
    dozen lands on either mode (0.13-0.71 ms per queued call in four runs; the mean 0.47-0.61)."""
    group = dist.new_group(backend="gloo")
    lower_gloo_loop_priority()
    rank, a = dist.get_rank(), torch.randn(64, 64)
    bufs = [torch.zeros(n_bytes // 4) for _ in range(queued + 1)]
    one, burst = [], []
    for rep in range(repeats + 1):
        for k, out in ((1, one), (queued + 1, burst)):
            dist.barrier()
            if rank == 0:
                _compute_for(lead_s, a)
            t0 = time.perf_counter()
            works = [dist.all_reduce(b, group=group, async_op=True) for b in bufs[:k]]
            for w in works:
                w.wait()
            if rep:
                out.append(time.perf_counter() - t0)
    dist.destroy_process_group(group)
    return max(0.0, (trimmed_mean(burst) - trimmed_mean(one)) / queued)


def wake_latency(repeats: int, lead_s: float = 0.002) -> float | None:
    """How much later a worker blocked in a receive (irecv + wait, as hetplan.runtime.pipeline waits)
    answers than one that just started waiting: ranks 0 and 1 ping-pong 4 bytes, back to back
    (hot), then with rank 0 computing `lead_s` before each ping (rank 1 blocked meanwhile);
    the difference of the median round trips, >= 0, on rank 0 (None elsewhere; other ranks
    idle)."""
    rank, t, a = dist.get_rank(), torch.zeros(1), torch.randn(64, 64)
    rounds: dict[bool, list[float]] = {False: [], True: []}
    for cold in (False, True):
        for i in range(repeats + 1):
            if rank == 0:
                if cold:
                    _compute_for(lead_s, a)
                t0 = time.perf_counter()
                dist.isend(t, 1).wait()
                dist.irecv(t, 1).wait()
                if i:
                    rounds[cold].append(time.perf_counter() - t0)
            elif rank == 1:
                dist.irecv(t, 0).wait()
                dist.isend(t, 0).wait()
    if rank != 0:
        return None
    return max(0.0, stats(rounds[True])[0] - stats(rounds[False])[0])


HELD_WINDOWS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.004, 0.006)   # held_send's curve


def held_send(repeats: int, windows: tuple[float, ...] = HELD_WINDOWS_S, lead_s: float = 0.001,
              post_s: float = 0.0012) -> list[tuple[float, float]] | None:
    """How much later a pipeline message leaves when its receive is posted while the sender
    computes: gloo sends an unbound buffer once the sender's event-loop thread (nice 19:
    hetplan.runtime.gloo_threads) has read the receiver's notice, which it does when the worker's thread
    waits, or when the scheduler first gives it the core, after a delay D of the worker's
    compute that varies from round to round (docs/tuning.md). Ranks 0 and 1 on
    one host, on a group of their own: rank 0 computes `lead_s`, isends 4 KiB, then computes
    max(windows) (else waits at once: the baseline) and waits for the send; rank 1 posts its
    irecv `post_s` after the round's barrier, just after the isend, and waits; the arrival (rank
    1's clock) less the later of isend and post (one host's monotonic clock) per round, rounds
    alternating. Returns the expected hold of a sender that waits after w seconds of compute,
    [(w, mean over rounds of min(D, w))] with D = delay - the baseline's median, on rank 0 (None
    elsewhere); None where ranks 0 and 1 are on different hosts."""
    import socket
    rank = dist.get_rank()
    hosts: list = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    ahead = dist.new_group([0, 1], backend="gloo")
    lower_gloo_loop_priority()
    if hosts[0] != hosts[1] or rank > 1:
        return None
    a, t, stamp = torch.randn(64, 64), torch.randn(1024), torch.zeros(1, dtype=torch.float64)
    delays: dict[float, list[float]] = {0.0: [], max(windows): []}
    for i in range(repeats + 1):
        for w, out in delays.items():
            dist.barrier(group=ahead)
            if rank == 0:
                _compute_for(lead_s, a)
                stamp[0] = time.perf_counter()
                work = dist.isend(t, 1, group=ahead)
                _compute_for(w, a)
                work.wait()
                dist.send(stamp, 1, group=ahead)
            else:
                time.sleep(post_s)
                posted = time.perf_counter()
                dist.irecv(t, 0, group=ahead).wait()
                arrived = time.perf_counter()
                dist.recv(stamp, 0, group=ahead)
                if i:
                    out.append(arrived - max(posted, float(stamp[0])))
    curve = torch.zeros(len(windows), dtype=torch.float64)
    if rank == 1:   # the samples are rank 1's
        base, held = (torch.tensor(v, dtype=torch.float64) for v in delays.values())
        d = (held - base.median()).clamp(min=0.0)
        curve = torch.stack([d.clamp(max=w).mean() for w in windows])
    dist.broadcast(curve, 1, group=ahead)
    dist.destroy_process_group(ahead)
    return list(zip(windows, curve.tolist())) if rank == 0 else None


def message_issue(repeats: int) -> tuple[float, float] | None:
    """(isend, irecv) seconds an isend or an irecv post costs the calling thread, in the
    runtime's own code and pattern: `hetplan.runtime.pipeline.PeerLink` over a process group per
    direction, as stages use (an 8 x 256 float tensor; gloo's issue cost does not depend on the
    size), each call right after a stage's compute while the peer computes and its message
    arrives, where a call costs several times what it does back to back (docs/tuning.md); with
    what the call costs the compute after it (the small stage of `_small_stage`, cold by 10-30
    µs after the call's trip through gloo and the kernel): the call and the stage's compute
    after it less the stage's compute after a compute. Both ranks post the receive of the
    peer's next message, compute, send theirs, compute and wait for the peer's. Rank 0's
    medians; None on other ranks. Every rank takes part in creating the groups; ranks above 1
    do nothing else."""
    from hetplan.planner.hardware.device import torch_device
    from hetplan.runtime.pipeline import PeerLink
    rank = dist.get_rank()
    ahead, back = dist.new_group([0, 1], backend="gloo"), dist.new_group([0, 1], backend="gloo")
    lower_gloo_loop_priority()
    if rank > 1:
        return None
    peer = 1 - rank
    sends_on, receives_on = (ahead, back) if rank == 0 else (back, ahead)
    link = PeerLink(peer, sends_on, receives_on, torch_device("cpu:0"), host_staged=False)
    t, probe = torch.randn(8, 256), _small_stage()
    mine, theirs = ("act", "grad") if rank == 0 else ("grad", "act")
    if rank == 0:                         # the first exchange carries the headers
        link.send(mine, [t])
        link.recv(theirs)
    else:
        link.send(mine, link.recv(theirs))
    hot, sends, posts = [], [], []
    for _ in range(repeats):
        probe()                           # a stage's compute while the peer's message arrives
        hot.append(probe())
        t0 = time.perf_counter()
        link.post(theirs)
        posts.append(time.perf_counter() - t0 + probe())
        t0 = time.perf_counter()
        link.send(mine, [t])
        sends.append(time.perf_counter() - t0 + probe())
        link.recv(theirs)
    link.drain()
    base = stats(hot)[0]
    return (max(0.0, stats(sends)[0] - base), max(0.0, stats(posts)[0] - base)) if rank == 0 else None


def grad_accumulate(repeats: int) -> float:
    """Seconds per parameter byte that a backward costs more when the parameters' gradients
    already exist (a pipeline's microbatches after the first add theirs into `.grad`) than when
    they are fresh (layer timing sets them to None before each backward): a 1024 -> 256 linear
    layer (1 MiB of weights, in cache as in a stage) at 8 samples, alternating the two cases,
    difference of the medians / parameter bytes, >= 0."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(1024, 256)
    x = torch.randn(8, 1024)
    n_bytes = sum(p.numel() * p.element_size() for p in layer.parameters())

    def backward(fresh: bool) -> float:
        if fresh:
            layer.zero_grad(set_to_none=True)
        out = layer(x)
        grad = torch.ones_like(out)
        t0 = time.perf_counter()
        torch.autograd.backward([out], [grad])
        return time.perf_counter() - t0

    for _ in range(5):
        backward(True), backward(False)
    fresh, accumulating = [], []
    for _ in range(repeats):
        fresh.append(backward(True))
        accumulating.append(backward(False))
    return max(0.0, stats(accumulating)[0] - stats(fresh)[0]) / n_bytes


def _tiny_runner(scale: float):
    """(module, busy timer, runner): the runtime's StageRunner over a whole 4 x 4 linear layer
    (MSE loss) on cpu:0, whose compute takes a few µs: what the runtime's own overheads are
    timed around."""
    from hetplan.planner.hardware.device import torch_device
    from hetplan.runtime.instruments import BusyTimer, SavedTracker
    from hetplan.runtime.pipeline import StageRunner, WholeModel
    torch.manual_seed(0)
    timer = BusyTimer(torch_device("cpu:0"))
    module = WholeModel(torch.nn.Linear(4, 4))
    runner = StageRunner(module, torch.device("cpu"), torch.nn.functional.mse_loss, None, None,
                         scale=scale, busy=timer.timer)
    runner.saved_tracker = SavedTracker(list(module.parameters()))
    return module, timer, runner


def action_overhead(repeats: int, microbatches: int = 8) -> float:
    """Seconds the runtime's own code spends per schedule action besides the compute it times:
    the driver (hetplan.runtime.pipeline.StageRunner.run: the action loop, the busy timers'
    contexts, autocast, the microbatch's inputs, the loss bookkeeping), on a one-stage 1F1B
    iteration of a 4 x 4 linear layer, so the compute is a few µs: (iteration wall time - the
    busy timers' total) / actions, median of `repeats` iterations. The pipeline's messages are
    timed apart (message_issue)."""
    from hetplan.runtime.pipeline import stage_actions
    _, timer, runner = _tiny_runner(1.0 / microbatches)
    actions = stage_actions("1f1b", 0, 1, microbatches)
    inputs = [((torch.randn(2, 4),), {}) for _ in range(microbatches)]
    targets = [torch.randn(2, 4) for _ in range(microbatches)]
    per_action = []
    for i in range(repeats + 3):
        t0 = time.perf_counter()
        runner.run(actions, inputs, targets)
        wall = time.perf_counter() - t0
        busy = timer.take()
        if i >= 3:                # warm-up: autograd's and the allocator's first calls
            per_action.append(max(0.0, wall - busy) / len(actions))
    return stats(per_action)[0]


def iteration_overhead(repeats: int, action_s: float) -> float:
    """Seconds per iteration the runtime's own loop (hetplan.runtime.worker._train: `begin`, the step's
    contexts, the loop's bookkeeping) spends beside its actions and their timed compute: the
    loop run for real over a one-stage, one-microbatch plan of a 4 x 4 linear layer (SGD), its
    iteration times less its busy timers, median after a warm-up, less the two actions'
    overhead (`action_s` each: `action_overhead`, which the simulator adds to each action). >= 0."""
    import types
    from hetplan.planner.files.plan import ModelRef, Optimizer, Plan, Replica, Stage, Sync
    from hetplan.planner.hardware.device import torch_device
    from hetplan.planner.workload import Workload
    from hetplan.runtime.optim import StageOptimizer
    from hetplan.runtime.pipeline import stage_actions
    from hetplan.runtime.rank import Built
    from hetplan.runtime.sync import BufferSync
    from hetplan.runtime.sync_modes import NoGradSync
    from hetplan.runtime.worker import _train
    dev = torch_device("cpu:0")
    plan = Plan(model=ModelRef("linear"), global_batch=2,
                replicas=(Replica(1.0, 1, (Stage("cpu:0", (0, 1)),)),), schedule="1f1b",
                sync=Sync("coarse"), optimizer=Optimizer("sgd", 1e-3), recompute=False)
    module, timer, runner = _tiny_runner(1.0)
    workload = Workload(model=module, make_batch=lambda n, seed: (torch.randn(n, 4), torch.randn(n, 4)),
                        loss_fn=torch.nn.functional.mse_loss)
    actions = stage_actions("1f1b", 0, 1, 1)
    built = Built(plan, workload, 0, 0, 1, 0, 2, module, runner, NoGradSync(),
                  StageOptimizer(list(module.parameters()), plan.optimizer, dev),
                  types.SimpleNamespace(barrier=lambda: None), timer, actions, BufferSync(None, []))
    warmup = 10
    cfg = types.SimpleNamespace(iters=warmup + repeats, trace_dir=None)
    # rank -1: the loop prints no progress lines (those are rank 0's)
    out = _train(cfg, plan, built, -1, dev, "cpu:0", types.SimpleNamespace(mark=lambda name: None))
    beside = [it - busy for it, busy in zip(out["iter_s"][warmup:], out["busy_s"][warmup:])]
    return max(0.0, stats(beside)[0] - len(actions) * action_s)


def _small_stage() -> Callable[[], float]:
    """A timed forward and backward of three 256-wide linear layers on 16 samples (what a
    pipeline stage of a small model runs per microbatch), warmed up: returns its seconds."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                              torch.nn.ReLU(), torch.nn.Linear(256, 256))
    x = torch.randn(16, 256)

    def probe() -> float:
        net.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        net(x).sum().backward()
        return time.perf_counter() - t0

    for _ in range(5):
        probe()
    return probe


def cold_compute(repeats: int, gap_s: float = 0.0003) -> float | None:
    """How much longer a small stage's forward and backward (`_small_stage`) takes right after this
    worker waited in a gloo receive, as a pipeline stage or an optimizer step after the
    all-reduce does, than right after running it: rank 1 sends 4 KiB `gap_s` after rank 0 asks,
    rank 0 blocked in its receive meanwhile; the difference of the medians, >= 0, on rank 0
    (None elsewhere; ranks above 1 only create the group). After the wait the core ran gloo's
    loop thread and the kernel's receive path, not only idled: the excess is ~2x what the same
    gap of sleeping gives, and much the same for 0.05-1 ms gaps (docs/tuning.md)."""
    rank = dist.get_rank()
    group = dist.new_group([0, 1], backend="gloo")
    lower_gloo_loop_priority()
    if rank > 1:
        return None
    t, probe = torch.zeros(1024), _small_stage()
    cold, hot = [], []
    for _ in range(repeats):     # alternate, so slow drift of the machine hits both alike
        if rank == 1:
            dist.recv(t, 0, group=group)
            time.sleep(gap_s)
            dist.send(t, 0, group=group)
            continue
        dist.send(t, 1, group=group)
        dist.recv(t, 1, group=group)
        cold.append(probe())
        hot.append(probe())
    dist.destroy_process_group(group)
    return max(0.0, stats(cold)[0] - stats(hot)[0]) if rank == 0 else None


def reference_step(threads_hint: int | None = None) -> Callable[[], None]:
    """A small training step shaped like the built-in workloads' layers (linear layers with a
    GELU and a LayerNorm, forward + backward + Adam on a 64-sample batch, ~34 MB of weights,
    gradients and moments: workers compete for the shared L3 cache and memory as in training):
    what the contention factor is measured with. Returns the step as a closure."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 1024),
                              torch.nn.LayerNorm(1024), torch.nn.Linear(1024, 10))
    x = torch.randn(64, 1024)
    opt = make_optimizer(net.parameters(), "adam", 1e-6)

    def step():   # a whole training step: with Adam's moments, ~34 MB per worker, as in training
        net.zero_grad(set_to_none=True)
        net(x).square().mean().backward()
        opt.step()
    return step


def per_call_in_window(fn: Callable[[], None], window_s: float) -> float:
    """Seconds per call of `fn` called back to back for `window_s` (after one warm-up call).
    Workers that start a window together (after a barrier) overlap for all of it, which
    `time_per_call`'s calibrated batches do not guarantee."""
    fn()
    n, t0 = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= window_s:
            return elapsed / n


def optimizer_table(repeats: int, min_time_s: float, barrier: Callable[[], None] | None = None,
                    dev: TorchDevice | None = None) -> dict[str, list[dict]]:
    """Adam and SGD steps (hetplan.planner.workload.optimizer, as the runtime builds them) over parameter sets of
    several tensor counts and sizes, each timed alone after evicting the caches (a 64 MiB copy;
    in training, forward and backward run between two steps): rows {"tensors", "bytes", "s"}
    (median seconds per step). With `barrier` (called before each timed step), every worker
    steps at once. On `dev` (default the CPU), synchronized before and after each step."""
    shapes = [(1, 1 << 20), (4, 1 << 18), (16, 1 << 16), (64, 1 << 12), (64, 1 << 14), (8, 1 << 20)]
    if dev is None:
        from hetplan.planner.hardware.device import torch_device
        dev = torch_device("cpu:0")
    where, sync = dev.device, dev.synchronize
    junk_src, junk_dst = torch.ones(16 << 20, device=where), torch.empty(16 << 20, device=where)
    out: dict[str, list[dict]] = {}
    for name in ("adam", "sgd"):
        rows = []
        for n, numel in shapes:
            params = [torch.nn.Parameter(torch.randn(numel, device=where)) for _ in range(n)]
            for p in params:
                p.grad = torch.randn(numel, device=where)
            opt = make_optimizer(params, name, 1e-3 if name == "adam" else 1e-2)
            samples = []
            for _ in range(max(5, repeats)):
                junk_dst.copy_(junk_src)
                if barrier is not None:
                    barrier()
                sync()
                t0 = time.perf_counter()
                opt.step()
                sync()
                samples.append(time.perf_counter() - t0)
            med, spread = stats(samples[1:])
            rows.append({"tensors": n, "bytes": n * numel * 4, "s": med, "spread": spread})
        out[name] = rows
    return out


def _noop_hook(state, bucket):
    """A DDP comm hook that reduces nothing: DDP's own work without the communication."""
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def ddp_costs(group, repeats: int) -> dict[str, float]:
    """DDP's own work, in the runtime's pattern (hetplan.runtime.ddp.wrap: gradients as bucket views,
    no buffer sync, one bucket; gradients set to None before each iteration, Adam after), on a
    one-rank `group` with a comm hook that reduces nothing. A 4-layer 512-wide MLP at 16 samples
    runs wrapped and plain, alternating iterations; returns the medians' differences:
    `ddp_forward_s` (a forward under DDP, >= 0), `ddp_backward_s` (a backward: mainly the copy of
    each gradient into its bucket), and `grad_copy_s_per_byte`: copying freshly computed
    gradients into a flat buffer tensor by tensor (what the reducer and hetplan.runtime.sync.GradSync
    do), per byte."""
    from torch.nn.parallel import DistributedDataParallel

    def mlp() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                                   torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(),
                                   torch.nn.Linear(512, 10))
    plain, inner = mlp(), mlp()
    n_bytes = sum(p.numel() * p.element_size() for p in plain.parameters())
    wrapped = DistributedDataParallel(inner, process_group=group, bucket_cap_mb=n_bytes / 2 ** 20 + 1,
                                      gradient_as_bucket_view=True,
                                      **ddp.no_forward_buffer_sync(ddp.ddp_parameters()))
    wrapped.register_comm_hook(None, _noop_hook)
    x, y = torch.randn(16, 512), torch.randint(0, 10, (16,))
    flat = torch.empty(n_bytes // 4)
    runs = {}
    for name, (model, params) in {"plain": (plain, list(plain.parameters())),
                                  "ddp": (wrapped, list(inner.parameters()))}.items():
        runs[name] = (model, params, make_optimizer(params, "adam", 1e-6), {"fwd": [], "bwd": []})
    copies = []

    def iteration(name: str, keep: bool) -> None:
        model, params, opt, times = runs[name]
        for p in params:
            p.grad = None
        t0 = time.perf_counter()
        out = model(x)
        t1 = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(out, y)
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        if name == "plain":       # the gradients are fresh and in cache, as in a bucket's hook
            off, t4 = 0, time.perf_counter()
            for p in params:
                n = p.numel()
                flat[off:off + n].copy_(p.grad.reshape(-1))
                off += n
            if keep:
                copies.append(time.perf_counter() - t4)
        opt.step()
        if keep:
            times["fwd"].append(t1 - t0)
            times["bwd"].append(t3 - t2)

    for i in range(repeats + 10):    # the first ones: DDP's bucket rebuild, allocator warm-up
        for name in ("plain", "ddp"):
            iteration(name, i >= 10)
    med = {k: {p: stats(v)[0] for p, v in r[3].items()} for k, r in runs.items()}
    copy_s = stats(copies)[0]
    return {"ddp_forward_s": max(0.0, med["ddp"]["fwd"] - med["plain"]["fwd"]),
            "ddp_backward_s": max(0.0, med["ddp"]["bwd"] - med["plain"]["bwd"]),
            "grad_copy_s_per_byte": copy_s / n_bytes}
