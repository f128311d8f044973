"""Few-shot linear evaluation: parity with scikit-learn's ridge, sampling, features."""

import os

from conftest import run_command
import jax
import numpy as np
import pytest
from sklearn.linear_model import RidgeClassifier

from vit_jax import models
from vit_jax.configs import architectures
from vit_jax.evaluation import fewshot


def clustered(num_classes, per_class, dim, seed, spread=2.0):
  """Gaussian blobs: features [K*per_class, D] with a class-dependent mean."""
  rng = np.random.default_rng(seed)
  centres = rng.normal(size=(num_classes, dim)) * spread / np.sqrt(dim) * 4
  labels = np.repeat(np.arange(num_classes), per_class)
  features = centres[labels] + rng.normal(size=(len(labels), dim)) + 3.0  # off-centre
  return features.astype(np.float32), labels


def sklearn_predictions(train_x, train_y, test_x, l2_reg):
  """The independent reference: sklearn's ridge on the same standardised features."""
  train_x, test_x = train_x.astype(np.float64), test_x.astype(np.float64)  # sklearn keeps float32
  mean, std = train_x.mean(0), train_x.std(0) + 1e-5
  ridge = RidgeClassifier(alpha=l2_reg, fit_intercept=True, solver='svd')
  ridge.fit((train_x - mean) / std, train_y)
  return ridge.predict((test_x - mean) / std), ridge


@pytest.mark.parametrize(
  'num_classes,per_class,dim,l2_reg',
  [
    (10, 1, 48, fewshot.DEFAULT_L2_REG),  # 1-shot: fewer points than dimensions
    (10, 25, 48, fewshot.DEFAULT_L2_REG),  # more points than dimensions
    (7, 5, 32, 0.01),  # weak regularisation: near-interpolation
    (2, 10, 16, 3.0),  # sklearn uses a single +-1 column for 2 classes
  ],
)
def test_predictions_match_sklearn_ridge_classifier(num_classes, per_class, dim, l2_reg):
  train_x, train_y = clustered(num_classes, per_class, dim, seed=0)
  test_x, _ = clustered(num_classes, 40, dim, seed=1, spread=0.5)  # many near-ties
  ours = fewshot.predict(fewshot.fit(train_x, train_y, num_classes, l2_reg), test_x)
  reference, ridge = sklearn_predictions(train_x, train_y, test_x, l2_reg)
  np.testing.assert_array_equal(ours, reference)
  if num_classes > 2:  # same weights and bias, not only the same argmax
    clf = fewshot.fit(train_x, train_y, num_classes, l2_reg)
    np.testing.assert_allclose(clf.kernel.T, ridge.coef_, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(clf.bias, ridge.intercept_, rtol=1e-6, atol=1e-9)


def test_fit_path_equals_separate_fits_and_closed_form():
  x, y = clustered(5, 6, 12, seed=2)
  path = fewshot.fit_path(x, y, 5, [0.1, 10.0, 1000.0])
  for l2, clf in zip([0.1, 10.0, 1000.0], path):
    xs = fewshot.standardize(x, clf.mean, clf.std)
    t = fewshot.signed_one_hot(y, 5)
    # Normal equations of the centred problem, solved directly.
    w = np.linalg.solve(xs.T @ xs + l2 * np.eye(12), xs.T @ (t - t.mean(0)))
    np.testing.assert_allclose(clf.kernel, w, rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(clf.bias, t.mean(0))
  # Targets: +1 for the class, -1 elsewhere.
  np.testing.assert_array_equal(
    fewshot.signed_one_hot(np.array([2, 0]), 3), [[-1, -1, 1], [1, -1, -1]]
  )


def test_sample_shots_counts_nesting_and_seeds():
  labels = np.repeat(np.arange(4), 30)[np.random.default_rng(0).permutation(120)]
  five = fewshot.sample_shots(labels, 4, 5, seed=3)
  ten = fewshot.sample_shots(labels, 4, 10, seed=3)
  np.testing.assert_array_equal(np.bincount(labels[ten], minlength=4), [10] * 4)
  assert len(set(ten)) == 40
  assert set(five) <= set(ten)  # nested within a seed
  assert set(fewshot.sample_shots(labels, 4, 10, seed=4)) != set(ten)
  with pytest.raises(ValueError, match='class 1 has 29 training examples, fewer than 30 shots'):
    fewshot.sample_shots(np.repeat([0, 1, 2, 3], [30, 29, 30, 30]), 4, 30, seed=0)


def test_fewshot_accuracy_per_seed_and_mean():
  train_x, train_y = clustered(5, 40, 24, seed=0)
  test_x, test_y = clustered(5, 20, 24, seed=0)  # same centres
  test_x, test_y = test_x[::2], test_y[::2]
  results = fewshot.fewshot_accuracy(
    train_x, train_y, test_x, test_y, num_classes=5, shots=(1, 10), seeds=(0, 1, 2)
  )
  assert sorted(results) == [1, 10]
  for shots, result in results.items():
    expected = []
    for seed in (0, 1, 2):
      idx = fewshot.sample_shots(train_y, 5, shots, seed)
      pred, _ = sklearn_predictions(train_x[idx], train_y[idx], test_x, fewshot.DEFAULT_L2_REG)
      expected.append(np.mean(pred == test_y))
    np.testing.assert_allclose(result['per_seed'], expected)
    assert result['mean'] == pytest.approx(np.mean(expected))
  assert results[10]['mean'] > 0.9  # well-separated blobs

  scalars = fewshot.summary_scalars(results, 'blobs')
  assert scalars['blobs_10shot'] == results[10]['mean']
  assert scalars['blobs_1shot-seed2'] == results[1]['per_seed'][2]
  assert len(scalars) == 2 * (1 + 3)


def test_select_l2_reg_scores_on_held_out_training_examples():
  x, y = clustered(4, 30, 64, seed=5, spread=1.0)
  best, scores = fewshot.select_l2_reg(x, y, num_classes=4, shots=2, l2_grid=[1e-3, 1.0, 1e3])
  idx = fewshot.sample_shots(y, 4, 2, seed=0)
  rest = np.setdiff1d(np.arange(len(y)), idx)
  for l2, score in scores.items():
    pred, _ = sklearn_predictions(x[idx], y[idx], x[rest], l2)
    assert score == pytest.approx(np.mean(pred == y[rest]))
  assert scores[best] == max(scores.values())


def test_bad_labels_are_one_line_errors():
  x, y = clustered(3, 2, 4, seed=0)
  with pytest.raises(ValueError, match=r'class ids span \[0, 2\] but num_classes=2'):
    fewshot.fit(x, y, 2)
  with pytest.raises(ValueError, match='not one-hot'):
    fewshot.fit(x, np.eye(3)[y], 3)
  with pytest.raises(ValueError, match='must be > 0'):
    fewshot.fit_path(x, y, 3, [0.0])


@pytest.mark.parametrize('representation_size', [None, 8])
def test_extract_features_are_what_the_head_reads(representation_size):
  config = architectures.MODEL_CONFIGS['testing']
  config.representation_size = representation_size
  model = models.VisionTransformer(num_classes=6, **config)
  images = jax.random.uniform(jax.random.key(1), (5, 32, 32, 3), minval=-1, maxval=1)
  shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), images, train=False))['params']
  rng = np.random.default_rng(0)
  params = jax.tree.map(lambda s: rng.normal(0, 0.3, s.shape).astype(np.float32), shapes)
  batches = [
    {'image': images[:3], 'label': np.array([0, 1, 2]), 'mask': np.array([1, 0, 1])},
    {'image': images[3:], 'label': np.eye(6)[[4, 5]]},
  ]  # one-hot labels too
  features, labels = fewshot.extract_features(model, params, batches)
  np.testing.assert_array_equal(labels, [0, 2, 4, 5])
  assert features.shape == (4, representation_size or 10)
  logits = model.apply({'params': params}, images, train=False)
  np.testing.assert_allclose(
    features @ params['head']['kernel'] + params['head']['bias'],
    np.asarray(logits)[[0, 2, 3, 4]],
    rtol=1e-5,
    atol=1e-5,
  )


# ---------------------------------------------------------------------------
# Metric names of folder datasets.


def test_few_shot_keys_name_a_folder_by_its_last_part(tmp_path, digit_folder, user_files, capsys):
  """Few-shot metric keys name a folder dataset by its last part, not its absolute path."""
  from vit_jax import fewshot

  argv = [f'--checkpoint={user_files["npz"]}', '--model=testing', f'--datasets={digit_folder}/']
  code, out, err = run_command(fewshot.main, argv + ['--shots=1', '--seeds=0', '--crop=32'], capsys)
  assert code == 0, err
  assert out.startswith(f'fewshot/{os.path.basename(digit_folder)}_1shot '), out
  from vit_jax.evaluation.fewshot import metric_name

  assert metric_name('/a/odd', ['/a/odd', '/b/odd/']) == 'a/odd'
  assert metric_name('cifar10', ['cifar10', '/x/cifar10']) == 'cifar10'
