"""Throughput of the train input pipeline alone: test images and a timed loop.

`write_jpegs` makes an ImageNet-like folder of JPEGs, `time_pipeline` times
host batches of the train pipeline over it. `python -m vit_jax.benchmark_input`
is the command line.
"""

import os
import time

import ml_collections
import numpy as np
from PIL import Image

from vit_jax.data import pipeline


def write_jpegs(root, n, classes=10, seed=0):
  rng = np.random.default_rng(seed)
  for c in range(classes):
    os.makedirs(os.path.join(root, 'train', f'class{c}'), exist_ok=True)
  yy, xx = np.mgrid[0:375, 0:500]
  for i in range(n):
    h, w = ((375, 500), (300, 400))[i % 2]
    # Smooth colour fields plus noise: JPEG sizes like photos (~50-100 kB).
    base = np.stack(
      [
        np.sin(xx[:h, :w] / rng.uniform(5, 40) + rng.uniform(0, 6)),
        np.cos(yy[:h, :w] / rng.uniform(5, 40)),
        np.sin((xx[:h, :w] + yy[:h, :w]) / rng.uniform(5, 40)),
      ],
      -1,
    )
    pixels = np.clip(127 + 100 * base + rng.normal(0, 20, (h, w, 3)), 0, 255).astype(np.uint8)
    Image.fromarray(pixels).save(
      os.path.join(root, 'train', f'class{i % classes}', f'{i}.jpg'), quality=90
    )


def time_pipeline(dataset, batch, steps, start_step=0):
  config = pipeline.add_data_config(ml_collections.ConfigDict())
  config.dataset, config.batch, config.pp.crop = dataset, batch, 224
  it = pipeline.make_train_iterator(config, None, state={'step': start_step})
  t0 = time.perf_counter()
  next(it)
  first = time.perf_counter() - t0
  t0 = time.perf_counter()
  for _ in range(steps):
    next(it)
  return first, steps * batch / (time.perf_counter() - t0)
