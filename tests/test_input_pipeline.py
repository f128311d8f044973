"""The train/eval iterators on the built-in digits: determinism, resume, exact evaluation."""

from conftest import batch_sharding
from conftest import data_config
import jax
import ml_collections
import numpy as np
import pytest

from vit_jax.configs import ConfigError
from vit_jax.configs.data import add_data_config
from vit_jax.data import order
from vit_jax.data import pipeline
from vit_jax.data.readers import builtin
from vit_jax.data.sources import DataError


def _config(**overrides):
  return data_config(**{'batch': 64, 'batch_eval': 100, 'pp.crop': 16, **overrides})


def _take(it, n):
  return [jax.tree.map(np.asarray, next(it)) for _ in range(n)]


def test_digits_split_is_fixed_stratified_and_disjoint():
  train, test = builtin.digits_split_indices()
  assert len(train) == 1438 and len(test) == 359
  assert not set(train) & set(test) and len(set(train) | set(test)) == 1797
  _, labels = builtin.load_digits()
  # Each class holds out round(20%) of its members.
  for c in range(10):
    n = np.sum(labels == c)
    assert np.sum(labels[test] == c) == round(0.2 * n)
  info = pipeline.get_info(_config())
  assert (info.num_train, info.num_test, info.num_classes, info.multi_label) == (
    1438,
    359,
    10,
    False,
  )


def test_add_data_config_keeps_existing_values():
  config = ml_collections.ConfigDict({'batch': 7, 'pp': {'crop': 32}})
  add_data_config(config)
  assert config.batch == 7 and config.pp.crop == 32
  assert config.pp.mixup == 0.0 and config.dataset == 'digits'


def test_train_batches_shapes_and_range():
  batch = next(pipeline.make_train_iterator(_config(), batch_sharding()))
  assert batch['image'].shape == (64, 16, 16, 3) and batch['image'].dtype == np.float32
  assert batch['label'].shape == (64,) and batch['label'].dtype == np.int32
  assert float(batch['image'].min()) >= -1 and float(batch['image'].max()) <= 1
  assert isinstance(batch['image'], jax.Array)


def test_each_epoch_is_a_permutation_of_the_split():
  n, b = 1438, 64
  seen = np.concatenate(
    [
      order.train_indices(
        s,
        global_batch=b,
        local_batch=b,
        offset=0,
        num_examples=n,
        order_key=5,
      )[1]
      for s in range(2 * n // b + 2)
    ]
  )
  assert sorted(seen[:n]) == list(range(n))  # epoch 0: every example once
  assert sorted(seen[n : 2 * n]) == list(range(n))  # epoch 1 too
  assert not np.array_equal(seen[:n], seen[n : 2 * n])  # in another order


def test_same_seed_same_batches_other_seed_others():
  a = _take(pipeline.make_train_iterator(_config(), batch_sharding()), 3)
  b = _take(pipeline.make_train_iterator(_config(), batch_sharding()), 3)
  c = _take(pipeline.make_train_iterator(_config(seed=1), batch_sharding()), 3)
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x['image'], y['image'])
    np.testing.assert_array_equal(x['label'], y['label'])
  assert not np.array_equal(a[0]['label'], c[0]['label'])


@pytest.mark.parametrize('overrides', [{}, {'pp.mixup': 0.4, 'pp.randaug_layers': 2}])
def test_resume_gives_bitwise_the_same_batches(overrides):
  config = _config(**overrides)
  it = pipeline.make_train_iterator(config, batch_sharding())
  _take(it, 30)  # past the first epoch boundary (1438 / 64 = 22.5 steps)
  state = it.get_state()
  assert state['step'] == 30
  expected = _take(it, 4)
  resumed = pipeline.make_train_iterator(config, batch_sharding(), state=dict(state))
  for x, y in zip(expected, _take(resumed, 4)):
    np.testing.assert_array_equal(x['image'], y['image'])
    np.testing.assert_array_equal(x['label'], y['label'])


def test_restore_with_another_batch_size_is_refused():
  state = {'step': 3, 'seed': 0, 'batch': 64, 'dataset': 'digits'}
  with pytest.raises(DataError, match='batch=64'):
    pipeline.make_train_iterator(_config(batch=32), batch_sharding(), state=state)


def test_mixup_labels_are_soft_and_sum_to_one():
  batch = next(pipeline.make_train_iterator(_config(**{'pp.mixup': 0.4}), batch_sharding()))
  label = np.asarray(batch['label'])
  assert label.shape == (64, 10)
  np.testing.assert_allclose(label.sum(1), 1.0, rtol=1e-6)
  # One weight p >= 1/2 per step; an image whose neighbour shares its class keeps 1.
  top = label.max(1)
  p = top.min()
  assert 0.5 <= p < 1 and np.all(np.isclose(top, p) | np.isclose(top, 1.0))


def _pixels(images):
  """[-1, 1] floats back to the uint8 pixels they were made from."""
  return np.round((images + 1.0) * 127.5).astype(np.uint8)


def _nearest_centroid_predictions(images, centroids):
  flat = images.reshape(len(images), -1)
  return np.argmin(((flat[:, None] - centroids[None]) ** 2).sum(-1), axis=1)


def test_eval_sees_every_example_once_and_masking_keeps_accuracy_exact():
  config = _config()
  n = 359  # batch_eval 100 does not divide it: 4 batches, 41 padded
  batches = list(pipeline.make_eval_iterator(config, batch_sharding()))
  assert len(batches) == 4
  images = np.concatenate([np.asarray(b['image']) for b in batches])
  labels = np.concatenate([np.asarray(b['label']) for b in batches])
  mask = np.concatenate([np.asarray(b['mask']) for b in batches])
  assert mask.sum() == n and np.all(mask[:n] == 1) and np.all(mask[n:] == 0)

  # The real examples are the test split in order, resized exactly as eval does.
  raw, raw_labels = builtin.load_digits()
  test = builtin.digits_split_indices()[1]
  tf = pytest.importorskip('tensorflow')  # the oracle: TensorFlow's resize
  expected = tf.cast(
    tf.clip_by_value(tf.round(tf.image.resize(raw[test], [16, 16], method='bilinear')), 0, 255),
    tf.uint8,
  )
  np.testing.assert_array_equal(_pixels(images[:n]), expected.numpy())
  np.testing.assert_array_equal(labels[:n], raw_labels[test])

  # Accuracy of a fixed classifier: masked over the padded batches == direct.
  train_batches = _take(
    pipeline.make_train_iterator(_config(**{'pp.inception_crop': False}), batch_sharding()), 30
  )
  train_x = np.concatenate([b['image'] for b in train_batches]).reshape(30 * 64, -1)
  train_y = np.concatenate([b['label'] for b in train_batches])
  centroids = np.stack([train_x[train_y == c].mean(0) for c in range(10)])
  correct = _nearest_centroid_predictions(images, centroids) == labels
  masked_correct = int((correct * mask).sum())
  direct_correct = int(
    np.sum(_nearest_centroid_predictions(images[:n], centroids) == raw_labels[test])
  )
  assert masked_correct == direct_correct and 0.8 * n < direct_correct < n
  assert correct.sum() / len(correct) != direct_correct / n  # unmasked padding would count


def test_eval_with_resize_then_centre_crop():
  batches = list(pipeline.make_eval_iterator(_config(**{'pp.resize': 20}), batch_sharding()))
  raw, _ = builtin.load_digits()
  first = raw[builtin.digits_split_indices()[1][:4]]
  tf = pytest.importorskip('tensorflow')  # the oracle: TensorFlow's resize
  big = tf.cast(tf.clip_by_value(tf.round(tf.image.resize(first, [20, 20])), 0, 255), tf.uint8)
  np.testing.assert_array_equal(
    _pixels(np.asarray(batches[0]['image'][:4])), big.numpy()[:, 2:18, 2:18]
  )


def test_batch_that_does_not_split_over_devices_is_a_clear_error():
  if jax.device_count() == 1:
    pytest.skip('needs several devices')
  with pytest.raises(DataError, match='batch'):
    pipeline.make_train_iterator(_config(batch=jax.device_count() + 1), batch_sharding())


def test_config_errors_are_one_line():
  with pytest.raises(DataError, match='did you mean cifar10'):
    pipeline.get_info(_config(dataset='cifar11'))
  with pytest.raises(DataError, match='no split'):
    pipeline.get_info(_config(**{'pp.train': 'validation'}))
  # A value the schema refuses (configs.schema.DATA_RULES), for callers that skip the trainer.
  with pytest.raises(ConfigError, match=r'^pp.area_min=0.0: use a fraction in \(0, 1\]$'):
    next(pipeline.make_train_iterator(_config(**{'pp.area_min': 0.0}), batch_sharding()))
