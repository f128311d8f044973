"""RandAugment (Cubuk et al. 2020) as AugReg applies it, by PIL.

The 14 ops, levels and grey fill of AugReg's TensorFlow version (whose
definitions follow PIL's ImageOps / ImageEnhance; the tests compare the two
with the TensorFlow ops kept in tests/oracles/randaug_tf.py), drawn per
layer from 4 uniforms: which op, the probability U(0.2, 0.8) of applying it,
whether it is applied, and the direction of the geometric ones.
"""

import math

import numpy as np
from PIL import Image
from PIL import ImageEnhance
from PIL import ImageOps

_FILL = (128, 128, 128)
DRAWS_PER_LAYER = 4


def _factor(level):
  return level / 10 * 1.8 + 0.1


def _affine(image, matrix):
  """Output pixel (x, y) samples input (a x + b y + c, d x + e y + f), nearest, grey fill.

  As TensorFlow's ImageProjectiveTransform, which rounds M (x, y) to the
  nearest pixel; PIL floors M' (x + 1/2, y + 1/2), so M' shifts by 1/2 - A (1/2, 1/2).
  """
  a, b, c, d, e, f = matrix
  shifted = (a, b, c + 0.5 - 0.5 * (a + b), d, e, f + 0.5 - 0.5 * (d + e))
  return image.transform(
    image.size, Image.Transform.AFFINE, shifted, Image.Resampling.NEAREST, fillcolor=_FILL
  )


def _rotate(image, level, sign):
  angle = math.radians(level / 10 * 30.0 * sign)
  w, h = image.size
  cy, cx = (h - 1) / 2, (w - 1) / 2
  cos, sin = math.cos(angle), math.sin(angle)
  return _affine(image, [cos, -sin, cx - cos * cx + sin * cy, sin, cos, cy - sin * cx - cos * cy])


def _shear_x(image, level, sign):
  return _affine(image, [1, level / 10 * 0.3 * sign, 0, 0, 1, 0])


def _shear_y(image, level, sign):
  return _affine(image, [1, 0, 0, level / 10 * 0.3 * sign, 1, 0])


def _translate_x(image, level, sign):
  return _affine(image, [1, 0, round(level / 10 * 0.45 * sign * image.size[0]), 0, 1, 0])


def _translate_y(image, level, sign):
  return _affine(image, [1, 0, 0, 0, 1, round(level / 10 * 0.45 * sign * image.size[1])])


# In the order of the TensorFlow oracle's _PLAIN + _SIGNED: op numbers mean the same op.
OPS = (
  lambda im, level, _: ImageOps.autocontrast(im),
  lambda im, level, _: ImageOps.equalize(im),
  lambda im, level, _: ImageOps.invert(im),
  lambda im, level, _: ImageOps.posterize(im, max(1, int(level / 10 * 4))),
  lambda im, level, _: ImageOps.solarize(im, 256 - int(level / 10 * 256)),
  lambda im, level, _: ImageEnhance.Color(im).enhance(_factor(level)),
  lambda im, level, _: ImageEnhance.Contrast(im).enhance(_factor(level)),
  lambda im, level, _: ImageEnhance.Brightness(im).enhance(_factor(level)),
  lambda im, level, _: ImageEnhance.Sharpness(im).enhance(_factor(level)),
  _rotate,
  _shear_x,
  _shear_y,
  _translate_x,
  _translate_y,
)
NUM_OPS = len(OPS)


def apply_op(image: np.ndarray, op: int, level: float, sign: int = 1) -> np.ndarray:
  """uint8 [h, w, 3] after op number `op` at `level` (sign +1 / -1 for the geometric ones)."""
  return np.asarray(OPS[op](Image.fromarray(image), level, sign))


def randaugment(image: np.ndarray, uniforms, num_layers: int, magnitude: float) -> np.ndarray:
  """uint8 [h, w, 3] after `num_layers` random ops; uniforms [num_layers * 4] in [0, 1)."""
  pil = Image.fromarray(image)
  for layer in range(num_layers):
    u_op, u_prob, u_apply, u_sign = uniforms[
      DRAWS_PER_LAYER * layer : DRAWS_PER_LAYER * (layer + 1)
    ]
    if u_apply < 0.2 + 0.6 * u_prob:
      op = min(int(u_op * NUM_OPS), NUM_OPS - 1)
      pil = OPS[op](pil, float(magnitude), 1 if u_sign < 0.5 else -1)
  return np.asarray(pil)
