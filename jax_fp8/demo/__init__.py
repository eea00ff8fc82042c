"""The package's main job, ``python -m jax_fp8.demo``: FP8 vs BF16 training of a byte-level LM.
``model`` (the transformer) and ``train`` (its train step) are the ones the benchmarks run."""
