"""Test oracle: the paper's image preprocessing (Appendix B.1.1) in TensorFlow ops.

The input pipeline (vit_jax/data/images.py) must give these pixels: the
tests compare the two where TensorFlow is installed. This was the tf.data
backend's preprocessing until the package dropped TensorFlow.

Train: inception crop (Szegedy et al. 2015) as the official input pipeline
draws it, `tf.image.sample_distorted_bounding_box` with area_range
(area_min, 1), no boxes and TensorFlow's default aspect ratios and attempts;
random horizontal flip, bilinear resize to `crop`. Eval: bilinear resize to `crop`, or to `resize`
followed by a centre crop. Pixels end in [-1, 1].

Every random choice comes from a stateless RNG seeded by the caller with
(seed, example position), so an example's augmentation is a pure function of
where it sits in the data stream: a resumed run repeats it bit for bit.
Images stay uint8 [h, w, 3] between steps (rounded after each resize), which
is also what RandAugment's ops expect.
"""

import tensorflow as tf


def inception_crop_window(seed, height, width, area_min):
  """(y, x, h, w) int32 of one inception crop of a [height, width] image; seed [2].

  The official input pipeline's call (vit_jax/input_pipeline.py there), stateless.
  """
  begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(
    tf.stack([height, width, 3]),
    tf.zeros([0, 0, 4], tf.float32),
    seed=seed,
    min_object_covered=0.0,
    area_range=(area_min, 1.0),
    use_image_if_no_bounding_boxes=True,
  )
  return begin[0], begin[1], size[0], size[1]


def inception_crop_windows(seeds, height, width, area_min):
  """`inception_crop_window` of [n, 2] seeds: four int32 [n]."""
  one = lambda seed: inception_crop_window(seed, height, width, area_min)
  spec = (tf.TensorSpec([], tf.int32),) * 4
  return tf.map_fn(one, seeds, fn_output_signature=spec)


def decode(encoded):
  """Encoded JPEG/PNG/GIF/BMP -> uint8 [h, w, 3]: grey replicated, alpha dropped, GIF frame 0."""
  image = tf.io.decode_image(encoded, channels=3, expand_animations=False)
  image.set_shape([None, None, 3])
  return image


def to_uint8(image):
  return tf.cast(tf.clip_by_value(tf.round(image), 0, 255), tf.uint8)


def resize(image, size):
  """Bilinear resize (half-pixel centres, no antialiasing, as the original code)."""
  return to_uint8(tf.image.resize(image, [size, size], method='bilinear'))


def decode_inception_crop(encoded, seed, area_min, crop):
  """Decodes only the crop window of JPEGs (DCT-domain crop), any format otherwise."""

  def crop_jpeg():
    shape = tf.io.extract_jpeg_shape(encoded)
    y, x, h, w = inception_crop_window(seed, shape[0], shape[1], area_min)
    return tf.io.decode_and_crop_jpeg(encoded, tf.stack([y, x, h, w]), channels=3)

  def crop_other():
    image = decode(encoded)
    shape = tf.shape(image)
    y, x, h, w = inception_crop_window(seed, shape[0], shape[1], area_min)
    return image[y : y + h, x : x + w]

  image = tf.cond(tf.io.is_jpeg(encoded), crop_jpeg, crop_other)
  image.set_shape([None, None, 3])
  return resize(image, crop)


def eval_image(image, crop, resize_to=None):
  """uint8 [(b,) h, w, 3] -> resize to `crop`, or to `resize_to` then a centre `crop`."""
  if not resize_to:
    return resize(image, crop)
  image = resize(image, resize_to)
  start = (resize_to - crop) // 2
  return image[..., start : start + crop, start : start + crop, :]


def train_image(encoded, seed, *, crop, inception_crop, area_min, flip):
  """Encoded image + seed [2] -> augmented uint8 [crop, crop, 3] (before RandAugment)."""
  crop_seed, flip_seed = tf.unstack(tf.random.experimental.stateless_split(seed, 2))
  if inception_crop:
    image = decode_inception_crop(encoded, crop_seed, area_min, crop)
  else:
    image = resize(decode(encoded), crop)
  if flip:
    image = tf.image.stateless_random_flip_left_right(image, flip_seed)
  return image


# ---------------------------------------------------------------------------
# Batched versions for decoded in-memory images of one size (the digits): one
# op per batch instead of one per image keeps the per-step cost tiny.


def _interpolation_matrix(start, length, size, out):
  """[b, out, size] weights of a bilinear resize of rows [start, start+length) to `out`.

  Same sampling as `tf.image.resize` (half-pixel centres, edge clamped), so a
  batched crop+resize equals cropping and resizing each image on its own.
  """
  start = tf.cast(start, tf.float32)[:, None]
  length = tf.cast(length, tf.float32)[:, None]
  centres = (tf.range(out, dtype=tf.float32)[None] + 0.5) * length / out - 0.5
  src = start + tf.clip_by_value(centres, 0.0, length - 1.0)
  lo = tf.floor(src)
  frac = src - lo
  hi = tf.minimum(lo + 1.0, start + length - 1.0)
  one_hot = lambda i: tf.one_hot(tf.cast(i, tf.int32), size, dtype=tf.float32)
  return one_hot(lo) * (1.0 - frac)[..., None] + one_hot(hi) * frac[..., None]


def crop_and_resize_batch(images, y, x, h, w, crop):
  """uint8 [b, H, W, 3] and per-image windows -> uint8 [b, crop, crop, 3]."""
  size_h, size_w = images.shape[1], images.shape[2]
  rows = _interpolation_matrix(y, h, size_h, crop)
  cols = _interpolation_matrix(x, w, size_w, crop)
  b, c = tf.shape(images)[0], images.shape[3]
  # Two batched matmuls: rows, then columns (one fused einsum is several times slower).
  x = tf.reshape(tf.cast(images, tf.float32), [b, size_h, size_w * c])
  x = tf.reshape(tf.matmul(rows, x), [b, crop, size_w, c])
  x = tf.reshape(tf.transpose(x, [0, 2, 1, 3]), [b, size_w, crop * c])
  x = tf.reshape(tf.matmul(cols, x), [b, crop, crop, c])
  return to_uint8(tf.transpose(x, [0, 2, 1, 3]))


def train_batch(images, seed, *, crop, inception_crop, area_min, flip, offset=0, global_batch=None):
  """Batched `train_image` for decoded images of one size; seed [2] for the batch.

  The random draws are made for `global_batch` examples and rows
  [offset, offset + b) used, so a process's share of a global batch is
  augmented as it would be in a single-process run.
  """
  b = tf.shape(images)[0]
  total = b if global_batch is None else global_batch
  size_h, size_w = images.shape[1], images.shape[2]
  crop_seed, flip_seed = tf.unstack(tf.random.experimental.stateless_split(seed, 2))
  if inception_crop:
    seeds = tf.random.experimental.stateless_split(crop_seed, total)[offset : offset + b]
    y, x, h, w = inception_crop_windows(seeds, size_h, size_w, area_min)
    images = crop_and_resize_batch(images, y, x, h, w, crop)
  else:
    images = resize(images, crop)  # exactly the eval resize
  if flip:
    mirror = tf.random.stateless_uniform([total], flip_seed)[offset : offset + b] < 0.5
    images = tf.where(mirror[:, None, None, None], images[:, :, ::-1], images)
  return images


def to_float(images):
  """uint8 -> float32 in [-1, 1] (paper B.1.1)."""
  return tf.cast(images, tf.float32) / 127.5 - 1.0
