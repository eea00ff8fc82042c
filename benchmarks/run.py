"""jax_fp8 benchmark suite: one process, whatever device exists.

Measures the device's ceilings first (copy bandwidth, BF16 GEMM rate), then per case our
path beside BF16 and the pure-JAX FP8 path, with ratios and achieved TB/s or TFLOP/s.
Prints a table and writes ``benchmarks/results/<gpu>-run.json`` (with ``--only``,
``<gpu>-run-<group>[-<group>...].json``).

    python -m benchmarks.run [--quick] [--out PATH]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import jax_fp8
from jax_fp8 import activations, norms, reference
from jax_fp8.recipes import CROSSOVER_INTENSITY

from . import block, block_scaled, peers
from .common import FAST_ACCUM, ceilings, environment, rand, write_results
from .timing import device_time

QUANT_SHAPES = [(8192, 8192), (16384, 4096)]
GEMM_SHAPES = [(8192, 8192, 8192), (16384, 4096, 14336), (16384, 14336, 4096),
               (16384, 4096, 4096), (4096, 1024, 4096)]  # (M, N, K)
QUICK_GEMM_SHAPES = [(256, 256, 256)]
BLOCK_LINEAR_SHAPES = [(16384, 4096, 14336), (16384, 14336, 4096), (8192, 8192, 8192)]
# Issue 48's Llama shapes, for jax_fp8's block-scaled kernels.
BLOCK_GEMM_SHAPES = GEMM_SHAPES[:4]
PDL_SHAPES = [(512, 4096, 4096), (4096, 4096, 4096)]
# Where FP8 stops paying: the linear at arithmetic intensities M*N*K / (M*K + K*N + M*N) from
# about 170 to 2000 (the GEMM's FLOPs per element the quantizers move).
CROSSOVER_SHAPES = [(4096, d, d) for d in (512, 1024, 1536, 2048, 3072, 4096)] + [
    (4096, 1024, 4096), (4096, 4096, 1024), (1024, 4096, 4096), (16384, 1024, 1024),
    (8192, 2048, 2048), (2048, 8192, 8192)]
# The per-tensor crossover that bench_crossover measures: FP8 below it is slower than BF16, so
# the "auto" linear runs BF16 there.
AUTO = jax_fp8.DelayedScaling(fp8_min_intensity=CROSSOVER_INTENSITY)
GROUPS = ["quantize", "fused", "mx_nvfp4", "gemm", "linear", "block_step", "block_scaling",
          "block_gemm", "crossover"]  # --only


def bench_quantize(quick, ceil):
  rows = []
  for shape in ([(512, 512)] if quick else QUANT_SHAPES):
    x = rand(2, shape, jnp.bfloat16, 3.0)
    s = jnp.float32(0.01)
    nbytes = 3 * x.size  # bf16 read + e4m3 written
    ours = device_time(lambda x: jax_fp8.quantize(x, s), x)
    jnp_t = device_time(lambda x: reference.quantize(x, s), x)
    ring = jax_fp8.quantize_delayed(x, jax_fp8.ScaleRing.create(16)).ring  # past step 0
    ring_t = device_time(lambda x, r: jax_fp8.quantize_delayed(x, r).tensor, x, ring)
    for name, t in (("quantize", ours), ("quantize_delayed", ring_t), ("jnp quantize", jnp_t)):
      rows.append({"case": name, "shape": list(shape), "us": t * 1e6, "TBps": nbytes / t / 1e12,
                   "of_copy": nbytes / t / 1e12 / ceil["copy_TBps"],
                   "vs_jnp": jnp_t / t})
    # Cast-transpose: bf16 read, two FP8 copies written (+ dbias, negligible bytes).
    nbytes = 4 * x.size
    ref_ct = lambda x: (reference.quantize(x, s).data.T, reference.quantize(x, s))
    ref_ct_dbias = lambda x: ref_ct(x) + (jnp.sum(x, axis=0, dtype=jnp.float32),)

    def ct(with_dbias):
      def run(x, r):
        out = jax_fp8.cast_transpose_delayed(x, r, with_dbias=with_dbias)
        return (out.tensor,) + ((out.dbias,) if with_dbias else ())
      return run

    for name, fn, ref in (("cast_transpose", ct(False), ref_ct),
                          ("cast_transpose+dbias", ct(True), ref_ct_dbias)):
      t = device_time(fn, x, ring)
      tj = device_time(ref, x)
      rows.append({"case": name, "shape": list(shape), "us": t * 1e6, "TBps": nbytes / t / 1e12,
                   "of_copy": nbytes / t / 1e12 / ceil["copy_TBps"], "jnp_us": tj * 1e6,
                   "vs_jnp": tj / t})
    # x in three parts, as a projection with a split output (q / k / v) hands its gradients
    # to the backward: read where they lie, against XLA's concatenation first ("unfused").
    c = shape[1]
    parts = (x[:, :c // 4], x[:, c // 4:3 * c // 4], x[:, 3 * c // 4:])
    t = device_time(ct(True), parts, ring)
    tu = device_time(lambda xs, r: ct(True)(jnp.concatenate(xs, axis=1), r), parts, ring)
    rows.append({"case": "cast_transpose+dbias of 3 parts", "shape": list(shape), "us": t * 1e6,
                 "TBps": nbytes / t / 1e12, "of_copy": nbytes / t / 1e12 / ceil["copy_TBps"],
                 "unfused_us": tu * 1e6, "vs_unfused": tu / t})
  return rows


def bench_fused(quick, ceil):
  """The fused cast-transposes, per-tensor and block-scaled (``bench_fused_sources``)."""
  rows = []
  for shape in ([(512, 512)] if quick else QUANT_SHAPES):
    x = rand(2, shape, jnp.bfloat16, 3.0)
    ring = jax_fp8.quantize_delayed(x, jax_fp8.ScaleRing.create(16)).ring  # past step 0
    rows += bench_fused_sources(x, ring, ceil) + bench_fused_sources(x, None, ceil, block=True)
  return rows


def _cast_transpose_op(module, name, block):
  """``module``'s cast-transpose ``name`` (per-tensor: "cast_transpose_delayed",
  "activation_cast_transpose", ...) as ``f(*inputs, r, **kw)``: the per-tensor op on ring r
  (its ``Quantized`` tensor: FP8 copies, scale and amax), or with ``block`` its 1 x 128 group
  twin, which takes no ring."""
  if not block:
    return lambda *a, **kw: getattr(module, name)(*a, **kw).tensor
  group = getattr(module, name.replace("cast_transpose", "group_cast_transpose")
                  .replace("_delayed", ""))
  return lambda *a, **kw: group(*a[:-1], **kw)


def bench_fused_sources(x, ring, ceil, block=False):
  """The fused cast-transposes (an MLP's SwiGLU and GELU, forward and gradient, x's shape
  [R, C] for the activation; the RMSNorm and LayerNorm of x with their row statistics by XLA)
  against the unfused path jax_fp8 takes without them (XLA's fusion writes the activation, its
  gradient or the norm in bf16, our cast-transpose reads it) and the pure-jnp one; per-tensor,
  or with ``block`` the 1 x 128 group cast-transposes of block scaling. Bytes: SwiGLU's
  forward reads [gate | up] and writes two FP8 copies (6 bytes an element of x); its gradient
  reads dh and [gate | up] and writes two FP8 copies of [dgate | dup] (10); GELU's forward 4
  and gradient 6 (one pre-activation, one output); a norm reads x and writes two FP8 copies
  (4: the statistics' own read of x is not counted, so "of_copy" is against one read); block
  scaling adds its two f32 scales per 128 elements written."""
  y = jnp.concatenate([x, x[::-1]], axis=1)
  dh = x[::-1]
  gamma = jnp.linspace(0.5, 1.5, x.shape[1], dtype=jnp.float32)
  beta = jnp.linspace(-0.5, 0.5, x.shape[1], dtype=jnp.float32)
  plain, act, act_grad, norm_ct = (_cast_transpose_op(jax_fp8, name, block) for name in (
      "cast_transpose_delayed", "activation_cast_transpose", "activation_grad_cast_transpose",
      "norm_cast_transpose"))
  ref_act, ref_grad, ref_norm = (_cast_transpose_op(reference, name, block) for name in (
      "activation_cast_transpose", "activation_grad_cast_transpose", "norm_cast_transpose"))

  def norm_cases(norm, b):
    normalized = lambda x: norms.normalize(x, gamma, b, norm=norm,  # noqa: E731
                                           epsilon=1e-6).astype(x.dtype)
    stats = lambda x: norms.stats(x, norm, 1e-6)  # noqa: E731
    return (f"{norm}_cast_transpose", 4, 1, (x,),
            lambda x, r: norm_ct(x, stats(x), gamma, b, r, norm=norm),
            lambda x, r: plain(normalized(x), r),
            lambda x, r: ref_norm(x, stats(x), gamma, b, r, norm=norm))

  def act_cases(activation, y):
    """The forward and the gradient; y is [gate | up] for a gated activation."""
    gated = y.shape[1] > x.shape[1]
    applied = lambda y: activations.apply(y, activation).astype(y.dtype)  # noqa: E731
    grad = lambda dh, y: activations.grad(dh, y, activation).astype(y.dtype)  # noqa: E731
    return ((f"{activation}_cast_transpose", 6 if gated else 4, 1, (y,),
             lambda y, r: act(y, r, activation=activation),
             lambda y, r: plain(applied(y), r), lambda y, r: ref_act(y, r, activation=activation)),
            (f"{activation}_grad_cast_transpose", 10 if gated else 6, 2 if gated else 1,
             (dh, y), lambda dh, y, r: act_grad(dh, y, r, activation=activation),
             lambda dh, y, r: plain(grad(dh, y), r),
             lambda dh, y, r: ref_grad(dh, y, r, activation=activation)))
  cases = (*act_cases("swiglu", y), *act_cases("gelu", x), norm_cases("rmsnorm", None),
           norm_cases("layernorm", beta))
  rows = []
  for name, per_elem, written, args, fused, unfused, jnp_path in cases:
    t, tu, tj = (device_time(fn, *args, ring) for fn in (fused, unfused, jnp_path))
    nbytes = per_elem * x.size + (written * x.size // 128 * 8 if block else 0)
    rows.append({"case": name.replace("cast_transpose", "group_cast_transpose") if block
                 else name, "shape": list(x.shape), "us": t * 1e6,
                 "TBps": nbytes / t / 1e12, "of_copy": nbytes / t / 1e12 / ceil["copy_TBps"],
                 "unfused_us": tu * 1e6, "vs_unfused": tu / t, "jnp_us": tj * 1e6,
                 "vs_jnp": tj / t})
  return rows


def bench_gemm(quick, ceil):
  rows = []
  for m, n, k in (QUICK_GEMM_SHAPES if quick else GEMM_SHAPES):
    a = rand(3, (m, k), jnp.float8_e4m3fn)
    b = rand(4, (n, k), jnp.float8_e4m3fn)
    one = jnp.float32(1)
    flops = 2 * m * n * k
    ours = device_time(lambda a, b: jax_fp8.gemm(a, b, one, one), a, b)
    fast = device_time(lambda a, b: jax_fp8.gemm(a, b, one, one, fast_accum=True), a, b)
    xla = device_time(lambda a, b: jax.lax.dot_general(
        a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.bfloat16), a, b)
    a16, b16 = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
    bf16 = device_time(lambda a, b: jax.lax.dot_general(a, b, (((1,), (1,)), ((), ()))), a16, b16)
    rows.append({"case": "gemm", "shape": [m, n, k], "us": ours * 1e6,
                 "TFLOPs": flops / ours / 1e12, "fast_accum_TFLOPs": flops / fast / 1e12,
                 "xla_fp8_TFLOPs": flops / xla / 1e12,
                 "bf16_TFLOPs": flops / bf16 / 1e12, "vs_xla_fp8": xla / ours, "vs_bf16": bf16 / ours,
                 **accumulation_errors(a, b)})
  return rows


def accumulation_errors(a, b):
  """Normwise relative error of each FP8 GEMM's f32 output against an f32 GEMM of the same
  (exactly representable) operands: the accumulation error alone, no quantization in it. The
  upcast operands pass an optimization barrier, or XLA would rewrite the f32 dot back into
  an FP8 cuBLASLt GEMM (it did on the H200: an error of exactly 0)."""
  dims = (((1,), (1,)), ((), ()))
  want = jax.jit(lambda a, b: jax.lax.dot_general(
      *jax.lax.optimization_barrier((a.astype(jnp.float32), b.astype(jnp.float32))), dims,
      precision=jax.lax.Precision.HIGHEST))(a, b)
  one = jnp.float32(1)
  got = {"exact_accum_err": jax_fp8.gemm(a, b, one, one, out_dtype=jnp.float32),
         "fast_accum_err": jax_fp8.gemm(a, b, one, one, out_dtype=jnp.float32, fast_accum=True),
         "xla_fp8_err": jax.jit(lambda a, b: jax.lax.dot_general(
             a, b, dims, preferred_element_type=jnp.float32))(a, b)}
  norm = float(jnp.linalg.norm(want))
  return {name: float(jnp.linalg.norm(d - want)) / norm for name, d in got.items()}


def fwd_bwd(f):
  """``(g, x, w, b, *extra) -> (y, grads)`` of ``f`` with output cotangent ``g``. Every array
  is an argument: one captured by the closure would be a constant that XLA folds work on."""
  def run(g, x, w, b, *extra):
    y, vjp = jax.vjp(f, x, w, b, *extra)
    return y, vjp(g)
  return run


def linear_problem(m, n, k):
  """bf16 ``(g, x, w, b)`` of a linear [M, K] x [K, N] and its per-tensor state at steady
  state: one step taken, so no ring is on its first (current-scaling) step."""
  x = rand(5, (m, k), jnp.bfloat16)
  w = rand(6, (k, n), jnp.bfloat16, k**-0.5)
  b = rand(7, (n,), jnp.bfloat16)
  g = rand(8, (m, n), jnp.bfloat16)
  state = jax_fp8.LinearState.create()
  _, vjp = jax.vjp(lambda s: jax_fp8.linear(x, w, b, state=s), state)
  return g, x, w, b, jax_fp8.update_state(state, vjp(g)[0])


def bench_linear(quick, ceil):
  rows = []
  for m, n, k in (QUICK_GEMM_SHAPES if quick else GEMM_SHAPES):
    g, x, w, b, state = linear_problem(m, n, k)
    ours_fn = fwd_bwd(lambda x, w, b, s: jax_fp8.linear(x, w, b, state=s))
    ours = device_time(ours_fn, g, x, w, b, state)
    auto = device_time(fwd_bwd(lambda x, w, b, s: jax_fp8.linear(x, w, b, state=s, recipe=AUTO)),
                       g, x, w, b, state)
    fast = {name: device_time(fwd_bwd(lambda x, w, b, s, r=recipe: jax_fp8.linear(
        x, w, b, state=s, recipe=r)), g, x, w, b, state) for name, recipe in FAST_ACCUM.items()}
    bf16 = device_time(fwd_bwd(peers.bf16_linear), g, x, w, b)
    xla8 = device_time(fwd_bwd(peers.xla_fp8_linear), g, x, w, b)
    flops = 6 * m * n * k
    mem = peak_bytes(ours_fn, g, x, w, b, state) / peak_bytes(fwd_bwd(peers.bf16_linear), g, x,
                                                                w, b)
    rows.append({"case": "linear fwd+bwd", "shape": [m, n, k], "us": ours * 1e6,
                 "peak_mem_vs_bf16": mem,
                 "TFLOPs": flops / ours / 1e12, "bf16_us": bf16 * 1e6, "xla_fp8_us": xla8 * 1e6,
                 "vs_bf16": bf16 / ours, "vs_xla_fp8": xla8 / ours,
                 "auto_fp8": bool(intensity(m, n, k) >= AUTO.fp8_min_intensity),
                 "auto_vs_bf16": bf16 / auto,
                 **{f"{name}_vs_xla_fp8": xla8 / t for name, t in fast.items()},
                 **{f"{name}_vs_bf16": bf16 / t for name, t in fast.items()}})
  return rows


def intensity(m, n, k):
  """A linear's GEMM FLOPs / 2 per element of its three operands (x, kernel, output)."""
  return m * n * k / (m * k + k * n + m * n)


def bench_crossover(quick):
  """FP8 linear fwd+bwd (per-tensor, and block-scaled) against BF16 across arithmetic
  intensities: where the quantization passes cost more than the FP8 GEMMs save."""
  rows = []
  for m, n, k in (QUICK_GEMM_SHAPES if quick else CROSSOVER_SHAPES):
    g, x, w, b, state = linear_problem(m, n, k)
    ours = device_time(fwd_bwd(lambda x, w, b, s: jax_fp8.linear(x, w, b, state=s)),
                       g, x, w, b, state)
    block_s = device_time(fwd_bwd(lambda x, w, b: jax_fp8.linear(
        x, w, b, recipe=jax_fp8.BlockScaling())), g, x, w, b)
    bf16 = device_time(fwd_bwd(peers.bf16_linear), g, x, w, b)
    rows.append({"case": "linear crossover", "shape": [m, n, k], "us": ours * 1e6,
                 "bf16_us": bf16 * 1e6, "block_us": block_s * 1e6,
                 "intensity": float(intensity(m, n, k)), "vs_bf16": bf16 / ours,
                 "block_vs_bf16": bf16 / block_s})
  return rows


def bench_memory(quick):
  """Peak device memory of a train step through a stack of linears, FP8 (per-tensor and block
  scaling) against BF16. Between forward and backward BF16 keeps each layer's bf16 input, FP8
  keeps its FP8 transposed copy: the saving a single layer (whose input is an argument, live
  either way) cannot show."""
  m, d, layers = (256, 256, 4) if quick else (16384, 4096, 4)
  x = rand(9, (m, d), jnp.bfloat16)
  ws = [rand(10 + i, (d, d), jnp.bfloat16, d**-0.5) for i in range(layers)]
  states = [jax_fp8.LinearState.create() for _ in range(layers)]

  def step(layer):
    def loss(ws, states):
      y = x
      for w, s in zip(ws, states):
        y = layer(y, w, s)
      return jnp.mean(jnp.square(y.astype(jnp.float32)))
    return lambda ws, states: jax.grad(loss, argnums=(0, 1))(ws, states)

  fp8 = peak_bytes(step(lambda y, w, s: jax_fp8.linear(y, w, state=s)), ws, states)
  block_bytes = peak_bytes(step(lambda y, w, s: jax_fp8.linear(
      y, w, recipe=jax_fp8.BlockScaling())), ws, states)
  bf16 = peak_bytes(step(lambda y, w, s: y @ w), ws, states)
  return [{"case": "linear stack peak memory", "shape": [m, d, layers], "fp8_MiB": fp8 / 2**20,
           "bf16_MiB": bf16 / 2**20, "peak_mem_vs_bf16": fp8 / bf16,
           "block_peak_mem_vs_bf16": block_bytes / bf16}]


def bench_block(quick, ceil):
  """Transformer block train step (forward, backward, FP8 state update), FP8 vs BF16; FP8 also
  with the FAST_ACCUM recipes."""
  cfg = block.QUICK_BLOCK if quick else block.BLOCK
  recipes = {"fp8": jax_fp8.DelayedScaling(), "bf16": None, **FAST_ACCUM}
  times = {}
  for name, recipe in recipes.items():
    step, params, collections, x = block.setup(recipe, **cfg)
    times[name] = device_time(step, params, collections, x, iters=5 if quick else 10)
  d, f, t = cfg["d_model"], cfg["ffn"], cfg["batch"] * cfg["seq"]
  flops = 6 * t * (4 * d * d + 3 * d * f)  # the linears only
  return [{"case": "block train step", "shape": [cfg["batch"], cfg["seq"], d, f],
           "us": times["fp8"] * 1e6, "bf16_us": times["bf16"] * 1e6,
           "linear_TFLOPs": flops / times["fp8"] / 1e12, "vs_bf16": times["bf16"] / times["fp8"],
           **{f"{name}_vs_bf16": times["bf16"] / times[name] for name in FAST_ACCUM}}]


def peak_bytes(fn, *args):
  """Device bytes XLA plans for one call: arguments, outputs and temporaries (the compiled
  program's memory analysis)."""
  m = jax.jit(fn).lower(*args).compile().memory_analysis()
  return m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes


def print_table(results):
  c = results["ceilings"]
  print(f"\n{results['env']['device']}  jax {results['env']['jax']}  {results['env']['date']}")
  print(f"ceilings: copy {c['copy_TBps']:.2f} TB/s, bf16 GEMM {c['bf16_gemm_TFLOPs']:.0f} TFLOP/s"
        f" (timing loop control {c['timing_loop_overhead_us']:.1f} us/iteration, cancelled)")
  w = max([len(r["case"]) + 2 for r in results["rows"]] + [28])
  print(f"{'case':<{w}}{'shape':<20}{'us':>10}  figures")
  for r in results["rows"]:
    figs = "  ".join([f"{k}={v:.3g}" for k, v in r.items()
                      if k not in ("case", "shape", "us") and isinstance(v, float)]
                     + ([f"kernel={r['kernel']}"] if "kernel" in r else []))
    us = f"{r['us']:>10.1f}" if "us" in r else f"{'-':>10}"
    print(f"{r['case']:<{w}}{'x'.join(map(str, r['shape'])):<20}{us}  {figs}")


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--quick", action="store_true", help="tiny shapes (a smoke run on CPU)")
  p.add_argument("--out", help="JSON path (default benchmarks/results/<gpu>-run[-<group>...]"
                               ".json)")
  p.add_argument("--only", nargs="+", choices=GROUPS, default=GROUPS,
                 help="case groups to run (default: all)")
  args = p.parse_args(argv)
  env = environment()
  ceil = ceilings(args.quick)
  q = args.quick
  groups = {
      "quantize": lambda: bench_quantize(q, ceil),
      "fused": lambda: bench_fused(q, ceil),
      "mx_nvfp4": lambda: block_scaled.bench_mx_nvfp4([(512, 512)] if q else QUANT_SHAPES,
                                                     rand, ceil),
      "gemm": lambda: bench_gemm(q, ceil),
      "linear": lambda: bench_linear(q, ceil) + bench_memory(q),
      "block_step": lambda: bench_block(q, ceil),
      "block_scaling": lambda: (
          block_scaled.bench_quantizers([(512, 512)] if q else QUANT_SHAPES, rand, ceil) +
          block_scaled.bench_gemm(QUICK_GEMM_SHAPES if q else GEMM_SHAPES, rand) +
          block_scaled.bench_linear(QUICK_GEMM_SHAPES if q else BLOCK_LINEAR_SHAPES,
                                    linear_problem, fwd_bwd) +
          block_scaled.bench_pdl(QUICK_GEMM_SHAPES if q else PDL_SHAPES, rand)),
      "block_gemm": lambda: block_scaled.bench_kernels(
          QUICK_GEMM_SHAPES if q else BLOCK_GEMM_SHAPES, rand),
      "crossover": lambda: bench_crossover(q),
  }
  rows = [r for g in GROUPS if g in args.only for r in groups[g]()]
  results = {"env": env, "ceilings": ceil, "rows": rows}
  print_table(results)
  only = "" if set(args.only) == set(GROUPS) else "".join(f"-{g}" for g in GROUPS
                                                          if g in args.only)
  write_results(results, args.out, f"-run{only}")


if __name__ == "__main__":
  main()
