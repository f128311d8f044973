"""The TFDS path: mocked presets, real TFRecord/ArrayRecord preparations, real builders, errors."""

import socket

from conftest import batch_sharding
from conftest import data_config
import numpy as np
import pytest
import tensorflow_datasets as tfds

from vit_jax import prepare as prepare_cli
from vit_jax.configs import recipes
from vit_jax.data import datasets
from vit_jax.data import pipeline
from vit_jax.data import presets


def _config(dataset, **kw):
  return data_config(dataset, **{'batch': 4, 'batch_eval': 3, 'pp.crop': 8, **kw})


def _fresh():
  datasets.open_split.cache_clear()


def test_cifar10_preset_with_mock_data():
  _fresh()
  with tfds.testing.mock_data(num_examples=10):
    config = _config('cifar10')
    info = pipeline.get_info(config)
    assert (info.num_classes, info.num_test) == (10, 10)
    assert recipes.finetune_steps('cifar10') == 10_000
    batch = next(pipeline.make_train_iterator(config, batch_sharding()))
    assert batch['image'].shape == (4, 8, 8, 3) and batch['label'].dtype == np.int32
    masks = [np.asarray(b['mask']) for b in pipeline.make_eval_iterator(config, batch_sharding())]
    assert len(masks) == 4 and sum(m.sum() for m in masks) == 10  # 10 = 3 + 3 + 3 + 1
  _fresh()


def test_imagenet_real_labels_are_multi_hot_and_empty_sets_masked():
  _fresh()
  with tfds.testing.mock_data(num_examples=5):
    config = _config('imagenet2012_real')
    batches = list(pipeline.make_eval_iterator(config, batch_sharding()))
    label = np.concatenate([b['label'] for b in batches])
    assert label.shape == (6, 1000) and set(np.unique(label)) <= {0.0, 1.0}
    assert np.concatenate([b['mask'] for b in batches]).sum() == 5
  _fresh()


def test_vtab_task_uses_the_1k_protocol_splits():
  _fresh()
  with tfds.testing.mock_data(num_examples=7):
    info = pipeline.get_info(_config('vtab/dsprites_orientation'))
    # Mocked splits have 7 examples each: train800 -> 7, val200 -> 7.
    assert (info.num_classes, info.num_train) == (16, 14)
    assert recipes.finetune_steps('vtab/dsprites_orientation') == 2500
    batch = next(
      pipeline.make_train_iterator(_config('vtab/dsprites_orientation'), batch_sharding())
    )
    assert np.all((0 <= np.asarray(batch['label'])) & (np.asarray(batch['label']) < 16))
  _fresh()


class Tiny(tfds.core.GeneratorBasedBuilder):
  """A real, locally prepared TFDS dataset: solid images whose colour is the label."""

  VERSION = tfds.core.Version('1.0.0')

  def _info(self):
    return tfds.core.DatasetInfo(
      builder=self,
      features=tfds.features.FeaturesDict(
        {
          'image': tfds.features.Image(shape=(12, 10, 3)),
          'label': tfds.features.ClassLabel(num_classes=5),
        }
      ),
    )

  def _split_generators(self, dl_manager):
    return {'train': self._generate_examples(23), 'test': self._generate_examples(7)}

  def _generate_examples(self, n):
    for i in range(n):
      image = np.full((12, 10, 3), 40 * (i % 5), np.uint8)
      yield i, {'image': image, 'label': i % 5}


@pytest.mark.parametrize('file_format', ['tfrecord', 'array_record'])
def test_prepared_dataset_reads_every_example(tmp_path, file_format):
  _fresh()
  Tiny(data_dir=str(tmp_path), file_format=file_format).download_and_prepare()
  config = _config('tiny', tfds_data_dir=str(tmp_path))
  config.pp.test = 'test'
  config.pp.train = 'train[:20]'
  info = pipeline.get_info(config)
  assert (info.num_train, info.num_test, info.num_classes) == (20, 7, 5)
  batches = list(pipeline.make_eval_iterator(config, batch_sharding(), split='train[:20]'))
  images = np.concatenate([b['image'] for b in batches])
  labels = np.concatenate([b['label'] for b in batches])
  mask = np.concatenate([b['mask'] for b in batches])
  assert mask.sum() == 20
  # Each image's pixel value encodes its label: image and label travel together.
  pixel = np.round((images[mask == 1, 0, 0, 0] + 1) * 127.5)
  np.testing.assert_array_equal(pixel, 40 * labels[mask == 1])
  # Same examples in the same order as TFDS's own reader.
  builder = tfds.builder('tiny', data_dir=str(tmp_path))
  reference = (
    builder.as_dataset('train[:20]')
    if file_format == 'tfrecord'
    else builder.as_data_source('train[:20]')
  )
  np.testing.assert_array_equal(labels[mask == 1], [int(e['label']) for e in reference])
  _fresh()


def test_unprepared_and_unknown_datasets_say_what_to_do(tmp_path):
  _fresh()
  with pytest.raises(pipeline.DataError, match=r"unknown dataset 'cifar11': did you mean cifar10"):
    pipeline.get_info(_config('cifar11'))
  with pytest.raises(
    pipeline.DataError, match='cifar10: not prepared in .* run python -m vit_jax.prepare cifar10'
  ):
    pipeline.get_info(_config('cifar10', tfds_data_dir=str(tmp_path)))
  with pytest.raises(
    pipeline.DataError, match='imagenet2012: not prepared .*ILSVRC2012_img_train.tar'
  ):
    pipeline.get_info(_config('imagenet2012', tfds_data_dir=str(tmp_path)))
  with pytest.raises(pipeline.DataError, match='imagenet21k: no converted shards'):
    pipeline.get_info(_config('imagenet21k', tfds_data_dir=str(tmp_path)))
  _fresh()


def test_prepare_names_the_missing_manual_download(tmp_path):
  with pytest.raises(
    SystemExit, match=r'imagenet2012: manual download missing in .*ILSVRC2012_img_train.tar'
  ):
    prepare_cli.main(['imagenet2012', '--data_dir', str(tmp_path), '--manual_dir', str(tmp_path)])
  with pytest.raises(SystemExit, match='imagenet21k: manual download missing'):
    prepare_cli.main(
      ['imagenet21k', '--data_dir', str(tmp_path), '--manual_dir', str(tmp_path / 'x')]
    )


# The TFDS datasets docs/data.md names (the manual ImageNet ones are tested above).
DOCUMENTED = ['cifar10', 'cifar100', 'oxford_iiit_pet', 'oxford_flowers102'] + [
  f'vtab/{task}' for task in presets.VTAB_TASKS
]
# Tasks whose TFDS builder has no download: its files are fetched by hand.
_MANUAL = ('vtab/resisc45', 'vtab/diabetic_retinopathy')


@pytest.mark.parametrize('name', DOCUMENTED)
def test_prepare_runs_the_real_builder_and_stops_offline_in_one_line(name, tmp_path, monkeypatch):
  """Real `tfds.builder` code up to the download; offline, that is one line at once.

  No mock of TFDS: only name resolution fails, as on a machine without internet access.
  """

  def offline(*args, **kwargs):
    raise socket.gaierror(socket.EAI_NONAME, 'Name or service not known')

  monkeypatch.setattr(socket, 'getaddrinfo', offline)
  with pytest.raises(SystemExit) as exit_info:
    prepare_cli.main([name, '--data_dir', str(tmp_path)])
  message = str(exit_info.value.code)
  assert message.startswith(f'python -m vit_jax.prepare: error: {name}: ') and '\n' not in message
  if name in _MANUAL:
    assert 'download it by hand' in message and '--manual_dir' in message
  else:
    assert 'cannot reach ' in message and 'Name or service not known' in message
    assert 'internet access' in message
  if name == 'cifar10':
    assert 'cannot reach www.cs.toronto.edu' in message
