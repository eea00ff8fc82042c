"""Shared test helpers. Eight virtual CPU devices for the multi-device tests; CUDA cases are marked
`gpu` and skipped without a CUDA GPU (one capability probe: jax_fp8.cuda_available).

Random test data comes from one base seed, ``JAX_FP8_TEST_SEED`` (0 unless set), so every run
draws the same data; set it to explore others (``JAX_FP8_TEST_SEED=7 pytest tests``). Each
test mixes the base seed with its own name, so tests do not all see the same data."""

import hashlib
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
# pytest-xdist's workers share the GPU: each takes memory as it needs it, not 75% up front.
if "PYTEST_XDIST_WORKER" in os.environ:
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# GEMM algorithm choices are timed in each test process and not written to the user's file.
os.environ.setdefault("JAX_FP8_GEMM_CACHE", "")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import jax_fp8  # noqa: E402

HAS_CUDA = jax_fp8.cuda_available()


def _base_seed() -> int:
  value = os.environ.get("JAX_FP8_TEST_SEED", "0")
  try:
    return int(value)
  except ValueError:
    raise ValueError(f"JAX_FP8_TEST_SEED must be an integer, got {value!r}") from None


BASE_SEED = _base_seed()


def seed_for(name: str) -> int:
  """The 32-bit seed of one test's data: a SHA-256 of the base seed and ``name`` (the test's
  node id), the same on every run and machine (Python's own hash is salted per process)."""
  digest = hashlib.sha256(f"{BASE_SEED}:{name}".encode()).digest()
  return int.from_bytes(digest[:4], "little")


def pytest_report_header(config):
  return f"JAX_FP8_TEST_SEED={BASE_SEED} (the base seed of the tests' random data)"


PLATFORMS = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not HAS_CUDA, reason="no CUDA GPU with the jax_fp8 CUDA targets")]),
]


@pytest.fixture(params=PLATFORMS)
def platform(request):
  """Runs the test's ops on that platform's first device."""
  device = jax.devices(request.param)[0]
  with jax.default_device(device):
    yield request.param


@pytest.fixture
def rng(request):
  """A NumPy generator seeded with ``seed_for(node id)``; the seeds are printed (pytest shows
  them on failure). Rerun one test on the same data with the printed JAX_FP8_TEST_SEED."""
  seed = seed_for(request.node.nodeid)
  print(f"rng seed {seed} (JAX_FP8_TEST_SEED={BASE_SEED}, {request.node.nodeid})")
  return np.random.default_rng(seed)


# The FP8 GEMMs' accumulation error, relative to the sum of the products' magnitudes
# (|a| @ |b|): Hopper's FP8 tensor cores accumulate with about 14 bits (DeepSeek-V3 technical
# report, section 3.3.2), good to 2^-12; f32 on the CPU gives K * 2^-24, below that to K = 4096.
ACCUMULATION = 2.0**-12


def summation_error(n: int, platform: str = "cpu") -> float:
  """Bound on the error of a sum of ``n`` terms computed in f32 in any order, relative to the
  sum of the terms' magnitudes: Higham's gamma_n = n u / (1 - n u), u = 2^-24; on a GPU plus
  ``ACCUMULATION`` (the sum may run in an FP8 GEMM). Two orders differ by at most twice this."""
  nu = n * roundoff(jax.numpy.float32)
  return nu / (1 - nu) + (0.0 if platform == "cpu" else ACCUMULATION)


def roundoff(dtype) -> float:
  """The unit roundoff of round-to-nearest into ``dtype`` (a dtype or "e4m3" / "e5m2"): half
  the spacing above 1, the largest relative error of rounding a normal value (e4m3 2^-4, e5m2
  2^-3, bfloat16 2^-8, float16 2^-11, float32 2^-24)."""
  if isinstance(dtype, str):
    dtype = jax_fp8.fp8_dtype(dtype)
  return float(jax.numpy.finfo(dtype).eps) / 2


def normwise(*roundoffs: float) -> float:
  """Tolerance on the normwise relative error of a result (a product, a sum, a GEMM) computed
  from operands each rounded once to a format of unit roundoff u_i (``roundoff``; pass one
  per rounding on the path). A rounding error uniform within u_i of each element has RMS at
  most u_i / sqrt(3); independent roundings add in quadrature, so the expected normwise error
  is at most sqrt(sum u_i^2 / 3) (about 0.74 of it for Gaussian data, whose mantissas are
  not all at the bottom of their binade). 5/4 of it covers the spread over the tests' draws."""
  return 1.25 * float(np.sqrt(sum(u * u for u in roundoffs) / 3))

def on_cpu(fn, *args):
  """Evaluate fn on the CPU (the reference's platform) and return NumPy results."""
  with jax.default_device(jax.devices("cpu")[0]):
    return jax.tree.map(np.asarray, fn(*jax.device_put(args, jax.devices("cpu")[0])))


def poison_allocator(nbytes: int):
  """Allocate and free a block filled with 0xFF bytes, so the next allocation of that size is
  likely to reuse poisoned memory: an element a kernel fails to write then shows."""
  junk = jax.numpy.full((nbytes,), 0xFF, jax.numpy.uint8)
  junk.block_until_ready()
  del junk


# E2M1's magnitudes, the codes 0..7 (code | 8 is the negative): NVFP4's elements.
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def bits(a) -> np.ndarray:
  """The raw bytes of an FP8 array, for bitwise comparison."""
  return np.asarray(a).view(np.uint8)


def block_scaled_data(rng, shape, block: int, decades: float, dtype):
  """Gaussian [R, C] data whose consecutive blocks of ``block`` elements along a row each have
  their own magnitude, 10**u with u uniform in [-decades, decades]: for block formats."""
  r, c = shape
  x = rng.standard_normal(shape) * 10.0 ** rng.uniform(-decades, decades, (r, c // block)).repeat(
      block, 1)
  return jnp.asarray(x, dtype)
