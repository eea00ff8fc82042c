"""Shared test helpers. Eight virtual CPU devices for the multi-device tests; CUDA cases are marked
`gpu` and skipped without a CUDA GPU (one capability probe: jax_fp8.cuda_available)."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import jax_fp8  # noqa: E402

HAS_CUDA = jax_fp8.cuda_available()

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
  """A fresh NumPy generator per test, seeded from OS entropy; the seed is printed on failure."""
  seed = np.random.SeedSequence().entropy % (2**32)
  print(f"rng seed {seed}")
  return np.random.default_rng(seed)


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


def bits(a) -> np.ndarray:
  """The raw bytes of an FP8 array, for bitwise comparison."""
  return np.asarray(a).view(np.uint8)
