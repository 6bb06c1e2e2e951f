"""The timeline of `hetplan compare --plot`: simulated lanes above measured lanes, one per device.

Top panel: the simulator's tasks (Simulator.simulate(plan, trace=True)), one row per device as
below: its compute, and in the row's lower half its communication: an all-reduce on the row of
every device of its ring ("cpu:0+cpu:1"), a transfer on its receiver's row ("cpu:0->cpu:1").
Bottom panel: the runtime's spans of one post-warm-up iteration on each device
(`per_device[dev]["events"]` of the measured file): forward / backward / optimizer compute, and,
hatched, waits for received tensors and for the gradient sync (time the device was not computing).
Both share the time axis, so a bar that is longer below than above is where the model is wrong.
Measured spans are relative to each rank's own iteration start (aligned by a barrier, to within
its skew); a dashed line marks each panel's iteration end.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from hetplan.planner.files.io import replace_atomically

COLORS = {"forward": "#4c78a8", "backward": "#f58518", "optimizer": "#54a24b",
          "transfer": "#9d9d9d", "allreduce": "#e45756", "compute": "#4c78a8"}
WAITS = ("transfer", "allreduce")   # measured spans that are waits, not compute


def _rows_of(lane: str) -> list[str]:
    """The device rows a simulated lane is drawn on: a ring's devices, a link's receiver."""
    if "->" in lane:
        return [lane.split("->", 1)[1]]
    return lane.split("+")


def device_rows(tasks: list[dict[str, Any]], devices: list[str]) -> tuple[list[str], dict[str, list[dict]]]:
    """The simulated tasks by device row: the plan's devices in order, then any other device a
    task names (a parameter server) in name order."""
    by_row: dict[str, list[dict]] = {}
    for t in tasks:
        for row in _rows_of(t["lane"]):
            by_row.setdefault(row, []).append(t)
    return list(devices) + sorted(set(by_row) - set(devices)), by_row


def _draw(ax, lanes: list[str], spans_by_lane: dict[str, list[dict]], measured: bool, end_s: float) -> None:
    for y, lane in enumerate(lanes):
        for t in spans_by_lane.get(lane, []):
            a, b = t["start_s"] * 1e3, t["end_s"] * 1e3
            comm = t["kind"] in WAITS
            wait = measured and comm
            inside = comm and not measured   # simulated communication: the row's lower half
            ax.barh(y + 0.15 if inside else y, max(b - a, 1e-6), left=a, height=0.3 if inside else 0.6,
                    color=COLORS.get(t["kind"], "#bab0ac"),
                    alpha=0.45 if comm else 0.9, hatch="//" if comm else None,
                    edgecolor="black", linewidth=0.3)
            label = t["name"].split(":", 1)[-1] if not measured else t["name"]
            if (b - a) > 0.012 * len(label) * end_s * 1e3 and not comm:   # only where it fits
                ax.text((a + b) / 2, y, label, ha="center", va="center", fontsize=6, clip_on=True)
    ax.axvline(end_s * 1e3, color="black", linestyle="--", linewidth=0.8)
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels(lanes, fontsize=7)
    ax.set_ylim(len(lanes) - 0.5, -0.5)


def plot_timeline(tasks: list[dict[str, Any]], simulated_s: float, devices: list[str],
                  measured_events: dict[str, list[dict[str, Any]]], measured_s: float | None,
                  path: str | Path, title: str = "") -> None:
    """Write the PNG. tasks: SimResult.tasks; measured_events: device -> spans (may be empty);
    measured_s: the measured time of the iteration the spans come from."""
    import matplotlib
    matplotlib.use("Agg")   # no display needed; must precede pyplot
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    sim_lanes, by_lane = device_rows(tasks, devices)
    meas_lanes = [d for d in devices if measured_events.get(d)] + \
        sorted(d for d in measured_events if d not in devices and measured_events[d])
    rows = len(sim_lanes) + max(len(meas_lanes), 1)
    fig, axes = plt.subplots(2, 1, sharex=True, figsize=(9, 1.4 + 0.32 * rows),
                             gridspec_kw={"height_ratios": [len(sim_lanes), max(len(meas_lanes), 1)]})
    _draw(axes[0], sim_lanes, by_lane, False, simulated_s)
    axes[0].set_title(f"simulated: {simulated_s * 1e3:.3f} ms", fontsize=8, loc="left")
    if meas_lanes:
        end = measured_s if measured_s is not None else max(
            e["end_s"] for d in meas_lanes for e in measured_events[d])
        _draw(axes[1], meas_lanes, measured_events, True, end)
        axes[1].set_title(f"measured (one iteration after warm-up): {end * 1e3:.3f} ms", fontsize=8, loc="left")
    else:
        axes[1].set_yticks([])
        axes[1].text(0.5, 0.5, "the measured file has no timeline (per_device.*.events)",
                     ha="center", va="center", transform=axes[1].transAxes, fontsize=8)
    axes[1].set_xlabel("time from iteration start (ms)", fontsize=8)
    axes[1].tick_params(axis="x", labelsize=7)
    kinds = ["forward", "backward", "optimizer", "transfer", "allreduce"]
    handles = [Patch(color=COLORS[k], label=k if k not in WAITS else f"{k} (measured: a wait)") for k in kinds]
    fig.legend(handles=handles, loc="lower center", ncol=5, fontsize=7, frameon=False)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    try:   # written aside, then renamed: never a half-written PNG
        replace_atomically(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    finally:
        plt.close(fig)


__all__ = ["plot_timeline", "device_rows"]
