"""What the benchmarks share: random inputs, the device's ceilings, the record of the machine
a result was measured on, and writing a result's JSON file."""

from __future__ import annotations

import datetime
import json
import pathlib
import platform as pyplatform

import jax
import jax.numpy as jnp

import jax_fp8
from jax_fp8.recipes import LINEAR_GEMMS

from .timing import device_time, loop_overhead

# Fast accumulation in the forward GEMM only (TransformerEngine's default), and in all three
# (what XLA's FP8 dot, and so the pure-JAX FP8 path, does at default precision).
FAST_ACCUM = {"fast_fprop": jax_fp8.DelayedScaling(fast_accum_gemms=("fprop",)),
              "fast_all": jax_fp8.DelayedScaling(fast_accum_gemms=LINEAR_GEMMS)}


def rand(key, shape, dtype, scale=1.0):
  return (jax.random.normal(jax.random.PRNGKey(key), shape, jnp.float32) * scale).astype(dtype)


def ceilings(quick):
  n = 1 << 16 if quick else 1 << 30  # 2 GiB of bf16
  x = rand(0, (n,), jnp.bfloat16)
  t = device_time(lambda x: x + 1, x)
  a = rand(1, (8192, 8192) if not quick else (256, 256), jnp.bfloat16)
  tg = device_time(lambda a: a @ a, a)
  m = a.shape[0]
  return {"copy_TBps": 4 * n / t / 1e12, "bf16_gemm_TFLOPs": 2 * m**3 / tg / 1e12,
          "timing_loop_overhead_us": loop_overhead() * 1e6}


def environment(device=None):
  """The machine and versions a result was measured with; ``device`` (default: the default
  backend's first) names the device."""
  dev = device or jax.devices()[0]
  return {"device": dev.device_kind, "platform": dev.platform, "jax": jax.__version__,
          "python": pyplatform.python_version(), "date": datetime.date.today().isoformat(),
          "jax_fp8_cuda": jax_fp8.cuda_available()}


def write_results(results: dict, out: str | None, name: str) -> None:
  """Write ``results`` as JSON to ``out``, or to ``benchmarks/results/<device><name>.json``, the
  device ``results["env"]["device"]`` with underscores for spaces (``NVIDIA_H200-run.json``)."""
  device = results["env"]["device"].replace(" ", "_")
  path = (pathlib.Path(out) if out else
          pathlib.Path(__file__).parent / "results" / f"{device}{name}.json")
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(results, indent=1))
  print(f"wrote {path}")
