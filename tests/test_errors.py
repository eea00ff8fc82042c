"""Bad input gets a clear TypeError / ValueError at trace time naming the argument, the rule
and what came (or the right value), across the public API."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import jax_fp8
import jax_fp8.checkpoint
import jax_fp8.flax

X = jnp.ones((32, 128), jnp.float32)
S = jnp.float32(1)
RING = jax_fp8.ScaleRing.create(4)
E4 = jnp.ones((32, 128), jnp.float8_e4m3fn)
W = jnp.ones((128, 16), jnp.float32)
CURRENT = jax_fp8.CurrentScaling()

CASES = {
    # arguments used before they were checked
    "group_quantize eps None": (lambda: jax_fp8.group_quantize(X, eps=None), TypeError,
                                "eps must be a number, got NoneType None"),
    "BlockScaling eps str": (lambda: jax_fp8.BlockScaling(eps="tiny"), TypeError,
                             "BlockScaling.eps must be a number, got str 'tiny'"),
    "ScaleRing.create None": (lambda: jax_fp8.ScaleRing.create(None), TypeError,
                              "history_len must be a Python int"),
    "quantize fmt list": (lambda: jax_fp8.quantize(X, S, ["e4m3"]), TypeError,
                          r"fmt must be one of \['e4m3', 'e5m2'\], got list \['e4m3'\]"),
    "gemm a_scale None": (lambda: jax_fp8.gemm(E4, E4, None, S), TypeError,
                          "a_scale must be an array, got NoneType None"),
    "gemm b_scale str": (lambda: jax_fp8.gemm(E4, E4, S, "1"), TypeError,
                         "b_scale must be an array, got str"),
    "quantize x None": (lambda: jax_fp8.quantize(None, S), TypeError,
                        "x must be an array, got NoneType None"),
    "quantize scale list": (lambda: jax_fp8.quantize(X, [1.0]), TypeError,
                            r"scale must be a float32 scalar, got float32\[1\]"),
    "dequantize dtype": (lambda: jax_fp8.dequantize(E4, S, "int8"), TypeError,
                         "dtype must be one of float32, bfloat16, float16, got int8"),
    "linear bias fp8": (lambda: jax_fp8.linear(X, jnp.ones((128, 16)),
                                               jnp.ones(16, jnp.float8_e4m3fn),
                                               state=jax_fp8.LinearState.create()), TypeError,
                        "bias must be float32, bfloat16 or float16, got float8_e4m3fn"),
    "linear state bf16 history": (lambda: jax_fp8.linear(X, W, state=jax.tree.map(
        lambda a: a.astype(jnp.bfloat16), jax_fp8.LinearState.create())), ValueError,
        r"state.x.amax_history must be float32 \[L\] with 1 <= L <= \d+, got bfloat16\[16\]$"),
    "linear dtype int8": (lambda: jax_fp8.linear(X, W, dtype=jnp.int8), TypeError,
                          "dtype must be None, float32, bfloat16 or float16, got int8"),
    "linear state None rings": (lambda: jax_fp8.linear(X, jnp.ones((128, 16)),
                                                       state=jax_fp8.LinearState(None, None, None)),
                                TypeError, "state.x must be a jax_fp8.ScaleRing, got NoneType"),
    "linear stacked state": (lambda: jax_fp8.linear(X, jnp.ones((128, 16)), state=jax_fp8.share(
        jax_fp8.LinearState.create(), 2)), ValueError, r"state.x.amax_history must be float32 \[L\]"),
    "intensity huge int": (lambda: jax_fp8.DelayedScaling(fp8_min_intensity=10**400), ValueError,
                           "fp8_min_intensity must be representable as a float"),
    "dequantize dtype None": (lambda: jax_fp8.dequantize(E4, S, None), TypeError,
                              "dtype must be one of float32, bfloat16, float16, got None"),
    "algo None": (lambda: jax_fp8.DelayedScaling(algo=None), TypeError,
                  "algo must be one of .* got NoneType None"),
    "linear bias str": (lambda: jax_fp8.linear(X, jnp.ones((128, 16)), "b",
                                               state=jax_fp8.LinearState.create()), TypeError,
                        "bias must be an array, got str"),
    "DelayedScaling fp8_format": (lambda: jax_fp8.DelayedScaling(fp8_format="e5m2"), ValueError,
                                  "DelayedScaling.fp8_format must be one of"),
    "DelayedScaling intensity str": (lambda: jax_fp8.DelayedScaling(fp8_min_intensity="900"),
                                     TypeError, "fp8_min_intensity must be a number"),
    "DelayedScaling margin float": (lambda: jax_fp8.DelayedScaling(margin=1.0), TypeError,
                                    "margin must be a Python int"),
    # booleans that took any truthy value
    "group_quantize ue8m0 str": (lambda: jax_fp8.group_quantize(X, ue8m0="no"), TypeError,
                                 "ue8m0 must be a bool, got str 'no'"),
    "block_quantize ue8m0 int": (lambda: jax_fp8.block_quantize(X, ue8m0=1), TypeError,
                                 "ue8m0 must be a bool, got int 1"),
    "group_cast_transpose ue8m0": (lambda: jax_fp8.group_cast_transpose(X, ue8m0="yes"),
                                   TypeError, "ue8m0 must be a bool"),
    "cast_transpose with_dbias str": (
        lambda: jax_fp8.cast_transpose_delayed(X, RING, with_dbias="no"), TypeError,
        "with_dbias must be a bool, got str 'no'"),
    "cast_transpose observe int": (lambda: jax_fp8.cast_transpose_delayed(X, RING, observe=0),
                                   TypeError, "observe must be a bool, got int 0"),
    "quantize_delayed observe str": (lambda: jax_fp8.quantize_delayed(X, RING, observe="no"),
                                     TypeError, "observe must be a bool"),
    "ScaleRing history_len bool": (lambda: jax_fp8.ScaleRing.create(history_len=True), TypeError,
                                   "history_len must be a Python int .* got bool True"),
    "ScaleRing history_len 0": (lambda: jax_fp8.ScaleRing.create(0), ValueError,
                                r"history_len must be an int in \[1, 1024\], got 0"),
    "gemm fast_accum str": (lambda: jax_fp8.gemm(E4, E4, S, S, fast_accum="yes"), TypeError,
                            "fast_accum must be a bool"),
    # share's count
    "share n 0": (lambda: jax_fp8.share(jax_fp8.LinearState.create(), 0), ValueError,
                  r"n must be an int >= 1, got 0"),
    "share n -2": (lambda: jax_fp8.share(jax_fp8.LinearState.create(), -2), ValueError,
                   r"n must be an int >= 1, got -2"),
    "share n float": (lambda: jax_fp8.share(jax_fp8.LinearState.create(), 2.0), TypeError,
                      "n must be a Python int .* got float 2.0"),
    "share n traced": (lambda: jax.jit(lambda n: jax_fp8.share(jax_fp8.LinearState.create(), n))(
        2), TypeError, r"n must be a Python int \(static, not traced\), got int32\[\]"),
    # amax_axis_name of the wrong type, or naming an axis that is not bound
    "amax_axis_name int": (lambda: jax_fp8.linear(X, jnp.ones((128, 16)),
                                                  state=jax_fp8.LinearState.create(),
                                                  amax_axis_name=3), TypeError,
                           "amax_axis_name must be None, an axis name"),
    "amax_axis_name unbound": (lambda: jax_fp8.linear(X, jnp.ones((128, 16)),
                                                      state=jax_fp8.LinearState.create(),
                                                      amax_axis_name="data"), ValueError,
                               "amax_axis_name names the axis 'data', which is not bound"),
    # cast_kernel / CastKernel / cast_kernels
    "cast_kernel MXFP8": (lambda: jax_fp8.cast_kernel(W, recipe=jax_fp8.MXFP8BlockScaling()),
                          TypeError, "recipe must be a DelayedScaling, a CurrentScaling or a "
                                     "BlockScaling, got MXFP8BlockScaling"),
    "cast_kernel no ring": (lambda: jax_fp8.cast_kernel(W), TypeError,
                            "ring must be the kernel's jax_fp8.ScaleRing under DelayedScaling"),
    "cast_kernel ring stateless": (lambda: jax_fp8.cast_kernel(W, RING, recipe=CURRENT),
                                   ValueError, "CurrentScaling is stateless: pass ring=None"),
    "cast_kernel ring history": (lambda: jax_fp8.cast_kernel(W, RING), ValueError,
                                 r"rings \(fmt, history_len, margin, algo\) for \(ring\) = "
                                 r"\(\('e4m3', 4, 0, 'max'\),\) do not match the recipe's "
                                 r"\(\('e4m3', 16, 0, 'max'\),\)"),
    "cast_kernel int kernel": (lambda: jax_fp8.cast_kernel(jnp.ones((128, 16), jnp.int32),
                                                           recipe=CURRENT), TypeError,
                               r"kernel must be a float32 / bfloat16 / float16 \[K, N\] array, "
                               r"got int32\[128, 16\]"),
    "cast_kernel block K": (lambda: jax_fp8.cast_kernel(W, recipe=jax_fp8.BlockScaling()),
                            ValueError, r"BlockScaling needs K and N multiples of 128.*got "
                                        r"kernel \[128, 16\]"),
    "linear cast for another recipe": (
        lambda: jax_fp8.linear(X, jax_fp8.cast_kernel(W, recipe=CURRENT),
                               state=jax_fp8.LinearState.create()), ValueError,
        "kernel was cast for CurrentScaling.* but the layer runs DelayedScaling"),
    "multi_linear cast beside array": (
        lambda: jax_fp8.multi_linear(X, (jax_fp8.cast_kernel(W, recipe=CURRENT), W),
                                     recipe=CURRENT), TypeError,
        r"kernels\[1\] is an array beside CastKernel kernels"),
    "cast_kernels no state": (lambda: jax_fp8.flax.cast_kernels({"kernel": W}), TypeError,
                              "cast_kernels under DelayedScaling takes the \"fp8_state\""),
    "cast_kernels state stateless": (
        lambda: jax_fp8.flax.cast_kernels({"kernel": W}, {}, CURRENT), ValueError,
        "CurrentScaling is stateless: pass fp8_state=None"),
    "quantize_weights of a CastKernel": (
        lambda: jax_fp8.quantize_weights({"d": {"kernel": jax_fp8.cast_kernel(W, recipe=CURRENT)}},
                                         CURRENT), TypeError,
        r"params holds a CastKernel at d/kernel \(cast_kernels', for training\): quantize the "
        r"float params"),
    "cast_kernels select None": (
        lambda: jax_fp8.flax.cast_kernels({"d": {"kernel": W}}, None, CURRENT,
                                          select=lambda path, kernel: None), TypeError,
        "select must return a bool, got NoneType for d/kernel"),
    "cast_kernels select": (lambda: jax_fp8.flax.cast_kernels({"kernel": W}, None, CURRENT,
                                                              select="all"), TypeError,
                            "select must be a callable"),
    "cast_kernels select numpy int": (
        lambda: jax_fp8.flax.cast_kernels({"d": {"kernel": W}}, None, CURRENT,
                                          select=lambda path, kernel: np.int64(1)), TypeError,
        "select must return a bool, got numpy.int64 for d/kernel"),
    "checkpoint save directory int": (
        lambda: jax_fp8.checkpoint.save(5, {"w": W}, CURRENT), TypeError,
        "directory must be a str or os.PathLike path, got int 5"),
    "checkpoint restore directory None": (
        lambda: jax_fp8.checkpoint.restore(None, {"w": W}, CURRENT), TypeError,
        "directory must be a str or os.PathLike path, got NoneType None"),
    "update_state of an array": (
        lambda: jax_fp8.update_state(jnp.ones(3), jnp.ones(3)), TypeError,
        r"state must be a pytree of ScaleRings .* got a leaf float32\[3\]"),
    "quantize scale zero": (lambda: jax_fp8.quantize(X, 0.0), ValueError,
                            "scale must be a positive normal finite float32 .* got 0.0"),
    "dequantize scale negative": (lambda: jax_fp8.dequantize(E4, np.float32(-2)), ValueError,
                                  "scale must be a positive normal finite float32"),
    "gemm a_scale nan": (lambda: jax_fp8.gemm(E4, E4, float("nan"), S), ValueError,
                         "a_scale must be a positive normal finite float32 .* got nan"),
    "quantize_weights select int": (
        lambda: jax_fp8.quantize_weights({"d": {"kernel": W}}, CURRENT,
                                          select=lambda path, kernel: 1), TypeError,
        "select must return a bool, got int for d/kernel"),
    "cast_kernels of cast params": (
        lambda: jax_fp8.flax.cast_kernels({"d": {"kernel": jax_fp8.cast_kernel(W, recipe=CURRENT)}},
                                          None, CURRENT), TypeError,
        "d/kernel is a CastKernel already"),
    "linear cast with other amax axes": (
        lambda: jax_fp8.linear(X, jax_fp8.cast_kernel(W, recipe=CURRENT, amax_axis_name=()),
                               recipe=CURRENT), ValueError,
        r"kernel was cast with amax_axis_name=\(\), but the layer's is None: cast it with the "
        r"layer's amax_axis_name"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_clear_error(case):
  fn, exc, message = CASES[case]
  with pytest.raises(exc, match=message):
    fn()


def test_amax_axis_name_unbound_under_pmap_and_shard_map():
  """An axis the mesh does not have fails in the forward, with the names, under pmap and
  shard_map (it used to pass the forward and fail the backward with a bare AssertionError or
  NameError)."""
  state = jax_fp8.LinearState.create()
  w = jnp.ones((128, 16))

  def loss(x, s):
    return jax_fp8.linear(x, w, state=s, amax_axis_name="model").sum()
  with pytest.raises(ValueError, match="names the axis 'model', which is not bound"):
    jax.pmap(jax.grad(loss, argnums=1), axis_name="data")(X[None], jax.tree.map(
        lambda v: v[None], state))
  mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
  sm = jax.shard_map(jax.grad(loss, argnums=1), mesh=mesh, in_specs=(P("data"), P()),
                     out_specs=P())
  with pytest.raises(ValueError, match="names the axis 'model', which is not bound"):
    sm(X, state)


@pytest.mark.parametrize("op", ["quantize", "gemm", "group_quantize", "block_quantize",
                                "group_cast_transpose", "norm_group_cast_transpose",
                                "activation_group_cast_transpose",
                                "activation_grad_group_cast_transpose", "quantize_delayed",
                                "cast_transpose_delayed"])
def test_grad_names_the_op(op):
  calls = {
      "quantize": lambda x: jax_fp8.quantize(x, S).amax,
      "gemm": lambda x: jax_fp8.gemm(x.astype(jnp.float8_e4m3fn), E4, S, S).astype(
          jnp.float32).sum(),
      "group_quantize": lambda x: jax_fp8.group_quantize(x).scale.sum(),
      "block_quantize": lambda x: jax_fp8.block_quantize(x).scale.sum(),
      "group_cast_transpose": lambda x: jax_fp8.group_cast_transpose(x).scale.sum(),
      "norm_group_cast_transpose": lambda x: jax_fp8.norm_group_cast_transpose(
          x, jnp.ones((x.shape[0], 1)), jnp.ones(x.shape[1]), None, norm="rmsnorm").scale.sum(),
      "activation_group_cast_transpose": lambda x: jax_fp8.activation_group_cast_transpose(
          x, activation="gelu").scale.sum(),
      "activation_grad_group_cast_transpose": lambda x: (
          jax_fp8.activation_grad_group_cast_transpose(x, x, activation="gelu").scale.sum()),
      "quantize_delayed": lambda x: jax_fp8.quantize_delayed(x, RING).tensor.amax,
      "cast_transpose_delayed": lambda x: jax_fp8.cast_transpose_delayed(x, RING).tensor.amax,
  }
  with pytest.raises(TypeError, match=f"jax_fp8.{op} is not differentiable.*jax_fp8.linear"):
    jax.grad(calls[op])(X)


@pytest.mark.parametrize("recipe", [jax_fp8.DelayedScaling(), jax_fp8.CurrentScaling(),
                                    jax_fp8.BlockScaling()], ids=lambda r: type(r).__name__)
def test_second_derivative_says_first_order_only(recipe):
  """jax.hessian differentiates linear's backward pass; the error says that linear gives
  first derivatives in reverse mode only, at trace time (under jit: nothing runs before it)."""
  x, w = jnp.ones((128, 128)), jnp.ones((128, 128))
  state = jax_fp8.LinearState.create() if isinstance(recipe, jax_fp8.DelayedScaling) else None
  f = lambda w: jax_fp8.linear(x, w, state=state, recipe=recipe).astype(jnp.float32).sum()  # noqa: E731
  with pytest.raises(TypeError, match=r"first derivatives in reverse mode \(grad, vjp\) only"):
    jax.jit(jax.hessian(f))(w)


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(features=0), ValueError, "Dense.features must be an int >= 1, got 0"),
    (dict(features=16.0), TypeError, "Dense.features must be a Python int"),
    (dict(features=16, use_bias="no"), TypeError, "Dense.use_bias must be a bool, got str"),
], ids=["features 0", "features float", "use_bias str"])
def test_flax_dense_bad_arguments(kwargs, error, message):
  with pytest.raises(error, match=message):
    jax_fp8.flax.Dense(**kwargs).init(jax.random.key(0), X)


def test_flax_layer_without_its_fp8_state_says_how_to_pass_it():
  """A DelayedScaling layer applied without its "fp8_state" collection, or scanned without it
  in variable_axes, is told how to pass it (not Flax's ScopeCollectionNotFound)."""
  import flax.linen as nn

  layer = jax_fp8.flax.Dense(16)
  variables = layer.init(jax.random.key(0), X)
  with pytest.raises(ValueError, match=r'Dense under DelayedScaling keeps its scale rings in the '
                                       r'"fp8_state" collection, .* variable "linear" there for '
                                       r'the layer at /: apply with the variables init returned'):
    layer.apply({"params": variables["params"]}, X)

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
      return jax_fp8.flax.Mlp(32, out_features=128)(x), None

  scanned = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=2)
  with pytest.raises(ValueError, match=r'Mlp under DelayedScaling .* variable "mlp" there for the '
                                       r'layer at /scan\(\)/Mlp_0: .* under nn.scan list '
                                       r'"fp8_state" in variable_axes'):
    scanned().init(jax.random.key(0), X, None)
  # with the collection mutable, a fresh state is made, as Flax makes variables
  _, made = layer.apply({"params": variables["params"]}, X, mutable=["fp8_state"])
  assert isinstance(made["fp8_state"]["linear"], jax_fp8.LinearState)


def _grads(history_len=16):
  recipe = jax_fp8.DelayedScaling(history_len=history_len)
  state = jax_fp8.LinearState.create(recipe)
  return state, jax.grad(lambda s: jax_fp8.linear(X, jnp.ones((128, 16)), state=s,
                                                  recipe=recipe).sum())(state)


def test_state_gradients_must_match_the_state():
  """A gradient of another state (rings swapped, other history length) or none is refused by
  name, instead of advancing the rings with the wrong amax."""
  state, g = _grads()
  swapped = jax_fp8.LinearState(g.grad, g.kernel, g.x)  # e5m2 ring where an e4m3 one goes
  with pytest.raises(ValueError, match="state_grads must have the structure of state"):
    jax_fp8.update_state(state, swapped)
  with pytest.raises(ValueError, match=r"state_grads must have the leaf shapes of state, got "
                                       r"\(4,\) against \(16,\)"):
    jax_fp8.update_state(state, _grads(4)[1])
  with pytest.raises(ValueError, match="state_grads must have the structure of state"):
    jax_fp8.update_state(state, None)
  with pytest.raises(ValueError, match="b must have the leaf shapes of a"):
    jax_fp8.combine_updates(g, _grads(4)[1])
  # cast (as before an all-reduce): an int amax of 0.3 is 0, a bf16 one rounded
  for dtype in (jnp.int32, jnp.bfloat16):
    cast = jax.tree.map(lambda v: v.astype(dtype) if v.dtype == jnp.float32 else v, g)
    with pytest.raises(TypeError, match=f"state_grads must have the leaf dtypes of state .* got "
                                        f"{jnp.dtype(dtype).name} against float32"):
      jax_fp8.update_state(state, cast)
