"""FP8 training under a plain jit over a 2-D mesh (data x model), no shard_map: the batch is
split over "data" and the MLP is tensor parallel over "model" (the first layer's kernel split
by columns, the second's by rows, as in Megatron-LM). jax_fp8's ops carry sharding rules
(jax_fp8/sharding.py), so XLA keeps every operand split and adds only the reductions: the
amaxes, the row-parallel partial sums and the data-parallel gradients. The Dense layers need
no amax_axis_name here; the scale rings are replicated.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/sharded_jit.py
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


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    dense = functools.partial(Dense, dtype=jnp.bfloat16)
    x = jax.nn.gelu(dense(256, name="up")(x))
    return dense(64, name="down")(x).astype(jnp.float32)


def main(steps=30):
  devices = np.array(jax.devices())
  mesh = Mesh(devices.reshape(max(devices.size // 2, 1), -1), ("data", "model"))
  rng = np.random.default_rng(0)
  x = rng.standard_normal((mesh.shape["data"] * 32, 64)).astype(np.float32)
  y = np.tanh(x * 2)

  model, tx = MLP(), optax.adamw(3e-3)
  variables = model.init(jax.random.key(0), jnp.asarray(x[:8]))
  specs = {"up": {"kernel": P(None, "model"), "bias": P("model")},  # column parallel
           "down": {"kernel": P("model", None), "bias": P()}}  # row parallel
  put = lambda tree, spec: jax.device_put(tree, NamedSharding(mesh, spec))
  params = jax.tree.map(put, variables["params"], specs)
  fp8_state = put(variables["fp8_state"], P())
  opt_state = jax.jit(tx.init)(params)  # sharded like the parameters
  xs, ys = put(jnp.asarray(x), P("data")), put(jnp.asarray(y), P("data"))

  def loss_fn(params, state, xb, yb):
    return jnp.mean((model.apply({"params": params, "fp8_state": state}, xb) - yb) ** 2)

  @jax.jit
  def train_step(params, opt_state, state, xb, yb):
    loss, (grads, state_grads) = jax.value_and_grad(loss_fn, argnums=(0, 1))(
        params, state, xb, yb)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, jax_fp8.update_state(
        state, state_grads), loss

  for step in range(steps):
    params, opt_state, fp8_state, loss = train_step(params, opt_state, fp8_state, xs, ys)
    if step % 10 == 0 or step == steps - 1:
      print(f"step {step:3d}  loss {float(loss):.4f}")
  up = params["up"]["kernel"]
  print(f"mesh {dict(mesh.shape)}; up kernel {up.shape} stored as "
        f"{up.addressable_shards[0].data.shape} per device")
  return float(loss)


if __name__ == "__main__":
  main()
