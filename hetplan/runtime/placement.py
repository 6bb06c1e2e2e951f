"""Where a worker runs: the plan device of a rank, and the intra-op threads it gets.

Shared by `hetplan run`'s launcher (hetplan.runtime.launch) and its workers (hetplan.runtime.worker, also under
torchrun).
"""
from __future__ import annotations

import os

from hetplan.planner.hardware.topology import natural_key, parse_device_name
from hetplan.runtime.gloo_threads import thread_ids


def node_of(device: str) -> str:
    """The node prefix of a plan device name ("node1/cpu:0" -> "node1"; "" without one)."""
    return device.split("/", 1)[0] if "/" in device else ""


def my_device(devices: tuple[str, ...], env) -> str:
    """The plan device of this process.

    Nodes are the distinct node prefixes of the plan's device names in natural order (node0,
    node1, ..., node10); torchrun's node rank (GROUP_RANK) picks one, and LOCAL_RANK picks the
    node's devices in plan order. Without prefixes the plan is one node.
    """
    nodes = sorted({node_of(d) for d in devices}, key=natural_key)
    node_rank = int(env.get("GROUP_RANK", "0"))
    if node_rank >= len(nodes):
        raise ValueError(f"node rank {node_rank} but the plan has {len(nodes)} node(s)")
    local = [d for d in devices if node_of(d) == nodes[node_rank]]
    local_world = int(env.get("LOCAL_WORLD_SIZE", len(local)))
    if local_world != len(local):
        raise ValueError(f"node {nodes[node_rank] or 'local'} runs {local_world} processes but the plan "
                         f"has {len(local)} device(s) there ({', '.join(local)})")
    return local[int(env.get("LOCAL_RANK", env.get("RANK", "0")))]


def default_threads(devices: tuple[str, ...], name: str, cores: int | None = None) -> int:
    """Intra-op threads of a worker when no topology says: the node's cores are split evenly
    among its CPU workers; a GPU worker gets 1 when CPU workers share its node (it mostly
    launches kernels; more would steal their cores), else an even split among GPU workers."""
    cores = cores or os.cpu_count() or 1
    local = [d for d in devices if node_of(d) == node_of(name)]
    cpus = [d for d in local if parse_device_name(d)[1] == "cpu"]
    if parse_device_name(name)[1] == "cpu":
        return max(1, cores // len(cpus))
    return 1 if cpus else max(1, cores // len(local))


def local_threads(devices: tuple[str, ...], name: str, threads: dict[str, int]) -> list[tuple[str, int]]:
    """(device, intra-op threads) of every worker on `name`'s node, in plan order: `threads`
    where it says, else default_threads."""
    return [(d, threads.get(d) or default_threads(devices, d))
            for d in devices if node_of(d) == node_of(name)]


def threads_affinity() -> list[int] | None:
    """The cores any thread of this process may run on (the union over its threads); None
    where there is no /proc (not Linux)."""
    tids = thread_ids()
    if tids is None:
        return None
    out: set[int] = set()
    for tid in tids:
        try:
            out |= os.sched_getaffinity(tid)
        except OSError:          # the thread ended meanwhile
            continue
    return sorted(out)
