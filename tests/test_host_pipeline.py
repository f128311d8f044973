"""The host pipeline (NumPy, libjpeg-turbo, OpenCV, PIL) against TensorFlow and itself.

Order: the NumPy index shuffle is TensorFlow's RandomIndexShuffle bit for bit.
Evaluation: the same pixels as the tf.data path (the official preprocessing).
Training: crops and flips from per-position random numbers, so batches do not
depend on threads or resumption; reduced-scale decoding stays close to a full
decode. And all of it runs where `import tensorflow` fails.
"""

import io
import json
import os
import subprocess
import sys

from conftest import ROOT
from conftest import subprocess_env
import numpy as np
from PIL import Image
import pytest
import tensorflow as tf

from vit_jax.bench import input_speed
from vit_jax.data import host
from vit_jax.data import order
from vit_jax.data import pipeline
from vit_jax.data import preprocess
from vit_jax.data import randaug
from vit_jax.data import randaug_host
from vit_jax.data import shards
from vit_jax.data import tf_data


@pytest.fixture(scope='module')
def photos(tmp_path_factory):
  """An image folder of crops of scikit-learn's photos: JPEGs of several sizes, PNG, grey."""
  root = str(tmp_path_factory.mktemp('photos'))
  input_speed.write_photos(root, 24, classes=3)
  from sklearn.datasets import load_sample_images

  flower = load_sample_images().images[1]
  Image.fromarray(flower[::4, ::4]).save(os.path.join(root, 'train', 'class0', 'png.png'))
  Image.fromarray(flower[::3, ::3, 1]).save(os.path.join(root, 'train', 'class1', 'grey.jpg'))
  return root


def _config(dataset, **overrides):
  config = pipeline.add_data_config(pipeline.data_config())
  config.dataset, config.batch, config.batch_eval = dataset, 8, 8
  config.pp.crop = 64
  config.update_from_flattened_dict(overrides)
  return config


def _tf_index_shuffle(index, key, max_index):
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


def test_both_pipelines_read_the_same_examples_at_each_step():
  kw = dict(global_batch=64, local_batch=32, offset=32, num_examples=1438, order_key=12345)
  for step in (0, 22, 10**5):
    positions, ours = order.train_indices(step, **kw)
    tf_positions, theirs = tf_data.train_indices(tf.constant(step, tf.int64), **kw)
    np.testing.assert_array_equal(positions, tf_positions.numpy())
    np.testing.assert_array_equal(ours, theirs.numpy())
    assert len(set(ours.tolist())) == 32


def test_eval_pixels_are_the_tf_data_pipelines(photos):
  files = input_speed.image_files(os.path.join(photos, 'train')) + [
    os.path.join(photos, 'train', 'class0', 'png.png')
  ]
  for path in files:
    data = open(path, 'rb').read()
    for crop, resize_to in ((64, None), (64, 80), (384, None)):
      ours = host.eval_image(data, crop, resize_to)
      theirs = preprocess.eval_image(preprocess.decode(data), crop, resize_to).numpy()
      np.testing.assert_array_equal(ours, theirs, err_msg=f'{path} {crop} {resize_to}')
  # And the whole eval pass, batches, masks and floats included.
  config = _config(photos, **{'pp.resize': 80, 'pp.test': 'train'})
  host_pass = list(pipeline.make_eval_iterator(config, None))
  config.input_backend = 'tf'
  tf_pass = list(pipeline.make_eval_iterator(config, None))
  assert len(host_pass) == len(tf_pass) == 4  # 26 images, batches of 8
  for a, b in zip(host_pass, tf_pass):
    for key in ('image', 'label', 'mask'):
      np.testing.assert_array_equal(a[key], b[key])


def _encoded(array, fmt, **kw):
  buf = io.BytesIO()
  Image.fromarray(array).save(buf, fmt, **kw)
  return buf.getvalue()


def test_other_formats_decode_as_tensorflow_decodes_them():
  rng = np.random.default_rng(0)
  rgb = rng.integers(0, 256, (30, 40, 3), np.uint8)
  ramp = (np.arange(30 * 40, dtype=np.uint32).reshape(30, 40) * 53).astype(np.uint16)
  cmyk = Image.fromarray(rgb).convert('CMYK')
  buf = io.BytesIO()
  cmyk.save(buf, 'JPEG', quality=95)
  cases = {
    'png': _encoded(rgb, 'PNG'),
    'png rgba': _encoded(np.dstack([rgb, rgb[..., :1]]), 'PNG'),
    'png 16-bit grey': _encoded(ramp, 'PNG'),
    'gif': _encoded(rgb, 'GIF'),
    'bmp': _encoded(rgb, 'BMP'),
    'jpeg grey': _encoded(rgb[..., 0], 'JPEG'),
    'jpeg cmyk': buf.getvalue(),
  }
  for name, data in cases.items():
    ours = host.decode(data).astype(int)
    theirs = preprocess.decode(data).numpy().astype(int)
    assert ours.shape == theirs.shape, name
    # CMYK JPEGs: PIL's conversion, not libjpeg's, within 1 (docs/data.md).
    assert np.abs(ours - theirs).max() <= (1 if name == 'jpeg cmyk' else 0), name


def test_unreadable_and_undecodable_files_are_one_line_errors(tmp_path):
  root = tmp_path / 'folder'
  input_speed.write_photos(str(root), 8, classes=2)
  config = _config(str(root), **{'pp.test': 'train', 'eval_cache_mb': 0})
  pipeline.get_info(config)  # opened and checked: every file decodes
  victim = root / 'train' / 'class0' / '0.jpg'
  victim.write_bytes(victim.read_bytes()[:600])  # truncated after the check
  with pytest.raises(pipeline.DataError, match=r'0\.jpg: cannot decode the image \(') as e:
    list(pipeline.make_eval_iterator(config, None))
  assert '\n' not in str(e.value) and 'BytesIO' not in str(e.value)
  victim.unlink()
  with pytest.raises(pipeline.DataError, match=r'0\.jpg: cannot read the file'):
    next(pipeline.make_train_iterator(config, None))


def test_a_foreign_shard_record_is_a_one_line_error(photos, tmp_path):
  examples, names = shards.examples_from_folder(os.path.join(photos, 'train'))
  out = str(tmp_path / 'shards')
  shards.write_shards(examples[:4], out, 'train', num_classes=3, class_names=names)
  path = os.path.join(
    out, json.load(open(os.path.join(out, 'info.json')))['splits']['train'][0]['file']
  )
  with tf.io.TFRecordWriter(path) as writer:  # the same number of records, not Examples
    for _ in range(4):
      writer.write(b'\x0a\x03abc')
  source = shards.open_split(out, 'train')
  with pytest.raises(pipeline.DataError, match='not a record of this format'):
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


def test_one_image_crop_window_is_the_batched_one_and_inside():
  u = order.example_uniforms(11, np.arange(3000), host.ATTEMPTS * 4)
  for height, width, area_min in ((375, 500, 0.05), (8, 8, 0.5), (1, 1, 0.05), (3, 900, 0.05)):
    one = np.array([host.crop_window_one(row, height, width, area_min) for row in u])
    batched = host.crop_window(
      u.reshape(-1, host.ATTEMPTS, 4), np.full(3000, height), np.full(3000, width), area_min
    )
    np.testing.assert_array_equal(one, np.stack(batched, 1))
    y, x, h, w = one.T
    assert np.all((y >= 0) & (x >= 0) & (y + h <= height) & (x + w <= width) & (h >= 1))
  y, x, h, w = np.stack(host.crop_window(u.reshape(-1, 10, 4), 375, 500, 0.05), 1).T
  fraction = h * w / (375 * 500)
  assert fraction.min() > 0.045 and 0.35 < fraction.mean() < 0.5  # as the tf.data path's test


def test_example_uniforms_are_uniform_and_independent():
  u = order.example_uniforms(5, np.arange(20_000), 4)
  assert abs(u.mean() - 0.5) < 0.01 and abs(u.std() - 12**-0.5) < 0.01
  assert abs(np.corrcoef(u[:, 0], u[:, 1])[0, 1]) < 0.03
  assert abs(np.corrcoef(u[:-1, 0], u[1:, 0])[0, 1]) < 0.03
  assert not np.array_equal(u, order.example_uniforms(6, np.arange(20_000), 4))


def test_reduced_scale_decode_stays_close_to_a_full_decode():
  from sklearn.datasets import load_sample_images

  buf = io.BytesIO()
  Image.fromarray(load_sample_images().images[0]).save(buf, 'JPEG', quality=95)
  data = buf.getvalue()  # 427 x 640
  full = host.decode(data)
  half = host.decode(data, 200, 300)
  assert half.shape == (214, 320, 3)  # libjpeg-turbo's 1/2 scale
  cv2 = host._cv2()
  pp = pipeline._PP(96, None, False, False, 1.0, 0, 0.0, 0.0)  # whole image, no flip
  ours = host.train_image(data, np.zeros(host._DRAWS), pp)  # decodes at 1/4 scale
  ref = cv2.resize(full, (96, 96), interpolation=cv2.INTER_AREA)
  assert np.abs(ours.astype(int) - ref).mean() < 4


def test_flip_mirrors_the_same_crop():
  buf = io.BytesIO()
  Image.fromarray(np.random.default_rng(0).integers(0, 255, (90, 120, 3), np.uint8)).save(
    buf, 'PNG'
  )
  pp = pipeline._PP(32, None, True, True, 0.3, 0, 0.0, 0.0)
  u = order.example_uniforms(1, [7], host._DRAWS)[0]
  u[-1] = 0.9
  plain = host.train_image(buf.getvalue(), u, pp)
  u[-1] = 0.1
  np.testing.assert_array_equal(host.train_image(buf.getvalue(), u, pp), plain[:, ::-1])


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
  source = pipeline._open(config, 'train')
  _, idx = order.train_indices(
    0, global_batch=8, local_batch=8, offset=0, num_examples=26, order_key=order.keys(0)[0]
  )
  np.testing.assert_array_equal(labels, source.fetch(idx)[1])


@pytest.mark.parametrize('name', [f.__name__ for f in randaug._PLAIN + randaug._SIGNED])
def test_randaugment_ops_match_the_tensorflow_ones(name, photos):
  path = input_speed.image_files(os.path.join(photos, 'train'))[0]
  image = host.decode(open(path, 'rb').read())[:96, :128].copy()
  names = [f.__name__ for f in randaug._PLAIN + randaug._SIGNED]
  op = names.index(name)
  for level, sign in ((3.0, True), (9.0, False)):
    fn = getattr(randaug, name)
    args = (level, tf.constant(sign)) if op >= len(randaug._PLAIN) else (level,)
    theirs = fn(tf.constant(image), *args).numpy()
    ours = randaug_host.apply_op(image, op, level, 1 if sign else -1)
    assert np.mean(ours != theirs) < 0.01, (name, level)  # ties of nearest sampling only


def test_shards_parse_the_same_without_tensorflow(photos, tmp_path):
  examples, names = shards.examples_from_folder(os.path.join(photos, 'train'))
  out = str(tmp_path / 'shards')
  shards.write_shards(examples, out, 'train', num_classes=3, class_names=names, num_shards=2)
  source = shards.open_split(out, 'train')
  items, labels = source.fetch(np.arange(source.num_examples))
  reader_records = source.read(tf.range(source.num_examples, dtype=tf.int64))['record']
  for item, label, record in zip(items, labels, reader_records):
    parsed = shards.parse_example(record, 3)
    assert item == parsed['image'].numpy()
    np.testing.assert_array_equal(label, parsed['label'].numpy())


_NO_TF = r"""
import json, sys
sys.modules['tensorflow'] = None  # as if not installed: `import tensorflow` fails
sys.modules['tensorflow_datasets'] = None
import numpy as np
from vit_jax.data import pipeline, shards
from vit_jax.training import loop  # noqa: F401  (the trainer imports)
folder, out = sys.argv[1], sys.argv[2]
examples, names = shards.examples_from_folder(folder + '/train')
shards.write_shards(examples, out, 'train', num_classes=3, class_names=names, num_shards=2,
                    file_format='array_record')
sums = {}
for dataset in (folder, out, 'digits'):
  config = pipeline.add_data_config(pipeline.data_config())
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


def test_folders_shards_and_digits_need_no_tensorflow(photos, tmp_path):
  out = str(tmp_path / 'array_record')
  proc = _python('-c', _NO_TF, photos, out)
  result = json.loads(proc.stdout.split('RESULT', 1)[1])
  # The same batches as in this process, where TensorFlow is importable.
  for dataset, (image_sum, eval_batches) in result.items():
    config = pipeline.add_data_config(pipeline.data_config())
    config.dataset, config.batch, config.batch_eval, config.pp.crop = dataset, 8, 8, 32
    config.pp.randaug_layers, config.pp.mixup, config.pp.test = 2, 0.2, 'train'
    batch = next(pipeline.make_train_iterator(config, None))
    assert float(batch['image'].sum()) == image_sum, dataset
  assert result[photos][1] == 4 and result['digits'][1] == 180  # 1438 / 8


def test_benchmark_input_reports_rates_the_ceiling_and_stages(tmp_path):
  record = tmp_path / 'input.json'
  _python(
    '-m', 'vit_jax.benchmark_input', '--images=24', '--batch=8', '--steps=1', '--rounds=1',
    '--threads=1,2', f'--dir={tmp_path}', f'--json={record}',
  )  # fmt: skip
  out = json.loads(record.read_text())
  assert out['files'] == 24 and 60 < out['mean_file_kB'] < 120  # ImageNet-like JPEGs
  for n in ('1', '2'):
    t = out['threads'][n]
    assert abs(t['img_per_sec_per_core'] - t['img_per_sec'] / int(n)) <= 1  # each rounded
    ratio = t['img_per_sec'] / int(n) / out['decode_only_img_per_sec']
    assert t['ratio_per_core_to_decode_only'] == pytest.approx(ratio, rel=0.01)
  assert out['img_per_sec_per_core'] == out['threads']['2']['img_per_sec_per_core']
  assert set(out['stage_ms_per_image']) == {
    'read', 'header_and_crop', 'entropy_decode', 'idct_and_colour', 'resize', 'flip_and_float'
  }  # fmt: skip
  for key in ('randaugment_mixup_img_per_sec', 'tf_data_img_per_sec', 'eval_img_per_sec',
              'tfrecord_shards_img_per_sec'):  # fmt: skip
    assert out[key] > 0, key


def test_a_state_from_the_other_backend_is_refused(photos):
  state = pipeline.make_train_iterator(_config(photos, input_backend='tf'), None).get_state()
  assert state['input_backend'] == 'tf'
  with pytest.raises(pipeline.DataError, match="input_backend='tf' but the config gives 'host'"):
    pipeline.make_train_iterator(_config(photos), None, state=state)
