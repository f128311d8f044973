"""The input pipeline's workers: batches from a `Source` with NumPy, OpenCV, PIL and threads.

A thread pool reads, decodes and augments the images of the next steps while
the devices train (`images.py` holds what happens to one image); decoders and
OpenCV release the GIL. In-memory datasets of one image size (the digits) are
cropped and resized as whole batches.

Order and randomness. Step s reads the examples `order.train_indices` names;
each example's crop and flip come from `order.example_uniforms(key,
position)`, and its RandAugment from a second stream, so a batch is a pure
function of (seed, step) whatever the number of threads or processes.
"""

import collections
import concurrent.futures
import os
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


# ---------------------------------------------------------------------------
# One image.


# ---------------------------------------------------------------------------
# Batches of in-memory decoded images of one size (the digits): vectorised.


def _interpolation_matrix(start, length, size, out):
  """[b, out, size] weights of a bilinear resize of rows [start, start+length) to `out`."""
  start = start.astype(np.float32)[:, None]
  length = length.astype(np.float32)[:, None]
  centres = (np.arange(out, dtype=np.float32)[None] + 0.5) * length / out - 0.5
  src = start + np.clip(centres, 0.0, length - 1.0)
  lo = np.floor(src)
  frac = src - lo
  hi = np.minimum(lo + 1.0, start + length - 1.0)
  grid = np.arange(size, dtype=np.float32)
  one_hot = lambda i: (i[..., None] == grid).astype(np.float32)
  return one_hot(lo) * (1.0 - frac)[..., None] + one_hot(hi) * frac[..., None]


def train_batch(pixels, uniforms, pp) -> np.ndarray:
  """uint8 [b, H, W, 3] + uniforms [b, images.draws(pp.crop_sampler)] -> augmented uint8
  [b, crop, crop, 3]."""
  b, size_h, size_w, _ = pixels.shape
  n = images.crop_draws(pp.crop_sampler)
  if pp.inception_crop:
    y, x, h, w = images.crop_window(
      uniforms[:, :n], np.full(b, size_h), np.full(b, size_w), pp.area_min, pp.crop_sampler
    )
    rows = _interpolation_matrix(y, h, size_h, pp.crop)
    cols = _interpolation_matrix(x, w, size_w, pp.crop)
    out = np.einsum('bry,byxc->brxc', rows, pixels.astype(np.float32))
    out = np.einsum('bsx,brxc->brsc', cols, out)
    out = np.clip(np.round(out), 0, 255).astype(np.uint8)
  else:
    out = images.resize_exact(pixels, pp.crop, pp.crop)
  if pp.flip:
    mirror = uniforms[:, n] < 0.5
    out[mirror] = out[mirror, :, ::-1]
  return out


# ---------------------------------------------------------------------------
# Mixup.


def mixup(pixels, labels, step: int, key: int, alpha: float, num_classes: int, multi_label: bool):
  """Mixup (Zhang et al. 2018) as in AugReg: each image with its batch neighbour (pairs
  (2k, 2k+1) never straddle two processes' shares), weight max(p, 1-p), p ~ Beta(alpha, alpha)
  per step; labels become soft [b, K]."""
  p = np.random.default_rng([key, step]).beta(alpha, alpha)
  p = np.float32(max(p, 1.0 - p))
  if not multi_label:
    labels = np.eye(num_classes, dtype=np.float32)[labels]

  def mix(x):
    partner = x.reshape(-1, 2, *x.shape[1:])[:, ::-1].reshape(x.shape)
    return p * x + (np.float32(1.0) - p) * partner

  return mix(pixels), mix(labels)


# ---------------------------------------------------------------------------
# Train and eval batches.


def _read(source, index, item) -> bytes:
  """An item of `source.fetch`: record bytes as they are, a path read from disk or gs://."""
  if isinstance(item, bytes):
    return item
  from vit_jax import files

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


def _chunks(n: int):
  """Row ranges of `_CHUNK` images (one thread-pool job each) covering a batch of n."""
  return np.array_split(np.arange(n), -(-n // _CHUNK))


def _collect(jobs, out):
  """(images, labels) of a submitted batch: one vectorised job's, or `out` filled by the
  chunk jobs, which return their labels."""
  if out is None:
    return jobs[0].result()
  return out, np.concatenate([job.result() for job in jobs])


class TrainBatches:
  """Process-local host batches {'image': f32, 'label'} of steps start, start+1, ...

  A thread pool prepares the next `ahead` steps while the caller trains; a
  job reads, decodes and augments `_CHUNK` images of a batch (records are
  fetched by the job too), writing them into the batch's float array.
  """

  def __init__(self, source, pp, *, local_batch, start_step, keys, process_index=0,
               process_count=1, num_threads=0, ahead=2):  # fmt: skip
    self._source, self._pp, self._b = source, pp, local_batch
    self._order_key, self._aug_key, self._mix_key = keys  # order.keys(seed)
    self._global = local_batch * process_count
    self._offset = local_batch * process_index
    self._next_step = start_step
    self._pool = concurrent.futures.ThreadPoolExecutor(threads(num_threads))
    # An iterator dropped mid-stream stops its workers.
    weakref.finalize(self, self._pool.shutdown, wait=False, cancel_futures=True)
    self._ahead = max(1, ahead)
    self._queue = collections.deque()

  def __iter__(self):
    return self

  def _submit(self, step):
    positions, idx = order.train_indices(
      step,
      global_batch=self._global,
      local_batch=self._b,
      offset=self._offset,
      num_examples=self._source.num_examples,
      order_key=self._order_key,
    )
    pp = self._pp
    uniforms = order.example_uniforms(self._aug_key, positions, images.draws(pp.crop_sampler))
    ra_uniforms = None
    if pp.randaug_layers:  # RandAugment's own draws: 4 per layer
      n = randaug.DRAWS_PER_LAYER * pp.randaug_layers
      ra_uniforms = order.example_uniforms(self._aug_key ^ _RANDAUG_KEY, positions, n)
    if self._source.decoded:  # in memory: one vectorised job for the batch
      return step, [self._pool.submit(self._decoded_batch, idx, uniforms, ra_uniforms)], None
    out = batch_buffer((self._b, pp.crop, pp.crop, 3), np.float32)
    jobs = [
      self._pool.submit(self._images, idx[r], uniforms[r], ra_uniforms, r, out)
      for r in _chunks(self._b)
    ]
    return step, jobs, out

  def _images(self, idx, uniforms, ra_uniforms, rows, out):
    """Images `rows` of the batch into `out`; returns their labels."""
    pp = self._pp
    items, labels = self._source.fetch(idx)
    for k, i in enumerate(rows):
      image = _decoded(
        self._source, idx[k], items[k], lambda d: images.train_image(d, uniforms[k], pp)
      )
      if ra_uniforms is not None:
        image = randaug.randaugment(image, ra_uniforms[i], pp.randaug_layers, pp.randaug_magnitude)
      images.to_float(image, out[i])
    return labels

  def _decoded_batch(self, idx, uniforms, ra_uniforms):
    pp = self._pp
    pixels, labels = self._source.fetch(idx)
    pixels = train_batch(pixels, uniforms, pp)
    if ra_uniforms is not None:
      pixels = np.stack(
        [
          randaug.randaugment(a, u, pp.randaug_layers, pp.randaug_magnitude)
          for a, u in zip(pixels, ra_uniforms)
        ]
      )
    return images.to_float(pixels), labels

  def __next__(self):
    while len(self._queue) < self._ahead:
      self._queue.append(self._submit(self._next_step))
      self._next_step += 1
    step, jobs, out = self._queue.popleft()
    pixels, labels = _collect(jobs, out)
    if self._pp.mixup > 0:
      pixels, labels = mixup(
        pixels,
        labels,
        step,
        self._mix_key,
        self._pp.mixup,
        self._source.num_classes,
        self._source.multi_label,
      )
    return {'image': pixels, 'label': labels}


def eval_batches(source, pp, *, positions_fn, num_threads=0, ahead=2):
  """Host eval batches (uint8 images, labels, mask) at the (indices, mask) of `positions_fn()`.

  The next `ahead` batches are read and decoded while the caller evaluates one.
  """
  pool = concurrent.futures.ThreadPoolExecutor(threads(num_threads))

  def decode_rows(idx, rows, out):
    items, labels = source.fetch(idx)
    for k, i in enumerate(rows):
      out[i] = _decoded(
        source, idx[k], items[k], lambda d: images.eval_image(d, pp.crop, pp.resize)
      )
    return labels

  def decoded(idx):
    items, labels = source.fetch(idx)
    return images.eval_array(items, pp.crop, pp.resize), labels

  def submit(idx, mask):
    if source.decoded:
      return [pool.submit(decoded, idx)], None, mask
    out = batch_buffer((len(idx), pp.crop, pp.crop, 3), np.uint8)
    return [pool.submit(decode_rows, idx[r], r, out) for r in _chunks(len(idx))], out, mask

  def result(jobs, out, mask):
    batch, labels = _collect(jobs, out)
    return {'image': batch, 'label': labels, 'mask': mask}

  queue = collections.deque()
  try:
    for idx, mask in positions_fn():
      queue.append(submit(idx, mask))
      if len(queue) > ahead:
        yield result(*queue.popleft())
    while queue:
      yield result(*queue.popleft())
  finally:
    pool.shutdown(wait=False, cancel_futures=True)
