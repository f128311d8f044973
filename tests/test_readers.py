"""The readers' factory: which reader reads each `config.dataset` spelling, and a new reader
as one module and one entry."""

import json
import os

import numpy as np
import pytest

from vit_jax.data import datasets
from vit_jax.data import readers
from vit_jax.data import sources
from vit_jax.data.readers import reader
from vit_jax.data.readers import shards
from vit_jax.data.sources import DataError


@pytest.fixture
def here(tmp_path, monkeypatch):
  """tmp_path as the working directory, holding one dataset of each kind on disk."""
  monkeypatch.chdir(tmp_path)
  for split in ('train', 'test'):
    for name in ('a', 'b'):
      os.makedirs(tmp_path / 'photos' / split / name)
  os.makedirs(tmp_path / 'npy')
  np.save(tmp_path / 'npy' / 'x_train.npy', np.zeros((2, 4, 4, 3), np.uint8))
  for kind in ('shards', 'npy'):  # an info.json beside x_*.npy: arrays come first
    os.makedirs(tmp_path / kind, exist_ok=True)
    with open(tmp_path / kind / 'info.json', 'w') as f:
      json.dump({'format': shards.FORMAT}, f)
  return tmp_path


# Each spelling the tests use, and the reader that `datasets.kind()` chose for it before the
# readers: builtin, then arrays, then paths (shards, else a folder), then `imagenet21k`, then TFDS.
SPELLINGS = [
  ('digits', 'builtin'),
  ('data.npz', 'arrays'),  # a .npz path, there or not: arrays say it is missing
  ('npy', 'arrays'),
  ('{here}/npy', 'arrays'),
  ('shards', 'shards'),
  ('./shards', 'shards'),
  ('{here}/shards', 'shards'),
  ('imagenet21k', 'shards'),
  ('photos', 'folder'),
  ('{here}/photos', 'folder'),
  ('cifar10', 'tfds'),
  ('cifar11', 'tfds'),
  ('vtab/dtd', 'tfds'),
  ('tiny', 'tfds'),
]


@pytest.mark.parametrize('spelling, name', SPELLINGS)
def test_the_factory_picks_the_reader_the_old_dispatch_picked(here, spelling, name):
  assert readers.reader_for(spelling.format(here=here)).name == name


def test_registered_arrays_are_read_by_the_arrays_reader():
  name = datasets.register_arrays(
    'readers_test_arrays', x_train=np.zeros((2, 4, 4), np.uint8), y_train=np.array([0, 1])
  )
  assert readers.reader_for(name).name == 'arrays'


def test_a_local_folder_wins_over_a_name(here):
  """A folder named as a dataset here is that folder (paths come before names), with a folder's
  defaults: its own splits, not the preset's train[:98%]."""
  for name in ('imagenet21k', 'cifar10'):
    os.makedirs(here / name / 'train' / 'a')
    assert readers.reader_for(name).name == 'folder'
  assert readers.reader_for('cifar10').defaults('cifar10', reader.Options()) == reader.Defaults()


def test_paths_that_are_no_folder_are_refused_when_picked(here, monkeypatch):
  with pytest.raises(sources.DataError, match=r'^\./nope: no such folder; pass an existing'):
    readers.reader_for('./nope')
  with pytest.raises(sources.DataError, match=r'^~/no_such_dataset_here: no such folder'):
    readers.reader_for('~/no_such_dataset_here')
  monkeypatch.setattr(shards, 'is_shard_dir', lambda path: False)  # no network: no info.json
  with pytest.raises(sources.DataError, match='datasets in object stores are shard directories'):
    readers.reader_for('gs://bucket/shards')


def test_a_new_reader_is_one_entry(monkeypatch):
  """A reader placed in READERS is asked first and reads its datasets through the same
  `datasets` calls the pipeline makes; the others keep theirs."""
  pixels = np.arange(5 * 2 * 2 * 3, dtype=np.uint8).reshape(5, 2, 2, 3)
  toy = reader.Reader(
    'toy',
    claims=lambda dataset: dataset.startswith('toy:'),
    defaults=lambda dataset, options: reader.Defaults(train='all', flip=False, why='toy'),
    open_split=lambda dataset, split, options: sources.array_source(
      f'{dataset} {split}', pixels, np.arange(5) % 2, 2
    ),
  )
  monkeypatch.setattr(readers, 'READERS', (toy, *readers.READERS))
  datasets.defaults.cache_clear()
  datasets.open_split.cache_clear()
  try:
    assert datasets.defaults('toy:x') == reader.Defaults(train='all', flip=False, why='toy')
    source = datasets.open_split('toy:x', 'all')
    assert (source.name, source.num_examples, source.num_classes) == ('toy:x all', 5, 2)
    np.testing.assert_array_equal(source.fetch(np.array([4, 1]))[0], pixels[[4, 1]])
    assert readers.reader_for('digits').name == 'builtin'
  finally:
    datasets.defaults.cache_clear()
    datasets.open_split.cache_clear()


# ---------------------------------------------------------------------------
# Arrays registered twice under one name.


def test_register_arrays_twice_under_a_name_takes_the_same_arrays_only(monkeypatch):
  """A second `register_arrays('mine', ...)` takes the same arrays (a notebook cell run again);
  other arrays are one line, unless replace=True."""
  from vit_jax.data import datasets
  from vit_jax.data.readers import arrays

  monkeypatch.setattr(arrays, '_REGISTERED', {})
  x, y = np.zeros((4, 8, 8, 3), np.uint8), np.array([0, 1, 0, 1])
  datasets.register_arrays('mine', x_train=x, y_train=y)
  datasets.register_arrays('mine', x_train=x.copy(), y_train=y)  # a notebook cell run again
  with pytest.raises(DataError) as e:
    datasets.register_arrays('mine', x_train=x + 1, y_train=y)
  assert str(e.value) == (
    "register_arrays: 'mine' holds other arrays already in this process; pick another name, "
    'or pass replace=True to read these under it from now on'
  )
  datasets.register_arrays('mine', replace=True, x_train=x + 1, y_train=y)
  assert arrays._data('mine')['splits']['train'][0]().max() == 1
