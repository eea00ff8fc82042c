"""jax_fp8 benchmarks: `python -m benchmarks.run` (one process, whatever device exists)."""
