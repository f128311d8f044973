"""The tf.data pipeline: TFDS datasets (and any source, for comparison).

The same order as the host pipeline (`order.train_indices`), augmentation from
TensorFlow's stateless RNGs. `pipeline.make_train_iterator` picks this path for sources the
host pipeline cannot read (TFDS); `config.input_backend='tf'` forces it.
"""

import functools

import tensorflow as tf

from vit_jax.data import order
from vit_jax.data import preprocess
from vit_jax.data.sources import DataError

_FOREVER = 2**62


def train_indices(step, *, global_batch, local_batch, offset, num_examples, order_key):
  """`order.train_indices` in a tf.data graph: both pipelines read the same examples."""

  def indices(s):
    return order.train_indices(
      int(s),
      global_batch=global_batch,
      local_batch=local_batch,
      offset=offset,
      num_examples=num_examples,
      order_key=order_key,
    )

  positions, shuffled = tf.numpy_function(indices, [step], (tf.int64, tf.int64), stateful=False)
  return tf.ensure_shape(positions, [local_batch]), tf.ensure_shape(shuffled, [local_batch])


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
  order_key, aug_key, mix_key = order.keys(seed)
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


@functools.lru_cache(maxsize=8)
def _cached_eval_dataset(key, source, pp, local_batch, process_index, process_count, cache_bytes):
  """Process-local eval batches; memoised so a later pass reuses the in-memory cache."""
  del key  # only part of the memo key
  n = source.num_examples
  part_start, part_size = order.process_part(n, process_index, process_count)
  total = order.eval_steps(n, local_batch, process_count) * local_batch
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


def numpy_batches(dataset, source, what):
  """NumPy batches of a tf.data dataset; reader failures become one-line `DataError`s."""
  it = iter(dataset)
  count = 0
  while True:
    try:
      batch = next(it)
    except StopIteration:
      return
    except tf.errors.OpError as e:
      raise _tf_error(source, f'{what} {count}', e) from None
    count += 1
    yield {k: v.numpy() for k, v in batch.items()}
