"""The model side: workloads and built-in models, layers, graph capture, FLOPs, stages.

`from planner.workload import Workload` is the documented way to write a `--model pkg.mod:fn`
factory (see shared/CONTRACT.md); keep it importable from here.
"""
from planner.workload.load import Workload

__all__ = ["Workload"]
