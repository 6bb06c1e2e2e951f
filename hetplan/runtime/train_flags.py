"""The training flags of `hetplan run`, `torchrun ... -m hetplan.runtime.worker` and `hetplan.train`: the
arguments, and the TrainConfig they ask for, every flag and the workload's data checked before any
process starts (bad input is one line and exit 2, nothing written)."""
from __future__ import annotations

import dataclasses


def add_training_arguments(p) -> None:
    """The training flags, shared with `torchrun ... -m hetplan.runtime.worker` (several nodes)."""
    t = p.add_argument_group("training on the workload's data (hetplan.runtime.train; docs/guide.md 'Training with a plan')")
    t.add_argument("--steps", type=int, default=None, help="train this many steps in all (a resumed run continues to it)")
    t.add_argument("--epochs", type=int, default=None, help="or this many passes over train_data")
    t.add_argument("--seed", type=int, default=0, help="the per-epoch shuffles' seed (default 0)")
    t.add_argument("--log-every", type=int, default=10, metavar="K", help="a progress line every K steps (default 10)")
    t.add_argument("--metrics", metavar="FILE", default=None, help="the logged rows as JSON lines")
    t.add_argument("--eval-every", type=int, default=None, metavar="K", help="evaluate eval_data every K steps and at the end")
    t.add_argument("--checkpoint-dir", metavar="DIR", default=None, help="where checkpoints go (step-NNNNNNNN)")
    t.add_argument("--checkpoint-every", type=int, default=None, metavar="K", help="save every K steps and at the end")
    t.add_argument("--resume", action="store_true", help="continue from the latest complete checkpoint in --checkpoint-dir")
    t.add_argument("--lr-schedule", default="constant",
                   help="constant, cosine, linear (each after --warmup-steps) or a torch.optim.lr_scheduler class")
    t.add_argument("--lr-schedule-arg", action="append", metavar="KEY=VALUE", help="an argument of a torch scheduler")
    t.add_argument("--warmup-steps", type=int, default=0, help="linear warm-up steps (default 0)")
    t.add_argument("--min-lr-ratio", type=float, default=0.0, help="cosine/linear: the final lr / lr (default 0)")
    t.add_argument("--tensorboard", metavar="DIR", default=None, help="TensorBoard scalars (tensorboard package)")
    t.add_argument("--rebalance", type=int, default=None, metavar="K",
                   help="re-solve the replicas' batch shares from their measured speed every K steps "
                        "(plain data parallel; hetplan.runtime.rebalance)")


def train_config(args, plan, given=None):
    """The TrainConfig --steps or --epochs asks for (None: a measuring run), every flag checked here,
    before any process starts: bad input is one line and exit 2, with nothing written."""
    from hetplan.planner.files.io import InputError
    from hetplan.runtime import lr_schedule
    from hetplan.runtime.train import TrainConfig
    if args.steps is None and args.epochs is None:
        defaults = {"resume": False, "checkpoint_dir": None, "checkpoint_every": None, "eval_every": None,
                    "metrics": None, "tensorboard": None, "log_every": 10, "seed": 0, "lr_schedule": "constant",
                    "lr_schedule_arg": None, "warmup_steps": 0, "min_lr_ratio": 0.0,
                    "rebalance": None}
        for name, default in defaults.items():     # a training flag given (not its default) is refused
            if getattr(args, name, default) != default:
                flag = "--" + name.replace("_", "-")
                raise InputError(f"{flag}: applies to training; expected --steps or --epochs with it")
        return None
    if args.steps is not None and args.epochs is not None:
        raise InputError("--steps, --epochs: expected one of them, not both")
    for flag, v in (("--steps", args.steps), ("--epochs", args.epochs), ("--log-every", args.log_every),
                    ("--eval-every", args.eval_every), ("--checkpoint-every", args.checkpoint_every),
                    ("--rebalance", getattr(args, "rebalance", None))):
        if v is not None and v < 1:
            raise InputError(f"{flag}: expected a positive integer, got {v}")
    if (args.checkpoint_every or args.resume) and not args.checkpoint_dir:
        raise InputError(f"{'--resume' if args.resume else '--checkpoint-every'}: expected --checkpoint-dir")
    from hetplan.planner.workload.load import parse_model_args
    sched_args = getattr(args, "lr_schedule_args", None)     # hetplan.train: typed values already
    if sched_args is None:
        sched_args = parse_model_args(args.lr_schedule_arg, "--lr-schedule-arg")
    lr_schedule.check(args.lr_schedule, sched_args, args.warmup_steps, args.min_lr_ratio)
    if plan.sync.mode != "sync" and (args.checkpoint_dir or args.eval_every or plan.optimizer.clip_grad_norm):
        raise InputError(f"{args.plan}: sync.mode: checkpoints, evaluation and clipping run with synchronous "
                         f"plans in this version; got {plan.sync.mode!r}")
    if getattr(args, "rebalance", None):
        from hetplan.runtime.rebalance import check as check_rebalance
        check_rebalance(plan, args.plan)
    split = any(st.split for r in plan.replicas for st in r.stages)
    interleaved = plan.schedule == "interleaved-1f1b"
    if (split or interleaved) and (args.checkpoint_dir or args.eval_every):
        raise InputError(f"{args.plan}: replicas: checkpoints and evaluation of "
                         f"{'tensor-split stages' if split else 'interleaved virtual stages'} are not supported in "
                         "this version; expected plain stages")
    cfg = TrainConfig(steps=args.steps, epochs=args.epochs, seed=args.seed, log_every=args.log_every,
                      metrics=args.metrics, eval_every=args.eval_every, checkpoint_dir=args.checkpoint_dir,
                      checkpoint_every=args.checkpoint_every, resume=args.resume, lr_schedule=args.lr_schedule,
                      lr_schedule_args=sched_args, warmup_steps=args.warmup_steps,
                      min_lr_ratio=args.min_lr_ratio, tensorboard=args.tensorboard,
                      rebalance=getattr(args, "rebalance", None))
    runs = check_data(cfg, plan, args.plan, given)
    return dataclasses.replace(cfg, runs=runs)


def check_data(cfg, plan, file: str, given=None) -> int:
    """The resume point, and the workload's datasets against the plan, checked in this process;
    returns the steps this run will make."""
    from hetplan.planner.files.io import InputError
    from hetplan.runtime import checkpoint
    from hetplan.runtime.train import _model_ref
    start = 0
    if cfg.resume:
        meta = checkpoint.check_resumable(cfg.checkpoint_dir, _model_ref(plan))
        start = meta["step"]
        if cfg.steps is not None and meta["step"] >= cfg.steps:
            raise InputError(f"--steps: the latest checkpoint ({meta['path']}) is at step {meta['step']}; "
                             f"expected more steps than that, got {cfg.steps}")
    from hetplan.planner.workload.load import given_workload, load_plan_workload
    from hetplan.runtime.data import DataFeed, check_dataset
    w = (load_plan_workload(plan.model, file) if given is None
         else given_workload(given, plan.model.spec, plan.model.args))
    if w.train_data is None:
        if cfg.epochs is not None:
            raise InputError(f"--epochs: {plan.model.spec} has no train_data; expected --steps (synthetic batches)")
    else:
        feed = DataFeed(w.train_data, plan.global_batch, cfg.seed, w.collate_fn)
        _check_fits(w, plan)
    if cfg.eval_every:
        if w.eval_data is None:
            raise InputError(f"--eval-every: {plan.model.spec} has no eval_data; expected a workload with eval_data")
        check_dataset(w.eval_data, "eval_data")
    from hetplan.runtime.train import total_steps
    total = total_steps(cfg, feed.steps_per_epoch if w.train_data is not None else None)
    if total <= start:
        raise InputError(f"--epochs: the latest checkpoint is at step {start}; expected more than "
                         f"{cfg.epochs} epoch(s) of {total // cfg.epochs} steps")
    return total - start


def _check_fits(w, plan) -> None:
    """Two samples of train_data through the model and loss_fn: items that do not fit the model's
    inputs are refused here, by name, instead of inside a worker."""
    import torch
    from hetplan.planner.files.io import InputError
    from hetplan.planner.workload.inputs import call_model
    from hetplan.runtime.data import collate
    n = min(2, len(w.train_data))
    try:
        x, y = collate([w.train_data[i] for i in range(n)], w.collate_fn)
        with torch.no_grad():
            w.loss_fn(call_model(w.model, x), y)
    except InputError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's items against the user's model
        line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InputError(f"train_data: its items do not fit {plan.model.spec}'s inputs and loss_fn "
                         f"({type(e).__name__}: {line[:160]}); expected (inputs, target) as make_batch returns them") from None
