"""Fully sharded data parallel (FSDP / ZeRO-3) FP8 training with jax_fp8.flax.Dense, optax and
shard_map.

Each device stores 1/n of every parameter (split along its first axis) and of the optimizer
state; inside the step it gathers the full parameters for the forward and backward, and JAX
returns the parameter gradients reduce-scattered back to the shards (the transpose of the
gather). The FP8 scale rings are small and stay replicated, with amaxes max-reduced over the
devices.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/fsdp.py
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_fp8
from jax_fp8.flax import Dense

AXIS = "data"


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    dense = functools.partial(Dense, dtype=jnp.bfloat16, amax_axis_name=AXIS)
    x = jax.nn.gelu(dense(256)(x))
    return dense(64)(x).astype(jnp.float32)


def main(steps=30):
  mesh = Mesh(np.array(jax.devices()), (AXIS,))
  n_dev = mesh.size
  rng = np.random.default_rng(0)
  x = rng.standard_normal((n_dev * 32, 64)).astype(np.float32)
  y = np.tanh(x * 2)

  model, tx = MLP(), optax.adamw(3e-3)
  variables = model.init(jax.random.key(0), jnp.asarray(x[:8]))
  fp8_state = variables["fp8_state"]
  shard = NamedSharding(mesh, P(AXIS))  # every parameter split along its first axis
  params = jax.device_put(variables["params"], shard)
  opt_state = jax.jit(tx.init)(params)  # sharded like the parameters

  def loss_fn(params, state, xb, yb):
    return jnp.mean((model.apply({"params": params, "fp8_state": state}, xb) - yb) ** 2)

  def device_step(param_shards, state, xb, yb):
    def sharded_loss(param_shards, state):
      full = jax.tree.map(lambda p: jax.lax.all_gather(p, AXIS, axis=0, tiled=True),
                          param_shards)
      return loss_fn(full, state, xb, yb)
    loss, (grads, state_grads) = jax.value_and_grad(sharded_loss, argnums=(0, 1))(
        param_shards, state)
    grads = jax.tree.map(lambda g: g / n_dev, grads)  # reduce-scattered sums -> means
    return jax.lax.pmean(loss, AXIS), grads, jax_fp8.update_state(state, state_grads)

  sharded = jax.shard_map(device_step, mesh=mesh, in_specs=(P(AXIS), P(), P(AXIS), P(AXIS)),
                          out_specs=(P(), P(AXIS), P()))

  @jax.jit
  def train_step(params, opt_state, state, xb, yb):
    loss, grads, state = sharded(params, state, xb, yb)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, state, loss

  for step in range(steps):
    params, opt_state, fp8_state, loss = train_step(params, opt_state, fp8_state, x, y)
    if step % 10 == 0 or step == steps - 1:
      print(f"step {step:3d}  loss {float(loss):.4f}")
  kernel = params["Dense_0"]["kernel"]
  print(f"{n_dev} devices; Dense_0 kernel {kernel.shape} stored as "
        f"{kernel.addressable_shards[0].data.shape} per device")
  return float(loss)


if __name__ == "__main__":
  main()
