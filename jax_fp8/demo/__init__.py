"""The package's main job: FP8 vs BF16 training of a byte-level transformer (``python -m jax_fp8.demo``)."""
