"""Checkpoints of a whole train state that carry their FP8 recipe: ``save`` and ``restore``
through orbax (``orbax-checkpoint``, which the ``flax`` extra installs).

A checkpoint directory holds orbax's checkpoint of the state in ``state/`` and ``jax_fp8.json``,
the schema (``SCHEMA_VERSION`` 2)::

    {"schema_version": 2, "jax_fp8_version": "0.3.0",
     "recipe": {"type": "DelayedScaling", "fp8_format": "hybrid", "history_len": 16, ...},
     "rings": {"<path of a ScaleRing in the state>": {"fmt": "e4m3", "margin": 0,
                                                      "algo": "max", "shape": [16]}, ...},
     "leaves": {"<path of a leaf>": {"shape": [4096, 1024], "dtype": "float32"}, ...}}

The state is any pytree (a linen train state with its "fp8_state" collection, an NNX
``nnx.state(model)``, optimizer state included). Orbax stores the arrays; a ring's format,
margin and algo are static pytree fields, so they come back from the restore target, which
``restore`` checks against the saved ones: a checkpoint never lands in rings of another
recipe. Changing a recipe field that defines the state is refused, not migrated; so is a
target whose leaves differ from the saved ones in path, shape or dtype. A restored state is bit
for bit the saved one, so a restored run continues as the uninterrupted one would.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
import uuid

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from . import __version__
from .recipes import check_recipe
from .state import ScaleRing

SCHEMA_VERSION = 2
METADATA = "jax_fp8.json"


# The recipe fields that define the FP8 state (the rest, e.g. fast_accum_gemms or
# fp8_min_intensity, may change between a save and a restore); of a stateless recipe, its type.
STATE_FIELDS = ("type", "fp8_format", "history_len", "margin", "algo")


def _recipe_dict(recipe) -> dict:
  check_recipe(recipe)
  fields = {k: list(v) if isinstance(v, tuple) else v
            for k, v in dataclasses.asdict(recipe).items()}
  return {"type": type(recipe).__name__, **fields}


def _rings(state) -> dict:
  """{path: the ring's static fields and history shape} of every ScaleRing in ``state``."""
  leaves = jax.tree_util.tree_flatten_with_path(
      state, is_leaf=lambda v: isinstance(v, ScaleRing))[0]
  return {jax.tree_util.keystr(path): {"fmt": r.fmt, "margin": r.margin, "algo": r.algo,
                                       "shape": list(jax.numpy.shape(r.amax_history))}
          for path, r in leaves if isinstance(r, ScaleRing)}


def _check_rings(rings: dict, recipe) -> None:
  """Every ring was made by ``recipe`` (none under the stateless recipes)."""
  if not recipe.stateful:
    if rings:
      raise ValueError(f"the state holds scale rings ({sorted(rings)[:3]} ...) but "
                       f"{type(recipe).__name__} is stateless: pass the recipe the layers ran "
                       f"with")
    return
  want = {"margin": recipe.margin, "algo": recipe.algo, "shape": [recipe.history_len]}
  for path, ring in rings.items():
    # a stacked ring (per expert, per scanned layer) has leading axes before its history
    got = {k: ring[k][-1:] if k == "shape" else ring[k] for k in want}
    if got != want or ring["fmt"] not in (recipe.fwd_fmt, recipe.bwd_fmt):
      raise ValueError(f"ring {path} ({ring}) was not made by the recipe {recipe}: pass the "
                       f"recipe the layers ran with")


def _directory(directory) -> pathlib.Path:
  """``directory`` (a str or os.PathLike) as an absolute path; TypeError otherwise."""
  if not isinstance(directory, (str, os.PathLike)):
    raise TypeError(f"directory must be a str or os.PathLike path, got "
                    f"{type(directory).__name__} {directory!r}")
  return pathlib.Path(directory).absolute()


def _number_dtype(dtype: str) -> str:
  """A leaf's dtype name as JAX holds it: a Python number's ("int", "float") as the array
  ``jax.eval_shape`` makes of it (int32 / float32, 64-bit under x64), so a restore target of
  abstract leaves matches a state with Python numbers (a TrainState's step)."""
  if dtype in ("int", "float"):
    return jnp.dtype(jax.dtypes.canonicalize_dtype({"int": int, "float": float}[dtype])).name
  return dtype


def _leaves(tree, name: str) -> dict:
  """{path: shape and dtype} of every leaf of ``tree`` (argument ``name``): arrays, abstract
  arrays (``jax.ShapeDtypeStruct``, an abstract restore target) and Python numbers, what orbax
  stores; TypeError naming the first other leaf."""
  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if isinstance(leaf, np.generic):  # orbax saves a NumPy scalar but cannot restore one
      raise TypeError(f"{name}{jax.tree_util.keystr(path)} is a NumPy scalar "
                      f"({type(leaf).__name__}); a checkpoint stores arrays and Python numbers: "
                      f"pass np.asarray of it")
    if isinstance(leaf, (int, float)) and not isinstance(leaf, bool):
      shape, dtype = [], _number_dtype(type(leaf).__name__)
    elif hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
      shape, dtype = list(leaf.shape), str(leaf.dtype)
    else:
      raise TypeError(f"{name}{jax.tree_util.keystr(path)} is a {type(leaf).__name__}; a "
                      f"checkpoint stores arrays and numbers only")
    out[jax.tree_util.keystr(path)] = {"shape": shape, "dtype": dtype}
  return out


def _differences(saved: dict, given: dict) -> dict:
  """{key: (saved value, given value)} where the two dicts differ (None where a key is absent)."""
  return {k: (saved.get(k), given.get(k)) for k in sorted(set(saved) | set(given))
          if saved.get(k) != given.get(k)}


def save(directory, state, recipe) -> None:
  """Save ``state`` (any pytree) and ``recipe`` (its layers' recipe, ``linear``'s choices)
  into ``directory`` (a str or os.PathLike), which must not exist yet. The checkpoint is
  written in a temporary directory beside it and renamed into place when complete, so a
  failed save leaves nothing behind. Raises TypeError for another kind of directory, another
  recipe type or a leaf that is no array or Python number (a NumPy scalar, which orbax writes
  but cannot read back, is refused), ValueError when the state's rings were not made by
  ``recipe`` or the state holds no array, FileExistsError for an existing directory."""
  directory = _directory(directory)
  if not jax.tree.leaves(state):
    raise ValueError("state holds no array (the stateless recipes keep no FP8 state, e.g. an "
                     "empty fp8_state collection): save a state with arrays, such as the "
                     "parameters with the FP8 state")
  leaves, recipe_dict, rings = _leaves(state, "state"), _recipe_dict(recipe), _rings(state)
  _check_rings(rings, recipe)
  meta = json.dumps({"schema_version": SCHEMA_VERSION, "jax_fp8_version": __version__,
                     "recipe": recipe_dict, "rings": rings, "leaves": leaves}, indent=1)
  if directory.exists():
    raise FileExistsError(f"checkpoint directory {directory} exists already")
  partial = directory.with_name(f".{directory.name}.{uuid.uuid4().hex}.partial")
  partial.mkdir(parents=True)  # the user's umask applies, as to the directory itself
  try:
    with ocp.StandardCheckpointer() as ckpt:
      ckpt.save(partial / "state", state)
    (partial / METADATA).write_text(meta)
    partial.rename(directory)
  except BaseException:
    shutil.rmtree(partial, ignore_errors=True)
    raise


def _metadata(directory: pathlib.Path) -> dict:
  """The checked contents of ``directory``'s METADATA file: FileNotFoundError where it is
  missing, ValueError (naming the file) where it is no JSON object of this schema."""
  path = directory / METADATA
  if not path.is_file():
    raise FileNotFoundError(f"{directory} holds no jax_fp8 checkpoint (no {METADATA})")
  try:
    meta = json.loads(path.read_text())
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ValueError(f"{path} is not valid JSON ({e}): the checkpoint's metadata is corrupted "
                     f"or truncated") from None
  if not isinstance(meta, dict) or meta.get("schema_version") != SCHEMA_VERSION:
    version = meta.get("schema_version") if isinstance(meta, dict) else None
    raise ValueError(f"{path}: checkpoint schema version {version!r}; this jax_fp8 reads "
                     f"version {SCHEMA_VERSION}")
  kinds = {"recipe": dict, "rings": dict, "leaves": dict}
  wrong = [k for k, kind in kinds.items() if not isinstance(meta.get(k), kind)]
  if wrong:
    raise ValueError(f"{path} lacks a valid {', '.join(wrong)} entry (JSON objects expected): "
                     f"the checkpoint's metadata is damaged")
  return meta


def restore(directory, target, recipe):
  """The state saved in ``directory``, restored against ``target`` (a state of the same
  structure, e.g. a freshly initialized one, whose rings carry the static fields; its leaves
  may be abstract, ``jax.eval_shape``'s ``ShapeDtypeStruct``s, with shardings for orbax).

  Raises:
    TypeError when ``directory`` is no str or os.PathLike, or a leaf of ``target`` is no
    array, abstract array or number.
    ValueError when the checkpoint's schema version is not ``SCHEMA_VERSION``, when
    ``recipe`` differs from the saved one in a field that defines the state
    (``STATE_FIELDS``: the recipe type, format, history length, margin, algo; the differing
    ones are named; of a stateless recipe only its type), or when the target's rings differ
    from the saved ones (paths, formats, margins, algos, history lengths), or when its leaves
    differ from the saved ones (paths, shapes, dtypes; the first five named). Other fields
    (``fast_accum_gemms``, ``fp8_min_intensity``, BlockScaling's ``ue8m0`` and ``eps``,
    CurrentScaling's ``margin``) may change.
    ValueError naming the metadata file when it is no valid JSON or lacks an entry.
    FileNotFoundError when ``directory`` holds no jax_fp8 checkpoint.
  """
  directory = _directory(directory)
  given = _recipe_dict(recipe)  # checks the recipe
  meta = _metadata(directory)
  fields = STATE_FIELDS if recipe.stateful else ("type",)
  saved, wanted = ({k: v for k, v in d.items() if k in fields} for d in (meta["recipe"], given))
  if saved != wanted:
    raise ValueError(f"the checkpoint was saved under another recipe; (saved, given) per field: "
                     f"{_differences(saved, wanted)}")
  rings = _rings(target)
  if rings != meta["rings"]:
    raise ValueError(f"the target's scale rings differ from the checkpoint's; (saved, target) per "
                     f"ring: {_differences(meta['rings'], rings)}")
  leaves = _leaves(target, "target")
  saved_leaves = {k: {**v, "dtype": _number_dtype(v.get("dtype"))} if isinstance(v, dict) else v
                  for k, v in meta["leaves"].items()}
  if leaves != saved_leaves:
    diff = _differences(saved_leaves, leaves)
    raise ValueError(f"the target's leaves differ from the checkpoint's ({len(diff)} "
                     f"differences; restore into a state initialized as the saved one was); "
                     f"(saved, target) at the first: {dict(list(diff.items())[:5])}")
  with ocp.StandardCheckpointer() as ckpt:
    return ckpt.restore(directory / "state", target=target)
