"""Where a predicted iteration goes: its critical path, the chain of simulated tasks each of which
starts when the one before it on the path ends, from the iteration's start to its end.

The path is walked back from the last task to end: before a task, the task on the path is one
that ends exactly when it starts (on the same lane where there is one, else the longest); where
none does, the time back to the latest end before it is a `wait` (a latency no task carries);
after the last task come the iteration's fixed costs (`fixed`). The segments' seconds add up to
the predicted iteration.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

COMMUNICATION = ("transfer", "allreduce")


@dataclass(frozen=True)
class Segment:
    kind: str          # a task kind (forward, backward, optimizer, transfer, allreduce, ...), wait, fixed
    device: str        # the lane it ran on (a device, a link, a group's devices joined by "+"), or ""
    seconds: float

    def to_json(self) -> dict:
        return {"kind": self.kind, "device": self.device, "seconds": self.seconds}


def critical_path(tasks, iteration_s: float) -> list[Segment]:
    """The critical path of a traced simulation (SimResult.tasks: name, lane, kind, start_s,
    end_s) as segments in time order, consecutive tasks of one kind and lane merged."""
    tasks = [t for t in tasks if t["end_s"] > t["start_s"]]
    if not tasks:
        return [Segment("fixed", "", iteration_s)] if iteration_s > 0 else []
    by_end = sorted(tasks, key=lambda t: t["end_s"])
    ends = [t["end_s"] for t in by_end]
    scale = max(ends) * 1e-9
    cur = by_end[-1]
    back: list[Segment] = [Segment("fixed", "", iteration_s - cur["end_s"])] if iteration_s > cur["end_s"] else []
    while True:
        back.append(Segment(cur["kind"], cur["lane"], cur["end_s"] - cur["start_s"]))
        start = cur["start_s"]
        if start <= scale:
            break
        lo, hi = bisect.bisect_left(ends, start - scale), bisect.bisect_right(ends, start + scale)
        touching = by_end[lo:hi]
        if touching:
            same = [t for t in touching if t["lane"] == cur["lane"]]
            cur = max(same or touching, key=lambda t: t["end_s"] - t["start_s"])
            continue
        if lo == 0:                  # nothing ends before it: it waited from the start
            back.append(Segment("wait", "", start))
            break
        before = by_end[lo - 1]
        back.append(Segment("wait", "", start - before["end_s"]))
        cur = before
    return _merged(back[::-1])


def _merged(segments: list[Segment]) -> list[Segment]:
    out: list[Segment] = []
    for s in segments:
        if out and (out[-1].kind, out[-1].device) == (s.kind, s.device):
            out[-1] = Segment(s.kind, s.device, out[-1].seconds + s.seconds)
        else:
            out.append(s)
    return out


def totals(path: list[Segment]) -> dict[tuple[str, str], float]:
    """Seconds on the path per (kind, lane), largest first."""
    out: dict[tuple[str, str], float] = {}
    for s in path:
        out[(s.kind, s.device)] = out.get((s.kind, s.device), 0.0) + s.seconds
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def binding(path: list[Segment]) -> tuple[str, float]:
    """The lane holding the most of the path (a device, a link, a group), and its seconds."""
    lanes: dict[str, float] = {}
    for s in path:
        if s.device:
            lanes[s.device] = lanes.get(s.device, 0.0) + s.seconds
    return max(lanes.items(), key=lambda kv: kv[1]) if lanes else ("", 0.0)


def by_kind(path: list[Segment]) -> dict[str, float]:
    """Seconds on the path per kind of work: compute (forward, backward and the split backward's
    passes), communication (transfers, all-reduces), optimizer, wait, fixed."""
    out: dict[str, float] = {}
    for s in path:
        k = ("communication" if s.kind in COMMUNICATION else s.kind if s.kind in ("optimizer", "wait", "fixed")
             else "compute")
        out[k] = out.get(k, 0.0) + s.seconds
    return out


def summary_lines(path: list[Segment], iteration_s: float, headroom: dict[str, float]) -> list[str]:
    """Three lines: where the iteration goes, what binds it, the tightest memory."""
    share = lambda s: f"{100 * s / iteration_s:.0f} %" if iteration_s > 0 else "-"  # noqa: E731
    kinds = ", ".join(f"{k} {share(v)}" for k, v in sorted(by_kind(path).items(), key=lambda kv: -kv[1]) if v > 0)
    lane, held = binding(path)
    top = ", ".join(f"{k} on {d or 'no device'} {share(v)}" for (k, d), v in list(totals(path).items())[:3])
    tight = min(headroom.items(), key=lambda kv: kv[1]) if headroom else None
    return [f"critical path: {kinds}",
            f"binds: {lane} holds {share(held)} of the path; largest parts: {top}",
            f"memory headroom: least on {tight[0]}, {tight[1] / 1e6:.1f} MB" if tight else "memory headroom: -"]


__all__ = ["Segment", "critical_path", "totals", "binding", "by_kind", "summary_lines"]
