"""Test oracle: RandAugment (Cubuk et al. 2020) as AugReg (Steiner et al. 2021) uses it, stateless.

Each of `num_layers` rounds picks one of the ops below uniformly and applies it
with a probability drawn from U(0.2, 0.8), at a fixed `magnitude` where 10 is
an op's full range (AugReg's "medium" setting is 2 layers at magnitude 15,
beyond it). Ops follow PIL's ImageOps / ImageEnhance definitions (the tests
compare with PIL) on uint8 [h, w, 3] images; geometric ops fill with grey 128.
All randomness comes from the `seed` [2] argument.
"""

import math

import tensorflow as tf

_FILL = 128


def _blend(degenerate, image, factor):
  """PIL's Image.blend: degenerate + factor * (image - degenerate), truncated, clipped."""
  d = tf.cast(degenerate, tf.float32)
  out = d + factor * (tf.cast(image, tf.float32) - d)
  return tf.cast(tf.clip_by_value(tf.floor(out), 0, 255), tf.uint8)


def _grey(image):
  """PIL's 'L' conversion: (R*299 + G*587 + B*114) / 1000, rounded half up."""
  rgb = tf.cast(image, tf.int32)
  weights = tf.constant([19595, 38470, 7471], tf.int32)  # the same ratios in 16-bit fixed point
  return tf.cast(
    tf.bitwise.right_shift(tf.reduce_sum(rgb * weights, axis=-1) + 32768, 16), tf.uint8
  )


def invert(image, _):
  return 255 - image


def solarize(image, level):
  """Inverts pixels >= a threshold that falls from 256 (nothing) at level 0 to 0."""
  threshold = 256 - int(level / 10 * 256)
  return tf.where(tf.cast(image, tf.int32) < threshold, image, 255 - image)


def posterize(image, level):
  bits = max(1, int(level / 10 * 4))
  shift = 8 - bits
  return tf.bitwise.left_shift(tf.bitwise.right_shift(image, shift), shift)


def autocontrast(image, _):
  """Per channel, stretch [min, max] to [0, 255] (PIL ImageOps.autocontrast, cutoff 0)."""

  def channel(c):
    lo = tf.cast(tf.reduce_min(c), tf.float32)
    hi = tf.cast(tf.reduce_max(c), tf.float32)
    scale = 255.0 / tf.maximum(hi - lo, 1.0)
    stretched = tf.clip_by_value(tf.floor(tf.cast(c, tf.float32) * scale - lo * scale), 0, 255)
    return tf.where(hi > lo, tf.cast(stretched, tf.uint8), c)

  return tf.stack([channel(image[..., i]) for i in range(3)], axis=-1)


def equalize(image, _):
  """Per channel histogram equalisation (PIL ImageOps.equalize)."""

  def channel(c):
    hist = tf.math.bincount(tf.cast(c, tf.int32), minlength=256, maxlength=256)
    nonzero = tf.boolean_mask(hist, hist > 0)
    step = (tf.reduce_sum(hist) - nonzero[-1]) // 255
    lut = (tf.cumsum(hist, exclusive=True) + step // 2) // tf.maximum(step, 1)
    lut = tf.cast(tf.clip_by_value(lut, 0, 255), tf.uint8)
    return tf.where(step > 0, tf.gather(lut, tf.cast(c, tf.int32)), c)

  return tf.stack([channel(image[..., i]) for i in range(3)], axis=-1)


def _factor(level):
  return level / 10 * 1.8 + 0.1


def color(image, level):
  grey = tf.repeat(_grey(image)[..., None], 3, axis=-1)
  return _blend(grey, image, _factor(level))


def contrast(image, level):
  mean = tf.floor(tf.reduce_mean(tf.cast(_grey(image), tf.float32)) + 0.5)
  return _blend(tf.fill(tf.shape(image), tf.cast(mean, tf.uint8)), image, _factor(level))


def brightness(image, level):
  return _blend(tf.zeros_like(image), image, _factor(level))


def sharpness(image, level):
  """Blend with PIL's SMOOTH filter (3x3, centre 5, others 1, /13); borders stay."""
  x = tf.cast(image, tf.float32)[None]
  kernel = tf.constant([[1, 1, 1], [1, 5, 1], [1, 1, 1]], tf.float32) / 13.0
  kernel = tf.tile(kernel[:, :, None, None], [1, 1, 3, 1])
  smooth = tf.nn.depthwise_conv2d(x, kernel, [1, 1, 1, 1], 'VALID')[0]
  smooth = tf.cast(tf.clip_by_value(tf.floor(smooth + 0.5), 0, 255), tf.uint8)
  degenerate = tf.pad(smooth, [[1, 1], [1, 1], [0, 0]])
  border = tf.pad(tf.zeros_like(smooth, tf.bool), [[1, 1], [1, 1], [0, 0]], constant_values=True)
  degenerate = tf.where(border, image, degenerate)
  return _blend(degenerate, image, _factor(level))


def _affine(image, matrix):
  """Output pixel (x, y) samples input (a x + b y + c, d x + e y + f), nearest, grey fill."""
  transform = tf.concat([tf.reshape(matrix, [6]), [0.0, 0.0]], axis=0)[None]
  shape = tf.shape(image)[:2]
  out = tf.raw_ops.ImageProjectiveTransformV3(
    images=image[None],
    transforms=transform,
    output_shape=shape,
    fill_value=tf.constant(_FILL, tf.float32),
    interpolation='NEAREST',
    fill_mode='CONSTANT',
  )
  return out[0]


def _signed(value, sign):
  return tf.where(sign, value, -value)


def rotate(image, level, sign):
  """Rotation about the centre by up to 30 degrees."""
  angle = _signed(level / 10 * 30.0, sign) * math.pi / 180
  h, w = tf.cast(tf.shape(image)[0], tf.float32), tf.cast(tf.shape(image)[1], tf.float32)
  cy, cx = (h - 1) / 2, (w - 1) / 2
  cos, sin = tf.cos(angle), tf.sin(angle)
  return _affine(
    image, tf.stack([cos, -sin, cx - cos * cx + sin * cy, sin, cos, cy - sin * cx - cos * cy])
  )


def shear_x(image, level, sign):
  s = _signed(level / 10 * 0.3, sign)
  return _affine(image, tf.stack([1.0, s, 0.0, 0.0, 1.0, 0.0]))


def shear_y(image, level, sign):
  s = _signed(level / 10 * 0.3, sign)
  return _affine(image, tf.stack([1.0, 0.0, 0.0, s, 1.0, 0.0]))


def translate_x(image, level, sign):
  """Shift by up to 45% of the width (100 px at 224 in the reference setting)."""
  pixels = tf.round(_signed(level / 10 * 0.45, sign) * tf.cast(tf.shape(image)[1], tf.float32))
  return _affine(image, tf.stack([1.0, 0.0, pixels, 0.0, 1.0, 0.0]))


def translate_y(image, level, sign):
  pixels = tf.round(_signed(level / 10 * 0.45, sign) * tf.cast(tf.shape(image)[0], tf.float32))
  return _affine(image, tf.stack([1.0, 0.0, 0.0, 0.0, 1.0, pixels]))


_PLAIN = (
  autocontrast,
  equalize,
  invert,
  posterize,
  solarize,
  color,
  contrast,
  brightness,
  sharpness,
)
_SIGNED = (rotate, shear_x, shear_y, translate_x, translate_y)
NUM_OPS = len(_PLAIN) + len(_SIGNED)


def apply_op(image, op, level, sign):
  """Op number `op` (int tensor) at `level`; `sign` (bool tensor) picks the direction."""
  branches = [lambda f=f: f(image, level) for f in _PLAIN]
  branches += [lambda f=f: f(image, level, sign) for f in _SIGNED]
  out = tf.switch_case(op, branches)
  out.set_shape(image.shape)
  return out


def randaugment(image, seed, num_layers, magnitude):
  """uint8 [h, w, 3] -> uint8 [h, w, 3] after `num_layers` random ops."""
  for seed_ in tf.unstack(tf.random.experimental.stateless_split(seed, num_layers)):
    op_seed, p_seed, u_seed, s_seed = tf.unstack(tf.random.experimental.stateless_split(seed_, 4))
    op = tf.random.stateless_uniform([], op_seed, 0, NUM_OPS, dtype=tf.int32)
    prob = tf.random.stateless_uniform([], p_seed, 0.2, 0.8)
    sign = tf.random.stateless_uniform([], s_seed) < 0.5
    augmented = apply_op(image, op, float(magnitude), sign)
    image = tf.where(tf.random.stateless_uniform([], u_seed) < prob, augmented, image)
  return image
