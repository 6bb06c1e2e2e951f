"""Which topology file: the one named, the one a plan was made for, or this machine's profile.

`plan_topology` is the topology a plan is *simulated* on (`simulate`, `compare`, `explain`):
`--topology` when given (a warning when it is not the file the plan was made for), else the file
whose sha256 the plan records. `local_topology` is this machine's profile for `run`'s thread
counts: `--topology` when given, else this machine's cached profile when it holds every plan
device, else None. This machine's profile is `<cache>/profiles/<fingerprint>.json`
(hetplan.planner.hardware.machine): a profile whose fingerprint is another machine's is never
taken as this one's.
"""
from __future__ import annotations

import sys
from pathlib import Path

from hetplan.planner.files.io import InputError, file_sha256
from hetplan.planner.files.plan import Plan
from hetplan.planner.hardware.machine import cache_dir, this_machine
from hetplan.planner.hardware.topology import SHIPPED, Topology, load_topology


def profiles_dir() -> Path:
    """<cache>/profiles: every machine's cached profile, by fingerprint."""
    return cache_dir() / "profiles"


def default_profile_path() -> Path:
    """<cache>/profiles/<this machine's fingerprint>.json: where `hetplan profile` writes."""
    return profiles_dir() / f"{this_machine()}.json"


def measured_here(topology: Topology) -> bool:
    """The topology was profiled on this machine: its `host.fingerprint` is this machine's."""
    host = topology.measured.get("host")
    return isinstance(host, dict) and host.get("fingerprint") == this_machine()


def this_machines_profile() -> Path:
    """This machine's cached profile; InputError (naming `--topology`) when there is none."""
    path = default_profile_path()
    if not path.is_file():
        raise InputError(f"--topology: no profile of this machine in {profiles_dir()}; run `hetplan "
                         f"profile` first, or pass --topology FILE or a shipped name (dgx-8gpu)")
    return path


def find_topology_by_sha256(sha256: str, roots: list[str | Path] | None = None) -> Path | None:
    """The first `*.json` file (sorted, recursively) under `roots` whose bytes have this sha256.

    Default root: `profiles/` in the current directory."""
    for root in roots if roots is not None else [Path("profiles")]:
        root = Path(root)
        if not root.is_dir():
            continue
        for p in sorted(root.rglob("*.json")):
            try:
                if p.is_file() and file_sha256(p) == sha256:
                    return p
            except OSError:
                continue
    return None


def load_given_topology(plan: Plan, topology_path: str | Path, command: str = "hetplan") -> Topology:
    """The topology file the user named; a warning (not a failure) when it is not the file the
    plan was made for (the contract: `simulate` and `run` accept another one)."""
    topo = load_topology(topology_path)
    if plan.topology is not None and topo.sha256 != plan.topology.sha256:
        print(f"{command}: warning: {topology_path} is not the topology the plan was made "
              f"for ({plan.topology.name}, sha256 {plan.topology.sha256[:12]}...)", file=sys.stderr)
    return topo


def plan_topology(plan: Plan, plan_path: str | Path, topology_path: str | Path | None,
                  command: str = "hetplan") -> Topology:
    """The topology to simulate `plan` on: `topology_path` when given, else the file with the
    plan's recorded sha256 among the cached profiles, profiles/, the plan's directory, its
    profiles/, or the shipped topologies; InputError when none has it. Warnings go to stderr."""
    if topology_path:
        return load_given_topology(plan, topology_path, command)
    if plan.topology is None:
        raise InputError(f"{plan_path}: topology: the plan names no topology; pass --topology FILE")
    plan_dir = Path(plan_path).resolve().parent
    roots = [profiles_dir(), Path("profiles"), plan_dir, plan_dir / "profiles", SHIPPED]
    path = find_topology_by_sha256(plan.topology.sha256, roots)
    if path is None:
        raise InputError(f"{plan_path}: topology: no cached profile, file under profiles/ or beside the plan has sha256 "
                         f"{plan.topology.sha256[:12]}... ({plan.topology.name}); pass --topology FILE")
    return load_topology(path)


def local_topology(plan: Plan, topology_path: str | Path | None,
                   command: str = "hetplan run") -> Topology | None:
    """This machine's topology for `plan`: `topology_path` when given (a warning when it was
    profiled on another machine), else this machine's cached profile when it holds every plan
    device, else None."""
    if topology_path:
        t = load_given_topology(plan, topology_path, command)
        host = t.measured.get("host")
        if isinstance(host, dict) and host.get("fingerprint") and not measured_here(t):
            print(f"{command}: warning: {topology_path} was profiled on another machine (fingerprint "
                  f"{host['fingerprint']}, this one {this_machine()}): its thread counts may not fit here",
                  file=sys.stderr)
        return t
    default = default_profile_path()
    if default.exists():
        try:
            t = load_topology(default)
        except InputError:
            return None
        if measured_here(t) and all(t.has_device(d) for d in plan.devices):
            return t
    return None


__all__ = ["profiles_dir", "default_profile_path", "measured_here", "this_machines_profile", "find_topology_by_sha256", "load_given_topology",
           "plan_topology", "local_topology"]
