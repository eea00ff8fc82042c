"""The text data: the Python standard library's own ``.py`` sources, as bytes (vocab 256).

Nothing is downloaded: the files are found under ``sysconfig.get_paths()["stdlib"]``, read in
sorted order and concatenated, so the corpus is the same on every run on one Python install.
"""

from __future__ import annotations

import dataclasses
import operator
import os
import sysconfig

import numpy as np

VOCAB = 256  # one token per byte value
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}  # installed packages vary by machine


@dataclasses.dataclass(frozen=True)
class Corpus:
  """The corpus split into a training part and a held-out tail.

  Attributes:
    train: uint8 [N_train], the first ``1 - val_fraction`` of the bytes.
    val: uint8 [N_val], the last ``val_fraction`` of the bytes.
    files: how many source files were read.
  """

  train: np.ndarray
  val: np.ndarray
  files: int


def stdlib_sources() -> list[str]:
  """Paths of the standard library's ``.py`` files, sorted (installed packages left out)."""
  root = sysconfig.get_paths()["stdlib"]
  paths = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
    paths += [os.path.join(dirpath, f) for f in filenames if f.endswith(".py")]
  if not paths:
    raise FileNotFoundError(f"no .py files under the standard library at {root}")
  return sorted(paths, key=lambda p: os.path.relpath(p, root))


def load_corpus(val_fraction: float = 0.05) -> Corpus:
  """Read the standard library's sources and hold out the last ``val_fraction`` for validation."""
  paths = stdlib_sources()
  chunks = []
  for p in paths:
    with open(p, "rb") as f:
      chunks.append(f.read())
  data = np.frombuffer(b"".join(chunks), dtype=np.uint8)
  split = int(len(data) * (1 - val_fraction))
  return Corpus(train=data[:split], val=data[split:], files=len(paths))


@dataclasses.dataclass(frozen=True)
class TrainBatches:
  """The training batches, each cut from the bytes when indexed (a run of any length holds
  only the window offsets): ``batches[i]`` is uint8 [batch, seq_len + 1], inputs ``[:, :-1]``
  and targets ``[:, 1:]``; ``len(batches)`` is the number of steps.

  Attributes:
    data: uint8 [N], the training bytes.
    starts: int64 [steps, batch], each window's first byte.
    seq_len: tokens per window.
  """

  data: np.ndarray
  starts: np.ndarray
  seq_len: int

  def __len__(self) -> int:
    return len(self.starts)

  def __getitem__(self, step: int) -> np.ndarray:
    """Batch ``step`` (an int); TypeError for a slice or another index."""
    starts = self.starts[operator.index(step)]
    return self.data[starts[:, None] + np.arange(self.seq_len + 1)]


def train_batches(data: np.ndarray, steps: int, batch: int, seq_len: int,
                  seed: int) -> TrainBatches:
  """Random windows of ``seq_len + 1`` bytes, the same for a given seed.

  Args:
    data: uint8 [N], the training bytes.
    steps, batch, seq_len: how many batches, windows per batch, tokens per window.
    seed: numpy seed for the window offsets.
  Returns:
    ``TrainBatches``: ``steps`` batches of uint8 [batch, seq_len + 1].
  """
  if len(data) <= seq_len + 1:
    raise ValueError(f"training data ({len(data)} bytes) shorter than one window")
  starts = np.random.default_rng(seed).integers(0, len(data) - seq_len - 1, (steps, batch))
  return TrainBatches(data, starts, seq_len)


def val_batches(data: np.ndarray, max_batches: int, batch: int, seq_len: int) -> np.ndarray:
  """Consecutive non-overlapping windows from the start of the validation bytes.

  Returns:
    uint8 [n, batch, seq_len + 1] with ``1 <= n <= max_batches`` (as many as the data holds).
  """
  windows = (len(data) - 1) // seq_len
  n = min(max_batches, windows // batch)
  if n < 1:
    raise ValueError(f"validation data ({len(data)} bytes) too short for one batch of "
                     f"{batch} x {seq_len + 1}")
  starts = np.arange(n * batch).reshape(n, batch) * seq_len
  return data[starts[..., None] + np.arange(seq_len + 1)]
