"""Frontend: graph primitives (fx leaves), nn layers built on them, and the torch.fx tracer."""
