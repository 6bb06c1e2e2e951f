"""`hetplan plan`: search the strategy space with the simulator and write the best plan.

The search is deterministic for a given seed and iteration budget; `--time-limit` is a safety
cap (when it stops the search, a warning says the plan may then depend on machine speed).
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field, replace

HELP = "search the strategy space with the simulator; write the best plan and compare it with the baselines"


def add_arguments(p):
    p.add_argument("--model", required=True, metavar="M", help="built-in name or package.module:function")
    p.add_argument("--model-arg", action="append", default=[], metavar="K=V",
                   help="argument of the model factory (repeatable)")
    p.add_argument("--layers", default=None, metavar="PATTERN",
                   help="layer boundaries: modules matching this dotted glob are layers, e.g. "
                        "'hf.model.layers.*' (comma-separated for several; default: every element "
                        "of the model's outermost module lists, see docs/guide.md)")
    p.add_argument("--batch", required=True, type=int, metavar="B", help="global batch size (samples)")
    p.add_argument("--topology", default=None, metavar="T",
                   help="topology file (hetplan.topology/1) or a shipped one's name (dgx-8gpu); default: "
                        "this machine's cached profile (`hetplan profile`)")
    p.add_argument("--seed", type=int, default=0, help="random seed of the search (default 0)")
    p.add_argument("--iterations", type=int, default=20000,
                   help="most proposals to try; the deterministic budget (default 20000; the search "
                        "usually stops earlier, when the best has not improved for a while)")
    p.add_argument("--time-limit", type=float, default=60.0, metavar="S",
                   help="wall-clock cap in seconds (default 60); a safety net, not the usual stop")
    p.add_argument("--chains", type=int, default=None, metavar="N",
                   help="independent walks sharing --iterations; the best of them wins (default: 1 "
                        "up to 8 devices, else 4); part of what the seed decides")
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help="processes the chains run in at once (default: this process's cores); "
                        "changes only the speed")
    p.add_argument("--optimizer", help="sgd, adam or any torch.optim class (AdamW, SGD, ...); priced as SGD "
                                       "or Adam (default: the workload's optimizer)")
    p.add_argument("--optimizer-arg", action="append", metavar="KEY=VALUE",
                   help="a keyword argument of the optimizer (repeatable), e.g. weight_decay=0.1")
    p.add_argument("--clip-grad-norm", type=float, default=None, metavar="MAX",
                   help="clip the gradients' global norm (over every stage and replica) to MAX when training")
    p.add_argument("--lr", type=float, help="learning rate (default: the workload's)")
    p.add_argument("--precision", default="fp32", metavar="LIST",
                   help="comma-separated precisions the search may choose from, among fp32, tf32, "
                        "bf16 (default fp32); baselines use the first")
    p.add_argument("--objective", choices=("iteration-time", "time-to-loss"), default="iteration-time",
                   help="what the plan minimises: the time of one synchronous iteration (default), or the "
                        "time to reach --target-loss, synchronous and asynchronous plans together")
    p.add_argument("--target-loss", type=float, default=None, metavar="X",
                   help="with --objective time-to-loss: the training loss to reach")
    p.add_argument("--horizon", type=int, default=None, metavar="N",
                   help="with --objective time-to-loss: iterations each strategy's convergence is "
                        "emulated for on this machine before a fitted curve extrapolates (default 200)")
    p.add_argument("--confirm", action=argparse.BooleanOptionalAction, default=None,
                   help="run the few best candidates on this machine, interleaved, and keep the measured "
                        "fastest (default: when the topology is this machine's profile and it takes about "
                        "30 s or less)")
    p.add_argument("-o", "--output", default="plan.json", metavar="PLAN", help="plan file to write (default plan.json)")


def _check_flags(args) -> None:
    from hetplan.planner.files.io import InputError
    from hetplan.planner.files.plan import check_batch
    check_batch(args.batch, "--batch")
    if not 0 < args.time_limit < float("inf"):
        raise InputError(f"--time-limit: expected a positive number of seconds, got {args.time_limit}")
    if args.iterations < 1:
        raise InputError(f"--iterations: expected a positive integer, got {args.iterations}")
    if args.chains is not None and not 1 <= args.chains <= args.iterations:
        raise InputError(f"--chains: expected an integer from 1 to --iterations ({args.iterations}), "
                         f"got {args.chains}")
    if args.workers is not None and args.workers < 1:
        raise InputError(f"--workers: expected a positive integer, got {args.workers}")
    if args.lr is not None and not 0 < args.lr < float("inf"):
        raise InputError(f"--lr: expected a positive number, got {args.lr}")
    _optimizer_flags(args)
    parse_precisions(args.precision)
    if args.objective == "time-to-loss":
        if args.target_loss is None or not 0 < args.target_loss < float("inf"):
            raise InputError(f"--target-loss: expected a positive number with --objective time-to-loss, "
                             f"got {args.target_loss}")
        from hetplan.planner.search.time_to_loss import MAX_HORIZON
        args.horizon = 200 if args.horizon is None else args.horizon
        if not 16 <= args.horizon <= MAX_HORIZON:
            raise InputError(f"--horizon: expected an integer from 16 to {MAX_HORIZON} iterations, got {args.horizon}")
    elif args.target_loss is not None or args.horizon is not None:
        flag = "--target-loss" if args.target_loss is not None else "--horizon"
        raise InputError(f"{flag}: applies only with --objective time-to-loss")


def _why(result) -> str:
    if result.stopped_by == "no improvement":
        each = " of each chain" if result.chains > 1 else ""
        return f": no better plan in the last {'<= ' if each else ''}{result.patience} proposals{each}"
    return ""


def parse_precisions(text: str) -> tuple[str, ...]:
    """'fp32,bf16' -> ('fp32', 'bf16'); InputError naming --precision on an unknown or repeated one."""
    from hetplan.planner.files.io import InputError
    from hetplan.planner.files.plan import PRECISIONS
    out = tuple(p.strip() for p in text.split(","))
    if not all(p in PRECISIONS for p in out) or len(set(out)) != len(out):
        raise InputError(f"--precision: expected a comma-separated list of distinct values among "
                         f"{', '.join(PRECISIONS)}, got {text!r}")
    return out


def _where(st) -> str:
    """A stage's device, or its tensor split: 'cpu:0 30% + cuda:0 70%'."""
    return " + ".join(f"{x.device} {x.share:.0%}" for x in st.split) if st.split else st.device


def describe(plan) -> str:
    """'cuda:0[0:6] | cpu:0[0:4]+cuda:1[4:6]' with batches and microbatches, and the sharding."""
    from hetplan.planner.files.plan import SHARD_STAGES
    parts = []
    for r, b in zip(plan.replicas, plan.replica_batches()):
        stages = " -> ".join(f"{_where(s)}[{s.start}:{s.end}]" for s in r.stages)
        parts.append(f"{stages} (batch {b}, {r.microbatches} microbatch{'es' if r.microbatches > 1 else ''})")
    sharded = f" (ZeRO-{plan.shard}: {SHARD_STAGES[plan.shard]} sharded over the replicas)" if plan.shard else ""
    return "; ".join(parts) + sharded


def _table(rows, chosen):
    """Each candidate judged (hetplan.planner.sim.interval.Judged, by name) against the chosen one."""
    import pandas as pd
    from hetplan.planner.sim.interval import PROBABILITY, beat_probability
    out = []
    for name, (cand, j) in rows.items():
        lo, hi = j.interval() if j is not None else (float("nan"),) * 2
        p = (beat_probability(chosen[1].times, chosen[1].residual, j.times, j.residual)
             if j is not None and name != "chosen" else None)
        out.append({"plan": name, "predicted ms": cand.iteration_s * 1e3,
                    f"{PROBABILITY:.0%} interval ms": f"{lo * 1e3:.3f}-{hi * 1e3:.3f}" if j is not None else "-",
                    "chosen is x faster": cand.iteration_s / chosen[0].iteration_s,
                    "P(chosen faster)": "-" if p is None else f"{p:.2f}",
                    "peak memory MB": max(cand.peak_memory_bytes.values(), default=0.0) / 1e6,
                    "fits": "yes" if cand.feasible else "NO"})
    return pd.DataFrame(out).to_string(index=False, float_format=lambda v: f"{v:.3f}")


def _time_to_loss(args, problem, workload, best, baselines):
    """The candidates ranked by time to --target-loss (hetplan.planner.search.time_to_loss); InputError
    when none reaches it."""
    import math

    from hetplan.planner.files.io import InputError
    from hetplan.planner.search.time_to_loss import rank
    print(f"hetplan plan: emulating convergence for {args.horizon} iterations per strategy", file=sys.stderr)
    named = [("chosen (synchronous)", best.plan)] + [(c.name, c.plan) for c in baselines if c.feasible]
    ranked = rank(problem.evaluate, workload, named, args.target_loss, args.horizon)
    if math.isinf(ranked[0].time_s):
        raise InputError(f"--target-loss: no plan reaches {args.target_loss:g}, in {args.horizon} emulated "
                         f"iterations or on the curve fitted to them")
    return ranked


def _judged(problem, topology, plan):
    """`plan` judged on draws of the topology's measured inputs (its interval), as `_choose` does."""
    from hetplan.planner.hardware.lookup import measured_here
    from hetplan.planner.sim.interval import Draws, judge, spread_of
    return judge(Draws(problem.simulator, spread_of(topology)), "chosen", plan, measured_here(topology))


def _loss_table(ranked) -> str:
    import pandas as pd
    df = pd.DataFrame([{"plan": c.name, "iteration ms": c.iteration_s * 1e3, "iterations": c.iterations,
                        "time to loss s": c.time_s, "fits": "yes" if c.feasible else "NO"} for c in ranked])
    return df.to_string(index=False, float_format=lambda v: f"{v:.4g}")


def _cost_fit(cost, devices) -> dict:
    """{"layer_cost_fit": {device: affine fit of its measured cost curve}} where measured."""
    fits = {d: f for d in devices if (f := cost.fit_report(d)) is not None}
    return {"layer_cost_fit": fits} if fits else {}


@dataclass
class _Choice:
    """The candidates judged on the same draws, the one kept, and what confirming measured."""
    rows: dict            # name -> (mcmc.Candidate, Judged | None), the kept one as "chosen"
    kept: object          # mcmc.Candidate
    beats_baseline: float | None = None     # P(kept measures faster than the best baseline)
    best_baseline: str | None = None
    confirmed: list = field(default_factory=list)   # hetplan.confirm.Confirmed
    note: str = ""
    explained: list = field(default_factory=list)   # hetplan.planner.sim.explain.summary_lines of the kept plan
    judgements: dict = field(default_factory=dict)  # every feasible candidate's name -> its plan's Judged

    def to_json(self) -> dict:
        return {"kept": self.kept.name, "best_baseline": self.best_baseline,
                "probability_beats_best_baseline": self.beats_baseline,
                **({"confirm": [c.to_json() for c in self.confirmed]} if self.confirmed else {})}


def _choose(args, problem, topology, result) -> _Choice:
    """The search's best and the feasible baselines judged on the same draws of the measured
    inputs; a plan with more parts kept only when surely faster (hetplan.planner.sim.interval.choose);
    then, on this machine, the few best confirmed by running them."""
    from hetplan.planner.files.plan import plan_key
    from hetplan.planner.hardware.lookup import measured_here
    from hetplan.planner.sim.interval import Draws, beat_probability, choose, judge, spread_of
    measured = measured_here(topology)
    draws = Draws(problem.simulator, spread_of(topology))
    cands, by_key = {}, {}          # name -> candidate judged; plan key -> its judgement
    for c in [*(b for b in result.baselines if b.feasible), replace(result.best, name="search's best")]:
        key = plan_key(c.plan)
        if key not in by_key:
            by_key[key] = judge(draws, c.name, c.plan, measured, baseline=c.name != "search's best")
            cands[c.name] = c
    judged = {j.name: j for j in by_key.values()}
    kept = cands[choose(list(judged.values())).name]
    confirmed, note = _confirm(args, topology, measured, kept, cands, judged)
    if confirmed:
        from hetplan.confirm import fastest
        kept = cands[fastest(confirmed).name]
    k = judged[kept.name]
    rows = {"chosen": (kept, k)}
    for c in [*result.baselines, replace(result.best, name="search's best")]:
        j = by_key.get(plan_key(c.plan)) if c.feasible else None
        if c.name not in rows and (j is None or j.name != kept.name):
            rows[c.name] = (c, j)
    judgements = {c.name: by_key[plan_key(c.plan)] for c in result.baselines if c.feasible}
    bases = list(judgements.values())
    best_base = min(bases, key=lambda j: j.middle) if bases else None
    beats = (None if best_base is None or best_base.name == kept.name else
             beat_probability(k.times, k.residual, best_base.times, best_base.residual))
    return _Choice(rows, kept, beats, best_base.name if best_base else None, confirmed, note,
                   _explained(problem.simulator, kept.plan, topology), judgements)


def _explained(simulator, plan, topology) -> list[str]:
    """Three lines on where the plan's predicted iteration goes (`hetplan explain` says more)."""
    from hetplan.planner.sim.explain import critical_path, summary_lines
    r = simulator.simulate(plan, trace=True)
    headroom = {d: topology.device(d).memory_bytes - v["peak_memory_bytes"] for d, v in r.per_device.items()}
    return summary_lines(critical_path(r.tasks, r.iteration_s), r.iteration_s, headroom)


def _confirm(args, topology, measured, kept, cands, judged) -> tuple[list, str]:
    """Run the kept plan and the next fastest candidates (hetplan.confirm) when asked, or by
    default when it fits in DEFAULT_BUDGET_S; ([], why not) otherwise."""
    from hetplan.confirm import DEFAULT_BUDGET_S, MOST, confirm, estimate_s
    if args.confirm is False:
        return [], ""
    if not measured:
        return [], "not confirmed: the topology is not this machine's profile (a what-if file cannot run here)"
    order = [kept.name] + sorted((n for n in cands if n != kept.name), key=lambda n: judged[n].middle)
    picked = [(n, cands[n].plan, cands[n].iteration_s) for n in order[:MOST]]
    if len(picked) < 2:
        return [], ""
    need = estimate_s([p for _, _, p in picked])
    if args.confirm is None and need > DEFAULT_BUDGET_S:
        return [], f"not confirmed: running the candidates would take about {need:.0f} s (--confirm runs them)"
    from hetplan.planner.files.io import InputError
    from hetplan.runtime.launch import check_devices
    try:
        for _, plan, _ in picked:
            check_devices(plan, args.output)
    except InputError as e:   # a device this machine lacks (a profile carried from a larger host)
        return [], f"not confirmed: {e}"
    print(f"hetplan plan: confirming {len(picked)} candidates on this machine (about {need:.0f} s)", file=sys.stderr)
    from hetplan.runtime.launch import RunError
    try:
        confirmed, foreign = confirm(picked, topology)
    except RunError as e:
        return [], f"not confirmed: a candidate failed to run: {e}"
    from hetplan.runtime.host_load import BUSY_WARNING
    busy = (f"other processes used {foreign:.0%} of the CPU while confirming: the runs measured "
            f"that load" if foreign > BUSY_WARNING else "")
    return confirmed, busy


def _setup(args):
    """(topology, workload, optimizer flags, precisions, graph, problem) for the search."""
    from hetplan.planner.files.io import InputError
    from hetplan.planner.files.plan import ModelRef
    from hetplan.planner.hardware.lookup import measured_here
    from hetplan.planner.hardware.topology import load_topology
    from hetplan.planner.search.problem import CAPTURE_BATCH, plan_problem
    from hetplan.planner.workload.load import load_workload, parse_model_args

    _check_flags(args)
    model_args = parse_model_args(args.model_arg)
    if args.topology is None:
        from hetplan.planner.hardware.lookup import this_machines_profile
        args.topology = str(this_machines_profile())
    topology = load_topology(args.topology)
    optimizer = _optimizer_flags(args)
    # the weights' values only where something runs the model: layers timed on this machine,
    # convergence emulated
    workload = load_workload(args.model, model_args, args.layers,
                             weights=measured_here(topology) or args.objective == "time-to-loss")
    print(f"hetplan plan: capturing {args.model} at batch {min(args.batch, CAPTURE_BATCH)} "
          f"in {args.precision}", file=sys.stderr)
    precisions = parse_precisions(args.precision)
    try:
        graph, problem = plan_problem(workload, ModelRef(args.model, model_args, args.layers), args.batch,
                                      topology, optimizer.name if optimizer else workload.optimizer,
                                      args.lr if args.lr is not None else workload.lr, precisions)
    except ValueError as e:       # the model could not be captured or grouped into layers
        raise InputError(f"--model: {args.model}: {e}") from None
    return topology, workload, optimizer, precisions, graph, problem


def _search(args, problem, graph, topology):
    import random

    from hetplan.planner.files.io import InputError
    from hetplan.planner.search.mcmc import SearchConfig, chains, memory_error, search
    space = problem.space
    config = SearchConfig(iterations=args.iterations, time_limit_s=args.time_limit,
                          chains=args.chains if args.chains is not None else chains(space), workers=args.workers)
    print(f"hetplan plan: searching {len(space.devices)} devices x {graph.num_layers} layers "
          f"(seed {args.seed}, {args.iterations} iterations in {config.chains} "
          f"chain{'s' if config.chains > 1 else ''}, cap {args.time_limit:g} s)", file=sys.stderr)
    result = search(problem, random.Random(args.seed), config,
                    progress=lambda msg: print(f"hetplan plan: {msg}", file=sys.stderr))
    if result.best is None:
        raise InputError(f"{args.topology}: devices: {memory_error(result, problem.memory_bytes)}")
    if result.stopped_by == "time limit":
        print(f"hetplan plan: warning: stopped by --time-limit after {result.iterations} of {args.iterations} "
              "iterations; the plan may differ on a faster or slower machine", file=sys.stderr)
    return result


def _predicted(args, best, result, choice, objective, precisions, problem):
    """The plan file's `predicted`: the kept plan's time and interval, the baselines, the choice
    and the search's record."""
    from hetplan.planner.files.plan import Predicted
    from hetplan.planner.sim.interval import PROBABILITY
    import math
    judged = choice.judgements if choice else {}
    baselines = [{"name": c.name, "iteration_s": c.iteration_s if math.isfinite(c.iteration_s) else None,
                  "feasible": c.feasible,
                  "peak_memory_bytes": c.peak_memory_bytes,
                  **({"iteration_s_interval": list(judged[c.name].interval())} if c.name in judged else {})}
                 for c in result.baselines]
    search = {"seed": args.seed, "precisions": list(precisions), "iterations": result.iterations,
              "chains": result.chains, "simulations": result.evaluations,
              "bound_rejections": result.bound_rejections, "stopped_by": result.stopped_by,
              "acceptance_rate": result.acceptance_rate, "patience": result.patience}
    span = (choice.rows["chosen"][1].interval() if choice else
            objective.get("time_to_loss", {}).get("iteration_s_interval"))
    return Predicted(best.iteration_s, best.peak_memory_bytes, extra={
        **objective, "baselines": baselines, **({"choice": choice.to_json()} if choice else {}),
        "search": search, **_cost_fit(problem.cost, best.plan.devices)},
        iteration_s_interval=span, interval_probability=PROBABILITY if span else None)


def main(args) -> int:
    import gc

    from hetplan.planner.files.plan import TopologyRef, plan_to_dict, save_plan, validate_plan
    from hetplan.runtime.launch import priced_conditions

    topology, workload, optimizer, precisions, graph, problem = _setup(args)
    if args.objective != "time-to-loss":
        del workload   # the search never runs the model: its memory is not copied into the chains
        gc.collect()
    result = _search(args, problem, graph, topology)
    ranked, objective, choice = None, {}, None
    if args.objective == "time-to-loss":
        ranked = _time_to_loss(args, problem, workload, replace(result.best, name="chosen"), result.baselines)
        best = ranked[0]
        lo, hi = _judged(problem, topology, best.plan).interval()
        objective = {"time_to_loss": {"target_loss": args.target_loss, "horizon": args.horizon,
                                      "iterations": best.iterations, "time_s": best.time_s,
                                      "iteration_s_interval": (lo, hi),
                                      "time_s_interval": [best.iterations * lo, best.iterations * hi],
                                      "candidates": [c.to_json() for c in ranked]}}
    else:
        choice = _choose(args, problem, topology, result)
        best = replace(choice.kept, name="chosen")
    if optimizer is not None:     # the class and its arguments as asked; priced by its family
        best = replace(best, plan=replace(best.plan, optimizer=replace(
            best.plan.optimizer, torch_class=optimizer.torch_class, args=optimizer.args,
            clip_grad_norm=optimizer.clip_grad_norm)))
    plan = replace(best.plan, topology=TopologyRef(topology.name, topology.sha256,
                                                   **priced_conditions(best.plan, topology)),
                   predicted=_predicted(args, best, result, choice, objective, precisions, problem))
    validate_plan(plan, args.output, graph.num_layers, {d.name for d in topology.devices})
    save_plan(plan, args.output)
    if args.json:
        print(json.dumps({"plan": plan_to_dict(plan), "iteration_s": best.iteration_s,
                          "iteration_s_interval": plan.predicted.iteration_s_interval,
                          "baselines": plan.predicted.extra["baselines"],
                          **({"choice": choice.to_json()} if choice else {}), "output": str(args.output)}))
        return 0
    _report(args, plan, best, ranked, choice, result)
    return 0


def _report(args, plan, best, ranked, choice, result) -> None:
    print(f"chosen plan: {describe(plan)}")
    print(f"  schedule {plan.schedule}, sync {plan.sync.granularity} ({plan.sync.bucket_bytes / 2**20:g} MiB buckets), "
          f"optimizer {plan.optimizer.name} on {plan.optimizer.placement}"
          f"{f' ({plan.optimizer.cpu_fraction:.0%} of the bytes on the CPU)' if plan.optimizer.cpu_fraction else ''}, recompute {'on' if plan.recompute else 'off'}, "
          f"precision {plan.precision}")
    if ranked is not None:
        lo, hi = plan.predicted.extra["time_to_loss"]["time_s_interval"]
        print(f"  sync mode {plan.sync.mode}; predicted to reach loss {args.target_loss:g} in "
              f"{best.iterations:.0f} iterations, {best.time_s:.3g} s (90% interval of the iterations' "
              f"time {lo:.3g}-{hi:.3g} s; the iteration count's own error not included)")
        print(_loss_table(ranked))
    else:
        print(_table(choice.rows, choice.rows["chosen"]))
        _report_choice(choice)
    print(f"searched {result.iterations} proposals"
          f"{f' in {result.chains} chains' if result.chains > 1 else ''} ({result.bound_rejections} rejected by their bound), "
          f"{result.evaluations} simulations in "
          f"{result.elapsed_s:.1f} s, {100 * result.acceptance_rate:.0f}% accepted (stopped by "
          f"{result.stopped_by}{_why(result)}); wrote {args.output}")


def _report_choice(choice) -> None:
    lo, hi = choice.rows["chosen"][1].interval()
    print(f"  predicted {choice.kept.iteration_s * 1e3:.3f} ms, 90% interval {lo * 1e3:.3f}-{hi * 1e3:.3f} ms "
          f"({choice.rows['chosen'][1].residual.basis})")
    if choice.beats_baseline is not None:
        print(f"  probability the chosen plan measures faster than the best baseline ({choice.best_baseline}): "
              f"{choice.beats_baseline:.2f}")
    elif choice.best_baseline is not None:
        print(f"  the chosen plan is the best baseline ({choice.best_baseline}): no other plan is surely faster")
    for c in choice.confirmed:
        print(f"  confirmed here: {c.name}: measured {c.median_s * 1e3:.3f} ms (predicted {c.predicted_s * 1e3:.3f})")
    if choice.note:
        print(f"  {choice.note}")
    for line in choice.explained:
        print(f"  {line}")


def _optimizer_flags(args):
    """--optimizer, --optimizer-arg and --clip-grad-norm as a plan Optimizer (None: none given)."""
    from hetplan.planner.files.io import InputError
    from hetplan.planner.files.plan import Optimizer, frozen_args
    from hetplan.planner.workload.load import parse_model_args
    from hetplan.planner.files.optimizer_spec import DEFAULT_CLASS, OptimizerSpecError, check_spec, priced_as, torch_class
    if args.optimizer is None and not args.optimizer_arg and args.clip_grad_norm is None:
        return None
    if args.clip_grad_norm is not None and not 0 < args.clip_grad_norm < float("inf"):
        raise InputError(f"--clip-grad-norm: expected a positive number, got {args.clip_grad_norm}")
    if args.optimizer is not None and not args.optimizer.strip():
        raise InputError("--optimizer: expected sgd, adam or a torch.optim class such as AdamW, got ''")
    name = args.optimizer or "adam"
    cls = DEFAULT_CLASS.get(name) or (torch_class(name).__name__ if torch_class(name) else None)
    if cls is None:
        raise InputError(f"--optimizer: expected sgd, adam or a torch.optim class such as AdamW, got {name!r}")
    kwargs = parse_model_args(args.optimizer_arg, "--optimizer-arg")
    try:
        check_spec(priced_as(cls), cls, kwargs)
    except OptimizerSpecError as e:
        raise InputError(f"--optimizer-arg: {e}" if e.field == "args" else f"--optimizer: {e}") from None
    return Optimizer(name=priced_as(cls), torch_class=None if name in DEFAULT_CLASS else cls,
                     args=frozen_args(kwargs), clip_grad_norm=args.clip_grad_norm)
