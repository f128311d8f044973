"""Throughput of the input pipeline alone, where its time goes, and the decode ceiling.

`write_photos` makes an ImageNet-like folder of JPEGs from scikit-learn's two
sample photographs; `measure` times the train pipeline (host and tf.data), the
evaluation pipeline and a bare single-thread PIL decode of the same files (the
ceiling), and splits one training image's time into stages.
`python -m vit_jax.benchmark_input` is the command line.
"""

import io
import os
import time

import ml_collections
import numpy as np
from PIL import Image

from vit_jax.data import host
from vit_jax.data import pipeline

# ImageNet's common sizes (width, height).
SIZES = ((500, 375), (375, 500), (640, 480), (500, 333), (480, 640))


def write_photos(root, n, classes=10, seed=0):
  """n JPEGs (quality 95, ~85 kB) of crops of scikit-learn's sample photos, in ROOT/train/<class>."""
  from sklearn.datasets import load_sample_images

  photos = load_sample_images().images
  rng = np.random.default_rng(seed)
  classes = min(classes, n)  # no empty class folders
  for c in range(classes):
    os.makedirs(os.path.join(root, 'train', f'class{c}'), exist_ok=True)
  for i in range(n):
    photo = photos[i % len(photos)]
    width, height = SIZES[i % len(SIZES)]
    scale = rng.uniform(0.6, 1.0)
    ch = int(photo.shape[0] * scale)
    cw = int(min(photo.shape[1], ch * width / height))
    y = rng.integers(0, photo.shape[0] - ch + 1)
    x = rng.integers(0, photo.shape[1] - cw + 1)
    image = Image.fromarray(photo[y : y + ch, x : x + cw])
    image = image.resize((width, height), Image.Resampling.BICUBIC)
    if rng.random() < 0.5:
      image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    image.save(os.path.join(root, 'train', f'class{i % classes}', f'{i}.jpg'), quality=95)


def image_files(root):
  """Sorted paths of the images (any extension image folders accept) under `root`."""
  from vit_jax.data import folder

  return sorted(
    os.path.join(d, f)
    for d, _, fs in os.walk(root)
    for f in fs
    if f.lower().endswith(folder.EXTENSIONS)
  )


def _read(path):
  with open(path, 'rb') as f:
    return f.read()


def bare_decode_rate(paths, seconds=3.0):
  """img/s of read + full PIL decode to RGB, one thread: the ceiling."""
  count, t0 = 0, time.perf_counter()
  while time.perf_counter() - t0 < seconds:
    for path in paths:
      with Image.open(io.BytesIO(_read(path))) as image:
        image.convert('RGB').load()
      count += 1
  return count / (time.perf_counter() - t0)


def stages(paths, crop=224, area_min=0.05, limit=200):
  """Seconds per image of each step of a training JPEG (the first `limit`), one thread."""
  from vit_jax.data import order

  cv2 = host._cv2()
  paths = [p for p in paths if p.lower().endswith(('.jpg', '.jpeg'))][:limit]
  if not paths:
    return {}
  timings = dict.fromkeys(
    ['read', 'header_and_crop', 'entropy_decode', 'idct_and_colour', 'resize', 'flip_and_float'],
    0.0,
  )
  uniforms = order.example_uniforms(1, np.arange(len(paths)), host.ATTEMPTS * 4 + 1)
  for path, u in zip(paths, uniforms):
    t = [time.perf_counter()]
    data = _read(path)
    t.append(time.perf_counter())
    height, width = host.image_size(data)
    y, x, h, w = host.crop_window_one(u, height, width, area_min)
    t.append(time.perf_counter())
    host.decode(data, max(1, height // 8), max(1, width // 8))  # 1/8 scale: ~entropy decoding
    t.append(time.perf_counter())
    scale = host.dct_scale(h, w, crop)
    image = host.decode(data, -(-height // scale), -(-width // scale), fast=True)
    t.append(time.perf_counter())
    sy, sx = image.shape[0] / height, image.shape[1] / width
    region = image[round(y * sy) : round((y + h) * sy), round(x * sx) : round((x + w) * sx)]
    out = cv2.resize(region, (crop, crop), interpolation=cv2.INTER_LINEAR)
    t.append(time.perf_counter())
    host.to_float(cv2.flip(out, 1))
    t.append(time.perf_counter())
    for name, a, b in zip(timings, t, t[1:]):
      timings[name] += b - a
  # The scaled decode includes the entropy decoding the 1/8 decode measured.
  timings['idct_and_colour'] = max(0.0, timings['idct_and_colour'] - timings['entropy_decode'])
  return {k: v / len(paths) for k, v in timings.items()}


def _config(dataset, batch, **overrides):
  config = pipeline.add_data_config(ml_collections.ConfigDict())
  config.dataset, config.batch, config.batch_eval, config.pp.crop = dataset, batch, batch, 224
  config.eval_cache_mb = 0
  config.update_from_flattened_dict(overrides)
  return config


def time_train(dataset, batch, steps, start_step=0, **overrides):
  """(first batch seconds, img/s, process CPU seconds per image) of host train batches."""
  config = _config(dataset, batch, **overrides)
  it = pipeline.make_train_iterator(config, None, state={'step': start_step})
  t0 = time.perf_counter()
  next(it)
  first = time.perf_counter() - t0
  cpu0, t0 = time.process_time(), time.perf_counter()
  for _ in range(steps):
    next(it)
  wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
  return first, steps * batch / wall, cpu / max(1, steps * batch)


def time_eval(dataset, batch, **overrides):
  """img/s of one evaluation pass (resize + centre crop, exact pixels), no cache."""
  config = _config(dataset, batch, **overrides)
  t0, n = time.perf_counter(), 0
  for b in pipeline.make_eval_iterator(config, None, split='train'):
    n += len(b['mask'])
  return n / (time.perf_counter() - t0)


def to_device_seconds(batch):
  """Seconds to hand one host batch to the default device (`jax.device_put`)."""
  import jax

  x = np.zeros((batch, 224, 224, 3), np.float32)
  jax.device_put(x).block_until_ready()
  t0 = time.perf_counter()
  for _ in range(5):
    jax.device_put(x).block_until_ready()
  return (time.perf_counter() - t0) / 5
