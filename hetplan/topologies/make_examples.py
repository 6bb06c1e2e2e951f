"""Regenerate the what-if topology files in this folder: `python hetplan/topologies/make_examples.py`.

Every figure is a *sustained* value, not a peak from a spec sheet; README.md next to this file
gives each figure's source and how the sustained value was derived from the peak. The files are
written through `hetplan.planner.hardware.topology.save_topology`, so they are exactly what the loader reads back.
"""
from __future__ import annotations

import itertools
from pathlib import Path

from hetplan.planner.hardware.topology import Device, Link, Topology, save_topology

HERE = Path(__file__).resolve().parent
GB = 1e9

# --- the source report's workstation: 16-thread Core i7 + GeForce GTX 1650 4 GB -------------
I7_8C16T = dict(kind="cpu", threads=16, memory_bytes=28 * GB,    # 32 GB installed, ~4 GB for the OS
                matmul_flops_per_s=6.0e11,      # ~60% of 1.0 TFLOPS AVX2 FP32 peak (8 cores)
                memory_bytes_per_s=3.5e10,      # STREAM copy on dual-channel DDR4-2933 (46.9 GB/s peak)
                op_overhead_s=5e-6)             # PyTorch eager dispatch of a tiny CPU op
GTX1650 = dict(kind="cuda", memory_bytes=3.8 * GB,  # 4 GiB GDDR5 less the CUDA context
               matmul_flops_per_s=2.6e12,      # ~87% of 2.98 TFLOPS FP32 (no tensor cores on TU117)
               memory_bytes_per_s=1.1e11,      # ~86% of 128 GB/s GDDR5
               op_overhead_s=1e-5)             # eager kernel launch + dispatch
PCIE3_X16 = dict(bandwidth_bytes_per_s=1.2e10, latency_s=1e-5)  # 15.75 GB/s peak; ~12 GB/s pinned

# --- a 2-socket CPU-only server: 2x Xeon Gold 6248 (20 cores, AVX-512) ---------------------
XEON_6248 = dict(kind="cpu", threads=40, memory_bytes=180 * GB,  # 192 GB per socket, less the OS
                 matmul_flops_per_s=1.8e12,     # ~75% of 2.4 TFLOPS (20 cores x 64 FLOP/cycle x 1.9 GHz AVX-512)
                 memory_bytes_per_s=1.0e11,     # STREAM copy; 6 x DDR4-2933 = 140.8 GB/s peak
                 op_overhead_s=5e-6)
UPI_3LINKS = dict(bandwidth_bytes_per_s=3.5e10, latency_s=5e-6)  # 3 x 20.8 GB/s peak; software hand-off sets latency

# --- DGX A100 (640 GB): 8x A100-SXM4-80GB, NVSwitch, 2x AMD EPYC 7742 ------------------------
A100_80GB = dict(kind="cuda", memory_bytes=80 * GB,
                 matmul_flops_per_s=1.8e13,     # FP32 (PyTorch's default: TF32 off for matmul); 19.5 TFLOPS peak
                 memory_bytes_per_s=1.75e12,    # ~86% of 2039 GB/s HBM2e
                 op_overhead_s=1e-5)
EPYC_7742 = dict(kind="cpu", threads=128, memory_bytes=950 * GB,  # 1 TB per socket, less the OS
                 matmul_flops_per_s=2.5e12,     # ~55% of 4.6 TFLOPS (64 cores x 32 FLOP/cycle x 2.25 GHz)
                 memory_bytes_per_s=1.5e11,     # STREAM copy; 8 x DDR4-3200 = 204.8 GB/s peak
                 op_overhead_s=5e-6)
NVLINK3 = dict(bandwidth_bytes_per_s=2.3e11, latency_s=1e-5)  # 300 GB/s per direction peak; NCCL ~230 GB/s
PCIE4_X16 = dict(bandwidth_bytes_per_s=2.4e10, latency_s=1e-5)  # 31.5 GB/s peak; ~24 GB/s pinned
XGMI = dict(bandwidth_bytes_per_s=6.4e10, latency_s=5e-6)     # EPYC socket-to-socket (assumed, see README)
IB_EDR = dict(bandwidth_bytes_per_s=1.2e10, latency_s=5e-6)   # 100 Gb/s = 12.5 GB/s; ib_write_bw ~12 GB/s


def workstation() -> Topology:
    return Topology(
        name="workstation-gtx1650: 16-thread Core i7 (8C, AVX2, 2ch DDR4-2933) + GeForce GTX 1650 "
             "4 GB over PCIe 3.0 x16; sustained FP32 figures, sources in hetplan/topologies/README.md",
        devices=(Device("cpu:0", **I7_8C16T), Device("cuda:0", **GTX1650)),
        links=(Link("cpu:0", "cuda:0", **PCIE3_X16),))


def cpu_server() -> Topology:
    return Topology(
        name="cpu-server-2socket: 2x Xeon Gold 6248 (20C, AVX-512, 6ch DDR4-2933) linked by 3 UPI "
             "links; sustained FP32 figures, sources in hetplan/topologies/README.md",
        devices=(Device("cpu:0", **XEON_6248), Device("cpu:1", **XEON_6248)),
        links=(Link("cpu:0", "cpu:1", **UPI_3LINKS),))


def _dgx_node(prefix: str = "") -> tuple[list[Device], list[Link]]:
    """One DGX A100: GPUs 0-3 hang off socket 0, 4-7 off socket 1 (PCIe Gen4 switches);
    NVSwitch gives every GPU pair a full-speed path, drawn here as a clique of links."""
    n = lambda s: f"{prefix}{s}"  # noqa: E731
    devices = [Device(n(f"cpu:{s}"), **EPYC_7742) for s in range(2)]
    devices += [Device(n(f"cuda:{g}"), **A100_80GB) for g in range(8)]
    links = [Link(n(f"cuda:{i}"), n(f"cuda:{j}"), **NVLINK3) for i, j in itertools.combinations(range(8), 2)]
    links += [Link(n(f"cpu:{g // 4}"), n(f"cuda:{g}"), **PCIE4_X16) for g in range(8)]
    links.append(Link(n("cpu:0"), n("cpu:1"), **XGMI))
    return devices, links


def dgx() -> Topology:
    devices, links = _dgx_node()
    return Topology(
        name="dgx-8gpu: DGX A100, 8x A100-SXM4-80GB (FP32, TF32 off) on NVSwitch + 2x EPYC 7742, "
             "PCIe Gen4 to host; sustained figures, sources in hetplan/topologies/README.md",
        devices=tuple(devices), links=tuple(links))


def dgx_2node() -> Topology:
    devices, links = [], []
    for node in range(2):
        d, l = _dgx_node(f"node{node}/")
        devices += d
        links += l
    # One 100 Gb/s HCA per node, on socket 0; cross-node traffic is routed through it.
    links.append(Link("node0/cpu:0", "node1/cpu:0", **IB_EDR))
    return Topology(
        name="dgx-2node-ib: two DGX A100 nodes (as dgx-8gpu) over one 100 Gb/s InfiniBand EDR link; "
             "sustained figures, sources in hetplan/topologies/README.md",
        devices=tuple(devices), links=tuple(links))


EXAMPLES = {"workstation-gtx1650": workstation, "cpu-server-2socket": cpu_server,
            "dgx-8gpu": dgx, "dgx-2node-ib": dgx_2node}

if __name__ == "__main__":
    for stem, make in EXAMPLES.items():
        save_topology(make(), HERE / f"{stem}.json")
        print(f"wrote {HERE / stem}.json")
