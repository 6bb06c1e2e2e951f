"""`hetplan run PLAN`: execute a plan with torch.distributed on this machine and measure it.

One process per plan device (CPU workers get their thread share, GPUs cuda:N), rendezvous on
127.0.0.1 unless --master-addr is given. For several nodes, run
`torchrun --nnodes N --node_rank I ... -m hetplan.runtime.worker PLAN -o MEASURED` on each node.
The measured file defaults to `<plan name>.measured.json` next to the plan.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from hetplan.runtime.train_flags import add_training_arguments, train_config

HELP = "execute a plan with torch.distributed on this machine and write the measured file"


def add_arguments(p):
    p.add_argument("plan", help="plan file (hetplan.plan/1)")
    p.add_argument("--iters", type=int, default=10, help="iterations to run (default 10)")
    p.add_argument("--warmup", type=int, default=None,
                   help="iterations left out of the median iteration time (default 2, at most --iters - 1)")
    p.add_argument("-o", "--output", default=None,
                   help="measured file (default: <plan name>.measured.json next to the plan; a training "
                        "run, --steps or --epochs, writes one only when given)")
    p.add_argument("--trace", metavar="DIR", default=None,
                   help="write a torch.profiler Chrome trace per rank into DIR")
    p.add_argument("--topology", default=None,
                   help="topology file for CPU thread shares (default: the threads the plan records, else this "
                        "machine's cached profile if it holds the plan's devices, else cores // CPU workers)")
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


def default_output(plan_path: str) -> str:
    p = Path(plan_path)
    return str(p.with_name(f"{p.stem}.measured.json"))


def main(args) -> int:
    """SIGINT/SIGTERM stop every worker (hetplan.runtime.launch.stop_on_signals): exit 130/143, one line
    on stderr, no measured file."""
    from hetplan.runtime.launch import Stopped, stop_on_signals
    try:
        with stop_on_signals():
            return _run(args)
    except Stopped as e:
        print(f"hetplan run: {e}; every worker ended, no measured file written", file=sys.stderr)
        return e.exit_code


def _run(args) -> int:
    from hetplan.planner.files.io import InputError, write_json_atomic
    from hetplan.planner.files.plan import load_plan, validate_plan
    from hetplan.planner.hardware.lookup import local_topology
    from hetplan.runtime.launch import RunError, check_devices, launch, prestart, thread_shares
    from hetplan.runtime.startup import Marks, format_lines, process_start_time
    from hetplan.runtime.worker import RunConfig

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
    from hetplan.planner.hardware.cores import binding_enabled
    binding_enabled()   # HETPLAN_BIND_CORES is 0 or 1 (the workers bind, hetplan.runtime.placement)
    plan = load_plan(args.plan)
    training = train_config(args, plan)
    check_devices(plan, args.plan)
    prestart()          # the workers' imports overlap the rest; the model is checked by them
    # (hetplan.runtime.stage.check_model: a bad model, training step or layer range there is exit 2 as well)
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
    if args.output:   # a measured file (compare reads it), with the rows, steps and shares
        from hetplan.planner.files.io import write_json_atomic
        write_json_atomic(args.output, result)
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
    from hetplan.planner.files.io import InputError
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


