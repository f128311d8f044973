"""Training and evaluation batches as global `jax.Array`s: the data interface.

    info = pipeline.get_info(config)
    train_it = pipeline.make_train_iterator(config, sharding)          # infinite
    batch = next(train_it)  # {'image': f32 [B, crop, crop, 3] in [-1, 1], 'label': ...}
    state = train_it.get_state()                                              # {'step': 123, ...}
    resumed = pipeline.make_train_iterator(config, sharding, state=state)
    for batch in pipeline.make_eval_iterator(config, sharding):        # + 'mask'

Order. The example stream is epoch after epoch of the split, each epoch a
seeded permutation (`tf.random.experimental.index_shuffle`, computed per index,
no table); global step s takes the stream positions [s*B, (s+1)*B), and process
p of P reads only its share [s*B + p*b, s*B + (p+1)*b), b = B / P. Each
example's augmentation is seeded by (seed, its position). So the global batch
at step s is a pure function of (seed, s), whatever the number of processes:
the iterator's state is the step number, restoring it costs nothing however
late in training, and a run may resume on another number of hosts.

Evaluation reads every example of the split exactly once: each process pads
its part to the same number of batches and marks padding with mask = 0.
"""

import collections
import dataclasses
import functools
import math
from typing import Iterator, Optional, Sequence

import jax
import numpy as np
import tensorflow as tf

from vit_jax.configs.data import add_data_config  # noqa: F401  (public API)
from vit_jax.configs.data import data_config  # noqa: F401  (public API)
from vit_jax.data import datasets
from vit_jax.data import preprocess
from vit_jax.data import sources
from vit_jax.data.sources import DataError  # noqa: F401  (public API)

_FOREVER = 2**62


@dataclasses.dataclass(frozen=True)
class DatasetInfo:
  name: str
  num_classes: int
  num_train: int  # examples in the train split as configured (after slicing)
  num_test: int  # examples in the test split
  multi_label: bool  # True for JFT-style data (sigmoid loss, multi-hot labels)
  class_names: Optional[Sequence[str]]


def get_info(config) -> DatasetInfo:
  train, test = _open(config, 'train'), _open(config, 'test')
  return DatasetInfo(
    config.dataset,
    train.num_classes,
    train.num_examples,
    test.num_examples,
    train.multi_label,
    train.class_names,
  )


# ---------------------------------------------------------------------------
# Config -> settings.


@dataclasses.dataclass(frozen=True)
class _PP:
  crop: int
  resize: Optional[int]
  flip: bool
  inception_crop: bool
  area_min: float
  randaug_layers: int
  randaug_magnitude: float
  mixup: float


def _pp(config) -> _PP:
  pp, base = config.pp, datasets.defaults(config.dataset, config.tfds_data_dir)
  pick = lambda value, default: default if value is None else value
  area_min = float(pick(pp.area_min, base.area_min))
  if not 0 < area_min <= 1:
    raise DataError(f'pp.area_min={area_min}: use a fraction in (0, 1]')
  if pp.resize and pp.resize < pp.crop:
    raise DataError(f'pp.resize={pp.resize} < pp.crop={pp.crop}: resize to at least the crop')
  return _PP(
    int(pp.crop),
    pp.resize,
    bool(pick(pp.flip, base.flip)),
    bool(pick(pp.inception_crop, base.inception_crop)),
    area_min,
    int(pp.randaug_layers),
    float(pp.randaug_magnitude),
    float(pp.mixup),
  )


def describe_preprocessing(config) -> str:
  """The preprocessing a run uses, in one line, with where its defaults come from."""
  pp = _pp(config)
  base = datasets.defaults(config.dataset, config.tfds_data_dir)
  if pp.inception_crop:
    crop = f'inception crop (area {pp.area_min:g}-1) to {pp.crop} px'
  else:
    crop = f'resize to {pp.crop} px'
  train = [crop, 'horizontal flip' if pp.flip else 'no flip']
  if pp.randaug_layers:
    train.append(f'RandAugment {pp.randaug_layers}x{pp.randaug_magnitude:g}')
  if pp.mixup:
    train.append(f'Mixup {pp.mixup:g}')
  evaluation = (
    f'resize to {pp.resize}, centre crop {pp.crop} px' if pp.resize else f'resize to {pp.crop} px'
  )
  chosen = [
    name
    for name, value in (
      ('flip', config.pp.flip),
      ('inception_crop', config.pp.inception_crop),
      ('area_min', config.pp.area_min),
    )
    if value is not None
  ]
  source = f'dataset defaults ({base.why})' + (f', set: {", ".join(chosen)}' if chosen else '')
  return (
    f'preprocessing: train {", ".join(train)}; eval {evaluation}. From: {source}; '
    'change with --config.pp.flip, .area_min, .inception_crop (docs/data.md)'
  )


def split_expression(config, split: str) -> str:
  """'train' / 'test' -> pp.train / pp.test or the dataset's default; others as given."""
  base = datasets.defaults(config.dataset, config.tfds_data_dir)
  if split == 'train':
    return config.pp.train or base.train
  if split == 'test':
    return config.pp.test or base.test
  return split


def _open(config, split) -> sources.Source:
  if config.get('dataset') is None:
    raise DataError(
      'config.dataset is not set: pass --config.dataset=NAME_OR_DIR (a TFDS name '
      'such as imagenet2012, an image folder, or a directory of JFT-style shards)'
    )
  return datasets.open_split(
    config.dataset,
    split_expression(config, split),
    config.tfds_data_dir,
    config.tfds_manual_dir,
    config.corrupt_images,
  )


def _keys(seed: int):
  """Independent int64 keys for example order, augmentation and mixup."""
  words = np.random.SeedSequence([int(seed)]).generate_state(3, np.uint64)
  return [int(w >> np.uint64(1)) for w in words]


def process_part(n: int, process_index: int, process_count: int):
  """(start, size) of the examples [p*n//P, (p+1)*n//P) that process p reads."""
  start = n * process_index // process_count
  return start, n * (process_index + 1) // process_count - start


def _local_batch(batch: int, what: str, sharding, process_count: int) -> int:
  if batch % process_count:
    raise DataError(
      f'{what}={batch} is not divisible by the {process_count} processes; '
      f'use a multiple of {process_count}'
    )
  if sharding is not None:
    try:
      sharding.shard_shape((batch,))
    except ValueError:
      raise DataError(
        f'{what}={batch} does not split evenly over the devices of the batch '
        f'axes of mesh {dict(sharding.mesh.shape)}; use a multiple of their '
        'product'
      ) from None
  return batch // process_count


# ---------------------------------------------------------------------------
# tf.data pipelines of process-local batches.


def train_indices(step, *, global_batch, local_batch, offset, num_examples, order_key):
  """(stream positions, example indices) int64 [b] of one process's share of a step."""
  positions = step * global_batch + offset + tf.range(local_batch, dtype=tf.int64)
  epoch, within = positions // num_examples, positions % num_examples
  # The raw op: the public wrapper mis-pads batched [n, 2] seeds (TF 2.21).
  key = tf.fill([local_batch], tf.constant(order_key, tf.int64))
  seeds = tf.stack([key, epoch, tf.zeros_like(epoch)], axis=1)
  shuffled = tf.raw_ops.RandomIndexShuffle(
    index=within,
    seed=seeds,
    max_index=tf.fill([local_batch], tf.constant(num_examples - 1, tf.int64)),
    rounds=4,
  )
  return positions, shuffled


def _randaugment(image, seed, pp):
  if not pp.randaug_layers:
    return image
  from vit_jax.data import randaug

  return randaug.randaugment(image, seed, pp.randaug_layers, pp.randaug_magnitude)


def _finish(batch, source, pp, mix_key=None, *, train):
  """uint8 batch -> float images in [-1, 1]; labels, mixup, eval masks."""
  out = {'image': preprocess.to_float(batch['image']), 'label': batch['label']}
  if 'mask' in batch:
    mask = batch['mask']
    if source.mask_empty_labels:
      mask = mask * tf.cast(tf.reduce_sum(batch['label'], axis=-1) > 0, tf.float32)
    out['mask'] = mask
  if train and pp.mixup > 0:
    out = _mixup(out, batch['step'], source, pp.mixup, mix_key)
  return out


def _mixup(batch, step, source, alpha, mix_key):
  """Mixup (Zhang et al. 2018) as in AugReg: each image with its batch neighbour,
  weight max(p, 1-p), p ~ Beta(alpha, alpha) per step; labels become soft [B, K]."""
  seed = tf.stack([tf.constant(mix_key, tf.int64), step])
  g = tf.random.stateless_gamma([2], seed, alpha=alpha)
  p = g[0] / (g[0] + g[1])
  p = tf.maximum(p, 1.0 - p)
  labels = batch['label']
  if not source.multi_label:
    labels = tf.one_hot(labels, source.num_classes, dtype=tf.float32)

  def partner(x):
    # Examples 2k and 2k+1 mix with each other: pairs never straddle two
    # processes' shares, so the global batch does not depend on their number.
    pairs = tf.reshape(x, tf.concat([[-1, 2], tf.shape(x)[1:]], axis=0))
    return tf.reshape(tf.reverse(pairs, axis=[1]), tf.shape(x))

  mix = lambda x: p * x + (1.0 - p) * partner(x)
  return {**batch, 'image': mix(batch['image']), 'label': mix(labels)}


def train_dataset(
  source, pp, *, local_batch, start_step, seed, process_index=0, process_count=1
) -> tf.data.Dataset:
  """Process-local train batches from `start_step` on (float images, labels)."""
  if source.num_examples < 1:
    raise DataError(f'{source.name}: the train split is empty; check pp.train')
  if pp.mixup > 0 and local_batch % 2:
    raise DataError(f'mixup pairs examples: the per-process batch ({local_batch}) must be even')
  order_key, aug_key, mix_key = _keys(seed)
  global_batch, offset = local_batch * process_count, local_batch * process_index
  indices = functools.partial(
    train_indices,
    global_batch=global_batch,
    local_batch=local_batch,
    offset=offset,
    num_examples=source.num_examples,
    order_key=order_key,
  )
  steps = tf.data.Dataset.range(start_step, _FOREVER)
  aug = dict(crop=pp.crop, inception_crop=pp.inception_crop, area_min=pp.area_min, flip=pp.flip)

  if source.decoded:

    def make_batch(step):
      _, idx = indices(step)
      example = source.read(idx)
      seed_ = tf.stack([tf.constant(aug_key, tf.int64), step])
      images = preprocess.train_batch(
        example['image'], seed_, offset=offset, global_batch=global_batch, **aug
      )
      if pp.randaug_layers:
        seeds = tf.random.experimental.stateless_split(seed_, global_batch)[offset:][:local_batch]
        images = tf.map_fn(
          lambda a: _randaugment(a[0], a[1], pp), (images, seeds), fn_output_signature=tf.uint8
        )
      batch = {'image': images, 'label': example['label'], 'step': step}
      return _finish(batch, source, pp, mix_key, train=True)

    ds = steps.map(make_batch, num_parallel_calls=2, deterministic=True)
  else:

    def read(step):
      positions, idx = indices(step)
      return {**source.read(idx), 'position': positions, 'step': tf.fill([local_batch], step)}

    def one(example):
      parsed = source.parse(example)
      seed_ = tf.stack([tf.constant(aug_key, tf.int64), example['position']])
      aug_seed, ra_seed = tf.unstack(tf.random.experimental.stateless_split(seed_, 2))
      image = preprocess.train_image(parsed['image'], aug_seed, **aug)
      return {
        'image': _randaugment(image, ra_seed, pp),
        'label': parsed['label'],
        'step': example['step'],
      }

    def finish(batch):
      return _finish({**batch, 'step': batch['step'][0]}, source, pp, mix_key, train=True)

    ds = steps.map(read, num_parallel_calls=2, deterministic=True).unbatch()
    ds = ds.map(one, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    ds = ds.batch(local_batch, drop_remainder=True).map(finish)
  return ds.prefetch(2)


def eval_steps(n: int, local_batch: int, process_count: int) -> int:
  """Batches per evaluation pass; every process runs the same number."""
  return max(1, math.ceil(math.ceil(n / process_count) / local_batch))


@functools.lru_cache(maxsize=8)
def _cached_eval_dataset(key, source, pp, local_batch, process_index, process_count, cache_bytes):
  """Process-local eval batches; memoised so a later pass reuses the in-memory cache."""
  del key  # only part of the memo key
  n = source.num_examples
  part_start, part_size = process_part(n, process_index, process_count)
  total = eval_steps(n, local_batch, process_count) * local_batch
  positions = tf.data.Dataset.range(total)

  def select(pos):
    idx = tf.clip_by_value(part_start + tf.minimum(pos, part_size - 1), 0, n - 1)
    return idx, tf.cast(pos < part_size, tf.float32)

  if source.decoded:

    def make(pos):
      idx, mask = select(pos)
      example = source.read(idx)
      images = preprocess.eval_image(example['image'], pp.crop, pp.resize)  # batched
      return {'image': images, 'label': example['label'], 'mask': mask}

    ds = positions.batch(local_batch).map(make)
  else:

    def read(pos):
      idx, mask = select(pos)
      return {**source.read(idx), 'mask': mask}

    def one(example):
      parsed = source.parse(example)
      image = preprocess.eval_image(preprocess.decode(parsed['image']), pp.crop, pp.resize)
      return {'image': image, 'label': parsed['label'], 'mask': example['mask']}

    ds = positions.batch(local_batch).map(read, num_parallel_calls=2, deterministic=True)
    ds = ds.unbatch().map(one, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    ds = ds.batch(local_batch)
  if total * pp.crop * pp.crop * 3 <= cache_bytes:
    ds = ds.cache()
  return ds.map(lambda b: _finish(b, source, pp, train=False)).prefetch(2)


def eval_dataset(
  source, pp, *, local_batch, process_index=0, process_count=1, cache_bytes=0
) -> tf.data.Dataset:
  return _cached_eval_dataset(
    (source.name,), source, pp, local_batch, process_index, process_count, int(cache_bytes)
  )


# ---------------------------------------------------------------------------
# Host -> device.


def _to_device(batch, sharding):
  if sharding is None:
    return batch
  return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in batch.items()}


def _tf_error(source, what, error):
  for line in str(error).splitlines():
    if 'DataError: ' in line:  # raised by a reader inside tf.numpy_function
      return DataError(line.split('DataError: ', 1)[1].strip())
  first = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
  return DataError(
    f'{source.name}: {what} failed ({first}); if an image is corrupt, '
    "replace it (image folders: corrupt_images='skip' leaves out what PIL "
    'cannot decode)'
  )


class TrainIterator:
  """Infinite iterator of global train batches with a restorable position.

  `get_state()` is {'step': batches handed out so far, ...}; pass it back as
  `make_train_iterator(..., state=...)` to continue with exactly the next batch.
  """

  def __init__(self, dataset, sharding, step, prefetch, source, fingerprint):
    self._tf_it = iter(dataset)
    self._sharding = sharding
    self._step = step  # batches handed to the caller
    self._prefetch = max(0, int(prefetch))
    self._queue = collections.deque()
    self._source = source
    self._fingerprint = fingerprint

  def __iter__(self):
    return self

  def _pull(self):
    try:
      batch = next(self._tf_it)
    except tf.errors.OpError as e:
      step = self._step + len(self._queue)
      raise _tf_error(self._source, f'reading train step {step}', e) from None
    host = {k: v.numpy() if hasattr(v, 'numpy') else v for k, v in batch.items()}
    self._queue.append(_to_device(host, self._sharding))

  def __next__(self):
    while len(self._queue) <= self._prefetch:
      self._pull()
    self._step += 1
    return self._queue.popleft()

  def get_state(self) -> dict:
    return {'step': self._step, **self._fingerprint}


def make_train_iterator(config, sharding, *, state=None) -> TrainIterator:
  """Global train batches of `config.batch` (see module docstring)."""
  source = _open(config, 'train')
  pp = _pp(config)
  local_batch = _local_batch(config.batch, 'batch', sharding, jax.process_count())
  fingerprint = {
    'seed': int(config.seed),
    'batch': int(config.batch),
    'dataset': str(config.dataset),
  }
  step = 0
  if state:
    for key, value in fingerprint.items():
      if key in state and state[key] != value:
        raise DataError(
          f'iterator state has {key}={state[key]!r} but the config gives '
          f'{value!r}; restore with the same config or pass '
          f"state={{'step': {state.get('step', 0)}}} to start there anyway"
        )
    step = int(state['step'])
  dataset = train_dataset(
    source,
    pp,
    local_batch=local_batch,
    start_step=step,
    seed=int(config.seed),
    process_index=jax.process_index(),
    process_count=jax.process_count(),
  )
  return TrainIterator(dataset, sharding, step, config.prefetch, source, fingerprint)


def make_eval_iterator(config, sharding, split='test') -> Iterator[dict]:
  """One pass over `split` ('test', 'train' or a split expression), every example once."""
  source = _open(config, split)
  pp = _pp(config)
  local_batch = _local_batch(config.batch_eval, 'batch_eval', sharding, jax.process_count())
  dataset = eval_dataset(
    source,
    pp,
    local_batch=local_batch,
    process_index=jax.process_index(),
    process_count=jax.process_count(),
    cache_bytes=config.eval_cache_mb * 2**20,
  )
  return _eval_batches(dataset, sharding, source, config.prefetch)


def _eval_batches(dataset, sharding, source, prefetch):
  queue = collections.deque()
  it = iter(dataset)
  while True:
    try:
      while len(queue) <= prefetch:
        batch = next(it)
        queue.append(_to_device({k: v.numpy() for k, v in batch.items()}, sharding))
    except StopIteration:
      pass
    except tf.errors.OpError as e:
      raise _tf_error(source, 'reading an eval batch', e) from None
    if not queue:
      return
    yield queue.popleft()
