"""Throughput of the input pipeline alone, where its time goes, and the decode ceiling.

`write_photos` makes an ImageNet-like folder of JPEGs from scikit-learn's two
sample photographs; `measure` times the train pipeline with 1, 2, ... threads
(uint8 host batches, as they cross to the devices), the same photos held in
memory and the built-in digits at the same threads, the evaluation pipeline
and a bare single-thread PIL decode of the same files (the ceiling); the bare
decode in n processes at once (the machine's own per-core rate with n cores
busy), optionally the cores split into processes x threads; it splits one
training image's time into stages, and times RandAugment with mixup, record
shards and a restore far into a run. `python -m vit_jax.benchmark_input` is
the command line.
"""

import io
import os
import platform
import time

import ml_collections
import numpy as np
from PIL import Image

from vit_jax.configs.data import add_data_config
from vit_jax.core.errors import UserError
from vit_jax.data import datasets
from vit_jax.data import images
from vit_jax.data import pipeline

# ImageNet's common sizes (width, height).
SIZES = ((500, 375), (375, 500), (640, 480), (500, 333), (480, 640))


class FolderError(UserError, ValueError):
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
  from vit_jax.data.readers import folder

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
    ['read', 'header_and_crop', 'entropy_decode', 'idct_and_colour', 'resize', 'flip'],
    0.0,
  )
  uniforms = order.example_uniforms(1, np.arange(len(paths)), images.DRAWS)
  for path, u in zip(paths, uniforms):
    t = [time.perf_counter()]
    data = _read(path)
    t.append(time.perf_counter())
    height, width = images.image_size(data)
    y, x, h, w = images.crop_window(u, height, width, area_min)
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
    cv2.flip(out, 1, dst=out)  # in place, as the pipeline (floats are made on the devices)
    t.append(time.perf_counter())
    for name, a, b in zip(timings, t, t[1:]):
      timings[name] += b - a
  # The scaled decode includes the entropy decoding the 1/8 decode measured.
  timings['idct_and_colour'] = max(0.0, timings['idct_and_colour'] - timings['entropy_decode'])
  return {k: v / len(paths) for k, v in timings.items()}


def _config(dataset, batch, **overrides):
  config = add_data_config(ml_collections.ConfigDict())
  config.dataset, config.batch, config.batch_eval, config.pp.crop = dataset, batch, batch, 224
  config.eval_cache_mb = 0
  config.update_from_flattened_dict(overrides)
  return config


def time_train(dataset, batch, steps, start_step=0, **overrides):
  """(first batch seconds, img/s, process CPU seconds per image) of host train batches (uint8,
  as they cross to the devices)."""
  config = _config(dataset, batch, **overrides)
  it = pipeline.make_train_iterator(config, None, state={'step': start_step}, raw=True)
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
  for b in pipeline.make_eval_iterator(config, None, split='train', raw=True):
    n += len(b['mask'])
  return n / (time.perf_counter() - t0)


def to_device_seconds(batch, dtype=np.uint8):
  """Seconds to hand one host batch of `dtype` to the default device (`jax.device_put`)."""
  import jax

  x = np.zeros((batch, 224, 224, 3), dtype)
  jax.device_put(x).block_until_ready()
  t0 = time.perf_counter()
  for _ in range(5):
    jax.device_put(x).block_until_ready()
  return (time.perf_counter() - t0) / 5


# ---------------------------------------------------------------------------
# The same photos in memory, and the machine's cores.

PHOTO_SHAPE = (375, 500)  # (height, width): ImageNet's most common size
ARRAYS_NAME = 'benchmark_input_photos'


def register_photo_arrays(paths, limit=1024):
  """The first `limit` images of `paths` decoded, at one size, as in-memory dataset ARRAYS_NAME:
  the JPEG folder's pixels without its decoding (`datasets.register_arrays`)."""
  cv2 = images._cv2()
  x = np.empty((min(limit, len(paths)), *PHOTO_SHAPE, 3), np.uint8)
  for i, path in enumerate(paths[: len(x)]):
    image = images.decode(_read(path))
    if image.shape[:2] != PHOTO_SHAPE:
      image = cv2.resize(image, PHOTO_SHAPE[::-1], interpolation=cv2.INTER_AREA)
    x[i] = image
  labels = np.arange(len(x)) % 10
  return datasets.register_arrays(ARRAYS_NAME, x_train=x, y_train=labels)


def topology() -> dict:
  """Logical CPUs, physical cores and sockets (/proc/cpuinfo), and the CPUs this process may
  use: a per-core rate means something else on hyperthreads."""
  logical, cores, model = 0, set(), ''
  try:
    with open('/proc/cpuinfo', encoding='utf-8') as f:
      block = {}
      for line in f.read().splitlines() + ['']:
        if line.strip():
          key, _, value = line.partition(':')
          block[key.strip()] = value.strip()
          continue
        if 'processor' in block:
          logical += 1
          cores.add((block.get('physical id', '0'), block.get('core id', str(logical))))
          model = block.get('model name', model)
        block = {}
  except OSError:
    pass
  return {
    'model': model,
    'logical_cpus': logical or os.cpu_count(),
    'physical_cores': len(cores) or None,
    'sockets': len({socket for socket, _ in cores}) or None,
    'usable_cpus': len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else None,
  }


# ---------------------------------------------------------------------------
# Several processes at once: the machine's own scaling, and processes against threads.


def _decode_unit(paths):
  state = {'i': 0}

  def unit():
    path = paths[state['i'] % len(paths)]
    state['i'] += 1
    with Image.open(io.BytesIO(_read(path))) as image:
      image.convert('RGB').load()
    return 1

  return unit


def _train_unit(dataset, batch, threads):
  it = pipeline.make_train_iterator(_config(dataset, batch, input_threads=threads), None, raw=True)
  return lambda: len(next(it)['image'])


def _one_process(kind, args, barrier, seconds, results):
  """One of several processes timed together: set up, wait for all, count for `seconds`."""
  import jax

  # Host work only: no process of many may take an accelerator (JAX would claim its memory).
  jax.config.update('jax_platforms', 'cpu')
  unit = _decode_unit(*args) if kind == 'decode' else _train_unit(*args)
  unit()  # warm: imports, the folder's check, the first batch
  barrier.wait()
  count, t0 = 0, time.perf_counter()
  while time.perf_counter() - t0 < seconds:
    count += unit()
  results.put(count / (time.perf_counter() - t0))


def concurrent_rates(kind, args, processes: int, seconds: float) -> list:
  """img/s of each of `processes` processes running at once: 'decode' (a bare single-thread PIL
  decode of `args` = (paths,)) or 'train' (the pipeline, `args` = (dataset, batch, threads))."""
  import multiprocessing

  context = multiprocessing.get_context('spawn')  # no fork of a process that runs JAX
  barrier, results = context.Barrier(processes), context.Queue()
  workers = [
    context.Process(target=_one_process, args=(kind, args, barrier, seconds, results))
    for _ in range(processes)
  ]
  for worker in workers:
    worker.start()
  rates = [results.get(timeout=600) for _ in workers]
  for worker in workers:
    worker.join()
  return sorted(rates)


# ---------------------------------------------------------------------------
# The whole measurement (python -m vit_jax.benchmark_input).


def training_folder(dataset, images: int, work_dir: str):
  """(folder, its train images): `dataset`, or `images` photos written into `work_dir`."""
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


def measure(folder, paths, *, batch, steps, threads, rounds, quick, work_dir, processes=(),
            say=print) -> dict:  # fmt: skip
  """The record of `python -m vit_jax.benchmark_input`; `say` prints its lines."""
  size = sum(os.path.getsize(p) for p in paths) / len(paths)
  out = {
    'dataset': folder,
    'files': len(paths),
    'mean_file_kB': round(size / 1024, 1),
    'batch': batch,
    'cores': os.cpu_count(),
    'machine': topology(),
    'load_average_before': os.getloadavg()[0],
    'python': platform.python_version(),
  }
  say(f'{len(paths)} images, {size / 1024:.0f} kB each, {os.cpu_count()} cores: {out["machine"]}')
  in_memory = {'photos': register_photo_arrays(paths), 'digits': 'digits'}
  ceiling, by_threads, memory = _rounds(folder, paths, batch, steps, threads, rounds, in_memory)
  out.update(decode_only_img_per_sec=round(ceiling), rounds=rounds)
  say(f'ceiling: bare PIL decode to RGB, 1 thread: {ceiling:.0f} img/s (best of {rounds})')
  out['threads'] = _thread_records(by_threads, ceiling, say)
  best = max(by_threads)
  for key in ('img_per_sec', 'img_per_sec_per_core', 'ratio_per_core_to_decode_only'):
    out[key] = out['threads'][best][key]
  out['in_memory'] = _in_memory_records(memory, by_threads, say)
  if any(n > 1 for n in threads):
    out['decode_in_parallel'] = _parallel_ceiling(paths, threads, out['threads'], say)
  if processes:
    out['processes'] = _process_grid(folder, batch, max(threads), processes, say)
  if not quick:
    out.update(_beyond_plain_training(folder, paths, batch, steps, best, work_dir, out, say))
  out['load_average_after'] = os.getloadavg()[0]
  return out


def _rounds(folder, paths, batch, steps, threads, rounds, in_memory):
  """(ceiling, {threads: (img/s, CPU s per image)}, {name: {threads: (img/s, CPU s)}}), each the
  best of `rounds`: the machine may be shared, so measurements alternate and each keeps its
  best; in-memory data is timed right after the folder at the same threads."""
  ceiling, by_threads, memory = 0.0, {}, {name: {} for name in in_memory}

  def keep(table, n, result):
    if result[1] > table.get(n, (0, 0))[0]:
      table[n] = result[1:]

  for _ in range(rounds):
    ceiling = max(ceiling, bare_decode_rate(paths, seconds=2.0))
    for n in threads:
      keep(by_threads, n, time_train(folder, batch, steps, input_threads=n))
      for name, dataset in in_memory.items():
        keep(memory[name], n, time_train(dataset, batch, steps * 4, input_threads=n))
  return ceiling, by_threads, memory


def _thread_records(by_threads, ceiling, say) -> dict:
  records = {}
  for n, (rate, cpu) in sorted(by_threads.items()):
    say(
      f'input pipeline, {n} thread(s): {rate:.0f} img/s = {rate / n:.0f} per core '
      f'({1 / cpu:.0f} per CPU-second of the process); {rate / n / ceiling:.2f} x the ceiling '
      'per core'
    )
    records[n] = {
      'img_per_sec': round(rate),
      'img_per_sec_per_core': round(rate / n),
      'img_per_cpu_second': round(1 / cpu),
      'ratio_per_core_to_decode_only': round(rate / n / ceiling, 3),
    }
  return records


def _in_memory_records(memory, by_threads, say) -> dict:
  """Each in-memory dataset against the JPEG folder at the same threads (the same rounds)."""
  records = {}
  for name, table in memory.items():
    records[name] = {}
    for n, (rate, cpu) in sorted(table.items()):
      ratio = rate / by_threads[n][0]
      say(
        f'in memory ({name}), {n} thread(s): {rate:.0f} img/s ({1 / cpu:.0f} per CPU-second), '
        f'{ratio:.2f} x the JPEG folder'
      )
      records[name][n] = {
        'img_per_sec': round(rate),
        'img_per_cpu_second': round(1 / cpu),
        'ratio_to_jpeg_folder': round(ratio, 2),
      }
  return records


def _parallel_ceiling(paths, threads, records, say) -> dict:
  """The bare decode in n processes at once (no GIL, no pipeline): the machine's own per-core
  rate at n busy cores (turbo, shared caches, hyperthreads), against the pipeline's."""
  out = {}
  for n in sorted(t for t in set(threads) if t > 1):
    rates = concurrent_rates('decode', (paths,), n, seconds=2.0)
    per_core = sum(rates) / n
    ratio = records[n]['img_per_sec_per_core'] / per_core
    records[n]['ratio_per_core_to_parallel_decode'] = round(ratio, 3)
    out[n] = round(per_core)
    say(
      f'bare decode in {n} processes at once: {per_core:.0f} img/s per process; the pipeline '
      f'at {n} threads: {ratio:.2f} x that per core'
    )
  return out


def _process_grid(folder, batch, cores, processes, say) -> dict:
  """`cores` split as P processes x cores / P threads, all at once: processes against threads."""
  out = {}
  for p in processes:
    rates = concurrent_rates('train', (folder, batch, max(1, cores // p)), p, seconds=6.0)
    out[f'{p}x{max(1, cores // p)}'] = {'img_per_sec': round(sum(rates)), 'per_process': [
      round(r) for r in rates]}  # fmt: skip
    say(
      f'{p} process(es) x {max(1, cores // p)} threads: {sum(rates):.0f} img/s '
      f'({sum(rates) / cores:.0f} per core)'
    )
  return out


def measure_arrays(dataset, *, batch, steps, threads, rounds, say=print) -> dict:
  """The pipeline on an in-memory dataset (`.npz`, `.npy` folder, digits) by threads."""
  info = pipeline.get_info(_config(dataset, batch, **{'pp.test': 'train[:1]'}))
  by_threads = {}
  for _ in range(rounds):
    for n in threads:
      _, rate, cpu = time_train(dataset, batch, steps, input_threads=n)
      if rate > by_threads.get(n, (0, 0))[0]:
        by_threads[n] = (rate, cpu)
  out = {'dataset': dataset, 'examples': info.num_train, 'batch': batch, 'cores': os.cpu_count(),
         'machine': topology(), 'rounds': rounds, 'threads': {}}  # fmt: skip
  for n, (rate, cpu) in sorted(by_threads.items()):
    say(f'{dataset}, {n} thread(s): {rate:.0f} img/s ({1 / cpu:.0f} per CPU-second)')
    out['threads'][n] = {'img_per_sec': round(rate), 'img_per_cpu_second': round(1 / cpu)}
  out['img_per_sec'] = out['threads'][max(by_threads)]['img_per_sec']
  return out


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
  put, put_float = to_device_seconds(batch), to_device_seconds(batch, np.float32)
  more['host_to_device_ms_per_batch'] = round(put * 1e3, 2)
  more['host_to_device_ms_per_batch_float32'] = round(put_float * 1e3, 2)
  say(
    f'host to device (jax.device_put, CPU here): {put * 1e3:.1f} ms per uint8 batch, '
    f'{put_float * 1e3:.1f} ms as float32'
  )

  augmented = {'pp.randaug_layers': 2, 'pp.randaug_magnitude': 10, 'pp.mixup': 0.2}
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
  from vit_jax.data.readers import shards as shard_files

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
