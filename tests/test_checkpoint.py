"""jax_fp8.checkpoint: the whole train state (params, optimizer, FP8 state) saved with its
recipe; a restored run continues bit for bit; another recipe, other rings or another schema
version are refused by name."""

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jax_fp8
import jax_fp8.flax
import jax_fp8.nnx
from jax_fp8 import checkpoint

RECIPE = jax_fp8.DelayedScaling(history_len=8, fast_accum_gemms=("fprop",))


class MLP(nn.Module):
  recipe: jax_fp8.DelayedScaling

  @nn.compact
  def __call__(self, x):
    h = jax.nn.gelu(jax_fp8.flax.Dense(64, recipe=self.recipe)(x))
    return jax_fp8.flax.Dense(16, recipe=self.recipe)(h)


def linen_run(recipe, x, y):
  """(initial train state, a jitted step on it)."""
  model, tx = MLP(recipe), optax.adam(1e-2)
  v = model.init(jax.random.key(0), x)
  state = {"params": v["params"], "opt": tx.init(v["params"]), "fp8_state": v["fp8_state"]}

  @jax.jit
  def step(state):
    def loss(params, fp8_state):
      return jnp.mean((model.apply({"params": params, "fp8_state": fp8_state}, x) - y) ** 2)
    g, sg = jax.grad(loss, argnums=(0, 1))(state["params"], state["fp8_state"])
    updates, opt = tx.update(g, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt": opt,
            "fp8_state": jax_fp8.update_state(state["fp8_state"], sg)}
  return state, step


def data(rng):
  x = jnp.asarray(rng.standard_normal((32, 32)), jnp.float32)
  return x, jnp.tanh(x[:, :16])


def nnx_step(model, x):
  """One step's FP8 state update of an NNX model (its gradient in one jit, not op by op)."""
  grads = nnx.jit(nnx.grad(lambda m: jnp.sum(m(x) ** 2),
                           argnums=nnx.DiffState(0, (nnx.Param, jax_fp8.nnx.Fp8State))))(model)
  jax_fp8.nnx.update_fp8_state(model, grads)


def assert_same(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


def test_restored_run_continues_bit_identically(rng, tmp_path):
  x, y = data(rng)
  state, step = linen_run(RECIPE, x, y)
  for _ in range(5):
    state = step(state)
  checkpoint.save(tmp_path / "ckpt", state, RECIPE)
  meta = json.loads((tmp_path / "ckpt" / checkpoint.METADATA).read_text())
  assert meta["schema_version"] == checkpoint.SCHEMA_VERSION
  assert meta["recipe"]["history_len"] == 8 and meta["recipe"]["fast_accum_gemms"] == ["fprop"]
  assert len(meta["rings"]) == 6 and {r["fmt"] for r in meta["rings"].values()} == {"e4m3", "e5m2"}
  uninterrupted = state
  for _ in range(5):
    uninterrupted = step(uninterrupted)

  fresh, step2 = linen_run(RECIPE, x, y)
  restored = checkpoint.restore(tmp_path / "ckpt", fresh, RECIPE)
  assert_same(restored, state)
  for _ in range(5):
    restored = step2(restored)
  assert_same(restored, uninterrupted)


def test_refuses_another_recipe_or_other_rings(rng, tmp_path):
  x, y = data(rng)
  state, _ = linen_run(RECIPE, x, y)
  checkpoint.save(tmp_path / "ckpt", state, RECIPE)
  other = jax_fp8.DelayedScaling(history_len=16)
  with pytest.raises(ValueError, match=r"saved under another recipe.*'history_len': \(8, 16\)"):
    checkpoint.restore(tmp_path / "ckpt", state, other)
  with pytest.raises(ValueError, match=r"'type': \('DelayedScaling', 'BlockScaling'\)"):
    checkpoint.restore(tmp_path / "ckpt", state, jax_fp8.BlockScaling())
  target, _ = linen_run(other, x, y)  # rings of 16 where the checkpoint has 8
  with pytest.raises(ValueError, match=r"target's scale rings differ .*\[8\].*\[16\]"):
    checkpoint.restore(tmp_path / "ckpt", target, RECIPE)
  with pytest.raises(TypeError, match="recipe must be a DelayedScaling, .* got str"):
    checkpoint.restore(tmp_path / "ckpt", state, "delayed")
  # orbax writes a NumPy scalar but cannot read one back: refused when saved
  with pytest.raises(TypeError, match=r"state\['lr'\] is a NumPy scalar \(float32\); .* "
                                      r"np.asarray"):
    checkpoint.save(tmp_path / "scalar", {"lr": np.float32(0.5), "state": state}, RECIPE)
  # Fields that do not define the state may change.
  fresh, _ = linen_run(RECIPE, x, y)
  assert_same(checkpoint.restore(tmp_path / "ckpt", fresh, jax_fp8.DelayedScaling(
      history_len=8, fp8_min_intensity=900.0)), state)
  for wrong in (other, jax_fp8.BlockScaling()):  # save checks the rings against the recipe
    with pytest.raises(ValueError, match="pass the recipe the layers ran with"):
      checkpoint.save(tmp_path / "wrong", state, wrong)
  with pytest.raises(FileExistsError):
    checkpoint.save(tmp_path / "ckpt", state, RECIPE)
  # A target of other leaves: another shape or dtype, a leaf more or less.
  kernel = state["params"]["Dense_1"]["kernel"]
  for params, want in (
      ({**state["params"], "Dense_1": {**state["params"]["Dense_1"], "kernel": kernel[:8]}},
       r"\['Dense_1'\]\['kernel'\]\W+\(\{'shape': \[64, 16\], 'dtype'.*\{'shape': \[8, 16\]"),
      ({**state["params"], "Dense_1": {**state["params"]["Dense_1"],
                                       "kernel": kernel.astype(jnp.bfloat16)}}, "'bfloat16'"),
      ({**state["params"], "extra": jnp.ones(3)}, r"\['extra'\]\W+\(None, \{'shape': \[3\]"),
      ({"Dense_0": state["params"]["Dense_0"]}, r"\(2 differences.*\['Dense_1'\]\['bias'\]\W+\(\{"),
  ):
    with pytest.raises(ValueError, match=r"target's leaves differ from the checkpoint's.*" + want):
      checkpoint.restore(tmp_path / "ckpt", {**state, "params": params}, RECIPE)
  with pytest.raises(TypeError, match="recipe must be a DelayedScaling, a CurrentScaling, a "
                                      "BlockScaling, an MXFP8BlockScaling or an NVFP4"):
    checkpoint.save(tmp_path / "other", state, "hybrid")
  with pytest.raises(ValueError, match="state holds no array"):
    checkpoint.save(tmp_path / "empty", {}, jax_fp8.NVFP4BlockScaling())
  with pytest.raises(FileNotFoundError, match="holds no jax_fp8 checkpoint"):
    checkpoint.restore(tmp_path, state, RECIPE)
  meta_path = tmp_path / "ckpt" / checkpoint.METADATA
  meta = json.loads(meta_path.read_text())
  meta_path.write_text(json.dumps({**meta, "schema_version": 99}))
  with pytest.raises(ValueError, match="schema version 99; this jax_fp8 reads version 2"):
    checkpoint.restore(tmp_path / "ckpt", state, RECIPE)


@pytest.mark.parametrize("damage, message", [
    (lambda text: text[: len(text) // 2], "is not valid JSON"),
    (lambda text: "\xff\xfe", "is not valid JSON"),
    (lambda text: "[1, 2]", "schema version None"),
    (lambda text: json.dumps({**json.loads(text), "leaves": None}), "lacks a valid leaves"),
    (lambda text: json.dumps({k: v for k, v in json.loads(text).items() if k != "rings"}),
     "lacks a valid rings"),
])
def test_damaged_metadata_is_named(rng, tmp_path, damage, message):
  """A truncated, corrupted or wrongly shaped metadata file is a ValueError naming the file."""
  x, y = data(rng)
  state, _ = linen_run(RECIPE, x, y)
  checkpoint.save(tmp_path / "ckpt", state, RECIPE)
  meta_path = tmp_path / "ckpt" / checkpoint.METADATA
  meta_path.write_bytes(damage(meta_path.read_text()).encode("latin-1"))  # "\xff": bad UTF-8
  with pytest.raises(ValueError, match=message) as e:
    checkpoint.restore(tmp_path / "ckpt", state, RECIPE)
  assert str(meta_path) in str(e.value)


def test_a_failed_save_leaves_nothing(rng, tmp_path, monkeypatch):
  """A leaf orbax cannot store is refused before anything is written; a save that fails while
  writing leaves no directory behind, so the same save can be retried; a recipe built from
  NumPy scalars saves and restores."""
  x, y = data(rng)
  state, _ = linen_run(RECIPE, x, y)
  with pytest.raises(TypeError, match=r"state\['name'\] is a str; a checkpoint stores arrays"):
    checkpoint.save(tmp_path / "ckpt", {**state, "name": "run1"}, RECIPE)

  def fail(*args, **kwargs):
    raise OSError("disk full")
  with monkeypatch.context() as m:
    m.setattr(checkpoint.ocp.StandardCheckpointer, "save", fail)
    with pytest.raises(OSError, match="disk full"):
      checkpoint.save(tmp_path / "ckpt", state, RECIPE)
  assert list(tmp_path.iterdir()) == []
  numpy_recipe = jax_fp8.DelayedScaling(history_len=np.int64(RECIPE.history_len),
                                        margin=np.int32(0), fp8_min_intensity=np.float32(0),
                                        fast_accum_gemms=RECIPE.fast_accum_gemms)
  assert numpy_recipe == RECIPE and type(numpy_recipe.history_len) is int
  checkpoint.save(tmp_path / "ckpt", state, numpy_recipe)
  assert sorted(v.name for v in tmp_path.iterdir()) == ["ckpt"]
  fresh, _ = linen_run(RECIPE, x, y)
  assert_same(checkpoint.restore(tmp_path / "ckpt", fresh, RECIPE), state)
  abstract = jax.eval_shape(lambda: linen_run(RECIPE, x, y)[0])  # restore without allocating
  assert_same(checkpoint.restore(tmp_path / "ckpt", abstract, RECIPE), state)
  # a Python number (a TrainState's step) is the int32 array eval_shape makes of it
  checkpoint.save(tmp_path / "step", {"step": 3, "state": state}, RECIPE)
  restored = checkpoint.restore(tmp_path / "step",
                                jax.eval_shape(lambda: {"step": 3, "state": state}), RECIPE)
  assert int(restored["step"]) == 3
  assert_same(restored["state"], state)


def test_nnx_state(rng, tmp_path):
  """An NNX model's state saves and restores (the directory given as a str)."""
  x, _ = data(rng)
  model = jax_fp8.nnx.Linear(32, 16, recipe=RECIPE, rngs=nnx.Rngs(0))
  nnx_step(model, x)
  state = nnx.state(model)
  checkpoint.save(str(tmp_path / "ckpt"), state, RECIPE)
  fresh = jax_fp8.nnx.Linear(32, 16, recipe=RECIPE, rngs=nnx.Rngs(1))
  restored = checkpoint.restore(str(tmp_path / "ckpt"), nnx.state(fresh), RECIPE)
  nnx.update(fresh, restored)
  assert_same(nnx.state(fresh), state)
  np.testing.assert_array_equal(np.asarray(fresh(x)), np.asarray(model(x)))


def test_stacked_expert_rings(rng, tmp_path):
  """A MoE layer's state (one ring per expert kernel, stacked [G, L]) saves and restores; a
  recipe of another history length is still refused."""
  x = jnp.asarray(rng.standard_normal((24, 32)), jnp.float32)
  model = jax_fp8.nnx.MoeMlp(32, 4, 2, 16, recipe=RECIPE, rngs=nnx.Rngs(0))
  nnx_step(model, x)
  state = nnx.state(model)
  checkpoint.save(tmp_path / "ckpt", state, RECIPE)
  fresh = jax_fp8.nnx.MoeMlp(32, 4, 2, 16, recipe=RECIPE, rngs=nnx.Rngs(1))
  restored = checkpoint.restore(tmp_path / "ckpt", nnx.state(fresh), RECIPE)
  nnx.update(fresh, restored)
  assert_same(nnx.state(fresh), state)
  other = jax_fp8.DelayedScaling(history_len=4, fast_accum_gemms=("fprop",))
  with pytest.raises(ValueError, match="was not made by the recipe"):
    checkpoint.save(tmp_path / "other", state, other)
