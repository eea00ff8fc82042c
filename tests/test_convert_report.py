"""jax_fp8.convert on models as users write them: the conversion report (linen and NNX), the
default recipe and its warning, logically partitioned initializers, the head pattern and the
last-projection warning, a second convert, a bound module, quantize_weights with convert's
selection, and the TrainState example."""

import importlib.util
import pathlib
import re
import sys
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from conftest import default_devices

import jax_fp8
import jax_fp8.convert as jc
import jax_fp8.nnx
from jax_fp8.convert import ConversionWarning, conversion_report, convert

VOCAB, D, LEN, BATCH = 64, 64, 16, 4
RECIPE = jax_fp8.DelayedScaling()
# A threshold that the report's model crosses: "big" pays at M = 512, "up" only above M = 8,
# "tiny" (K = N = 16: at most 8) never.
THRESHOLD = jax_fp8.DelayedScaling(fp8_min_intensity=100)
EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def statuses(report):
  return {r.path: r.status for r in report.layers}


# --- the report -------------------------------------------------------------------------------

class Mixed(nn.Module):
  """One layer of every kind: FP8, below the threshold at this M, never paying, unaligned, a
  batched nn.Einsum (no GEMM: an axis in input, kernel and output), a head."""

  @nn.compact
  def __call__(self, x, h):  # x [M, 1024], h [8, 256]
    y = nn.Dense(1024, name="big")(x)
    z = nn.Dense(16, name="tiny")(nn.Dense(256, name="up")(h)[:, :16])
    z = nn.Dense(24, name="odd")(z)
    e = nn.Einsum((8, 24, 32), "bi,bij->bj", name="mix")(z)
    return y, nn.Dense(VOCAB, name="lm_head")(e)


def test_report_linen():
  x, h = jax.ShapeDtypeStruct((512, 1024), jnp.float32), jnp.ones((8, 256))
  report = conversion_report(convert(Mixed(), THRESHOLD), x, h)
  assert statuses(report) == {"big": "fp8", "up": "below_intensity", "tiny": "never_pays",
                              "odd": "unaligned", "mix": "unsupported", "lm_head": "excluded"}
  big, up = report["big"], report["up"]
  assert (big.k, big.n, big.m, up.m) == (1024, 1024, 512, 8)
  assert big.intensity == pytest.approx(1 / (1 / 512 + 2 / 1024))
  assert [r.path for r in report.converted] == ["big", "up"]
  assert [r.path for r in report.fp8] == ["big"]
  assert report.last == "lm_head"
  assert "HEAD_PATTERN" in report["lm_head"].detail
  assert "multiples of 16" in report["odd"].detail
  assert "at any M" in report["tiny"].detail
  text = str(report)
  assert "2 of 6 layers converted, 1 ran FP8" in text
  assert re.search(r"big\s+nn\.Dense\s+1024\s+1024\s+512\s+256\s+fp8", text)
  assert re.search(r"tiny\s+nn\.Dense\s+16\s+16\s+8\s+4\s+never_pays", text)
  assert re.search(r"mix\s+nn\.Einsum\s+-\s+-\s+-\s+-\s+unsupported", text)
  # Only the layers convert chose get rings; the never-paying one gets none (no dead state).
  v = convert(Mixed(), THRESHOLD).init(jax.random.key(0), jnp.ones((512, 1024)), h)
  assert sorted(v["fp8_state"]) == ["big", "up"]
  # The user's filter is told apart from the head pattern.
  report = conversion_report(convert(Mixed(), RECIPE, include="^(big|up)$"), x, h)
  assert statuses(report)["tiny"] == "not_included"
  assert "include='^(big|up)$'" in report["tiny"].detail
  # The status is "fp8" under every recipe; the title names the GEMMs' format.
  nvfp4 = jax_fp8.NVFP4BlockScaling(fp8_min_intensity=100)
  report = conversion_report(convert(Mixed(), nvfp4), x, h)
  assert report["big"].status == "fp8" and "1 ran NVFP4 at the traced shapes" in str(report)


class NNXMixed(nnx.Module):
  def __init__(self, rngs):
    self.big = nnx.Linear(1024, 1024, rngs=rngs)
    self.up = nnx.Linear(256, 256, rngs=rngs)
    self.tiny = nnx.Linear(16, 16, rngs=rngs)
    self.odd = nnx.Linear(16, 24, rngs=rngs)
    self.attn = nnx.LinearGeneral(24, (2, 16), rngs=rngs)
    self.unused = nnx.Linear(256, 256, rngs=rngs)
    self.output_layer = nnx.Linear(32, VOCAB, rngs=rngs)

  def __call__(self, x, h):
    z = self.odd(self.tiny(self.up(h)[:, :16]))
    return self.big(x), self.output_layer(self.attn(z).reshape(h.shape[0], 32))


def test_report_nnx():
  with pytest.warns(ConversionWarning, match="1 of 7 layers.*1 never reach it"):
    model = convert(NNXMixed(nnx.Rngs(0)), THRESHOLD)
  report = conversion_report(model, jax.ShapeDtypeStruct((512, 1024), jnp.float32),
                             jnp.ones((8, 256)))
  assert statuses(report) == {"up": "below_intensity", "tiny": "never_pays", "odd": "unaligned",
                              "attn": "unaligned", "output_layer": "excluded", "big": "fp8",
                              "unused": "converted"}  # in call order, then the uncalled
  assert report["up"].layer == "jax_fp8.nnx.Linear" and report["up"].m == 8
  assert report["unused"].m is None and report["attn"].layer == "nnx.LinearGeneral"
  assert report.last == "output_layer"
  assert "unused" in str(report) and "1 ran FP8" in str(report)
  assert isinstance(model.big, jax_fp8.nnx.Linear) and type(model.tiny) is nnx.Linear


# --- the default --------------------------------------------------------------------------------

class Small(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(16, name="output_layer")(nn.Dense(64)(nn.Dense(64)(x)))


def test_default_on_cpu_warns_and_creates_no_state():
  assert jax.default_backend() == "cpu"
  assert jc.default_recipe() == jax_fp8.DelayedScaling(fp8_min_intensity=jc.NEVER_INTENSITY)
  x = jnp.ones((4, 32))
  with pytest.warns(ConversionWarning, match=r"2 of 3 layers run in higher precision.*"
                    r"convert's default on cpu.*To force FP8 pass a recipe with "
                    r"fp8_min_intensity=0"):
    v = convert(Small()).init(jax.random.key(0), x)
  assert "fp8_state" not in v  # nothing converted: no dead rings
  np.testing.assert_array_equal(convert(Small()).apply(v, x), Small().apply(v, x))
  # NNX: told at convert.
  with pytest.warns(ConversionWarning, match="1 of 1 layers.*convert's default on cpu"):
    layer = convert(nnx.Linear(32, 32, rngs=nnx.Rngs(0)))
  assert type(layer) is nnx.Linear
  # Forcing FP8 as the warning says converts them.
  with warnings.catch_warnings():
    warnings.simplefilter("error", ConversionWarning)
    assert sorted(convert(Small(), RECIPE).init(jax.random.key(0), x)["fp8_state"]) == [
        "Dense_0", "Dense_1"]


def test_default_on_a_gpu(monkeypatch):
  """Where jax_fp8's kernels serve the GPU, the default runs FP8 from the measured crossover."""
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(jc, "cuda_available", lambda: True)
  assert jc.default_recipe() == jax_fp8.DelayedScaling(
      fp8_min_intensity=jax_fp8.recipes.CROSSOVER_INTENSITY)


def test_below_intensity_warns_at_apply_not_init():
  class Wide(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(16, name="head")(nn.Dense(256)(x))

  model = convert(Wide(), THRESHOLD)
  with warnings.catch_warnings():
    # init's shapes may be placeholders: no warning there
    warnings.simplefilter("error", ConversionWarning)
    v = model.init(jax.random.key(0), jnp.ones((2, 256)))
  with pytest.warns(ConversionWarning, match="1 converted ones fall below it at these shapes"):
    model.apply(v, jnp.ones((2, 256)))


# --- partitioned initializers ---------------------------------------------------------------

def logical(init, *names):
  return nn.with_logical_partitioning(init, names)


class PartitionedLM(nn.Module):
  """lm1b's idiom: every initializer logically partitioned; the head is "logitdense"."""

  @nn.compact
  def __call__(self, tokens):
    dense = nn.initializers.xavier_uniform()
    x = nn.Embed(VOCAB, D, embedding_init=logical(nn.initializers.normal(1.0), "vocab", "embed"))(
        tokens)
    for i in range(2):
      h = nn.LayerNorm(scale_init=logical(nn.initializers.ones, "embed"))(x)
      x = x + nn.MultiHeadDotProductAttention(
          4, kernel_init=logical(dense, "embed", "heads", "kv"),
          out_kernel_init=logical(dense, "heads", "kv", "embed"), deterministic=True,
          name=f"attn_{i}")(h)
      h = nn.Dense(4 * D, kernel_init=logical(dense, "embed", "mlp"),
                   bias_init=logical(nn.initializers.zeros, "mlp"), name=f"up_{i}")(x)
      x = x + nn.Dense(D, kernel_init=logical(dense, "mlp", "embed"), name=f"down_{i}")(
          nn.relu(h))
    return nn.Dense(VOCAB, kernel_init=logical(dense, "embed", "vocab"), name="logitdense")(x)


def test_logically_partitioned_linen_lm(rng, monkeypatch):
  tokens = jnp.asarray(rng.integers(0, VOCAB, (BATCH, LEN + 1)), jnp.int32)
  inputs, targets = tokens[:, :-1], tokens[:, 1:]
  model = convert(PartitionedLM(), RECIPE)
  v0 = PartitionedLM().init(jax.random.key(0), inputs)
  v = model.init(jax.random.key(0), inputs)
  spec = nn.get_partition_spec(v)["params"]
  assert spec == nn.get_partition_spec(v0)["params"]  # the same annotations, boxed
  assert spec["up_0"]["kernel"] == jax.sharding.PartitionSpec("embed", "mlp")
  assert spec["attn_0"]["query"]["kernel"] == jax.sharding.PartitionSpec("embed", "heads", "kv")
  assert isinstance(v["params"]["up_0"]["kernel"], nn.LogicallyPartitioned)
  for a, b in zip(jax.tree.leaves(nn.unbox(v["params"])), jax.tree.leaves(nn.unbox(v0["params"]))):
    np.testing.assert_array_equal(a, b)
  # Logical rules map them onto a mesh as for the original model.
  rules = (("mlp", "model"), ("heads", "model"), ("embed", None), ("vocab", None), ("kv", None))
  mesh = jax.make_mesh((2,), ("model",), devices=default_devices(2))
  shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(v), mesh, rules)
  assert shardings["params"]["up_0"]["kernel"].spec == jax.sharding.PartitionSpec(None, "model")
  report = conversion_report(model, inputs)
  assert statuses(report)["logitdense"] == "excluded"
  assert sorted(v["fp8_state"]) == ["attn_0", "attn_1", "down_0", "down_1", "up_0", "up_1"]

  # Trained on the boxed params, as a partitioned training loop holds them (the example's step).
  example = load_example(monkeypatch)
  state = example.create(model, RECIPE, jax.random.key(0), inputs, learning_rate=1e-2)
  state, first = example.train_step(state, inputs, targets)
  state, second = example.train_step(state, inputs, targets)
  assert nn.get_partition_spec({"params": state.params})["params"] == spec  # still boxed
  assert float(second) < float(first)
  rings = jax.tree.leaves(state.fp8_state, is_leaf=lambda r: isinstance(r, jax_fp8.ScaleRing))
  assert rings and all(float(r.steps) == 2.0 for r in rings)


def test_nnx_partitioning_metadata_kept():
  """NNX: the converted layers hold the original Param variables, sharding names included."""
  class Partitioned(nnx.Module):
    def __init__(self, rngs):
      init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "mlp"))
      self.up = nnx.Linear(64, 256, kernel_init=init, rngs=rngs)

  with nnx.use_eager_sharding(False):  # the names alone, no mesh
    model = Partitioned(nnx.Rngs(0))
  before = nnx.get_partition_spec(nnx.state(model, nnx.Param))
  convert(model, RECIPE)
  assert isinstance(model.up, jax_fp8.nnx.Linear)
  after = nnx.get_partition_spec(nnx.state(model, nnx.Param))
  assert after == before
  assert after["up"]["kernel"].get_value() == jax.sharding.PartitionSpec("embed", "mlp")


# --- the head ---------------------------------------------------------------------------------

def test_head_names():
  for name in ("lm_head", "head", "logits", "logitdense", "LogitDense", "output_layer",
               "output_projection", "unembed", "decoder/lm_head", "classifier"):
    assert re.search(jc.HEAD_PATTERN, name), name
  for name in ("out_proj", "Dense_3", "output_layer_norm", "heads_proj", "up"):
    assert not re.search(jc.HEAD_PATTERN, name), name


def test_output_layer_head_excluded_and_reported():
  x = jnp.ones((4, 32))
  with warnings.catch_warnings():
    # the head is not converted: no last-projection warning
    warnings.simplefilter("error", ConversionWarning)
    v = convert(Small(), RECIPE).init(jax.random.key(0), x)
  assert "output_layer" not in v["fp8_state"]
  report = conversion_report(convert(Small(), RECIPE), x)
  assert report["output_layer"].status == "excluded" and report.last == "output_layer"


def test_last_projection_converted_warns():
  class Unnamed(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(VOCAB, name="to_vocab")(nn.Dense(64)(x))

  with pytest.warns(ConversionWarning, match=r"last projection, nn.Dense at 'to_vocab'.*"
                                             r"exclude=jax_fp8.convert.HEAD_PATTERN \+ "
                                             r"r'\|\^to_vocab\$'"):
    convert(Unnamed(), RECIPE).init(jax.random.key(0), jnp.ones((4, 32)))
  report = conversion_report(convert(Unnamed(), RECIPE), jnp.ones((4, 32)))
  assert "the last projection, 'to_vocab', is converted" in str(report)
  with warnings.catch_warnings():
    warnings.simplefilter("error", ConversionWarning)
    convert(Unnamed(), RECIPE, exclude="to_vocab").init(jax.random.key(0), jnp.ones((4, 32)))


class TiedLM(nn.Module):
  """Logits from the embedding (tied): the last dense layer is the MLP's down projection."""

  @nn.compact
  def __call__(self, tokens):
    embed = nn.Embed(VOCAB, 32, name="embed")
    h = embed(tokens)
    h = h + nn.Dense(32, name="down")(nn.gelu(nn.Dense(128, name="up")(h)))
    return embed.attend(h)  # [B, T, VOCAB]


class NNXTiedLM(nnx.Module):
  def __init__(self, rngs):
    self.embed = nnx.Embed(VOCAB, 32, rngs=rngs)
    self.up, self.down = nnx.Linear(32, 128, rngs=rngs), nnx.Linear(128, 32, rngs=rngs)

  def __call__(self, tokens):
    h = self.embed(tokens)
    return self.embed.attend(h + self.down(nnx.gelu(self.up(h))))


def test_tied_embedding_has_no_output_projection():
  """Where the logits come from the embedding after the last dense layer, that layer is no
  output projection: no warning, and the report names none."""
  tokens = jnp.zeros((2, LEN), jnp.int32)
  with warnings.catch_warnings():
    warnings.simplefilter("error", ConversionWarning)
    convert(TiedLM(), RECIPE).init(jax.random.key(0), tokens)
  report = conversion_report(convert(TiedLM(), RECIPE), tokens)
  assert report.last is None and [r.path for r in report.fp8] == ["up", "down"]
  assert "last projection" not in str(report)
  report = conversion_report(convert(NNXTiedLM(nnx.Rngs(0)), RECIPE), tokens)
  assert report.last is None and [r.path for r in report.fp8] == ["up", "down"]


def test_nothing_converted_for_sizes_warns():
  """A recipe whose K / N rule no layer meets converts nothing: a warning says so."""
  with pytest.warns(ConversionWarning, match=r"none of the 2 layers was converted; 2 of "
                                             r"them for their sizes: BlockScaling needs K and N "
                                             r"multiples of 128"):
    convert(TiedLM(), jax_fp8.BlockScaling()).init(
        jax.random.key(0), jnp.zeros((2, LEN), jnp.int32))
  with pytest.warns(ConversionWarning, match="none of the 2 layers was converted"):
    convert(NNXTiedLM(nnx.Rngs(0)), jax_fp8.BlockScaling())


# --- second convert, bound module -------------------------------------------------------------

def test_second_convert():
  x = jnp.ones((4, 32))
  once = convert(Small(), jax_fp8.CurrentScaling())
  twice = convert(once, RECIPE)  # the recipe replaced: the original converted anew
  assert twice.recipe == RECIPE and twice.module is once.module
  v = twice.init(jax.random.key(0), x)
  assert sorted(v["fp8_state"]) == ["Dense_0", "Dense_1"]
  assert jax.tree.structure(v["params"]) == jax.tree.structure(
      Small().init(jax.random.key(0), x)["params"])

  class Outer(nn.Module):  # a converted model inside a model converted again
    inner: nn.Module

    @nn.compact
    def __call__(self, x):
      return self.inner(x)
  with pytest.raises(ValueError, match="runs inside another converted model"):
    convert(Outer(once), RECIPE).init(jax.random.key(0), x)

  model = NNXMixed(nnx.Rngs(0))
  convert(model, RECIPE)
  with pytest.raises(ValueError, match=r"converted already.*'big'.*convert a freshly built"):
    convert(model, jax_fp8.CurrentScaling())
  assert model.big.recipe == RECIPE
  layer = convert(nnx.Linear(32, 32, rngs=nnx.Rngs(0)), RECIPE)
  with pytest.raises(ValueError, match="converted already"):
    convert(layer, RECIPE)


def test_bound_module_refused():
  x = jnp.ones((4, 32))
  bound = Small().bind(Small().init(jax.random.key(0), x))
  with pytest.raises(TypeError, match="unbound linen module.*model.unbind"):
    convert(bound, RECIPE)

  class Parent(nn.Module):  # a layer built inside another module's method is bound too
    @nn.compact
    def __call__(self, x):
      return convert(nn.Dense(16), RECIPE)(x)
  with pytest.raises(TypeError, match="got a Dense bound to a scope"):
    Parent().init(jax.random.key(0), x)


# --- quantize_weights with convert's selection --------------------------------------------

def test_quantize_weights_takes_the_selection():
  x = jnp.ones((4, 32))
  model = convert(Small(), RECIPE)
  v = model.init(jax.random.key(0), x)
  report = conversion_report(model, x)
  q = jax_fp8.quantize_weights(v["params"], RECIPE, select=report.select)
  assert isinstance(q["Dense_0"]["kernel"], jax_fp8.Fp8Weight)
  assert not isinstance(q["output_layer"]["kernel"], jax_fp8.Fp8Weight)
  np.testing.assert_array_equal(model.apply({**v, "params": q}, x), model.apply(v, x))
  # Without it the head's kernel is quantized too: the error names the layer and the fix.
  everything = jax_fp8.quantize_weights(v["params"], RECIPE)
  with pytest.raises(ValueError, match=r"layer at /output_layer hold an Fp8Weight kernel, but "
                                       r"convert left this layer as it was \(excluded.*select="):
    model.apply({**v, "params": everything}, x)

  nnx_model = convert(NNXMixed(nnx.Rngs(0)), RECIPE)
  inputs = (jnp.ones((8, 1024)), jnp.ones((8, 256)))
  report = conversion_report(nnx_model, *inputs)
  want = nnx_model(*inputs)
  params = jax_fp8.quantize_weights(nnx.state(nnx_model, nnx.Param), RECIPE,
                                    select=report.select)
  nnx.update(nnx_model, params)
  assert isinstance(nnx_model.big.kernel.get_value(), jax_fp8.Fp8Weight)
  assert not isinstance(nnx_model.output_layer.kernel.get_value(), jax_fp8.Fp8Weight)
  for a, b in zip(nnx_model(*inputs), want):
    np.testing.assert_array_equal(a, b)


def test_report_bad_arguments():
  with pytest.raises(TypeError, match="a model that jax_fp8.convert returned"):
    conversion_report(Small(), jnp.ones((4, 32)))
  with pytest.raises(TypeError, match="a model that jax_fp8.convert returned"):
    conversion_report(nnx.Linear(16, 16, rngs=nnx.Rngs(0)), jnp.ones((4, 16)))


# --- the TrainState example -------------------------------------------------------------------

def load_example(monkeypatch):
  spec = importlib.util.spec_from_file_location("convert_train_state",
                                                EXAMPLES / "convert_train_state.py")
  module = importlib.util.module_from_spec(spec)
  monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look their module up
  spec.loader.exec_module(module)
  return module


def test_train_state_example(monkeypatch):
  state, losses = load_example(monkeypatch).main(steps=12)
  assert losses[-1] < 0.6 * losses[0]  # task-level: one batch, memorized in part
  assert int(state.step) == 12
  rings = jax.tree.leaves(state.fp8_state, is_leaf=lambda r: isinstance(r, jax_fp8.ScaleRing))
  assert len(rings) == 4 * 3 and all(float(r.steps) == 12.0 for r in rings)
