"""One image: decoding, the official evaluation resize, the training crop.

Every path that turns a file into pixels uses `decode` (training, evaluation,
prediction, analysis), so an image reaches the model as the same pixels
wherever it is read. JPEGs are decoded by libjpeg-turbo through `simplejpeg`
with TensorFlow's default settings (fast integer IDCT, fancy upsampling), at a
reduced DCT scale (1, 1/2, 1/4, 1/8) where a training crop allows; other
formats by PIL. Evaluation resizes as `tf.image.resize` does (bilinear,
half-pixel centres, no antialiasing), so its pixels are the official
preprocessing's, bit for bit (the tests compare with TensorFlow where it is
installed). Training crops are resized by OpenCV with the same sampling, in
fixed point.
"""

import functools
import io
import math
import re
from typing import Optional

import numpy as np

from vit_jax.data.sources import DataError

# An inception crop's box is drawn as tf.image.sample_distorted_bounding_box draws it where the
# official input pipeline and big_vision call it (area_range (area_min, 1), TensorFlow's default
# aspect_ratio_range (0.75, 1.33) and max_attempts 100, min_object_covered 0, the whole image
# after 100 misses): per attempt a width/height ratio uniform in the range, then a height
# uniform over the whole numbers whose box has an area in range and fits, then the offsets.
TF_ATTEMPTS = 100
_TF_RATIO = (0.75, 1.33)
CROP_DRAWS = 2 * TF_ATTEMPTS + 2  # uniforms a crop reads: (ratio, height) per attempt, (y, x)
DRAWS = CROP_DRAWS + 1  # uniforms per training image: the crop's, then the flip's


def _is_jpeg(data: bytes) -> bool:
  return data[:3] == b'\xff\xd8\xff'


class BadImage(Exception):
  """Bytes that do not decode as an image; `_decoded` turns it into a `DataError`."""


class TooLarge(BadImage):
  """An image of more pixels than PIL decodes (its guard against decompression bombs)."""


def too_large_reason(error) -> str:
  """What PIL's DecompressionBombError says, as a reason a user can act on."""
  found = re.search(r'\((\d+) pixels\) exceeds limit of (\d+) pixels', str(error))
  if not found:
    return 'more pixels than PIL decodes (its guard against decompression bombs)'
  pixels, limit = (int(n) for n in found.groups())
  return f'{pixels:,} pixels, more than the {limit:,} that PIL decodes (a decompression-bomb guard)'


def decode(data: bytes, min_height: int = 0, min_width: int = 0, fast: bool = False) -> np.ndarray:
  """Encoded image -> uint8 [h, w, 3]; JPEGs as tf.io.decode_jpeg, optionally DCT-scaled.

  A JPEG is decoded at the smallest scale whose size is at least
  (min_height, min_width); 0 means full size. `fast` upsamples the colour
  planes without smoothing (training only: a few % faster, not TF's pixels).
  Grey is replicated, alpha dropped, 16-bit samples keep their high byte (as
  tf.io.decode_image), a GIF gives its first frame.
  """
  if _is_jpeg(data):
    import simplejpeg

    try:
      return simplejpeg.decode_jpeg(
        data,
        'RGB',
        fastdct=True,  # TensorFlow's default IDCT (JDCT_IFAST)
        fastupsample=fast,  # False: TensorFlow's fancy upsampling
        min_height=min_height,
        min_width=min_width,
      )
    except ValueError:
      pass  # CMYK, or corrupt: PIL below converts the one and names the other
  from PIL import Image

  try:
    with Image.open(io.BytesIO(data)) as image:
      image.seek(0)
      if image.mode in ('I;16', 'I;16B', 'I;16L', 'I'):  # 16-bit grey
        grey = (np.asarray(image).astype(np.uint32) >> 8).astype(np.uint8)
        return np.repeat(grey[..., None], 3, axis=-1)
      return np.asarray(image.convert('RGB'))
  except Image.DecompressionBombError as e:
    raise TooLarge(too_large_reason(e)) from None
  except (OSError, ValueError, SyntaxError) as e:
    reason = re.sub(r'<_io\.BytesIO object at 0x[0-9a-f]+>', 'the data', str(e))
    raise BadImage((reason.strip().splitlines() or [type(e).__name__])[0][:200]) from None


# Formats PIL opens but does not decode by itself: EPS (Ghostscript), MPEG (identified only).
_NOT_DECODED = ('EPS', 'MPEG')


@functools.lru_cache(maxsize=1)
def extensions() -> tuple:
  """File name endings (lower case) of the formats `decode` reads: the one list that image
  folders, shards (`vit_jax.jft`) and `predict` accept, so that every image one of them reads
  the others read too. PIL's own decoders (JPEG, PNG, GIF, BMP, TIFF, WebP, ...), without its
  stubs (which decode only through a handler an application installs) and `_NOT_DECODED`."""
  from PIL import Image
  from PIL import ImageFile

  Image.init()
  found = set()
  for ending, name in Image.registered_extensions().items():
    opener = Image.OPEN.get(name, (None,))[0]
    stub = isinstance(opener, type) and issubclass(opener, ImageFile.StubImageFile)
    if opener is not None and not stub and name not in _NOT_DECODED:
      found.add(ending.lower())
  return tuple(sorted(found))


def image_size(data: bytes):
  """(height, width) from the header of a JPEG, else None (`decode` then tells)."""
  if not _is_jpeg(data):
    return None
  import simplejpeg

  try:
    height, width, _, _ = simplejpeg.decode_jpeg_header(data)
  except ValueError:
    return None
  return height, width


def _lerp_weights(n_in: int, n_out: int):
  """Source rows (lower, upper) and weights of tf.image.resize's bilinear sampling."""
  scale = np.float32(n_in) / np.float32(n_out)
  src = (np.arange(n_out, dtype=np.float32) + np.float32(0.5)) * scale - np.float32(0.5)
  floor = np.floor(src)
  lower = np.maximum(floor, 0).astype(np.int64)
  upper = np.minimum(np.ceil(src), n_in - 1).astype(np.int64)
  return lower, upper, src - floor


@functools.lru_cache(maxsize=64)
def _resize_plan(in_h: int, in_w: int, height: int, width: int):
  """Corner coordinates (as OpenCV remap maps) and weights of a `resize_exact`."""
  y0, y1, dy = _lerp_weights(in_h, height)
  x0, x1, dx = _lerp_weights(in_w, width)
  grid = lambda ys, xs: tuple(a.astype(np.float32) for a in np.meshgrid(xs, ys))
  maps = [grid(y0, x0), grid(y0, x1), grid(y1, x0), grid(y1, x1)]
  return (y0, y1, x0, x1), maps, dx[:, None], dy[:, None, None]


def resize_exact(image: np.ndarray, height: int, width: int) -> np.ndarray:
  """uint8 [(b,) h, w, 3] -> uint8 [(b,) height, width, 3], equal to `preprocess.resize`.

  The float32 arithmetic of TensorFlow's ResizeBilinear kernel (half-pixel
  centres, no antialiasing), step for step, then round half to even. The four
  corner pixels of every output pixel are gathered by OpenCV (nearest-pixel
  remap at integer coordinates: exact copies), the arithmetic is NumPy's.
  """
  (y0, y1, x0, x1), maps, dx, dy = _resize_plan(*image.shape[-3:-1], height, width)
  if image.ndim == 3 and max(image.shape[:2]) < 32767:
    cv2 = _cv2()
    corners = [cv2.remap(image, *m, cv2.INTER_NEAREST) for m in maps]
  else:  # batches of small images (the digits)
    rows_top, rows_bottom = image[..., y0, :, :], image[..., y1, :, :]
    corners = [rows_top[..., x0, :], rows_top[..., x1, :]]
    corners += [rows_bottom[..., x0, :], rows_bottom[..., x1, :]]
  tl, tr, bl, br = (np.asarray(a, np.float32) for a in corners)
  # In place: top = tl + (tr - tl) * dx, bottom likewise, out = top + (bottom - top) * dy.
  for left, right in ((tl, tr), (bl, br)):
    np.subtract(right, left, out=right)
    np.multiply(right, dx, out=right)
    np.add(right, left, out=right)
  np.subtract(br, tr, out=br)
  np.multiply(br, dy, out=br)
  np.add(br, tr, out=br)
  np.rint(br, out=br)
  return np.clip(br, 0, 255, out=br).astype(np.uint8)


def eval_image(data: bytes, crop: int, resize_to: Optional[int] = None) -> np.ndarray:
  """Encoded image -> uint8 [crop, crop, 3]: the official evaluation pixels."""
  return eval_array(decode(data), crop, resize_to)


def eval_array(image, crop: int, resize_to: Optional[int] = None) -> np.ndarray:
  if not resize_to:
    return resize_exact(image, crop, crop)
  start = (resize_to - crop) // 2
  image = resize_exact(image, resize_to, resize_to)
  return image[..., start : start + crop, start : start + crop, :]


# timm's interpolation names -> PIL's filters (torchvision resizes a PIL image with PIL's).
_PIL_FILTERS = {
  'bicubic': 'BICUBIC',
  'bilinear': 'BILINEAR',
  'nearest': 'NEAREST',
  'lanczos': 'LANCZOS',
  'box': 'BOX',
  'hamming': 'HAMMING',
}


def timm_eval_image(data: bytes, transform) -> np.ndarray:
  """Encoded image -> uint8 [size, size, 3]: timm's evaluation pixels for weights whose
  preprocessing is `transform` (a `configs.timm_weights.Preprocessing`). Decoded as timm's
  datasets read a file (PIL, converted to RGB), then `timm_eval_array`."""
  from PIL import Image

  try:
    with Image.open(io.BytesIO(data)) as image:
      image.seek(0)
      return timm_eval_array(image.convert('RGB'), transform)
  except Image.DecompressionBombError as e:
    raise TooLarge(too_large_reason(e)) from None
  except (OSError, ValueError, SyntaxError) as e:
    reason = re.sub(r'<_io\.BytesIO object at 0x[0-9a-f]+>', 'the data', str(e))
    raise BadImage((reason.strip().splitlines() or [type(e).__name__])[0][:200]) from None


def timm_eval_array(image, transform) -> np.ndarray:
  """A uint8 [h, w, 3] array or PIL image (or a batch of arrays) -> uint8 [size, size, 3]:
  timm's evaluation transform (`transforms_imagenet_eval`): the shorter side resized to
  `transform.scale_size` (the longer to int(scale * long / short), torchvision's rule), or both
  sides with crop_mode 'squash', by PIL's filter; then the centre crop, offsets rounded as
  torchvision's `center_crop`."""
  from PIL import Image

  if isinstance(image, np.ndarray) and image.ndim == 4:
    return np.stack([timm_eval_array(one, transform) for one in image])
  if isinstance(image, np.ndarray):
    image = Image.fromarray(image)
  width, height = image.size
  scale, size = transform.scale_size, transform.size
  if transform.crop_mode == 'squash':
    new = (scale, scale)
  elif width <= height:
    new = (scale, int(scale * height / width))
  else:
    new = (int(scale * width / height), scale)
  if new != (width, height):
    image = image.resize(new, getattr(Image, _PIL_FILTERS[transform.interpolation]))
  pixels = np.asarray(image)
  if pixels.shape[0] < size or pixels.shape[1] < size:
    raise BadImage(f'{pixels.shape[1]}x{pixels.shape[0]} px after the resize, under the crop')
  top = int(round((pixels.shape[0] - size) / 2.0))
  left = int(round((pixels.shape[1] - size) / 2.0))
  return np.ascontiguousarray(pixels[top : top + size, left : left + size])


def crop_window(uniforms, height: int, width: int, area_min: float):
  """(y, x, h, w) of one image's inception crop from its `CROP_DRAWS` uniforms in [0, 1): the
  first attempt whose box fits, else the whole image; offsets as TensorFlow places them, y
  uniform in [0, height - h) (0 when h == height; likewise x). In plain Python: a NumPy call
  per image costs more (tests/oracles/crop_window.py holds a vectorised one)."""
  # TensorFlow's area bounds are float32: whether a box of exactly area_min * height * width
  # pixels passes depends on their rounding.
  f32 = np.float32
  min_area = float((f32(area_min) * f32(width)) * f32(height))
  max_area = float(width) * height
  for a in range(TF_ATTEMPTS):
    ratio = _TF_RATIO[0] + (_TF_RATIO[1] - _TF_RATIO[0]) * uniforms[2 * a]
    h = _rint(math.sqrt(min_area / ratio))
    max_h = _rint(math.sqrt(max_area / ratio))
    if _rint(max_h * ratio) > width:
      max_h = math.floor((width + 0.5 - 1e-7) / ratio)
      if _rint(max_h * ratio) > width:
        max_h -= 1
    max_h = min(max_h, height)
    h = min(h, max_h)
    h += math.floor(uniforms[2 * a + 1] * (max_h - h + 1))
    w = _rint(h * ratio)
    if w * h < min_area:
      h += 1
      w = _rint(h * ratio)
    if w * h > max_area:
      h -= 1
      w = _rint(h * ratio)
    if min_area <= w * h <= max_area and 0 < w <= width and 0 < h <= height:
      u_y, u_x = uniforms[2 * TF_ATTEMPTS : 2 * TF_ATTEMPTS + 2]
      return math.floor(u_y * (height - h)), math.floor(u_x * (width - w)), h, w
  return 0, 0, height, width


def _rint(v: float) -> int:
  return int(round(v))  # half to even, as lrintf and np.rint


@functools.lru_cache(maxsize=1)
def _cv2():
  try:
    import cv2
  except ImportError:
    raise DataError(
      'the host input pipeline resizes training crops with OpenCV: pip install '
      'opencv-python-headless'
    ) from None
  cv2.setNumThreads(1)  # the pipeline's own threads run one image each
  return cv2


def dct_scale(crop_height: int, crop_width: int, size: int) -> int:
  """1, 2, 4 or 8: the largest JPEG downscale that keeps a crop at least `size` px each way.

  Only these: libjpeg-turbo's other n/8 scales have no SIMD code and decode
  slower than the full image.
  """
  scale = 1
  while scale < 8 and min(crop_height, crop_width) >= 2 * scale * size:
    scale *= 2
  return scale


def train_image(data: bytes, uniforms, pp, out=None) -> np.ndarray:
  """Encoded image + its `DRAWS` uniforms -> augmented uint8 [crop, crop, 3] (into `out`)."""
  size = image_size(data)
  image = None
  if size is None:
    image = decode(data)
    size = image.shape[:2]
  height, width = size
  if pp.inception_crop:
    y, x, h, w = crop_window(uniforms, height, width, pp.area_min)
  else:
    y, x, h, w = 0, 0, height, width
  if image is None:
    scale = dct_scale(h, w, pp.crop)
    image = decode(data, -(-height // scale), -(-width // scale), fast=True)
  sy, sx = image.shape[0] / height, image.shape[1] / width
  top, left = round(y * sy), round(x * sx)
  bottom = max(top + 1, min(image.shape[0], round((y + h) * sy)))
  right = max(left + 1, min(image.shape[1], round((x + w) * sx)))
  return _resize_and_flip(image[top:bottom, left:right], uniforms, pp, out)


def train_array(image: np.ndarray, uniforms, pp, out=None) -> np.ndarray:
  """Decoded uint8 [h, w, 3] + its `DRAWS` uniforms -> augmented uint8
  [crop, crop, 3]: `train_image` of an image already in memory (the same crop, resize and
  flip)."""
  height, width = image.shape[:2]
  if pp.inception_crop:
    y, x, h, w = crop_window(uniforms, height, width, pp.area_min)
  else:
    y, x, h, w = 0, 0, height, width
  return _resize_and_flip(image[y : y + h, x : x + w], uniforms, pp, out)


def _resize_and_flip(region, uniforms, pp, out):
  """`region` resized to [crop, crop, 3] and maybe mirrored, written into `out` (a batch's row:
  no copy) where given."""
  # Bilinear with half-pixel centres and no antialiasing, as tf.image.resize.
  cv2 = _cv2()
  out = cv2.resize(region, (pp.crop, pp.crop), dst=out, interpolation=cv2.INTER_LINEAR)
  if pp.flip and uniforms[CROP_DRAWS] < 0.5:
    cv2.flip(out, 1, dst=out)  # in place
  return out


def to_float(images, out=None):
  """uint8 -> float32 in [-1, 1], the same float32 operations as the tf.data path."""
  out = np.divide(images, np.float32(127.5), out=out, dtype=np.float32)
  return np.subtract(out, np.float32(1.0), out=out)
