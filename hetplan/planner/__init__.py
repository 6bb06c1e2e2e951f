"""hetplan's planner, one subpackage per concept (map: docs/design.md).

files (plan, measured, io) -> hardware (topology, calibration, devices) and workload (models,
layers, capture) -> cost -> sim -> search. Never imports `runtime`.
"""
