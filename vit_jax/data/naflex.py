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

from fractions import Fraction
import math

import numpy as np

from vit_jax.data import host
from vit_jax.data import images


def grid_for(height: int, width: int, budget: int):
  """(rows, columns) of patches for a height x width image, as timm's NaFlex pipeline picks
  them (`get_image_size_for_seq`): the image scaled by the largest s for which
  ceil(height * s) * ceil(width * s) <= budget, each side rounded up to whole patches.

  The count only grows with s, and steps up just past s = k / height or k / width, so the
  largest s is one of those; exact fractions find it (timm searches it to 1e-5).
  """
  best = Fraction(1, max(height, width))  # one patch each way: 1 <= budget
  for side in (height, width):
    lo, hi = 1, budget  # ceil(side * k / side) = k rows (or columns): at most the budget
    while lo <= hi:  # the largest k with k / side within the budget
      mid = (lo + hi) // 2
      s = Fraction(mid, side)
      if math.ceil(height * s) * math.ceil(width * s) <= budget:
        best, lo = max(best, s), mid + 1
      else:
        hi = mid - 1
  return math.ceil(height * best), math.ceil(width * best)


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
  n = images.CROP_DRAWS
  if pp.inception_crop:
    y, x, h, w = images.crop_window(uniforms, *image.shape[:2], pp.area_min)
    image = image[y : y + h, x : x + w]
  if pp.flip and uniforms[n] < 0.5:
    image = image[:, ::-1]
  return image, tokens[min(int(uniforms[n + 1] * len(tokens)), len(tokens) - 1)]


class TrainBatches(host.TrainBatches):
  """Process-local packed NaFlex batches {'image': f32 [b, N, P*P*3 + 3], 'label'} of steps
  start, start + 1, ...: the host's train batches (order, threads, steps ahead) with each
  image packed at its own aspect ratio instead of cropped square."""

  def __init__(self, source, pp, tokens, patch, **kwargs):
    super().__init__(source, pp, **kwargs)
    self._tokens, self._patch = tuple(int(t) for t in tokens), int(patch)

  def _draws(self) -> int:
    return images.DRAWS + 1  # the crop's and flip's, then the budget's

  def _buffer(self) -> np.ndarray:
    return host.batch_buffer((self._b, max(self._tokens), self._patch**2 * 3 + 3), np.float32)

  def _images(self, idx, uniforms, ra_uniforms, rows, out):
    items, labels = self._source.fetch(idx)
    for k, i in enumerate(rows):
      if self._source.decoded:
        image = items[k]
      else:
        image = host._decoded(self._source, idx[k], items[k], images.decode)
      image, budget = _augment(image, uniforms[k], self._pp, self._tokens)
      out[i] = pack_image(np.ascontiguousarray(image), self._patch, budget, out.shape[1])
    return labels
