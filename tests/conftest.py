"""Shared test helpers. Eight virtual CPU devices for the multi-device tests; CUDA cases are marked
`gpu` and skipped without a CUDA GPU (one capability probe: jax_fp8.cuda_available).

Random test data comes from one base seed, ``JAX_FP8_TEST_SEED`` (0 unless set), so every run
draws the same data; set it to explore others (``JAX_FP8_TEST_SEED=7 pytest tests``). Each
test mixes the base seed with its own name, so tests do not all see the same data."""

import atexit
import collections
import dataclasses
import functools
import hashlib
import importlib.metadata
import importlib.util
import itertools
import os
import pkgutil
import re
import shutil
import tempfile


def _cuda_plugin() -> bool:
  """Whether JAX would find a CUDA plugin: a jax_cuda* module, an entry point in the
  jax_plugins group, or a module in the jax_plugins namespace package (JAX's three ways)."""
  spec = importlib.util.find_spec("jax_plugins")
  namespaced = pkgutil.iter_modules(spec.submodule_search_locations) if spec else ()
  return (any(m.name.startswith("jax_cuda") for m in pkgutil.iter_modules())
          or any("cuda" in e.name for e in importlib.metadata.entry_points(group="jax_plugins"))
          or any("cuda" in m.name for m in namespaced))


# XLA:CPU's LLVM optimizations off (xla_backend_optimization_level=0) where JAX has no CUDA
# plugin (CI): the HLO, XLA's own passes and the FFI handlers are the same, only LLVM's code
# generation for XLA's CPU kernels changes (no FMA contraction, less vectorization: each
# operation rounds as written), and the suite takes about two thirds of the time (compilation
# is most of it). Where JAX can reach a GPU, every program compiles as users compile it; a
# setting of the user's own in XLA_FLAGS is kept: XLA_FLAGS=--xla_backend_optimization_level=2
# runs the CPU suite as users compile (every bit-for-bit comparison with a twin then also checks
# that LLVM's optimizations change no bit, which this setting leaves unchecked).
_FLAGS = os.environ.get("XLA_FLAGS", "")
_UNOPTIMIZED = "--xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = (_FLAGS + " --xla_force_host_platform_device_count=8" + (
    " " + _UNOPTIMIZED
    if "xla_backend_optimization_level" not in _FLAGS and not _cuda_plugin() else "")).strip()
# Whether XLA's CPU kernels compile without LLVM's optimizations in this run (a test whose
# programs round differently then says so).
LLVM_UNOPTIMIZED = _UNOPTIMIZED in os.environ["XLA_FLAGS"]

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

# Without a GPU (CI), compiled programs of over half a second are kept in a compilation cache
# for this run: a folder of each test process (pytest-xdist's workers have one each) that the
# processes it starts inherit. A demo or benchmark model compiled again by a later test (each
# main() builds its train step anew; a benchmark's child processes compile it once more) is
# read back instead. Nothing carries between runs; GPU runs, and a JAX_COMPILATION_CACHE_DIR
# of the user's, are left as they are.
if not HAS_CUDA and ("JAX_COMPILATION_CACHE_DIR" not in os.environ
                     or "JAX_FP8_TESTS_CACHE" in os.environ):
  _CACHE_DIR = tempfile.mkdtemp(prefix="jax_fp8_tests_")  # removed in pytest_unconfigure
  atexit.register(shutil.rmtree, _CACHE_DIR, ignore_errors=True)
  os.environ.update(JAX_FP8_TESTS_CACHE="1", JAX_COMPILATION_CACHE_DIR=_CACHE_DIR,
                    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0.5")
  jax.config.update("jax_compilation_cache_dir", _CACHE_DIR)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


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


# The quick tier (`pytest --quick`, `bash scripts/test.sh --quick`), for the edit-test loop: every
# op against its reference at small shapes, with its edge values and errors; linear per recipe
# (delayed, current, block, MXFP8, NVFP4) with its gradients; the layers (Flax, NNX, multi,
# MLP, norm, split, convert, checkpoint, state, inference), one data-parallel step, the demo's
# and benchmarks' argument checks. Each entry is a regex searched in the node ids of one file;
# the full suite (no flag, CI) runs everything. An entry that names no test of a collected file
# is an error, so a renamed test cannot drop out of the tier unnoticed.
QUICK = {
    "test_activation.py": [r"::test_(forward|grad)_matches_reference\[\w+-\w+-17x48-",
                           r"::test_nan_stays_visible", r"::test_bad_inputs",
                           r"::test_grad_formulas_are_the_derivatives"],
    "test_block_sources.py": [r"::test_activation(_grad)?_matches_reference\[\w+-\w+-\w+-129x384\]",
                              r"::test_norm_matches_reference_bytes\[\w+-129x384-bfloat16-",
                              r"::test_plain_source_is_group_cast_transpose"],
    "test_blockwise.py": [r"::test_group_quantize_matches_reference\[\w+-bfloat16-e4m3",
                          r"::test_edge_policy\[", r"::test_bad_inputs", r"::test_empty_rows",
                          r"::test_vmap", r"::test_group_cast_transpose_padding_is_zero"],
    "test_cast_transpose.py": [r"::test_matches_reference\[\w+-(17x48|0x16)-",
                               r"::test_parts_match_their_concatenation\[\w+-100-48x16x80-",
                               r"::test_parts_keep_a_nan_visible", r"::test_bad_inputs",
                               r"::test_parts_bad_inputs", r"::test_a_list_of_rows_is_one_array"],
    "test_quantize.py": [r"::test_shapes_and_zero", r"::test_special_values\[\w+-bfloat16-",
                         r"::test_observe_writes_the_observation\[\w+-finite-",
                         r"::test_ring_first_step_uses_current_amax", r"::test_ring_edge_cases",
                         r"::test_ring_margin", r"::test_f32_subnormals_count_as_zero",
                         r"::test_bad_inputs"],
    "test_norm.py": [r"::test_matches_reference_bytes\[\w+-17x48-", r"::test_bad_inputs",
                     r"::test_nan_stays_visible",
                     r"::test_linear_matches_unfused_and_f32\[\w+-delayed-rmsnorm-"],
    "test_gemm.py": [r"::test_gemm_matches_f32\[\w+-37-48-80-bfloat16-",
                     r"::test_block_gemm_matches_f32\[\w+-40-48-256-bfloat16-",
                     r"::test_gemm_e4m3_out\[\w+-37-48-80-", r"::test_gemm_nan_propagates",
                     r"::test_gemm_zero_rows", r"::test_bad_inputs"],
    "test_block_gemm_kernel.py": [r"::test_kernel_matches_f32\[\w+-70-128-128-bfloat16-b1x128-"
                                  r"sm90_128x112_c1\]", r"::test_bad_algorithm"],
    "test_mxfp8.py": [r"::test_kernel_bytes_equal_reference\[\w+-\(33, 160\)-",
                      r"::test_special_blocks", r"::test_zero_block", r"::test_bad_input",
                      r"::test_nan_and_inf_blocks_stay_visible"],
    "test_nvfp4.py": [r"::test_kernel_bytes_equal_reference\[\w+-\(16, 80\)-",
                      r"::test_packing_and_rounding", r"::test_(cuda_)?kernel_choice",
                      r"::test_bad_input", r"::test_empty_tensors"],
    "test_hadamard.py": [r"::test_hadamard_transform_is_its_definition\[0\]"],
    "test_philox.py": [r"::"],
    "test_import.py": [r"::"],
    "test_linear.py": [r"::test_forward_and_grads\[", r"::test_bad_inputs"],
    "test_grouped_linear.py": [r"::test_forward_and_grads\[\w+-delayed-unaligned",
                               r"::test_backward_is_the_quantized_operands_products\[\w+-current",
                               r"::test_block_backward_is_the_quantized_operands_products\[",
                               r"::test_bad_inputs"],
    "test_grouped_mlp.py": [r"::test_forward_and_grads\[\w+-zeros",
                            r"::test_equals_twin\[\w+-delayed",
                            r"::test_block_equals_twin\[\w+-bias-unaligned", r"::test_bad_inputs"],
    "test_grouped_gemm.py": [r"::test_grouped_gemm_matches_f32\[\w+-scale-per-group-zeros-bfloat16-",
                             r"::test_grouped_gemm_wgrad_matches_f32\[\w+-ragged-last-float32-",
                             r"::test_block_grouped_gemm_matches_f32\[\w+-zeros-",
                             r"::test_bad_inputs"],
    "test_moe_routing.py": [r"::test_permute_layout\[37-", r"::test_round_trip_and_gradient"],
    "test_moe.py": [r"::test_values_and_gradients_match_f32\[current", r"::test_bad_input"],
    "test_capacity_moe.py": [r"::test_no_drop_equals_the_ragged_dot_twin",
                             r"::test_dispatch_priority", r"::test_bad_arguments",
                             r"::test_model_config_rejects_a_capacity"],
    "test_current_scaling.py": [r"::test_forward_and_grads_against_f32", r"::test_errors"],
    "test_block_linear.py": [r"::test_forward_and_grads\[\w+-bfloat16-f32scale",
                             r"::test_bad_inputs"],
    "test_mxfp8_block_scaling.py": [r"::test_forward_and_grads_against_f32", r"::test_errors",
                                    r"::test_mxfp8_gemm_is_exact_to_the_f32_sums"],
    "test_nvfp4_block_scaling.py": [r"::test_gemms_against_f32_within_the_format",
                                    r"::test_errors"],
    "test_multi_linear.py": [r"::test_multi_dense_matches_dense", r"::test_bad_arguments"],
    "test_mlp.py": [r"::test_flax_layer", r"::test_nnx_layer", r"::test_bad_arguments"],
    "test_flax.py": [r"::test_init_matches_nn_dense", r"::test_layer_dtypes_are_checked"],
    "test_nnx.py": [r"::test_linear_is_a_drop_in", r"::test_bad_arguments",
                    r"::test_call_takes_nnx_keywords"],
    "test_linear_split.py": [r"::test_split_equals_the_output_cut\[(\w+-)?current-None",
                             r"::test_bad_split"],
    "test_cast_kernel.py": [r"::test_cast_matches_the_uncast_layer\[(\w+-)?delayed-linear"],
    "test_convert.py": [r"::test_filter", r"::test_bad_arguments"],
    "test_convert_report.py": [r"::test_report_nnx", r"::test_default_on_a_gpu",
                               r"::test_below_intensity_warns", r"::test_output_layer_head",
                               r"::test_last_projection", r"::test_second_convert",
                               r"::test_bound_module", r"::test_report_bad_arguments"],
    "test_convert_layers.py": [r"::test_contraction_layers_are_linear\[delayed",
                               r"::test_nnx_unmapped_layers_are_left",
                               r"::test_nnx_vmap_scan_stack\[delayed"],
    "test_convert_ragged.py": [r"::test_moe_converts_in_one_line\[delayed",
                               r"::test_forms_left_as_they_were",
                               r"::test_recipes_that_leave_them",
                               r"::test_nested_refused_and_other_threads"],
    "test_checkpoint.py": [r"::test_refuses_another_recipe_or_other_rings"],
    "test_state.py": [r"::test_combined_observations_equal_next_ring_of_max\[history0-"],
    "test_inference.py": [r"::test_errors", r"::test_same_forward_as_training"],
    "test_residuals.py": [r"::test_residuals_come_back_bit_for_bit\[float8_e4m3fn-"],
    "test_errors.py": [r"::test_clear_error\[", r"::test_grad_names_the_op\["],
    "test_multidevice.py": [r"::test_data_parallel$", r"::test_explicit_axes_rejected"],
    "test_demo.py": [r"::test_training_batches", r"::test_demo_config_rejects",
                     r"::test_demo_rejects_a_negative_tolerance",
                     r"::test_demo_moe_preset_rejects_other_recipes"],
    "test_benchmarks.py": [r"::test_per_call_takes_more_calls_until_resolved",
                           r"::test_model_step_bad_flags", r"::test_moe_layer_bad_flags",
                           r"::test_demo_step_moe_preset_rejects"],
}


def pytest_addoption(parser):
  parser.addoption("--quick", action="store_true",
                   help="run only the quick tier (conftest.QUICK): about 2 minutes on 2 cores")


def pytest_configure(config):
  config.addinivalue_line("markers", "quick: in the quick tier (conftest.QUICK; --quick)")


def pytest_unconfigure(config):
  if "_CACHE_DIR" in globals():
    shutil.rmtree(_CACHE_DIR, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
  """Marks the quick tier's tests; with --quick, keeps only those (and refuses a QUICK entry that
  selects no test of a file it collected)."""
  file_of = lambda item: item.nodeid.split("::")[0].rsplit("/", 1)[-1]  # noqa: E731
  patterns = {name: [re.compile(p) for p in ps] for name, ps in QUICK.items()}
  used = set()
  for item in items:
    for p in patterns.get(file_of(item), ()):
      if p.search(item.nodeid):
        item.add_marker(pytest.mark.quick)
        used.add((file_of(item), p.pattern))
  if not config.getoption("--quick"):
    return
  files = {file_of(item) for item in items}
  unused = [f"{name}: {p}" for name, ps in QUICK.items() if name in files for p in ps
            if (name, p) not in used]
  if unused:
    raise pytest.UsageError("conftest.QUICK entries that select no test (renamed?): "
                            + "; ".join(unused))
  config.hook.pytest_deselected(items=[i for i in items if not i.get_closest_marker("quick")])
  items[:] = [i for i in items if i.get_closest_marker("quick")]


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


def _case_id(value) -> str:
  """A parameter's part of a test id: a shape as 16x32, a dtype by name."""
  if isinstance(value, tuple):
    return "x".join(map(str, value))
  return jnp.dtype(value).name if isinstance(value, type) else str(value)


def covering_cases(full: dict[str, list], varied: dict[str, list]) -> list:
  """``pytest.param``s over the factors of ``full`` (their whole product) and of ``varied``
  (values chosen per case) in which every pair of values of any two factors occurs: a covering
  array of strength 2 (pairwise testing), far fewer cases than the whole product. Each case of
  the product takes the ``varied`` values that meet the most pairs not met yet (then the least
  met ones); cases are added while a pair is left. Argument order: ``full``'s names, then
  ``varied``'s; ids join the values (shapes as 16x32, dtypes by name)."""
  levels = [*full.values(), *varied.values()]
  pairs = lambda case: [(a, case[a], b, case[b])  # noqa: E731
                        for a in range(len(case)) for b in range(a + 1, len(case))]
  every = list(itertools.product(*map(range, map(len, levels))))
  seen, cases = collections.Counter(), []

  def best(candidates):
    return max(candidates, key=lambda c: (sum(seen[p] == 0 for p in pairs(c)),
                                          -sum(seen[p] for p in pairs(c))))
  for head in itertools.product(*map(range, map(len, full.values()))):
    cases.append(best(c for c in every if c[:len(head)] == head))
    seen.update(pairs(cases[-1]))
  while left := {p for c in every for p in pairs(c)} - set(seen):
    cases.append(best(c for c in every if set(pairs(c)) & left))
    seen.update(pairs(cases[-1]))
  return [pytest.param(*(levels[k][i] for k, i in enumerate(case)),
                       id="-".join(_case_id(levels[k][i]) for k, i in enumerate(case)))
          for case in cases]


def default_devices(n: int) -> list:
  """The default backend's first ``n`` devices (CPU: eight, forced above), or the test skips
  where it has fewer (a machine with one GPU)."""
  devices = jax.devices()
  if len(devices) < n:
    pytest.skip(f"needs {n} {devices[0].platform} devices, this machine has {len(devices)}")
  return devices[:n]


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


def to_device(x, dtype=None) -> jax.Array:
  """NumPy data ``x`` (converted to ``dtype`` by NumPy) as an array on the default device,
  without compiling: ``jnp.asarray`` of a NumPy array runs a jitted identity (``lax.stage``),
  and with a dtype a conversion, compiled once per shape and dtype; ``jax.device_put`` none."""
  return jax.device_put(np.asarray(x, dtype))


def filled(*shape, fill=0, dtype=np.float32) -> jax.Array:
  """An array of ``shape`` holding ``fill``, put from NumPy (``to_device``): no eager
  broadcast compiled, e.g. for the bad-input cases built at collection."""
  return to_device(np.full(shape, fill, dtype))


def on_cpu(fn, *args):
  """Evaluate fn on the CPU (the reference's platform) and return NumPy results."""
  with jax.default_device(jax.devices("cpu")[0]):
    return jax.tree.map(np.asarray, fn(*jax.device_put(args, jax.devices("cpu")[0])))


# XLA:CPU's compile options for the jnp twins (reference_on_cpu), also where the rest of the
# suite compiles as users do (a GPU machine): LLVM's optimizations off, as above. The HLO is
# the same and compiles in about half the time (the Hadamard transform's fused butterfly above
# all). A twin compared bit for bit whose results this changed would fail its comparison, not
# pass it; the f32 twins compared within a bound are within it either way.
TWIN_COMPILER_OPTIONS = {"xla_backend_optimization_level": 0}


@functools.cache
def _jitted(fn, static, options=None):
  return jax.jit(functools.partial(fn, **dict(static)),
                 compiler_options=None if options is None else dict(options))


def jitted(fn, *args, **kwargs):
  """``fn(*args, **kwargs)`` on the default device, jitted once per fn and set of non-array
  keyword arguments as ``reference_on_cpu`` is: one compilation per shape instead of one per
  jnp call of an eager op."""
  arrays = {k: v for k, v in kwargs.items() if isinstance(v, (jax.Array, np.ndarray))}
  static = tuple(sorted((k, v) for k, v in kwargs.items() if k not in arrays))
  return _jitted(fn, static)(*args, **arrays)


def reference_on_cpu(fn, *args, **kwargs):
  """``on_cpu(lambda *a: fn(*a, **kwargs), *args)`` with fn jitted once per fn and set of
  non-array keyword arguments (hashable: formats, flags, seeds). Eagerly, every jnp call of a
  reference twin compiles on its own at each new shape; jitted, the twin compiles into one
  program per shape, and runs again at a shape seen before without compiling, with
  ``TWIN_COMPILER_OPTIONS``. Array keyword arguments (keys, given amaxes) are passed to the
  jitted function, not bound into it."""
  arrays = {k: v for k, v in kwargs.items() if isinstance(v, (jax.Array, np.ndarray))}
  static = {k: v for k, v in kwargs.items() if k not in arrays}
  names, n = tuple(arrays), len(args)
  twin = _jitted(fn, tuple(sorted(static.items())), tuple(TWIN_COMPILER_OPTIONS.items()))
  return on_cpu(lambda *a: twin(*a[:n], **dict(zip(names, a[n:]))), *args, *arrays.values())


def poison_allocator(nbytes: int):
  """Allocate and free a block filled with 0xFF bytes, so the next allocation of that size is
  likely to reuse poisoned memory: an element a kernel fails to write then shows."""
  junk = jax.device_put(np.full((nbytes,), 0xFF, np.uint8), may_alias=False)  # no compile
  junk.block_until_ready()
  del junk


# E2M1's magnitudes, the codes 0..7 (code | 8 is the negative): NVFP4's elements.
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def bits(a) -> np.ndarray:
  """The raw bytes of an FP8 array, for bitwise comparison."""
  return np.asarray(a).view(np.uint8)


def assert_same_quantized(got, want, fields=None):
  """Two ``jax_fp8.Quantized`` equal field by field (``fields``: those names only, default all):
  the same fields None, the others the same dtype and shape, byte-equal for 1-byte elements
  (FP8, E8M0, packed E2M1) and equal in value for f32 scales and amaxes (NaN equal to NaN)."""
  names = fields or [f.name for f in dataclasses.fields(jax_fp8.Quantized)]
  for name in names:
    g, w = getattr(got, name), getattr(want, name)
    assert (g is None) == (w is None), f"{name}: got {g is not None}, want {w is not None}"
    if g is not None:
      g, w = np.asarray(g), np.asarray(w)
      assert (g.dtype, g.shape) == (w.dtype, w.shape), f"{name}: {g.dtype}{g.shape} vs " \
          f"{w.dtype}{w.shape}"
      if g.dtype.itemsize == 1:
        g, w = bits(g), bits(w)
      np.testing.assert_array_equal(g, w, err_msg=name)


def block_scaled_data(rng, shape, block: int, decades: float, dtype):
  """Gaussian [R, C] data whose consecutive blocks of ``block`` elements along a row each have
  their own magnitude, 10**u with u uniform in [-decades, decades]: for block formats."""
  r, c = shape
  x = rng.standard_normal(shape) * 10.0 ** rng.uniform(-decades, decades, (r, c // block)).repeat(
      block, 1)
  return to_device(x, dtype)
