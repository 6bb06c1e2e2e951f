"""The cost side: cost model, layer timing, memory, gradient buckets."""
