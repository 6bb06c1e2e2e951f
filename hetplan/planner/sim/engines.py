"""The engines that compute a simulated iteration, and the one ordered list the simulator tries.

Every engine gives the times of the reference loop (hetplan.planner.sim.reference, the specification)
bit for bit, or declines; the first in the list that does not decline is used, and the result
names it (`SimResult.engine`). `Simulator(graph, topology, engines=[REFERENCE])` runs the
specification alone; tests/test_engines.py holds every engine to it. Three levels:

- plan: `DELTA` (hetplan.planner.sim.delta: independent replicas run one by one, each distinct one once,
  then the coupling), `TWINS` (identical independent replicas run once: Simulator._like); where
  both decline, the whole task graph runs by the graph engines.
- replica, inside delta simulation: `PIPELINE_PASS` and `LINKED_PASS` (hetplan.planner.sim.pipeline_pass: one
  pass over the schedule); where they decline, the replica's graph runs by the graph engines.
- graph (a task graph and its durations -> start and end times): `COMPILED`
  (hetplan.planner.sim.fastloop, large graphs where numba is installed), `FIXED_ORDER`
  (hetplan.planner.sim.listsched, a graph run before whose resources' orders are fixed), `EVENT_LOOP`
  (hetplan.planner.sim.eventloop), `REFERENCE`. Where every listed one declines, the reference runs.

To add an engine: a class here with `name`, `level` and `run` (graph) or `prepare` (replica),
listed in `DEFAULT_ENGINES`, and in tests/test_engines.py's list.

A graph engine runs a `Tasks`: an object with `res`, `succ`, `ndeps`, `shared` (resources of
multi-resource tasks), `n_res`, `wake` (task -> wake-up) and `state` (an `EngineState`: the
engines' caches for that graph), and `prepare_compiled()` where it has its own arrays.
"""
from __future__ import annotations

from typing import Any, Protocol, Sequence

import numpy as np

from hetplan.planner.sim import eventloop, fastloop, reference
from hetplan.planner.sim.listsched import Static
from hetplan.planner.sim.pipeline_pass import LinkedRun, PipelineRun, fits as pipeline_fits, linked_fits
from hetplan.planner.sim.taskgraph import EngineState

COUPLING_COMPILED = 64   # a coupling graph (hetplan.planner.sim.delta) this large runs compiled: its arrays are
                         # made once per graph (other graphs: fastloop.MIN_TASKS)
FIXED_ORDER_AFTER = 2    # a graph run this many times before takes the fixed-order pass: most graphs of a
                         # search run once or twice, and preparing the pass costs about two runs


class Tasks(Protocol):
    res: Any
    succ: Any
    ndeps: Any
    shared: tuple[int, ...]
    n_res: int
    wake: dict[int, float]
    state: EngineState


def _listed(dur) -> list[float]:
    return dur.tolist() if isinstance(dur, np.ndarray) else dur


class Engine:
    """An engine's name and level ("plan", "replica" or "graph"); plan engines are steps of
    hetplan.planner.sim.simulator.Simulator.simulate."""
    level = "plan"

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name


class Compiled(Engine):
    level = "graph"

    def run(self, tasks: Tasks, dur):
        st = tasks.state
        if len(dur) < (COUPLING_COMPILED if st.coupling else fastloop.MIN_TASKS) or not fastloop.available():
            return None
        if st.fast is None:
            prepare = getattr(tasks, "prepare_compiled", None)
            st.fast = prepare() if prepare else fastloop.prepare(tasks.res, tasks.succ, tasks.ndeps, tasks.shared,
                                                                 tasks.n_res, tasks.wake)
        return fastloop.run(st.fast, np.asarray(dur, np.float64))


class FixedOrder(Engine):
    level = "graph"

    def __init__(self, name: str, after: int = FIXED_ORDER_AFTER):
        super().__init__(name)
        self.after = after

    def run(self, tasks: Tasks, dur):
        st = tasks.state
        if st.static is None and st.runs >= self.after:
            st.static = Static.of(tasks) or False
        return st.static.run(_listed(dur), tasks.wake) if st.static else None


class EventLoop(Engine):
    level = "graph"

    def run(self, tasks: Tasks, dur):
        return eventloop.run(_listed(dur), tasks.res, tasks.succ, list(tasks.ndeps), tasks.shared, tasks.n_res,
                             tasks.wake)


class Reference(Engine):
    level = "graph"

    def run(self, tasks: Tasks, dur):
        return reference.run(_listed(dur), tasks.res, tasks.succ, tasks.ndeps, tasks.n_res, tasks.wake)


class PipelinePass(Engine):
    """One replica, one pass over its schedule (hetplan.planner.sim.pipeline_pass.PipelineRun); never declines
    once prepared."""
    level = "replica"

    def prepare(self, cores, canons, res, wake_at):
        if len(cores) == 1 and pipeline_fits(cores[0], res[0], wake_at):
            return PipelineRun(cores[0], canons[0])
        return None


class LinkedPass(Engine):
    """Replicas whose routes share link directions (hetplan.planner.sim.pipeline_pass.LinkedRun); its `run`
    may decline on a plan's times."""
    level = "replica"

    def prepare(self, cores, canons, res, wake_at):
        return LinkedRun(cores, canons) if linked_fits(cores, res, wake_at) else None


DELTA, TWINS = Engine("delta"), Engine("twins")
PIPELINE_PASS, LINKED_PASS = PipelinePass("pipeline-pass"), LinkedPass("linked-pass")
COMPILED, FIXED_ORDER = Compiled("compiled"), FixedOrder("fixed-order")
EVENT_LOOP, REFERENCE = EventLoop("event-loop"), Reference("reference")
DEFAULT_ENGINES = (DELTA, TWINS, PIPELINE_PASS, LINKED_PASS, COMPILED, FIXED_ORDER, EVENT_LOOP)


def run_graph(tasks: Tasks, dur, engines: Sequence[Engine]) -> tuple[Any, Any, str]:
    """(start, end, engine name) of `tasks` for durations `dur` (a list or an array; start and
    end come as lists or arrays) by the first graph engine of `engines` that does not decline,
    else by the reference loop."""
    for e in engines:
        if e.level == "graph":
            out = e.run(tasks, dur)
            if out is not None:
                tasks.state.runs += 1
                return out[0], out[1], e.name
    start, end = REFERENCE.run(tasks, dur)
    tasks.state.runs += 1
    return start, end, REFERENCE.name


def engines_of(delta: bool = True, collapse: bool = True, static_after: int | None = FIXED_ORDER_AFTER
               ) -> tuple[Engine, ...]:
    """DEFAULT_ENGINES as the simulator's older switches name them: `delta` False drops DELTA,
    `collapse` False TWINS, `static_after` None the compiled loop and the fixed-order pass (the
    event loop alone), another number the fixed-order pass from that many runs."""
    out = []
    for e in DEFAULT_ENGINES:
        if (e is DELTA and not delta) or (e is TWINS and not collapse) or (
                e in (COMPILED, FIXED_ORDER) and static_after is None):
            continue
        out.append(FixedOrder(e.name, static_after) if e is FIXED_ORDER and static_after != e.after else e)
    return tuple(out)


__all__ = ["Engine", "EngineState", "Tasks", "run_graph", "engines_of", "DEFAULT_ENGINES", "DELTA", "TWINS",
           "PIPELINE_PASS", "LINKED_PASS", "COMPILED", "FIXED_ORDER", "EVENT_LOOP", "REFERENCE", "COUPLING_COMPILED",
           "FIXED_ORDER_AFTER"]
