"""How fast a step runs and what it costs: FLOPs and memory estimates, tokens/s and MFU, the fast
path's one-line description, the SDPA kernel choice, CPU threads and the host allocator."""
