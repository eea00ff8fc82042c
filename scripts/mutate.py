"""Mutation check: deliberate bugs that the tests must catch (issue 50).

Each mutation below replaces one exact source snippet (found exactly once, else the script
fails loudly: retarget the entry when the code moves). For each, the repository's tracked files
(``git ls-files`` at ``--ref``, default the working tree) are copied to a temporary directory,
the replacement applied, the built extension modules copied into the copy's ``jax_fp8/`` (no
rebuild: the mutations are in Python), and the chosen test files run there with the copy's
package first on the path (the editable install's import redirect removed for that process).
The tests first run on the unmutated copy and must pass (exit 2 otherwise). A mutation is
"killed" when at least one test fails, "survived" when none does; the script exits 1 if any
survived.

  python scripts/mutate.py                      # the default tests, on the working tree
  python scripts/mutate.py --ref main --tests tests/test_linear.py ...
  python scripts/mutate.py --only dgrad-1.05 --python /path/to/venv/bin/python
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

# (name, file, exact snippet, replacement): one bug each, per recipe family.
MUTATIONS = [
    ("per-tensor dgrad x1.05", "jax_fp8/families/per_tensor.py",
     "    dx = dxi if dx is None else dx + dxi  # summed as autodiff sums",
     "    dxi = 1.05 * dxi\n    dx = dxi if dx is None else dx + dxi  # summed as autodiff sums"),
    ("per-tensor wgrad x1.05", "jax_fp8/families/per_tensor.py",
     'fast_accum="wgrad" in s.fast_accum).astype(k_dtype))  # wgrad [K, N]',
     'fast_accum="wgrad" in s.fast_accum).astype(k_dtype) * 1.05)  # wgrad [K, N]'),
    ("ring skips a step (update_state)", "jax_fp8/state.py",
     "  history = jnp.concatenate([front[None], ring.amax_history[:-1]])",
     "  history = ring.amax_history"),
    ("scale inverted (ring rule)", "jax_fp8/state.py",
     "  s = jnp.clip(amax * np.float32(2.0**margin / fp8_max(fmt)), tiny, big)",
     "  s = jnp.clip(1 / (amax * np.float32(2.0**margin / fp8_max(fmt))), tiny, big)"),
    ("transposed copy swapped (x's data for data_t)", "jax_fp8/families/per_tensor.py",
     "  saved = (transposed(qx), tuple(rowwise(ck.tensor) for ck in cks),",
     "  saved = (Quantized(data_t=qx.data, scale=qx.scale), tuple(rowwise(ck.tensor) for ck in "
     "cks),"),
    ("grouped dgrad x1.05", "jax_fp8/families/per_tensor_grouped.py",
     "                      out_dtype=gemm_out(dtype)).astype(dtype)  # dgrad [M, K]",
     "                      out_dtype=gemm_out(dtype)).astype(dtype) * 1.05  # dgrad [M, K]"),
    ("grouped wgrad x1.05", "jax_fp8/families/per_tensor_grouped.py",
     "                            out_dtype=gemm_out(dtype)).astype(dtype)  # wgrad [G, K, N]",
     "                            out_dtype=gemm_out(dtype)).astype(dtype) * 1.05  # wgrad"),
    ("grouped wgrad groups left unaligned", "jax_fp8/families/_shared.py",
     "  if not aligned and rows and group_sizes.shape[0] > 1:",
     "  if False:"),
    ("grouped MLP dgrad through the activation x1.05", "jax_fp8/families/per_tensor_grouped.py",
     "  dx = _dgrad(cdy.tensor, saved.k_in, group_sizes, x_dtype)  # [M, K]",
     "  dx = _dgrad(cdy.tensor, saved.k_in, group_sizes, x_dtype) * 1.05  # [M, K]"),
    ("block grouped dgrad x1.05", "jax_fp8/families/block_grouped.py",
     "                      out_dtype=gemm_out(dtype)).astype(dtype)  # dgrad [M, K]",
     "                      out_dtype=gemm_out(dtype)).astype(dtype) * 1.05  # dgrad [M, K]"),
    ("block grouped wgrad x1.05", "jax_fp8/families/block_grouped.py",
     "                            out_dtype=gemm_out(dtype)).astype(dtype)  # wgrad [G, K, N]",
     "                            out_dtype=gemm_out(dtype)).astype(dtype) * 1.05  # wgrad"),
    ("block grouped groups left unaligned", "jax_fp8/families/block_grouped.py",
     "  src, sizes = wgrad_layout(group_sizes, rows, aligned, BLOCK_ROW_ALIGN)",
     "  src, sizes = wgrad_layout(group_sizes, rows, True, BLOCK_ROW_ALIGN)"),
    ("block grouped MLP dgrad through the activation x1.05", "jax_fp8/families/block_grouped.py",
     "  dx = _dgrad(qdy.rows, saved.k_in, group_sizes, x_dtype)  # [M, K]",
     "  dx = _dgrad(qdy.rows, saved.k_in, group_sizes, x_dtype) * 1.05  # [M, K]"),
    ("block dgrad x1.05", "jax_fp8/families/block.py",
     "               out_dtype=gemm_dtype(x_dtype))  # dgrad: 1x128 . 128x128",
     "               out_dtype=gemm_dtype(x_dtype)) * 1.05  # dgrad: 1x128 . 128x128"),
    ("MXFP8 dgrad x1.05", "jax_fp8/families/mxfp8.py",
     "    dxi = mxfp8_gemm(qg.data, qk.data, qg.scale, qk.scale, out_dtype=jnp.float32)  # [M32, "
     "K]",
     "    dxi = 1.05 * mxfp8_gemm(qg.data, qk.data, qg.scale, qk.scale, out_dtype=jnp.float32)"),
    ("NVFP4 dgrad x1.05", "jax_fp8/families/nvfp4.py",
     "                     out_dtype=jnp.float32)[:m]  # dgrad [M, K]",
     "                     out_dtype=jnp.float32)[:m] * 1.05  # dgrad [M, K]"),
]

DEFAULT_TESTS = ["tests/test_backward_twins.py", "tests/test_state.py",
                 "tests/test_mxfp8_block_scaling.py", "tests/test_nvfp4_block_scaling.py",
                 "tests/test_grouped_linear.py", "tests/test_grouped_mlp.py"]

# Run pytest in the copy with the copy's jax_fp8, not the editable install's: scikit-build-core's
# editable install puts a redirecting finder on sys.meta_path ahead of sys.path.
_BOOT = """
import sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__]
sys.path.insert(0, {root!r})
import pytest
sys.exit(pytest.main({args!r}))
"""


def extension_files(python: str) -> list[str]:
  """The built extension modules the given Python imports (CPU, and CUDA where built)."""
  code = ("import jax_fp8._ffi as f\n"
          "for m in (f._jax_fp8_cpu, getattr(f, '_jax_fp8_cuda', None)):\n"
          "  print(getattr(m, '__file__', '') or '')")
  out = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True)
  return [p for p in out.stdout.split() if p.endswith(".so")]


def copy_tree(repo: str, ref: str | None, dest: str, ext: list[str]) -> None:
  """The tracked files at ``ref`` (None: the working tree's) and the extension modules."""
  if ref is None:
    files = subprocess.run(["git", "ls-files", "-z"], cwd=repo, capture_output=True,
                           check=True).stdout.decode().split("\0")
    for f in filter(None, files):
      src = os.path.join(repo, f)
      if os.path.isfile(src):
        os.makedirs(os.path.dirname(os.path.join(dest, f)), exist_ok=True)
        shutil.copy2(src, os.path.join(dest, f))
  else:
    archive = subprocess.run(["git", "archive", ref], cwd=repo, capture_output=True,
                             check=True).stdout
    subprocess.run(["tar", "-x", "-C", dest], input=archive, check=True)
  for so in ext:
    shutil.copy2(so, os.path.join(dest, "jax_fp8", os.path.basename(so)))


def apply(dest: str, file: str, snippet: str, replacement: str) -> None:
  path = os.path.join(dest, file)
  text = open(path).read()
  count = text.count(snippet)
  if count != 1:
    raise SystemExit(f"mutate.py: the snippet for {file} occurs {count} times (want 1): "
                     f"retarget it\n{snippet}")
  open(path, "w").write(text.replace(snippet, replacement))


def run_tests(python: str, root: str, k: str, tests: list[str]):
  """pytest's exit code and last line for ``tests`` in the tree at ``root``, stopping at the
  first failure."""
  args = ["-q", "-x", "-n", "0", "-p", "no:cacheprovider", "-k", k, *tests]
  run = subprocess.run([python, "-c", _BOOT.format(root=root, args=args)], cwd=root,
                       capture_output=True, text=True)
  return run.returncode, (run.stdout.strip().splitlines() or [""])[-1]


def main() -> int:
  repo = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                        check=True, cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--python", default=sys.executable, help="the Python to run pytest with")
  ap.add_argument("--ref", default=None, help="a git ref whose tree to copy (default: the "
                  "working tree's tracked files)")
  ap.add_argument("--tests", nargs="+", default=DEFAULT_TESTS)
  ap.add_argument("-k", default="not cuda", help="pytest -k expression (default: CPU cases)")
  ap.add_argument("--only", nargs="*", help="run only the mutations whose names contain these")
  opts = ap.parse_args()
  ext = extension_files(opts.python)
  chosen = [m for m in MUTATIONS if not opts.only or any(o in m[0] for o in opts.only)]
  survived = []
  with tempfile.TemporaryDirectory(prefix="jax_fp8_mutate_") as tmp:
    pristine = os.path.join(tmp, "pristine")
    os.makedirs(pristine)
    copy_tree(repo, opts.ref, pristine, ext)
    tests = [t for t in opts.tests if os.path.exists(os.path.join(pristine, t))]
    print(f"tests ({opts.ref or 'working tree'}): {' '.join(tests)} -k {opts.k!r}", flush=True)
    code, tail = run_tests(opts.python, pristine, opts.k, tests)
    if code != 0:  # else a failure under a mutation would say nothing of the mutation
      print(f"mutate.py: the tests fail without a mutation ({tail}): fix them first")
      return 2
    print(f"unmutated: {tail}", flush=True)
    for name, file, snippet, replacement in chosen:
      dest = os.path.join(tmp, "mutant")
      shutil.rmtree(dest, ignore_errors=True)
      shutil.copytree(pristine, dest, symlinks=True)
      apply(dest, file, snippet, replacement)
      start = time.time()
      code, tail = run_tests(opts.python, dest, opts.k, tests)
      if code == 1:
        verdict = "killed"
      elif code == 0:
        verdict = "SURVIVED"
        survived.append(name)
      else:  # collection errors, an interrupted run: the mutation broke the tests' setup
        verdict = f"killed (pytest exit {code})"
      print(f"{verdict:9s} {name}  [{time.time() - start:.0f} s: {tail}]", flush=True)
  print(f"{len(chosen) - len(survived)} of {len(chosen)} killed"
        + (f"; survived: {', '.join(survived)}" if survived else ""))
  return 1 if survived else 0


if __name__ == "__main__":
  sys.exit(main())
