"""The built-in dataset `digits`: the UCI handwritten digits that scikit-learn ships.

1797 8x8 images of 10 classes in a fixed stratified split, 1438 train / 359
test, held in memory: data every install has, without a download.
"""

import numpy as np

from vit_jax.data import presets
from vit_jax.data import sources
from vit_jax.data.readers import reader
from vit_jax.data.sources import DataError

# Digits are 8x8: a crop keeping most of the digit, and no flip (it changes
# their meaning: 2 vs 5 mirrored).
_DEFAULTS = reader.Defaults(flip=False, area_min=0.5, why='built-in digits')


def load_digits():
  """(images uint8 [1797, 8, 8, 3], labels [1797]) from scikit-learn's copy of UCI digits."""
  from sklearn import datasets as sk_datasets

  digits = sk_datasets.load_digits()
  # Pixels are counts 0..16 of set bits in 4x4 blocks of the 32x32 scans.
  grey = np.round(digits.images * (255.0 / 16.0)).astype(np.uint8)
  return np.repeat(grey[..., None], 3, axis=-1), digits.target.astype(np.int32)


def digits_split_indices(test_fraction=0.2, seed=0):
  """Fixed stratified split: per class, a seeded 20% are test. (train, test) indices."""
  _, labels = load_digits()
  rng = np.random.default_rng(seed)
  train, test = [], []
  for c in range(10):
    members = rng.permutation(np.flatnonzero(labels == c))
    n_test = int(round(test_fraction * len(members)))
    test += members[:n_test].tolist()
    train += members[n_test:].tolist()
  return np.sort(train), np.sort(test)


def _open_split(dataset: str, split: str, options: reader.Options) -> sources.Source:
  name, start, stop = sources.parse_split(split)
  if name not in ('train', 'test'):
    raise DataError(f'digits: no split {name!r}; use train or test (e.g. train[:90%])')
  images, labels = load_digits()
  index = digits_split_indices()[0 if name == 'train' else 1]
  source = sources.array_source(
    f'digits {name}', images[index], labels[index], 10, [str(d) for d in range(10)]
  )
  return reader.sliced(source, start, stop)


READER = reader.Reader(
  'builtin',
  claims=lambda dataset: dataset in presets.BUILTIN,
  defaults=lambda dataset, options: _DEFAULTS,
  open_split=_open_split,
)
