"""Checkpoints of a training run on torch.distributed.checkpoint, resumable under any plan.

A checkpoint is a directory `DIR/step-NNNNNNNN`: DCP files holding every parameter and its
optimizer state under the model's own names (`model.<name>`, `optim.<name>.<state>`: each rank
writes what its stage holds, replicas' copies written once), each rank's RNG states
(`rng-rank<R>.pt`) and `hetplan.json` (step, data position, model, parameter shapes). Ranks write
into `DIR/.step-NNNNNNNN.partial`, which rank 0 renames once every rank has finished: a checkpoint
is complete or absent, and a save killed halfway leaves the previous one usable. Because the
names are the model's, another plan of the same model (other devices, stages, shares) reads it:
each rank loads the names its stage holds. A shared directory is needed across nodes.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from hetplan.planner.files.io import InputError

SCHEMA = "hetplan.checkpoint/1"
META = "hetplan.json"


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def complete(root: str | Path) -> list[Path]:
    """The complete checkpoints under `root`, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-") and (p / META).is_file()]
    return sorted(out, key=lambda p: p.name)


def read_meta(path: Path) -> dict[str, Any]:
    """A checkpoint's hetplan.json, checked: InputError naming the file when it is not one."""
    f = path / META
    try:
        meta = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise InputError(f"{f}: not a readable checkpoint description ({e}); expected {SCHEMA}") from None
    if not isinstance(meta, dict) or meta.get("schema") != SCHEMA:
        raise InputError(f"{f}: schema: expected {SCHEMA!r}")
    for key, kind in (("step", int), ("seed", int), ("model", dict), ("params", dict)):
        if not isinstance(meta.get(key), kind):
            raise InputError(f"{f}: {key}: expected {kind.__name__}")
    if not (path / ".metadata").is_file():
        raise InputError(f"{path}: .metadata is missing; expected a complete torch.distributed.checkpoint")
    return meta


def latest(root: str | Path) -> Path | None:
    found = complete(root)
    return found[-1] if found else None


def check_resumable(root: str | Path, model: dict[str, Any], flag: str = "--resume") -> dict[str, Any]:
    """The latest checkpoint's description, refused (InputError) when there is none or it is of
    another model."""
    path = latest(root)
    if path is None:
        raise InputError(f"{flag}: no complete checkpoint in {root}; expected a step-NNNNNNNN directory "
                         "written by --checkpoint-every")
    meta = read_meta(path)
    if meta["model"] != model:
        raise InputError(f"{path / META}: model: the checkpoint is of {json.dumps(meta['model'])}; expected the "
                         f"plan's {json.dumps(model)}")
    return {**meta, "path": str(path)}


# --- what a rank saves and loads ---------------------------------------------------------------
def _optimizer_slots(built) -> dict[str, tuple[torch.optim.Optimizer, torch.Tensor]]:
    """Each trainable parameter's name -> (the torch optimizer stepping it, the tensor it steps:
    the parameter, or its host master copy)."""
    opt = built.optimizer
    stepped = dict(zip(map(id, opt.on_device), [(opt.device_opt, p) for p in opt.on_device]))
    stepped.update(zip(map(id, opt.on_host), [(opt.host_opt, m) for m in opt.master]))
    return {n: stepped[id(p)] for n, p in built.named_params if id(p) in stepped}


def ensure_state(built) -> None:
    """Create the optimizers' state (zero-gradient step at lr 0) so that a load has tensors to fill."""
    for torch_opt in (built.optimizer.device_opt, built.optimizer.host_opt):
        if torch_opt is None or all(torch_opt.state.get(p) for g in torch_opt.param_groups for p in g["params"]):
            continue
        lrs = [g["lr"] for g in torch_opt.param_groups]
        for g in torch_opt.param_groups:
            g["lr"] = 0.0
            for p in g["params"]:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
        torch_opt.step()
        for g, lr in zip(torch_opt.param_groups, lrs):
            g["lr"] = lr
            for p in g["params"]:
                p.grad = None


def state_dict(built) -> dict[str, torch.Tensor]:
    """This rank's part: its parameters and their optimizer state, by the model's names (ZeRO:
    the whole state, gathered from the group's slices; ZeRO-3: inside `whole_parameters`)."""
    out = {f"model.{n}": p.detach() for n, p in built.named_params}
    out.update({f"buffer.{n}": b for n, b in built.module.named_buffers() if b is not None})
    if getattr(built.optimizer, "sharded", None) is not None:
        out.update(_sharded_state(built))
        return out
    for n, (torch_opt, t) in _optimizer_slots(built).items():
        for key, v in torch_opt.state.get(t, {}).items():
            out[f"optim.{n}.{key}"] = v if isinstance(v, torch.Tensor) else torch.tensor(v)
    return out


def _sharded_state(built) -> dict[str, torch.Tensor]:
    """ZeRO: each state of the slices' optimizer as whole tensors (`ShardedStep.whole`, one
    all-gather per state name); a per-tensor scalar (Adam's step) the same on every slice."""
    import torch.distributed as dist
    st = built.optimizer.sharded
    states = [built.optimizer.state_of(t) for t in st.slices]
    keys = sorted({k for s in states for k in s})
    everyone: list = [None] * st.n
    dist.all_gather_object(everyone, keys, group=st.group)     # a rank with no slice knows none
    keys = sorted({k for ks in everyone for k in ks})
    names = {id(p): n for n, p in built.named_params}
    out = {}
    for key in keys:
        vals = [s.get(key) for s in states]
        if any(torch.is_tensor(v) and v.dim() == 0 or not torch.is_tensor(v) and v is not None for v in vals):
            v = next(v for v in vals if v is not None)
            scalar = v if torch.is_tensor(v) else torch.tensor(v)
            for p in st.params:
                out[f"optim.{names[id(p)]}.{key}"] = scalar.detach().cpu().clone()
            continue
        for p, whole in zip(st.params, st.whole(vals)):
            out[f"optim.{names[id(p)]}.{key}"] = whole
    return out


def _load_sharded(built, sd: dict[str, torch.Tensor]) -> None:
    """The slices' optimizer state (and ZeRO-3's own parameter chunks, the host's master
    copies) from the loaded whole tensors."""
    st, opt = built.optimizer.sharded, built.optimizer
    by_id = {id(p): n for n, p in built.named_params}
    names = [by_id[id(p)] for p in st.params]
    with torch.no_grad():
        if st.own:
            for t, got in zip(st.slices, st.split([p.detach() for p in st.params])):
                t.copy_(got)
        for key in sorted({k for t in st.slices for k in opt.state_of(t)}):
            wholes = [sd[f"optim.{n}.{key}"] for n in names]
            parts = st.split(wholes) if wholes[0].dim() else None     # else a scalar, the same on every slice
            for j, t in enumerate(st.slices):
                v = opt.state_of(t).get(key)
                if v is not None:
                    v.copy_(parts[j] if parts is not None else wholes[0])
    opt.refresh_masters()


def save(root: str | Path, step: int, built, rank: int, meta: dict[str, Any], group=None,
         written=None) -> Path:
    """Write step `step` (collective over `group`); returns the complete directory. `written()`
    is called once this rank's files are written, before the rename (tests kill a rank there)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    final = step_dir(root, step)
    partial = Path(root) / f".{final.name}.partial"
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    dist.barrier(group)
    with built.whole_parameters():
        dcp.save(state_dict(built), checkpoint_id=str(partial), process_group=group)
    torch.save(rng_states(), partial / f"rng-rank{rank}.pt")
    if written is not None:
        written()
    dist.barrier(group)
    if rank == 0:
        (partial / META).write_text(json.dumps({"schema": SCHEMA, "step": step, **meta}, indent=1))
        _fsync_dir(partial)
        if final.exists():
            shutil.rmtree(final)
        os.replace(partial, final)
        _fsync_dir(final.parent)
    dist.barrier(group)
    return final


def load(path: str | Path, built, rank: int, world: int, meta: dict[str, Any], plan_sha256: str,
         group=None) -> None:
    """Fill this rank's parameters and optimizer state from checkpoint `path` (collective); its
    RNG states too when the checkpoint was written by this very plan (the same ranks)."""
    import torch.distributed.checkpoint as dcp
    path = Path(path)
    shapes = meta["params"]
    for n, p in built.named_params:
        want = shapes.get(n)
        if want is None:
            raise InputError(f"{path / META}: params: no {n!r}; expected a checkpoint of this model")
        if built_full_shape(built, n, p) != tuple(want):
            raise InputError(f"{path / META}: params.{n}: shape {want}; expected {list(built_full_shape(built, n, p))}")
    ensure_state(built)
    with built.whole_parameters():
        sd = state_dict(built)
        try:
            dcp.load(sd, checkpoint_id=str(path), process_group=group)
        except Exception as e:  # noqa: BLE001 - a corrupt or mismatched checkpoint is bad input
            line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise InputError(f"{path}: cannot be read as this plan's state ({line[:200]}); expected a checkpoint "
                             "of this model and optimizer") from None
        if getattr(built.optimizer, "sharded", None) is not None:
            _load_sharded(built, sd)
    named = dict(built.named_params)
    with torch.no_grad():
        for n, (_, t) in _optimizer_slots(built).items():
            if t is not named[n]:          # a host master copy (placement cpu / split): the loaded value
                t.copy_(named[n])
    rng = path / f"rng-rank{rank}.pt"
    if meta.get("world_size") == world and meta.get("plan_sha256") == plan_sha256 and rng.is_file():
        set_rng_states(torch.load(rng, weights_only=False))


def built_full_shape(built, name: str, p: torch.Tensor) -> tuple[int, ...]:
    """The model's shape of parameter `name` (a tensor-split rank holds a slice of it)."""
    full = dict(built.workload.model.named_parameters()).get(name)
    return tuple(full.shape) if full is not None else tuple(p.shape)


def rng_states() -> dict[str, Any]:
    import random
    out = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def set_rng_states(states: dict[str, Any]) -> None:
    import random
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
