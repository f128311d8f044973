r"""Our input pipeline against google/grain on the same files, by threads and processes.

  pip install grain   # not a dependency: only this comparison needs it
  python benchmarks/input_workers.py [--images=512] [--batch=64] [--steps=12] [--rounds=3]

Both sides do the same work per image (read the JPEG, the inception crop drawn
from the image's position, DCT-scaled decode, OpenCV resize to 224, flip,
[-1, 1] floats: `vit_jax.data.images.train_image`); only the orchestration
differs: ours (`vit_jax.data.pipeline`, a thread pool filling each batch in
chunks) against grain's `MapDataset` (shuffle, map, batch) read by threads
(`ReadOptions.num_threads`) or by worker processes (`mp_prefetch`). Each rate is
the best of `--rounds` (the machine may be shared), in images per second.

It also measures the Python time per image that holds the GIL (the same work
on a 16x16 JPEG, where decoding and resizing cost almost nothing): one
process's threads cannot go faster than one image per that time, whatever the
cores. Writes `benchmarks/<time>_input_workers.json`.
"""

import argparse
import datetime
import io
import json
import os
import pathlib
import platform
import sys
import tempfile
import time

import numpy as np
from PIL import Image

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from vit_jax.bench import input_speed  # noqa: E402
from vit_jax.configs.data import add_data_config  # noqa: E402
from vit_jax.configs.data import data_config  # noqa: E402
from vit_jax.data import images  # noqa: E402
from vit_jax.data import order  # noqa: E402
from vit_jax.data import pipeline  # noqa: E402

CROP = 224


class _Work:
  """The per-image work both pipelines do, picklable for grain's worker processes."""

  def __init__(self, paths, labels):
    self.paths, self.labels = paths, labels
    self.pp = pipeline.Preprocessing(CROP, None, True, True, 0.05, 0, 0.0, 0.0)
    self.key = order.keys(0)[1]

  def __len__(self):
    return len(self.paths)

  def __getitem__(self, position):
    i = int(position) % len(self.paths)
    with open(self.paths[i], 'rb') as f:
      data = f.read()
    uniforms = order.example_uniforms(self.key, [position], images.DRAWS)[0]
    return images.to_float(images.train_image(data, uniforms, self.pp)), self.labels[i]


def _stack(batch):
  return np.stack([x for x, _ in batch]), np.array([y for _, y in batch])


def ours(folder, batch, steps, threads):
  config = add_data_config(data_config())
  config.update(dataset=folder, batch=batch, input_threads=threads)
  config.pp.crop = CROP
  it = pipeline.make_train_iterator(config, None)
  next(it)  # the pool starts, the first batches are in flight
  start = time.perf_counter()
  for _ in range(steps):
    next(it)
  return batch * steps / (time.perf_counter() - start)


def grain_rate(work, batch, steps, threads, processes):
  import grain

  ds = (
    grain.MapDataset.range(10**9)
    .shuffle(seed=0)
    .map(work.__getitem__)
    .batch(batch, batch_fn=_stack)
  )
  ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=threads, prefetch_buffer_size=2 * batch))
  if processes:
    ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=processes))
  it = iter(ds)
  next(it)
  start = time.perf_counter()
  for _ in range(steps):
    next(it)
  rate = batch * steps / (time.perf_counter() - start)
  del it
  return rate


def gil_seconds_per_image(repeats=2000):
  """Wall time per image of the whole per-image path on a 16x16 JPEG, one thread."""
  buf = io.BytesIO()
  Image.fromarray(np.full((16, 16, 3), 90, np.uint8)).save(buf, 'JPEG')
  data = buf.getvalue()
  pp = pipeline.Preprocessing(16, None, True, True, 0.05, 0, 0.0, 0.0)
  uniforms = order.example_uniforms(1, np.arange(repeats), images.DRAWS)
  out = np.empty((16, 16, 3), np.float32)
  start = time.perf_counter()
  for u in uniforms:
    images.to_float(images.train_image(data, u, pp), out)
  return (time.perf_counter() - start) / repeats


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--images', type=int, default=512)
  parser.add_argument('--batch', type=int, default=64)
  parser.add_argument('--steps', type=int, default=12)
  parser.add_argument('--rounds', type=int, default=3)
  args = parser.parse_args()
  from absl import flags
  import grain

  flags.FLAGS.mark_as_parsed()  # grain reads its absl flags' defaults

  cores = len(os.sched_getaffinity(0))
  counts = sorted({1, 2, cores})
  with tempfile.TemporaryDirectory() as tmp:
    input_speed.write_photos(tmp, args.images)
    source = pipeline.datasets.open_split(tmp, 'train')
    paths, labels = source.fetch(np.arange(source.num_examples))
    work = _Work(paths, labels)
    rates = {}
    for _ in range(args.rounds):
      for n in counts:
        for name, fn in (
          (f'ours, {n} threads', lambda: ours(tmp, args.batch, args.steps, n)),
          (f'grain, {n} threads', lambda: grain_rate(work, args.batch, args.steps, n, 0)),
          (f'grain, {n} processes', lambda: grain_rate(work, args.batch, args.steps, 1, n)),
        ):
          rates[name] = max(rates.get(name, 0.0), fn())
  gil = gil_seconds_per_image()
  for name, rate in rates.items():
    print(f'{name:24s} {rate:7.0f} img/s')
  print(f'per-image Python path on a 16x16 JPEG: {gil * 1e6:.0f} us -> at most '
        f'{1 / gil:,.0f} img/s per process')  # fmt: skip
  record = {
    'command': 'python benchmarks/input_workers.py ' + ' '.join(sys.argv[1:]),
    'cores': cores,
    'cpu': platform.processor() or platform.machine(),
    'grain': getattr(grain, '__version__', '?'),
    'images': args.images,
    'batch': args.batch,
    'crop': CROP,
    'img_per_sec': {k: round(v) for k, v in rates.items()},
    'python_us_per_image_16px': round(gil * 1e6, 1),
    'gil_ceiling_img_per_sec_per_process': round(1 / gil),
  }
  stamp = datetime.datetime.now().strftime('%Y%m%dT%H%M')
  path = ROOT / 'benchmarks' / f'{stamp}_input_workers.json'
  path.write_text(json.dumps(record, indent=2) + '\n')
  print(f'wrote {path}')


if __name__ == '__main__':
  main()
