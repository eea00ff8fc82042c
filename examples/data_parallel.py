"""Data-parallel FP8 training with jax_fp8.flax.Dense, optax and shard_map, with gradient
accumulation over microbatches.

Every device holds the parameters and the FP8 scale rings; each takes a slice of the batch and
scans over microbatches of it. The rings see every microbatch's amax through `jax_fp8.share`
(combined by max) and the amaxes are max-reduced over the devices, so all devices end each step
with identical rings; parameter gradients are summed over the devices by JAX (they are
replicated inputs of the shard_map). The kernels are quantized once per step, not once per
microbatch (`jax_fp8.flax.cast_kernels`).

Runs on whatever devices exist; on a CPU, fake eight of them:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/data_parallel.py

On several hosts, start one process per host with the same script and call
`jax.distributed.initialize()` first (see the README); `jax.devices()` then spans all hosts.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, PartitionSpec as P

import jax_fp8
import jax_fp8.flax
from jax_fp8 import DelayedScaling
from jax_fp8.flax import Dense

AXIS = "data"
MICROBATCHES = 4


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    dense = functools.partial(Dense, dtype=jnp.bfloat16, amax_axis_name=AXIS)
    x = jax.nn.gelu(dense(256)(x))
    return dense(16)(x).astype(jnp.float32)


def main(steps=30):
  mesh = Mesh(np.array(jax.devices()), (AXIS,))
  n_dev = mesh.size
  rng = np.random.default_rng(0)
  x = rng.standard_normal((n_dev * MICROBATCHES * 32, 64)).astype(np.float32)
  y = np.tanh(x[:, :16] * 2)

  model, tx = MLP(), optax.adamw(3e-3)
  variables = model.init(jax.random.key(0), jnp.asarray(x[:8]))
  params, fp8_state = variables["params"], variables["fp8_state"]
  opt_state = tx.init(params)

  def loss_fn(params, state, xb, yb):
    return jnp.mean((model.apply({"params": params, "fp8_state": state}, xb) - yb) ** 2)

  def device_step(params, state, xb, yb):
    """One device's share: scan over its microbatches, the state shared among them."""
    xb = xb.reshape(MICROBATCHES, -1, xb.shape[-1])
    yb = yb.reshape(MICROBATCHES, -1, yb.shape[-1])

    def accumulated(params, state):
      # Varying from here on, so that the gradients are summed over the devices once, after
      # the scan, rather than in every microbatch.
      params = jax.lax.pcast(params, (AXIS,), to="varying")
      # The kernels quantized once for all microbatches (their rings observe this cast).
      cast = jax_fp8.flax.cast_kernels(params, state, DelayedScaling(), amax_axis_name=AXIS)

      def body(_, mb):
        xm, ym, sm = mb
        return None, loss_fn(cast, sm, xm, ym)
      _, losses = jax.lax.scan(body, None, (xb, yb, jax_fp8.share(state, MICROBATCHES)))
      return jnp.mean(losses)

    loss, (grads, state_grads) = jax.value_and_grad(accumulated, argnums=(0, 1))(params, state)
    grads = jax.tree.map(lambda g: g / n_dev, grads)  # summed over devices -> mean
    return jax.lax.pmean(loss, AXIS), grads, jax_fp8.update_state(state, state_grads)

  sharded = jax.shard_map(device_step, mesh=mesh, in_specs=(P(), P(), P(AXIS), P(AXIS)),
                          out_specs=(P(), P(), P()))

  @jax.jit
  def train_step(params, opt_state, state, xb, yb):
    loss, grads, state = sharded(params, state, xb, yb)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, state, loss

  for step in range(steps):
    params, opt_state, fp8_state, loss = train_step(params, opt_state, fp8_state, x, y)
    if step % 10 == 0 or step == steps - 1:
      print(f"step {step:3d}  loss {float(loss):.4f}")
  ring = fp8_state["Dense_0"]["linear"].x
  print(f"{n_dev} devices x {MICROBATCHES} microbatches; first layer's x ring: "
        f"{int(ring.steps)} steps, scale {float(ring.scale):.3g}")
  return float(loss)


if __name__ == "__main__":
  main()
