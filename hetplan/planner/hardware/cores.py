"""Core binding: each worker of a node computes on its own cores.

A worker's `threads` (the topology's, else hetplan.runtime.placement.default_threads) are a set of
cores, not a count: when the node's cores hold every local worker's threads, worker k (in plan
order) is bound to the next `threads` of the cores this process may use, as DeepSpeed's
`--bind_cores_to_rank` and numactl per torchrun rank do. The binding is set before the worker
starts any thread, so all of its threads inherit it (intra-op threads, gloo's event loop and
work threads). Without enough cores nothing is bound. `HETPLAN_BIND_CORES=0` turns it off.

Why (docs/tuning.md, "Threads are part of a CPU device"): unbound, two one-thread workers on two
cores often shared one core for most of a run, which then took about twice as long.
Limits: cores are taken in number order, no SMT sibling or NUMA node is considered; nothing is
bound where the OS has no thread affinity (not Linux).
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping, Sequence

from hetplan.planner.files.io import InputError

BIND_ENV = "HETPLAN_BIND_CORES"   # "0": leave affinity alone; "1" or unset: bind when cores suffice


def binding_enabled(env: Mapping[str, str] = os.environ) -> bool:
    """Whether core binding is on (HETPLAN_BIND_CORES: 0 or 1, default 1)."""
    value = env.get(BIND_ENV, "1").strip()
    if value not in ("0", "1"):
        raise InputError(f"environment variable {BIND_ENV}: expected 0 or 1, got {value!r}")
    return value == "1"


def usable_cores() -> list[int]:
    """The cores this process may run on, in number order (all of them without affinity)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:          # not Linux
        return list(range(os.cpu_count() or 1))


def assign_cores(threads: Sequence[tuple[str, int]], cores: Sequence[int]) -> dict[str, tuple[int, ...]]:
    """Disjoint core sets: worker k of `threads` ((device, threads) in plan order) gets the next
    `threads` of `cores`. Empty when the threads summed exceed the cores (nothing is bound)."""
    if sum(n for _, n in threads) > len(cores):
        return {}
    out, i = {}, 0
    for name, n in threads:
        out[name] = tuple(cores[i:i + n])
        i += n
    return out


def describe(assigned: Mapping[str, tuple[int, ...]], threads: Sequence[tuple[str, int]],
             cores: Sequence[int], enabled: bool) -> str:
    """One log line: what was bound, or why nothing was."""
    if not enabled:
        return f"cores not bound ({BIND_ENV}=0)"
    if not assigned:
        need = sum(n for _, n in threads)
        return (f"cores not bound: the workers' threads need {need} cores, this node has "
                f"{len(cores)}")
    return "cores bound: " + ", ".join(f"{d} -> {_span(c)}" for d, c in assigned.items())


def _span(cores: tuple[int, ...]) -> str:
    if len(cores) > 1 and cores[-1] - cores[0] == len(cores) - 1:
        return f"{cores[0]}-{cores[-1]}"
    return ",".join(map(str, cores))


_before_binding: list[int] | None = None   # the usable cores when bind_worker bound this process


def node_cores() -> list[int]:
    """The cores this node's workers share: this process's usable cores before `bind_worker`
    bound it to its own."""
    return list(_before_binding) if _before_binding is not None else usable_cores()


def bind_current_thread(cores: Sequence[int]) -> None:
    """Bind the calling thread (and the threads it starts from now on) to `cores`."""
    os.sched_setaffinity(0, cores)


def bind_worker(threads: Sequence[tuple[str, int]], name: str) -> tuple[tuple[int, ...] | None, str]:
    """Bind this worker (`name`, one of the node's workers in `threads`) to its cores; call it
    before the worker starts any thread. Returns its cores (None when unbound) and the log line."""
    usable, enabled = usable_cores(), binding_enabled()
    if not hasattr(os, "sched_setaffinity"):
        return None, "cores not bound: no thread affinity on this OS"
    assigned = assign_cores(threads, usable) if enabled else {}
    if assigned:
        global _before_binding
        _before_binding = usable
        bind_current_thread(assigned[name])
    return assigned.get(name), describe(assigned, threads, usable, enabled)


@contextlib.contextmanager
def bound_to_first(threads: int) -> Iterator[tuple[int, ...] | None]:
    """Layer timing: the calling thread bound to the first `threads` usable cores meanwhile (the
    cores a node's first worker gets), its affinity restored after; yields them, or None when
    binding is off or the cores are too few. An intra-op thread pool that exists already keeps
    its affinity (the limit of binding after start)."""
    usable = usable_cores()
    if not binding_enabled() or threads > len(usable) or not hasattr(os, "sched_setaffinity"):
        yield None
        return
    old = os.sched_getaffinity(0)
    bind_current_thread(usable[:threads])
    try:
        yield tuple(usable[:threads])
    finally:
        os.sched_setaffinity(0, old)


__all__ = ["BIND_ENV", "binding_enabled", "usable_cores", "node_cores", "assign_cores", "describe",
           "bind_current_thread", "bind_worker", "bound_to_first"]
