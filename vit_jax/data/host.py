"""The input pipeline's workers: batches from a `Source` with NumPy, OpenCV, PIL and threads.

A thread pool reads, decodes and augments the images of the next steps while
the devices train (`images.py` holds what happens to one image); decoders and
OpenCV release the GIL. Every kind of source goes the same way, images in
memory included: a job takes `_CHUNK` images of a batch and writes them into
the batch's uint8 array. Batches stay uint8: the [-1, 1] floats and Mixup are
made on the devices, inside the jitted step (`on_device.py`).

Order and randomness. Step s reads the examples `order.train_indices` names;
each example's crop and flip come from `order.example_uniforms(key,
position)`, and its RandAugment from a second stream, so a batch is a pure
function of (seed, step) whatever the number of threads or processes.
"""

import collections
import concurrent.futures
import itertools
import os
from typing import Iterator
import weakref

import numpy as np

from vit_jax.data import images
from vit_jax.data import order
from vit_jax.data import randaug
from vit_jax.data.sources import DataError

_CHUNK = 8  # images per thread-pool job
_RANDAUG_KEY = 0x52414E44  # RandAugment's stream: the augmentation key xor this


def threads(requested: int = 0) -> int:
  """Worker threads: `requested`, or the cores this process may use."""
  if requested and requested > 0:
    return int(requested)
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:  # not Linux
    return os.cpu_count() or 1


def mixup_weight(step: int, key: int, alpha: float) -> np.float32:
  """Mixup's weight p of `step` (AugReg: max(p, 1 - p), p ~ Beta(alpha, alpha), one per step);
  the devices mix (`on_device.mixup`)."""
  p = np.random.default_rng([key, step]).beta(alpha, alpha)
  return np.float32(max(p, 1.0 - p))


# ---------------------------------------------------------------------------
# Train and eval batches.


def _read(source, index, item) -> bytes:
  """An item of `source.fetch`: record bytes as they are, a path read from disk or gs://."""
  if isinstance(item, bytes):
    return item
  from vit_jax.core import files

  try:
    with files.open_file(item, 'rb') as f:
      return f.read()
  except OSError as e:
    raise DataError(
      f'{source.describe(int(index))}: cannot read the file ({e.strerror or e}); '
      'restore it, or re-open the dataset if it was removed on purpose'
    ) from None


def _decoded(source, index, item, fn):
  """fn(encoded bytes of `item`), with undecodable data as a one-line `DataError`."""
  data = _read(source, index, item)
  try:
    return fn(data)
  except images.BadImage as e:
    raise DataError(
      f'{source.describe(int(index))}: cannot decode the image ({e}); replace it '
      "(image folders: corrupt_images='skip' leaves out what cannot be decoded)"
    ) from None


def batch_buffer(shape, dtype) -> np.ndarray:
  """An uninitialised batch, or a one-line error when the host's memory runs out."""
  try:
    return np.empty(shape, dtype)
  except MemoryError:
    gib = np.prod(shape) * np.dtype(dtype).itemsize / 2**30
    raise DataError(
      f'out of host memory for a batch of {shape[0]} images at {shape[1]} px ({gib:.1f} GiB, '
      'a few in flight): lower --config.batch (or raise --config.accum_steps), '
      '--config.prefetch or --config.eval_cache_mb'
    ) from None


def ahead_of(started: Iterator, depth: int) -> Iterator:
  """The items of `started` in order, each drawn `depth` items before it is handed on: drawing
  an item starts its work (a thread-pool job, a transfer to the devices), so the next `depth`
  run while the caller uses this one."""
  queue = collections.deque()
  for item in started:
    queue.append(item)
    if len(queue) > depth:
      yield queue.popleft()
  while queue:
    yield queue.popleft()


def _chunks(n: int):
  """Row ranges of `_CHUNK` images (one thread-pool job each) covering a batch of n."""
  return np.array_split(np.arange(n), -(-n // _CHUNK))


class TrainBatches:
  """Process-local host batches {'image': uint8, 'label'(, 'mixup')} of steps start, start+1, ...

  A thread pool prepares the next `ahead` steps while the caller trains; a
  job reads, decodes and augments `_CHUNK` images of a batch (records are
  fetched by the job too, images in memory gathered), writing them into the
  batch's uint8 array. Under Mixup, 'mixup' holds each example's weight
  (`mixup_weight`, the same for the whole step).
  """

  def __init__(self, source, pp, *, local_batch, start_step, keys, process_index=0,
               process_count=1, num_threads=0, ahead=2):  # fmt: skip
    self._source, self._pp, self._b = source, pp, local_batch
    self._order_key, self._aug_key, self._mix_key = keys  # order.keys(seed)
    self._global = local_batch * process_count
    self._offset = local_batch * process_index
    self._pool = concurrent.futures.ThreadPoolExecutor(threads(num_threads))
    # An iterator dropped mid-stream stops its workers.
    weakref.finalize(self, self._pool.shutdown, wait=False, cancel_futures=True)
    submitted = map(self._submit, itertools.count(start_step))
    self._batches = map(self._finish, ahead_of(submitted, max(1, ahead) - 1))

  def __iter__(self):
    return self

  def _indices(self, step):
    """(positions in the epoch order, example indices) of this host's share of `step`."""
    return order.train_indices(
      step,
      global_batch=self._global,
      local_batch=self._b,
      offset=self._offset,
      num_examples=self._source.num_examples,
      order_key=self._order_key,
    )

  def _submit(self, step):
    positions, idx = self._indices(step)
    pp = self._pp
    uniforms = order.example_uniforms(self._aug_key, positions, self._draws())
    ra_uniforms = None
    if pp.randaug_layers:  # RandAugment's own draws: 4 per layer
      n = randaug.DRAWS_PER_LAYER * pp.randaug_layers
      ra_uniforms = order.example_uniforms(self._aug_key ^ _RANDAUG_KEY, positions, n)
    out = self._buffer()
    jobs = [
      self._pool.submit(self._images, idx[r], uniforms[r], ra_uniforms, r, out)
      for r in _chunks(self._b)
    ]
    return step, jobs, out

  def _draws(self) -> int:
    """Uniforms per example: the crop's and the flip's."""
    return images.DRAWS

  def _buffer(self) -> np.ndarray:
    """A step's batch of images, written by the jobs."""
    return batch_buffer((self._b, self._pp.crop, self._pp.crop, 3), np.uint8)

  def _images(self, idx, uniforms, ra_uniforms, rows, out):
    """Images `rows` of the batch into `out`; returns their labels."""
    pp, source = self._pp, self._source
    items, labels = source.fetch(idx)
    for k, i in enumerate(rows):
      if source.decoded:
        image = images.train_array(items[k], uniforms[k], pp, out[i])
      else:
        image = _decoded(
          source, idx[k], items[k], lambda d: images.train_image(d, uniforms[k], pp, out[i])
        )
      if ra_uniforms is not None:
        out[i] = randaug.randaugment(image, ra_uniforms[i], pp.randaug_layers, pp.randaug_magnitude)
    return labels

  def __next__(self):
    return next(self._batches)

  def _finish(self, submitted):
    step, jobs, out = submitted
    batch = {'image': out, 'label': np.concatenate([job.result() for job in jobs])}
    if self._pp.mixup > 0:
      weight = mixup_weight(step, self._mix_key, self._pp.mixup)
      batch['mixup'] = np.full(self._b, weight, np.float32)
    return batch


def eval_batches(source, pp, *, positions_fn, num_threads=0, ahead=2):
  """Host eval batches (uint8 images, labels, mask) at the (indices, mask) of `positions_fn()`:
  the official resize, or timm's transform of the weights (`pp.transform`, at `pp.crop` px).

  The next `ahead` batches are read and decoded while the caller evaluates one,
  `_CHUNK` images a job (images in memory: each chunk resized as one array).
  """
  pool = concurrent.futures.ThreadPoolExecutor(threads(num_threads))

  transform = pp.transform  # the weights' own (timm's), else the official resize
  if transform is not None:
    from_array = lambda items: images.timm_eval_array(items, transform)
    from_bytes = lambda data: images.timm_eval_image(data, transform)
  else:
    from_array = lambda items: images.eval_array(items, pp.crop, pp.resize)
    from_bytes = lambda data: images.eval_image(data, pp.crop, pp.resize)

  def decode_rows(idx, rows, out):
    items, labels = source.fetch(idx)
    if source.decoded:
      out[rows[0] : rows[-1] + 1] = from_array(items)
      return labels
    for k, i in enumerate(rows):
      out[i] = _decoded(source, idx[k], items[k], from_bytes)
    return labels

  def submit(idx, mask):
    out = batch_buffer((len(idx), pp.crop, pp.crop, 3), np.uint8)
    return [pool.submit(decode_rows, idx[r], r, out) for r in _chunks(len(idx))], out, mask

  def result(jobs, out, mask):
    labels = np.concatenate([job.result() for job in jobs])
    return {'image': out, 'label': labels, 'mask': mask}

  try:
    for submitted in ahead_of((submit(idx, mask) for idx, mask in positions_fn()), ahead):
      yield result(*submitted)
  finally:
    pool.shutdown(wait=False, cancel_futures=True)
