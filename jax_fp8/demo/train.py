"""The train step that the demo runs and the benchmarks time, built once: the loss, its
gradients and the next FP8 state, the optimizer's update; with options for microbatches,
kernels cast once a step, data parallelism under ``shard_map``, and a gradients-only step.
Also the demo's presets, optimizer and step keys, which ``benchmarks.demo_step`` and
``benchmarks.data_parallel`` reuse.

A step carries ``(params, opt_state, collections)``: ``collections`` is every variable
collection of the model but its parameters (``init_variables``): jax_fp8's scale rings
(``"fp8_state"``, advanced by ``jax_fp8.update_state``), Flax's FP8 collection (replaced by its
gradient, as Flax prescribes); ``{}`` for BF16 and the stateless recipes. A mixture-of-experts
model's (``Config.moe_experts``) training losses add its load-balancing loss (``moe_loss``); its
validation loss is the cross-entropy alone.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

import jax_fp8
import jax_fp8.flax

from .model import FLAX_FP8_COLLECTION, Config, Transformer
from .twins import LOAD_BALANCING

STATE = jax_fp8.flax.STATE_COLLECTION
INTERMEDIATES = "intermediates"  # where MoE layers sow their load-balancing loss (and counts)
SKIP_STEPS = 2  # steps left out of a loop's timing: compilation, then the first donated step


@dataclasses.dataclass(frozen=True)
class Preset:
  """Model, batch and schedule of one demo size."""

  d_model: int
  n_heads: int
  n_layers: int
  seq_len: int
  batch: int
  steps: int
  lr: float
  val_batches: int
  moe_experts: int = 0  # > 0: every MLP a dropless mixture of this many experts (Config's)
  moe_top_k: int = 2
  moe_hidden: int | None = None  # each expert's hidden size; None: the dense MLP's

  def config(self, fp8: bool, recipe: str = "delayed", attention: str | None = None,
             fast_accum_gemms: tuple[str, ...] = ()) -> Config:
    """The demo's model of this size: FP8 under ``recipe`` or its BF16 twin."""
    moe = {f: getattr(self, f) for f in MOE_FIELDS} if self.moe_experts else {}
    return Config(self.d_model, self.n_heads, self.n_layers, self.seq_len,
                  linear="fp8" if fp8 else "bf16", recipe=recipe, attention=attention,
                  fast_accum_gemms=fast_accum_gemms, **moe)

  def record(self) -> dict:
    """The fields a run records among its settings: the MoE ones only for a MoE preset (so
    the dense runs saved before they existed still match)."""
    fields = dataclasses.asdict(self)
    return fields if self.moe_experts else {
        k: v for k, v in fields.items() if k not in MOE_FIELDS}


MOE_FIELDS = ("moe_experts", "moe_top_k", "moe_hidden")  # Preset's, named as Config's


PRESETS = {
    # For the test suite: a few seconds of training, most of it compilation.
    "smoke": Preset(d_model=128, n_heads=2, n_layers=1, seq_len=32, batch=4, steps=10, lr=3e-3,
                    val_batches=2),
    # Two CPU cores: both runs in about two minutes, compilation included.
    "cpu": Preset(d_model=128, n_heads=4, n_layers=2, seq_len=128, batch=16, steps=250, lr=3e-3,
                  val_batches=8),
    # One NVIDIA H200: ~400M parameters and 32K tokens a step, large enough GEMMs for FP8 to win.
    "gpu": Preset(d_model=2048, n_heads=16, n_layers=8, seq_len=1024, batch=32, steps=300,
                  lr=3e-4, val_batches=8),
    # The gpu preset's model, every MLP a mixture of 8 experts, top 2, each half the dense
    # MLP's width: a token's expert FLOPs those of the dense MLP, 4x its parameters.
    "moe": Preset(d_model=2048, n_heads=16, n_layers=8, seq_len=1024, batch=32, steps=300,
                  lr=3e-4, val_batches=8, moe_experts=8, moe_top_k=2, moe_hidden=4096),
    # The smoke preset's, with 4 experts of 64, top 2 (the test suite's).
    "moe_smoke": Preset(d_model=128, n_heads=2, n_layers=1, seq_len=32, batch=4, steps=4,
                        lr=3e-3, val_batches=2, moe_experts=4, moe_top_k=2, moe_hidden=64),
}


def preset_name(name: str) -> str:
  """A ``--preset`` choice as a key of ``PRESETS``: "auto" is "gpu" on a GPU backend, else
  "cpu"."""
  if name == "auto":
    return "gpu" if jax.default_backend() == "gpu" else "cpu"
  return name


def _is_kernel(params):
  return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(preset: Preset, steps: int) -> optax.GradientTransformation:
  """AdamW with linear warmup (10% of the steps) and cosine decay to 10%, clipped at norm 1;
  weight decay on the kernels (rank >= 2) only."""
  schedule = optax.warmup_cosine_decay_schedule(0.0, preset.lr, max(1, steps // 10), steps,
                                                end_value=preset.lr / 10)
  return optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.1, mask=_is_kernel))


def init_variables(model: Transformer, seed: int):
  """``(params, collections)`` of a fresh ``model``, from ``jax.random.key(seed)``."""
  tokens = jnp.zeros((1, model.cfg.seq_len), jnp.int32)
  variables = dict(jax.jit(model.init)(jax.random.key(seed), tokens))
  variables.pop(INTERMEDIATES, None)  # what a MoE layer sows: a loss of the step, not a state
  return variables.pop("params"), variables


def step_key(seed: int, step: int) -> jax.Array:
  """The key of training step ``step``: the seed's key for stochastic rounding, folded with the
  step (every layer folds in its own path)."""
  return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), 1), step)


def _variables(params, collections) -> dict:
  return {"params": params, **collections}


def _rngs(key) -> dict:
  """The layers' rng streams: this step's key for NVFP4's stochastic rounding, if any."""
  return {} if key is None else {jax_fp8.flax.SR_STREAM: key}


def _is_moe(model) -> bool:
  cfg = getattr(model, "cfg", None)
  return cfg is not None and cfg.moe


def sown(intermediates, name: str) -> list[jax.Array]:
  """The values that a model's layers sowed as ``name`` in ``intermediates`` (one a layer;
  stacked [L] under ``nn.scan``), each raveled."""
  return [jnp.ravel(v) for path, v in jax.tree_util.tree_leaves_with_path(intermediates)
          if any(getattr(k, "key", None) == name for k in path)]


def moe_loss(intermediates) -> jax.Array:
  """The mean of the load-balancing losses that a model's MoE layers sowed in ``intermediates``
  (one a block; stacked [L] under ``nn.scan``), f32 []."""
  return jnp.mean(jnp.concatenate(sown(intermediates, LOAD_BALANCING)).astype(jnp.float32))


def _apply(model, params, collections, x, key, aux: bool = True):
  """``model.apply``'s output; with ``aux``, for a MoE model (``cfg.moe``), with the
  load-balancing loss times ``cfg.moe_aux_weight`` (else None, no op traced)."""
  variables, rngs = _variables(params, collections), _rngs(key)
  if not (aux and _is_moe(model)):
    return model.apply(variables, x, rngs=rngs), None
  out, intermediates = model.apply(variables, x, rngs=rngs, mutable=[INTERMEDIATES])
  return out, model.cfg.moe_aux_weight * moe_loss(intermediates[INTERMEDIATES])


def cross_entropy(model, params, collections, batch, key=None, *, with_aux: bool = True):
  """Mean next-token cross-entropy, f32 [] (with ``with_aux``, plus a MoE model's weighted
  load-balancing loss: the training loss); a loss of ``make_train_step``.

  batch: integer [B, T + 1] tokens (uint8 bytes or int32). key: this step's key for NVFP4's
  stochastic rounding (the layers' "stochastic_rounding" rng stream), or None.
  """
  tokens = batch.astype(jnp.int32)
  logits, aux = _apply(model, params, collections, tokens[:, :-1], key, with_aux)
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
  return loss if aux is None else loss + aux


def mean_square(model, params, collections, x, key=None):
  """mean(block(x)^2) in f32 of a ``Block`` (``benchmarks.block``'s loss). x: [B, T, D]."""
  (y, _), aux = _apply(model, params, collections, x, key)
  loss = jnp.mean(jnp.square(y.astype(jnp.float32)))
  return loss if aux is None else loss + aux


def next_collections(collections, grads) -> dict:
  """The collections of the next step: jax_fp8's rings advanced by their observations (their
  gradients), Flax's FP8 collection replaced by its gradient."""
  out = dict(collections)
  if STATE in collections:
    out[STATE] = jax_fp8.update_state(collections[STATE], grads[STATE])
  if FLAX_FP8_COLLECTION in collections:
    out[FLAX_FP8_COLLECTION] = grads[FLAX_FP8_COLLECTION]
  return out


def _add_microbatch(loss, params, rest, key, total, xs):
  """A ``lax.scan`` body: ``total`` plus one microbatch's loss (its share of the rings)."""
  part, shared, i = xs
  collections = rest if shared is None else {**rest, STATE: shared}
  return total + loss(params, collections, part,
                      None if key is None else jax.random.fold_in(key, i)), None


def batch_loss(loss, microbatches: int, cast_kernels, params, collections, batch, key):
  """``loss`` of the batch: the mean over ``microbatches`` parts of it (a scan, jax_fp8's state
  ``jax_fp8.share``d among them; Flax's FP8 collection combines its gradients by max itself),
  the kernels first cast once under recipe ``cast_kernels`` (``jax_fp8.flax.cast_kernels``)
  where given."""
  if cast_kernels is not None:
    params = jax_fp8.flax.cast_kernels(params, collections[STATE], cast_kernels)
  if microbatches == 1:
    return loss(params, collections, batch, key)
  rest = {k: v for k, v in collections.items() if k != STATE}
  state = collections.get(STATE)
  xs = (batch.reshape(microbatches, batch.shape[0] // microbatches, -1),
        None if state is None else jax_fp8.share(state, microbatches), jnp.arange(microbatches))
  body = functools.partial(_add_microbatch, loss, params, rest, key)
  return jax.lax.scan(body, 0.0, xs)[0] / microbatches


def gradients(loss, params, collections, batch, key, microbatches: int = 1,
              cast_kernels=None):
  """(the loss, the parameters' gradients, the next collections) of one batch."""
  value, (grads, collection_grads) = jax.value_and_grad(
      functools.partial(batch_loss, loss, microbatches, cast_kernels), argnums=(0, 1))(
          params, collections, batch, key)
  return value, grads, next_collections(collections, collection_grads)


def _data_parallel(grads_fn, axis: str, n: int, params, collections, batch, key):
  """``grads_fn`` on this device's part of the batch: the gradients (summed over the devices
  by shard_map's transpose) divided by n, the loss averaged over ``axis``."""
  value, grads, collections = grads_fn(params, collections, batch, key)
  grads = jax.tree.map(lambda g: g / n, grads)
  return jax.lax.pmean(value, axis), grads, collections


def train_step(grads_fn, tx, params, opt_state, collections, batch, key):
  """One step: ``(params, opt_state, collections, loss)`` after ``batch``."""
  value, grads, collections = grads_fn(params, collections, batch, key)
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, collections, value


def make_train_step(model, tx: optax.GradientTransformation, *, loss=cross_entropy,
                    microbatches: int = 1, cast_kernels=None, mesh=None, axis: str = "data"):
  """The jitted ``step(params, opt_state, collections, batch, key) -> (params, opt_state,
  collections, loss)`` of ``model`` under ``loss(model, params, collections, batch, key)``,
  its first three arguments donated; key: None, or the step's key for stochastic rounding.

  microbatches: the batch's parts scanned over, gradients accumulated (``batch_loss``).
  cast_kernels: a recipe; the kernels cast once a step under it. mesh: data parallelism over
  its ``axis`` under ``shard_map``: the batch split along it, parameters and collections
  replicated, the gradients averaged (the model's ``amax_axis_name`` reduces the amaxes).
  """
  grads_fn = functools.partial(gradients, functools.partial(loss, model),
                               microbatches=microbatches, cast_kernels=cast_kernels)
  if mesh is not None:
    grads_fn = jax.shard_map(
        functools.partial(_data_parallel, grads_fn, axis, mesh.shape[axis]), mesh=mesh,
        in_specs=(P(), P(), P(axis), P()), out_specs=(P(), P(), P()))
  return jax.jit(functools.partial(train_step, grads_fn, tx), donate_argnums=(0, 1, 2))


def grad_step(loss, params, collections, batch):
  """``(the parameters' gradients, the next collections)`` of one batch."""
  _, grads, collections = gradients(loss, params, collections, batch, None)
  return grads, collections


def make_grad_step(model, *, loss=mean_square):
  """``step(params, collections, batch) -> (grads, collections)``, not jitted: the train step
  without an optimizer (``benchmarks.block``'s)."""
  return functools.partial(grad_step, functools.partial(loss, model))


def evaluate(loss, params, collections, batches):
  """The mean of ``loss`` over batches [n, ...] (one at a time)."""
  return jnp.mean(jax.lax.map(functools.partial(loss, params, collections), batches))


def make_eval(model, *, loss=functools.partial(cross_entropy, with_aux=False)):
  """Jitted ``(params, collections, batches) -> mean loss`` over uint8 [n, B, T + 1] (by
  default the cross-entropy alone, a MoE model's too)."""
  return jax.jit(functools.partial(evaluate, functools.partial(loss, model)))
