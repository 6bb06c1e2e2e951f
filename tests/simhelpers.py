"""Hand-built graphs, topologies and plans for exact-time simulator tests (not a test file)."""
from __future__ import annotations

from hetplan.planner.workload.graph import Layer, ModelGraph
from hetplan.planner.files.plan import ModelRef, Optimizer, Plan, Replica, Stage, Sync
from hetplan.planner.hardware.topology import Device, Link, Topology


def layer(i: int, fwd_flops=1e9, bwd_flops=2e9, param_bytes=0, saved_bytes=0) -> Layer:
    return Layer(index=i, name=f"l{i}", fwd_flops=fwd_flops, bwd_flops=bwd_flops,
                 param_bytes=param_bytes, activation_bytes=0, saved_bytes=saved_bytes,
                 fwd_bytes_moved=0.0, bwd_bytes_moved=0.0, n_ops=1, bwd_n_ops=2,
                 param_names=(f"l{i}.weight",), signature=f"sig{i}")


def graph(layers, batch=1, cut_bytes=None) -> ModelGraph:
    layers = tuple(layers)
    return ModelGraph(layers=layers, batch=batch,
                      cut_bytes=tuple(cut_bytes) if cut_bytes else (0,) * (len(layers) + 1))


def device(name, flops=1e9, mem_bw=1e30, memory=1e12, overhead=0.0) -> Device:
    return Device(name=name, kind=name.split("/")[-1].split(":")[0], memory_bytes=memory,
                  matmul_flops_per_s=flops, memory_bytes_per_s=mem_bw, op_overhead_s=overhead)


def topology(devices, links=()) -> Topology:
    return Topology(name="t", devices=tuple(devices), links=tuple(links))


def link(a, b, bw=1e30, lat=0.0) -> Link:
    return Link(a=a, b=b, bandwidth_bytes_per_s=bw, latency_s=lat)


def plan(replicas, global_batch, schedule="1f1b", granularity="fine", bucket_bytes=1 << 40,
         optimizer="sgd", placement="device", recompute=False, cpu_fraction=None) -> Plan:
    """replicas: list of (batch_fraction, microbatches, [(device, start, end[, offload]), ...])."""
    reps = tuple(Replica(f, m, tuple(Stage(d, (a, b), *off) for d, a, b, *off in st)) for f, m, st in replicas)
    return Plan(model=ModelRef("synthetic"), global_batch=global_batch, replicas=reps,
                schedule=schedule, sync=Sync(granularity, bucket_bytes),
                optimizer=Optimizer(optimizer, 1e-3, placement, cpu_fraction), recompute=recompute)


def with_timed_steps(topo: Topology, fixed_s: float = 2e-3) -> Topology:
    """`topo` with each GPU's optimizer steps timed by a profile (`optimizer_table`): `fixed_s`
    per step (the host's launches) + 1e-5 s per tensor + the device's memory traffic."""
    from dataclasses import replace
    from hetplan.planner.cost.model import OPTIMIZER_BYTES_PER_PARAM_BYTE

    def rows(d, name):
        per_byte = OPTIMIZER_BYTES_PER_PARAM_BYTE[name] / d.memory_bytes_per_s
        return [{"tensors": n, "bytes": b, "s": fixed_s + 1e-5 * n + per_byte * b}
                for n, b in ((1, 4e6), (16, 4e6), (64, 3.2e7))]
    return replace(topo, devices=tuple(
        replace(d, measured={**d.measured, "optimizer_table": {k: rows(d, k) for k in ("adam", "sgd")}})
        if d.kind == "cuda" else d for d in topo.devices))
