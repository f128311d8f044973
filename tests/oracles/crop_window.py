"""Test oracle: inception crops of many images at once, in NumPy arrays (the pipeline draws one
image's in plain Python, `vit_jax.data.images.crop_window`).

'tf' draws TensorFlow's `sample_distorted_bounding_box` boxes, vectorised over images and
attempts; 'log_ratio_10' is the package's sampler before it (an area uniform in [area_min, 1],
a log-uniform ratio in [3/4, 4/3], 10 attempts), which the distribution test shows to be
distinguishable from TensorFlow's: the test's negative control.
"""

import math

import numpy as np

from vit_jax.data import images

SAMPLERS = ('tf', 'log_ratio_10')
_LOG_ATTEMPTS = 10
_LOG_RATIO = (math.log(3 / 4), math.log(4 / 3))
_TF_RATIO = (0.75, 1.33)


def crop_draws(sampler: str = 'tf') -> int:
  """Uniforms a crop of `sampler` reads: 'tf' (ratio, height) per attempt then (y, x);
  'log_ratio_10' (area, ratio, y, x) per attempt."""
  return images.CROP_DRAWS if sampler == 'tf' else 4 * _LOG_ATTEMPTS


def _tf_area_range(area_min, height, width):
  """TensorFlow's bounds of a crop's area in pixels, rounded to float32 as it rounds them."""
  f32 = np.float32
  min_area = (f32(area_min) * np.asarray(width, f32)) * np.asarray(height, f32)
  return min_area.astype(np.float64), np.asarray(width, np.float64) * height


def _tf_box(ratio, u_height, height, width, area_min):
  """One attempt of TensorFlow's GenerateRandomCrop, elementwise: (h, w, ok) float arrays.

  The area bounds are TensorFlow's float32 values; the rest is float64 where
  TensorFlow rounds some steps to float32, which differ only for a ratio
  within 1e-7 of a rounding tie.
  """
  min_area, max_area = _tf_area_range(area_min, height, width)
  h = np.rint(np.sqrt(min_area / ratio))
  max_h = np.rint(np.sqrt(max_area / ratio))
  # The tallest box whose rounded width still fits.
  over = np.rint(max_h * ratio) > width
  max_h = np.where(over, np.floor((width + 0.5 - 1e-7) / ratio), max_h)
  max_h = np.where(over & (np.rint(max_h * ratio) > width), max_h - 1, max_h)
  max_h = np.minimum(max_h, height)
  h = np.minimum(h, max_h)
  h = h + np.floor(u_height * (max_h - h + 1))  # uniform over [h, max_h]
  w = np.rint(h * ratio)
  # Rounding may leave the area out of range: one step up, then one down.
  h = np.where(w * h < min_area, h + 1, h)
  w = np.rint(h * ratio)
  h = np.where(w * h > max_area, h - 1, h)
  w = np.rint(h * ratio)
  area = w * h
  ok = (area >= min_area) & (area <= max_area) & (w <= width) & (h <= height)
  return h, w, ok & (w > 0) & (h > 0)


def _log_box(u_area, u_ratio, height, width, area_min):
  area = height * width * (area_min + (1.0 - area_min) * u_area)
  ratio = np.exp(_LOG_RATIO[0] + (_LOG_RATIO[1] - _LOG_RATIO[0]) * u_ratio)
  w, h = np.round(np.sqrt(area * ratio)), np.round(np.sqrt(area / ratio))
  return h, w, (w <= width) & (h <= height) & (w >= 1) & (h >= 1)


def crop_window(uniforms, height, width, area_min, sampler: str = 'tf'):
  """(y, x, h, w) int arrays of inception crops; uniforms [..., crop_draws(sampler)] in [0, 1).

  The first attempt whose box fits is used, else the whole image. 'tf' places
  the box as TensorFlow does, at y uniform in [0, height - h) (0 when
  h == height; likewise x), 'log_ratio_10' in [0, height - h].
  """
  height = np.asarray(height, np.float64)[..., None]
  width = np.asarray(width, np.float64)[..., None]
  attempts = images.TF_ATTEMPTS
  if sampler == 'tf':
    pairs = uniforms[..., : 2 * attempts].reshape(*uniforms.shape[:-1], attempts, 2)
    ratio = _TF_RATIO[0] + (_TF_RATIO[1] - _TF_RATIO[0]) * pairs[..., 0]
    h, w, fits = _tf_box(ratio, pairs[..., 1], height, width, area_min)
  else:
    quads = uniforms.reshape(*uniforms.shape[:-1], _LOG_ATTEMPTS, 4)
    h, w, fits = _log_box(quads[..., 0], quads[..., 1], height, width, area_min)
  first = np.argmax(fits, axis=-1)[..., None]
  take = lambda t: np.take_along_axis(t, first, axis=-1)[..., 0]
  if sampler == 'tf':  # one (y, x) pair after the attempts; offsets below height - h
    u_y, u_x, last = uniforms[..., -2], uniforms[..., -1], 0
  else:  # each attempt's own pair; offsets up to height - h
    u_y, u_x, last = take(quads[..., 2]), take(quads[..., 3]), 1
  found = fits.any(axis=-1)
  height, width = height[..., 0], width[..., 0]
  h = np.where(found, take(h), height)
  w = np.where(found, take(w), width)
  y = np.floor(u_y * (height - h + last))
  x = np.floor(u_x * (width - w + last))
  return tuple(v.astype(np.int64) for v in (y, x, h, w))
