"""jax_fp8.ops.gemm_algorithms: each GEMM problem timed once per kind of device, cuBLASLt's
candidates and jax_fp8's own block-scaled kernels, the choice recorded and read back by later
runs (CPU: a stand-in for the CUDA extension's three functions); on a GPU, two processes give
the same bits from the recorded choice, and every candidate keeps within the bound."""

import json
import os
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import HAS_CUDA, on_cpu

import jax_fp8
from jax_fp8 import _ffi, reference
from jax_fp8.ops import gemm_algorithms
from jax_fp8.ops.gemm_algorithms import AUTOTUNE_ENV, CACHE_ENV

PROBLEM = (256, 512, 1024, "float8_e4m3fn", "float8_e4m3fn", "bfloat16", False, True, 0)
OTHER = (256, 512, 2048, "float8_e4m3fn", "float8_e5m2", "float32", False, False, 0)
BLOCK = (256, 512, 1024, "float8_e4m3fn", "float8_e4m3fn", "bfloat16", False, False, 1)
FAST, SLOW = gemm_algorithms.KERNELS[3], gemm_algorithms.KERNELS[0]
TIMES = {"cublaslt_0": 3.0, "cublaslt_1": 1.0, "cublaslt_2": 2.0}
A, B = "A (sm_90, cuBLASLt 1)", "B (sm_100, cuBLASLt 1)"


def algorithm(ordinal: int, candidate: int) -> bytes:
  return bytes([ordinal, candidate] * 32)


class FakeCuda:
  """The CUDA extension's GEMM-choice functions: two devices of kind A and one of kind B; the
  second of cuBLASLt's three candidates is the fastest (1 us); jax_fp8's kernels take the times
  in ``kernel_us`` ({ordinal: {name: us}}, none by default)."""

  def __init__(self, fail=False, kernel_us=None):
    self.tuned, self.chosen, self.fail, self.kernel_us = [], {}, fail, kernel_us or {}

  def gemm_device(self, ordinal):
    return [A, A, B][ordinal]

  def gemm_tune(self, ordinal, *problem):
    if self.fail:
      raise RuntimeError("cudaMalloc of the GEMM timing buffers: out of memory")
    self.tuned.append((ordinal, problem))
    kernels = self.kernel_us.get(ordinal, {})
    return ([algorithm(ordinal, c) for c in range(3)], [3.0, 1.0, 2.0], list(kernels),
            list(kernels.values()))

  def gemm_choose(self, device, *args):
    self.chosen[(device, args[:-1])] = args[-1]


@pytest.fixture
def cuda(monkeypatch, tmp_path):
  """A fresh process's state with the stand-in extension and a cache file in tmp_path."""
  def new_process(fail=False, kernel_us=None):
    ext = FakeCuda(fail, kernel_us)
    monkeypatch.setattr(_ffi, "_jax_fp8_cuda", ext)
    monkeypatch.setattr(_ffi, "cuda_available", lambda: True)
    monkeypatch.setattr(gemm_algorithms, "_gpu_ordinals", lambda: [0, 1, 2])
    monkeypatch.setattr(gemm_algorithms, "_installed", {})
    monkeypatch.setattr(gemm_algorithms, "_recorded", {})
    return ext
  monkeypatch.setenv(CACHE_ENV, str(tmp_path / "gemm.jsonl"))
  monkeypatch.delenv(AUTOTUNE_ENV, raising=False)
  return new_process


def records(path):
  return [json.loads(line) for line in path.read_text().splitlines()]


def test_timed_once_per_kind_of_device_and_recorded(cuda, tmp_path):
  ext = cuda()
  assert gemm_algorithms.select(PROBLEM) is None
  assert gemm_algorithms.select(PROBLEM) is None
  assert [o for o, _ in ext.tuned] == [0, 2]  # one device of each kind, once
  assert ext.chosen == {(A, PROBLEM): algorithm(0, 1), (B, PROBLEM): algorithm(2, 1)}
  got = records(tmp_path / "gemm.jsonl")
  assert [(r["device"], tuple(r["problem"]), r["algorithm"], r["kernel"], r["candidates_us"])
          for r in got] == [(A, PROBLEM, algorithm(0, 1).hex(), None, TIMES),
                            (B, PROBLEM, algorithm(2, 1).hex(), None, TIMES)]


def test_a_faster_kernel_is_chosen_and_recorded(cuda, tmp_path):
  """jax_fp8's kernel beats cuBLASLt's candidates on both kinds: select names it, cuBLASLt's
  fastest is still installed (``algorithm="cublaslt"`` runs it), and a later process reads the
  choice back without timing."""
  times = {FAST: 0.5, SLOW: 2.5}
  ext = cuda(kernel_us={0: times, 2: times})
  assert gemm_algorithms.select(BLOCK) == FAST
  assert ext.chosen == {(A, BLOCK): algorithm(0, 1), (B, BLOCK): algorithm(2, 1)}
  got = records(tmp_path / "gemm.jsonl")
  assert [(r["kernel"], r["candidates_us"]) for r in got] == [(FAST, TIMES | times)] * 2
  later = cuda()
  assert gemm_algorithms.select(BLOCK) == FAST and later.tuned == []
  assert later.chosen == ext.chosen


@pytest.mark.parametrize("kernel_us", [{0: {FAST: 1.5}, 2: {FAST: 1.5}},
                                       {0: {FAST: 0.5}, 2: {FAST: 1.5}},
                                       {0: {FAST: 0.5}, 2: {FAST: -1.0}}],
                         ids=["slower", "faster-on-one-kind", "failed-on-one-kind"])
def test_cublaslt_runs_unless_every_kind_chose_the_kernel(cuda, tmp_path, kernel_us):
  """One program serves every device: a kernel runs only where every kind of device chose
  it (a kernel that failed to run is never chosen)."""
  ext = cuda(kernel_us=kernel_us)
  assert gemm_algorithms.select(BLOCK) is None
  assert ext.chosen == {(A, BLOCK): algorithm(0, 1), (B, BLOCK): algorithm(2, 1)}
  got = {r["device"]: r["kernel"] for r in records(tmp_path / "gemm.jsonl")}
  assert got == {A: FAST if kernel_us[0][FAST] < 1 else None,
                 B: FAST if kernel_us[2][FAST] == 0.5 else None}


def test_a_record_of_a_kernel_this_build_lacks_is_timed_again(cuda, tmp_path):
  """A record naming a kernel that a later build dropped: a warning, the candidates are timed
  again (this process runs the new choice), the file keeps its first record."""
  path = tmp_path / "gemm.jsonl"
  gone = {"device": A, "problem": list(BLOCK), "algorithm": algorithm(5, 5).hex(),
          "kernel": "sm90_128x96_c4", "candidates_us": {}}
  path.write_text(json.dumps(gone) + "\n")
  ext = cuda(kernel_us={0: {FAST: 0.5}, 2: {FAST: 0.5}})
  with pytest.warns(UserWarning, match="the kernel 'sm90_128x96_c4', which this build lacks"):
    assert gemm_algorithms.select(BLOCK) == FAST
  assert [o for o, _ in ext.tuned] == [0, 2]
  assert ext.chosen[(A, BLOCK)] == algorithm(0, 1)
  assert [r["kernel"] for r in records(path)] == ["sm90_128x96_c4", FAST]


def test_a_kernel_alone_is_a_choice(cuda, tmp_path):
  """No cuBLASLt candidate ran but a kernel did: the kernel, and no cuBLASLt algorithm
  installed (the heuristic's stays)."""
  ext = cuda(kernel_us={0: {FAST: 0.5}, 2: {FAST: 0.5}})
  ext.gemm_tune = lambda ordinal, *problem: ([], [], [FAST], [0.5])
  assert gemm_algorithms.select(BLOCK) == FAST and ext.chosen == {}
  assert [(r["algorithm"], r["kernel"]) for r in records(tmp_path / "gemm.jsonl")] == [
      (None, FAST)] * 2


def test_a_later_run_takes_the_recorded_choice(cuda, tmp_path):
  first = cuda()
  gemm_algorithms.select(PROBLEM)
  later = cuda()
  gemm_algorithms.select(PROBLEM)
  assert later.tuned == [] and later.chosen == first.chosen
  gemm_algorithms.select(OTHER)  # a new problem is timed and appended
  assert [p for _, p in later.tuned] == [OTHER, OTHER]
  assert len(records(tmp_path / "gemm.jsonl")) == 4


def test_first_record_wins_and_bad_lines_are_skipped(cuda, tmp_path):
  """The first record of a problem wins, in the format before jax_fp8's kernels too (no
  "kernel", a list of times); lines that are not records are skipped with a warning."""
  path = tmp_path / "gemm.jsonl"
  device = "A (sm_90, cuBLASLt 1)"
  line = {"device": device, "problem": list(PROBLEM), "candidates_us": []}
  path.write_text("not json\n" + json.dumps({**line, "algorithm": algorithm(7, 7).hex()}) + "\n"
                  + json.dumps({**line, "algorithm": algorithm(8, 8).hex()}) + "\n"
                  + json.dumps({"device": device}) + "\n"
                  + json.dumps({**line, "algorithm": None, "kernel": None}) + "\n"
                  + json.dumps({**line, "algorithm": None, "kernel": 3}) + "\n")
  ext = cuda()
  with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    gemm_algorithms.select(PROBLEM)
  assert [str(x.message).split(" is not")[0].split("/")[-1] for x in w] == [
      "gemm.jsonl:1", "gemm.jsonl:4", "gemm.jsonl:5", "gemm.jsonl:6"]
  assert ext.chosen[(device, PROBLEM)] == algorithm(7, 7)
  assert [o for o, _ in ext.tuned] == [2]  # only the kind with no record


def test_autotune_off_leaves_the_heuristic(cuda, tmp_path, monkeypatch):
  monkeypatch.setenv(AUTOTUNE_ENV, "0")
  ext = cuda()
  gemm_algorithms.select(PROBLEM)
  assert ext.tuned == [] and ext.chosen == {} and not (tmp_path / "gemm.jsonl").exists()


def test_a_record_another_process_wrote_meanwhile_wins(cuda, tmp_path, monkeypatch):
  """Two processes time the same problem at once: the one that records second adopts the
  first one's record, so both run what later runs will read."""
  ext = cuda()
  path = tmp_path / "gemm.jsonl"
  device = "A (sm_90, cuBLASLt 1)"
  gemm_algorithms._read(path)  # this process read the file while it was still empty
  path.write_text(json.dumps({"device": device, "problem": list(PROBLEM), "candidates_us": [],
                              "algorithm": algorithm(9, 9).hex()}) + "\n")
  gemm_algorithms.select(PROBLEM)
  assert ext.chosen[(device, PROBLEM)] == algorithm(9, 9)
  assert [r["device"] for r in records(path)] == [device, "B (sm_100, cuBLASLt 1)"]


@pytest.mark.parametrize("content", [b"\xff\xfe binary", None])
def test_a_file_that_cannot_be_read_or_written_is_skipped(cuda, tmp_path, monkeypatch, content):
  """Undecodable bytes, or a path whose parent is a file: warnings, and the GEMM still gets
  the timed choice."""
  path = tmp_path / "gemm.jsonl"
  if content is None:
    path.write_text("")
    path = path / "inside"  # its parent is a file: neither readable nor writable
    monkeypatch.setenv(CACHE_ENV, str(path))
  else:
    path.write_bytes(content)
  ext = cuda()
  with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    gemm_algorithms.select(PROBLEM)
  assert any("cannot record a GEMM algorithm" in str(x.message) for x in w)
  assert ext.chosen[("A (sm_90, cuBLASLt 1)", PROBLEM)] == algorithm(0, 1)


def test_a_record_of_the_wrong_size_is_skipped(cuda, tmp_path):
  path = tmp_path / "gemm.jsonl"
  path.write_text(json.dumps({"device": "A (sm_90, cuBLASLt 1)", "problem": list(PROBLEM),
                              "candidates_us": [], "algorithm": "00"}) + "\n")
  ext = cuda()
  with pytest.warns(UserWarning, match="an algorithm of 1 bytes, not 64"):
    gemm_algorithms.select(PROBLEM)
  assert ext.chosen[("A (sm_90, cuBLASLt 1)", PROBLEM)] == algorithm(0, 1)


@pytest.mark.parametrize("value", ["yes", "true", "", "2"])
def test_autotune_takes_only_0_or_1(cuda, monkeypatch, value):
  monkeypatch.setenv(AUTOTUNE_ENV, value)
  cuda()
  with pytest.raises(ValueError, match=f"{AUTOTUNE_ENV} must be 0 or 1, got {value!r}"):
    gemm_algorithms.select(PROBLEM)


def test_no_file_times_again_in_each_process(cuda, tmp_path, monkeypatch):
  monkeypatch.setenv(CACHE_ENV, "")
  assert gemm_algorithms.cache_path() is None
  for _ in range(2):
    ext = cuda()
    gemm_algorithms.select(PROBLEM)
    assert len(ext.tuned) == 2 and len(ext.chosen) == 2
  assert list(tmp_path.iterdir()) == []


def test_default_file_is_under_the_cache_home(monkeypatch, tmp_path):
  monkeypatch.delenv(CACHE_ENV, raising=False)
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  assert gemm_algorithms.cache_path() == tmp_path / "jax_fp8" / "gemm_algorithms.jsonl"


def test_a_timing_failure_warns_once_and_records_nothing(cuda, tmp_path):
  ext = cuda(fail=True)
  with pytest.warns(UserWarning, match="out of memory.*first heuristic choice"):
    gemm_algorithms.select(PROBLEM)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    gemm_algorithms.select(PROBLEM)  # not retried, no second warning
  assert ext.chosen == {} and not (tmp_path / "gemm.jsonl").exists()


def test_without_cuda_nothing_is_asked(monkeypatch):
  monkeypatch.setattr(_ffi, "cuda_available", lambda: False)
  monkeypatch.setattr(_ffi, "_jax_fp8_cuda", None)  # any call would fail
  gemm_algorithms.select(PROBLEM)


RUN = """
import hashlib, jax, jax.numpy as jnp, numpy as np, jax_fp8
k = jax.random.split(jax.random.PRNGKey(0))
a = (jax.random.normal(k[0], (2048, 4096)) * 3).astype(jnp.float8_e4m3fn)
b = (jax.random.normal(k[1], (1024, 4096)) * 3).astype(jnp.float8_e4m3fn)
one = jnp.float32(1)
outs = [jax_fp8.gemm(a, b, one, one, fast_accum=f, out_dtype=d)
        for f in (False, True) for d in (jnp.bfloat16, jnp.float32)]
print(hashlib.sha256(b"".join(np.asarray(o).tobytes() for o in outs)).hexdigest())
"""


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA GPU with the jax_fp8 CUDA targets")
def test_recorded_choice_gives_the_same_bits_in_a_new_process(tmp_path):
  path = tmp_path / "gemm.jsonl"
  env = {**os.environ, CACHE_ENV: str(path), AUTOTUNE_ENV: "1"}
  run = lambda: subprocess.run([sys.executable, "-c", RUN], env=env, check=True,  # noqa: E731
                               capture_output=True, text=True).stdout.strip()
  first = run()
  timed = records(path)
  assert sorted(tuple(r["problem"]) for r in timed) == sorted(
      (2048, 1024, 4096, "float8_e4m3fn", "float8_e4m3fn", d, False, f, 0)
      for f in (False, True) for d in ("bfloat16", "float32"))
  for r in timed:
    us = [t for t in r["candidates_us"].values() if t >= 0]
    assert us and min(us) > 0 and r["kernel"] is None  # per-tensor: cuBLASLt alone
  assert run() == first
  assert records(path) == timed  # nothing timed the second time


def every_candidate(problem, run, check):
  """Each of cuBLASLt's candidates for the problem, made the choice in turn and compiled afresh
  (a CUDA graph keeps what it captured), gives an output that passes check(output, index); the
  timed choice is restored after."""
  ext = _ffi._jax_fp8_cuda
  ordinal = jax.devices("cuda")[0].local_hardware_id
  device = ext.gemm_device(ordinal)
  candidates, us, _, _ = ext.gemm_tune(ordinal, *problem)
  try:
    for i, algorithm in enumerate(candidates):
      ext.gemm_choose(device, *problem, algorithm)
      check(np.asarray(jax.jit(lambda: run())().astype(jnp.float32)), i)  # a new jit each
  finally:
    ext.gemm_choose(device, *problem, candidates[int(np.argmin(np.where(np.array(us) < 0,
                                                                         np.inf, us)))])


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA GPU with the jax_fp8 CUDA targets")
@pytest.mark.parametrize("fast_accum", [False, True])
def test_every_candidate_is_within_the_bound(rng, monkeypatch, fast_accum):
  """Whichever candidate wins the timing runs: each one gives a product within the
  accumulation bound (test_gemm's) of the f32 reference."""
  from test_gemm import accumulation_error
  m, n, k = 512, 1024, 4096
  a = jnp.asarray(rng.standard_normal((m, k)) * 4).astype(jnp.float8_e4m3fn)
  b = jnp.asarray(rng.standard_normal((n, k)) * 4).astype(jnp.float8_e4m3fn)
  one = jnp.float32(1)
  problem = (m, n, k, "float8_e4m3fn", "float8_e4m3fn", "float32", False, fast_accum, 0)
  want = on_cpu(lambda *v: reference.gemm(*v, out_dtype=jnp.float32), a, b, one, one)
  bound = accumulation_error(reference.gemm, a, b, one, one,
                             rel=2.0**-8 if fast_accum else 2.0**-12)

  def check(got, i):
    assert np.all(np.abs(got - want) <= bound), f"candidate {i}"
  monkeypatch.setenv(AUTOTUNE_ENV, "0")  # tracing must not choose again
  every_candidate(problem, lambda: jax_fp8.gemm(a, b, one, one, out_dtype=jnp.float32,
                                                fast_accum=fast_accum), check)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA GPU with the jax_fp8 CUDA targets")
@pytest.mark.parametrize("mode", [1, 2], ids=["b128x128", "b1x128"])
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32], ids=lambda d: jnp.dtype(d).name)
def test_every_block_candidate_is_within_the_bound(rng, monkeypatch, mode, out_dtype):
  """As above for block scaling: M, N and K not multiples of the 128-wide tiles (M padded to 4
  rows), K of 9 groups, the bounds of test_gemm's check_block_gemm."""
  from test_gemm import b_scale_shape, block_scales, check_block_gemm, fp8_operand
  m, n, k = 300, 400, 1152
  a, b = fp8_operand(rng, (m, k), "e4m3"), fp8_operand(rng, (n, k), "e4m3")
  sa, sb = block_scales(rng, (m, k // 128)), block_scales(rng, b_scale_shape(mode, n, k))
  problem = (-(-m // 4) * 4, n, k, "float8_e4m3fn", "float8_e4m3fn", jnp.dtype(out_dtype).name,
             False, False, mode)

  def check(got, i):
    try:
      check_block_gemm(jnp.asarray(got), a, b, sa, sb, None, out_dtype)
    except AssertionError as e:
      raise AssertionError(f"candidate {i}: {e}") from e
  monkeypatch.setenv(AUTOTUNE_ENV, "0")
  every_candidate(problem, lambda: jax_fp8.gemm(a, b, sa, sb, out_dtype=out_dtype), check)
