"""Throughput of the train input pipeline alone, at 224 px, on this machine.

  python -m vit_jax.benchmark_input --images 2000 --batch 128 --steps 30

Writes a folder of JPEGs (sizes around ImageNet's mean, 500x375 and 400x300)
and the same images as TFRecord shards into a temp dir, then times host
batches (no devices) of the train pipeline: inception crop, flip, resize to
224, [-1, 1] floats. Also times a restore late in training (step 10^6).
"""

import argparse
import os
import tempfile
import time

import ml_collections
import numpy as np
from PIL import Image

from vit_jax import datasets
from vit_jax import input_pipeline
from vit_jax import jft


def write_jpegs(root, n, classes=10, seed=0):
  rng = np.random.default_rng(seed)
  for c in range(classes):
    os.makedirs(os.path.join(root, 'train', f'class{c}'), exist_ok=True)
  yy, xx = np.mgrid[0:375, 0:500]
  for i in range(n):
    h, w = ((375, 500), (300, 400))[i % 2]
    # Smooth colour fields plus noise: JPEG sizes like photos (~50-100 kB).
    base = np.stack([np.sin(xx[:h, :w] / rng.uniform(5, 40) + rng.uniform(0, 6)),
                     np.cos(yy[:h, :w] / rng.uniform(5, 40)),
                     np.sin((xx[:h, :w] + yy[:h, :w]) / rng.uniform(5, 40))], -1)
    pixels = np.clip(127 + 100 * base + rng.normal(0, 20, (h, w, 3)), 0, 255).astype(np.uint8)
    Image.fromarray(pixels).save(os.path.join(root, 'train', f'class{i % classes}', f'{i}.jpg'),
                                 quality=90)


def time_pipeline(dataset, batch, steps, start_step=0):
  config = input_pipeline.add_data_config(ml_collections.ConfigDict())
  config.dataset, config.batch, config.pp.crop = dataset, batch, 224
  it = input_pipeline.make_train_iterator(config, None, state={'step': start_step})
  t0 = time.perf_counter()
  next(it)
  first = time.perf_counter() - t0
  t0 = time.perf_counter()
  for _ in range(steps):
    next(it)
  return first, steps * batch / (time.perf_counter() - t0)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--images', type=int, default=2000)
  parser.add_argument('--batch', type=int, default=128)
  parser.add_argument('--steps', type=int, default=30)
  parser.add_argument('--dir', help='work dir (default: a new temp dir)')
  args = parser.parse_args()
  root = args.dir or tempfile.mkdtemp(prefix='vit_jax_bench_')
  folder = os.path.join(root, 'folder')
  shards = os.path.join(root, 'shards')
  if not os.path.isdir(folder):
    write_jpegs(folder, args.images)
  t0 = time.perf_counter()
  datasets.open_split(folder, 'train')
  check = time.perf_counter() - t0
  if not os.path.isdir(shards):
    jft.main(['--folder', os.path.join(folder, 'train'), '--out', shards, '--shards', '8'])
  size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(folder) for f in fs)
  print(f'{args.images} JPEGs, {size / args.images / 1024:.0f} kB each; '
        f'opening the folder (checks every file): {args.images / check:.0f} files/s')
  for name, path in (('image folder', folder), ('TFRecord shards', shards)):
    first, rate = time_pipeline(path, args.batch, args.steps)
    print(f'{name}: {rate:.0f} img/s at 224 px (batch {args.batch}, {os.cpu_count()} cores); '
          f'first batch {first:.2f} s')
  first, _ = time_pipeline(shards, args.batch, 1, start_step=10**6)
  print(f'restore at step 1,000,000: first batch {first:.2f} s (no replay)')


if __name__ == '__main__':
  main()
