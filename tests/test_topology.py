"""Topology types, the `hetplan.topology/1` loader/saver, routing and the all-reduce formula."""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hetplan.planner.files.io import InputError
from hetplan.planner.hardware.topology import Device, Link, Topology, load_topology, save_topology

EXAMPLES = Path(__file__).resolve().parents[1] / "hetplan" / "topologies"
EXAMPLE_FILES = sorted(EXAMPLES.glob("*.json"))

VALID = {
    "schema": "hetplan.topology/1",
    "name": "t",
    "devices": [
        {"name": "cpu:0", "kind": "cpu", "threads": 8, "memory_bytes": 64e9,
         "matmul_flops_per_s": 4.0e11, "memory_bytes_per_s": 4.0e10, "op_overhead_s": 1e-5},
        {"name": "cuda:0", "kind": "cuda", "memory_bytes": 4.0e9,
         "matmul_flops_per_s": 2.9e12, "memory_bytes_per_s": 1.28e11},
    ],
    "links": [{"a": "cpu:0", "b": "cuda:0", "bandwidth_bytes_per_s": 1.2e10, "latency_s": 1e-5}],
}


def test_all_four_examples_exist():
    assert {p.stem for p in EXAMPLE_FILES} == {
        "workstation-gtx1650", "cpu-server-2socket", "dgx-8gpu", "dgx-2node-ib"}


@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=lambda p: p.stem)
def test_example_loads_and_round_trips(path, tmp_path):
    t = load_topology(path)
    assert t.name.startswith(path.stem + ":")  # the name says what the file models
    assert all(d.memory_bytes > 0 and d.matmul_flops_per_s > 0 for d in t.devices)
    save_topology(t, tmp_path / "again.json")
    assert load_topology(tmp_path / "again.json") == t
    # every device can reach every other one (the simulator would reject a plan otherwise)
    names = [d.name for d in t.devices]
    for b in names[1:]:
        t.route(names[0], b)


def test_example_contents():
    ws = load_topology(EXAMPLES / "workstation-gtx1650.json")
    assert ws.device("cuda:0").memory_bytes < 4.3e9 and ws.device("cpu:0").threads == 16
    dgx = load_topology(EXAMPLES / "dgx-8gpu.json")
    assert sum(d.kind == "cuda" for d in dgx.devices) == 8
    assert sum(d.kind == "cpu" for d in dgx.devices) == 2
    two = load_topology(EXAMPLES / "dgx-2node-ib.json")
    assert {d.node for d in two.devices} == {"node0", "node1"} and len(two.devices) == 20
    cross = [l for l in two.links if l.a.split("/")[0] != l.b.split("/")[0]]
    assert len(cross) == 1 and cross[0].bandwidth_bytes_per_s == 1.2e10  # 100 Gb/s, sustained


def test_round_trip_keeps_measured_extras(tmp_path):
    data = copy.deepcopy(VALID)
    data["devices"][0]["matmul_table"] = [{"n": 256, "flops_per_s": 1e10, "spread": 0.1}]
    data["links"][0]["p2p_table"] = [{"bytes": 4096, "s": 1e-5}]
    data["host"] = {"hostname": "h", "cores": 2}
    p = tmp_path / "m.json"
    p.write_text(json.dumps(data))
    t = load_topology(p)
    assert t.device("cpu:0").measured == {"matmul_table": data["devices"][0]["matmul_table"]}
    assert t.links[0].measured == {"p2p_table": [{"bytes": 4096, "s": 1e-5}]}
    assert t.measured == {"host": {"hostname": "h", "cores": 2}}
    assert t.device("cuda:0").op_overhead_s == 0.0  # default when absent
    save_topology(t, tmp_path / "m2.json")
    t2 = load_topology(tmp_path / "m2.json")
    assert t2 == t and t2.sha256 != t.sha256  # equal objects; the bytes differ (formatting)


def _broken(mutate):
    data = copy.deepcopy(VALID)
    mutate(data)
    return data


MALFORMED = {
    "missing_field": (lambda d: d["devices"][0].pop("memory_bytes"),
                      "devices[0].memory_bytes: missing"),
    "wrong_type": (lambda d: d["devices"][1].update(matmul_flops_per_s="fast"),
                   "devices[1].matmul_flops_per_s: expected a number >= 1"),
    "bool_is_not_a_number": (lambda d: d["devices"][1].update(memory_bytes=True),
                             "devices[1].memory_bytes: expected a number >= 1"),
    "negative_bandwidth": (lambda d: d["links"][0].update(bandwidth_bytes_per_s=-1),
                           "links[0].bandwidth_bytes_per_s: expected a number >= 1, got -1"),
    "negative_latency": (lambda d: d["links"][0].update(latency_s=-1e-6),
                         "links[0].latency_s: expected a non-negative number"),
    "unknown_link_endpoint": (lambda d: d["links"][0].update(b="cuda:7"),
                              "links[0].b: expected the name of another device in 'devices', got \"cuda:7\""),
    "self_link": (lambda d: d["links"][0].update(b="cpu:0"),
                  "links[0].b: expected the name of another device"),
    "duplicate_device": (lambda d: d["devices"][1].update(name="cpu:0", kind="cpu"),
                         "devices[1].name: duplicate device name 'cpu:0'"),
    "bad_device_name": (lambda d: d["devices"][1].update(name="gpu0"),
                        "devices[1].name: expected 'cpu:N' or 'cuda:N'"),
    "kind_disagrees_with_name": (lambda d: d["devices"][1].update(kind="cpu"),
                                 "devices[1].kind: expected 'cuda' (as in its name)"),
    "wrong_schema": (lambda d: d.update(schema="hetplan.plan/1"),
                     "schema: expected 'hetplan.topology/1'"),
    "no_devices": (lambda d: d.update(devices=[]), "devices: expected a non-empty list"),
    "devices_not_a_list": (lambda d: d.update(devices={"cpu:0": {}}), "devices: expected a list"),
    "device_not_an_object": (lambda d: d["devices"].append(3), "devices[2]: expected an object"),
    "unknown_precision": (lambda d: d["devices"][1].update(matmul_flops_per_s_by_precision={"fp8": 1e15}),
                          "devices[1].matmul_flops_per_s_by_precision.fp8: expected a precision among "
                          "fp32, tf32, bf16 as key"),
    "precision_rate_not_positive": (
        lambda d: d["devices"][1].update(matmul_flops_per_s_by_precision={"fp32": 1e12, "bf16": 0}),
        "devices[1].matmul_flops_per_s_by_precision.bf16: expected a positive number, got 0"),
    "precision_table_not_an_object": (
        lambda d: d["devices"][0].update(matmul_flops_per_s_by_precision=[1e12]),
        "devices[0].matmul_flops_per_s_by_precision: expected an object"),
    "optimizer_row_without_time": (
        lambda d: d["devices"][1].update(optimizer_table={"adam": [{"tensors": 1, "bytes": 4e6}]}),
        "devices[1].optimizer_table.adam[0].s: missing; expected a positive number"),
    "optimizer_rows_not_a_list": (
        lambda d: d["devices"][1].update(optimizer_table={"adam": {"tensors": 1}}),
        "devices[1].optimizer_table.adam: expected a list"),
}


def test_matmul_rate_by_precision_round_trips_and_falls_back(tmp_path):
    data = copy.deepcopy(VALID)
    data["devices"][0]["matmul_flops_per_s_by_precision"] = {"fp32": 4.0e11, "bf16": 1.1e12}
    data["devices"][1]["matmul_flops_per_s_by_precision"] = {"fp32": 2.9e12, "tf32": 5e12}
    p = tmp_path / "m.json"
    p.write_text(json.dumps(data))
    t = load_topology(p)
    cpu, gpu = t.device("cpu:0"), t.device("cuda:0")
    assert cpu.measured == {} and cpu.matmul_flops_per_s_at("bf16") == 1.1e12
    assert cpu.matmul_flops_per_s_at("tf32") == 4.0e11      # no TF32 on a CPU: the fp32 entry
    assert gpu.matmul_flops_per_s_at("tf32") == 5e12
    assert gpu.matmul_flops_per_s_at("bf16") == 2.9e12      # no entry: matmul_flops_per_s
    save_topology(t, tmp_path / "m2.json")
    assert load_topology(tmp_path / "m2.json") == t
    what_if = load_topology(EXAMPLES / "dgx-8gpu.json").device("cuda:0")
    assert what_if.matmul_flops_per_s_at("bf16") == what_if.matmul_flops_per_s


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_file_gives_one_line_naming_file_and_field(case, tmp_path):
    mutate, expected = MALFORMED[case]
    p = tmp_path / f"{case}.json"
    p.write_text(json.dumps(_broken(mutate)))
    with pytest.raises(InputError) as e:
        load_topology(p)
    msg = str(e.value)
    assert msg.startswith(f"{p}: ") and "\n" not in msg
    assert expected in msg


def test_not_json_and_missing_file(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text('{"schema": "hetplan.topology/1", "devices": [')
    with pytest.raises(InputError, match=r"bad\.json: not valid JSON \(line 1, column"):
        load_topology(p)
    with pytest.raises(InputError, match=r"nope\.json: topology file not found"):
        load_topology(tmp_path / "nope.json")
    p.write_text("[1, 2]")
    with pytest.raises(InputError, match=r"bad\.json: top level: expected an object"):
        load_topology(p)


def _chain() -> Topology:
    """cpu:0 -- cuda:0 -- cuda:1 -- cuda:2, plus a slow direct cpu:0 -- cuda:2 link."""
    dev = lambda n: Device(n, n.split(":")[0], 1e9, 1e12, 1e11)  # noqa: E731
    return Topology("chain", tuple(dev(n) for n in ("cpu:0", "cuda:0", "cuda:1", "cuda:2")), (
        Link("cpu:0", "cuda:0", 1e10, 1e-5),
        Link("cuda:0", "cuda:1", 1e11, 2e-6),
        Link("cuda:1", "cuda:2", 5e10, 3e-6),
        Link("cpu:0", "cuda:2", 1e8, 1e-3),
    ))


def test_route_over_multiple_hops():
    t = _chain()
    assert [(l.a, l.b) for l in t.route("cpu:0", "cuda:1")] == [("cpu:0", "cuda:0"), ("cuda:0", "cuda:1")]
    # the 3-hop path (15 us) beats the slow direct link (1 ms)
    assert len(t.route("cuda:2", "cpu:0")) == 3
    assert t.route("cuda:1", "cuda:1") == ()
    n = 1e6
    assert t.transfer_s("cpu:0", "cuda:2", n) == pytest.approx(
        (1e-5 + n / 1e10) + (2e-6 + n / 1e11) + (3e-6 + n / 5e10), rel=1e-12)


def test_route_without_path_raises():
    t = Topology("split", (Device("cpu:0", "cpu", 1, 1, 1), Device("cpu:1", "cpu", 1, 1, 1)))
    with pytest.raises(ValueError, match="no path of links between cpu:0 and cpu:1"):
        t.route("cpu:0", "cpu:1")


def test_route_across_two_dgx_nodes():
    t = load_topology(EXAMPLES / "dgx-2node-ib.json")
    hops = [(l.a, l.b) for l in t.route("node0/cuda:5", "node1/cuda:2")]
    assert hops == [("node0/cpu:1", "node0/cuda:5"), ("node0/cpu:0", "node0/cpu:1"),
                    ("node0/cpu:0", "node1/cpu:0"), ("node1/cpu:0", "node1/cuda:2")]


def test_allreduce_matches_contract_formula_by_hand():
    # 2(k-1)·latency + 2(k-1)/k · n / bandwidth, slowest link on the ring
    server = load_topology(EXAMPLES / "cpu-server-2socket.json")
    # k=2, UPI 3.5e10 B/s, 5 us: 2*5e-6 + 1 * 1e9 / 3.5e10
    assert server.allreduce_s(["cpu:0", "cpu:1"], 1e9) == pytest.approx(0.028581428571428, rel=1e-12)
    dgx = load_topology(EXAMPLES / "dgx-8gpu.json")
    # k=8, NVLink 2.3e11 B/s, 10 us: 14 * 1e-5 + 14/8 * 1e9 / 2.3e11
    ring = [f"cuda:{i}" for i in range(8)]
    assert dgx.allreduce_s(ring, 1e9) == pytest.approx(0.007748695652173913, rel=1e-12)
    assert dgx.allreduce_s(["cuda:0"], 1e9) == 0.0
    # the slowest hop sets the pace: a ring through the host uses PCIe (2.4e10, 10 us)
    assert dgx.allreduce_s(["cuda:0", "cuda:1", "cpu:0"], 3e8) == pytest.approx(
        4 * 1e-5 + 4 / 3 * 3e8 / 2.4e10, rel=1e-12)


@pytest.mark.parametrize("case", ["negative_bandwidth", "unknown_link_endpoint", "wrong_schema"])
def test_cli_with_malformed_topology_exits_2_with_one_line(case, tmp_path):
    mutate, expected = MALFORMED[case]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(_broken(mutate)))
    out = tmp_path / "plan.json"
    r = subprocess.run([sys.executable, "-m", "hetplan", "plan", "--model", "mlp", "--batch", "8",
                        "--topology", str(bad), "-o", str(out)],
                       capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"hetplan plan: error: {bad}: ")
    assert expected in lines[0] and not out.exists()
