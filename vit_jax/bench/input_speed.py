"""Throughput of the input pipeline alone, where its time goes, and the decode ceiling.

`write_photos` makes an ImageNet-like folder of JPEGs from scikit-learn's two
sample photographs; `measure` times the train pipeline with 1, 2, ... threads, the
evaluation pipeline and a bare single-thread PIL decode of the same files (the
ceiling), splits one training image's time into stages, and times RandAugment
with mixup, record shards and a restore far into a run.
`python -m vit_jax.benchmark_input` is the command line.
"""

import io
import os
import platform
import time

import ml_collections
import numpy as np
from PIL import Image

from vit_jax.data import images
from vit_jax.data import pipeline

# ImageNet's common sizes (width, height).
SIZES = ((500, 375), (375, 500), (640, 480), (500, 333), (480, 640))


class FolderError(ValueError):
  """A --dataset that is not an image folder; one line."""


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

  return [os.path.join(root, f) for f in folder.images_under(root)[0]]


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

  cv2 = images._cv2()
  paths = [p for p in paths if p.lower().endswith(('.jpg', '.jpeg'))][:limit]
  if not paths:
    return {}
  timings = dict.fromkeys(
    ['read', 'header_and_crop', 'entropy_decode', 'idct_and_colour', 'resize', 'flip_and_float'],
    0.0,
  )
  uniforms = order.example_uniforms(1, np.arange(len(paths)), images.DRAWS)
  for path, u in zip(paths, uniforms):
    t = [time.perf_counter()]
    data = _read(path)
    t.append(time.perf_counter())
    height, width = images.image_size(data)
    y, x, h, w = images.crop_window_one(u, height, width, area_min)
    t.append(time.perf_counter())
    images.decode(data, max(1, height // 8), max(1, width // 8))  # 1/8 scale: ~entropy decoding
    t.append(time.perf_counter())
    scale = images.dct_scale(h, w, crop)
    image = images.decode(data, -(-height // scale), -(-width // scale), fast=True)
    t.append(time.perf_counter())
    sy, sx = image.shape[0] / height, image.shape[1] / width
    region = image[round(y * sy) : round((y + h) * sy), round(x * sx) : round((x + w) * sx)]
    out = cv2.resize(region, (crop, crop), interpolation=cv2.INTER_LINEAR)
    t.append(time.perf_counter())
    images.to_float(cv2.flip(out, 1))
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


# ---------------------------------------------------------------------------
# The whole measurement (python -m vit_jax.benchmark_input).


def training_folder(dataset, images: int, work_dir: str):
  """(folder, its train images): `dataset`, or `images` photos written into `work_dir`."""
  from vit_jax.data import datasets

  folder = dataset or os.path.join(work_dir, 'folder')
  if not dataset and not os.path.isdir(folder):
    write_photos(folder, images)
  train_dir = os.path.join(folder, 'train')
  layout = 'pass a folder laid out as DIR/train/<class>/<image>'
  if not os.path.isdir(train_dir):
    raise FolderError(f'{folder}: no train/ folder; {layout}')
  paths = image_files(train_dir)
  if not paths:
    raise FolderError(f'{train_dir}: no images; {layout}')
  datasets.open_split(folder, 'train')
  return folder, paths


def measure(folder, paths, *, batch, steps, threads, rounds, quick, work_dir, say=print) -> dict:
  """The record of `python -m vit_jax.benchmark_input`; `say` prints its lines."""
  size = sum(os.path.getsize(p) for p in paths) / len(paths)
  out = {
    'dataset': folder,
    'files': len(paths),
    'mean_file_kB': round(size / 1024, 1),
    'batch': batch,
    'cores': os.cpu_count(),
    'load_average_before': os.getloadavg()[0],
    'python': platform.python_version(),
  }
  say(f'{len(paths)} images, {size / 1024:.0f} kB each, {os.cpu_count()} cores')
  ceiling, by_threads = _rounds(folder, paths, batch, steps, threads, rounds)
  out.update(decode_only_img_per_sec=round(ceiling), rounds=rounds)
  say(f'ceiling: bare PIL decode to RGB, 1 thread: {ceiling:.0f} img/s (best of {rounds})')
  out['threads'] = {}
  for n, (rate, cpu) in sorted(by_threads.items()):
    say(
      f'input pipeline, {n} thread(s): {rate:.0f} img/s = {rate / n:.0f} per core '
      f'({1 / cpu:.0f} per CPU-second of the process); {rate / n / ceiling:.2f} x the ceiling '
      'per core'
    )
    out['threads'][n] = {
      'img_per_sec': round(rate),
      'img_per_sec_per_core': round(rate / n),
      'img_per_cpu_second': round(1 / cpu),
      'ratio_per_core_to_decode_only': round(rate / n / ceiling, 3),
    }
  best = max(by_threads)
  for key in ('img_per_sec', 'img_per_sec_per_core', 'ratio_per_core_to_decode_only'):
    out[key] = out['threads'][best][key]
  if not quick:
    out.update(_beyond_plain_training(folder, paths, batch, steps, best, work_dir, out, say))
  out['load_average_after'] = os.getloadavg()[0]
  return out


def _rounds(folder, paths, batch, steps, threads, rounds):
  """(ceiling, {threads: (img/s, CPU s per image)}), each the best of `rounds`: the machine
  may be shared, so measurements alternate and each keeps its best."""
  ceiling, by_threads = 0.0, {}
  for _ in range(rounds):
    ceiling = max(ceiling, bare_decode_rate(paths, seconds=2.0))
    for n in threads:
      _, rate, cpu = time_train(folder, batch, steps, input_threads=n)
      if rate > by_threads.get(n, (0, 0))[0]:
        by_threads[n] = (rate, cpu)
  return ceiling, by_threads


def _beyond_plain_training(folder, paths, batch, steps, threads, work_dir, out, say) -> dict:
  """Stages of one image, host to device, RandAugment + mixup, evaluation, shards, restore."""
  more = {}
  stage = stages(paths)
  if not stage:
    say('no JPEGs: no per-stage times')
    stage = {'no_jpegs': 0.0}
  total = sum(stage.values()) or 1.0
  more['stage_ms_per_image'] = {k: round(v * 1e3, 3) for k, v in stage.items()}
  say(
    'one training image, 1 thread: '
    + ', '.join(f'{k} {v * 1e3:.2f} ms ({v / total:.0%})' for k, v in stage.items())
  )
  put = to_device_seconds(batch)
  more['host_to_device_ms_per_batch'] = round(put * 1e3, 2)
  say(f'host to device (jax.device_put, CPU here): {put * 1e3:.1f} ms per batch')

  augmented = {'pp.randaug_layers': 2, 'pp.randaug_magnitude': 15, 'pp.mixup': 0.2}
  _, rate, _ = time_train(folder, batch, steps, input_threads=threads, **augmented)
  more['randaugment_mixup_img_per_sec'] = round(rate)
  more['randaugment_mixup_ratio_to_plain'] = round(rate / out['img_per_sec'], 3)
  say(
    f'with RandAugment 2x15 and mixup 0.2: {rate:.0f} img/s '
    f'({rate / out["img_per_sec"]:.2f} x plain)'
  )
  rate = time_eval(folder, batch, input_threads=threads, **{'pp.resize': 256})
  more['eval_img_per_sec'] = round(rate)
  say(f'evaluation (resize 256, centre crop 224, exact pixels): {rate:.0f} img/s')
  more.update(_shards(folder, batch, steps, threads, work_dir, say))
  return more


def _shards(folder, batch, steps, threads, work_dir, say) -> dict:
  """The pipeline on record shards of the same images, and a restore at step 10^6."""
  from vit_jax.data import shards as shard_files

  file_format = 'tfrecord'  # the format `python -m vit_jax.jft` writes by default
  shards = os.path.join(work_dir, f'shards_{file_format}')
  if not os.path.isdir(shards):
    examples, names = shard_files.examples_from_folder(os.path.join(folder, 'train'))
    shard_files.write_shards(
      examples,
      shards,
      'train',
      num_classes=len(names),
      class_names=names,
      num_shards=8,
      file_format=file_format,
    )
  _, rate, _ = time_train(shards, batch, steps, input_threads=threads)
  say(f'{file_format} shards: {rate:.0f} img/s')
  t0 = time.perf_counter()
  time_train(shards, batch, 0, start_step=10**6)
  restore = round(time.perf_counter() - t0, 2)
  say(f'restore at step 1,000,000: first batch {restore} s')
  return {
    f'{file_format}_shards_img_per_sec': round(rate),
    'restore_at_step_1e6_first_batch_s': restore,
  }
