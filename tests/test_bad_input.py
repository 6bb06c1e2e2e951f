"""Bad files through the one reader (hetplan.planner.files.io.read_json) and the plan, topology and
measured loaders: one InputError line naming the file and field, never another exception."""
import json
import os

import pytest

from hetplan.planner.files.io import InputError, read_json
from hetplan.planner.files.measured import load_measured
from hetplan.planner.files.plan import load_plan
from hetplan.planner.hardware.topology import load_topology

PLAN = {"schema": "hetplan.plan/1", "model": {"spec": "mlp", "args": {}}, "global_batch": 8,
        "replicas": [{"batch_fraction": 1.0, "microbatches": 1, "stages": [{"device": "cpu:0", "layers": [0, 3]}]}],
        "schedule": "1f1b", "sync": {"granularity": "fine", "bucket_bytes": 1024},
        "optimizer": {"name": "adam", "lr": 0.001, "placement": "device"},
        "topology": {"name": "t", "sha256": "x", "threads": {"cpu:0": 1}, "host": "h", "cpu_cores": 2},
        "predicted": {"iteration_s": 0.1, "peak_memory_bytes": {"cpu:0": 1e6}, "baselines": [],
                      "time_to_loss": {"target_loss": 1.0, "iterations": 10, "time_s": 1.0}}}
TOPOLOGY = {"schema": "hetplan.topology/1", "name": "t",
            "devices": [{"name": "cpu:0", "kind": "cpu", "memory_bytes": 1e9, "matmul_flops_per_s": 1e10,
                         "memory_bytes_per_s": 1e10, "matmul_table": []},
                        {"name": "cpu:1", "memory_bytes": 1e9, "matmul_flops_per_s": 1e10, "memory_bytes_per_s": 1e10}],
            "links": [{"a": "cpu:0", "b": "cpu:1", "bandwidth_bytes_per_s": 1e9, "latency_s": 1e-5, "p2p_table": []}],
            "host": {"hostname": "h", "cores": 2}, "notes": []}
MEASURED = {"schema": "hetplan.measured/1", "plan_sha256": "x", "iterations_s": [0.1, 0.1], "iteration_s": 0.1,
            "losses": [2.0, 1.9], "iters": 2, "warmup": 1,
            "per_device": {"cpu:0": {"busy_s": 0.05, "peak_memory_bytes": 1e6, "events_iteration": 1,
                                     "events": [{"name": "F0", "kind": "forward", "start_s": 0.0, "end_s": 0.01}],
                                     "threads": 1}}}
LOADERS = {"plan": (load_plan, PLAN), "topology": (load_topology, TOPOLOGY), "measured": (load_measured, MEASURED)}


def refused(tmp_path, loader, text, *needles):
    """The loader refuses the file with one line starting with its path and holding `needles`."""
    path = tmp_path / "f.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(InputError) as e:
        loader(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}: ") and "\n" not in msg and len(msg) < 400, msg
    for n in needles:
        assert n in msg, msg


@pytest.mark.parametrize("kind", sorted(LOADERS))
def test_valid_files_load(tmp_path, kind):
    """The fixtures above are valid (so every refusal below is the mutation's)."""
    loader, good = LOADERS[kind]
    (tmp_path / "f.json").write_text(json.dumps(good))
    loader(tmp_path / "f.json")


@pytest.mark.parametrize("raw,needle", [
    ('{"a": "caf\xe9"}'.encode("latin-1"), "not UTF-8"),
    (json.dumps(PLAN).encode("utf-16"), "not UTF-8"),
    (bytes(range(256)) * 4, "not UTF-8"),
    (b"[" * 200_000 + b"]" * 200_000, "nested too deeply"),
    (b'{"global_batch": 1' + b"0" * 4300 + b"}", "4,300 digits"),
    (b'{"global_batch": 1' + b"0" * 30 + b"}", "global_batch: expected a finite number within"),
    (b'{"x": {"y": [1, 1e400]}}', "x.y[1]: expected a finite number, got inf"),
    (b'{"x": NaN}', "x: expected a finite number, got nan"),
    (b'{"x": -Infinity}', "x: expected a finite number, got -inf"),
])
def test_read_json_refuses_bytes_depth_and_numbers(tmp_path, raw, needle):
    """Broken by: read_json letting UnicodeDecodeError, RecursionError, ValueError or a
    non-finite number through."""
    refused(tmp_path, read_json, raw, needle)


def test_read_json_refuses_a_fifo_without_blocking(tmp_path):
    """Broken by: opening the path before checking it is a regular file (open() of a FIFO blocks
    for ever; pytest's timeout is the test's)."""
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    for p in (fifo, tmp_path):
        with pytest.raises(InputError, match="not a regular file"):
            read_json(p, "plan file")


@pytest.mark.parametrize("kind,mutate,needle", [
    ("plan", lambda d: d.update(schedul="gpipe"), "schedul: unknown field; did you mean `schedule`?"),
    ("plan", lambda d: d["replicas"][0].update(microbatchs=4), "replicas[0].microbatchs: unknown field; did you mean `microbatches`"),
    ("plan", lambda d: d["replicas"][0]["stages"][0].update(layer=[0, 3]), "replicas[0].stages[0].layer: unknown field; did you mean `layers`"),
    ("plan", lambda d: d["sync"].update(granularty="fine"), "sync.granularty: unknown field; did you mean `granularity`"),
    ("plan", lambda d: d["optimizer"].update(clip_grad=1.0), "optimizer.clip_grad: unknown field; did you mean `clip_grad_norm`"),
    ("plan", lambda d: d["model"].update(arg={}), "model.arg: unknown field; did you mean `args`"),
    ("plan", lambda d: d["topology"].update(cpu_core=2), "topology.cpu_core: unknown field; did you mean `cpu_cores`"),
    ("topology", lambda d: d.update(link=[]), "link: unknown field; did you mean `links`"),
    ("topology", lambda d: d["devices"][0].update(op_overhed_s=1e-5), "devices[0].op_overhed_s: unknown field; did you mean `op_overhead_s`"),
    ("topology", lambda d: d["links"][0].update(latency=1e-5), "links[0].latency: unknown field; did you mean `latency_s`"),
    ("measured", lambda d: d.update(loses=[]), "loses: unknown field; did you mean `losses`"),
])
def test_unknown_fields_are_refused_with_the_closest_name(tmp_path, kind, mutate, needle):
    """Broken by: a loader dropping a key it does not know (the typo then runs with a default)."""
    loader, good = LOADERS[kind]
    d = json.loads(json.dumps(good))
    mutate(d)
    refused(tmp_path, loader, json.dumps(d), needle)


def test_free_form_fields_stay_free(tmp_path):
    """model.args, optimizer.args, predicted's extras and per_device's extras take any key.
    Broken by: Reader.only applied below a documented free-form key."""
    d = json.loads(json.dumps(PLAN))
    d["model"]["args"] = {"hidden": 16}
    d["optimizer"].update(torch_class="AdamW", args={"weight_decay": 0.1})
    d["predicted"]["anything"] = {"x": 1}
    (tmp_path / "p.json").write_text(json.dumps(d))
    assert load_plan(tmp_path / "p.json").predicted.extra["anything"] == {"x": 1}


@pytest.mark.parametrize("kind,mutate,needle", [
    ("plan", lambda d: d.update(global_batch=1e308), "global_batch: expected an integer"),
    ("plan", lambda d: d["predicted"]["peak_memory_bytes"].update({"cpu:0": "big"}), "predicted.peak_memory_bytes.cpu:0: expected a non-negative number"),
    ("plan", lambda d: d["predicted"]["peak_memory_bytes"].update({"cpu:0": True}), "predicted.peak_memory_bytes.cpu:0"),
    ("plan", lambda d: d["predicted"].update(iteration_s=0), "predicted.iteration_s: expected a positive number"),
    ("plan", lambda d: d["predicted"].update(iteration_s=-1), "predicted.iteration_s: expected a positive number"),
    ("plan", lambda d: d["predicted"]["time_to_loss"].update(iterations="many"), "predicted.time_to_loss.iterations"),
    ("plan", lambda d: d["predicted"]["time_to_loss"].pop("target_loss"), "predicted.time_to_loss.target_loss: missing"),
    ("plan", lambda d: d["topology"]["threads"].update({"cpu:0": 10**12}), "topology.threads.cpu:0: expected an integer in [1, "),
    ("topology", lambda d: d.update(host=["h"]), "host: expected an object"),
    ("topology", lambda d: d["host"].update(cores="2"), "host.cores: expected a positive integer"),
    ("topology", lambda d: [x.update(matmul_flops_per_s=1e-300) for x in d["devices"]], "devices[0].matmul_flops_per_s: expected a number >= 1"),
    ("topology", lambda d: d["devices"][1].update(threads=1e308), "devices[1].threads"),
    ("topology", lambda d: d["links"].append({"a": "cpu:1", "b": "cpu:0", "bandwidth_bytes_per_s": 1e9}), "links[1]: a second link between cpu:1 and cpu:0"),
    ("topology", lambda d: d.update(calibration={"cpu_workers": "x"}), "calibration.cpu_workers"),
    ("measured", lambda d: d.update(losses=[1.0, "x"]), "losses[1]: expected a number"),
    ("measured", lambda d: d["per_device"]["cpu:0"].update(peak_memory_bytes=True), "per_device.cpu:0.peak_memory_bytes"),
    ("measured", lambda d: d["per_device"]["cpu:0"]["events"][0].pop("end_s"), "per_device.cpu:0.events[0].end_s: missing"),
    ("measured", lambda d: d["per_device"]["cpu:0"]["events"][0].update(start_s="0"), "per_device.cpu:0.events[0].start_s"),
    ("measured", lambda d: d["per_device"]["cpu:0"].update(events={}), "per_device.cpu:0.events: expected a list"),
])
def test_fields_read_without_the_reader_before(tmp_path, kind, mutate, needle):
    """Broken by: a loader reading one of these with float()/[] instead of the Reader (a
    TypeError, KeyError or ZeroDivisionError later in simulate or compare)."""
    loader, good = LOADERS[kind]
    d = json.loads(json.dumps(good))
    mutate(d)
    refused(tmp_path, loader, json.dumps(d), needle)
