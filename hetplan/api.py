"""Training with a plan from Python: `hetplan.train(plan, workload, steps=...)`.

Every process of the run calls it, launched by torchrun (one node or several, one process per
plan device: `torchrun --nproc_per_node N script.py`); a plan of one device also runs without
torchrun. The command line's `hetplan run --steps` is the same loop (hetplan.runtime.train).
"""
from __future__ import annotations

import os
from argparse import Namespace
from pathlib import Path
from typing import Any, Callable


def train(plan: str | os.PathLike, workload: Callable[..., Any] | Any = None, *, steps: int | None = None,
          epochs: int | None = None, seed: int = 0, log_every: int = 10, metrics: str | None = None,
          eval_every: int | None = None, checkpoint_dir: str | None = None, checkpoint_every: int | None = None,
          resume: bool = False, lr_schedule: str = "constant", lr_schedule_args: dict | None = None,
          warmup_steps: int = 0, min_lr_ratio: float = 0.0, tensorboard: str | None = None,
          save_params: str | None = None, threads: int | None = None, timeout_s: float = 300.0,
          rebalance: int | None = None) -> list[dict]:
    """Train this process's part of `plan` (a plan file) and return the logged rows (every rank
    gets the same rows: step, loss, lr, samples_per_s, eta_s, eval_* ...).

    `workload`: a function returning a `hetplan.planner.workload.Workload` (called with the plan's
    model.args after torch.manual_seed(0) on every rank), or a Workload; None: the plan's
    model.spec. The other arguments are `hetplan run`'s flags of the same names. Bad input raises
    `hetplan.planner.files.io.InputError` (one line naming the argument or file) before training starts.
    """
    from hetplan.planner.files.plan import load_plan
    from hetplan.runtime.train_flags import train_config
    from hetplan.runtime.worker import RunConfig, run_worker
    path = str(Path(plan))
    p = load_plan(path)
    args = Namespace(plan=path, steps=steps, epochs=epochs, seed=seed, log_every=log_every, metrics=metrics,
                     eval_every=eval_every, checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every,
                     resume=resume, lr_schedule=lr_schedule,
                     lr_schedule_arg=None, lr_schedule_args=dict(lr_schedule_args or {}),
                     warmup_steps=warmup_steps, min_lr_ratio=min_lr_ratio, tensorboard=tensorboard,
                     rebalance=rebalance)
    if steps is None and epochs is None:
        from hetplan.planner.files.io import InputError
        raise InputError("steps, epochs: expected one of them")
    tcfg = train_config(args, p, given=workload)
    _single_process_env(p)
    cfg = RunConfig(plan=path, iters=1, warmup=0, out="", save_params=save_params, timeout_s=timeout_s,
                    threads={d: threads for d in p.devices} if threads else {}, train=tcfg.to_dict())
    return run_worker(cfg, given=workload)


def _single_process_env(plan) -> None:
    """torchrun's variables for a one-device plan run without it; else they must be set."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return
    if len(plan.devices) != 1:
        from hetplan.planner.files.io import InputError
        raise InputError(f"the plan has {len(plan.devices)} devices; expected the script launched with "
                         f"torchrun --nproc_per_node {len(plan.devices)} (one process per device)")
    from hetplan.runtime.rendezvous import env_vars, free_port
    os.environ.update(env_vars(0, 1, "127.0.0.1", free_port()))
