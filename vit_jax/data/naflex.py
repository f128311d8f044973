"""NaFlex training batches on the host: each image at its own aspect ratio, up to a budget.

Every training image is cropped as the classic pipeline crops it (the
inception crop keeps its box's aspect ratio here instead of squashing it to a
square), flipped, given a token budget drawn from `tokens`, resized so that
its patch grid (h, w) has the box's aspect ratio and h * w fits the budget,
and cut into patches. A batch is fixed-shape whatever the images: float32
[B, N, P*P*3 + 3] packed as `vit_jax.models.naflex` reads it (each row a patch's
pixels, then its grid row, grid column and 1 for a real patch), N = max(tokens),
each image's real patches first in row order, then padding. Mixed budgets in
one batch train one model at mixed resolutions.

Order and randomness as `host.TrainBatches`: a batch is a pure function of
(seed, step); each example's crop, flip and budget come from its own uniforms.
"""

import collections
import concurrent.futures
import math
import weakref

import numpy as np

from vit_jax.data import host
from vit_jax.data import images
from vit_jax.data import order


def grid_for(height: int, width: int, budget: int):
  """(rows, columns) of patches for a height x width image: the aspect ratio kept (each
  side rounded down), rows * columns <= budget, at least one patch each way."""
  scale = math.sqrt(budget / (height * width))
  rows = max(1, min(budget, math.floor(height * scale)))
  cols = max(1, min(budget // rows, math.floor(width * scale)))
  return rows, cols


def pack_image(image: np.ndarray, patch: int, budget: int, length: int) -> np.ndarray:
  """uint8 [h, w, 3] -> float32 [length, P*P*3 + 3]: resized to `grid_for(h, w, budget)`
  patches (bilinear as tf.image.resize), pixels in [-1, 1], padded to `length` rows."""
  rows, cols = grid_for(image.shape[0], image.shape[1], budget)
  pixels = images.to_float(images.resize_exact(image, rows * patch, cols * patch))
  cut = pixels.reshape(rows, patch, cols, patch, 3).swapaxes(1, 2).reshape(rows * cols, -1)
  out = np.zeros((length, cut.shape[1] + 3), np.float32)
  out[: rows * cols, :-3] = cut
  out[: rows * cols, -3], out[: rows * cols, -2] = np.divmod(np.arange(rows * cols), cols)
  out[: rows * cols, -1] = 1.0
  return out


def _augment(image, uniforms, pp, tokens):
  """An image's crop (its own aspect ratio), flip and token budget from its uniforms."""
  n = images.crop_draws(pp.crop_sampler)
  if pp.inception_crop:
    y, x, h, w = images.crop_window_one(uniforms, *image.shape[:2], pp.area_min, pp.crop_sampler)
    image = image[y : y + h, x : x + w]
  if pp.flip and uniforms[n] < 0.5:
    image = image[:, ::-1]
  return image, tokens[min(int(uniforms[n + 1] * len(tokens)), len(tokens) - 1)]


class TrainBatches:
  """Process-local packed NaFlex batches {'image': f32 [b, N, P*P*3 + 3], 'label'} of steps
  start, start + 1, ...; the next `ahead` steps are prepared by a thread pool."""

  def __init__(self, source, pp, tokens, patch, *, local_batch, start_step, keys,
               process_index=0, process_count=1, num_threads=0, ahead=2):  # fmt: skip
    self._source, self._pp, self._b = source, pp, local_batch
    self._tokens, self._patch = tuple(int(t) for t in tokens), int(patch)
    self._order_key, self._aug_key, _ = keys
    self._global, self._offset = local_batch * process_count, local_batch * process_index
    self._next_step = start_step
    self._pool = concurrent.futures.ThreadPoolExecutor(host.threads(num_threads))
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
    # The crop's and flip's draws, then the budget's.
    uniforms = order.example_uniforms(
      self._aug_key, positions, images.draws(self._pp.crop_sampler) + 1
    )
    out = host.batch_buffer((self._b, max(self._tokens), self._patch**2 * 3 + 3), np.float32)
    jobs = [
      self._pool.submit(self._images, idx[r], uniforms[r], r, out) for r in host._chunks(self._b)
    ]
    return jobs, out

  def _images(self, idx, uniforms, rows, out):
    items, labels = self._source.fetch(idx)
    for k, i in enumerate(rows):
      if self._source.decoded:
        image = items[k]
      else:
        image = host._decoded(self._source, idx[k], items[k], images.decode)
      image, budget = _augment(image, uniforms[k], self._pp, self._tokens)
      out[i] = pack_image(np.ascontiguousarray(image), self._patch, budget, out.shape[1])
    return labels

  def __next__(self):
    while len(self._queue) < self._ahead:
      self._queue.append(self._submit(self._next_step))
      self._next_step += 1
    jobs, out = self._queue.popleft()
    return {'image': out, 'label': np.concatenate([job.result() for job in jobs])}
