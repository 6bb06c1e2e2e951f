"""`hetplan profile`: measure this machine's devices and links and write a topology file."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from hetplan.planner.files.io import InputError
from hetplan.planner.hardware.lookup import default_profile_path as default_path  # demo and tests import it here

HELP = "measure this machine's devices and links for real and write a topology file"


def add_arguments(p) -> None:
    p.add_argument("--cpu-workers", type=int, default=1, metavar="N",
                   help="CPU worker processes cpu:0..N-1 splitting the cores (default 1)")
    p.add_argument("-o", "--output", metavar="PATH", default=None,
                   help="topology file to write (default: this machine's profile in the cache, "
                        "~/.cache/hetplan/profiles/<fingerprint>.json or under $HETPLAN_CACHE_DIR)")
    p.add_argument("--list", action="store_true",
                   help="list the cached profiles (which one is this machine's) and measure nothing")
    p.add_argument("--quick", action="store_true",
                   help="fewer sizes and repeats: faster, noisier (times in docs/status.md)")


def _summary(t, path: Path, elapsed_s: float, spread: float) -> dict:
    return {
        "path": str(path), "name": t.name, "duration_s": round(elapsed_s, 2), "max_spread": spread,
        "devices": [{"name": d.name, "threads": d.threads, "matmul_flops_per_s": d.matmul_flops_per_s,
                     "matmul_flops_per_s_by_precision": d.matmul_flops_per_s_by_precision,
                     "memory_bytes_per_s": d.memory_bytes_per_s, "op_overhead_s": d.op_overhead_s,
                     "memory_bytes": d.memory_bytes} for d in t.devices],
        "links": [{"a": l.a, "b": l.b, "bandwidth_bytes_per_s": l.bandwidth_bytes_per_s,
                   "latency_s": l.latency_s} for l in t.links],
    }


def _print_table(s: dict) -> None:
    print(f"{'device':<10}{'threads':>8}{'matmul GFLOP/s':>16}{'bf16 GFLOP/s':>14}{'copy GB/s':>11}{'op us':>8}"
          f"{'memory GB':>11}")
    for d in s["devices"]:
        bf16 = (d["matmul_flops_per_s_by_precision"] or {}).get("bf16")
        print(f"{d['name']:<10}{d['threads'] or '':>8}{d['matmul_flops_per_s'] / 1e9:>16.1f}"
              f"{bf16 / 1e9 if bf16 else float('nan'):>14.1f}"
              f"{d['memory_bytes_per_s'] / 1e9:>11.1f}{d['op_overhead_s'] * 1e6:>8.1f}"
              f"{d['memory_bytes'] / 1e9:>11.1f}")
    for l in s["links"]:
        print(f"link {l['a']} <-> {l['b']}: {l['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s, "
              f"latency {l['latency_s'] * 1e6:.1f} us")
    print(f"wrote {s['path']} in {s['duration_s']:.1f} s; largest spread of a repeated "
          f"measurement {s['max_spread']:.1%}")


def cached_profiles() -> list[dict]:
    """Every cached profile: its path, fingerprint, CPU, cores, GPUs, date, whether it is this
    machine's; a file that does not load is listed with its error."""
    from hetplan.planner.hardware.lookup import profiles_dir
    from hetplan.planner.hardware.machine import this_machine
    from hetplan.planner.hardware.topology import load_topology
    here, rows = this_machine(), []
    for path in sorted(profiles_dir().glob("*.json")):
        try:
            host = load_topology(path).measured.get("host") or {}
        except InputError as e:
            rows.append({"path": str(path), "error": str(e)})
            continue
        machine = host.get("machine") or {}
        rows.append({"path": str(path), "fingerprint": host.get("fingerprint"), "this_machine": host.get("fingerprint") == here,
                     "cpu_model": host.get("cpu_model"), "cores": host.get("cores"), "gpus": machine.get("gpus", []),
                     "hostname": host.get("hostname"), "profiled_at": host.get("profiled_at")})
    return rows


def _list(args) -> int:
    from hetplan.planner.hardware.lookup import profiles_dir
    from hetplan.planner.hardware.machine import this_machine
    rows = cached_profiles()
    if args.json:
        print(json.dumps({"cache": str(profiles_dir()), "this_machine": this_machine(), "profiles": rows}))
        return 0
    print(f"profiles in {profiles_dir()} (this machine: {this_machine()})")
    for r in rows:
        if "error" in r:
            print(f"    {r['path']}: {r['error']}")
            continue
        gpus = ", ".join(r["gpus"]) or "no GPU"
        print(f"  {'*' if r['this_machine'] else ' '} {r['fingerprint']}  {r['cpu_model']}, {r['cores']} cores, {gpus}; "
              f"{r['profiled_at']} on {r['hostname']}  {r['path']}")
    if not rows:
        print("  none: `hetplan profile` measures this machine")
    return 0


def main(args) -> int:
    if args.list:
        return _list(args)
    path = Path(args.output) if args.output else default_path()
    if path.is_dir():
        raise InputError(f"{path}: -o: expected a file path, got a directory")
    from hetplan.runtime import profile  # heavy (torch): only when the command runs

    t0 = time.perf_counter()
    try:
        topology = profile.profile_machine(args.cpu_workers, quick=args.quick)
    except profile.ProfileError as e:
        print(f"hetplan profile: error: {e} (no file written)", file=sys.stderr)
        return 1
    from hetplan.planner.hardware.topology import save_topology
    save_topology(topology, path)
    s = _summary(topology, path, time.perf_counter() - t0, profile.max_spread(topology))
    if args.json:
        print(json.dumps(s))
    else:
        _print_table(s)
    return 0
