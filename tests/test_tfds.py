"""TFDS datasets: presets on datasets TFDS prepared, read without TensorFlow; preparing; errors."""

import re
import socket
import subprocess
import sys
import textwrap

from conftest import batch_sharding
from conftest import data_config
from conftest import fake_image_dataset
from conftest import fake_tfds_dataset
from conftest import subprocess_env
import numpy as np
import pytest

from vit_jax import prepare as prepare_cli
from vit_jax.configs import recipes
from vit_jax.core import cli
from vit_jax.data import datasets
from vit_jax.data import pipeline
from vit_jax.data import presets
from vit_jax.data.readers import tfds
from vit_jax.data.sources import DataError


def _config(dataset, **kw):
  return data_config(dataset, **{'batch': 4, 'batch_eval': 3, 'pp.crop': 8, **kw})


@pytest.fixture(autouse=True)
def _fresh():
  datasets.open_split.cache_clear()
  tfds._metadata.cache_clear()
  yield
  datasets.open_split.cache_clear()


def _solid(i, shape=(12, 10, 3)):
  """An image whose pixel value (40 * (i % 5)) encodes example i's label."""
  return np.full(shape, 40 * (i % 5), np.uint8)


def test_cifar10_preset_reads_its_prepared_splits(tmp_path):
  names = [f'class_{k}' for k in range(10)]
  fake_image_dataset(
    tmp_path,
    'cifar10',
    (32, 32, 3),
    names,
    lambda split, i: {'image': _solid(i, (32, 32, 3)), 'label': i % 10},
    {'train': 50, 'test': 10},
  )
  config = _config('cifar10', tfds_data_dir=str(tmp_path))
  info = pipeline.get_info(config)
  # The preset's splits: train[:98%] of 50 is 49 (TFDS rounds to the nearest example).
  assert (info.num_classes, info.num_train, info.num_test) == (10, 49, 10)
  assert list(info.class_names) == names
  assert recipes.finetune_steps('cifar10') == 10_000
  batch = next(pipeline.make_train_iterator(config, batch_sharding()))
  assert batch['image'].shape == (4, 8, 8, 3) and batch['label'].dtype == np.int32
  batches = list(pipeline.make_eval_iterator(config, batch_sharding()))
  masks = np.concatenate([b['mask'] for b in batches])
  assert len(batches) == 4 and masks.sum() == 10  # 10 = 3 + 3 + 3 + 1
  # Each image's pixel value encodes its label (i % 5 of i % 10): they travel together.
  images = np.concatenate([b['image'] for b in batches])[masks == 1]
  labels = np.concatenate([b['label'] for b in batches])[masks == 1]
  np.testing.assert_array_equal(np.round((images[:, 0, 0, 0] + 1) * 127.5), 40 * (labels % 5))


def test_imagenet_real_labels_are_multi_hot_and_empty_sets_masked(tmp_path):
  real = [[3, 7], [], [5], [1, 2, 999], []]
  fake_tfds_dataset(
    tmp_path,
    'imagenet2012_real',
    lambda t: {
      'image': t.features.Image(shape=(12, 10, 3)),
      'real_label': t.features.Sequence(t.features.ClassLabel(num_classes=1000)),
    },
    lambda split, i: {'image': _solid(i), 'real_label': real[i]},
    {'validation': 5},
  )
  config = _config('imagenet2012_real', tfds_data_dir=str(tmp_path))
  batches = list(pipeline.make_eval_iterator(config, batch_sharding()))
  label = np.concatenate([b['label'] for b in batches])
  mask = np.concatenate([b['mask'] for b in batches])
  assert label.shape == (6, 1000) and set(np.unique(label)) <= {0.0, 1.0}
  # TFDS stores examples shuffled: compare as sets of label sets.
  got = sorted(tuple(np.flatnonzero(row)) for row in label[:5])
  assert got == sorted(tuple(r) for r in real)
  # Padding and the two examples without a correct label are left out of accuracy.
  assert mask.sum() == 3 and not np.any(mask[(label.sum(1) == 0)])


def test_vtab_task_uses_the_1k_protocol_splits_and_its_label(tmp_path):
  fake_image_dataset(
    tmp_path,
    'dsprites',
    (12, 10, 3),
    40,
    lambda split, i: {'image': _solid(i), 'label_orientation': (7 * i) % 40},
    {'train': 30},
    label='label_orientation',
  )
  config = _config('vtab/dsprites_orientation', tfds_data_dir=str(tmp_path))
  info = pipeline.get_info(config)
  # train800 = train[:80%][:800] -> 24 of 30; val200 = train[80%:90%][:200] -> 3.
  assert (info.num_classes, info.num_train) == (16, 27)
  assert recipes.finetune_steps('vtab/dsprites_orientation') == 2500
  batches = list(pipeline.make_eval_iterator(config, batch_sharding(), split='train'))
  labels = np.concatenate([b['label'] for b in batches])[:27]
  # 40 orientations binned into 16 classes of 2.5.
  assert labels.min() >= 0 and labels.max() < 16 and len(set(labels.tolist())) > 8


def test_vtab_label_functions_bin_as_the_protocol():
  by_name = {k: p.label_fn for k, p in presets.PRESETS.items() if p.label_fn}
  assert by_name['vtab/clevr_count']({'objects/size': [0, 1, 1, 0, 1]}) == 2
  coords = np.array([[10, 20, 9.7], [30, 40, 8.7], [5, 5, 12.0]], np.float32).ravel()
  assert by_name['vtab/clevr_distance']({'objects/pixel_coords': coords}) == 2  # 8.5 < 8.7 <= 9
  kitti = by_name['vtab/kitti_distance']
  locations = np.array([[0, 0, 25.0], [0, 0, 5.0]], np.float32).ravel()
  assert kitti({'objects/type': [0, 3], 'objects/location': locations}) == 2  # a car at 25 m
  assert kitti({'objects/type': [4], 'objects/location': np.zeros(3, np.float32)}) == 3  # none
  assert by_name['vtab/dsprites_orientation']({'label_orientation': np.array([39])}) == 15
  assert by_name['vtab/dsprites_location']({'label_x_position': np.array([31])}) == 15
  real = by_name['imagenet2012_real']({'real_label': np.array([3, 3, 8])})
  assert real.dtype == np.float32 and np.flatnonzero(real).tolist() == [3, 8]


@pytest.mark.parametrize('file_format', ['tfrecord', 'array_record'])
def test_prepared_dataset_reads_every_example_in_tfds_order(tmp_path, file_format):
  builder = fake_image_dataset(
    tmp_path,
    'tiny',
    (12, 10, 3),
    5,
    lambda split, i: {'image': _solid(i), 'label': i % 5},
    {'train': 23, 'test': 7},
    file_format=file_format,
  )
  config = _config(
    'tiny', tfds_data_dir=str(tmp_path), **{'pp.train': 'train[:20]', 'pp.test': 'test'}
  )
  info = pipeline.get_info(config)
  assert (info.num_train, info.num_test, info.num_classes) == (20, 7, 5)
  batches = list(pipeline.make_eval_iterator(config, batch_sharding(), split='train[:20]'))
  images = np.concatenate([b['image'] for b in batches])
  labels = np.concatenate([b['label'] for b in batches])
  mask = np.concatenate([b['mask'] for b in batches])
  assert mask.sum() == 20
  pixel = np.round((images[mask == 1, 0, 0, 0] + 1) * 127.5)
  np.testing.assert_array_equal(pixel, 40 * labels[mask == 1])
  # The same examples in the same order as TFDS's own reader (the order runs trained in).
  reference = (
    builder.as_dataset('train[:20]')
    if file_format == 'tfrecord'
    else builder.as_data_source('train[:20]')
  )
  np.testing.assert_array_equal(labels[mask == 1], [int(e['label']) for e in reference])
  # 'a+b' concatenates as TFDS does.
  both = datasets.open_split('tiny', 'train[:3]+test[-2:]', str(tmp_path))
  if file_format == 'array_record':  # TFDS's random access reads ArrayRecord only
    want = [int(e['label']) for e in builder.as_data_source('train[:3]')] + [
      int(e['label']) for e in builder.as_data_source('test[-2:]')
    ]
    assert both.fetch(np.arange(5))[1].tolist() == want
  assert both.num_examples == 5


_READ_WITHOUT_TENSORFLOW = textwrap.dedent("""
  import sys
  sys.modules['tensorflow'] = None  # any import of TensorFlow (or TFDS) fails
  sys.modules['tensorflow_datasets'] = None
  import ml_collections
  from vit_jax.configs.data import add_data_config
  from vit_jax.data import pipeline
  config = add_data_config(ml_collections.ConfigDict())
  config.update(dataset='cifar10', tfds_data_dir=sys.argv[1], batch=4, batch_eval=5)
  config.pp.crop = 8
  batch = next(pipeline.make_train_iterator(config, None))
  n = sum(float(b['mask'].sum()) for b in pipeline.make_eval_iterator(config, None))
  print(batch['image'].shape, int(n))
""")


def test_a_prepared_dataset_trains_and_evaluates_without_tensorflow(tmp_path):
  fake_image_dataset(
    tmp_path,
    'cifar10',
    (32, 32, 3),
    10,
    lambda split, i: {'image': _solid(i, (32, 32, 3)), 'label': i % 10},
    {'train': 20, 'test': 10},
  )
  result = subprocess.run(
    [sys.executable, '-c', _READ_WITHOUT_TENSORFLOW, str(tmp_path)],
    capture_output=True,
    text=True,
    env=subprocess_env(),
    timeout=300,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.split('\n')[-2] == '(4, 8, 8, 3) 10'


def test_unprepared_and_unknown_datasets_say_what_to_do(tmp_path):
  with pytest.raises(DataError, match=r"unknown dataset 'cifar11': did you mean cifar10"):
    pipeline.get_info(_config('cifar11', tfds_data_dir=str(tmp_path)))
  with pytest.raises(
    DataError, match='cifar10: not prepared in .* run python -m vit_jax.prepare cifar10'
  ):
    pipeline.get_info(_config('cifar10', tfds_data_dir=str(tmp_path)))
  with pytest.raises(DataError, match='imagenet2012: not prepared .*ILSVRC2012_img_train.tar'):
    pipeline.get_info(_config('imagenet2012', tfds_data_dir=str(tmp_path)))
  with pytest.raises(DataError, match='imagenet21k: no converted shards'):
    pipeline.get_info(_config('imagenet21k', tfds_data_dir=str(tmp_path)))


def prepare_error(capsys, *args):
  """The one `error:` line `python -m vit_jax.prepare ARGS` ends with."""
  capsys.readouterr()
  with pytest.raises(SystemExit) as exit_info:
    prepare_cli.main([str(a) for a in args])
  assert exit_info.value.code == cli.EXIT_ERROR
  lines = capsys.readouterr().err.splitlines()
  assert len(lines) == 1 and lines[0].startswith('error: '), lines
  return lines[0][len('error: ') :]


def test_prepare_names_the_missing_manual_download(tmp_path, capsys):
  pytest.importorskip('tensorflow')
  message = prepare_error(capsys, 'imagenet2012', '--data_dir', tmp_path, '--manual_dir', tmp_path)
  assert re.match(r'imagenet2012: manual download missing in .*ILSVRC2012_img_train.tar', message)
  message = prepare_error(
    capsys, 'imagenet21k', '--data_dir', tmp_path, '--manual_dir', tmp_path / 'x'
  )
  assert message.startswith('imagenet21k: manual download missing')


def test_preparing_without_tensorflow_says_what_to_install(tmp_path, monkeypatch, capsys):
  monkeypatch.setitem(sys.modules, 'tensorflow', None)
  message = prepare_error(capsys, 'cifar10', '--data_dir', tmp_path)
  assert message == (
    "preparing TFDS datasets needs TensorFlow: pip install 'vit_jax[tfds]' "
    '(TensorFlow and tensorflow-datasets)'
  )


# The TFDS datasets docs/data.md names (the manual ImageNet ones are tested above).
DOCUMENTED = ['cifar10', 'cifar100', 'oxford_iiit_pet', 'oxford_flowers102'] + [
  f'vtab/{task}' for task in presets.VTAB_TASKS
]
# Tasks whose TFDS builder has no download: its files are fetched by hand.
_MANUAL = ('vtab/resisc45', 'vtab/diabetic_retinopathy')


@pytest.mark.parametrize('name', DOCUMENTED)
def test_prepare_runs_the_real_builder_and_stops_offline_in_one_line(
  name, tmp_path, monkeypatch, capsys
):
  """Real `tfds.builder` code up to the download; offline, that is one line at once.

  No mock of TFDS: only name resolution fails, as on a machine without internet access.
  """
  pytest.importorskip('tensorflow')

  def offline(*args, **kwargs):
    raise socket.gaierror(socket.EAI_NONAME, 'Name or service not known')

  monkeypatch.setattr(socket, 'getaddrinfo', offline)
  message = prepare_error(capsys, name, '--data_dir', tmp_path)
  assert message.startswith(f'{name}: ')
  if name in _MANUAL:
    assert 'download it by hand' in message and '--manual_dir' in message
  else:
    assert 'cannot reach ' in message and 'Name or service not known' in message
    assert 'internet access' in message
  if name == 'cifar10':
    assert 'cannot reach www.cs.toronto.edu' in message
