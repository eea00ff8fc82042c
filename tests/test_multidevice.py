"""Multi-device training: data parallel, FSDP and tensor parallel (column and row) linears (and a
data-parallel jax_fp8.nnx model) under shard_map give the single-device results, and every
device ends the step with the same rings.

The meshes use the CUDA GPUs where there are two or more (their collectives run over NCCL),
else eight virtual CPU devices (conftest). The single-device reference runs on the first of
those devices."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P

import jax_fp8
import jax_fp8.nnx
from jax_fp8.state import next_ring
from conftest import HAS_CUDA, assert_same_quantized, jitted, roundoff, summation_error


def _mesh_devices():
  try:
    gpus = jax.devices("cuda")
  except RuntimeError:
    gpus = []
  if HAS_CUDA and len(gpus) >= 2:  # 2, 4 or 8 of them: M, K and N split evenly
    return gpus[:min(8, 1 << (len(gpus).bit_length() - 1))]
  return jax.devices("cpu")[:8]


DEVICES = _mesh_devices()
NDEV = len(DEVICES)  # 2, 4 or 8
PLATFORM = DEVICES[0].platform

M, K, N = 128, 64, 128  # split 8 ways (or over a 2 x 4 mesh) K, N / 4 stay multiples of 16


def order_bounds(x, w, b, g):
  """Elementwise bounds on |sharded - single device| for y, dx, dw and db. The same
  quantization everywhere, so only summation order differs: 2 * summation_error(n) of the
  products' magnitudes for sums of n terms (on GPUs the FP8 tensor cores accumulate in about 14
  bits and cuBLASLt may pick another kernel for a shard's shape than for the whole, see
  docs/design.md); quantization grows the magnitudes by at most (1 + 2^-4) (1 + 2^-3)."""
  x, w, b, g = (np.abs(np.asarray(v, np.float64)) for v in (x, w, b, g))
  q = (1 + roundoff("e4m3")) * (1 + roundoff("e5m2"))
  e = lambda n: 2 * summation_error(n, PLATFORM)  # noqa: E731
  return (e(K + 1) * (q * x @ w + b), e(N) * q * g @ w.T, e(M) * q * x.T @ g, e(M) * g.sum(0))


def warm_state(x, w, g):
  """A state past its first step, recorded from the full tensors: from here on every device
  quantizes with the same (delayed) scales as one device would, so results can be compared
  tightly."""
  amax = lambda v: jnp.max(jnp.abs(v))
  s = jax_fp8.LinearState.create()
  return jax_fp8.LinearState(next_ring(s.x, amax(x)), next_ring(s.kernel, amax(w)),
                             next_ring(s.grad, amax(g)))


@pytest.fixture
def problem(rng):
  x = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((K, N)) / 8, jnp.float32)
  b = jnp.asarray(rng.standard_normal(N), jnp.float32)
  g = jnp.asarray(rng.standard_normal((M, N)), jnp.float32)  # dL/dy
  return x, w, b, g, warm_state(x, w, g)


@jax.jit
def _one_device_step(x, w, b, g, state):
  """y and the gradients of x, w, b and the state; jitted once at the problem's shapes for all
  the tests that compare with it."""
  y, vjp = jax.vjp(lambda x, w, b, s: jax_fp8.linear(x, w, b, state=s), x, w, b, state)
  return (y, *vjp(g))


def single_device(x, w, b, g, state):
  """The reference: one device of the meshes' platform."""
  one = DEVICES[0]
  x, w, b, g, state = jax.device_put((x, w, b, g, state), one)
  with jax.default_device(one):
    y, dx, dw, db, obs = _one_device_step(x, w, b, g, state)
    return y, dx, dw, db, jax_fp8.update_state(state, obs)


def check(got, want, problem):
  """y, dx, dw and db within ``order_bounds`` of one device's, and the rings equal."""
  for name, a, r, bound in zip(("y", "dx", "dw", "db"), got[:4], want[:4],
                               order_bounds(*problem[:4])):
    err = np.abs(np.asarray(a, np.float64) - np.asarray(r, np.float64))
    assert np.all(err <= bound), (name, np.max(err / bound))
  for a, r in zip(jax.tree.leaves(got[4]), jax.tree.leaves(want[4])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(r))


def reduced_elements(hlo: str) -> int:
  """How many f32 elements a compiled program all-reduces. XLA:CPU combines reductions into
  tuples (``(f32[2], f32[1]) all-reduce(``); XLA:GPU concatenates them into flat buffers
  reduced asynchronously, whose results ``all-reduce-done(`` gives."""
  total = 0
  for line in hlo.splitlines():
    op = re.search(r" all-reduce(-done)?\(", line)
    if op:
      for dims in re.findall(r"f32\[([\d,]*)\]", line[:op.start()].split("=", 1)[1]):
        total += int(np.prod([int(d) for d in dims.split(",") if d]))
  return total


def per_device_rings(state, axes):
  """The state as each device holds it, stacked on a leading axis (to compare them)."""
  return jax.tree.map(lambda v: jax.lax.pcast(v, axes, to="varying")[None], state)


def test_data_parallel(problem):
  x, w, b, g, state = problem
  mesh = Mesh(np.array(DEVICES), ("data",))

  def step(x, w, b, g, state):
    y, vjp = jax.vjp(lambda x, w, b, s: jax_fp8.linear(x, w, b, state=s,
                                                       amax_axis_name="data"), x, w, b, state)
    dx, dw, db, obs = vjp(g)  # dw, db: summed over the devices
    new = jax_fp8.update_state(state, obs)
    return y, dx, dw, db, new, per_device_rings(new, ("data",))

  run = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P("data"), P(), P(), P("data"), P()),
                              out_specs=(P("data"), P("data"), P(), P(), P(), P("data"))))
  *got, copies = run(x, w, b, g, state)
  check(got, single_device(x, w, b, g, state), problem)
  for leaf in jax.tree.leaves(copies):  # every device holds the same rings, bit for bit
    assert np.all(np.asarray(leaf) == np.asarray(leaf)[:1])

  # The compiled step gathers no activations, and reduces only the gradients of the
  # replicated kernel and bias and the rings' observations written by the kernels (history,
  # scale and steps of x and kernel in one, of grad in one; XLA may combine reductions into
  # tuples).
  hlo = run.lower(x, w, b, g, state).compile().as_text()
  assert "all-gather" not in hlo
  history = state.x.amax_history.shape[0]
  assert reduced_elements(hlo) == 3 * (history + 2) + K * N + N


def test_fsdp(problem):
  """The kernel lives sharded over the data axis and is gathered for the GEMM; its gradient
  comes back reduce-scattered."""
  x, w, b, g, state = problem
  mesh = Mesh(np.array(DEVICES), ("data",))

  def step(x, w_shard, b, g, state):
    def f(x, w_shard, b, s):
      w = jax.lax.all_gather(w_shard, "data", axis=0, tiled=True)
      return jax_fp8.linear(x, w, b, state=s, amax_axis_name="data")
    y, vjp = jax.vjp(f, x, w_shard, b, state)
    dx, dw_shard, db, obs = vjp(g)
    return y, dx, dw_shard, db, jax_fp8.update_state(state, obs)

  run = jax.jit(jax.shard_map(step, mesh=mesh,
                              in_specs=(P("data"), P("data"), P(), P("data"), P()),
                              out_specs=(P("data"), P("data"), P("data"), P(), P())))
  check(run(x, w, b, g, state), single_device(x, w, b, g, state), problem)


def test_tensor_parallel_column_and_row(problem):
  """Megatron-style: column-parallel (kernel split on N, y split on N) and row-parallel
  (kernel split on K, x split on K, partial y summed; the bias added once, after the sum), on a
  2 x 4 (data, model) mesh (1 x 2 or 2 x 2 on fewer GPUs)."""
  x, w, b, g, state = problem
  mesh = Mesh(np.array(DEVICES).reshape(2 if NDEV >= 4 else 1, -1), ("data", "model"))
  axes = ("data", "model")
  want = single_device(x, w, b, g, state)

  def column(x, w, b, g, state):
    y, vjp = jax.vjp(lambda x, w, b, s: jax_fp8.linear(x, w, b, state=s, amax_axis_name=axes),
                     x, w, b, state)
    dx, dw, db, obs = vjp(g)
    return y, dx, dw, db, jax_fp8.update_state(state, obs)

  run = jax.jit(jax.shard_map(
      column, mesh=mesh, in_specs=(P("data"), P(None, "model"), P("model"),
                                   P("data", "model"), P()),
      out_specs=(P("data", "model"), P("data"), P(None, "model"), P("model"), P())))
  check(run(x, w, b, g, state), want, problem)

  def row(x, w, b, g, state):
    def f(x, w, b, s):
      partial = jax_fp8.linear(x, w, state=s, amax_axis_name=axes)
      return jax.lax.psum(partial, "model") + b
    y, vjp = jax.vjp(f, x, w, b, state)
    dx, dw, db, obs = vjp(g)
    return y, dx, dw, db, jax_fp8.update_state(state, obs)

  run = jax.jit(jax.shard_map(
      row, mesh=mesh, in_specs=(P("data", "model"), P("model"), P(), P("data"), P()),
      out_specs=(P("data"), P("data", "model"), P("model"), P(), P())))
  # Row-parallel: each device's gradient ring sees dL/dy (replicated over "model"), so the
  # rings equal the single-device ones too.
  check(run(x, w, b, g, state), want, problem)


def test_rings_owned_per_device(problem):
  """A state that varies over the axis (one set of rings per device, as pipeline stages own
  theirs) records each device's own amax: nothing is reduced across devices."""
  x, w, b, g, state = problem
  mesh = Mesh(np.array(DEVICES[:2]), ("stage",))
  xs = jnp.stack([x, 10 * x])  # stage 1 sees 10x larger activations
  stacked = jax.tree.map(lambda v: jnp.stack([v, v]), state)

  def step(x, s):
    s = jax.tree.map(lambda v: v[0], s)
    _, vjp = jax.vjp(lambda s: jax_fp8.linear(x[0], w, b, state=s), s)
    new = jax_fp8.update_state(s, vjp(jax.lax.pcast(g, ("stage",), to="varying"))[0])
    return jax.tree.map(lambda v: v[None], new)

  new = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P("stage"), P("stage")),
                              out_specs=P("stage")))(xs, stacked)
  front = np.asarray(new.x.amax_history[:, 0])
  np.testing.assert_array_equal(front, [np.max(np.abs(np.asarray(x))),
                                       np.max(np.abs(10 * np.asarray(x)))])  # maxima: exact


def test_unchecked_shard_map(problem):
  """With check_vma=False the library cannot see which axes vary: by default it reduces over
  every manual axis, so every device records the same rings; () asks for no reduction."""
  x, w, b, g, state = problem
  mesh = Mesh(np.array(DEVICES), ("data",))

  def step(axis_name, x, g, state):
    _, vjp = jax.vjp(lambda s: jax_fp8.linear(x, w, b, state=s, amax_axis_name=axis_name), state)
    new = jax_fp8.update_state(state, vjp(g)[0])
    return jax.tree.map(lambda v: v[None], new)  # each device's copy, unchecked

  def run(axis_name):
    return jax.jit(jax.shard_map(lambda *a: step(axis_name, *a), mesh=mesh,
                                 in_specs=(P("data"), P("data"), P()), out_specs=P("data"),
                                 check_vma=False))(x, g, state)

  for name in (None, "data"):
    copies = run(name)
    for leaf in jax.tree.leaves(copies):
      assert np.all(np.asarray(leaf) == np.asarray(leaf)[:1])
    np.testing.assert_array_equal(np.asarray(copies.x.amax_history[0, 0]),
                                  np.max(np.abs(np.asarray(x))))
  local = np.asarray(run(()).x.amax_history[:, 0])  # each device's own slice of x
  np.testing.assert_array_equal(local, np.abs(np.asarray(x)).reshape(NDEV, -1).max(axis=1))


def test_named_axis_reduces_even_for_a_per_device_state(problem):
  """A state stacked per device (as ported pmap code passes it) but with the axis named:
  the named axis is reduced, so every device records the same amax, as under pmap."""
  x, w, b, g, state = problem
  mesh = Mesh(np.array(DEVICES[:2]), ("data",))
  stacked = jax.tree.map(lambda v: jnp.stack([v, v]), state)

  def step(x, s):
    s = jax.tree.map(lambda v: v[0], s)
    _, vjp = jax.vjp(lambda s: jax_fp8.linear(x, w, b, state=s, amax_axis_name="data"), s)
    new = jax_fp8.update_state(s, vjp(jax.lax.pcast(g[:64], ("data",), to="varying"))[0])
    return jax.tree.map(lambda v: v[None], new)

  new = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P("data"), P("data")),
                              out_specs=P("data")))(x, stacked)
  np.testing.assert_array_equal(np.asarray(new.x.amax_history[:, 0]),
                                [np.max(np.abs(np.asarray(x)))] * 2)


@pytest.mark.parametrize("name,shared", [(None, True), ("r", True), ((), False)])
def test_pmap_axis_defaults(problem, name, shared):
  """Under pmap: None and the axis name share the rings; () keeps each device's own."""
  x, w, b, g, state = problem
  xs = jnp.stack([x, 3 * x])
  rep = jax.tree.map(lambda v: jnp.stack([v, v]), state)

  def step(x, s):
    _, vjp = jax.vjp(lambda s: jax_fp8.linear(x, w, b, state=s, amax_axis_name=name), s)
    return jax_fp8.update_state(s, vjp(g)[0])

  new = jax.pmap(step, axis_name="r", devices=DEVICES[:2])(xs, rep)
  own = [float(m) for m in np.abs(np.asarray(xs)).max(axis=(1, 2))]
  want = [max(own)] * 2 if shared else own
  np.testing.assert_array_equal(np.asarray(new.x.amax_history[:, 0]), want)  # maxima: exact


# Plain jit over a mesh, no shard_map: the ops' sharding rules (jax_fp8/sharding.py) keep the
# operands split and add the reductions. Specs of x, kernel, bias and the output gradient.
SHARDED_JIT = {
    "data_parallel": (P("data"), P(), P(), P("data")),
    "fsdp": (P("data"), P("data"), P(), P("data")),
    "tensor_column": (P(), P(None, "model"), P("model"), P(None, "model")),
    "tensor_row": (P(None, "model"), P("model"), P(), P()),
    "data_and_model": (P("data"), P(None, "model"), P("model"), P("data", "model")),
}


def sharded_jit_args(specs, values):
  """The mesh of a SHARDED_JIT case, 2 x (NDEV / 2) (on two GPUs the axis the case splits gets
  both of them; data_and_model then splits on the model axis only), and ``values`` (x, w, b, g
  and optionally a state, replicated) placed on it."""
  splits_model = any("model" in spec for spec in specs)
  shape = (NDEV // 2, 2) if NDEV >= 4 else ((1, 2) if splits_model else (2, 1))
  mesh = Mesh(np.array(DEVICES).reshape(shape), ("data", "model"))
  put = lambda v, s: jax.device_put(v, jax.sharding.NamedSharding(mesh, s))  # noqa: E731
  return mesh, [put(v, s) for v, s in zip(values, (*specs, P()))]


@pytest.mark.parametrize("name", SHARDED_JIT)
def test_sharded_jit(problem, name):
  x, w, b, g, state = problem
  specs = SHARDED_JIT[name]
  mesh, args = sharded_jit_args(specs, (x, w, b, g, state))

  @jax.jit
  def step(x, w, b, g, state):
    y, vjp = jax.vjp(lambda x, w, b, s: jax_fp8.linear(x, w, b, state=s), x, w, b, state)
    dx, dw, db, obs = vjp(g)
    return y, dx, dw, db, jax_fp8.update_state(state, obs)

  got = step(*args)
  check(got, single_device(x, w, b, g, state), problem)
  pieces = lambda spec, i: mesh.shape[spec[i]] if len(spec) > i and spec[i] else 1
  want_shard = (M // pieces(specs[0], 0), N // pieces(specs[1], 1))
  assert got[0].sharding.shard_shape((M, N)) == want_shard  # y split as x's rows, w's columns
  hlo = step.lower(*args).compile().as_text()
  if name == "data_parallel":
    # No activation gathered; reductions only for the replicated kernel's and bias's
    # gradients and the amaxes of x and the output gradient (value and NaN flag; once more in
    # each fresh-ring branch, which XLA may combine). A reduced activation would add at
    # least M * K / NDEV elements.
    assert "all-gather" not in hlo
    assert K * N + N < reduced_elements(hlo) <= 2 * 2 * 2 + K * N + N


def test_sharded_jit_fresh_rings(rng):
  """On a ring's first step every device quantizes with the scale from the global amax, so a
  sharded step equals one device's even then (and NaN stays visible in the amax)."""
  x = jnp.asarray(rng.standard_normal((M, K)) * 5, jnp.float32).at[3, 7].set(40.0)
  mesh = Mesh(np.array(DEVICES), ("data",))
  xs = jax.device_put(x, jax.sharding.NamedSharding(mesh, P("data")))
  ring = jax_fp8.ScaleRing.create(4)
  got = jax.jit(lambda x, r: jax_fp8.cast_transpose_delayed(x, r, with_dbias=True))(xs, ring)
  with jax.default_device(DEVICES[0]):
    want = jax_fp8.cast_transpose_delayed(x, ring, with_dbias=True)
  assert_same_cast_transpose(got, want)
  assert float(got.tensor.amax) == 40.0
  absum = np.abs(np.asarray(x, np.float64)).sum(axis=0)  # dbias: column sums in two orders
  assert np.all(np.abs(np.asarray(got.dbias) - np.asarray(want.dbias))
                <= 2 * summation_error(M) * absum)
  a_nan = jax.jit(lambda x, r: jax_fp8.quantize_delayed(x, r).tensor.amax)(
      jax.device_put(x.at[M - 1, 0].set(jnp.nan), jax.sharding.NamedSharding(mesh, P("data"))),
      ring)
  assert np.isnan(float(a_nan))


def assert_same_cast_transpose(got, want):
  """Two cast-transposes' ``DelayedQuantized`` bit for bit: both layouts, amax, scale and
  ring."""
  assert_same_quantized(got.tensor, want.tensor)
  for u, v in zip(jax.tree.leaves(got.ring), jax.tree.leaves(want.ring)):
    np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


@pytest.mark.parametrize("spec", [("data", None), (None, "data")], ids=["rows", "cols"])
def test_sharded_jit_cast_transpose_of_parts(rng, spec):
  """x in parts under a sharded jit (rows split; split columns gathered, the parts' columns
  not being the output's) equals one device's, fresh ring and dbias included."""
  xs = [jnp.asarray(rng.standard_normal((M, c)) * 3, jnp.bfloat16) for c in (K, 2 * K, K)]
  mesh = Mesh(np.array(DEVICES), ("data",))
  put = lambda v: jax.device_put(v, jax.sharding.NamedSharding(mesh, P(*spec)))  # noqa: E731
  op = jax.jit(lambda xs, r: jax_fp8.cast_transpose_delayed(xs, r, with_dbias=True))
  ring = jax_fp8.ScaleRing.create(4)
  got = op([put(v) for v in xs], ring)
  with jax.default_device(DEVICES[0]):
    want = op(xs, ring)
  assert_same_cast_transpose(got, want)
  absum = np.abs(np.concatenate([np.asarray(v, np.float64) for v in xs], axis=1)).sum(axis=0)
  assert np.all(np.abs(np.asarray(got.dbias) - np.asarray(want.dbias))
                <= 2 * summation_error(M) * absum)


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_sharded_jit_activation_cast_transposes(rng, activation):
  """The activation ops under a sharded jit (rows split; a gated activation's columns kept
  whole, its gate and up halves being far apart) equal one device's, fresh ring included (its
  scale from the kernels' own amaxes, max-reduced)."""
  gated = activation == "swiglu"
  y = jnp.asarray(rng.standard_normal((M, 2 * K if gated else K)) * 3, jnp.float32)
  dh = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)
  mesh = Mesh(np.array(DEVICES), ("data",))
  put = lambda v: jax.device_put(v, jax.sharding.NamedSharding(mesh, P("data")))  # noqa: E731
  fwd = lambda y, r: jax_fp8.activation_cast_transpose(y, r, activation=activation)  # noqa: E731
  bwd = lambda dh, y, r: jax_fp8.activation_grad_cast_transpose(  # noqa: E731
      dh, y, r, activation=activation, with_dbias=True)
  ring = jax_fp8.ScaleRing.create(4)
  got = jax.jit(fwd)(put(y), ring), jax.jit(bwd)(put(dh), put(y), ring)
  with jax.default_device(DEVICES[0]):
    want = fwd(y, ring), bwd(dh, y, ring)
  for g, w in zip(got, want):
    assert_same_cast_transpose(g, w)
  v = np.abs(np.asarray(jitted(jax_fp8.activations.grad, dh, y, activation=activation),
                        np.float64)).sum(axis=0)
  assert np.all(np.abs(np.asarray(got[1].dbias) - np.asarray(want[1].dbias))
                <= 2 * summation_error(M) * v)


@pytest.mark.parametrize("spec", [("data", None), (None, "data")], ids=["rows", "cols"])
def test_sharded_jit_norm_cast_transpose(rng, spec):
  """norm_cast_transpose under a sharded jit, rows or columns split (each element needs only
  its row's statistics and its column's gamma and beta), equals one device's, fresh ring
  included."""
  x = jnp.asarray(rng.standard_normal((M, 2 * K)) * 3, jnp.float32)
  gamma, beta = jnp.linspace(0.5, 1.5, 2 * K), jnp.linspace(-1, 1, 2 * K)
  mesh = Mesh(np.array(DEVICES), ("data",))
  put = lambda v, s: jax.device_put(v, jax.sharding.NamedSharding(mesh, P(*s)))  # noqa: E731
  row_stats = jax_fp8.norms.stats(x, "layernorm", 1e-6)
  op = jax.jit(lambda *a: jax_fp8.norm_cast_transpose(*a, norm="layernorm"))
  ring = jax_fp8.ScaleRing.create(4)
  got = op(put(x, spec), put(row_stats, (spec[0], None)), put(gamma, spec[1:]),
           put(beta, spec[1:]), ring)
  with jax.default_device(DEVICES[0]):
    want = op(x, row_stats, gamma, beta, ring)
  assert_same_cast_transpose(got, want)


@pytest.mark.parametrize("spec", [("data", None), (None, "data")], ids=["rows", "cols"])
def test_sharded_jit_block_sources(rng, spec):
  """Block scaling's group cast-transposes of a norm, an activation and the gradient through
  it under a sharded jit, rows or columns split in whole 128-element groups (a gated
  activation's columns kept whole), equal one device's byte for byte."""
  n = 128 * len(DEVICES)
  x = jnp.asarray(rng.standard_normal((n, n)) * 3, jnp.bfloat16)
  y = jnp.asarray(rng.standard_normal((n, 2 * n)) * 3, jnp.bfloat16)
  gamma = jnp.linspace(0.5, 1.5, n)
  mesh = Mesh(np.array(DEVICES), ("data",))
  put = lambda v, s: jax.device_put(v, jax.sharding.NamedSharding(mesh, P(*s)))  # noqa: E731
  row_stats = jax_fp8.norms.stats(x, "rmsnorm", 1e-6)
  ops = [
      (lambda x, st, g: jax_fp8.norm_group_cast_transpose(x, st, g, None, norm="rmsnorm"),
       (x, row_stats, gamma), (spec, (spec[0], None), spec[1:])),
      (lambda x: jax_fp8.activation_group_cast_transpose(x, activation="gelu"), (x,), (spec,)),
      (lambda y: jax_fp8.activation_group_cast_transpose(y, activation="swiglu"), (y,), (spec,)),
      (lambda dh, y: jax_fp8.activation_grad_group_cast_transpose(dh, y, activation="gelu"),
       (x, y[:, :n]), (spec, spec)),
      (lambda dh, y: jax_fp8.activation_grad_group_cast_transpose(dh, y, activation="swiglu"),
       (x, y), (spec, spec)),
  ]
  for op, args, specs in ops:
    got = jax.jit(op)(*(put(a, s) for a, s in zip(args, specs)))
    with jax.default_device(DEVICES[0]):
      want = jax.jit(op)(*args)
    assert_same_quantized(got, want)


ONE_GROUP = {  # op, then its arguments' shapes with a grouped dimension of exactly one group
    "activation_group_cast_transpose": (
        lambda x: jax_fp8.activation_group_cast_transpose(x, activation="gelu"), [(128, 128)]),
    "swiglu_group_cast_transpose": (
        lambda x: jax_fp8.activation_group_cast_transpose(x, activation="swiglu"), [(128, 256)]),
    "swiglu_grad_group_cast_transpose": (
        lambda dh, y: jax_fp8.activation_grad_group_cast_transpose(dh, y, activation="swiglu"),
        [(128, 128), (128, 256)]),
    "norm_group_cast_transpose": (  # rsigma > 0 from any draw
        lambda x, st: jax_fp8.norm_group_cast_transpose(
            x, jnp.abs(st.astype(jnp.float32)) + 0.5, jnp.ones(x.shape[1]), None,
            norm="rmsnorm"),
        [(128, 128), (128, 1)]),
    "group_quantize": (jax_fp8.group_quantize, [(128, 128)]),
    "block_quantize": (jax_fp8.block_quantize, [(128, 128)]),
    "mxfp8_quantize": (lambda x: jax_fp8.mxfp8_quantize(x, columnwise=True), [(32, 32)]),
    "nvfp4_quantize": (lambda x: jax_fp8.nvfp4_quantize(x, columnwise=True), [(16, 16)]),
}


@pytest.mark.parametrize("name", ONE_GROUP)
def test_sharded_jit_one_group(rng, name):
  """A dimension of exactly one group (one scale) beside a split one lowers under a sharded jit
  (Shardy takes no size-1 factor in a compound) and equals one device's byte for byte."""
  op, shapes = ONE_GROUP[name]
  mesh = Mesh(np.array(DEVICES), ("data",))
  for split in (0, 1):  # the grouped dimension beside the split one, then split itself
    splits = [tuple(i == split and d > 1 for i, d in enumerate(s)) for s in shapes]
    args = [jnp.asarray(rng.standard_normal(tuple(d * NDEV if on else d for d, on in zip(s, on)))
                        * 3, jnp.bfloat16) for s, on in zip(shapes, splits)]
    got = jax.jit(op)(*(jax.device_put(a, jax.sharding.NamedSharding(
        mesh, P(*("data" if o else None for o in on)))) for a, on in zip(args, splits)))
    with jax.default_device(DEVICES[0]):
      want = jax.jit(op)(*args)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
      np.testing.assert_array_equal(np.asarray(g).reshape(-1).view(np.uint8),
                                    np.asarray(w).reshape(-1).view(np.uint8))


@pytest.mark.parametrize("dims", [(1, 1, 1), (NDEV, 1, 1), (1, NDEV, 1), (1, 1, NDEV)],
                         ids=["mkn", "m", "k", "n"])
def test_block_scaling_sharded_jit_one_group(rng, dims):
  """BlockScaling's linear with M, K and N each one 128-group, or one of them split over the
  devices in whole groups, under a sharded jit equals one device's up to the order of sums."""
  m, k, n = (128 * d for d in dims)
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((k, n)) / 8, jnp.float32)
  g = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)
  mesh = Mesh(np.array(DEVICES), ("data",))
  split = [P("data" if dims[0] > 1 else None, "data" if dims[1] > 1 else None),
           P("data" if dims[1] > 1 else None, "data" if dims[2] > 1 else None)]

  def step(x, w, g):
    y, vjp = jax.vjp(lambda x, w: jax_fp8.linear(x, w, recipe=jax_fp8.BlockScaling()), x, w)
    return (y, *vjp(g))

  got = jax.jit(step)(*(jax.device_put(v, jax.sharding.NamedSharding(mesh, s))
                        for v, s in zip((x, w), split)), g)
  with jax.default_device(DEVICES[0]):
    want = jax.jit(step)(x, w, g)
  close_to(got, want)


@pytest.mark.parametrize("ndev", [4, 8])
@pytest.mark.parametrize("split", ["kernel_k", "x_k", "kernel_n"])
def test_block_scaling_groups_split_unevenly(rng, split, ndev):
  """A dimension of six 128-groups split over 4 or 8 devices (gcd 2: Shardy splits the axis
  into sub-axes, which no partition spec names) is gathered, not a compile error:
  BlockScaling's linear and its gradients equal one device's up to the order of sums,
  block_quantize's bytes one device's exactly."""
  if NDEV < ndev:
    pytest.skip(f"{NDEV} devices")
  mesh = Mesh(np.array(DEVICES[:ndev]), ("fsdp",))
  m, k, n = 128, 768, 768
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((k, n)) / 8, jnp.float32)
  g = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)
  specs = {"kernel_k": (P(), P("fsdp", None)), "x_k": (P(None, "fsdp"), P()),
           "kernel_n": (P(), P(None, "fsdp"))}[split]

  def step(x, w, g):
    y, vjp = jax.vjp(lambda x, w: jax_fp8.linear(x, w, recipe=jax_fp8.BlockScaling()), x, w)
    blocks = jax_fp8.block_quantize(w)
    return (y, *vjp(g), blocks.data, blocks.scale)

  got = jax.jit(step)(*(jax.device_put(v, jax.sharding.NamedSharding(mesh, s))
                        for v, s in zip((x, w), specs)), g)
  with jax.default_device(DEVICES[0]):
    want = jax.jit(step)(x, w, g)
  close_to(got[:3], want[:3])
  for a, b in zip(got[3:], want[3:], strict=True):
    np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


@pytest.mark.parametrize("op", ["group_quantize", "block_quantize", "block_linear"])
def test_rows_left_uneven_by_a_slice(rng, op):
  """Rows split 4 ways and sliced to 6 (Shardy keeps the split, some devices a row more) are
  gathered for the op: the same bytes as one device's."""
  mesh = Mesh(np.array(DEVICES[:4]), ("data",)) if NDEV >= 4 else pytest.skip(f"{NDEV} devices")
  x = jnp.asarray(rng.standard_normal((8, 256)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((256, 128)) / 16, jnp.float32)
  fn = {"group_quantize": lambda x: jax_fp8.group_quantize(x[:6]),
        "block_quantize": lambda x: jax_fp8.block_quantize(x[:6]),
        "block_linear": lambda x: jax_fp8.linear(x[:6], w, recipe=jax_fp8.BlockScaling())}[op]
  got = jax.jit(fn)(jax.device_put(x, jax.sharding.NamedSharding(mesh, P("data", None))))
  with jax.default_device(DEVICES[0]):
    want = jax.jit(fn)(x)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


@pytest.mark.parametrize("spec", [("data", None), (None, "data")], ids=["rows", "cols"])
@pytest.mark.parametrize("columnwise", [False, True])
def test_sharded_jit_mxfp8_quantize(rng, spec, columnwise):
  """mxfp8_quantize under a sharded jit (rows or columns split in whole 32-element blocks)
  equals one device's, the transposed outputs split like x transposed."""
  x = jnp.asarray(rng.standard_normal((2 * M, 4 * K)) * 3, jnp.bfloat16)  # 32 x NDEV rows, cols
  mesh = Mesh(np.array(DEVICES), ("data",))
  op = jax.jit(lambda v: jax_fp8.mxfp8_quantize(v, columnwise=columnwise))
  got = op(jax.device_put(x, jax.sharding.NamedSharding(mesh, P(*spec))))
  with jax.default_device(DEVICES[0]):
    want = op(x)
  assert_same_quantized(got, want)
  local = tuple(d // NDEV if s else d for d, s in zip(x.shape, spec))  # no gather
  assert got.data.sharding.shard_shape(x.shape) == local
  if columnwise:
    assert got.data_t.sharding.shard_shape(x.shape[::-1]) == local[::-1]


@pytest.mark.parametrize("spec", [("data", None), (None, "data")], ids=["rows", "cols"])
@pytest.mark.parametrize("option", ["both", "both_2d", "both_rht_sr"])
def test_sharded_jit_nvfp4_quantize(rng, spec, option):
  """nvfp4_quantize under a sharded jit equals one device's: the global amax is XLA's reduction
  over the whole tensor; 1D blocks stay split (whole blocks on each device); stochastic
  rounding and 2D tiles, which follow global coordinates, see the whole tensor."""
  x = jnp.asarray(rng.standard_normal((2 * M, 4 * K)) * 3, jnp.bfloat16)
  options = {"both": dict(columnwise=True), "both_2d": dict(columnwise=True, block_2d=True),
             "both_rht_sr": dict(columnwise=True, rht=True, stochastic_rounding=True,
                                 key=jax.random.key(3))}[option]
  mesh = Mesh(np.array(DEVICES), ("data",))
  op = jax.jit(lambda v: jax_fp8.nvfp4_quantize(v, **options))
  got = op(jax.device_put(x, jax.sharding.NamedSharding(mesh, P(*spec))))
  with jax.default_device(DEVICES[0]):
    want = op(x)
  assert_same_quantized(got, want)  # bytes, and the f32 global scales as values
  if option == "both":  # no gather
    local = tuple(d // NDEV if s else d for d, s in zip(x.shape, spec))
    assert got.scale.sharding.shard_shape(got.scale.shape)[spec.index("data")] == (
        got.scale.shape[spec.index("data")] // NDEV)
    assert got.data.sharding.shard_shape(got.data.shape)[0] == local[0]
    assert got.data_t.sharding.shard_shape(got.data_t.shape)[0] == local[1]


def test_sharded_jit_gemm_sums_in_f32():
  """A K split over the devices sums the local products in f32 and casts once: float16
  partials of +-448 * 448 * 128 would overflow although the total is 0."""
  mesh = Mesh(np.array(DEVICES), ("data",))
  k = 32 * NDEV
  a = jnp.full((16, k), 448.0).astype(jnp.float8_e4m3fn)
  b = (jnp.full((16, k), 448.0) * jnp.where(jnp.arange(k) < k // 2, 1.0, -1.0)).astype(
      jnp.float8_e4m3fn)
  split = jax.sharding.NamedSharding(mesh, P(None, "data"))
  one = jnp.float32(1)
  gemm = jax.jit(lambda a, b: jax_fp8.gemm(a, b, one, one, out_dtype=jnp.float16))
  got = gemm(jax.device_put(a, split), jax.device_put(b, split))
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.zeros((16, 16), np.float32))


def test_explicit_axes_rejected():
  """custom_partitioning takes Auto mesh axes; an Explicit-axis mesh (jax.make_mesh's default
  in jax 0.10) gets a clear error at trace time, not a failure deep in the partitioner."""
  mesh = Mesh(np.array(DEVICES), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
  x = jax.device_put(jnp.ones((M, K)), jax.sharding.NamedSharding(mesh, P("data")))
  with pytest.raises(ValueError, match="meshes with Auto axes; got a mesh with Explicit axes"):
    jax.jit(lambda x: jax_fp8.quantize(x, jnp.float32(1)))(x)


def test_nnx_data_parallel(problem):
  """A jax_fp8.nnx model under shard_map (split / merge around the step): its rings end the
  step identical on every device and equal to one device's over the whole batch, and the
  kernel gradient is the single-device one within summation order."""
  x, w, b, g, state = problem
  mesh = Mesh(np.array(DEVICES), ("data",))
  model = jax_fp8.nnx.Linear(K, N, amax_axis_name="data", rngs=nnx.Rngs(0))
  model.kernel[...], model.bias[...] = w, b
  model.fp8_state.set_value(state)
  graphdef, params, fp8 = nnx.split(model, nnx.Param, jax_fp8.nnx.Fp8State)
  diff = nnx.DiffState(0, (nnx.Param, jax_fp8.nnx.Fp8State))
  loss = lambda m, x, g: jnp.sum(m(x) * g)  # dL/dy = g

  def step(params, fp8, x, g):
    m = nnx.merge(graphdef, params, fp8)
    grads = nnx.grad(loss, argnums=diff)(m, x, g)
    jax_fp8.nnx.update_fp8_state(m, grads)
    rings = nnx.state(m, jax_fp8.nnx.Fp8State)
    return nnx.filter_state(grads, nnx.Param), per_device_rings(rings, ("data",))

  run = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P("data"), P("data")),
                              out_specs=(P(), P("data"))))
  grads, copies = run(params, fp8, x, g)
  for leaf in jax.tree.leaves(copies):  # every device holds the same rings, bit for bit
    assert np.all(np.asarray(leaf) == np.asarray(leaf)[:1])
  *_, dw, db, new = single_device(x, w, b, g, state)
  ring = jax.tree.map(lambda v: v[0], copies["fp8_state"].get_value())
  for got, want in zip(jax.tree.leaves(ring), jax.tree.leaves(new)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  bound = order_bounds(x, w, b, g)
  assert np.all(np.abs(np.asarray(grads["kernel"].get_value()) - np.asarray(dw)) <= bound[2])
  assert np.all(np.abs(np.asarray(grads["bias"].get_value()) - np.asarray(db)) <= bound[3])


# CurrentScaling: every device quantizes each tensor with the scale of the whole tensor's amax
# (max-reduced before the quantization), so the sharded step equals one device's with the same
# bounds, on every step (no state to warm up).
CURRENT = jax_fp8.CurrentScaling()


@jax.jit
def _current_step(x, w, b, g):
  y, vjp = jax.vjp(lambda x, w, b: jax_fp8.linear(x, w, b, recipe=CURRENT), x, w, b)
  return (y, *vjp(g), ())


def single_device_current(x, w, b, g):
  """The reference: one device's step, compiled once for all the tests that compare with it."""
  one = DEVICES[0]
  with jax.default_device(one):
    return _current_step(*jax.device_put((x, w, b, g), one))


@pytest.mark.parametrize("axis_name", ["data", None], ids=["named", "inferred"])
def test_current_scaling_data_parallel(problem, axis_name):
  """x and the gradient split over the batch: their amaxes are reduced over "data" (named, or
  added because x varies over it) before either is quantized, so every device's scale is the
  whole tensor's even though the shards' amaxes differ."""
  x, w, b, g, _ = problem
  x = x * jnp.repeat(jnp.arange(1, NDEV + 1, dtype=jnp.float32), M // NDEV)[:, None]
  mesh = Mesh(np.array(DEVICES), ("data",))

  def step(x, w, b, g):
    y, vjp = jax.vjp(lambda x, w, b: jax_fp8.linear(x, w, b, recipe=CURRENT,
                                                    amax_axis_name=axis_name), x, w, b)
    return (y, *vjp(g), ())

  run = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P("data"), P(), P(), P("data")),
                              out_specs=(P("data"), P("data"), P(), P(), P())))
  check(run(x, w, b, g), single_device_current(x, w, b, g), (x, w, b, g))


def test_current_scaling_tensor_parallel_column(problem):
  """The kernel split on N: its amax (and the output gradient's, split on N) reduced over
  "model" and x's over "data" before quantizing."""
  x, w, b, g, _ = problem
  w = w * jnp.repeat(jnp.arange(1, 5, dtype=jnp.float32), N // 4)[None, :]
  mesh = Mesh(np.array(DEVICES).reshape(2 if NDEV >= 4 else 1, -1), ("data", "model"))

  def column(x, w, b, g):
    y, vjp = jax.vjp(lambda x, w, b: jax_fp8.linear(x, w, b, recipe=CURRENT,
                                                    amax_axis_name=("data", "model")), x, w, b)
    return (y, *vjp(g), ())

  run = jax.jit(jax.shard_map(
      column, mesh=mesh, in_specs=(P("data"), P(None, "model"), P("model"), P("data", "model")),
      out_specs=(P("data", "model"), P("data"), P(None, "model"), P("model"), P())))
  check(run(x, w, b, g), single_device_current(x, w, b, g), (x, w, b, g))


@pytest.mark.parametrize("name", SHARDED_JIT)
def test_current_scaling_sharded_jit(problem, name):
  """Plain jit over a mesh: XLA's amax reduction already spans the whole tensor."""
  x, w, b, g, _ = problem
  _, args = sharded_jit_args(SHARDED_JIT[name], (x, w, b, g))

  check(_current_step(*args), single_device_current(x, w, b, g), (x, w, b, g))


@pytest.mark.parametrize("name", ["data_parallel", "tensor_column"])
def test_mxfp8_block_scaling_sharded_jit(problem, name):
  """MXFP8BlockScaling under a plain sharded jit: the quantizers' sharding rules keep every
  block whole, so the step equals one device's up to the order of the sums."""
  x, w, b, g, _ = problem
  _, args = sharded_jit_args(SHARDED_JIT[name], (x, w, b, g))
  with jax.default_device(DEVICES[0]):
    want = _mxfp8_step(*jax.device_put((x, w, b, g), DEVICES[0]))
  check(_mxfp8_step(*args), want, (x, w, b, g))


@jax.jit
def _mxfp8_step(x, w, b, g):
  """One jitted step for every mesh and the single device (one compile per sharding, the single
  device's shared by the cases)."""
  y, vjp = jax.vjp(lambda x, w, b: jax_fp8.linear(x, w, b, recipe=jax_fp8.MXFP8BlockScaling()),
                   x, w, b)
  return (y, *vjp(g), ())


def per_shard(v, factors):
  """v [M, ...] with each device's rows (split over the data axis) times its own factor, so the
  shards' amaxes differ and a device-local scale would show."""
  return v * jnp.repeat(jnp.asarray(factors, jnp.float32), v.shape[0] // NDEV)[:, None]


def close_to(got, want):
  """Equal up to the order of f32 sums (any FP8 scale that differed would move elements by
  an FP8 step, 2^-4 of themselves, far beyond this)."""
  for a, r in zip(got, want):
    r = np.asarray(r, np.float64)
    assert np.max(np.abs(np.asarray(a, np.float64) - r)) <= 1e-4 * np.max(np.abs(r))


@pytest.mark.parametrize("norm", [None, "rmsnorm"])
def test_current_scaling_mlp_data_parallel(rng, norm):
  """The fused MLP under CurrentScaling: the hidden activation's and its gradient's amaxes (from
  XLA's activation) are reduced over the data axis too, so every device quantizes them with the
  whole tensor's scales."""
  x = per_shard(jnp.asarray(rng.standard_normal((M, K)), jnp.float32), range(1, NDEV + 1))
  g = per_shard(jnp.asarray(rng.standard_normal((M, K)), jnp.float32), range(NDEV, 0, -1))
  k_in = jnp.asarray(rng.standard_normal((K, 128)) / 8, jnp.float32)
  k_out = jnp.asarray(rng.standard_normal((64, K)) / 8, jnp.float32)
  kw = dict(recipe=CURRENT, norm=norm, gamma=jnp.ones(K) if norm else None)

  def step(x, k_in, k_out, g, axis_name=None):
    y, vjp = jax.vjp(lambda *a: jax_fp8.mlp(*a, amax_axis_name=axis_name, **kw), x, k_in, k_out)
    return (y, *vjp(g))

  mesh = Mesh(np.array(DEVICES), ("data",))
  run = jax.jit(jax.shard_map(lambda *a: step(*a, axis_name="data"), mesh=mesh,
                              in_specs=(P("data"), P(), P(), P("data")),
                              out_specs=(P("data"), P("data"), P(), P())))
  with jax.default_device(DEVICES[0]):
    want = jax.jit(step)(*jax.device_put((x, k_in, k_out, g), DEVICES[0]))
  close_to(run(x, k_in, k_out, g), want)


def test_current_scaling_fp8_weight_and_replicas(problem):
  """An Fp8Weight under CurrentScaling quantizes x with the whole batch's scale; with
  amax_axis_name=() each device keeps its own scales (independent replicas), as one device
  running its own shard would."""
  x, w, b, _, _ = problem
  x = per_shard(x, [4.0**i for i in range(NDEV)])
  fw = jax_fp8.quantize_weight(w, CURRENT)
  mesh = Mesh(np.array(DEVICES), ("data",))
  shard = lambda f: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("data"),),  # noqa: E731
                                          out_specs=P("data")))
  one = lambda f, v: jax.jit(f)(jax.device_put(v, DEVICES[0]))  # noqa: E731
  weight = lambda x: jax_fp8.linear(x, fw, b, recipe=CURRENT)  # noqa: E731
  close_to([shard(lambda x: jax_fp8.linear(x, fw, b, recipe=CURRENT, amax_axis_name="data"))(x)],
           [one(weight, x)])
  replicas = shard(lambda x: jax_fp8.linear(x, w, b, recipe=CURRENT, amax_axis_name=()))(x)
  pieces = [one(lambda v: jax_fp8.linear(v, w, b, recipe=CURRENT), p)
            for p in jnp.split(x, NDEV)]
  close_to([replicas], [jnp.concatenate(pieces)])


# NVFP4BlockScaling: the global amaxes are the whole tensors' (XLA's reduction under a sharded
# jit; max-reduced over amax_axis_name under shard_map), so every device quantizes with one
# global scale per tensor; the random bits follow global coordinates under a sharded jit (the
# quantizer sees the whole tensor) and, under shard_map, the device's index along the reduced
# axes is folded into the key so that devices draw their own bits.
NV_KEY = jax.random.key(21)


@pytest.mark.parametrize("name", ["data_parallel", "fsdp", "tensor_column"])
def test_nvfp4_block_scaling_sharded_jit(problem, name):
  """Under a plain sharded jit the step equals one device's, stochastic rounding included, up
  to the order of the sums."""
  x, w, b, g, _ = problem
  x = per_shard(x, range(1, NDEV + 1))
  _, args = sharded_jit_args(SHARDED_JIT[name], (x, w, b, g))
  with jax.default_device(DEVICES[0]):
    want = _nvfp4_step(*jax.device_put((x, w, b, g), DEVICES[0]))
  close_to(_nvfp4_step(*args), want)


@jax.jit
def _nvfp4_step(x, w, b, g):
  """As _mxfp8_step, under NVFP4BlockScaling() with NV_KEY."""
  y, vjp = jax.vjp(lambda x, w, b: jax_fp8.linear(x, w, b, recipe=jax_fp8.NVFP4BlockScaling(),
                                                  key=NV_KEY), x, w, b)
  return (y, *vjp(g))


def test_nvfp4_block_scaling_data_parallel(problem):
  """Under shard_map over the batch: with round to nearest the step equals one device's (the
  global amaxes reduced over "data" although the shards' differ; the Hadamard groups of 16
  rows lie within each device's rows); with stochastic rounding every device draws its own
  bits: devices holding the same rows get the same forward and different dgrads."""
  x, w, b, g, _ = problem
  x = per_shard(x, range(1, NDEV + 1))
  mesh = Mesh(np.array(DEVICES), ("data",))

  def step(x, w, b, g, recipe, key):
    y, vjp = jax.vjp(lambda x, w, b: jax_fp8.linear(x, w, b, recipe=recipe, key=key), x, w, b)
    return (y, *vjp(g))  # dw, db summed over "data" (w, b are replicated)

  def run(recipe, key, *args):
    return jax.jit(jax.shard_map(lambda *a: step(*a, recipe, key), mesh=mesh,
                                 in_specs=(P("data"), P(), P(), P("data")),
                                 out_specs=(P("data"), P("data"), P(), P())))(*args)

  nearest = jax_fp8.NVFP4BlockScaling(stochastic_rounding=False)
  with jax.default_device(DEVICES[0]):  # one device's step, jitted (one compile, not one a jnp op)
    want = jax.jit(lambda *a: step(*a, nearest, None))(*jax.device_put((x, w, b, g), DEVICES[0]))
  close_to(run(nearest, None, x, w, b, g), want)
  same = jnp.tile(x[:M // NDEV], (NDEV, 1))  # every device the same rows and gradient
  same_g = jnp.tile(g[:M // NDEV], (NDEV, 1))
  y, dx, _, _ = run(jax_fp8.NVFP4BlockScaling(), NV_KEY, same, w, b, same_g)
  rows = M // NDEV
  np.testing.assert_array_equal(y[:rows], y[rows:2 * rows])
  assert not np.array_equal(dx[:rows], dx[rows:2 * rows])


def test_nvfp4_gradient_bits_follow_the_gradients_axes(problem):
  """Over a data x model mesh with x and the gradient split over "data" and the kernel
  replicated, every "model" replica holds the same gradient: they draw the same bits (the key
  is folded only along the axes the gradient varies over, though the amax axes name both), so
  their dx agree, while the "data" shards, given the same rows, draw their own."""
  if NDEV < 4:
    pytest.skip("needs a 2 x 2 mesh")
  x, w, b, g, _ = problem
  mesh = Mesh(np.array(DEVICES[:4]).reshape(2, 2), ("data", "model"))
  rows = M // 2
  same_x, same_g = jnp.tile(x[:rows], (2, 1)), jnp.tile(g[:rows], (2, 1))

  def step(x, w, b, g):
    _, vjp = jax.vjp(lambda x: jax_fp8.linear(x, w, b, recipe=jax_fp8.NVFP4BlockScaling(),
                                              key=NV_KEY, amax_axis_name=("data", "model")), x)
    return jax.lax.pcast(vjp(g)[0], "model", to="varying")[None]  # each device's dx

  dx = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P("data"), P(), P(), P("data")),
                             out_specs=P(("data", "model"))))(same_x, w, b, same_g)
  dx = np.asarray(dx)  # [4, rows, K]: (data 0, model 0), (0, 1), (1, 0), (1, 1)
  np.testing.assert_array_equal(dx[0], dx[1])
  np.testing.assert_array_equal(dx[2], dx[3])
  assert not np.array_equal(dx[0], dx[2])
