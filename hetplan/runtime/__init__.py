"""hetplan's runtime: executes a plan with torch.distributed and measures it."""
