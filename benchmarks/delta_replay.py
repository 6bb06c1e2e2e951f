"""Delta simulation (hetplan.planner.sim.delta) against the whole graph on a search's own plans.

Records every plan a 64 x 96 rails search simulates (benchmarks/search.py's case, seed 0, one
walk: its first 600 proposals, or `--proposals`; 20000 lets the walk stop by itself, as each of
`plan`'s chains does, after ~2,600), checks that both paths give identical results (repr),
then replays the plans in order in fresh processes (cold template cache, as the search has
it), delta on and off alternating: CPU time per side, medians and spread. Sides: delta
simulation ("on"), whole graphs with what the simulator keeps across plans ("off": templates,
replica values, identical replicas once), whole graphs from scratch per plan ("scratch").

    python benchmarks/delta_replay.py [--pairs 5] [--proposals 600] [--plans PATH] [--sides on,off,scratch]
"""
from __future__ import annotations

import argparse
import gc
import pickle
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import benchmarks.paths  # noqa: E402,F401  (the commands it starts import benchmarks.* too)

from search import cluster_64, synthetic_graph  # noqa: E402
from hetplan.planner.files.plan import ModelRef  # noqa: E402
from hetplan.planner.search.mcmc import SearchConfig, search  # noqa: E402
from hetplan.planner.search.problem import make_space, simulator_problem  # noqa: E402
from hetplan.planner.sim.simulator import Simulator  # noqa: E402


SIDES = {"on": "delta simulation", "off": "whole graphs, kept across plans",
         "scratch": "whole graphs from scratch"}


def case():
    return synthetic_graph(96, 256), cluster_64(8)


def record(path: Path, proposals: int) -> None:
    g, topo = case()
    plans = []

    class Recording(Simulator):
        def simulate(self, plan, trace=False):
            plans.append(plan)
            return super().simulate(plan, trace)
    space = make_space(topo, g.num_layers, g.batch, ModelRef("bench"), "adam", 1e-3)
    config = SearchConfig(iterations=proposals, time_limit_s=1e9, chains=1)   # no wall-clock stop: the same plans anywhere
    search(simulator_problem(Recording(g, topo), space), random.Random(0), config)
    path.write_bytes(pickle.dumps(plans))


def outcomes(sim: Simulator, plans) -> list:
    """Each plan's result, or the error of a plan the simulator refuses (no host CPU)."""
    out = []
    for p in plans:
        try:
            out.append(sim.simulate(p))
        except ValueError as e:   # refused alike
            out.append(str(e))
    return out


def warm_up() -> None:
    """What a process pays once, whichever path it takes: torch (the DDP bucket layout) and the
    compiled loops, loaded by simulating a small plan; then the template caches emptied, so the
    replay builds its structures cold, as a search does."""
    from hetplan.planner.sim import fastloop
    pipeline = _pipeline_pass()
    if fastloop.available():
        fastloop._compiled()
        if pipeline is not None:
            pipeline._pass()
    g, topo = synthetic_graph(8, 16), cluster_64(1)
    space = make_space(topo, g.num_layers, g.batch, ModelRef("bench"), "adam", 1e-3)
    search(simulator_problem(Simulator(g, topo), space), random.Random(0), SearchConfig(iterations=30))
    clear_caches()


def _pipeline_pass():
    """hetplan.planner.sim.pipeline_pass (hetplan.planner.sim.pipeline in earlier revisions; absent in the
    first ones this benchmark compares)."""
    try:
        from hetplan.planner.sim import pipeline_pass
        return pipeline_pass
    except ImportError:
        pass
    try:
        from hetplan.planner.sim import pipeline
        return pipeline
    except ImportError:
        return None


def clear_caches() -> None:
    """The simulator's module-level caches (templates, schedules) emptied."""
    from hetplan.planner.sim import template
    try:   # where this revision keeps the schedules
        from hetplan.planner.files import schedule
    except ImportError:
        from hetplan.planner.sim import schedule
    pipeline = _pipeline_pass()
    kept = [pipeline.layout, pipeline.graph] if pipeline is not None else []
    for f in [template.replica_template, getattr(template, "replica_core", None), template._skeleton,
              getattr(schedule, "_schedule", None), getattr(schedule, "schedule_arrays", None)] + kept:
        if f is not None:
            f.cache_clear()


def replay(path: Path, side: str) -> float:
    """CPU seconds to simulate the plans in order (gc off), after `warm_up`: "on" and "off" with
    one simulator, delta simulation on or off (whole graphs, identical replicas once); "scratch"
    whole graphs with nothing kept from one plan to the next (a simulator per plan, the template
    caches emptied) but the cost model's tables: full simulation as FlexFlow's paper compares."""
    plans = pickle.loads(path.read_bytes())
    g, topo = case()
    warm_up()
    sim = Simulator(g, topo, delta=side == "on")
    gc.disable()
    t0 = time.process_time()
    if side != "scratch":
        outcomes(sim, plans)
        return time.process_time() - t0
    for p in plans:
        clear_caches()
        outcomes(Simulator(g, topo, cost=sim.cost, delta=False), [p])
    return time.process_time() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=5, help="replays per side, alternating (default 5)")
    ap.add_argument("--proposals", type=int, default=600, help="the recorded walk's budget (default 600)")
    ap.add_argument("--plans", type=Path, help="recorded plans (default /tmp/delta_replay_plans_<proposals>.pkl)")
    ap.add_argument("--sides", default="on,off,scratch", help="replays to time (default on,off,scratch)")
    ap.add_argument("--replay", choices=SIDES, help=argparse.SUPPRESS)   # one replay (a child)
    args = ap.parse_args()
    if args.replay:
        print(replay(args.plans, args.replay))
        return 0
    if args.proposals < 1:
        print(f"--proposals: expected at least 1; got {args.proposals}", file=sys.stderr)
        return 2
    args.plans = args.plans or Path(f"/tmp/delta_replay_plans_{args.proposals}.pkl")
    if not args.plans.exists():
        record(args.plans, args.proposals)
    plans = pickle.loads(args.plans.read_bytes())
    g, topo = case()
    same = (list(map(repr, outcomes(Simulator(g, topo), plans)))
            == list(map(repr, outcomes(Simulator(g, topo, delta=False), plans))))
    print(f"{len(plans)} plans; delta and whole results identical: {same}", file=sys.stderr)
    sides = [x for x in args.sides.split(",") if x]
    if not set(sides) <= set(SIDES):
        print(f"--sides: expected some of {', '.join(SIDES)}; got {args.sides!r}", file=sys.stderr)
        return 2
    times: dict[str, list[float]] = {side: [] for side in sides}
    for _ in range(args.pairs):
        for side in sides:
            out = subprocess.run([sys.executable, __file__, "--plans", str(args.plans), "--replay", side],
                                 capture_output=True, text=True, check=True)
            times[side].append(float(out.stdout))
    for side, ts in times.items():
        ratio = (f", {statistics.median(ts) / statistics.median(times['on']):.2f}x delta's time"
                 if "on" in times and side != "on" else "")
        print(f"{SIDES[side]}: median {statistics.median(ts):.2f} s CPU ({min(ts):.2f}-{max(ts):.2f}), "
              f"{len(plans) / statistics.median(ts):.1f} sims/s{ratio}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
