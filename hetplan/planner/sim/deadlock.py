"""A task graph that cannot finish: `Deadlock`, raised by every engine, and its report, the step x
resource grid with each resource's blocked task marked (torch.distributed.pipelining's
`_format_pipeline_order` is the model).

Step k of a resource is the k-th task it started (in start time, then id order); a resource's
blocked task is the first of its tasks, by id, that never started. The grid shows the resources
with a blocked task, and the steps up to the blocked ones.
"""
from __future__ import annotations

SHOWN_STEPS = 8   # steps shown before the earliest blocked one (the rest elided)


class Deadlock(RuntimeError):
    """Some tasks never became ready. `start`: per task its start (None: never started), `res`:
    per task its resources; `lanes`: a name per resource, `labels`: per task its label (None
    where unknown: the ids are shown). Without `start` (a pass that stopped) the message is the
    header alone."""

    def __init__(self, start=None, res=None, lanes=None, labels=None, what: str = ""):
        self.start, self.res = start, res
        super().__init__(report(start, res, lanes, labels) if start is not None else
                         f"simulator deadlock: {what or 'some tasks never became ready'}")

    def named(self, lanes, labels) -> Deadlock:
        """The same deadlock reported with resource names and task labels."""
        return Deadlock(self.start, self.res, lanes, labels)


def report(start, res, lanes=None, labels=None) -> str:
    """The header line (how many tasks never started) and the grid."""
    n = len(start)
    never = [t for t in range(n) if start[t] is None]
    name = (lambda x: lanes[x]) if lanes else (lambda x: f"r{x}")            # noqa: E731
    label = lambda t: str(labels[t]) if labels and labels[t] is not None else f"t{t}"   # noqa: E731
    ran: dict[int, list[int]] = {}
    blocked: dict[int, int] = {}
    for t in sorted((t for t in range(n) if start[t] is not None), key=lambda t: (start[t], t)):
        for x in res[t]:
            ran.setdefault(x, []).append(t)
    for t in never:
        for x in res[t]:
            blocked.setdefault(x, t)
    header = (f"simulator deadlock: {len(never)} of {n} tasks never became ready; each resource's tasks in the "
              f"order they started, [its first that never did] marked")
    if not blocked:
        return header + f" (none holds a resource: {', '.join(label(t) for t in never[:8])})"
    cols = sorted(blocked)
    at = {x: len(ran.get(x, [])) for x in cols}                            # the blocked task's step
    first, last = max(0, min(at.values()) - SHOWN_STEPS), max(at.values())
    cells = [[label(ran[x][k]) if k < at[x] else f"[{label(blocked[x])}]" if k == at[x] else ""
              for x in cols] for k in range(first, last + 1)]
    w = max(4, *(len(name(x)) for x in cols), *(len(c) for row in cells for c in row))
    lines = [header, "step " + " ".join(name(x).rjust(w) for x in cols)]
    if first > 0:
        lines.append(" ...")
    for k, row in zip(range(first, last + 1), cells):
        mark = "  <-- blocked" if any(k == at[x] for x in cols) else ""
        lines.append(f"{k:>4} " + " ".join(c.rjust(w) for c in row) + mark)
    return "\n".join(lines)


__all__ = ["Deadlock", "report", "SHOWN_STEPS"]
