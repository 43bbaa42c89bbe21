"""Runtime: sparse kernels, the reference trainer (and, later, communication, executor, launcher)."""
