"""An existing linen model converted in one line and trained with Flax's ``TrainState``: the FP8
state (the "fp8_state" collection, ``DelayedScaling``'s scale rings) is one more field of the
train state, threaded through the jitted step beside the params and the optimizer state, and
its gradient turned into the next rings by ``jax_fp8.update_state``.

Run: ``python examples/convert_train_state.py`` (CPU or GPU; ``main(steps)`` returns the train
state and the losses).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import optax
from flax.training import train_state

import jax_fp8
from jax_fp8.convert import conversion_report, convert

VOCAB, D, LEN, BATCH = 64, 64, 16, 8


class TinyLM(nn.Module):
  """A model written without jax_fp8 in mind: embedding, two MLP blocks, a head."""

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(VOCAB, D)(tokens)
    for _ in range(2):
      x = x + nn.Dense(D)(nn.gelu(nn.Dense(4 * D)(nn.LayerNorm()(x))))
    return nn.Dense(VOCAB, name="lm_head")(nn.LayerNorm()(x))  # HEAD_PATTERN keeps it as it is


class TrainState(train_state.TrainState):
  fp8_state: Any = None  # the converted model's "fp8_state" collection ({} without rings)


def create(model, recipe, key, tokens, learning_rate=3e-3) -> TrainState:
  variables = model.init(key, tokens)
  return TrainState.create(apply_fn=model.apply, params=variables["params"],
                           tx=optax.adam(learning_rate),
                           fp8_state=variables.get("fp8_state", {}))


@jax.jit
def train_step(state: TrainState, inputs, targets):
  def loss_fn(params, fp8_state):
    logits = state.apply_fn({"params": params, "fp8_state": fp8_state}, inputs)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
  loss, (grads, state_grads) = jax.value_and_grad(loss_fn, argnums=(0, 1))(state.params,
                                                                           state.fp8_state)
  # The params take the optimizer's step; the rings take their observation of this step.
  state = state.apply_gradients(grads=grads,
                                fp8_state=jax_fp8.update_state(state.fp8_state, state_grads))
  return state, loss


def main(steps: int = 30, seed: int = 0):
  recipe = jax_fp8.DelayedScaling()  # FP8 at every shape (the toy's are far below the crossover)
  model = convert(TinyLM(), recipe)
  tokens = jax.random.randint(jax.random.key(seed), (BATCH, LEN + 1), 0, VOCAB)
  inputs, targets = tokens[:, :-1], tokens[:, 1:]
  print(conversion_report(model, inputs))
  state = create(model, recipe, jax.random.key(seed + 1), inputs)
  losses = []
  for _ in range(steps):
    state, loss = train_step(state, inputs, targets)
    losses.append(float(loss))
  print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} in {steps} steps")
  return state, losses


if __name__ == "__main__":
  main()
