"""Preprocessing and RandAugment against independent implementations (TF resize, PIL)."""

import numpy as np
from PIL import Image
from PIL import ImageEnhance
from PIL import ImageOps
import pytest
import tensorflow as tf

from vit_jax.data import preprocess
from vit_jax.data import randaug


def test_batched_crop_resize_matches_per_image_tf_resize():
  rng = np.random.default_rng(0)
  images = rng.integers(0, 256, (16, 8, 8, 3), dtype=np.uint8)
  y, x, h, w = preprocess.inception_crop_window(
    preprocess.random_uniforms(tf.constant([1, 2], tf.int64), [16]),
    tf.fill([16], 8),
    tf.fill([16], 8),
    0.3,
  )
  out = preprocess.crop_and_resize_batch(images, y, x, h, w, 20).numpy()
  for i in range(16):
    crop = images[i, y[i] : y[i] + h[i], x[i] : x[i] + w[i]]
    ref = preprocess.resize(crop, 20).numpy().astype(int)
    assert np.abs(out[i].astype(int) - ref).max() <= 1  # float rounding at .5 only
    assert np.mean(out[i] != ref) < 0.02


def test_inception_windows_lie_inside_with_paper_area_and_aspect():
  u = preprocess.random_uniforms(tf.constant([3, 4], tf.int64), [4000])
  y, x, h, w = [
    t.numpy()
    for t in preprocess.inception_crop_window(u, tf.fill([4000], 375), tf.fill([4000], 500), 0.05)
  ]
  assert np.all((y >= 0) & (x >= 0) & (y + h <= 375) & (x + w <= 500) & (h >= 1) & (w >= 1))
  area = h * w / (375 * 500)
  assert area.min() > 0.045 and area.max() <= 1.0
  # U(0.05, 1) has mean 0.525; boxes wider or taller than 500x375 are redrawn, so less.
  assert 0.35 < np.mean(area) < 0.5 and np.mean(area > 0.9) > 0.01
  ratio = w / h
  assert np.all((ratio > 0.74) | (area == 1)) and np.all((ratio < 1.35) | (area == 1))


def test_decode_turns_grey_and_alpha_into_rgb():
  grey = np.arange(48, dtype=np.uint8).reshape(6, 8)
  encoded = tf.io.encode_png(grey[..., None])
  np.testing.assert_array_equal(
    preprocess.decode(encoded).numpy(), np.repeat(grey[..., None], 3, -1)
  )


def _image(seed=0):
  rng = np.random.default_rng(seed)
  base = rng.integers(40, 200, (24, 32, 3))
  return np.clip(base + rng.integers(-30, 30, (24, 32, 3)), 0, 255).astype(np.uint8)


_PIL = {
  'invert': lambda im, level: ImageOps.invert(im),
  'solarize': lambda im, level: ImageOps.solarize(im, 256 - int(level / 10 * 256)),
  'posterize': lambda im, level: ImageOps.posterize(im, max(1, int(level / 10 * 4))),
  'autocontrast': lambda im, level: ImageOps.autocontrast(im),
  'equalize': lambda im, level: ImageOps.equalize(im),
  'color': lambda im, level: ImageEnhance.Color(im).enhance(level / 10 * 1.8 + 0.1),
  'contrast': lambda im, level: ImageEnhance.Contrast(im).enhance(level / 10 * 1.8 + 0.1),
  'brightness': lambda im, level: ImageEnhance.Brightness(im).enhance(level / 10 * 1.8 + 0.1),
  'sharpness': lambda im, level: ImageEnhance.Sharpness(im).enhance(level / 10 * 1.8 + 0.1),
}


@pytest.mark.parametrize('name', sorted(_PIL))
@pytest.mark.parametrize('level', [3.0, 9.0])
def test_randaugment_ops_match_pil(name, level):
  image = _image()
  ours = getattr(randaug, name)(tf.constant(image), level).numpy().astype(int)
  theirs = np.asarray(_PIL[name](Image.fromarray(image), level)).astype(int)
  assert np.abs(ours - theirs).max() <= 1, name
  assert np.mean(ours != theirs) < 0.01, name


def test_translate_moves_pixels_and_fills_grey():
  image = _image()
  out = randaug.translate_x(tf.constant(image), 10 / 4.5, tf.constant(True)).numpy()
  # +10% of 32 px = 3 px: output column j shows input column j + 3.
  np.testing.assert_array_equal(out[:, :-3], image[:, 3:])
  assert np.all(out[:, -3:] == 128)


def test_randaugment_is_a_pure_function_of_its_seed():
  image = tf.constant(_image())
  a = randaug.randaugment(image, tf.constant([5, 6], tf.int64), 2, 15).numpy()
  b = randaug.randaugment(image, tf.constant([5, 6], tf.int64), 2, 15).numpy()
  np.testing.assert_array_equal(a, b)
  outs = {
    randaug.randaugment(image, tf.constant([5, s], tf.int64), 2, 15).numpy().tobytes()
    for s in range(12)
  }
  assert len(outs) > 4
