"""Local launch of `hetplan run`: one process per plan device on this machine.

Children are started with multiprocessing (forkserver, else spawn) and run the same env:// worker as torchrun
(hetplan.runtime.worker.run_worker). The launcher watches them: when one exits non-zero (an error, or
killed), it terminates the others at once and raises `RunError` naming that rank, so a fault
ends the whole run in well under the collective timeout. Rank 0 writes the measured file into
a private run directory; the launcher reads it only after every rank exited 0, so a failed run
never leaves a measured file at the user's path.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from hetplan.planner.files.io import InputError
from hetplan.planner.files.plan import Plan
from hetplan.planner.hardware.topology import Topology, parse_device_name
from hetplan.runtime.rendezvous import env_vars, free_port
from hetplan.runtime.placement import default_threads, node_of
from hetplan.runtime.startup import Marks, launcher_phases, rank_phases
from hetplan.runtime.worker import RunConfig, is_input_error, report_error, run_worker

_POLL_S = 0.05
_TERMINATE_GRACE_S = 5.0


class RunError(Exception):
    """A worker failed; the message is one line naming the rank and device."""


class Stopped(Exception):
    """The launcher got SIGINT or SIGTERM; the run exits 128 + the signal number (130, 143)."""

    def __init__(self, signum: int):
        self.exit_code = 128 + signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")


@contextlib.contextmanager
def stop_on_signals():
    """SIGINT and SIGTERM raise `Stopped` (once: a second signal is ignored, so stopping the
    workers is not itself interrupted). `launch` stops every worker on any exception."""
    import threading
    if threading.current_thread() is not threading.main_thread():
        yield                       # signal handlers belong to the main thread
        return

    def handler(signum, frame):
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, signal.SIG_IGN)
        raise Stopped(signum)

    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def check_devices(plan: Plan, file: str) -> None:
    """Every plan device must exist here: one node, cuda:N with N < the GPUs present; and the
    runtime runs the plan's sharding (hetplan.runtime.shard.check_runs)."""
    from hetplan.runtime.shard import check_runs
    check_runs(plan, file)
    nodes = {node_of(d) for d in plan.devices}
    if len(nodes) > 1:
        raise InputError(f"{file}: replicas: devices span nodes {sorted(nodes)}; run each node "
                         "with torchrun ... -m hetplan.runtime.worker PLAN")
    n_gpu = None
    for i, rep in enumerate(plan.replicas):
        for j, st in enumerate(rep.stages):
            for k, d in enumerate(st.devices):
                _, kind, index = parse_device_name(d)
                if kind != "cuda":
                    continue
                if n_gpu is None:
                    from hetplan.planner.hardware.device import gpu_count
                    n_gpu = gpu_count()
                if index >= n_gpu:
                    field = f"devices[{k}].device" if st.split else "device"
                    raise InputError(f"{file}: replicas[{i}].stages[{j}].{field}: {d!r} is not on "
                                     f"this machine ({n_gpu} CUDA device(s)); expected a device present here")


def thread_shares(plan: Plan, topology: Topology | None) -> dict[str, int]:
    """Intra-op threads of each worker: the topology's `threads` of the device when it has one,
    else those the plan was priced at (its topology.threads), else placement.default_threads
    (cores // CPU workers; GPU workers 1 beside CPU workers)."""
    priced = dict(plan.topology.threads) if plan.topology is not None else {}
    out = {}
    for d in plan.devices:
        t = topology.device(d).threads if topology is not None and topology.has_device(d) else None
        out[d] = t or priced.get(d) or default_threads(plan.devices, d)
    return out


def priced_conditions(plan: Plan, topology: Topology) -> dict:
    """TopologyRef's fields besides name and sha256: what `run` needs to reproduce the pricing."""
    host = topology.measured.get("host") if isinstance(topology.measured.get("host"), dict) else {}
    cpu = [d for d in plan.devices if topology.has_device(d) and topology.device(d).kind == "cpu"]
    shares = thread_shares(plan, topology)
    cores = host.get("cores")
    return {"threads": tuple(sorted((d, shares[d]) for d in cpu)), "host": host.get("hostname"),
            "cpu_cores": cores if isinstance(cores, int) else None}


def _child(rank: int, world: int, addr: str, port: int, cfg_json: str, env: dict,
           spawn_t: float) -> None:
    """Worker process: take the launcher's environment (a forkserver child would otherwise
    see the server's, from when it started), set the env:// variables and run the worker."""
    marks = Marks(spawn=spawn_t, entered=time.time())
    # Ctrl-C reaches the whole process group: the launcher alone handles it (it terminates
    # the workers), so a worker prints no KeyboardInterrupt of its own; SIGTERM ends it at once
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.update(env)
    os.environ.update(env_vars(rank, world, addr, port))
    cfg = RunConfig.from_json(cfg_json)
    try:
        run_worker(cfg, marks)
    except BaseException as e:  # noqa: BLE001 - reported to the launcher as one line
        line = report_error(cfg, e)
        if not is_input_error(e):  # bad input: the launcher prints its one line
            print(f"hetplan run: error: {line}", file=sys.stderr, flush=True)
        os._exit(1)


def _context(mp):
    """Fresh worker processes. forkserver (where available) forks them from a server that has
    already imported torch and the runtime, which saves seconds per worker over plain spawn;
    both start clean processes that share nothing with the launcher. torch.export and
    torch._dynamo are preloaded even for workers that export nothing: torch.optim imports
    torch._dynamo on its first step (~2 s of imports)."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch.export", "torch._dynamo",
                                "hetplan.runtime.stage", "hetplan.runtime.worker", "hetplan.planner.workload.partition",
                                "hetplan.planner.workload.builtin"])
    return ctx


def prestart() -> None:
    """Start the forkserver now, so that its imports overlap the launcher's own work."""
    import multiprocessing as mp
    from multiprocessing import forkserver

    if "forkserver" in mp.get_all_start_methods():
        _context(mp)
        forkserver.ensure_running()


def launch(cfg: RunConfig, devices: tuple[str, ...], master_addr: str = "127.0.0.1",
           master_port: int | None = None, marks: Marks | None = None) -> dict:
    """Run the plan on one local process per device (rank r = devices[r]); return the
    measured file's dict, with the start-up breakdown under "startup_s" (hetplan.runtime.startup;
    `marks` holds the launcher's own marks so far)."""
    import multiprocessing as mp

    marks = marks or Marks()
    run_dir = tempfile.mkdtemp(prefix="hetplan-run-")
    try:
        wcfg = replace(cfg, out=str(Path(run_dir) / "measured.json"), error_dir=run_dir)
        world = len(devices)
        port = master_port or free_port()
        ctx = _context(mp)
        env = dict(os.environ)
        procs = []
        try:
            for r in range(world):      # the spawn mark of each is taken just before its start
                procs.append(ctx.Process(target=_child, name=f"hetplan-rank{r}", args=(
                    r, world, master_addr, port, wcfg.to_json(), env, time.time())))
                procs[-1].start()
            marks.mark("spawned")
            _watch(procs, devices, run_dir)
            marks.mark("exited")
        except BaseException:      # RunError, Stopped (a signal): leave no worker behind
            _stop(procs)
            raise
        result = json.loads(Path(wcfg.out).read_text())
        result["startup_s"] = _startup(marks, devices, run_dir)
        return result
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def _startup(marks: Marks, devices, run_dir: str) -> dict:
    """Start-up phases of the launcher and of each rank (hetplan.runtime.startup)."""
    out = {"launcher": launcher_phases(marks.at)}
    for r, d in enumerate(devices):
        f = Path(run_dir, f"startup-rank{r}.json")
        if f.exists():
            out[d] = rank_phases({**Marks.load(f).at, "exited": marks.at["exited"]})
    return out


def _watch(procs, devices, run_dir: str) -> None:
    """Wait for all; on the first non-zero exit, stop the rest and raise RunError."""
    while True:
        failed = [(r, p) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
        if failed:
            # peers of a dead rank fail too, with a broken-connection error, often within the
            # same poll: name the rank whose failure is not such an echo
            lines = [_failure_line(r, devices[r], p.exitcode, run_dir) for r, p in failed]
            primary = [l for l in lines if not _is_echo(l)] or lines
            _stop(procs)
            bad_input = sorted(Path(run_dir).glob("input-rank*.txt"))
            if bad_input:          # the plan's model was refused: bad input, not a fault
                raise InputError(bad_input[0].read_text().strip())
            raise RunError(primary[0])
        if all(p.exitcode == 0 for p in procs):
            return
        time.sleep(_POLL_S)


def _stop(procs) -> None:
    for p in procs:
        if p.pid is not None and p.exitcode is None:
            p.terminate()
    deadline = time.monotonic() + _TERMINATE_GRACE_S
    for p in procs:
        if p.pid is None:          # never started
            continue
        p.join(max(0.0, deadline - time.monotonic()))
        if p.exitcode is None:
            p.kill()
            p.join()


def _is_echo(line: str) -> bool:
    low = line.lower()
    return any(k in low for k in ("connection closed", "connection reset", "broken pipe",
                                  "timed out", "gloo"))


def _failure_line(rank: int, device: str, code: int, run_dir: str) -> str:
    err = Path(run_dir, f"rank{rank}.txt")
    if err.exists():
        return f"worker failed: {err.read_text().strip()}"
    how = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
    return f"worker failed: rank {rank} ({device}) {how} without an error message"
