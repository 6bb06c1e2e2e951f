"""`compare --plot`'s simulated panel: one row per device, as the measured panel has, with the
device's communication on its own row (hetplan.planner.files.plot)."""
from __future__ import annotations

from hetplan.planner.files.plot import device_rows, plot_timeline


def _t(name, lane, kind, a, b):
    return {"name": name, "lane": lane, "kind": kind, "start_s": a, "end_s": b}


TASKS = [_t("r0:F", "cpu:0", "forward", 0, 1), _t("r1:F", "cpu:1", "forward", 0, 1),
         _t("allreduce b0", "cpu:0+cpu:1", "allreduce", 2, 3),
         _t("r0:act cpu:1->cuda:0 mb0", "cpu:1->cuda:0", "transfer", 1, 1.5),
         _t("split F", "cuda:0+cuda:1", "forward", 1.5, 2)]


def test_every_task_on_its_devices_rows():
    rows, by_row = device_rows(TASKS, ["cpu:0", "cpu:1"])
    assert rows == ["cpu:0", "cpu:1", "cuda:0", "cuda:1"]   # no "cpu:0+cpu:1" or link row
    names = {r: [t["name"] for t in by_row[r]] for r in rows}
    assert names == {"cpu:0": ["r0:F", "allreduce b0"], "cpu:1": ["r1:F", "allreduce b0"],
                     "cuda:0": ["r0:act cpu:1->cuda:0 mb0", "split F"], "cuda:1": ["split F"]}


def test_the_picture_is_written(tmp_path):
    out = tmp_path / "t.png"
    plot_timeline(TASKS, 3.0, ["cpu:0", "cpu:1"], {"cpu:0": [_t("F", "cpu:0", "forward", 0, 1.2)]}, 3.1, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
