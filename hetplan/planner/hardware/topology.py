"""The hardware side: devices, links and the topology file (`hetplan.topology/1`).

A topology is either measured by `hetplan profile` (it then carries richer data in
`Device.measured` and `Topology.measured`) or written by hand as a what-if file, which needs
only the scalar fields of the contract. Units are in the field names, SI throughout.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import networkx as nx

from hetplan.planner.files.io import InputError, Reader, file_sha256, read_json, write_json_atomic

SCHEMA = "hetplan.topology/1"
DEVICE_NAME = re.compile(r"^(?:(?P<node>[A-Za-z0-9_.-]+)/)?(?P<kind>cpu|cuda):(?P<index>\d+)$")


def parse_device_name(name: str) -> tuple[str | None, str, int]:
    """'node1/cuda:3' -> ('node1', 'cuda', 3); raises ValueError when malformed."""
    m = DEVICE_NAME.match(name)
    if not m:
        raise ValueError(f"bad device name {name!r}")
    return m.group("node"), m.group("kind"), int(m.group("index"))


def natural_key(name: str) -> list[str | int]:
    """Sort key with digit runs compared as numbers: 'node2' < 'node10'."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


@dataclass(frozen=True)
class Device:
    name: str                      # "cpu:0", "cuda:1", "node1/cuda:3"
    kind: str                      # "cpu" or "cuda"
    memory_bytes: float            # capacity available to training
    matmul_flops_per_s: float      # sustained dense matmul throughput
    memory_bytes_per_s: float      # sustained memory bandwidth (stream-like copy)
    op_overhead_s: float = 0.0     # fixed cost per operator launch
    threads: int | None = None     # intra-op threads (CPU workers)
    measured: dict[str, Any] = field(default_factory=dict, compare=True)  # tables from `profile`
    # sustained matmul throughput per precision ("fp32", "tf32", "bf16"), measured by `profile`
    matmul_flops_per_s_by_precision: dict[str, float] | None = None

    @property
    def node(self) -> str | None:
        return parse_device_name(self.name)[0]

    def matmul_precision(self, precision: str) -> str:
        """The precision this device's matmuls run at: tf32 is fp32 on a CPU (no TF32 units)."""
        return "fp32" if precision == "tf32" and self.kind != "cuda" else precision

    def matmul_flops_per_s_at(self, precision: str) -> float:
        """matmul_flops_per_s_by_precision at `matmul_precision(precision)` when the device has
        that entry, else matmul_flops_per_s (what-if devices)."""
        table = self.matmul_flops_per_s_by_precision or {}
        return table.get(self.matmul_precision(precision), self.matmul_flops_per_s)


@dataclass(frozen=True)
class Link:
    a: str
    b: str
    bandwidth_bytes_per_s: float
    latency_s: float = 0.0
    measured: dict[str, Any] = field(default_factory=dict, compare=True)

    def transfer_s(self, n_bytes: float) -> float:
        """latency_s + n / bandwidth_bytes_per_s (the contract's link cost)."""
        return self.latency_s + n_bytes / self.bandwidth_bytes_per_s


@dataclass(frozen=True)
class Topology:
    name: str
    devices: tuple[Device, ...]
    links: tuple[Link, ...] = ()
    measured: dict[str, Any] = field(default_factory=dict, compare=True)  # host facts, collectives...
    sha256: str | None = field(default=None, compare=False)  # of the file it was loaded from

    def __post_init__(self):
        names = [d.name for d in self.devices]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate device names in topology {self.name!r}")

    # --- lookups -------------------------------------------------------------------------
    @cached_property
    def _by_name(self) -> dict[str, Device]:
        return {d.name: d for d in self.devices}

    def device(self, name: str) -> Device:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"no device {name!r} in topology {self.name!r}") from None

    def has_device(self, name: str) -> bool:
        return name in self._by_name

    @cached_property
    def graph(self) -> nx.Graph:
        """Undirected device graph; edge attribute `link` holds the Link."""
        g = nx.Graph()
        g.add_nodes_from(self._by_name)
        for link in self.links:
            g.add_edge(link.a, link.b, link=link,
                       weight=link.latency_s + 1.0 / link.bandwidth_bytes_per_s)
        return g

    def derived(self, key: str, make):
        """A value derived from this (frozen) topology by another module, made once: `make()`
        the first time `key` is asked (kept beside the fields, not compared)."""
        cache = self.__dict__.setdefault("_derived", {})
        if key not in cache:
            cache[key] = make()
        return cache[key]

    def route(self, a: str, b: str) -> tuple[Link, ...]:
        """Links on the cheapest path from a to b (empty when a == b).

        Raises ValueError when no path exists. Paths are cached: the search asks often.
        """
        if a == b:
            return ()
        key = (a, b) if a < b else (b, a)
        cache = self.__dict__.setdefault("_route_cache", {})
        if key not in cache:
            try:
                path = nx.shortest_path(self.graph, key[0], key[1], weight="weight")
            except (nx.NetworkXNoPath, nx.NodeNotFound):
                cache[key] = None
            else:
                cache[key] = tuple(self.graph.edges[u, v]["link"] for u, v in zip(path, path[1:]))
        if cache[key] is None:
            raise ValueError(f"no path of links between {a} and {b}")
        return cache[key]

    def transfer_s(self, a: str, b: str, n_bytes: float) -> float:
        """Time to move n bytes from a to b: sum of link costs along the route
        (store-and-forward; a contiguous transfer is not pipelined across hops)."""
        return sum(link.transfer_s(n_bytes) for link in self.route(a, b))

    def allreduce_s(self, devices: list[str] | tuple[str, ...], n_bytes: float) -> float:
        """Ring all-reduce of n bytes over k devices (the contract's formula):
        2(k-1)·latency + 2(k-1)/k · n / bandwidth, with the slowest link on the ring; a ring
        hop without a direct link uses its routed path (its latencies add, the bottleneck
        bandwidth applies)."""
        k = len(devices)
        if k <= 1:
            return 0.0
        lat, bw = 0.0, float("inf")
        for i in range(k):
            hop = self.route(devices[i], devices[(i + 1) % k])
            lat = max(lat, sum(l.latency_s for l in hop))
            bw = min(bw, min(l.bandwidth_bytes_per_s for l in hop))
        return 2 * (k - 1) * lat + 2 * (k - 1) / k * n_bytes / bw


# --- file format --------------------------------------------------------------------------
_DEVICE_FIELDS = {"name", "kind", "threads", "memory_bytes", "matmul_flops_per_s",
                  "memory_bytes_per_s", "op_overhead_s", "matmul_flops_per_s_by_precision"}
_LINK_FIELDS = {"a", "b", "bandwidth_bytes_per_s", "latency_s"}
# what `hetplan profile` adds beside the contract's fields (hetplan.runtime.profile): known by name, their
# contents free-form (only what the cost model reads is checked); any other key is refused
_TOP_MEASURED = {"host", "collectives", "calibration", "settings", "notes"}
_DEVICE_MEASURED = {"matmul_table", "matmul_tf32_table", "matmul_bf16_table", "memory_copy", "op_overhead",
                    "host_copy_table", "host_copy", "optimizer_table", "model", "measured_concurrently_with"}
_LINK_MEASURED = {"p2p_table", "method"}
# a device's or link's rates below these are typos (1e-300 FLOP/s), not hardware; the times they
# give would overflow. In SI: FLOP/s, bytes/s, bytes.
_MIN_RATE = 1.0


def topology_from_dict(data: Any, file: str = "<topology>") -> Topology:
    from hetplan.planner.files.plan import MAX_THREADS
    r = Reader(data, file)
    r.only({"schema", "name", "devices", "links"}, free=_TOP_MEASURED)
    schema = r.get("schema", str, default=SCHEMA)
    if schema != SCHEMA:
        raise r.error("schema", f"expected {SCHEMA!r}, got {schema!r}")
    positive = lambda v: v > 0  # noqa: E731
    rate = dict(check=lambda v: v >= _MIN_RATE, expected=f"a number >= {_MIN_RATE:g}")
    devices = []
    for d in r.readers("devices"):
        d.only(_DEVICE_FIELDS, free=_DEVICE_MEASURED)
        name = d.get("name", str)
        try:
            _, kind_from_name, _ = parse_device_name(name)
        except ValueError:
            raise d.error("name", f"expected 'cpu:N' or 'cuda:N' (optionally 'node/'), got {name!r}") from None
        kind = d.get("kind", str, default=kind_from_name,
                     check=lambda k: k == kind_from_name, expected=f"{kind_from_name!r} (as in its name)")
        devices.append(Device(
            name=name, kind=kind,
            memory_bytes=d.get("memory_bytes", float, **rate),
            matmul_flops_per_s=d.get("matmul_flops_per_s", float, **rate),
            memory_bytes_per_s=d.get("memory_bytes_per_s", float, **rate),
            op_overhead_s=d.get("op_overhead_s", float, default=0.0, check=lambda v: v >= 0,
                                expected="a non-negative number"),
            threads=d.get("threads", int, default=None, check=lambda v: 1 <= v <= MAX_THREADS,
                          expected=f"an integer in [1, {MAX_THREADS}]"),
            matmul_flops_per_s_by_precision=_by_precision(d),
            measured=_checked_measured(d),
        ))
    names = set()
    for i, dev in enumerate(devices):
        if dev.name in names:
            raise r.error(f"devices[{i}].name", f"duplicate device name {dev.name!r}")
        names.add(dev.name)
    links, pairs = [], {}
    for i, l in enumerate(r.readers("links", allow_empty=True) if r.has("links") else []):
        l.only(_LINK_FIELDS, free=_LINK_MEASURED)
        a = l.get("a", str, check=lambda v: v in names, expected="the name of a device in 'devices'")
        b = l.get("b", str, check=lambda v: v in names and v != a,
                  expected="the name of another device in 'devices'")
        if frozenset((a, b)) in pairs:
            raise l.error("", f"a second link between {a} and {b} (the first is links[{pairs[frozenset((a, b))]}]); "
                              "expected one link per pair of devices")
        pairs[frozenset((a, b))] = i
        links.append(Link(
            a=a, b=b,
            bandwidth_bytes_per_s=l.get("bandwidth_bytes_per_s", float, **rate),
            latency_s=l.get("latency_s", float, default=0.0, check=lambda v: v >= 0,
                            expected="a non-negative number"),
            measured={k: v for k, v in l.data.items() if k not in _LINK_FIELDS},
        ))
    extra = {k: v for k, v in r.data.items() if k not in {"schema", "name", "devices", "links"}}
    _check_host(r)
    if "calibration" in extra:     # read lazily by the cost model: its errors would name no file
        from hetplan.planner.hardware.calibration import calibration_from_dict
        calibration_from_dict(extra["calibration"], file)
    return Topology(name=r.get("name", str, default=Path(file).stem), devices=tuple(devices),
                    links=tuple(links), measured=extra)


def _check_host(r: Reader) -> None:
    """`host` (a profiled topology's machine): an object whose `cores`, `hostname` and
    `fingerprint`, read by the planner and `run`, are a positive integer and strings."""
    if r.has("host"):
        h = r.sub("host")
        h.get("cores", int, default=None, check=lambda v: v >= 1, expected="a positive integer")
        h.get("hostname", str, default=None)
        h.get("fingerprint", str, default=None)


def _checked_measured(d: Reader) -> dict[str, Any]:
    """A device's fields beyond the contract's (tables from `profile`), the ones the cost model
    reads checked: `optimizer_table` maps optimizer names to rows of positive
    {"tensors", "bytes", "s"}."""
    if d.has("optimizer_table"):
        table = d.sub("optimizer_table")
        positive = lambda v: v > 0  # noqa: E731
        for name in table.data:
            for row in table.readers(name):
                row.get("tensors", int, check=positive, expected="a positive integer")
                for key in ("bytes", "s"):
                    row.get(key, float, check=positive, expected="a positive number")
    return {k: v for k, v in d.data.items() if k not in _DEVICE_FIELDS}


def _by_precision(d: Reader) -> dict[str, float] | None:
    """The optional `matmul_flops_per_s_by_precision` object: precisions to positive numbers."""
    from hetplan.planner.files.plan import PRECISIONS
    key = "matmul_flops_per_s_by_precision"
    if not d.has(key):
        return None
    table = d.sub(key)
    for k in table.data:
        if k not in PRECISIONS:
            raise table.error(k, f"expected a precision among {', '.join(PRECISIONS)} as key")
    return {k: table.get(k, float, check=lambda v: v > 0, expected="a positive number")
            for k in PRECISIONS if table.has(k)}


def topology_to_dict(t: Topology) -> dict[str, Any]:
    devices = []
    for d in t.devices:
        out: dict[str, Any] = {"name": d.name, "kind": d.kind}
        if d.threads is not None:
            out["threads"] = d.threads
        out.update(memory_bytes=d.memory_bytes, matmul_flops_per_s=d.matmul_flops_per_s,
                   memory_bytes_per_s=d.memory_bytes_per_s, op_overhead_s=d.op_overhead_s)
        if d.matmul_flops_per_s_by_precision is not None:
            out["matmul_flops_per_s_by_precision"] = dict(d.matmul_flops_per_s_by_precision)
        out.update(d.measured)
        devices.append(out)
    links = [{"a": l.a, "b": l.b, "bandwidth_bytes_per_s": l.bandwidth_bytes_per_s,
              "latency_s": l.latency_s, **l.measured} for l in t.links]
    return {"schema": SCHEMA, "name": t.name, "devices": devices, "links": links, **t.measured}


SHIPPED = Path(__file__).resolve().parents[2] / "topologies"   # the example what-if topologies


def shipped_topologies() -> dict[str, Path]:
    """The topologies shipped with hetplan, by name (`dgx-8gpu` -> .../topologies/dgx-8gpu.json)."""
    return {p.stem: p for p in sorted(SHIPPED.glob("*.json"))}


def resolve_topology(path: str | Path) -> Path:
    """`path` when it is a file; else, when it is a bare name (no folder), the shipped topology of
    that name (`dgx-8gpu` or `dgx-8gpu.json`); InputError when it is neither."""
    p = Path(path)
    if p.exists() or p.parent != Path("."):
        return p
    shipped = shipped_topologies()
    name = p.stem if p.suffix == ".json" else p.name
    if name in shipped:
        return shipped[name]
    raise InputError(f"{path}: topology file not found, nor a shipped topology of that name "
                     f"(shipped: {', '.join(shipped)})")


def load_topology(path: str | Path) -> Topology:
    """The topology in file `path`, or the shipped topology named `path` (resolve_topology)."""
    path = resolve_topology(path)
    data = read_json(path, "topology file")
    t = topology_from_dict(data, str(path))
    object.__setattr__(t, "sha256", file_sha256(path))
    return t


def save_topology(t: Topology, path: str | Path) -> None:
    write_json_atomic(path, topology_to_dict(t))


__all__ = ["Device", "Link", "Topology", "InputError", "load_topology", "save_topology", "SHIPPED",
           "shipped_topologies", "resolve_topology",
           "topology_from_dict", "topology_to_dict", "parse_device_name", "natural_key"]
