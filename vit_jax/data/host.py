"""The host pipeline: image folders, shards and the digits with NumPy, OpenCV, PIL and threads.

No TensorFlow: JPEGs are decoded by libjpeg-turbo through `simplejpeg`, other
formats by PIL, in a thread pool (they release the GIL), straight into the
batch's float buffer. Per training image: read the JPEG header, draw the
inception crop, decode at the smallest DCT scale (1, 1/2, 1/4, 1/8) that keeps
the crop at least `crop` pixels high and wide, resize the crop with OpenCV
(bilinear, half-pixel centres, no antialiasing: the sampling of
`tf.image.resize`, in fixed point), flip. CMYK JPEGs go through PIL (within 1
of TensorFlow's pixels). Evaluation decodes at full scale with TensorFlow's
default JPEG settings (fast integer IDCT, fancy upsampling) and resizes as
`tf.image.resize` does (bilinear, half-pixel centres, no antialiasing), so its
pixels are the official preprocessing's, bit for bit (tests compare).

Order and randomness. Step s reads the same examples as the tf.data pipeline
(`order.train_indices`); each example's crop and flip come from
`order.example_uniforms(key, position)`, so a batch is a pure function of
(seed, step) whatever the number of threads or processes. RandAugment is
`randaug_host.py` (PIL), seeded the same way.
"""

import collections
import concurrent.futures
import functools
import io
import math
import os
import re
from typing import Optional
import weakref

import numpy as np

from vit_jax.data import order
from vit_jax.data import randaug_host
from vit_jax.data.sources import DataError

ATTEMPTS = 10  # inception crop candidates per image; the first that fits is taken
_LOG_RATIO = (math.log(3 / 4), math.log(4 / 3))
_DRAWS = ATTEMPTS * 4 + 1  # crop uniforms, then the flip
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


def crop_window(uniforms, height, width, area_min):
  """(y, x, h, w) int arrays of inception crops; uniforms [..., ATTEMPTS, 4] in [0, 1).

  Each attempt draws an area fraction in [area_min, 1] and a log-uniform aspect
  ratio in [3/4, 4/3]; the first box that fits is used, else the whole image
  (Szegedy et al. 2015; torchvision and the tf.data path do the same).
  """
  height = np.asarray(height, np.float64)[..., None]
  width = np.asarray(width, np.float64)[..., None]
  area = height * width * (area_min + (1.0 - area_min) * uniforms[..., 0])
  ratio = np.exp(_LOG_RATIO[0] + (_LOG_RATIO[1] - _LOG_RATIO[0]) * uniforms[..., 1])
  w, h = np.round(np.sqrt(area * ratio)), np.round(np.sqrt(area / ratio))
  fits = (w <= width) & (h <= height) & (w >= 1) & (h >= 1)
  first = np.argmax(fits, axis=-1)[..., None]
  take = lambda t: np.take_along_axis(t, first, axis=-1)[..., 0]
  found = fits.any(axis=-1)
  h = np.where(found, take(h), height[..., 0])
  w = np.where(found, take(w), width[..., 0])
  y = np.floor(take(uniforms[..., 2]) * (height[..., 0] - h + 1))
  x = np.floor(take(uniforms[..., 3]) * (width[..., 0] - w + 1))
  return tuple(v.astype(np.int64) for v in (y, x, h, w))


def _is_jpeg(data: bytes) -> bool:
  return data[:3] == b'\xff\xd8\xff'


class BadImage(Exception):
  """Bytes that do not decode as an image; `_decoded` turns it into a `DataError`."""


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
  except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
    reason = re.sub(r'<_io\.BytesIO object at 0x[0-9a-f]+>', 'the data', str(e))
    raise BadImage((reason.strip().splitlines() or [type(e).__name__])[0][:200]) from None


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


def crop_window_one(uniforms, height: int, width: int, area_min: float):
  """`crop_window` for one image in plain Python (a NumPy call per image costs more)."""
  for a in range(ATTEMPTS):
    u_area, u_ratio, u_y, u_x = uniforms[4 * a : 4 * a + 4]
    area = height * width * (area_min + (1.0 - area_min) * u_area)
    ratio = math.exp(_LOG_RATIO[0] + (_LOG_RATIO[1] - _LOG_RATIO[0]) * u_ratio)
    w, h = round(math.sqrt(area * ratio)), round(math.sqrt(area / ratio))
    if 1 <= w <= width and 1 <= h <= height:
      return math.floor(u_y * (height - h + 1)), math.floor(u_x * (width - w + 1)), h, w
  return 0, 0, height, width


@functools.lru_cache(maxsize=1)
def _cv2():
  try:
    import cv2
  except ImportError:
    raise DataError(
      'the host input pipeline resizes training crops with OpenCV: pip install '
      'opencv-python-headless (or set --config.input_backend=tf)'
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


def train_image(data: bytes, uniforms, pp) -> np.ndarray:
  """Encoded image + its `_DRAWS` uniforms -> augmented uint8 [crop, crop, 3]."""
  size = image_size(data)
  image = None
  if size is None:
    image = decode(data)
    size = image.shape[:2]
  height, width = size
  if pp.inception_crop:
    y, x, h, w = crop_window_one(uniforms, height, width, pp.area_min)
  else:
    y, x, h, w = 0, 0, height, width
  if image is None:
    scale = dct_scale(h, w, pp.crop)
    image = decode(data, -(-height // scale), -(-width // scale), fast=True)
  sy, sx = image.shape[0] / height, image.shape[1] / width
  top, left = round(y * sy), round(x * sx)
  bottom = max(top + 1, min(image.shape[0], round((y + h) * sy)))
  right = max(left + 1, min(image.shape[1], round((x + w) * sx)))
  # Bilinear with half-pixel centres and no antialiasing, as tf.image.resize.
  cv2 = _cv2()
  out = cv2.resize(
    image[top:bottom, left:right], (pp.crop, pp.crop), interpolation=cv2.INTER_LINEAR
  )
  if pp.flip and uniforms[ATTEMPTS * 4] < 0.5:
    out = cv2.flip(out, 1)
  return out


def to_float(images, out=None):
  """uint8 -> float32 in [-1, 1], the same float32 operations as the tf.data path."""
  out = np.divide(images, np.float32(127.5), out=out, dtype=np.float32)
  return np.subtract(out, np.float32(1.0), out=out)


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


def train_batch(images, uniforms, pp) -> np.ndarray:
  """uint8 [b, H, W, 3] + uniforms [b, _DRAWS] -> augmented uint8 [b, crop, crop, 3]."""
  b, size_h, size_w, _ = images.shape
  if pp.inception_crop:
    crop_u = uniforms[:, : ATTEMPTS * 4].reshape(b, ATTEMPTS, 4)
    y, x, h, w = crop_window(crop_u, np.full(b, size_h), np.full(b, size_w), pp.area_min)
    rows = _interpolation_matrix(y, h, size_h, pp.crop)
    cols = _interpolation_matrix(x, w, size_w, pp.crop)
    out = np.einsum('bry,byxc->brxc', rows, images.astype(np.float32))
    out = np.einsum('bsx,brxc->brsc', cols, out)
    out = np.clip(np.round(out), 0, 255).astype(np.uint8)
  else:
    out = resize_exact(images, pp.crop, pp.crop)
  if pp.flip:
    mirror = uniforms[:, ATTEMPTS * 4] < 0.5
    out[mirror] = out[mirror, :, ::-1]
  return out


# ---------------------------------------------------------------------------
# Mixup.


def mixup(images, labels, step: int, key: int, alpha: float, num_classes: int, multi_label: bool):
  """Mixup as the tf.data path: pairs (2k, 2k+1), weight max(p, 1-p), p ~ Beta(alpha, alpha)."""
  p = np.random.default_rng([key, step]).beta(alpha, alpha)
  p = np.float32(max(p, 1.0 - p))
  if not multi_label:
    labels = np.eye(num_classes, dtype=np.float32)[labels]

  def mix(x):
    partner = x.reshape(-1, 2, *x.shape[1:])[:, ::-1].reshape(x.shape)
    return p * x + (np.float32(1.0) - p) * partner

  return mix(images), mix(labels)


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
  except BadImage as e:
    raise DataError(
      f'{source.describe(int(index))}: cannot decode the image ({e}); replace it '
      "(image folders: corrupt_images='skip' leaves out what cannot be decoded)"
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
    uniforms = order.example_uniforms(self._aug_key, positions, _DRAWS)
    pp = self._pp
    ra_uniforms = None
    if pp.randaug_layers:  # RandAugment's own draws: 4 per layer
      n = randaug_host.DRAWS_PER_LAYER * pp.randaug_layers
      ra_uniforms = order.example_uniforms(self._aug_key ^ _RANDAUG_KEY, positions, n)
    if self._source.decoded:  # in memory: one vectorised job for the batch
      return step, [self._pool.submit(self._decoded_batch, idx, uniforms, ra_uniforms)], None
    out = np.empty((self._b, pp.crop, pp.crop, 3), np.float32)
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
      image = _decoded(self._source, idx[k], items[k], lambda d: train_image(d, uniforms[k], pp))
      if ra_uniforms is not None:
        image = randaug_host.randaugment(
          image, ra_uniforms[i], pp.randaug_layers, pp.randaug_magnitude
        )
      to_float(image, out[i])
    return labels

  def _decoded_batch(self, idx, uniforms, ra_uniforms):
    pp = self._pp
    images, labels = self._source.fetch(idx)
    images = train_batch(images, uniforms, pp)
    if ra_uniforms is not None:
      images = np.stack(
        [
          randaug_host.randaugment(a, u, pp.randaug_layers, pp.randaug_magnitude)
          for a, u in zip(images, ra_uniforms)
        ]
      )
    return to_float(images), labels

  def __next__(self):
    while len(self._queue) < self._ahead:
      self._queue.append(self._submit(self._next_step))
      self._next_step += 1
    step, jobs, out = self._queue.popleft()
    images, labels = _collect(jobs, out)
    if self._pp.mixup > 0:
      images, labels = mixup(
        images,
        labels,
        step,
        self._mix_key,
        self._pp.mixup,
        self._source.num_classes,
        self._source.multi_label,
      )
    return {'image': images, 'label': labels}


def eval_batches(source, pp, *, positions_fn, num_threads=0, ahead=2):
  """Host eval batches (uint8 images, labels, mask) at the (indices, mask) of `positions_fn()`.

  The next `ahead` batches are read and decoded while the caller evaluates one.
  """
  pool = concurrent.futures.ThreadPoolExecutor(threads(num_threads))

  def images(idx, rows, out):
    items, labels = source.fetch(idx)
    for k, i in enumerate(rows):
      out[i] = _decoded(source, idx[k], items[k], lambda d: eval_image(d, pp.crop, pp.resize))
    return labels

  def decoded(idx):
    items, labels = source.fetch(idx)
    return eval_array(items, pp.crop, pp.resize), labels

  def submit(idx, mask):
    if source.decoded:
      return [pool.submit(decoded, idx)], None, mask
    out = np.empty((len(idx), pp.crop, pp.crop, 3), np.uint8)
    return [pool.submit(images, idx[r], r, out) for r in _chunks(len(idx))], out, mask

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
