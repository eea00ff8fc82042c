"""Training recipes for ``jax_fp8.linear`` and ``jax_fp8.flax.Dense``: frozen, hashable
dataclasses (usable as jit static arguments), checked when built.

Each recipe answers what the layers ask of it (``Recipe``'s attributes): whether it keeps scale
rings, the multiple K and N must be of, over which devices its amaxes are reduced, whether it
draws a PRNG key, whether it serves ``cast_kernel`` and ``Fp8Weight`` and fuses the norm and the
MLP's activation, and which family module in ``jax_fp8.families`` quantizes its operands and
runs its GEMMs. A new recipe is a class here and a family module there."""

from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np

from . import checks
from .formats import (BLOCK, BLOCK_ROW_ALIGN, DIM_MULTIPLE, GROUP_EPS, MX_BLOCK, NVFP4_BLOCK,
                      ROW_ALIGN)
from .hadamard import rht_signs
from .state import HISTORY_LEN, ScaleRing, check_history_len, check_ring_params

LINEAR_GEMMS = ("fprop", "dgrad", "wgrad")  # a linear's three GEMMs
# The GEMM intensity M*N*K / (M*K + K*N + M*N) below which an FP8 linear was slower than BF16
# on the H200 (docs/performance.md, "Where FP8 pays"): a value for fp8_min_intensity.
CROSSOVER_INTENSITY = 900.0


def check_fp8_min_intensity(recipe) -> None:
  """Validate a recipe's ``fp8_min_intensity``: a linear whose GEMM does fewer multiply-adds
  per element of x, kernel and output than this, ``M*N*K / (M*K + K*N + M*N)``, runs in the
  input's dtype through XLA (BF16 GEMMs), because there the quantization passes cost more
  than the FP8 GEMMs save; its rings are then untouched (no observation this step). M counts
  the rows the call sees: under shard_map, one device's. docs/performance.md gives the
  crossover measured on the H200. The FP8 shape rules (K, N multiples of 16, or 128 under
  BlockScaling) apply only to FP8 layers. Raises TypeError / ValueError unless it is a finite
  number >= 0."""
  checks.number(recipe.fp8_min_intensity, f"{type(recipe).__name__}.fp8_min_intensity", lo=0)


def check_fast_accum_gemms(recipe) -> None:
  """Validate a per-tensor recipe's ``fast_accum_gemms`` and store it as a tuple in the
  canonical order of ``LINEAR_GEMMS``; TypeError for no tuple, list or set of strings,
  ValueError for other names or a name twice."""
  v = recipe.fast_accum_gemms
  rule = (f"{type(recipe).__name__}.fast_accum_gemms must be a tuple (or list or set) of "
          f"distinct names from {LINEAR_GEMMS}, got {v!r}")
  if (isinstance(v, str) or not isinstance(v, (tuple, list, set, frozenset))
      or not all(isinstance(g, str) for g in v)):
    raise TypeError(rule)
  if not all(g in LINEAR_GEMMS for g in v) or len(set(v)) != len(v):
    raise ValueError(rule)
  object.__setattr__(recipe, "fast_accum_gemms", tuple(g for g in LINEAR_GEMMS if g in v))


def python_values(recipe) -> None:
  """Store the NumPy scalars given for a recipe's fields as the Python values they hold, so
  that the recipe prints and serializes (a checkpoint's JSON) as one built from them."""
  for field in dataclasses.fields(recipe):
    value = getattr(recipe, field.name)
    if isinstance(value, np.generic):
      object.__setattr__(recipe, field.name, value.item())


class Recipe:
  """What every recipe answers, as class attributes (and ``draws_key``, a property).

  Attributes:
    family: the module of ``jax_fp8.families`` that quantizes x, the kernel and the gradient
      and runs the GEMMs under this recipe (its ``custom_vjp``s).
    gemm_format: the operands' format in words, for reports: "FP8" (per-tensor and block
      scaling), "MXFP8" or "NVFP4".
    stateful: whether a layer keeps scale rings (a ``LinearState`` and its kin) under it.
    amax_scope: "state" (amaxes max-reduced over ``amax_axis_name`` so the devices' rings stay
      in step), "tensor" (each tensor's amax of this step reduced over the devices that share
      it, before quantizing) or "local" (block scales from each device's own data: no
      reduction, and ``amax_axis_name`` must be None).
    dim_multiple: the multiple K and N (an MLP's F and D too) must be of on the FP8 path.
    dim_reason: why, in words (``dim_rule``, a property, states the rule for errors).
    casts_kernel: whether ``cast_kernel`` and ``Fp8Weight`` (inference) serve it.
    fuses: whether the input norm and the MLP's activation run inside its quantizers (else the
      layers compose XLA's norm and activation with its linears).
    grouped: whether ``grouped_linear`` and ``grouped_mlp`` serve it (its family has the
      grouped rules: the grouped FP8 GEMMs take per-tensor scales, one per operand or per
      expert, or block ones).
    grouped_row_align: under ``grouped`` recipes, the multiple of rows at which every
      non-empty group must start in the grouped wgrad's operands (the grouped layers'
      ``aligned=True`` promise, ``moe_mlp``'s padding of each expert's rows): 16 per-tensor
      (``ROW_ALIGN``), 128 under block scaling (``BLOCK_ROW_ALIGN``: whole 1 x 128 groups).
  """

  family: str
  gemm_format: str = "FP8"
  stateful: bool = False
  amax_scope: str
  dim_multiple: int
  dim_reason: str
  casts_kernel: bool = False
  fuses: bool = False
  grouped: bool = False
  grouped_row_align: int | None = None

  @property
  def dim_rule(self) -> str:
    """The K / N rule in words, naming the recipe (for errors and convert's report)."""
    return (f"{type(self).__name__} needs K and N multiples of {self.dim_multiple} "
            f"({self.dim_reason})")

  @property
  def draws_key(self) -> bool:
    """Whether a linear under this recipe takes a PRNG key (stochastic rounding)."""
    return False

  @classmethod
  def article(cls) -> str:
    """The class's name with its indefinite article, for messages."""
    return ("an " if cls.__name__[0] in "MN" else "a ") + cls.__name__


class PerTensorFormats(Recipe):
  """The per-tensor recipes: one scale per tensor, their FP8 formats (``fp8_format``: "hybrid"
  or "e4m3"), GEMMs by cuBLASLt."""

  family = "per_tensor"
  dim_multiple = DIM_MULTIPLE
  dim_reason = "cuBLASLt's FP8 GEMM alignment"
  casts_kernel = True
  fuses = True
  grouped = True
  grouped_row_align = ROW_ALIGN

  @property
  def fwd_fmt(self) -> str:
    """The FP8 format of x and the kernel."""
    return "e4m3"

  @property
  def bwd_fmt(self) -> str:
    """The FP8 format of the output gradient."""
    return "e5m2" if self.fp8_format == "hybrid" else "e4m3"

  def cast_key(self) -> tuple:
    """What decides a ``CastKernel``'s bytes and its ring's protocol: the recipe's type, its
    forward format and margin. A layer takes casts made under a recipe of the same key."""
    return type(self), self.fwd_fmt, self.margin


@dataclasses.dataclass(frozen=True)
class DelayedScaling(PerTensorFormats):
  """Per-tensor delayed-scaling recipe (TransformerEngine's ``DelayedScaling``).

  Attributes:
    fp8_format: "hybrid" (E4M3 for activations and weights, E5M2 for gradients) or "e4m3"
      (E4M3 for all three).
    history_len: amax history length L, 1..1024.
    margin: power-of-two headroom in the scale, an int in [-64, 64].
    algo: "max" (max over the history window) or "most_recent".
    fp8_min_intensity: see ``check_fp8_min_intensity``; 0 (default): always FP8.
    fast_accum_gemms: the linear's GEMMs, among "fprop" (y = x @ kernel), "dgrad" (dx) and
      "wgrad" (dkernel), that let Hopper's FP8 tensor cores accumulate without promotion to
      f32 (``gemm``'s ``fast_accum``): faster, less accurate as K grows. () (default): none.
      ("fprop",) is TransformerEngine's default; all three is what XLA's own FP8 dot does at
      default precision. Stored as a tuple in that canonical order, so recipes that name the
      same GEMMs are equal (and hashable).
  Raises:
    TypeError / ValueError when built with a field out of range.
  """

  stateful = True
  amax_scope = "state"

  fp8_format: Literal["hybrid", "e4m3"] = "hybrid"
  history_len: int = HISTORY_LEN
  margin: int = 0
  algo: Literal["max", "most_recent"] = "max"
  fp8_min_intensity: float = 0.0
  fast_accum_gemms: tuple[str, ...] = ()

  def __post_init__(self):
    python_values(self)
    checks.one_of(self.fp8_format, "DelayedScaling.fp8_format", ("hybrid", "e4m3"))
    check_history_len(self.history_len, "DelayedScaling.")
    check_ring_params("e4m3", self.margin, self.algo, "DelayedScaling.")
    check_fp8_min_intensity(self)
    check_fast_accum_gemms(self)

  def ring(self, fmt: str) -> ScaleRing:
    return ScaleRing.create(self.history_len, fmt, self.margin, self.algo)


@dataclasses.dataclass(frozen=True)
class BlockScaling(Recipe):
  """Block-scaling recipe (DeepSeek-V3 technical report, arXiv 2412.19437, section 3.3): E4M3
  everywhere; activations and output gradients in 1 x 128 groups (along K for the forward and
  dgrad, along the tokens for wgrad), weights in 128 x 128 blocks (the only sizes cuBLASLt's
  block-scaled Hopper GEMMs take). Stateless: scales come from the current tensors.

  Attributes:
    ue8m0: power-of-two scales (UE8M0), as DeepSeek-V3 uses on Hopper; a bool.
    eps: floor of each group's amax (see ``group_quantize``).
    fp8_min_intensity: below it a linear runs in its input's dtype (see
      ``check_fp8_min_intensity``); 0 (default): always FP8.
  Raises:
    TypeError / ValueError when built with a field out of range.
  """

  family = "block"
  amax_scope = "local"
  dim_multiple = BLOCK
  dim_reason = "the groups of x along K and of the gradient along N"
  casts_kernel = True
  fuses = True
  grouped = True
  grouped_row_align = BLOCK_ROW_ALIGN

  ue8m0: bool = False
  eps: float = GROUP_EPS
  fp8_min_intensity: float = 0.0

  def __post_init__(self):
    python_values(self)
    checks.boolean(self.ue8m0, "BlockScaling.ue8m0")
    checks.group_eps(self.eps, "e4m3", "BlockScaling.eps")
    check_fp8_min_intensity(self)

  def kwargs(self) -> dict:
    """The quantizers' keyword arguments under this recipe."""
    return {"fmt": "e4m3", "eps": self.eps, "ue8m0": self.ue8m0}

  def cast_key(self) -> tuple:
    """What decides a ``CastKernel``'s bytes: the recipe's type and its quantizers'
    arguments. A layer takes casts made under a recipe of the same key."""
    return type(self), tuple(sorted(self.kwargs().items()))


@dataclasses.dataclass(frozen=True)
class CurrentScaling(PerTensorFormats):
  """Per-tensor current-scaling recipe (TransformerEngine's ``Float8CurrentScaling``): each
  tensor is quantized with the scale of its own amax in this step, ``amax * 2^margin /
  fmt_max`` (``state.scale_from_amax``; 1 for an all-zero or non-finite tensor, so an inf
  saturates to the format's largest value, while a NaN stays NaN). Stateless.
  The amax is XLA's reduction, one read of the tensor before the quantize kernel's (XLA may
  fuse it into the op that produced the tensor). Under ``pmap`` / ``shard_map`` it is
  max-reduced over the devices that share the tensor before anything is quantized, so every
  device uses one scale (see ``linear``'s ``amax_axis_name``); under a sharded ``jit`` XLA's
  reduction already spans the whole tensor.

  Attributes:
    fp8_format: "hybrid" (E4M3 for activations and weights, E5M2 for gradients) or "e4m3".
    margin: power-of-two headroom in the scale, an int in [-64, 64].
    fp8_min_intensity: see ``check_fp8_min_intensity``; 0 (default): always FP8.
    fast_accum_gemms: as in ``DelayedScaling``.
  Raises:
    TypeError / ValueError when built with a field out of range.
  """

  amax_scope = "tensor"

  fp8_format: Literal["hybrid", "e4m3"] = "hybrid"
  margin: int = 0
  fp8_min_intensity: float = 0.0
  fast_accum_gemms: tuple[str, ...] = ()

  def __post_init__(self):
    python_values(self)
    checks.one_of(self.fp8_format, "CurrentScaling.fp8_format", ("hybrid", "e4m3"))
    check_ring_params("e4m3", self.margin, "most_recent", "CurrentScaling.")
    check_fp8_min_intensity(self)
    check_fast_accum_gemms(self)

  def ring(self, fmt: str) -> ScaleRing:
    """The ring a quantization's scale is set in (``state.current``): one amax, most recent."""
    return ScaleRing.create(1, fmt, self.margin, "most_recent")


@dataclasses.dataclass(frozen=True)
class MXFP8BlockScaling(Recipe):
  """MXFP8 recipe (OCP MX v1.0; TransformerEngine's ``MXFP8BlockScaling``): every GEMM operand in
  1 x 32 blocks along the GEMM's contraction dimension, each with an E8M0 scale rounded up
  (``mxfp8_quantize``), E4M3 elements for activations, weights and gradients: E5M2 gradients
  diverged in public MXFP8 runs, so HYBRID is refused. Each operand is quantized from the
  tensor itself in the direction its GEMM contracts (x along K for fprop and along M for wgrad,
  the gradient along N and M, the kernel along K and N). Stateless. On Hopper, which has no MX
  tensor cores, the GEMMs are emulated (``mxfp8_gemm``: the operands dequantized to bfloat16,
  exactly, then a BF16 GEMM with f32 accumulation): the numerics are a Blackwell MX GEMM's, the
  speed is BF16's plus the quantization passes.

  Attributes:
    fp8_format: "e4m3", the only format taken.
    fp8_min_intensity: see ``check_fp8_min_intensity``; 0 (default): always MXFP8.
  Raises:
    TypeError / ValueError when built with a field out of range.
  """

  family = "mxfp8"
  gemm_format = "MXFP8"
  amax_scope = "local"
  dim_multiple = MX_BLOCK
  dim_reason = ("whole MXFP8 blocks of x and the kernel along K, of the gradient and the "
                "kernel along N")

  fp8_format: Literal["e4m3"] = "e4m3"
  fp8_min_intensity: float = 0.0

  def __post_init__(self):
    python_values(self)
    if not isinstance(self.fp8_format, str):
      raise TypeError(f"MXFP8BlockScaling.fp8_format must be 'e4m3', got "
                      f"{checks.describe(self.fp8_format)}")
    if self.fp8_format != "e4m3":
      raise ValueError(f"MXFP8BlockScaling.fp8_format must be 'e4m3' (E5M2 gradients diverged in "
                       f"public MXFP8 runs; HYBRID is not offered), got {self.fp8_format!r}")
    check_fp8_min_intensity(self)


@dataclasses.dataclass(frozen=True)
class NVFP4BlockScaling(Recipe):
  """NVFP4 recipe as NVIDIA's NVFP4 pretraining report publishes it (arXiv 2509.25149, section
  4; TransformerEngine's ``NVFP4BlockScaling``): E2M1 elements, one E4M3 scale per block and
  one f32 global scale per tensor (``nvfp4_quantize``). x and the output gradient in 1 x 16
  blocks along each GEMM's contraction dimension, the kernel in 16 x 16 blocks (both of its
  directions then hold the same numbers), rounded to nearest; the gradient stochastically
  rounded in both of its copies; the two wgrad operands (x and the gradient along the tokens M)
  through the same random Hadamard transform of each 16 rows, which cancels in their product.
  The global amaxes are per tensor: under ``pmap`` / ``shard_map`` they are max-reduced over
  ``amax_axis_name`` as ``CurrentScaling``'s amaxes are. Stateless, but with stochastic
  rounding a linear takes a fresh PRNG key each step (its ``key``; a Flax layer's
  "stochastic_rounding" rng stream). On Hopper, which has no FP4 tensor cores, the GEMMs are
  emulated (``nvfp4_gemm``): the numerics are a Blackwell NVFP4 GEMM's, the speed BF16's plus
  the quantization passes. The report keeps some layers (the last blocks, the embeddings and
  the LM head) in higher precision: leave those layers out (``convert``'s ``exclude``, or
  plain layers).

  Attributes:
    weight_block_2d: 16 x 16 kernel blocks (True, the report's) or 1 x 16 along each GEMM's
      contraction; a bool.
    stochastic_rounding: round the gradient's copies stochastically (True, the report's) or to
      nearest; a bool.
    rht: the random Hadamard transform of the wgrad operands (True, the report's); a bool.
    rht_seed: the transform's sign seed (``hadamard.rht_signs``), an int in [0, 2^64); 0
      without the transform.
    fp8_min_intensity: below it a linear runs in its input's dtype (see
      ``check_fp8_min_intensity``); 0 (default): always NVFP4.
  Raises:
    TypeError / ValueError when built with a field out of range.
  """

  family = "nvfp4"
  gemm_format = "NVFP4"
  amax_scope = "tensor"
  dim_multiple = NVFP4_BLOCK
  dim_reason = ("whole NVFP4 blocks of x and the kernel along K, of the gradient and the "
                "kernel along N")

  weight_block_2d: bool = True
  stochastic_rounding: bool = True
  rht: bool = True
  rht_seed: int = 0
  fp8_min_intensity: float = 0.0

  def __post_init__(self):
    python_values(self)
    for name in ("weight_block_2d", "stochastic_rounding", "rht"):
      checks.boolean(getattr(self, name), f"NVFP4BlockScaling.{name}")
    rht_signs(self.rht_seed, "NVFP4BlockScaling.rht_seed")  # checks the seed
    if self.rht_seed and not self.rht:
      raise ValueError(f"NVFP4BlockScaling.rht_seed is the Hadamard transform's seed: it needs "
                       f"rht=True, got rht_seed={self.rht_seed!r} with rht=False")
    check_fp8_min_intensity(self)

  @property
  def dim_rule(self) -> str:
    """The K / N rule in words, naming the recipe (for errors and convert's report)."""
    return (f"{type(self).__name__} needs K and N multiples of {self.dim_multiple} "
            f"({self.dim_reason})")

  @property
  def draws_key(self) -> bool:
    """Whether a linear takes a PRNG key: for the gradients' stochastic rounding."""
    return self.stochastic_rounding


RECIPES = (DelayedScaling, CurrentScaling, BlockScaling, MXFP8BlockScaling, NVFP4BlockScaling)


def check_recipe(recipe, name: str = "recipe", casts_kernel: bool = False,
                 none_ok: bool = False) -> None:
  """TypeError naming ``name`` unless ``recipe`` is a recipe instance (``casts_kernel``: one
  that serves ``cast_kernel`` and ``Fp8Weight``), or None where ``none_ok``; a recipe class given
  for an instance is told so."""
  allowed = tuple(c for c in RECIPES if c.casts_kernel or not casts_kernel)
  if isinstance(recipe, allowed) or (none_ok and recipe is None):
    return
  kinds = ["None"] * none_ok + [c.article() for c in allowed]
  kinds = kinds[0] if len(kinds) == 1 else ", ".join(kinds[:-1]) + " or " + kinds[-1]
  got = (f"the class {recipe.__name__}: pass an instance, e.g. {recipe.__name__}()"
         if isinstance(recipe, type) else type(recipe).__name__)
  raise TypeError(f"{name} must be {kinds}, got {got}")
