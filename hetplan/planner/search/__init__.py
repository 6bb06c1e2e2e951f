"""Search: strategy space, baselines, MCMC walk, the planning problem."""
