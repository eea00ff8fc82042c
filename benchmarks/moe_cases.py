"""What the mixture-of-experts benchmarks share (``benchmarks.moe``: the grouped GEMMs alone;
``benchmarks.moe_layer``: the layer forward and backward): the cases of issue 47, and the
timing of a BF16 ``jax.lax.ragged_dot`` peer with the path XLA compiled it on.

Cases (``CASES``): ``mixtral`` (d_model 4096, expert ffn 14336, 8 experts, top 2) and
``deepseek_v3`` (d_model 7168, expert ffn 2048, 256 experts, top 8); ``QUICK_CASES`` the tiny
ones of a CPU smoke run. ``TOKENS`` tokens a batch (``QUICK_TOKENS`` for the smoke run).
"""

from __future__ import annotations

import dataclasses
import math
import sys

import jax

from .common import write_results
from .timing import device_time


@dataclasses.dataclass(frozen=True)
class Case:
  """A mixture of experts' sizes."""

  d_model: int
  ffn: int  # one expert's hidden size
  experts: int
  top_k: int

  def linear(self, name: str) -> tuple[int, int]:
    """(K, N) of the expert linear ``name``: "gate_up" (gate and up in one GEMM) or "down"."""
    return (self.d_model, 2 * self.ffn) if name == "gate_up" else (self.ffn, self.d_model)


CASES = {"mixtral": Case(4096, 14336, 8, 2), "deepseek_v3": Case(7168, 2048, 256, 8)}
QUICK_CASES = {"mixtral": Case(128, 64, 4, 2), "deepseek_v3": Case(128, 32, 16, 4)}
TOKENS, QUICK_TOKENS = 16384, 64
# XLA's cuDNN grouped GEMM for ragged_dot, its only native ragged GEMM on Hopper
CUDNN_RAGGED_DOT = {"xla_gpu_experimental_use_ragged_dot_fusion": True}


def xla_path(fn, args, options) -> str:
  """How XLA compiled the ragged dot in ``fn``: "cudnn" (cuDNN's grouped GEMM), "ragged-dot"
  (kept as one op), or "dense" (rewritten into one dense dot over every group)."""
  text = jax.jit(fn, compiler_options=options).lower(*args).compile().as_text()
  if "__cudnn$fusion" in text:
    return "cudnn"
  return "ragged-dot" if "ragged-dot(" in text else "dense"


def error_text(e: Exception) -> str:
  """An exception as one line for a result's JSON: its type and first line, at most 300
  characters."""
  return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]


def time_ragged(fn, args, options, flops: float, dense_flops: float, rate_tflops: float,
                max_s: float, timed_path: str | None = None) -> dict:
  """A BF16 ragged-dot peer ``fn(*args)`` compiled with XLA's ``options``: ``path``
  (``xla_path``), and ``us`` and ``TFLOPs`` (of ``flops`` a call) from ``device_time``. Not
  timed (``skipped`` says why): the path of ``timed_path`` (a peer already timed on it), or a
  call that would take longer than ``max_s`` seconds at ``rate_tflops``, counting
  ``dense_flops`` on the dense path (XLA's rewrite multiplies every row by every group's
  matrix). A failure (out of memory, an unsupported path) is recorded as ``error``."""
  row = {}
  try:
    row["path"] = path = xla_path(fn, args, options)
    if path == timed_path:
      row["skipped"] = f"XLA took the {path} path with {options} too"
      return row
    est = (dense_flops if path == "dense" else flops) / (rate_tflops * 1e12)
    if est > max_s:
      row["skipped"] = (f"XLA's {path} path: about {est:.1f} s a call at this run's dense BF16 "
                        f"rate (over --peer-max-ms)")
      return row
    t = device_time(fn, *args, iters=min(20, max(2, math.ceil(0.2 / est))),
                    compiler_options=options)
  except Exception as e:  # noqa: BLE001 (recorded)
    row["error"] = error_text(e)
    return row
  row.update({"us": t * 1e6, "TFLOPs": flops / t / 1e12})
  return row


def finish(results: dict, out: str | None, name: str, failed: int, what: str) -> dict:
  """Writes ``results`` (to ``out``, or ``benchmarks/results/<gpu>-<name>.json``), then exits 1
  where ``failed`` cases of ``what`` failed; returns the results."""
  write_results(results, out, f"-{name}")
  if failed:
    print(f"{failed} {what} case(s) failed", file=sys.stderr)
    sys.exit(1)
  return results
