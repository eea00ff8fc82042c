"""Grouped FP8 GEMMs of a mixture of experts against BF16 ragged_dot and the dense FP8 GEMM.

Issue 47's item 4, the GEMMs alone: the forward, dgrad and wgrad of one expert linear at
Mixtral-like and DeepSeek-V3-like shapes, balanced and skewed routing, against BF16
``jax.lax.ragged_dot`` and the dense FP8 GEMM rate of the same run.

    python -m benchmarks.moe [--tokens 16384] [--cases mixtral deepseek_v3]
        [--linears gate_up down] [--routings balanced skewed] [--gemms forward dgrad wgrad]
        [--wgrad-dtype float32|bfloat16] [--peer-max-ms 500] [--seed 0] [--quick] [--out PATH]

Cases (``CASES``, ``benchmarks.moe_cases``): ``mixtral`` (d_model 4096, expert ffn 14336, 8
experts, top 2) and ``deepseek_v3`` (d_model 7168, expert ffn 2048, 256 experts, top 8). Each
expert has two linears: ``gate_up`` (K = d_model, N = 2 ffn: gate and up in one GEMM, as a gated
expert MLP runs them) and ``down`` (K = ffn, N = d_model). ``--tokens`` tokens each routed to
top_k experts give tokens * top_k real rows. Routing (``route``, seeded): ``balanced``, every
expert the same rows; ``skewed``, each token's top_k distinct experts drawn with half the
probability on a tenth of the experts (Gumbel top-k: sampling without replacement, so the hot
experts' share of the rows is what the JSON's ``hot_share`` says, at most a half). Each group is
padded to a multiple of 16 rows (``grouped_gemm_wgrad``'s alignment rule; the padding rows zero)
inside a static capacity of tokens * top_k + 15 * experts rows, the most padding can take, so
one compilation serves every routing; the rows past the groups are zero.

The three GEMMs of the linear x [M, K] @ w[g] [K, N] (HYBRID: x and w e4m3, the gradient g e5m2;
``b_scale`` one per expert in forward and dgrad), each timed on the device
(``timing.device_time``) beside its BF16 peer on the same group sizes (traced, as a layer
passes them):

- ``forward``: ``jax_fp8.grouped_gemm(x [M, K], w_t [G, N, K])`` -> [M, N] bf16; BF16
  ``jax.lax.ragged_dot(x, w [G, K, N])``.
- ``dgrad``: ``grouped_gemm(g [M, N], w [G, K, N])`` -> [M, K] bf16; BF16 ``ragged_dot_general``
  contracting g with w's N, as autodiff of ``ragged_dot`` runs it.
- ``wgrad``: ``grouped_gemm_wgrad(x_t [K, M], g_t [N, M])`` -> [G, K, N] in ``--wgrad-dtype``
  (float32: what a layer with f32 master weights asks for); BF16 ``ragged_dot_general`` with
  the contraction ragged, on x and g as they are, into the same dtype.

TFLOP/s count the real rows only (2 * real rows * N * K), not the padding. The BF16 peer runs
as XLA compiles it by default (``bf16_*``) and, on a GPU, for forward and dgrad also with
``xla_gpu_experimental_use_ragged_dot_fusion`` (``bf16_cudnn_*``: cuDNN's grouped GEMM, XLA's
only native ragged GEMM on Hopper). Each records the path XLA took (``*_path``): ``cudnn``,
``ragged-dot`` (kept as one op), or ``dense``, XLA's rewrite into one dense dot of every row
against every group (G times the FLOPs); a dense path whose G-fold work would take more than
``--peer-max-ms`` a call at this run's dense BF16 rate is not timed (``*_skipped`` says why), and
a peer that fails (e.g. out of memory) records ``*_error``. Limits measured in the same run, at
the GEMM's shape with the real rows and no groups: the dense per-tensor FP8 GEMM
(``jax_fp8.gemm``, same operand dtypes) and the dense BF16 GEMM (``dot_general``).

Writes ``benchmarks/results/<gpu>-moe.json`` (or ``--out``): ``env`` (GPU, versions, date),
``ceilings`` (copy bandwidth, BF16 GEMM rate), ``config`` (tokens, cases, seed, wgrad dtype,
peer limit), ``routing`` (per case and routing: the real rows per expert, their padded sizes,
capacity, max / mean group, ``hot_share``: the busiest tenth of the experts' share of the rows)
and ``rows``, one per case, linear, routing and GEMM: ``shape`` (the GEMM's [M, N, K] with the
real rows on the grouped axis: M for forward and dgrad, K for wgrad), ``groups``, ``capacity``,
``us``, ``TFLOPs``, ``dense_fp8_TFLOPs``, ``of_dense_fp8`` (FP8 grouped over dense FP8 rate),
``dense_bf16_TFLOPs``, ``bf16_us``, ``bf16_TFLOPs``, ``vs_bf16`` (BF16 time over FP8's), the
``bf16_cudnn_`` counterparts, and for skewed rows ``vs_balanced`` (their TFLOP/s over the balanced
row's). Exits 1 if an FP8 case failed (after writing the JSON with its ``error``).
"""

from __future__ import annotations

import argparse
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

import jax_fp8
from jax_fp8.formats import ROW_ALIGN

from .common import ceilings, environment
from .moe_cases import (CASES, CUDNN_RAGGED_DOT, QUICK_CASES, QUICK_TOKENS, TOKENS, Case,
                        error_text, finish, time_ragged)
from .timing import device_time


LINEARS = ("gate_up", "down")
ROUTINGS = ("balanced", "skewed")
GEMMS = ("forward", "dgrad", "wgrad")
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


def route(routing: str, tokens: int, case: Case, seed: int) -> np.ndarray:
  """[G] int64: the real rows each expert gets when ``tokens`` tokens each go to ``top_k``
  distinct experts. ``balanced``: the same for every expert (the remainder to the first).
  ``skewed``: each token's experts drawn without replacement (Gumbel top-k), half the
  probability spread over a tenth of the experts (at least one), chosen by ``seed``."""
  g, k = case.experts, case.top_k
  if routing == "balanced":
    return tokens * k // g + (np.arange(g) < tokens * k % g)
  rng = np.random.default_rng(seed)
  hot = rng.permutation(g)[:tenth(g)]
  p = np.full(g, 0.5 / max(1, g - len(hot)))
  p[hot] = 0.5 / len(hot) if len(hot) < g else 1.0 / g
  keys = np.log(p) + rng.gumbel(size=(tokens, g))  # [T, G]
  chosen = np.argpartition(-keys, k - 1, axis=1)[:, :k]  # [T, top_k], distinct per token
  return np.bincount(chosen.ravel(), minlength=g)


def tenth(experts: int) -> int:
  """How many experts make "a tenth" of them: at least one."""
  return max(1, round(experts / 10))


@dataclasses.dataclass(frozen=True)
class Groups:
  """Real rows per group, each group padded to ``ROW_ALIGN`` rows, inside ``capacity`` rows."""

  sizes: np.ndarray  # [G] real rows
  capacity: int

  @property
  def padded(self) -> np.ndarray:  # [G], what group_sizes holds
    return -(-self.sizes // ROW_ALIGN) * ROW_ALIGN

  def real_rows(self) -> np.ndarray:
    """[capacity] bool: the rows holding a token (not padding, not past the groups)."""
    mask = np.zeros(self.capacity, bool)
    for start, size in zip(np.cumsum(self.padded) - self.padded, self.sizes):
      mask[start:start + size] = True
    return mask

  def summary(self) -> dict:
    busiest = np.sort(self.sizes)[::-1][:tenth(len(self.sizes))]
    return {"sizes": self.sizes.tolist(), "padded": self.padded.tolist(),
            "capacity": self.capacity, "rows": int(self.sizes.sum()),
            "max_group": int(self.sizes.max()), "mean_group": float(self.sizes.mean()),
            "hot_share": float(busiest.sum() / self.sizes.sum())}


def capacity(tokens: int, case: Case) -> int:
  """The rows a layer allocates: every token's rows plus the most padding the groups can need."""
  rows = tokens * case.top_k + case.experts * (ROW_ALIGN - 1)
  return -(-rows // ROW_ALIGN) * ROW_ALIGN


def _normal(seed, shape, scale=1.0):
  """bf16 normal values, drawn in bf16 (an f32 draw of a DeepSeek-V3 expert stack is 30 GB)."""
  return jax.random.normal(jax.random.key(seed), shape, jnp.bfloat16) * jnp.bfloat16(scale)


@dataclasses.dataclass(frozen=True)
class Gemm:
  """One GEMM of the expert linear: its [M, N] output x K contraction with the real rows on
  the grouped axis (``shape``), operand dtypes and output dtype."""

  name: str
  shape: tuple[int, int, int]
  a_dtype: object
  b_dtype: object
  out_dtype: object

  @property
  def flops(self) -> int:
    return 2 * math.prod(self.shape)


def gemm_spec(name: str, k: int, n: int, rows: int, wgrad_dtype) -> Gemm:
  """The GEMM ``name`` of a linear [rows, k] @ [k, n]: forward x @ w, dgrad g @ w.T, wgrad
  x.T @ g (rows the contraction)."""
  return {"forward": Gemm(name, (rows, n, k), E4M3, E4M3, jnp.bfloat16),
          "dgrad": Gemm(name, (rows, k, n), E5M2, E4M3, jnp.bfloat16),
          "wgrad": Gemm(name, (k, n, rows), E4M3, E5M2, wgrad_dtype)}[name]


def _dense_tn(out_dtype):
  return lambda a, b: jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())),
                                          preferred_element_type=out_dtype)


def dense_limits(spec: Gemm) -> dict:
  """The dense FP8 (``jax_fp8.gemm``, per-tensor) and BF16 rates at ``spec``'s shape."""
  m, n, k = spec.shape
  a, b = _normal(20, (m, k)), _normal(21, (n, k), k ** -0.5)
  one = jnp.float32(1)
  fp8 = device_time(lambda a, b: jax_fp8.gemm(a, b, one, one, out_dtype=spec.out_dtype),
                    a.astype(spec.a_dtype), b.astype(spec.b_dtype))
  bf16 = device_time(_dense_tn(spec.out_dtype), a, b)
  return {"dense_fp8_TFLOPs": spec.flops / fp8 / 1e12,
          "dense_bf16_TFLOPs": spec.flops / bf16 / 1e12}


def operands(spec: Gemm, k: int, n: int, groups: Groups):
  """``(fp8_fn, fp8_args, bf16_fn, bf16_args)`` of ``spec`` over ``groups``: the FP8 op and
  its BF16 ragged-dot peer on the same values, every array an argument (a captured one would be
  a constant for XLA to fold)."""
  g = len(groups.sizes)
  real = jnp.asarray(groups.real_rows())[:, None]
  sizes = jnp.asarray(groups.padded, jnp.int32)
  x = jnp.where(real, _normal(1, (groups.capacity, k)), 0)  # [M, K], zero off the real rows
  dy = jnp.where(real, _normal(2, (groups.capacity, n)), 0)  # [M, N]
  one, per_expert = jnp.float32(1), jnp.linspace(0.5, 1.5, g, dtype=jnp.float32)
  if spec.name == "wgrad":
    dn = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(((0,), (0,)), ((), ())),
                                           lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
    return (lambda a, b, gs: jax_fp8.grouped_gemm_wgrad(a, b, one, one, gs,
                                                        out_dtype=spec.out_dtype),
            (x.T.astype(E4M3), dy.T.astype(E5M2), sizes),
            lambda a, b, gs: jax.lax.ragged_dot_general(a, b, gs, dn,
                                                        preferred_element_type=spec.out_dtype),
            (x, dy, sizes))
  w = _normal(3, (g, k, n), k ** -0.5)  # [G, K, N]
  fp8 = lambda a, b, s, gs: jax_fp8.grouped_gemm(a, b, one, s, gs)  # noqa: E731
  if spec.name == "forward":
    return (fp8, (x.astype(E4M3), jnp.swapaxes(w.astype(E4M3), 1, 2), per_expert, sizes),
            jax.lax.ragged_dot, (x, w, sizes))
  dn = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(((1,), (2,)), ((), ())),
                                         lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
  return (fp8, (dy.astype(E5M2), w.astype(E4M3), per_expert, sizes),
          lambda a, b, gs: jax.lax.ragged_dot_general(a, b, gs, dn), (dy, w, sizes))


def time_peer(prefix: str, fn, args, options, spec: Gemm, groups: Groups, dense_bf16: float,
              max_s: float, fp8_us: float | None, timed_path: str | None = None) -> dict:
  """The BF16 peer's figures under ``prefix`` (``moe_cases.time_ragged``'s: its XLA path, µs,
  TFLOP/s of the real rows, or why it was skipped or failed) and the FP8 op's speedup over it.
  XLA's dense rewrite multiplies every row of the capacity by every group's matrix."""
  dense = spec.flops * len(groups.sizes) * groups.capacity / groups.sizes.sum()
  peer = time_ragged(fn, args, options, spec.flops, dense, dense_bf16, max_s, timed_path)
  row = {f"{prefix}_{k}": v for k, v in peer.items()}
  if fp8_us is not None and "us" in peer:
    row[f"vs_{prefix}"] = peer["us"] / fp8_us
  return row


def bench_gemm(spec: Gemm, k: int, n: int, groups: Groups, limits: dict, max_s: float) -> dict:
  """One row: the FP8 grouped GEMM of ``spec`` over ``groups`` and its BF16 peers."""
  fp8_fn, fp8_args, bf16_fn, bf16_args = operands(spec, k, n, groups)
  row = {"shape": list(spec.shape), "groups": len(groups.sizes), "capacity": groups.capacity}
  try:
    t = device_time(fp8_fn, *fp8_args)
    row.update({"us": t * 1e6, "TFLOPs": spec.flops / t / 1e12, **limits,
                "of_dense_fp8": spec.flops / t / 1e12 / limits["dense_fp8_TFLOPs"]})
  except Exception as e:  # noqa: BLE001 (recorded; the run exits 1)
    row.update({"error": error_text(e), **limits})
  del fp8_args
  peers = [("bf16", None)]
  if jax.default_backend() == "gpu" and spec.name != "wgrad":
    peers.append(("bf16_cudnn", CUDNN_RAGGED_DOT))
  for prefix, options in peers:
    row.update(time_peer(prefix, bf16_fn, bf16_args, options, spec, groups,
                         limits["dense_bf16_TFLOPs"], max_s, row.get("us"),
                         row.get("bf16_path") if options else None))
  return row


def run(cases: dict, tokens: int, linears, routings, gemms, wgrad_dtype, max_s: float,
        seed: int) -> tuple[dict, list[dict]]:
  """The routing summaries and the rows, printed as they come."""
  routing_info, rows = {}, []
  for case_name, case in cases.items():
    cap = capacity(tokens, case)
    layouts = {r: Groups(route(r, tokens, case, seed), cap) for r in routings}
    routing_info[case_name] = {r: g.summary() for r, g in layouts.items()}
    for linear in linears:
      k, n = case.linear(linear)
      for gemm in gemms:
        spec = gemm_spec(gemm, k, n, tokens * case.top_k, wgrad_dtype)
        limits = dense_limits(spec)
        for routing, groups in layouts.items():
          row = {"case": case_name, "linear": linear, "routing": routing, "gemm": gemm,
                 **bench_gemm(spec, k, n, groups, limits, max_s)}
          balanced = next((r for r in rows if r["routing"] == "balanced" and all(
              r[f] == row[f] for f in ("case", "linear", "gemm"))), None)
          if routing != "balanced" and balanced and "TFLOPs" in balanced and "TFLOPs" in row:
            row["vs_balanced"] = row["TFLOPs"] / balanced["TFLOPs"]
          rows.append(row)
          print_row(row)
  return routing_info, rows


def _fmt(row, key, spec=None):
  """``row[key]`` formatted (TFLOP/s: no decimals from 100 up, three figures below), or "-"."""
  if key not in row:
    return "-"
  v = row[key]
  return format(v, spec) if spec else f"{v:.0f}" if v >= 100 else f"{v:.3g}"


def print_row(row: dict) -> None:
  """One table line: the GEMM, its FP8 time and rate, the peers' rates and the ratios."""
  label = f"{row['case']} {row['linear']} {row['routing']} {row['gemm']}"

  def peer(p):  # its TFLOP/s, or why none, and its XLA path
    rate = (_fmt(row, f"{p}_TFLOPs") if f"{p}_TFLOPs" in row else "skip" if f"{p}_skipped"
            in row else "err" if f"{p}_error" in row else "-")
    return f"{rate} ({row.get(f'{p}_path', '-')})"
  print(f"{label:<38}{'x'.join(map(str, row['shape'])):<20}{_fmt(row, 'us', '.1f'):>10} "
        f"{_fmt(row, 'TFLOPs'):>7} {_fmt(row, 'dense_fp8_TFLOPs'):>7} "
        f"{_fmt(row, 'of_dense_fp8', '.2f'):>6} {peer('bf16'):>16} "
        f"{_fmt(row, 'vs_bf16', '.2f'):>6} "
        f"{peer('bf16_cudnn'):>16} {_fmt(row, 'vs_bf16_cudnn', '.2f'):>6} "
        f"{_fmt(row, 'vs_balanced', '.2f'):>6}" + (f"  {row['error']}" if "error" in row else ""),
        flush=True)


def print_header(env: dict, ceil: dict, tokens: int) -> None:
  print(f"\n{env['device']}  jax {env['jax']}  {env['date']}  tokens {tokens}")
  print(f"ceilings: copy {ceil['copy_TBps']:.2f} TB/s, bf16 GEMM {ceil['bf16_gemm_TFLOPs']:.0f} "
        f"TFLOP/s; TFLOP/s of real rows; bf16 columns: TFLOP/s (XLA path)")
  print(f"{'case linear routing gemm':<38}{'M x N x K':<20}{'us':>10} {'TFLOP/s':>7} "
        f"{'dense8':>7} {'of_d8':>6} {'bf16':>16} {'vs':>6} {'bf16 cudnn':>16} {'vs':>6} "
        f"{'vs_bal':>6}")


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--tokens", type=int, help=f"tokens a batch (default {TOKENS}; "
                 f"--quick: {QUICK_TOKENS}); rows = tokens * top_k")
  p.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
  p.add_argument("--linears", nargs="+", choices=LINEARS, default=list(LINEARS))
  p.add_argument("--routings", nargs="+", choices=ROUTINGS, default=list(ROUTINGS))
  p.add_argument("--gemms", nargs="+", choices=GEMMS, default=list(GEMMS))
  p.add_argument("--wgrad-dtype", choices=["float32", "bfloat16"], default="float32",
                 help="wgrad's output, FP8 and BF16 alike (default float32; DeepSeek-V3's "
                      "gate_up wgrad is then 30 GB a call, and the timing loop holds two)")
  p.add_argument("--peer-max-ms", type=float, default=500.0,
                 help="skip a BF16 peer that XLA lowers densely (every row times every "
                      "group) when that would take longer a call (default 500)")
  p.add_argument("--seed", type=int, default=0, help="the skewed routing's seed (default 0)")
  p.add_argument("--quick", action="store_true", help="tiny shapes (a CPU smoke run)")
  p.add_argument("--out", help="JSON path (default: benchmarks/results/<gpu>-moe.json)")
  args = p.parse_args(argv)
  tokens = args.tokens if args.tokens is not None else QUICK_TOKENS if args.quick else TOKENS
  if tokens < 1:
    p.error(f"--tokens must be >= 1, got {tokens}")
  cases = {c: (QUICK_CASES if args.quick else CASES)[c] for c in args.cases}
  env, ceil = environment(), ceilings(args.quick)
  print_header(env, ceil, tokens)
  routing, rows = run(cases, tokens, args.linears, args.routings, args.gemms,
                      jnp.dtype(args.wgrad_dtype), args.peer_max_ms / 1e3, args.seed)
  results = {"env": env, "ceilings": ceil,
             "config": {"tokens": tokens, "cases": {c: dataclasses.asdict(v)
                                                    for c, v in cases.items()},
                        "row_align": ROW_ALIGN, "wgrad_dtype": args.wgrad_dtype,
                        "peer_max_ms": args.peer_max_ms, "seed": args.seed,
                        "quick": args.quick},
             "routing": routing, "rows": rows}
  return finish(results, args.out, "moe", sum("error" in r for r in rows), "FP8")


if __name__ == "__main__":
  main()
