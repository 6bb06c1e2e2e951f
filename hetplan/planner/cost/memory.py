"""Peak memory per device for one training iteration of a plan.

peak(device) = parameters + gradients + optimizer state + saved activations in flight, where
for the stage a device holds (layers [a, b), microbatch of `mb` samples, p stages, m
microbatches, stage index s):

* parameters and gradients: sum of param_bytes over [a, b), each, plus a copy of every tied
  parameter a layer of [a, b) uses whose first layer is in another stage
  (ModelGraph.stage_param_bytes).
* optimizer state: OPTIMIZER_STATE_PER_PARAM_BYTE (Adam 2x params, SGD 0). Under placement
  "cpu" a GPU keeps none; its host CPU holds the state plus a copy of the gradients. Under
  "split" the host holds both for cpu_fraction f of the bytes, the GPU the state of 1 - f.
* activations: saved_bytes of one microbatch (sum over [a, b), scaled to mb) times the
  microbatches in flight: GPipe holds all m; 1F1B at most min(p - s, m). Interleaved 1F1B:
  a device holds several virtual stages; its peak is the most it holds at once walking its
  schedule (each F adds the stage's microbatch, each B frees it): (p - r - 1) * 2 + (v - 1) * p
  + 1 stage-microbatches on device r when the warm-up is not capped by m * v. ZB-H1 min(p, m)
  on every stage (a microbatch is held from its F to its W, which stage s runs s microbatches
  late; 1F1B's stage-0 peak everywhere). Hippie: m on every stage but the last (GPipe's order),
  1 on the last (it alternates F and B). Not modelled under ZB-H1: the gradients an I pass keeps
  for its W (the inputs' gradients of the weight-holding ops).
  With recompute only the stage's input (cut_bytes at a, scaled to mb) is kept per in-flight
  microbatch, plus one microbatch's full saved activations while it is recomputed.
* precision: the graph was captured in the plan's precision, so saved bytes are of the dtypes
  autocast gives (bf16 activations are half of fp32's); parameters, gradients and optimizer state
  stay fp32. Under bf16 each microbatch in flight also holds autocast's bf16 copies of the
  stage's weights (Layer.cast_param_bytes, not scaled by mb; one set under recompute).
* sync.mode "easgd": each worker also holds the center variable, a copy of its parameters.
* sync.mode "parameter-server": the workers hold parameters and gradients, the server the
  parameters, one worker's gradients and the optimizer state.
* sync.mode "pipedream" / "pipedream-2bw": each stage also holds the weight versions its
  in-flight microbatches' forwards used (weight stashing, hetplan.runtime.pipedream): one copy of its
  parameters per microbatch in flight under PipeDream (p - s on stage s; 1F1B without flush
  keeps p - s in flight), at most 2 under 2BW; "average": "swa" one more (the running sum).
* a tensor-split stage ("devices"): each device holds its share of the split linear pairs'
  parameters, gradients and optimizer state and the rest whole (`held_param_bytes`), and the
  stage's saved activations whole (an upper bound: the split pairs' hidden activations are
  held in shares).
* offload_activations: the stage's host CPU holds what the device would (every microbatch in
  flight); the device holds two of the stage's largest layer's saved bytes (one being copied
  out or back while the next is computed).

* shard (ZeRO stage k over the N replicas; stage j of each holds the same layers): equal shards,
  1/N each, whatever the batch shares (the collectives move equal chunks; sharding is for memory,
  the shares for speed). Stage 1: 1/N of the optimizer state. Stage 2: also 1/N of the
  gradients, plus twice a bucket's whole gradients (reduce-scattered a bucket at a time, laid out
  in rows beside them; a bucket: sync.bucket_bytes and the layer that crosses it, at most the
  stage; coarse sync: the stage). More than unsharded where the bucket is the stage. With more
  than one microbatch the earlier ones' whole gradients are held too (the slices and a bucket's
  rows beside them). Stage 3: also 1/N of the parameters, plus two units (a bucket: the one in
  use and the next being gathered). Under placement "cpu" the host holds the slices' optimizer
  state and its copy of their gradients instead (ZeRO-Offload over shards). The runtime's
  slices are 1/N of every tensor (stages 1, 2) or of every unit (stage 3; hetplan.runtime.shard).

Not modelled: allocator fragmentation and caching, temporary workspaces, the gradient of the
activations flowing through backward, communication buffers, the CUDA context.
"""
from __future__ import annotations

from hetplan.planner.cost.model import OPTIMIZER_STATE_PER_PARAM_BYTE, host_cpu
from hetplan.planner.workload.graph import ModelGraph
from hetplan.planner.files.plan import Plan, Stage
from hetplan.planner.hardware.topology import Topology
from hetplan.planner.files.schedule import make_schedule


def in_flight(schedule: str, stages: int, stage: int, microbatches: int, devices: int | None = None) -> int:
    """Microbatches whose activations stage `stage` holds at once: m (GPipe), min(p - s, m) (1F1B),
    min(p, m) (ZB-H1), m but 1 on the last stage (Hippie); interleaved 1F1B (`devices` p): the
    most its device's schedule holds of that stage."""
    if schedule == "gpipe":
        return microbatches
    if schedule == "zb-h1":
        return min(stages, microbatches)
    if schedule == "hippie":
        return 1 if stage == stages - 1 else microbatches
    if schedule == "interleaved-1f1b":
        p = devices or stages
        held, most = 0, 0
        for a in make_schedule(schedule, stages, microbatches, p)[stage % p]:
            if a.stage == stage:
                held += 1 if a.kind == "F" else -1
                most = max(most, held)
        return most
    return min(stages - stage, microbatches)


def device_activation_bytes(plan: Plan, graph: ModelGraph, rep_index: int) -> dict[str, float]:
    """Interleaved 1F1B: each device's peak saved-activation bytes over its virtual stages,
    walking its schedule; with recompute a stage keeps its input per microbatch and, during a
    backward, one microbatch's full saved activations."""
    rep = plan.replicas[rep_index]
    devs = rep.pipeline_devices
    mb = plan.replica_batches()[rep_index] / rep.microbatches
    one = [saved_per_microbatch(plan, graph, rep_index, s) for s in range(len(rep.stages))]
    keep = [graph.cut_bytes_at(st.start, mb) for st in rep.stages] if plan.recompute else one
    out = {}
    for r, acts in enumerate(make_schedule(plan.schedule, len(rep.stages), rep.microbatches, len(devs))):
        held = most = 0.0
        for a in acts:
            if a.kind == "F":
                held += keep[a.stage]
                most = max(most, held)
            else:
                most = max(most, held + (one[a.stage] if plan.recompute else 0.0))
                held -= keep[a.stage]
        out[devs[r]] = most
    return out


def saved_per_microbatch(plan: Plan, graph: ModelGraph, rep_index: int, stage: int,
                         batches: list[int] | None = None) -> float:
    """Bytes one microbatch of a stage saves for backward: its layers' saved_bytes scaled to the
    microbatch, plus (bf16) autocast's weight copies. `batches`: plan.replica_batches(), if known."""
    rep = plan.replicas[rep_index]
    st = rep.stages[stage]
    batch = (batches or plan.replica_batches())[rep_index]
    return graph.saved_bytes_at(st.start, st.end, batch / rep.microbatches)


def activation_bytes(plan: Plan, graph: ModelGraph, rep_index: int, stage: int,
                     batches: list[int] | None = None) -> float:
    """Peak saved-activation bytes of one stage of one replica on its device (see the module
    docstring); an offloaded stage's device holds two of its largest layer's."""
    rep = plan.replicas[rep_index]
    st = rep.stages[stage]
    batches = batches or plan.replica_batches()
    mb = batches[rep_index] / rep.microbatches
    if st.offload_activations:
        return 2 * max(graph.saved_bytes_at(i, i + 1, mb) for i in range(st.start, st.end))
    one_mb = saved_per_microbatch(plan, graph, rep_index, stage, batches)
    n = in_flight(plan.schedule, len(rep.stages), stage, rep.microbatches)
    if plan.recompute:
        return n * graph.cut_bytes_at(st.start, mb) + one_mb
    return n * one_mb


def offloaded_bytes(plan: Plan, graph: ModelGraph, rep_index: int, stage: int) -> float:
    """Saved-activation bytes an offloaded stage keeps in host memory at the peak: every
    microbatch in flight (0 for a stage that does not offload)."""
    rep = plan.replicas[rep_index]
    if not rep.stages[stage].offload_activations:
        return 0.0
    n = in_flight(plan.schedule, len(rep.stages), stage, rep.microbatches)
    return n * saved_per_microbatch(plan, graph, rep_index, stage)


def stashed_versions(plan: Plan, stages: int, stage: int) -> int:
    """Copies of a stage's parameters besides its live weights (see the module docstring)."""
    mode = plan.sync.mode
    if mode == "pipedream":
        return stages - stage + (plan.sync.average == "swa")
    if mode == "pipedream-2bw":
        return min(2, stages - stage)
    return 1 if mode == "easgd" else 0      # EASGD's center variable


def held_param_bytes(st: Stage, graph: ModelGraph) -> list[tuple[str, float]]:
    """(device, parameter bytes it holds) for a stage: all of them on its device; under a tensor
    split each device holds its share of the split pairs' bytes and the rest whole."""
    n = float(graph.stage_param_bytes(st.start, st.end))
    if not st.split:
        return [(st.device, n)]
    split = float(sum(p.param_bytes for p in graph.split_pairs(st.start, st.end)))
    return [(s.device, n - (1.0 - s.share) * split) for s in st.split]


def stepped_params(plan: Plan, graph: ModelGraph) -> dict[str, tuple[float, int]]:
    """(parameter bytes, parameter tensors) each device's optimizer step updates: its stages'
    (several under interleaving), or under a tensor split its share of the split stage's bytes
    over all of that stage's tensors; sharded (`plan.shard`), 1/N of them."""
    ranges: dict[str, list[tuple[int, int]]] = {}
    split: dict[str, tuple[float, int]] = {}
    for rep in plan.replicas:
        for st in rep.stages:
            if st.split:
                n_t = sum(len(graph.layers[i].param_names) for i in range(st.start, st.end))
                for dev, n in held_param_bytes(st, graph):
                    split[dev] = (n, n_t)
                    ranges.setdefault(dev, [])
            else:
                ranges.setdefault(st.device, []).append(st.layers)
    out = {dev: split.get(dev) or ((graph.stage_param_bytes(*rs[0]) if len(rs) == 1 else graph.device_param_bytes(rs)),
                                   sum(graph.stage_param_tensors(a, b) for a, b in rs))
           for dev, rs in ranges.items()}
    if plan.shard:      # each of the N replicas steps its 1/N (validated: one stage a device):
        k = len(plan.replicas)   # a slice of every tensor; ZeRO-3 a chunk of each unit (bucket)
        units = {dev: len(stage_units(plan, graph, rs[0])) for dev, rs in ranges.items()} if plan.shard == 3 else {}
        out = {dev: (n / k, units.get(dev, n_t)) for dev, (n, n_t) in out.items()}
    return out


def stage_units(plan: Plan, graph: ModelGraph, layers: tuple[int, int]) -> list[int]:
    """The bytes of each gradient bucket of a stage of layers [a, b) (ZeRO-3's units), in the
    order backward makes them ready (its last layers first); coarse sync: one, the stage."""
    from hetplan.planner.cost.buckets import grad_buckets
    a, b = layers
    mine = [x.bytes for x in grad_buckets(plan, graph) if a <= min(x.layers) < b]
    return mine if mine and plan.sync.granularity == "fine" else [graph.stage_param_bytes(a, b)]


def sharded_bytes(plan: Plan, graph: ModelGraph, st: Stage, rep, state_ratio: float) -> float:
    """A sharded stage's parameters, gradients and optimizer state on its device (the module
    docstring's rule; hetplan.runtime.shard)."""
    params, n = float(graph.stage_param_bytes(st.start, st.end)), len(plan.replicas)
    whole = float(max(stage_units(plan, graph, st.layers)))   # the largest bucket (a ZeRO-3 unit)
    grads = params
    if plan.shard >= 2:   # the slices, a bucket's rows; earlier microbatches' whole gradients
        grads = params / n + 2 * whole if rep.microbatches == 1 else params + params / n + whole
    held = params / n + 2 * whole if plan.shard == 3 else params   # slices, a unit in use, the next gathered
    return held + grads + state_ratio * params / n


def peak_memory(plan: Plan, graph: ModelGraph, topology: Topology) -> dict[str, float]:
    """Peak bytes per device used by the plan (hosts of offloaded optimizers included)."""
    state_ratio = OPTIMIZER_STATE_PER_PARAM_BYTE[plan.optimizer.name]
    placement = plan.optimizer.placement
    f = 1.0 if placement == "cpu" else plan.optimizer.cpu_fraction or 0.0
    out: dict[str, float] = {}
    if plan.sync.mode == "parameter-server":
        out[plan.sync.server] = (2 + state_ratio) * float(graph.stage_param_bytes(0, graph.num_layers))
        state_ratio = 0.0            # the workers keep no optimizer state
    interleaved = plan.schedule == "interleaved-1f1b"
    batches = plan.replica_batches()
    for r, rep in enumerate(plan.replicas):
        if interleaved:      # activations per device (its virtual stages together)
            for d, acts in device_activation_bytes(plan, graph, r).items():
                out[d] = out.get(d, 0.0) + acts
        for s, st in enumerate(rep.stages):
            acts = 0.0 if interleaved else activation_bytes(plan, graph, r, s, batches)
            if st.split:       # validated: optimizer on the devices, synchronous, no offload, not interleaved
                for dev, params in held_param_bytes(st, graph):
                    out[dev] = out.get(dev, 0.0) + (2 + state_ratio) * params + acts
                continue
            params = float(graph.stage_param_bytes(st.start, st.end))
            if interleaved:   # what this stage adds to its device's earlier ones (one tied copy)
                before = [x.layers for x in rep.stages[:s] if x.device == st.device]
                params = float(graph.device_param_bytes(before + [st.layers]) - graph.device_param_bytes(before))
            copies = stashed_versions(plan, len(rep.stages), s) * params
            if plan.shard:
                host = host_cpu(topology, st.device) if placement == "cpu" else st.device
                on_host = host != st.device      # ZeRO-Offload over shards: the slices' state and gradients there
                out[st.device] = out.get(st.device, 0.0) + acts + sharded_bytes(plan, graph, st, rep,
                                                                                0.0 if on_host else state_ratio)
                if on_host:
                    part = float(graph.stage_param_bytes(st.start, st.end)) / len(plan.replicas)
                    out[host] = out.get(host, 0.0) + (state_ratio + 1) * part
                continue
            out[st.device] = out.get(st.device, 0.0) + 2 * params + acts + copies
            if st.offload_activations:
                h = host_cpu(topology, st.device)
                out[h] = out.get(h, 0.0) + offloaded_bytes(plan, graph, r, s)
            host = host_cpu(topology, st.device) if placement != "device" else st.device
            if host == st.device:
                out[host] += state_ratio * params
                continue
            # the host's share: its optimizer state and its copy of those gradients
            out[st.device] += state_ratio * (1 - f) * params
            out[host] = out.get(host, 0.0) + (state_ratio + 1) * f * params
    return out


def feasible(peaks: dict[str, float], topology: Topology) -> bool:
    return all(v <= topology.device(d).memory_bytes for d, v in peaks.items())


__all__ = ["held_param_bytes", "stepped_params", "stage_units", "sharded_bytes", "in_flight", "device_activation_bytes", "stashed_versions", "saved_per_microbatch", "activation_bytes",
           "offloaded_bytes", "peak_memory", "feasible"]
