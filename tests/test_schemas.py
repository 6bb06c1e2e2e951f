"""The JSON Schemas shipped for editors (hetplan/schemas) accept what hetplan writes, refuse what its
loaders refuse, and name the same fields as the loaders (a field added to one is added to both)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

jsonschema = pytest.importorskip("jsonschema")

from hetplan.planner.files import measured as measured_file, plan as plan_file  # noqa: E402
from hetplan.planner.files.io import InputError  # noqa: E402
from hetplan.planner.hardware import topology as topology_file  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SCHEMAS = ROOT / "hetplan" / "schemas"


def validator(name: str):
    schema = json.loads((SCHEMAS / f"{name}.schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def errors(name: str, data) -> list[str]:
    return [e.message for e in validator(name).iter_errors(data)]


def test_the_shipped_topologies_pass():
    for path in sorted((ROOT / "hetplan" / "topologies").glob("*.json")):
        assert errors("topology", json.loads(path.read_text())) == [], path.name


@pytest.fixture(scope="module")
def made_plan(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("schema") / "p.json"
    r = subprocess.run([sys.executable, "-m", "hetplan", "plan", "--model", "mlp", "--batch", "64",
                        "--topology", "workstation-gtx1650", "--time-limit", "2", "-o", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(out.read_text())


def test_a_plan_that_plan_wrote_passes(made_plan):
    assert errors("plan", made_plan) == []


def test_a_measured_file_passes():
    m = measured_file.Measured(plan_sha256="ab" * 32, iterations_s=(0.1, 0.2), iteration_s=0.15,
                               losses=(2.3, 2.1), per_device={"cpu:0": {"busy_s": 0.1, "peak_memory_bytes": 1e6}},
                               host={"hostname": "h"}, torch="2.13.0", extra={"iters": 2, "warmup": 0})
    assert errors("measured", measured_file.measured_to_dict(m)) == []


@pytest.mark.parametrize("path,value", [
    (("global_batch",), "64"), (("replicas", 0, "batch_fraction"), "0.5"), (("schedule",), "2f2b"),
    (("replicas", 0, "stages", 0, "device"), "gpu0"), (("optimizer", "colour"), "red")])
def test_what_the_loader_refuses_the_schema_refuses(made_plan, path, value):
    bad = json.loads(json.dumps(made_plan))
    node = bad
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(InputError):
        plan_file.plan_from_dict(bad, "bad.json")
    assert errors("plan", bad) != []


def _properties(schema: dict, *where: str) -> set[str]:
    node = schema
    for key in where:
        node = node[key]
    return set(node["properties"])


def test_the_schemas_name_the_loaders_fields():
    plan = json.loads((SCHEMAS / "plan.schema.json").read_text())
    f = plan_file._FIELDS
    assert _properties(plan) == set(f[""])
    assert _properties(plan, "properties", "model") == set(f["model"])
    assert _properties(plan, "properties", "replicas", "items") == set(f["replica"])
    assert _properties(plan, "properties", "replicas", "items", "properties", "stages", "items") == set(f["stage"])
    assert _properties(plan, "properties", "sync") == set(f["sync"])
    assert _properties(plan, "properties", "optimizer") == set(f["optimizer"])
    assert _properties(plan, "properties", "topology") == set(f["topology"])
    topo = json.loads((SCHEMAS / "topology.schema.json").read_text())
    t = topology_file
    assert _properties(topo) == {"schema", "name", "devices", "links"} | t._TOP_MEASURED
    assert _properties(topo, "$defs", "device") == t._DEVICE_FIELDS | t._DEVICE_MEASURED
    assert _properties(topo, "$defs", "link") == t._LINK_FIELDS | t._LINK_MEASURED
    meas = json.loads((SCHEMAS / "measured.schema.json").read_text())
    assert _properties(meas) == set(measured_file._FIELDS) | set(measured_file._EXTRA)
