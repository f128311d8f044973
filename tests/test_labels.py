"""Class ids as every reader hands them over: checked in their own dtype, then made int32.

A cast before the check renumbers a label (3,000,000,000 as int32 is -1,294,967,296; 2**40 is
0): the run would train on it as another class and end `Done`. Each reader refuses it in one
line instead, and a run refused so leaves no workdir behind.
"""

import os

from conftest import tiny_run_config
import numpy as np
import pytest

from vit_jax.data import datasets
from vit_jax.data import example_proto
from vit_jax.data import sources
from vit_jax.data.readers import arrays
from vit_jax.data.readers import shards
from vit_jax.data.readers import tfds
from vit_jax.data.sources import DataError


def _npz(path, y_train, **extra):
  x = np.zeros((len(y_train), 8, 8, 3), np.uint8)
  np.savez(path, x_train=x, y_train=np.asarray(y_train), x_test=x[:2], y_test=[0, 1], **extra)
  return str(path)


@pytest.mark.parametrize(
  'label, dtype',
  [(3_000_000_000, np.int64), (2**40, np.int64), (2**63 + 5, np.uint64), (2**32 + 1, np.uint64)],
  ids=['3e9', '2^40', '2^63+5 uint64', '2^32+1 uint64'],
)
def test_an_npz_label_past_int32_is_refused_not_renumbered(tmp_path, label, dtype):
  path = _npz(tmp_path / 'data.npz', np.array([0, 1, label], dtype))
  with pytest.raises(DataError) as e:
    arrays.load(path)
  assert str(e.value).startswith(
    f'{path}: y_train holds a label {label}, which would make {label + 1:,} classes'
  )


def test_a_label_of_2_to_the_31_does_not_pass_a_list_of_class_names(tmp_path):
  path = _npz(tmp_path / 'data.npz', np.array([0, 1, 2**31]), class_names=['a', 'b', 'c'])
  with pytest.raises(DataError) as e:
    arrays.load(path)
  assert str(e.value) == f'{path}: a label 2147483648 but 3 class_names; give a name per class'


def test_arrays_in_python_are_checked_before_the_cast():
  x = np.zeros((3, 8, 8, 3), np.uint8)
  with pytest.raises(DataError, match='^labels_past_int32: y_train holds a label 4294967296,'):
    datasets.register_arrays('labels_past_int32', x_train=x, y_train=np.array([0, 1, 2**32]))
  # In range, any integer dtype: int32 ids as the pipeline takes them.
  data = arrays.from_arrays('fine', {'x_train': x, 'y_train': np.array([0, 2, 1], np.uint64)})
  labels = data['splits']['train'][1]
  assert labels.dtype == np.int32 and labels.tolist() == [0, 2, 1] and data['num_classes'] == 3


def test_sources_check_class_ids_in_their_own_dtype():
  assert sources.class_ids('y', np.array([0, 9], np.uint64), 10).dtype == np.int32
  for bad in (np.array([0, 2**32 + 3]), np.array([10]), np.array([-1])):
    with pytest.raises(
      DataError, match=r'^y: a label -?[\d,]+ outside the 10 classes \(ids 0..9\)'
    ):
      sources.class_ids('y', bad, 10)


def test_a_tfds_record_label_outside_the_classes_is_one_line_naming_it():
  parse = tfds._parser(None, 'label', False, 3)
  image, label = parse(example_proto.serialize({'image': b'jpeg', 'label': [2]}))
  assert image == b'jpeg' and label == 2 and label.dtype == np.int32
  for bad in (3, 2**32 + 1):
    with pytest.raises(DataError, match=f'^label: a label {bad:,} outside the 3 classes'):
      parse(example_proto.serialize({'image': b'jpeg', 'label': [bad]}))


def test_a_shard_label_outside_info_json_classes_is_refused_not_dropped():
  """A multi-hot record with a label past `num_classes` lost that label without a word."""
  record = example_proto.serialize(
    {'image/encoded': b'jpeg', 'image/labels': [1, 7], 'image/id': b'a.jpg'}
  )
  assert shards.parse_example(record, 8)[1].tolist() == [0, 1, 0, 0, 0, 0, 0, 1]
  with pytest.raises(
    DataError, match='^image/labels: a label 7 outside the 5 classes of info.json'
  ):
    shards.parse_example(record, 5)


def test_a_run_refused_for_its_labels_leaves_no_workdir(tmp_path):
  """The check happens once the run has taken its workdir's lock and written its config: a
  refused run removes what it made, up to the first folder that did not exist."""
  from vit_jax.training import loop

  path = _npz(tmp_path / 'data.npz', np.array([0, 1, 2**31]), class_names=['a', 'b', 'c'])
  os.makedirs(tmp_path / 'runs')
  (tmp_path / 'runs' / 'notes.txt').write_text('mine')
  workdir = tmp_path / 'runs' / 'new' / 'run'
  with pytest.raises(DataError, match='a label 2147483648 but 3 class_names'):
    loop.train_and_evaluate(tiny_run_config(dataset=path), str(workdir))
  assert sorted(os.listdir(tmp_path / 'runs')) == ['notes.txt']


# ---------------------------------------------------------------------------
# A label that would make a huge head.


def test_an_npz_label_past_a_million_classes_is_one_line_at_once(tmp_path):
  """One label of 2,000,000,000 in an .npz without class_names is one line at once, before any
  class name is built: the check allocates next to nothing (2e9 names would take GBs)."""
  import tracemalloc

  from vit_jax.data.readers import arrays

  x = np.zeros((4, 8, 8, 3), np.uint8)
  path = tmp_path / 'data.npz'
  np.savez(path, x_train=x, y_train=np.array([0, 1, 2, 2_000_000_000]), x_test=x, y_test=[0] * 4)
  tracemalloc.start()
  try:
    with pytest.raises(DataError) as e:
      arrays.load(str(path))
    _, peak = tracemalloc.get_traced_memory()
  finally:
    tracemalloc.stop()
  assert peak < 50 * 2**20
  assert str(e.value) == (
    f'{path}: y_train holds a label 2000000000, which would make 2,000,000,001 classes; labels '
    'are class ids 0..K-1: renumber them (np.unique(y, return_inverse=True)[1]) or give '
    'class_names'
  )
