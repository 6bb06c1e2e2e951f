"""hetplan's planner: workloads, operator graph, topology, cost model, plan, simulator, search.

Never imports `runtime`."""
