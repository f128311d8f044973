"""One image (vit_jax/data/images.py, randaug.py) against independent implementations.

The oracles are the TensorFlow ops of the official preprocessing and of AugReg's
RandAugment (tests/oracles/, run where TensorFlow is installed) and PIL.
Evaluation pixels are TensorFlow's bit for bit; decoding of every format PIL
opens is TensorFlow's; training crops lie inside the image with the paper's
area and aspect; RandAugment's ops are the TensorFlow ones up to ties.
"""

import io
import os

from conftest import ROOT
from conftest import write_photo_folder
import numpy as np
from PIL import Image
import pytest

from vit_jax.bench import input_speed
from vit_jax.data import images
from vit_jax.data import order
from vit_jax.data import pipeline
from vit_jax.data import randaug


@pytest.fixture(scope='module')
def tf():
  return pytest.importorskip('tensorflow')


@pytest.fixture(scope='module')
def photos(tmp_path_factory):
  """JPEGs of several sizes (crops of scikit-learn's photos), a PNG and a grey JPEG."""
  root = write_photo_folder(str(tmp_path_factory.mktemp('photos')), 12, classes=2)
  return input_speed.image_files(os.path.join(root, 'train'))


def _oracle(name):
  import importlib
  import sys

  sys.path.insert(0, str(ROOT / 'tests'))
  return importlib.import_module(f'oracles.{name}')


def _encoded(array, fmt, **kw):
  buf = io.BytesIO()
  Image.fromarray(array).save(buf, fmt, **kw)
  return buf.getvalue()


def test_eval_pixels_are_the_official_preprocessings(photos, tf):
  preprocess_tf = _oracle('preprocess_tf')
  for path in photos:
    data = open(path, 'rb').read()
    for crop, resize_to in ((64, None), (64, 80), (384, None)):
      ours = images.eval_image(data, crop, resize_to)
      theirs = preprocess_tf.eval_image(preprocess_tf.decode(data), crop, resize_to).numpy()
      np.testing.assert_array_equal(ours, theirs, err_msg=f'{path} {crop} {resize_to}')


def _formats():
  rng = np.random.default_rng(0)
  rgb = rng.integers(0, 256, (30, 40, 3), np.uint8)
  ramp = (np.arange(30 * 40, dtype=np.uint32).reshape(30, 40) * 53).astype(np.uint16)
  cmyk = Image.fromarray(rgb).convert('CMYK')
  buf = io.BytesIO()
  cmyk.save(buf, 'JPEG', quality=95)
  return {
    'png': _encoded(rgb, 'PNG'),
    'png rgba': _encoded(np.dstack([rgb, rgb[..., :1]]), 'PNG'),
    'png 16-bit grey': _encoded(ramp, 'PNG'),
    'gif': _encoded(rgb, 'GIF'),
    'bmp': _encoded(rgb, 'BMP'),
    'jpeg grey': _encoded(rgb[..., 0], 'JPEG'),
    'jpeg cmyk': buf.getvalue(),
  }


def test_other_formats_decode_as_tensorflow_decodes_them(tf):
  preprocess_tf = _oracle('preprocess_tf')
  for name, data in _formats().items():
    ours = images.decode(data).astype(int)
    theirs = preprocess_tf.decode(data).numpy().astype(int)
    assert ours.shape == theirs.shape, name
    # CMYK JPEGs: PIL's conversion, not libjpeg's, within 1 (docs/data.md).
    assert np.abs(ours - theirs).max() <= (1 if name == 'jpeg cmyk' else 0), name


def test_decode_turns_grey_and_alpha_into_rgb():
  grey = np.arange(48, dtype=np.uint8).reshape(6, 8)
  np.testing.assert_array_equal(
    images.decode(_encoded(grey, 'PNG')), np.repeat(grey[..., None], 3, -1)
  )
  rgba = np.dstack([np.full((6, 8, 3), 9, np.uint8), grey])
  np.testing.assert_array_equal(images.decode(_encoded(rgba, 'PNG')), np.full((6, 8, 3), 9))


@pytest.mark.parametrize('sampler', ['tf', 'log_ratio_10'])
def test_one_image_crop_window_is_the_batched_one_and_inside(sampler):
  """The pipeline's crop of one image is the vectorised oracle's ('tf'); the oracle's boxes,
  and those of the sampler before it, lie inside the image at the areas and ratios asked."""
  crops = _oracle('crop_window')
  u = order.example_uniforms(11, np.arange(3000), crops.crop_draws(sampler))
  for height, width, area_min in ((375, 500, 0.05), (8, 8, 0.5), (1, 1, 0.05), (3, 900, 0.05)):
    batched = crops.crop_window(u, np.full(3000, height), np.full(3000, width), area_min, sampler)
    if sampler == 'tf':
      one = np.array([images.crop_window(row, height, width, area_min) for row in u])
      np.testing.assert_array_equal(one, np.stack(batched, 1))
    y, x, h, w = batched
    assert np.all((y >= 0) & (x >= 0) & (y + h <= height) & (x + w <= width) & (h >= 1))
    whole = h * w == height * width
    # TensorFlow's boxes have at least the area; the older ones round w and h after it.
    slack, rounding = (1.0, 0.5) if sampler == 'tf' else (0.9, 1.5)
    assert np.all((h * w >= slack * area_min * height * width) | whole)
    ratio = w / h
    # The aspect ratio in range up to the rounding to whole pixels (TensorFlow's: w only).
    assert np.all((np.abs(ratio - np.clip(ratio, 0.75, 4 / 3)) <= rounding / h) | whole)
    if sampler == 'tf':  # TensorFlow's offsets stop one short of the far edge
      assert np.all((x + w < width) | (w == width)) and np.all((y + h < height) | (h == height))


# Image sizes and area_min for the crop-distribution test: a photo, the digits,
# a wide strip, and one where an attempt succeeds 0.9% of the time, so 100
# attempts fall back to the whole image 41% of the time (10 attempts: 92%).
_CROP_CASES = ((375, 500, 0.05), (8, 8, 0.5), (20, 200, 0.05), (20, 200, 0.134))


def test_inception_crop_is_distributed_as_tensorflows_sample_distorted_bounding_box(tf):
  """Two-sample Kolmogorov-Smirnov on the crop's area, aspect ratio and offsets: 20,000
  crops of ours against 20,000 of TensorFlow's op as the official
  pipeline calls it. Under equal distributions P(D > c * sqrt(2 / n)) <= 2 exp(-2 c^2)
  (conservative for these discrete ones); c = 2.225 makes that 1e-4 per statistic, so
  D <= 0.0223. The sampler before this one (log-uniform ratio, 10 attempts) fails it."""
  from scipy import stats

  preprocess_tf, crops = _oracle('preprocess_tf'), _oracle('crop_window')
  n = 20_000
  bound = 2.225 * np.sqrt(2 / n)
  seeds = tf.stack([tf.zeros(n, tf.int32), tf.range(n, dtype=tf.int32)], 1)
  windows = tf.function(preprocess_tf.inception_crop_windows)
  for height, width, area_min in _CROP_CASES:
    theirs = np.stack([v.numpy() for v in windows(seeds, height, width, area_min)], 1)

    def features(sampler):
      u = order.example_uniforms(3, np.arange(n), crops.crop_draws(sampler))
      y, x, h, w = crops.crop_window(u, height, width, area_min, sampler)
      return np.stack([h * w / (height * width), w / h, y / height, x / width])

    ty, tx, th, tw = theirs.T
    tf_features = np.stack([th * tw / (height * width), tw / th, ty / height, tx / width])
    for sampler, ok in (('tf', True), ('log_ratio_10', False)):
      d = [stats.ks_2samp(a, b).statistic for a, b in zip(features(sampler), tf_features)]
      case = (height, width, area_min, sampler, np.round(d, 4))
      assert (max(d) <= bound) == ok, case


def test_reduced_scale_decode_stays_close_to_a_full_decode():
  from sklearn.datasets import load_sample_images

  data = _encoded(load_sample_images().images[0], 'JPEG', quality=95)  # 427 x 640
  full = images.decode(data)
  half = images.decode(data, 200, 300)
  assert half.shape == (214, 320, 3)  # libjpeg-turbo's 1/2 scale
  cv2 = images._cv2()
  pp = pipeline.Preprocessing(96, None, False, False, 1.0, 0, 0.0, 0.0)  # whole image, no flip
  ours = images.train_image(data, np.zeros(images.DRAWS), pp)  # decodes at 1/4 scale
  ref = cv2.resize(full, (96, 96), interpolation=cv2.INTER_AREA)
  assert np.abs(ours.astype(int) - ref).mean() < 4


def test_flip_mirrors_the_same_crop():
  data = _encoded(np.random.default_rng(0).integers(0, 255, (90, 120, 3), np.uint8), 'PNG')
  pp = pipeline.Preprocessing(32, None, True, True, 0.3, 0, 0.0, 0.0)
  u = order.example_uniforms(1, [7], images.DRAWS)[0]
  u[-1] = 0.9
  plain = images.train_image(data, u, pp)
  u[-1] = 0.1
  np.testing.assert_array_equal(images.train_image(data, u, pp), plain[:, ::-1])
  # Into a batch's row (resized there, mirrored in place), and from the decoded array.
  batch = np.zeros((3, 32, 32, 3), np.uint8)
  images.train_image(data, u, pp, out=batch[1])
  np.testing.assert_array_equal(batch[1], plain[:, ::-1])
  images.train_array(images.decode(data), u, pp, out=batch[2])
  np.testing.assert_array_equal(batch[2], plain[:, ::-1])
  assert not batch[0].any()


def _image(seed=0):
  rng = np.random.default_rng(seed)
  base = rng.integers(40, 200, (24, 32, 3))
  return np.clip(base + rng.integers(-30, 30, (24, 32, 3)), 0, 255).astype(np.uint8)


_OP_NAMES = (
  'invert solarize posterize autocontrast equalize color contrast brightness sharpness '
  'rotate shear_x shear_y translate_x translate_y'
).split()


@pytest.mark.parametrize('name', _OP_NAMES)
def test_randaugment_ops_match_the_tensorflow_ones(name, photos, tf):
  randaug_tf = _oracle('randaug_tf')
  image = images.decode(open(photos[0], 'rb').read())[:96, :128].copy()
  names = [f.__name__ for f in randaug_tf._PLAIN + randaug_tf._SIGNED]
  op = names.index(name)
  for level, sign in ((3.0, True), (9.0, False)):
    fn = getattr(randaug_tf, name)
    args = (level, tf.constant(sign)) if op >= len(randaug_tf._PLAIN) else (level,)
    theirs = fn(tf.constant(image), *args).numpy()
    ours = randaug.apply_op(image, op, level, 1 if sign else -1)
    assert np.mean(ours != theirs) < 0.01, (name, level)  # ties of nearest sampling only
    if op < len(randaug_tf._PLAIN):  # the colour ops: within 1 everywhere
      assert np.abs(ours.astype(int) - theirs).max() <= 1, (name, level)


def test_translate_moves_pixels_and_fills_grey():
  image = _image()
  out = randaug.apply_op(image, _OP_NAMES.index('translate_x'), 10 / 4.5, 1)
  # +10% of 32 px = 3 px: output column j shows input column j + 3.
  np.testing.assert_array_equal(out[:, :-3], image[:, 3:])
  assert np.all(out[:, -3:] == 128)


def test_randaugment_is_a_pure_function_of_its_uniforms():
  image = _image()
  u = order.example_uniforms(5, np.arange(12), 2 * randaug.DRAWS_PER_LAYER)
  a = randaug.randaugment(image, u[0], 2, 15)
  np.testing.assert_array_equal(a, randaug.randaugment(image, u[0], 2, 15))
  assert len({randaug.randaugment(image, row, 2, 15).tobytes() for row in u}) > 4
