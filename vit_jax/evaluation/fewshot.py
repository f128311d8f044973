"""Few-shot linear evaluation (paper 4.1) of frozen pre-logits features.

Paper 4.1: "few-shot accuracies are obtained by solving a regularized
least-squares regression problem that maps the (frozen) representation of a
subset of training images to {-1, 1}^K target vectors". The closed form here:

- Features are standardised per dimension with the mean and standard
  deviation of the few-shot training examples (as big_vision does), so one
  regularisation strength suits models of any width and scale.
- Each class has an unregularised bias. After standardisation the training
  features have zero mean, so the bias is the mean target and the weights
  solve (X^T X + l2 I) W = X^T Y. This is exactly scikit-learn's
  `RidgeClassifier(alpha=l2_reg, fit_intercept=True)` on the standardised
  features (tests/test_fewshot.py checks the predictions agree).
- `DEFAULT_L2_REG = 2**10`, the fixed strength of big_vision's standard
  few-shot config; `select_l2_reg` picks one from a grid on held-out training
  examples instead (never on the test split).

Everything runs in float64 numpy on the host: the systems are at most
(width x width) and keep the accelerators free. The functions take arrays, so
the data pipeline only has to supply an iterable of batches for
`extract_features`; `summary_scalars` names results for TensorBoard and
`summary.json`.
"""

import os
from typing import Iterable, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from vit_jax.configs.data import data_config
from vit_jax.core import files
from vit_jax.core import hardware
from vit_jax.core.errors import UserError
from vit_jax.data import on_device
from vit_jax.models import vit

DEFAULT_SHOTS = (1, 5, 10, 25)
DEFAULT_SEEDS = (0, 1, 2)
DEFAULT_L2_REG = 2.0**10
DEFAULT_L2_GRID = tuple(2.0**i for i in range(-10, 21, 2))


class FewShotError(UserError, ValueError):
  """Labels, shots or a split that the probes cannot use; one line saying what to change."""


_STD_EPS = 1e-5  # keeps constant feature dimensions finite (they get zero weight)


class LinearClassifier(NamedTuple):
  """Scores = ((x - mean) / std) @ kernel + bias; the prediction is the argmax."""

  mean: np.ndarray  # [D]
  std: np.ndarray  # [D]
  kernel: np.ndarray  # [D, K]
  bias: np.ndarray  # [K]


def standardize(features: np.ndarray, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
  return (np.asarray(features, np.float64) - mean) / std


def signed_one_hot(labels: np.ndarray, num_classes: int) -> np.ndarray:
  """Paper 4.1 targets: +1 for the true class, -1 for every other class."""
  return np.where(np.arange(num_classes) == np.asarray(labels)[:, None], 1.0, -1.0)


def _check_labels(labels: np.ndarray, num_classes: int, what: str) -> np.ndarray:
  labels = np.asarray(labels)
  if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
    raise FewShotError(
      f'{what}: expected a 1-D integer array of class ids, got '
      f'{labels.dtype} with shape {labels.shape}; pass integer labels, not one-hot'
    )
  if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
    raise FewShotError(
      f'{what}: class ids span [{labels.min()}, {labels.max()}] but '
      f"num_classes={num_classes}; pass the dataset's number of classes"
    )
  return labels


def fit_path(
  features: np.ndarray, labels: np.ndarray, num_classes: int, l2_regs: Sequence[float]
) -> list:
  """Ridge classifiers for several regularisation strengths from one eigendecomposition.

  Args:
    features: [N, D] training features.
    labels: [N] integer class ids in [0, num_classes).
    num_classes: K.
    l2_regs: strengths (> 0), the `alpha` of scikit-learn's ridge.

  Returns:
    One `LinearClassifier` per entry of `l2_regs`.
  """
  features = np.asarray(features, np.float64)
  labels = _check_labels(labels, num_classes, 'fit labels')
  if features.ndim != 2 or len(features) != len(labels) or not len(labels):
    raise FewShotError(
      f'fit: features {features.shape} and labels {labels.shape} must be [N, D] and [N] with N > 0'
    )
  if any(l2 <= 0 for l2 in l2_regs):
    raise FewShotError(f'l2_regs={list(l2_regs)}: every strength must be > 0')
  mean = features.mean(axis=0)
  std = features.std(axis=0) + _STD_EPS
  x = standardize(features, mean, std)  # columns have zero mean
  y = signed_one_hot(labels, num_classes)
  bias = y.mean(axis=0)
  y = y - bias
  num_points, dim = x.shape
  # One eigendecomposition serves every l2. With fewer points than
  # dimensions the N x N Gram matrix is smaller:
  # (X^T X + l2 I)^-1 X^T = X^T (X X^T + l2 I)^-1.
  if num_points >= dim:
    eigs, q = np.linalg.eigh(x.T @ x)
    left, right = q, q.T @ (x.T @ y)
  else:
    eigs, q = np.linalg.eigh(x @ x.T)
    left, right = x.T @ q, q.T @ y
  eigs = np.maximum(eigs, 0.0)  # round-off can make zero eigenvalues slightly negative
  return [LinearClassifier(mean, std, (left / (eigs + l2)) @ right, bias) for l2 in l2_regs]


def fit(
  features: np.ndarray, labels: np.ndarray, num_classes: int, l2_reg: float = DEFAULT_L2_REG
) -> LinearClassifier:
  """The regularised least-squares classifier of paper 4.1 (see the module docstring)."""
  return fit_path(features, labels, num_classes, [l2_reg])[0]


def predict(classifier: LinearClassifier, features: np.ndarray) -> np.ndarray:
  """[N] predicted class ids."""
  # Standardisation folded into the weights: no standardised copy of a large test set.
  kernel = classifier.kernel / classifier.std[:, None]
  bias = classifier.bias - (classifier.mean / classifier.std) @ classifier.kernel
  return np.argmax(np.asarray(features, np.float64) @ kernel + bias, axis=1)


def sample_shots(labels: np.ndarray, num_classes: int, shots: int, seed: int) -> np.ndarray:
  """Indices of `shots` training examples per class, drawn with `seed`.

  For one seed the draws are nested: the 5-shot set contains the 1-shot set,
  so accuracies across shot counts differ only by the added examples.
  """
  labels = _check_labels(labels, num_classes, 'train labels')
  rng = np.random.default_rng(seed)
  picked = []
  for c in range(num_classes):
    members = np.flatnonzero(labels == c)
    if len(members) < shots:
      raise FewShotError(
        f'class {c} has {len(members)} training examples, fewer than '
        f'{shots} shots; use fewer shots or a larger training split'
      )
    picked.append(rng.permutation(members)[:shots])
  return np.concatenate(picked)


def fewshot_accuracy(
  train_features: np.ndarray,
  train_labels: np.ndarray,
  test_features: np.ndarray,
  test_labels: np.ndarray,
  *,
  num_classes: int,
  shots: Sequence[int] = DEFAULT_SHOTS,
  seeds: Sequence[int] = DEFAULT_SEEDS,
  l2_reg: float = DEFAULT_L2_REG,
) -> dict:
  """Few-shot linear accuracy on the test set, per shot count and seed.

  Args:
    train_features, train_labels: the pool the shots are drawn from, [N, D], [N].
    test_features, test_labels: the evaluation set, [M, D], [M].
    num_classes: K.
    shots: examples per class.
    seeds: one draw of the training examples per seed.
    l2_reg: ridge strength on standardised features.

  Returns:
    {shots: {'mean': float, 'per_seed': [float, ...]}}, accuracies in [0, 1].
  """
  test_labels = _check_labels(test_labels, num_classes, 'test labels')
  test_features = np.asarray(test_features, np.float64)
  train_features = np.asarray(train_features)
  results = {}
  for n in shots:
    accuracies = []
    for seed in seeds:
      idx = sample_shots(train_labels, num_classes, n, seed)
      classifier = fit(train_features[idx], np.asarray(train_labels)[idx], num_classes, l2_reg)
      accuracies.append(float(np.mean(predict(classifier, test_features) == test_labels)))
    results[n] = {'mean': float(np.mean(accuracies)), 'per_seed': accuracies}
  return results


def select_l2_reg(
  train_features: np.ndarray,
  train_labels: np.ndarray,
  *,
  num_classes: int,
  shots: int,
  l2_grid: Sequence[float] = DEFAULT_L2_GRID,
  seed: int = 0,
) -> tuple:
  """Picks the ridge strength on training examples held out from the few-shot draw.

  Fits on `shots` examples per class (drawn with `seed`) and scores every
  strength of `l2_grid` on the remaining training examples.

  Returns:
    (best l2, {l2: held-out accuracy}); ties go to the stronger regularisation.
  """
  train_labels = _check_labels(train_labels, num_classes, 'train labels')
  train_features = np.asarray(train_features)
  idx = sample_shots(train_labels, num_classes, shots, seed)
  held_out = np.ones(len(train_labels), bool)
  held_out[idx] = False
  if not held_out.any():
    raise FewShotError(
      f'{shots} shots use every training example; nothing is left to '
      'select l2 on: use fewer shots or a larger training split'
    )
  classifiers = fit_path(train_features[idx], train_labels[idx], num_classes, l2_grid)
  scores = {
    float(l2): float(np.mean(predict(c, train_features[held_out]) == train_labels[held_out]))
    for l2, c in zip(l2_grid, classifiers)
  }
  best = max(sorted(scores, reverse=True), key=lambda l2: scores[l2])
  return best, scores


def summary_scalars(results: Mapping[int, Mapping], name: str) -> dict:
  """Flat scalar names for TensorBoard / summary.json, e.g. `cifar10_10shot`.

  Per-seed values get a `-seed{i}` suffix in the order of the seeds evaluated.
  """
  out = {}
  for shots, result in sorted(results.items()):
    out[f'{name}_{shots}shot'] = result['mean']
    for i, accuracy in enumerate(result['per_seed']):
      out[f'{name}_{shots}shot-seed{i}'] = accuracy
  return out


# ---------------------------------------------------------------------------
# Frozen representations.


# Layers beside the backbone that features do not read: the classifier's head, masked patch
# prediction's (models.mpp), self-distillation's heads (models.dino).
_NOT_FEATURES = ('head', 'mask_token', 'mpp_head', 'dino_head', 'ibot_head')


def representation_fn(model):
  """A jitted `fn(params, images) -> [B, D]` of the features the head would read.

  That is the `pre_logits` output when the model has one, else the pooled
  token. Images are uint8 pixels (made [-1, 1] on the devices) or floats
  in [-1, 1]. Build it once and pass it to `extract_features` when evaluating
  repeatedly (during training), so the compiled function is reused.
  """
  feature_model = model.clone(num_classes=None)

  def fn(params, images):
    params = {k: v for k, v in params.items() if k not in _NOT_FEATURES}
    return feature_model.apply({'params': params}, on_device.normalise(images), train=False)

  return jax.jit(fn, compiler_options=hardware.compiler_options(jax.devices()))


def _host(x) -> np.ndarray:
  """A (possibly multi-process) array as a host numpy array."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(x)


def extract_features(model, params, batches: Iterable[Mapping], *, features_fn=None) -> tuple:
  """Pre-logits features of every real example in `batches`.

  Args:
    model: a `models.VisionTransformer` (any `num_classes`; the head is not
      evaluated).
    params: its parameters.
    batches: dicts with `image` [B, H, W, 3] (uint8, or floats in [-1, 1]), `label` ([B] ids or
      [B, K] one-hot/multi-hot, reduced by argmax) and optionally `mask` [B]
      (0 marks padding added to fill the last batch).
    features_fn: `representation_fn(model)`, built once by callers that
      evaluate repeatedly; built here otherwise.

  Returns:
    (features [N, D] float32, labels [N] int64) as numpy arrays, padding dropped.
  """
  features_fn = features_fn or representation_fn(model)
  # Cast once for every batch, not in every layer of every call (vit.compute_params).
  params = jax.jit(vit.compute_params, static_argnums=1)(params, jnp.dtype(model.compute.dtype))
  features, labels = [], []
  for batch in batches:
    out = _host(features_fn(params, batch['image']))
    label = _host(batch['label'])
    if label.ndim == 2:
      label = label.argmax(axis=1)
    keep = _host(batch['mask']).astype(bool) if 'mask' in batch else np.ones(len(out), bool)
    features.append(out.reshape(len(out), -1)[keep])
    labels.append(label[keep].astype(np.int64))
  if not features:
    raise FewShotError('extract_features: the batch iterable is empty; check the split')
  return np.concatenate(features), np.concatenate(labels)


# ---------------------------------------------------------------------------
# On datasets the input pipeline reads: during training and from the command line.


def probe_data(config, name: str, transform=None):
  """(data config, Preprocessing, DatasetInfo) of dataset `name` as a probe of a run reads it:
  the run's evaluation batch, TFDS folders and crop, or the weights' own `transform`."""
  from vit_jax.data import pipeline

  data = data_config()
  data.update(
    dataset=name,
    batch_eval=config.batch_eval,
    tfds_data_dir=config.tfds_data_dir,
    tfds_manual_dir=config.tfds_manual_dir,
  )
  data.pp.crop = config.pp.crop
  pp = pipeline.Preprocessing.of(data, transform)
  return data, pp, pipeline.get_info(data, pp)


def evaluate_datasets(config, model, params, sharding, *, features_fn=None, transform=None) -> dict:
  """Few-shot accuracies on every dataset of `config.fewshot.datasets`.

  Features of each dataset's train and test splits (eval preprocessing at
  `config.pp.crop`: the official resize, or `transform`, the weights' own) are extracted with
  `model`, then `fewshot_accuracy` runs.

  Args:
    config: a run config: `fewshot.*`, plus `pp.crop`, `batch_eval`,
      `tfds_data_dir`, `tfds_manual_dir` for reading the data.
    model, params: a `VisionTransformer` (any head) or MPP model parameters.
    sharding: batch sharding of the mesh (`vit_jax.core.sharding.batch_sharding`).
    features_fn: `representation_fn(model)`, to reuse its compilation.

  Returns:
    {'fewshot/<dataset>_<n>shot': mean accuracy, ...-seed<i>: per seed}.
  """
  from vit_jax.data import pipeline

  features_fn = features_fn or representation_fn(model)
  scalars = {}
  for name in config.fewshot.datasets:
    data, pp, info = probe_data(config, name, transform)
    train = extract_features(
      model,
      params,
      pipeline.make_eval_iterator(data, sharding, config.fewshot.train_split, raw=True, pp=pp),
      features_fn=features_fn,
    )
    test = extract_features(
      model,
      params,
      pipeline.make_eval_iterator(data, sharding, config.fewshot.test_split, raw=True, pp=pp),
      features_fn=features_fn,
    )
    results = fewshot_accuracy(
      *train,
      *test,
      num_classes=info.num_classes,
      shots=tuple(config.fewshot.shots),
      seeds=tuple(config.fewshot.seeds),
      l2_reg=config.fewshot.l2_reg,
    )
    scalars.update(
      summary_scalars(results, f'fewshot/{metric_name(name, config.fewshot.datasets)}')
    )
  return scalars


def metric_name(dataset: str, datasets: Sequence[str] = ()) -> str:
  """The name of a dataset in metric keys (`fewshot/<name>_5shot`): a name as it is, a folder
  or file by its last part (`/data/odd/` -> `odd`), more of its path only where two datasets
  of `datasets` share that part."""
  from vit_jax.data.readers import reader

  def short(name, parts=1):
    if not reader.names_a_path(name):
      return name
    path = os.path.normpath(os.path.expanduser(name.split('://', 1)[-1]))
    return '/'.join(path.strip('/').split('/')[-parts:])

  name, parts = short(dataset), 1
  depth = len(os.path.normpath(dataset).strip('/').split('/'))
  while parts < depth and any(short(d, parts) == name for d in datasets if d != dataset):
    parts += 1
    name = short(dataset, parts)
  return files.text(name)


def evaluate_checkpoint(loaded, datasets: Sequence[str], *, crop=None, batch=256, **fields) -> dict:
  """Few-shot accuracies of a loaded checkpoint (`evaluation.loader`) on `datasets`.

  `fields`: `shots`, `seeds`, `l2_reg`, `train_split`, `test_split` of
  `config.fewshot` (None or absent: the defaults above), `tfds_data_dir`,
  `tfds_manual_dir`. `crop` defaults to the checkpoint's resolution. The
  parameters are replicated over one mesh of every device; a family's checkpoint is read by its
  weights' own transform (`LoadedModel.preprocessing`).
  """
  import ml_collections

  from vit_jax.core import sharding

  data_dirs = {k: fields.pop(k, None) for k in ('tfds_data_dir', 'tfds_manual_dir')}
  method = {
    'shots': DEFAULT_SHOTS,
    'seeds': DEFAULT_SEEDS,
    'l2_reg': DEFAULT_L2_REG,
    'train_split': 'train',
    'test_split': 'test',
  }
  method.update({k: v for k, v in fields.items() if v is not None})
  config = ml_collections.ConfigDict(
    {
      'pp': {'crop': crop or loaded.spec.image_size},
      'batch_eval': batch,
      **data_dirs,
      'fewshot': {'datasets': tuple(datasets), **method},
    }
  )
  batch_sharding = sharding.batch_sharding(sharding.make_mesh())
  params = jax.device_put(loaded.params, sharding.replicated(batch_sharding.mesh))
  return evaluate_datasets(
    config, loaded.model, params, batch_sharding, transform=loaded.preprocessing
  )
