"""`hetplan run PLAN`: execute a plan with torch.distributed on this machine and measure it.

One process per plan device (CPU workers get their thread share, GPUs cuda:N), rendezvous on
127.0.0.1 unless --master-addr is given. For several nodes, run
`torchrun --nnodes N --node_rank I ... -m runtime.worker PLAN -o MEASURED` on each node.
The measured file defaults to `<plan name>.measured.json` next to the plan.
"""
from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

HELP = "execute a plan with torch.distributed on this machine and write the measured file"


def add_arguments(p):
    p.add_argument("plan", help="plan file (hetplan.plan/1)")
    p.add_argument("--iters", type=int, default=10, help="iterations to run (default 10)")
    p.add_argument("--warmup", type=int, default=None,
                   help="iterations left out of the median iteration time (default 2, at most --iters - 1)")
    p.add_argument("-o", "--output", default=None,
                   help="measured file (default: <plan name>.measured.json next to the plan)")
    p.add_argument("--trace", metavar="DIR", default=None,
                   help="write a torch.profiler Chrome trace per rank into DIR")
    p.add_argument("--topology", default=None,
                   help="topology file for CPU thread shares (default: profiles/<hostname>.json "
                        "if it holds the plan's devices, else cores // CPU workers)")
    p.add_argument("--master-addr", default="127.0.0.1", help="rendezvous address (default loopback)")
    p.add_argument("--master-port", type=int, default=None, help="rendezvous port (default: a free one)")
    p.add_argument("--save-params", metavar="FILE", default=None,
                   help="save the final parameters (torch.save of name -> tensor)")
    p.add_argument("--timeout", type=float, default=60.0,
                   help="seconds a collective may wait for a peer (default 60)")
    add_training_arguments(p)
    p.add_argument("--verbose", action="store_true",
                   help="print where the start-up went (per process: imports, rendezvous, model "
                        "and stage build, first iteration, teardown; also under startup_s in the "
                        "measured file)")


def add_training_arguments(p) -> None:
    """The training flags, shared with `torchrun ... -m runtime.worker` (several nodes)."""
    t = p.add_argument_group("training on the workload's data (runtime.train; docs/guide.md 'Training with a plan')")
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


def default_output(plan_path: str) -> str:
    p = Path(plan_path)
    return str(p.with_name(f"{p.stem}.measured.json"))


def main(args) -> int:
    """SIGINT/SIGTERM stop every worker (runtime.launch.stop_on_signals): exit 130/143, one line
    on stderr, no measured file."""
    from runtime.launch import Stopped, stop_on_signals
    try:
        with stop_on_signals():
            return _run(args)
    except Stopped as e:
        print(f"hetplan run: {e}; every worker ended, no measured file written", file=sys.stderr)
        return e.exit_code


def _run(args) -> int:
    from planner.files.io import InputError, write_json_atomic
    from planner.files.plan import load_plan, validate_plan
    from planner.hardware.lookup import local_topology
    from runtime.launch import RunError, check_devices, launch, prestart, thread_shares
    from runtime.startup import Marks, format_lines, process_start_time
    from runtime.worker import RunConfig

    marks = Marks(process=process_start_time() or time.time())
    marks.mark("main")
    if args.iters < 1:
        raise InputError(f"--iters: expected a positive integer, got {args.iters}")
    if args.warmup is None:
        args.warmup = min(2, args.iters - 1)    # `--iters 2` keeps one measured iteration
    if not 0 <= args.warmup < args.iters:
        raise InputError(f"--warmup: expected an integer in [0, --iters), got {args.warmup}")
    check_paths(args)
    if not args.timeout > 0 or args.timeout == float("inf"):
        raise InputError(f"--timeout: expected a positive number, got {args.timeout}")
    from planner.hardware.cores import binding_enabled
    binding_enabled()   # HETPLAN_BIND_CORES is 0 or 1 (the workers bind, runtime.placement)
    plan = load_plan(args.plan)
    training = train_config(args, plan)
    check_devices(plan, args.plan)
    prestart()          # the workers' imports overlap the rest; the model is checked by them
    # (runtime.stage.check_model: a bad model, training step or layer range there is exit 2 as well)
    topology = local_topology(plan, args.topology)
    if topology is not None:    # the plan's devices must be the topology's, as `simulate` asks
        validate_plan(plan, args.plan, None, {d.name for d in topology.devices})
    marks.mark("checked")
    out = args.output or default_output(args.plan)
    extra = {"topology": topology.name if topology is not None else None}
    cfg = RunConfig(plan=str(args.plan), iters=args.iters, warmup=args.warmup, out=out,
                    trace_dir=args.trace, save_params=args.save_params,
                    threads=thread_shares(plan, topology), timeout_s=args.timeout, extra=extra,
                    train=training.to_dict() if training is not None else None)
    try:
        result = launch(cfg, plan.devices, args.master_addr, args.master_port, marks)
    except RunError as e:
        print(f"hetplan run: error: {e}", file=sys.stderr)
        return 1
    if training is not None:
        return _trained(args, result)
    write_json_atomic(out, result)
    if args.verbose:
        print("\n".join(format_lines(result["startup_s"])), file=sys.stderr)
    summary = {"measured": out, "iteration_s": result["iteration_s"], "losses": result["losses"],
               "per_device": {d: {"busy_s": v["busy_s"], "peak_memory_bytes": v["peak_memory_bytes"]}
                              for d, v in result["per_device"].items()}}
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"iteration: {result['iteration_s'] * 1e3:.2f} ms (median of {args.iters - args.warmup})")
        for d, v in summary["per_device"].items():
            print(f"  {d}: busy {v['busy_s'] * 1e3:.2f} ms, peak memory {v['peak_memory_bytes'] / 1e6:.1f} MB")
        print(f"final loss: {result['losses'][-1]:.6g}")
        print(f"wrote {out}")
    return 0


def _trained(args, result: dict) -> int:
    rows = result["rows"]
    if args.json:
        print(json.dumps({"steps": result["steps"], "rows": rows, "iteration_s": result["iteration_s"]}))
    else:
        last = next((r for r in reversed(rows) if "loss" in r), None)
        first, total = result["steps"]
        print(f"trained steps {first + 1}-{total}" + (f", final loss {last['loss']:.6g}" if last else "")
              + (f", median step {result['iteration_s'] * 1e3:.2f} ms" if result["iteration_s"] else ""))
        for k, v in (rows[-1] if rows else {}).items():
            if k.startswith("eval_"):
                print(f"  {k}: {v:.6g}")
    return 0


def check_paths(args) -> None:
    """The port and the output paths, before any worker starts: a run must not fail at its end
    because `--save-params` names a folder or `--trace` a file."""
    from planner.files.io import InputError
    if args.master_port is not None and not 1 <= args.master_port <= 65535:
        raise InputError(f"--master-port: expected a port in [1, 65535], got {args.master_port}")
    for flag, path, want_dir in (("--save-params", args.save_params, False), ("--trace", args.trace, True),
                                 ("--output", args.output, False), ("--metrics", args.metrics, False)):
        if path is None or not Path(path).exists():
            continue
        if want_dir and not Path(path).is_dir():
            raise InputError(f"--trace: {path} is not a folder; expected a folder for the per-rank traces")
        if not want_dir and Path(path).is_dir():
            raise InputError(f"{flag}: {path} is a folder; expected a file path")


def train_config(args, plan, given=None):
    """The TrainConfig --steps or --epochs asks for (None: a measuring run), every flag checked here,
    before any process starts: bad input is one line and exit 2, with nothing written."""
    from planner.files.io import InputError
    from runtime import lr_schedule
    from runtime.train import TrainConfig
    if args.steps is None and args.epochs is None:
        defaults = {"resume": False, "checkpoint_dir": None, "checkpoint_every": None, "eval_every": None,
                    "metrics": None, "tensorboard": None, "log_every": 10, "seed": 0, "lr_schedule": "constant",
                    "lr_schedule_arg": None, "warmup_steps": 0, "min_lr_ratio": 0.0}
        for name, default in defaults.items():     # a training flag given (not its default) is refused
            if getattr(args, name, default) != default:
                flag = "--" + name.replace("_", "-")
                raise InputError(f"{flag}: applies to training; expected --steps or --epochs with it")
        return None
    if args.steps is not None and args.epochs is not None:
        raise InputError("--steps, --epochs: expected one of them, not both")
    for flag, v in (("--steps", args.steps), ("--epochs", args.epochs), ("--log-every", args.log_every),
                    ("--eval-every", args.eval_every), ("--checkpoint-every", args.checkpoint_every)):
        if v is not None and v < 1:
            raise InputError(f"{flag}: expected a positive integer, got {v}")
    if (args.checkpoint_every or args.resume) and not args.checkpoint_dir:
        raise InputError(f"{'--resume' if args.resume else '--checkpoint-every'}: expected --checkpoint-dir")
    from planner.workload.load import parse_model_args
    sched_args = getattr(args, "lr_schedule_args", None)     # hetplan.train: typed values already
    if sched_args is None:
        sched_args = parse_model_args(args.lr_schedule_arg, "--lr-schedule-arg")
    lr_schedule.check(args.lr_schedule, sched_args, args.warmup_steps, args.min_lr_ratio)
    if plan.sync.mode != "sync" and (args.checkpoint_dir or args.eval_every or plan.optimizer.clip_grad_norm):
        raise InputError(f"{args.plan}: sync.mode: checkpoints, evaluation and clipping run with synchronous "
                         f"plans in this version; got {plan.sync.mode!r}")
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
                      min_lr_ratio=args.min_lr_ratio, tensorboard=args.tensorboard)
    runs = check_data(cfg, plan, args.plan, given)
    return dataclasses.replace(cfg, runs=runs)


def check_data(cfg, plan, file: str, given=None) -> int:
    """The resume point, and the workload's datasets against the plan, checked in this process;
    returns the steps this run will make."""
    from planner.files.io import InputError
    from runtime import checkpoint
    from runtime.train import _model_ref
    start = 0
    if cfg.resume:
        meta = checkpoint.check_resumable(cfg.checkpoint_dir, _model_ref(plan))
        start = meta["step"]
        if cfg.steps is not None and meta["step"] >= cfg.steps:
            raise InputError(f"--steps: the latest checkpoint ({meta['path']}) is at step {meta['step']}; "
                             f"expected more steps than that, got {cfg.steps}")
    from planner.workload.load import given_workload, load_plan_workload
    from runtime.data import DataFeed, check_dataset
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
    from runtime.train import total_steps
    total = total_steps(cfg, feed.steps_per_epoch if w.train_data is not None else None)
    if total <= start:
        raise InputError(f"--epochs: the latest checkpoint is at step {start}; expected more than "
                         f"{cfg.epochs} epoch(s) of {total // cfg.epochs} steps")
    return total - start


def _check_fits(w, plan) -> None:
    """Two samples of train_data through the model and loss_fn: items that do not fit the model's
    inputs are refused here, by name, instead of inside a worker."""
    import torch
    from planner.files.io import InputError
    from planner.workload.inputs import call_model
    from runtime.data import collate
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
