"""A workload's layer map (its layers and the parameters of each), cached by content.

Exporting a model (hetplan.planner.workload.layers) costs seconds; `run` needs from it only the number of
layers (to validate the plan) and each layer's parameter names (gradient buckets, the fine sync),
so those are kept in `<cache>/layer_maps/<key>.json` (hetplan.planner.files.cache).

The key is the sha256 of: the model spec, args and layer pattern, the batch, the torch version, the bytes of the
source files of the factory and of the model's class, and the model's state_dict structure (every
name, shape and dtype). A change to any of them is a different key, so an entry is never stale
for what it records; code outside those two files that changes the layer grouping without
changing the parameters is the limit (delete the cache folder then).
"""
from __future__ import annotations

import hashlib
import inspect
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hetplan.planner.files.cache import cache_dir as hetplan_cache
from hetplan.planner.files.io import write_json_atomic


@dataclass(frozen=True)
class LayerMap:
    names: tuple[str, ...]                  # layer names, execution order
    params: tuple[tuple[str, ...], ...]     # parameter names of each layer (one-layer stages;
                                            # a tied weight in every layer that uses it)
    buffers: tuple[tuple[str, ...], ...]    # the model's buffer names each layer uses
    unused: tuple[str, ...] = ()            # trainable parameters with no gradient (layers.unused_parameters)
    # on a cache miss, the export the map was cut from (hetplan.planner.workload.layers.Exported), so a
    # caller cuts its stages from it instead of exporting again; None when read from the cache
    exported: Any = field(default=None, compare=False, repr=False)

    @property
    def num_layers(self) -> int:
        return len(self.names)


def cache_dir() -> Path:
    return hetplan_cache() / "layer_maps"


def _source_bytes(obj) -> bytes:
    try:
        return Path(inspect.getsourcefile(obj) or "").read_bytes()
    except (OSError, TypeError):
        return b""        # no source file (a builtin, a REPL class): the other fields still key it


def cache_key(workload, spec: str, args: dict, batch: int) -> str:
    import torch
    from hetplan.planner.workload.load import resolve_factory

    h = hashlib.sha256()
    h.update(json.dumps([spec, args, getattr(workload, "layers", None), int(batch), torch.__version__],
                        sort_keys=True, default=str).encode())
    h.update(_source_bytes(resolve_factory(spec)))
    h.update(_source_bytes(type(workload.model)))
    for name, t in workload.model.state_dict().items():
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
    return h.hexdigest()


def compute_layer_map(workload, batch: int) -> LayerMap:
    """Export the workload and cut it into one stage per layer: the partitioner's grouping of
    parameters and buffers."""
    from hetplan.planner.workload.layers import unused_parameters
    from hetplan.planner.workload.partition import exported_stages

    exported, stages = exported_stages(workload, None, batch)
    model_buffers = dict(workload.model.named_buffers())
    return LayerMap(tuple(exported.names), tuple(tuple(n for n, _ in s.named_parameters()) for s in stages),
                    tuple(tuple(n for n, _ in s.named_buffers() if n in model_buffers) for s in stages),
                    unused_parameters(exported.gm), exported)


def plan_batch(plan) -> int:
    """The batch a plan's layer map is keyed and exported at (the launcher's check and every
    worker use this one, so they share one cache entry): its largest microbatch."""
    return max(1, plan.global_batch // max(r.microbatches for r in plan.replicas))


def layer_map(workload, spec: str, args: dict, batch: int) -> LayerMap:
    """The layer map of `workload` (built from `spec`, `args`), from the cache or computed
    (`compute_layer_map`) and stored."""
    path = cache_dir() / f"{cache_key(workload, spec, args, batch)}.json"
    try:
        data = json.loads(path.read_text())
        return LayerMap(tuple(data["names"]), tuple(tuple(p) for p in data["params"]),
                        tuple(tuple(b) for b in data["buffers"]), tuple(data["unused"]))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    found = compute_layer_map(workload, batch)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, {"names": list(found.names), "params": [list(p) for p in found.params],
                                 "buffers": [list(b) for b in found.buffers], "unused": list(found.unused)})
    except Exception:  # noqa: BLE001 - a cache that cannot be written only costs time
        pass
    return found
