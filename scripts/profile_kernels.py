"""Runs each jax_fp8 CUDA kernel a few times on benchmark-sized inputs, for a profiler
(`scripts/gpu_check.sh profile` wraps it in Nsight Compute)."""

import jax
import jax.numpy as jnp

import jax_fp8


def main():
  x = jax.random.normal(jax.random.key(0), (8192, 8192), jnp.bfloat16)
  ring = jax_fp8.quantize_delayed(x, jax_fp8.ScaleRing.create())[2]  # past step 0
  quantize = jax.jit(lambda x: jax_fp8.quantize(x, jnp.float32(0.01)))
  delayed = jax.jit(jax_fp8.quantize_delayed)
  cast_t = jax.jit(jax_fp8.cast_transpose_delayed)
  cast_t_dbias = jax.jit(lambda x, r: jax_fp8.cast_transpose_delayed(x, r, with_dbias=True))
  group = jax.jit(lambda x: jax_fp8.group_quantize(x, scale_layout="col"))
  block = jax.jit(jax_fp8.block_quantize)
  group_t = jax.jit(jax_fp8.group_cast_transpose)
  for _ in range(3):
    jax.block_until_ready((quantize(x), delayed(x, ring), cast_t(x, ring), cast_t_dbias(x, ring),
                           group(x), block(x), group_t(x)))


if __name__ == "__main__":
  main()
