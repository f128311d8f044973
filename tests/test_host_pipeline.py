"""The input pipeline's batches: order, threads, resume, shards, errors, no TensorFlow.

Order: the NumPy index shuffle is TensorFlow's RandomIndexShuffle bit for bit
(the order runs trained in when a tf.data backend existed, so they resume on
the same examples). Training: crops and flips from per-position random
numbers, so batches do not depend on threads or resumption. And all of it
runs where `import tensorflow` fails. (One image's pixels: test_preprocess.py.)
"""

import json
import os
import subprocess
import sys

from conftest import ROOT
from conftest import subprocess_env
from conftest import write_photo_folder
import numpy as np
import pytest

from vit_jax.bench import input_speed
from vit_jax.configs.data import add_data_config
from vit_jax.configs.data import data_config
from vit_jax.data import images
from vit_jax.data import order
from vit_jax.data import pipeline
from vit_jax.data import records
from vit_jax.data.readers import shards
from vit_jax.data.sources import DataError


@pytest.fixture(scope='module')
def photos(tmp_path_factory):
  """An image folder of crops of scikit-learn's photos: JPEGs of several sizes, PNG, grey."""
  return write_photo_folder(str(tmp_path_factory.mktemp('photos')), 24, classes=3)


def _config(dataset, **overrides):
  config = add_data_config(data_config())
  config.dataset, config.batch, config.batch_eval = dataset, 8, 8
  config.pp.crop = 64
  config.update_from_flattened_dict(overrides)
  return config


def _tf_index_shuffle(index, key, max_index):
  tf = pytest.importorskip('tensorflow')
  n = len(index)
  return tf.raw_ops.RandomIndexShuffle(
    index=tf.constant(index, tf.int64),
    seed=tf.constant(np.tile(np.array(key, np.int64), (n, 1))),
    max_index=tf.fill([n], tf.constant(max_index, tf.int64)),
    rounds=4,
  ).numpy()


@pytest.mark.parametrize('n', [1, 7, 300, 1438, 65_536, 65_538, 1_281_167, 14_197_122])
def test_index_shuffle_is_tensorflows(n):
  rng = np.random.default_rng(n)
  index = np.unique(np.concatenate([[0, n - 1], rng.integers(0, n, 500)]))
  for key in [(5, 0, 0), (order.keys(3)[0] & 0xFFFFFFFF, 17, 0)]:
    ours = order.index_shuffle(index, key, n - 1)
    np.testing.assert_array_equal(ours, _tf_index_shuffle(index, key, n - 1))


@pytest.mark.parametrize('n', [17, 65_537, 1_048_577])
def test_every_epoch_is_a_permutation_also_where_tensorflows_is_not(n):
  key = (9, 2, 0)
  ours = order.index_shuffle(np.arange(n), key, n - 1)
  np.testing.assert_array_equal(np.sort(ours), np.arange(n))
  if n > 2**16:  # TensorFlow's block is one bit short for 2^k + 1 examples:
    theirs = _tf_index_shuffle([0, n - 1], key, n - 1)
    assert theirs[0] == theirs[1]  # two examples land on one position


def test_an_eval_pass_is_every_image_once_as_one_image_is_evaluated(photos):
  config = _config(photos, **{'pp.resize': 80, 'pp.test': 'train'})
  batches = list(pipeline.make_eval_iterator(config, None, raw=True))
  assert len(batches) == 4  # 26 images, batches of 8
  mask = np.concatenate([b['mask'] for b in batches])
  assert mask.tolist() == [1.0] * 26 + [0.0] * 6
  source = pipeline.split_source(config, 'test')
  paths, labels = source.fetch(np.arange(26))
  want = np.stack([images.eval_image(open(p, 'rb').read(), 64, 80) for p in paths])
  np.testing.assert_array_equal(np.concatenate([b['image'] for b in batches])[:26], want)
  np.testing.assert_array_equal(np.concatenate([b['label'] for b in batches])[:26], labels)


def test_unreadable_and_undecodable_files_are_one_line_errors(tmp_path):
  root = tmp_path / 'folder'
  input_speed.write_photos(str(root), 8, classes=2)
  config = _config(str(root), **{'pp.test': 'train', 'eval_cache_mb': 0})
  pipeline.get_info(config)  # opened and checked: every file decodes
  victim = root / 'train' / 'class0' / '0.jpg'
  victim.write_bytes(victim.read_bytes()[:600])  # truncated after the check
  with pytest.raises(DataError, match=r'0\.jpg: cannot decode the image \(') as e:
    list(pipeline.make_eval_iterator(config, None))
  assert '\n' not in str(e.value) and 'BytesIO' not in str(e.value)
  victim.unlink()
  with pytest.raises(DataError, match=r'0\.jpg: cannot read the file'):
    next(pipeline.make_train_iterator(config, None))


def test_a_foreign_shard_record_is_a_one_line_error(photos, tmp_path):
  examples, names = shards.examples_from_folder(os.path.join(photos, 'train'))
  out = str(tmp_path / 'shards')
  shards.write_shards(examples[:4], out, 'train', num_classes=3, class_names=names)
  path = os.path.join(
    out, json.load(open(os.path.join(out, 'info.json')))['splits']['train'][0]['file']
  )
  writer = records.TFRecordWriter(path)  # the same number of records, not Examples
  for _ in range(4):
    writer.write(b'\x0a\x03abc')
  writer.close()
  source = shards.open_split(out, 'train')
  with pytest.raises(DataError, match='not a record of this format'):
    source.fetch(np.arange(2))


def test_mixup_of_multi_label_shards_mixes_label_sets(photos, tmp_path):
  examples, names = shards.examples_from_folder(os.path.join(photos, 'train'))
  examples = [(path, labels + [(labels[0] + 1) % 3]) for path, labels in examples]  # 2 labels each
  out = str(tmp_path / 'multi')
  shards.write_shards(examples, out, 'train', num_classes=3, class_names=names)
  plain = next(pipeline.make_train_iterator(_config(out), None))['label']
  mixed = next(pipeline.make_train_iterator(_config(out, **{'pp.mixup': 0.4}), None))['label']
  assert plain.shape == mixed.shape == (8, 3) and set(np.unique(plain)) == {0.0, 1.0}
  partner = plain.reshape(4, 2, 3)[:, ::-1].reshape(8, 3)
  r = np.flatnonzero((plain != partner).any(axis=1))[0]  # a pair with different labels
  p = mixed[r, np.argmax(plain[r] - partner[r])]  # a label only row r has: weight p
  np.testing.assert_allclose(mixed, p * plain + (1 - p) * partner, rtol=1e-6)
  assert 0.5 <= p < 1


def test_example_uniforms_are_uniform_and_independent():
  u = order.example_uniforms(5, np.arange(20_000), 4)
  assert abs(u.mean() - 0.5) < 0.01 and abs(u.std() - 12**-0.5) < 0.01
  assert abs(np.corrcoef(u[:, 0], u[:, 1])[0, 1]) < 0.03
  assert abs(np.corrcoef(u[:-1, 0], u[1:, 0])[0, 1]) < 0.03
  assert not np.array_equal(u, order.example_uniforms(6, np.arange(20_000), 4))


def test_batches_do_not_depend_on_threads_and_resume_exactly(photos):
  overrides = {'pp.randaug_layers': 2, 'pp.mixup': 0.2, 'batch': 24}  # 3 jobs of 8 images
  config = _config(photos, input_threads=1, **overrides)
  it = pipeline.make_train_iterator(config, None)
  first = [next(it) for _ in range(3)]  # past the epoch boundary (26 / 24)
  config = _config(photos, input_threads=3, **overrides)
  again = pipeline.make_train_iterator(config, None, state={'step': 1})
  for a, b in zip(first[1:], [next(again) for _ in range(2)]):
    np.testing.assert_array_equal(a['image'], b['image'])
    np.testing.assert_array_equal(a['label'], b['label'])
  # The examples are the ones the shared order names.
  config = _config(photos, input_threads=2)
  labels = np.concatenate([next(pipeline.make_train_iterator(config, None))['label']])
  source = pipeline.split_source(config, 'train')
  _, idx = order.train_indices(
    0, global_batch=8, local_batch=8, offset=0, num_examples=26, order_key=order.keys(0)[0]
  )
  np.testing.assert_array_equal(labels, source.fetch(idx)[1])


def test_shards_parse_as_tensorflow_parses_them(photos, tmp_path):
  tf = pytest.importorskip('tensorflow')
  examples, names = shards.examples_from_folder(os.path.join(photos, 'train'))
  out = str(tmp_path / 'shards')
  shards.write_shards(examples, out, 'train', num_classes=3, class_names=names, num_shards=2)
  info = json.load(open(os.path.join(out, 'info.json')))
  files = [os.path.join(out, f['file']) for f in info['splits']['train']]
  theirs = [r.numpy() for r in tf.data.TFRecordDataset(files)]  # TensorFlow reads our files
  source = shards.open_split(out, 'train')
  items, labels = source.fetch(np.arange(source.num_examples))
  assert len(theirs) == len(items) == 26
  for item, label, record in zip(items, labels, theirs):
    example = tf.train.Example.FromString(record).features.feature
    assert item == example['image/encoded'].bytes_list.value[0]
    np.testing.assert_array_equal(np.flatnonzero(label), example['image/labels'].int64_list.value)
    assert example['image/id'].bytes_list.value[0].decode().startswith(photos)


_NO_TF = r"""
import json, sys
sys.modules['tensorflow'] = None  # as if not installed: `import tensorflow` fails
sys.modules['tensorflow_datasets'] = None
import numpy as np
from vit_jax.configs.data import add_data_config, data_config
from vit_jax.data import pipeline
from vit_jax.data.readers import shards
from vit_jax.training import loop  # noqa: F401  (the trainer imports)
folder, out = sys.argv[1], sys.argv[2]
examples, names = shards.examples_from_folder(folder + '/train')
shards.write_shards(examples, out, 'train', num_classes=3, class_names=names, num_shards=2,
                    file_format='array_record')
sums = {}
for dataset in (folder, out, 'digits'):
  config = add_data_config(data_config())
  config.dataset, config.batch, config.batch_eval, config.pp.crop = dataset, 8, 8, 32
  config.pp.randaug_layers, config.pp.mixup, config.pp.test = 2, 0.2, 'train'
  batch = next(pipeline.make_train_iterator(config, None))
  evals = list(pipeline.make_eval_iterator(config, None))
  sums[dataset] = [float(batch['image'].sum()), len(evals)]
print('RESULT' + json.dumps(sums))
"""


def _python(*args):
  """`python ARGS` in this checkout on one CPU device; a non-zero exit fails the test."""
  proc = subprocess.run(
    [sys.executable, *args], capture_output=True, text=True, cwd=ROOT, env=subprocess_env(),
    timeout=300,
  )  # fmt: skip
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc


@pytest.mark.slow
def test_folders_shards_and_digits_need_no_tensorflow(photos, tmp_path):
  out = str(tmp_path / 'array_record')
  proc = _python('-c', _NO_TF, photos, out)
  result = json.loads(proc.stdout.split('RESULT', 1)[1])
  # The same batches as in this process, where TensorFlow is importable.
  for dataset, (image_sum, eval_batches) in result.items():
    config = add_data_config(data_config())
    config.dataset, config.batch, config.batch_eval, config.pp.crop = dataset, 8, 8, 32
    config.pp.randaug_layers, config.pp.mixup, config.pp.test = 2, 0.2, 'train'
    batch = next(pipeline.make_train_iterator(config, None))
    assert float(batch['image'].sum()) == image_sum, dataset
  assert result[photos][1] == 4 and result['digits'][1] == 180  # 1438 / 8


@pytest.mark.slow
def test_benchmark_input_reports_rates_the_ceiling_and_stages(tmp_path):
  record = tmp_path / 'input.json'
  _python(
    '-m', 'vit_jax.benchmark_input', '--images=24', '--batch=8', '--steps=1', '--rounds=1',
    '--threads=1,2', '--processes=2', f'--dir={tmp_path}', f'--json={record}',
  )  # fmt: skip
  out = json.loads(record.read_text())
  assert out['files'] == 24 and 60 < out['mean_file_kB'] < 120  # ImageNet-like JPEGs
  assert out['machine']['logical_cpus'] >= out['machine']['physical_cores'] >= 1
  for n in ('1', '2'):
    t = out['threads'][n]
    assert abs(t['img_per_sec_per_core'] - t['img_per_sec'] / int(n)) <= 1  # each rounded
    ratio = t['img_per_sec'] / int(n) / out['decode_only_img_per_sec']
    assert t['ratio_per_core_to_decode_only'] == pytest.approx(ratio, rel=0.01)
    for name in ('photos', 'digits'):  # in memory, against the folder at the same threads
      m = out['in_memory'][name][n]
      assert m['ratio_to_jpeg_folder'] == pytest.approx(m['img_per_sec'] / t['img_per_sec'], 0.01)
  assert out['img_per_sec_per_core'] == out['threads']['2']['img_per_sec_per_core']
  ratio = out['threads']['2']['img_per_sec_per_core'] / out['decode_in_parallel']['2']
  assert out['threads']['2']['ratio_per_core_to_parallel_decode'] == pytest.approx(ratio, 0.01)
  grid = out['processes']['2x1']
  assert len(grid['per_process']) == 2 and abs(grid['img_per_sec'] - sum(grid['per_process'])) <= 2
  assert set(out['stage_ms_per_image']) == {
    'read', 'header_and_crop', 'entropy_decode', 'idct_and_colour', 'resize', 'flip'
  }  # fmt: skip
  for key in ('randaugment_mixup_img_per_sec', 'eval_img_per_sec', 'tfrecord_shards_img_per_sec'):
    assert out[key] > 0, key
  # An in-memory dataset by itself: threads only.
  arrays = tmp_path / 'digits.npz'
  np.savez(arrays, x_train=np.zeros((16, 8, 8), np.uint8), y_train=np.arange(16) % 2)
  _python(
    '-m', 'vit_jax.benchmark_input', f'--dataset={arrays}', '--batch=8', '--steps=1',
    '--rounds=1', '--threads=1,2', f'--json={record}',
  )  # fmt: skip
  out = json.loads(record.read_text())
  assert out['examples'] == 16 and set(out['threads']) == {'1', '2'}


def test_a_state_from_the_tf_data_backend_resumes_on_the_same_examples(photos):
  """Runs that tf.data fed (TFDS datasets, before TensorFlow left the package) kept the
  order of `order.train_indices`: they resume on the same examples."""
  state = {'step': 3, 'seed': 0, 'batch': 8, 'dataset': photos, 'input_backend': 'tf'}
  resumed = next(pipeline.make_train_iterator(_config(photos), None, state=state))
  fresh = pipeline.make_train_iterator(_config(photos), None)
  for _ in range(3):
    next(fresh)
  np.testing.assert_array_equal(resumed['label'], next(fresh)['label'])


# ---------------------------------------------------------------------------
# A batch the host cannot hold.


def test_host_memory_running_out_for_a_batch_is_one_line():
  """A batch the host cannot hold (10^9 images of 4096 px: numpy refuses at once, so the test
  needs no memory), as the input pipeline allocates each batch, is one line."""
  from vit_jax.data import host

  with pytest.raises(DataError, match='^out of host memory for a batch of 1000000000 ') as e:
    host.batch_buffer((10**9, 4096, 4096, 3), np.float32)
  assert '\n' not in str(e.value)
