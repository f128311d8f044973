"""k-NN classification of frozen features, as DINO evaluates self-supervised backbones.

Caron et al. 2021 (and DINOv2's `eval/knn.py`): features are L2-normalised; each test image's
k most cosine-similar training images vote for their class with weight exp(cosine / T),
normalised over the k (a softmax); the class of the largest vote wins. DINO's defaults:
k = 20, T = 0.07. No training, no hyperparameter search: a cheap read of what the features
separate, beside the few-shot linear probes (`evaluation.fewshot`).

The neighbour search runs in float32 NumPy on the host, the test set in chunks of 1,024 images
against the whole training set: the similarity matrix of a chunk is 1,024 x N floats.
"""

from typing import Sequence

import numpy as np

from vit_jax.core.errors import UserError
from vit_jax.evaluation import fewshot

DEFAULT_K = 20
DEFAULT_TEMPERATURE = 0.07
_CHUNK = 1024


class KnnError(UserError, ValueError):
  """Labels or a neighbour count that k-NN cannot use; one line saying what to change."""


def _normalised(x) -> np.ndarray:
  x = np.asarray(x, np.float32)
  return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def class_scores(
  train_features,
  train_labels,
  test_features,
  *,
  num_classes: int,
  k: int = DEFAULT_K,
  temperature: float = DEFAULT_TEMPERATURE,
) -> np.ndarray:
  """[M, K] each test image's votes per class: softmax over its k nearest training images
  (cosine) of cosine / temperature, summed by their class."""
  train_labels = np.asarray(train_labels)
  if not 1 <= k <= len(train_labels):
    raise KnnError(
      f'k={k} neighbours from {len(train_labels)} training images: use 1 <= k <= their number'
    )
  if train_labels.size and (train_labels.min() < 0 or train_labels.max() >= num_classes):
    raise KnnError(
      f'training labels span [{train_labels.min()}, {train_labels.max()}] but num_classes='
      f'{num_classes}; pass the dataset with its labels'
    )
  train = _normalised(train_features)
  test = _normalised(test_features)
  scores = np.zeros((len(test), num_classes), np.float32)
  for start in range(0, len(test), _CHUNK):
    sims = test[start : start + _CHUNK] @ train.T
    top = np.argpartition(-sims, k - 1, axis=1)[:, :k]
    top_sims = np.take_along_axis(sims, top, axis=1)
    weights = np.exp((top_sims - top_sims.max(axis=1, keepdims=True)) / temperature)
    weights /= weights.sum(axis=1, keepdims=True)
    rows = np.arange(len(top))[:, None]
    np.add.at(scores[start : start + _CHUNK], (rows, train_labels[top]), weights)
  return scores


def knn_accuracy(train_features, train_labels, test_features, test_labels, **method) -> float:
  """Top-1 accuracy of `class_scores` (`method`: num_classes, k, temperature)."""
  scores = class_scores(train_features, train_labels, test_features, **method)
  return float(np.mean(np.argmax(scores, axis=1) == np.asarray(test_labels)))


def dataset_accuracy(
  config, name: str, model, params, sharding, *, features_fn=None, transform=None
) -> tuple:
  """(k-NN accuracy, test images) on dataset `name`: features of its `knn.train_split` and
  `knn.test_split` (evaluation preprocessing at `config.pp.crop`, or the weights' own
  `transform`) by `model` (a ViT without a head: its class token), then `knn_accuracy` with
  `knn.k` and `knn.temperature`."""
  from vit_jax.data import pipeline

  features_fn = features_fn or fewshot.representation_fn(model)
  data, pp, info = fewshot.probe_data(config, name, transform)
  splits = []
  for split in (config.knn.train_split, config.knn.test_split):
    batches = pipeline.make_eval_iterator(data, sharding, split=split, raw=True, pp=pp)
    splits += fewshot.extract_features(model, params, batches, features_fn=features_fn)
  accuracy = knn_accuracy(
    *splits[:3],
    splits[3],
    num_classes=info.num_classes,
    k=config.knn.k,
    temperature=config.knn.temperature,
  )
  return accuracy, len(splits[3])


def evaluate_datasets(config, model, params, sharding, *, features_fn=None, transform=None) -> dict:
  """k-NN accuracies on every dataset of `config.knn.datasets`: {'knn/<name>': accuracy}
  (`dataset_accuracy`)."""
  features_fn = features_fn or fewshot.representation_fn(model)
  scalars = {}
  for name in config.knn.datasets:
    accuracy, _ = dataset_accuracy(
      config, name, model, params, sharding, features_fn=features_fn, transform=transform
    )
    scalars[f'knn/{fewshot.metric_name(name, config.knn.datasets)}'] = accuracy
  return scalars


def evaluate_checkpoint(
  loaded,
  datasets: Sequence[str],
  *,
  k: int = DEFAULT_K,
  temperature: float = DEFAULT_TEMPERATURE,
  train_split: str = 'train',
  test_split: str = 'test',
  crop=None,
  batch: int = 256,
  tfds_data_dir=None,
  tfds_manual_dir=None,
) -> dict:
  """k-NN accuracies of a loaded checkpoint (`evaluation.loader`) on `datasets`; the
  parameters replicated over one mesh of every device; a family's checkpoint read by its
  weights' own transform (`LoadedModel.preprocessing`), as the few-shot probes read it."""
  import jax
  import ml_collections

  from vit_jax.core import sharding

  config = ml_collections.ConfigDict(
    {
      'pp': {'crop': crop or loaded.spec.image_size},
      'batch_eval': batch,
      'tfds_data_dir': tfds_data_dir,
      'tfds_manual_dir': tfds_manual_dir,
      'knn': {
        'datasets': tuple(datasets),
        'k': k,
        'temperature': temperature,
        'train_split': train_split,
        'test_split': test_split,
      },
    }
  )
  batch_sharding = sharding.batch_sharding(sharding.make_mesh())
  params = jax.device_put(loaded.params, sharding.replicated(batch_sharding.mesh))
  return evaluate_datasets(
    config, loaded.model, params, batch_sharding, transform=loaded.preprocessing
  )


def record(workdir: str, scalars: dict, *, k: int, temperature: float) -> str:
  """`scalars` of `evaluate_checkpoint` into `workdir`'s knn.json under names that say the
  method (`knn/digits` -> `knn/digits_k20_t0.07`); its path."""
  from vit_jax import workdir as workdir_lib

  named = {f'{name}_k{k}_t{temperature:g}': value for name, value in scalars.items()}
  return workdir_lib.add_knn(workdir, named)
