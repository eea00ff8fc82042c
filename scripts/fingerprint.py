"""Fingerprints of what jax_fp8 computes on the CPU: one SHA-256 per case over the bytes of every
output, gradient and state leaf of the public ops, ``linear``, ``multi_linear``, ``mlp``,
``cast_kernel``, FP8 inference weights and the Flax linen / NNX layers, under every recipe.

A refactor that changes no numerics leaves every fingerprint as it was: record them before
(``python scripts/fingerprint.py --out before.json``), compare after (``python
scripts/fingerprint.py --compare before.json``, exit 1 on any difference). A case hashes the
sorted digests of its leaves (dtype, shape and bytes each), so a result that is regrouped (a
tuple become a named type, a dict a dataclass) but holds the same arrays keeps its fingerprint;
``field`` reads a result in any of those forms.
Inputs come from fixed seeds; only public names are used, so the script runs on the old tree
and the new one alike. Record both on one machine: XLA:CPU compiles for the host's processor, and
on another one d3ded52's own cases under a norm or MXFP8 hashed differently (65 of 188 on an AMD
EPYC with AVX2 against the first recording). The file names its host (``cpu``), and a comparison
across hosts says so.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=2").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jax_fp8  # noqa: E402

RECIPES = {
    "delayed": jax_fp8.DelayedScaling(),
    "delayed_e4m3_fast": jax_fp8.DelayedScaling(fp8_format="e4m3", margin=1, algo="most_recent",
                                                history_len=4, fast_accum_gemms=("fprop",)),
    "current": jax_fp8.CurrentScaling(),
    "block": jax_fp8.BlockScaling(),
    "block_ue8m0": jax_fp8.BlockScaling(ue8m0=True),
    "mxfp8": jax_fp8.MXFP8BlockScaling(),
    "nvfp4": jax_fp8.NVFP4BlockScaling(),
    "nvfp4_plain": jax_fp8.NVFP4BlockScaling(weight_block_2d=False, stochastic_rounding=False,
                                             rht=False),
}
DELAYED = ("delayed", "delayed_e4m3_fast")
CASTABLE = ("delayed", "current", "block")  # cast_kernel's and Fp8Weight's recipes
KEY = jax.random.key(7)


def digest(tree) -> str:
  """SHA-256 over the sorted per-leaf digests of ``tree`` (dtype, shape, bytes)."""
  leaves = []
  for leaf in jax.tree.leaves(tree):
    a = np.asarray(leaf)
    h = hashlib.sha256(f"{a.dtype}{a.shape}".encode())
    h.update(np.ascontiguousarray(a).tobytes())
    leaves.append(h.hexdigest())
  return hashlib.sha256("".join(sorted(leaves)).encode()).hexdigest()


def field(t, *names):
  """A field of a quantize op's result under the first of ``names`` it has, so that a case runs
  on trees whose results differ in form: a dict's key, a named field, or an int (a bare
  tuple's position)."""
  for name in names:
    if isinstance(name, int):
      if type(t) is tuple:
        return t[name]
    elif isinstance(t, dict):
      if name in t:
        return t[name]
    elif hasattr(t, name):
      return getattr(t, name)
  raise KeyError(f"none of {names} in a {type(t).__name__}")


def computed(t):
  """What ``quantize`` computed (data, amax), without the scale it was given: the old tree's
  result held only these two, the ``Quantized`` of the new one gives the scale back too."""
  return field(t, "data", "q"), t.amax


def data(seed: int, shape, dtype=jnp.float32, scale=1.0):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape) * scale, dtype)


def state_for(recipe, kind: str, outputs: int = 1):
  if not isinstance(recipe, jax_fp8.DelayedScaling):
    return None
  if kind == "linear":
    return jax_fp8.LinearState.create(recipe)
  if kind == "multi":
    return jax_fp8.MultiLinearState.create(outputs, recipe)
  return jax_fp8.MlpState.create(recipe)


def key_for(recipe):
  sr = isinstance(recipe, jax_fp8.NVFP4BlockScaling) and recipe.stochastic_rounding
  return KEY if sr else None


def two_steps(loss, params, state):
  """Outputs, gradients and states of two steps (the second with the first's updated state)."""
  out = []
  for _ in range(2):
    value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, state)
    out.append((value, grads))
    if state is not None:
      state = jax_fp8.update_state(state, grads[1])
  return out, state


def op_cases():
  x = data(1, (64, 256), jnp.bfloat16)
  x32 = data(2, (48, 128))
  g = data(3, (64, 256), jnp.bfloat16, 1e-3)
  ring = jax_fp8.ScaleRing.create(8, "e4m3")
  ring2 = jax_fp8.quantize_delayed(x, ring, observe=False).ring
  cases = {
      "quantize": lambda: computed(jax_fp8.quantize(x, jnp.float32(0.01), fmt="e4m3")),
      "quantize_e5m2": lambda: computed(jax_fp8.quantize(g, jnp.float32(1e-6), fmt="e5m2")),
      "quantize_delayed_fresh": lambda: jax_fp8.quantize_delayed(x, ring),
      "quantize_delayed_step": lambda: jax_fp8.quantize_delayed(x32, ring2, observe=True),
      "cast_transpose_dbias": lambda: jax_fp8.cast_transpose_delayed(
          g, jax_fp8.ScaleRing.create(4, "e5m2"), with_dbias=True),
      "cast_transpose_parts": lambda: jax_fp8.cast_transpose_delayed(
          (x[:, :128], x[:, 128:]), ring2, observe=True),
      "norm_cast_transpose_rms": lambda: jax_fp8.norm_cast_transpose(
          x, jax_fp8.norms.stats(x, "rmsnorm", 1e-6), data(4, (256,)), None, ring,
          norm="rmsnorm"),
      "norm_cast_transpose_ln": lambda: jax_fp8.norm_cast_transpose(
          x, jax_fp8.norms.stats(x, "layernorm", 1e-6), data(4, (256,)), data(5, (256,)), ring,
          norm="layernorm"),
      "dequantize": lambda: jax_fp8.dequantize(
          field(jax_fp8.quantize(x, jnp.float32(0.01)), "data", "q"), jnp.float32(0.01),
          dtype=jnp.bfloat16),
      "group_quantize": lambda: jax_fp8.group_quantize(x32),
      "group_quantize_ue8m0_col": lambda: jax_fp8.group_quantize(x, ue8m0=True,
                                                                 scale_layout="col"),
      "block_quantize": lambda: jax_fp8.block_quantize(data(6, (256, 384))),
      "group_cast_transpose": lambda: jax_fp8.group_cast_transpose(data(7, (200, 256))),
      "norm_group_cast_transpose": lambda: jax_fp8.norm_group_cast_transpose(
          x, jax_fp8.norms.stats(x, "rmsnorm", 1e-6), data(4, (256,)), None, norm="rmsnorm"),
      "mxfp8_quantize": lambda: jax_fp8.mxfp8_quantize(x, columnwise=True),
      "mxfp8_quantize_e5m2": lambda: jax_fp8.mxfp8_quantize(x32[:32], fmt="e5m2"),
      "nvfp4_quantize": lambda: jax_fp8.nvfp4_quantize(x, columnwise=True),
      "nvfp4_quantize_2d": lambda: jax_fp8.nvfp4_quantize(x, columnwise=True, block_2d=True),
      "nvfp4_quantize_sr_rht": lambda: jax_fp8.nvfp4_quantize(
          g, columnwise=True, stochastic_rounding=True, key=KEY, rht=True, rht_seed=3),
  }
  for act in ("silu", "gelu", "swiglu", "geglu"):
    y = data(8, (64, 256), jnp.bfloat16)
    dh = data(9, (64, 256 // 2 if act in ("swiglu", "geglu") else 256), jnp.bfloat16)
    cases[f"activation_cast_transpose_{act}"] = (
        lambda y=y, act=act: jax_fp8.activation_cast_transpose(y, ring, activation=act))
    cases[f"activation_grad_cast_transpose_{act}"] = (
        lambda y=y, dh=dh, act=act: jax_fp8.activation_grad_cast_transpose(
            dh, y, jax_fp8.ScaleRing.create(4, "e5m2"), activation=act, with_dbias=True))
    cases[f"activation_group_cast_transpose_{act}"] = (
        lambda y=y, act=act: jax_fp8.activation_group_cast_transpose(y, activation=act))
    cases[f"activation_grad_group_cast_transpose_{act}"] = (
        lambda y=y, dh=dh, act=act: jax_fp8.activation_grad_group_cast_transpose(
            dh, y, activation=act))
  a = jax_fp8.quantize(data(10, (64, 256)), jnp.float32(0.01))
  b = jax_fp8.quantize(data(11, (128, 256)), jnp.float32(0.02))
  qa, qb = field(a, "data", "q"), field(b, "data", "q")
  cases["gemm"] = lambda: jax_fp8.gemm(qa, qb, jnp.float32(0.01), jnp.float32(0.02),
                                       bias=data(12, (128,), jnp.bfloat16))
  cases["gemm_e4m3_out"] = lambda: jax_fp8.gemm(
      qa, qb, jnp.float32(0.01), jnp.float32(0.02), out_dtype=jnp.float8_e4m3fn,
      out_scale=jnp.float32(0.5))
  ga = jax_fp8.group_quantize(data(13, (64, 256)))
  gb = jax_fp8.block_quantize(data(14, (128, 256)))
  cases["gemm_block"] = lambda: jax_fp8.gemm(
      field(ga, "data", 0), field(gb, "data", 0), field(ga, "scale", 1), field(gb, "scale", 1))
  ma = jax_fp8.mxfp8_quantize(data(15, (64, 256)))
  mb = jax_fp8.mxfp8_quantize(data(16, (128, 256)))
  cases["mxfp8_gemm"] = lambda: jax_fp8.mxfp8_gemm(
      field(ma, "data"), field(mb, "data"), field(ma, "scale", "scales"),
      field(mb, "scale", "scales"))
  cases["mxfp8_dequantize"] = lambda: jax_fp8.mxfp8_dequantize(
      field(ma, "data"), field(ma, "scale", "scales"))
  na = jax_fp8.nvfp4_quantize(data(17, (64, 256)))
  nb = jax_fp8.nvfp4_quantize(data(18, (128, 256)))
  cases["nvfp4_gemm"] = lambda: jax_fp8.nvfp4_gemm(
      field(na, "data"), field(nb, "data"), field(na, "scale", "scales"),
      field(nb, "scale", "scales"), field(na, "global_scale"), field(nb, "global_scale"))
  cases["nvfp4_dequantize"] = lambda: jax_fp8.nvfp4_dequantize(
      field(na, "data"), field(na, "scale", "scales"), field(na, "global_scale"))
  return {f"op/{name}": fn for name, fn in cases.items()}


def linear_case(name, recipe, *, bias, norm, split=None, dtype=jnp.bfloat16):
  k, n = 256, 384
  x = data(20, (2, 64, k), dtype)
  kernel = data(21, (k, n), jnp.float32, 0.05)
  b = data(22, (n,), jnp.float32, 0.1) if bias else None
  gamma = data(23, (k,), jnp.float32, 0.1) + 1 if norm else None
  beta = data(24, (k,), jnp.float32, 0.1) if norm == "layernorm" else None
  key = key_for(recipe)

  def loss(params, state):
    kernel, b, gamma, beta, x = params
    y = jax_fp8.linear(x, kernel, b, state=state, recipe=recipe, norm=norm, gamma=gamma,
                       beta=beta, key=key, split=split)
    ys = y if isinstance(y, tuple) else (y,)
    return sum(jnp.sum(jnp.sin(yi.astype(jnp.float32)) * (i + 1)) for i, yi in enumerate(ys))

  def run():
    return two_steps(loss, (kernel, b, gamma, beta, x), state_for(recipe, "linear"))
  return run


def multi_case(recipe, norm):
  x = data(30, (128, 256), jnp.bfloat16)
  kernels = (data(31, (256, 128), scale=0.05), data(32, (256, 256), scale=0.05))
  biases = (data(33, (128,), jnp.bfloat16), None)
  gamma = data(34, (256,), scale=0.1) + 1 if norm else None

  def loss(params, state):
    kernels, biases, gamma, x = params
    ys = jax_fp8.multi_linear(x, kernels, biases, state=state, recipe=recipe, norm=norm,
                              gamma=gamma, key=key_for(recipe))
    return sum(jnp.sum(jnp.cos(y.astype(jnp.float32)) * (i + 2)) for i, y in enumerate(ys))

  return lambda: two_steps(loss, (kernels, biases, gamma, x), state_for(recipe, "multi", 2))


def mlp_case(recipe, activation, norm, bias):
  gated = activation in ("swiglu", "geglu")
  x = data(40, (128, 256), jnp.bfloat16)
  k_in = data(41, (256, 256 * (2 if gated else 1)), scale=0.05)
  k_out = data(42, (256, 128), scale=0.05)
  b_in = data(43, (k_in.shape[1],), jnp.bfloat16, 0.1) if bias else None
  b_out = data(44, (128,), jnp.bfloat16, 0.1) if bias else None
  gamma = data(45, (256,), scale=0.1) + 1 if norm else None
  beta = data(46, (256,), scale=0.1) if norm == "layernorm" else None

  def loss(params, state):
    k_in, k_out, b_in, b_out, gamma, beta, x = params
    y = jax_fp8.mlp(x, k_in, k_out, b_in, b_out, activation=activation, state=state,
                    recipe=recipe, norm=norm, gamma=gamma, beta=beta, key=key_for(recipe))
    return jnp.sum(jnp.sin(y.astype(jnp.float32)))

  return lambda: two_steps(loss, (k_in, k_out, b_in, b_out, gamma, beta, x),
                           state_for(recipe, "mlp"))


def cast_kernel_case(recipe):
  x = data(50, (3, 64, 256), jnp.bfloat16)
  kernel = data(51, (256, 128), scale=0.05)

  def loss(params, state):
    kernel, x = params
    ring = None if state is None else state.kernel
    shared = None if state is None else jax_fp8.share(state, 3)

    def body(carry, xs):
      i, xb = xs
      st = None if shared is None else jax.tree.map(lambda v: v[i], shared)
      y = jax_fp8.linear(xb, ck, state=st, recipe=recipe)
      return carry + jnp.sum(jnp.sin(y.astype(jnp.float32))), None

    ck = jax_fp8.cast_kernel(kernel, ring, recipe=recipe)
    total, _ = jax.lax.scan(body, jnp.float32(0), (jnp.arange(3), x))
    return total

  return lambda: two_steps(loss, (kernel, x), state_for(recipe, "linear"))


def weights_case(recipe, intensity):
  recipe = type(recipe)(**{**{f: getattr(recipe, f) for f in recipe.__dataclass_fields__},
                          "fp8_min_intensity": intensity})
  x = data(60, (64, 256), jnp.bfloat16)
  params = {"a": {"kernel": data(61, (256, 128), scale=0.05)},
            "b": {"kernel_0": data(62, (256, 256), scale=0.05),
                  "kernel_1": data(63, (256, 128), scale=0.05)}}
  w = jax_fp8.quantize_weights(params, recipe)
  state = state_for(recipe, "linear")
  mstate = state_for(recipe, "multi", 2)

  def run():
    y = jax.jit(lambda w, x: jax_fp8.linear(x, w["a"]["kernel"], state=state, recipe=recipe))(
        w, x)
    ys = jax.jit(lambda w, x: jax_fp8.multi_linear(
        x, (w["b"]["kernel_0"], w["b"]["kernel_1"]), state=mstate, recipe=recipe))(w, x)
    return w, y, ys
  return run


def linen_two_steps(model, recipe, x, seed: int):
  """A linen model's initial params and ``two_steps`` of its mean-square output on x."""
  rngs = {"stochastic_rounding": KEY} if key_for(recipe) is not None else {}
  variables = model.init(jax.random.key(seed), x)
  params, state = variables["params"], variables.get("fp8_state", {})

  def loss(params, state):
    y = model.apply({"params": params, "fp8_state": state}, x, rngs=rngs)
    return jnp.mean(jnp.square(y.astype(jnp.float32)))
  return params, two_steps(loss, params, state)


def small_model_cases():
  import flax.linen as nn
  import optax
  from flax import nnx

  import jax_fp8.convert
  import jax_fp8.flax
  import jax_fp8.nnx

  cases = {}
  x = data(70, (4, 32, 128), jnp.bfloat16)

  for rname, recipe in RECIPES.items():
    class Block(nn.Module):
      @nn.compact
      def __call__(self, h):
        q, k = jax_fp8.flax.MultiDense((128, 128), recipe=recipe, dtype=jnp.bfloat16,
                                       norm="rmsnorm")(h)
        h = h + jax_fp8.flax.Dense(128, recipe=recipe, dtype=jnp.bfloat16)(q * k)
        return h + jax_fp8.flax.Mlp(256, activation="gelu", out_features=128, recipe=recipe,
                                    norm="layernorm", dtype=jnp.bfloat16)(h)

    cases[f"flax/{rname}"] = (lambda recipe=recipe, Block=Block:
                              linen_two_steps(Block(), recipe, x, 0))

    class NnxBlock(nnx.Module):
      def __init__(self, rngs):
        kw = dict(recipe=recipe, dtype=jnp.bfloat16, rngs=rngs)
        self.qk = jax_fp8.nnx.MultiLinear(128, (128, 128), norm="rmsnorm", **kw)
        self.o = jax_fp8.nnx.Linear(128, 128, **kw)
        self.mlp = jax_fp8.nnx.Mlp(128, 256, 128, activation="swiglu", **kw)

      def __call__(self, h):
        q, k = self.qk(h)
        h = h + self.o(q * k)
        return h + self.mlp(h)

    def nnx_run(NnxBlock=NnxBlock):
      model = NnxBlock(nnx.Rngs(0, stochastic_rounding=1))
      opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
      out = []
      for _ in range(2):
        diff = nnx.DiffState(0, (nnx.Param, jax_fp8.nnx.Fp8State))
        loss, grads = nnx.jit(lambda m: nnx.value_and_grad(
            lambda m: jnp.mean(jnp.square(m(x).astype(jnp.float32))), argnums=diff)(m))(model)
        opt.update(model, nnx.filter_state(grads, nnx.Param))
        jax_fp8.nnx.update_fp8_state(model, grads)
        out.append((loss, grads))
      return out, nnx.state(model)
    cases[f"nnx/{rname}"] = nnx_run

  class Plain(nn.Module):
    @nn.compact
    def __call__(self, h):
      h = nn.Dense(256, dtype=jnp.bfloat16, name="up")(h)
      h = nn.DenseGeneral((2, 64), dtype=jnp.bfloat16, name="heads")(jax.nn.gelu(h))
      return nn.Dense(64, dtype=jnp.bfloat16, name="lm_head")(h.reshape(*h.shape[:-2], 128))

  for rname in ("delayed", "current", "block", "nvfp4"):
    cases[f"convert_linen/{rname}"] = (lambda recipe=RECIPES[rname]: linen_two_steps(
        jax_fp8.convert.convert(Plain(), recipe), recipe, x, 1))

  class NnxPlain(nnx.Module):
    def __init__(self, rngs):
      self.up = nnx.Linear(128, 256, dtype=jnp.bfloat16, rngs=rngs)
      self.down = nnx.Linear(256, 128, dtype=jnp.bfloat16, rngs=rngs)

    def __call__(self, h):
      return self.down(jax.nn.gelu(self.up(h)))

  for rname in ("delayed", "block"):
    def convert_nnx_run(recipe=RECIPES[rname]):
      model = jax_fp8.convert.convert(NnxPlain(nnx.Rngs(2)), recipe)
      diff = nnx.DiffState(0, (nnx.Param, jax_fp8.nnx.Fp8State))
      loss, grads = nnx.jit(lambda m: nnx.value_and_grad(
          lambda m: jnp.mean(jnp.square(m(x).astype(jnp.float32))), argnums=diff)(m))(model)
      return loss, grads
    cases[f"convert_nnx/{rname}"] = convert_nnx_run
  return cases


def sharded_cases():
  """Per-tensor and NVFP4 amaxes reduced over a 2-device shard_map (data parallel)."""
  from jax.sharding import Mesh, PartitionSpec as P
  mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
  x = data(80, (2, 64, 256), jnp.bfloat16)
  kernel = data(81, (256, 128), scale=0.05)
  cases = {}
  for rname in ("delayed", "current", "nvfp4"):
    recipe = RECIPES[rname]

    def run(recipe=recipe):
      state = state_for(recipe, "linear")

      def local(kernel, state, xb):
        def loss(kernel, state):
          y = jax_fp8.linear(xb[0], kernel, state=state, recipe=recipe, amax_axis_name="data",
                             key=key_for(recipe))
          return jnp.sum(jnp.sin(y.astype(jnp.float32)))
        value, grads = jax.value_and_grad(loss, argnums=(0, 1))(kernel, state)
        return value[None], grads
      f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P("data")),
                                out_specs=(P("data"), P()), check_vma=False))
      return f(kernel, state, x)
    cases[f"shard_map/{rname}"] = run
  return cases


def all_cases():
  cases = dict(op_cases())
  for rname, recipe in RECIPES.items():
    for bias in (False, True):
      for norm in (None, "rmsnorm", "layernorm"):
        if norm == "layernorm" and not bias:
          continue
        cases[f"linear/{rname}/bias={bias}/norm={norm}"] = linear_case(
            rname, recipe, bias=bias, norm=norm)
    cases[f"linear/{rname}/split"] = linear_case(rname, recipe, bias=True, norm=None,
                                                 split=(128, 256))
    cases[f"linear/{rname}/f32"] = linear_case(rname, recipe, bias=True, norm=None,
                                               dtype=jnp.float32)
    cases[f"multi_linear/{rname}"] = multi_case(recipe, None)
    cases[f"multi_linear/{rname}/rmsnorm"] = multi_case(recipe, "rmsnorm")
    for act, norm, bias in (("swiglu", None, False), ("gelu", "rmsnorm", True),
                            ("geglu", "layernorm", True), ("silu", None, True)):
      cases[f"mlp/{rname}/{act}/norm={norm}/bias={bias}"] = mlp_case(recipe, act, norm, bias)
    # Below fp8_min_intensity: XLA in the compute dtype.
    low = type(recipe)(**{**{f: getattr(recipe, f) for f in recipe.__dataclass_fields__},
                          "fp8_min_intensity": 1e6})
    cases[f"linear/{rname}/below_intensity"] = linear_case(rname, low, bias=True, norm=None)
  for rname in CASTABLE:
    cases[f"cast_kernel/{rname}"] = cast_kernel_case(RECIPES[rname])
    for intensity in (0.0, 1e6):
      cases[f"fp8_weight/{rname}/intensity={intensity}"] = weights_case(RECIPES[rname],
                                                                         intensity)
  cases.update(sharded_cases())
  cases.update(small_model_cases())
  return cases


def host_cpu() -> str:
  """The processor's model name and widest vector extension (Linux's /proc/cpuinfo), or the
  platform's name where there is none."""
  try:
    with open("/proc/cpuinfo") as f:
      info = {k.strip(): v.strip() for k, v in (
          line.split(":", 1) for line in f.read().split("\n\n")[0].splitlines() if ":" in line)}
    flags = info["flags"].split()
    widest = next((v for v in ("avx512f", "avx2", "avx", "sse4_2") if v in flags), "")
    return f"{info['model name']} ({widest})"
  except (OSError, KeyError):
    return platform.processor() or platform.machine()


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", help="write the fingerprints to this JSON file")
  parser.add_argument("--compare", help="compare with the fingerprints in this JSON file")
  parser.add_argument("-k", default="", help="only the cases whose name contains this")
  args = parser.parse_args(argv)
  cpu = host_cpu()
  results = {}
  for name, fn in all_cases().items():
    if args.k in name:
      results[name] = digest(fn())
      print(f"{results[name][:16]}  {name}", flush=True)
  if args.out:
    with open(args.out, "w") as f:
      json.dump({"jax": jax.__version__, "cpu": cpu, "fingerprints": results}, f, indent=1,
                sort_keys=True)
      f.write("\n")
  if args.compare:
    with open(args.compare) as f:
      recorded = json.load(f)
    before = recorded["fingerprints"]
    if recorded.get("cpu") != cpu:
      print(f"recorded on {recorded.get('cpu', 'an unnamed host')!r}, compared on {cpu!r}: cases "
            "may differ by the host alone; record both trees on this machine")
    differ = sorted(n for n in results if n in before and before[n] != results[n])
    missing = sorted(n for n in before if n not in results and args.k in n)
    print(f"{len(results) - len(differ)} of {len(results)} cases identical; differ: "
          f"{differ or 'none'}; not run: {missing or 'none'}")
    return 1 if differ or missing else 0
  return 0


if __name__ == "__main__":
  sys.exit(main())
