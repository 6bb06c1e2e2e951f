"""Simulation: schedules, task graph, event loop, simulator, Chrome trace, plan-file prediction."""
