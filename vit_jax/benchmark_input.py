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

from vit_jax import run_log


def main():
  parser = argparse.ArgumentParser(
    prog='python -m vit_jax.benchmark_input', description=__doc__.split('\n\n')[0]
  )
  parser.add_argument('--images', type=int, default=2000)
  parser.add_argument('--batch', type=int, default=128)
  parser.add_argument('--steps', type=int, default=30)
  parser.add_argument('--dir', help='work dir (default: a new temp dir)')
  run_log.add_verbosity_flag(parser)
  args = parser.parse_args()
  run_log.quiet_libraries(args.verbosity)

  from vit_jax.bench import input_speed
  from vit_jax.data import datasets
  from vit_jax.data import shards as shard_files

  root = args.dir or tempfile.mkdtemp(prefix='vit_jax_bench_')
  folder = os.path.join(root, 'folder')
  shards = os.path.join(root, 'shards')
  if not os.path.isdir(folder):
    input_speed.write_jpegs(folder, args.images)
  t0 = time.perf_counter()
  datasets.open_split(folder, 'train')
  check = time.perf_counter() - t0
  if not os.path.isdir(shards):
    examples, names = shard_files.examples_from_folder(os.path.join(folder, 'train'))
    shard_files.write_shards(
      examples, shards, 'train', num_classes=len(names), class_names=names, num_shards=8
    )
  size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(folder) for f in fs)
  print(
    f'{args.images} JPEGs, {size / args.images / 1024:.0f} kB each; '
    f'opening the folder (checks every file): {args.images / check:.0f} files/s'
  )
  for name, path in (('image folder', folder), ('TFRecord shards', shards)):
    first, rate = input_speed.time_pipeline(path, args.batch, args.steps)
    print(
      f'{name}: {rate:.0f} img/s at 224 px (batch {args.batch}, {os.cpu_count()} cores); '
      f'first batch {first:.2f} s'
    )
  first, _ = input_speed.time_pipeline(shards, args.batch, 1, start_step=10**6)
  print(f'restore at step 1,000,000: first batch {first:.2f} s (no replay)')


if __name__ == '__main__':
  main()
