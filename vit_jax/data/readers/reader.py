"""What a reader is: one data format as the pipeline sees it.

A reader says which `config.dataset` spellings are its format (`claims`), which
splits and augmentation suit its data when the config leaves them at None
(`defaults`), and opens a split as a `sources.Source` (`open_split`).
"""

import dataclasses
import os
from typing import Callable, Optional

from vit_jax.core import files
from vit_jax.data import sources


@dataclasses.dataclass(frozen=True)
class Options:
  """The config fields a reader may need besides the dataset and the split."""

  tfds_data_dir: Optional[str] = None
  tfds_manual_dir: Optional[str] = None
  corrupt_images: str = 'skip'  # image folders: 'skip' or 'fail'
  allow_missing_classes: bool = False  # image folders: a class folder only some splits have


@dataclasses.dataclass(frozen=True)
class Defaults:
  """What a dataset brings when the config leaves a field at None."""

  train: str = 'train'
  test: str = 'test'
  flip: bool = True
  inception_crop: bool = True
  area_min: float = 0.05
  why: str = "the paper's, B.1.1"  # where the choice comes from, for people


@dataclasses.dataclass(frozen=True)
class Reader:
  """One data format: `vit_jax.data.readers.reader_for` asks `claims` of each in turn."""

  name: str  # the format, as messages and `vit_jax.benchmark_input` name it
  # dataset -> whether it is this format's. A reader may refuse here, with a
  # DataError, a dataset that is its format's but cannot be read (a missing folder).
  claims: Callable[[str], bool]
  defaults: Callable[[str, Options], Defaults]  # (dataset, options)
  open_split: Callable[[str, str, Options], sources.Source]  # (dataset, split, options)


# Images whose shorter side is below this many pixels are "small" (digits,
# characters, icons, CIFAR-sized crops): an inception crop down to 5% of their
# area keeps a few pixels, blown up to the model's resolution.
SMALL_IMAGE_SIDE = 64


def for_image_side(side: Optional[int]) -> Defaults:
  """The paper's defaults, or for small images (`side`, the shorter, in px) crops that keep
  at least half of each image; None: the size is not known."""
  if side is None or side >= SMALL_IMAGE_SIDE:
    return Defaults()
  # Flips stay (they help photos, and only the data's meaning says whether a
  # mirror image is the same class: set pp.flip=False for digits and text).
  # Measured in docs/data.md on the digits written out as an image folder and
  # on tiles of scikit-learn's photos.
  return Defaults(area_min=0.5, why=f'small images: shorter side {side} px < {SMALL_IMAGE_SIDE}')


def names_a_path(dataset: str) -> bool:
  """Whether `dataset` is a path rather than a name: an existing folder, or spelled as a path
  (/, ., ~, gs://)."""
  return (
    os.path.isdir(os.path.expanduser(dataset))
    or dataset.startswith(('/', '.', '~'))
    or files.is_remote(dataset)
  )


def sliced(source: sources.Source, start, stop) -> sources.Source:
  """`source` sliced as `sources.parse_split` read the split's [start:stop]."""
  lo, hi = sources.slice_bounds(start, stop, source.num_examples)
  return sources.sliced(source, lo, hi, f'[{start or ""}:{stop or ""}]')
