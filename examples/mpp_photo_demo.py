"""A CPU-sized demo of masked patch prediction and the analyses (minutes on 2 cores).

Trains a tiny ViT (4 layers, width 64, 4 heads, 4x4 patches, 32x32 inputs)
with the MPP objective (paper B.1.2) on random crops of the three photos that
ship with matplotlib and scikit-learn, then writes the analysis figures for
it, analysing those same photos:

  PYTHONPATH=. python examples/mpp_photo_demo.py --steps=2000 --output=/tmp/mpp_demo

(2000 steps: 282 s on 2 shared CPU cores; final MPP loss 1.26, accuracy 0.60 on
the corrupted patches of the last batch.)

Three photos are not a dataset: this shows what the tools draw for a model
that has learned something, not a result about ViTs.
"""

import argparse
import os
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
from PIL import Image

from vit_jax import checkpoint
from vit_jax import models
from vit_jax.configs import architectures
from vit_jax.configs.model_spec import Architecture
from vit_jax.configs.model_spec import ModelSpec
from vit_jax.evaluation import classify
from vit_jax.evaluation import figures
from vit_jax.evaluation import loader
from vit_jax.models import mpp

SIZE = 32


def demo_config():
  config = architectures.MODEL_CONFIGS['testing']
  config.model_name = 'tiny MPP ViT'
  config.patches.size = (4, 4)
  config.hidden_size = 64
  # No dropout ('testing' has the official 0.1), as this demo was measured.
  config.transformer.update(num_layers=4, num_heads=4, mlp_dim=128, dropout_rate=0.0)
  return config


def photo_pyramid(files):
  """Each photo at three scales (shorter side 96, 128, 192 px), values in [-1, 1]."""
  out = []
  for path in files:
    with Image.open(path) as image:
      image = image.convert('RGB')
      for side in (96, 128, 192):
        scale = side / min(image.size)
        resized = image.resize(
          (round(image.size[0] * scale), round(image.size[1] * scale)), Image.BILINEAR
        )
        out.append(np.asarray(resized, np.float32) / 127.5 - 1.0)
  return out


def random_crops(photos, rng, batch_size):
  crops = np.empty((batch_size, SIZE, SIZE, 3), np.float32)
  for i in range(batch_size):
    photo = photos[rng.integers(len(photos))]
    y, x = rng.integers(photo.shape[0] - SIZE + 1), rng.integers(photo.shape[1] - SIZE + 1)
    crop = photo[y : y + SIZE, x : x + SIZE]
    crops[i] = crop[:, ::-1] if rng.random() < 0.5 else crop
  return crops


def train(config, photos, steps, batch_size, seed=0):
  model = mpp.MppViT(Architecture.of(config))
  params = jax.jit(
    lambda: model.init(jax.random.key(seed), jnp.zeros((1, SIZE, SIZE, 3)), train=False)
  )()['params']
  schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-3, min(200, steps // 5), steps)
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.05))
  opt_state = tx.init(params)

  @jax.jit
  def step(params, opt_state, images, rng):
    grads, metrics = jax.grad(mpp.loss_fn, has_aux=True)(
      params, images, rng, model=model, train=True
    )
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, metrics

  rng = np.random.default_rng(seed)
  start = time.time()
  for i in range(steps):
    images = random_crops(photos, rng, batch_size)
    params, opt_state, metrics = step(params, opt_state, images, jax.random.key(i))
    if i % 250 == 0 or i == steps - 1:
      print(
        f'step {i:5d}  loss {float(metrics["loss"]):.3f}  '
        f'accuracy {float(metrics["accuracy"]):.3f}  ({time.time() - start:.0f}s)',
        flush=True,
      )
  return params


def main():
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument('--steps', type=int, default=2000)
  parser.add_argument('--batch_size', type=int, default=32)
  parser.add_argument('--output', required=True)
  args = parser.parse_args()

  config = demo_config()
  files = classify.builtin_images()
  params = train(config, photo_pyramid(files), args.steps, args.batch_size)
  path = checkpoint.save_npz(params, os.path.join(args.output, 'mpp_demo.npz'))

  backbone = {k: v for k, v in params.items() if k not in ('mask_token', 'mpp_head')}
  spec = ModelSpec(Architecture.of(config), SIZE)
  loaded = loader.LoadedModel(models.build(spec, None), backbone, spec)
  images = np.stack([classify.read_image(f, SIZE) for f in files])
  result = figures.compute(loaded, images, num_components=28)
  names = figures.write_outputs(
    result,
    loaded,
    images,
    files,
    types.SimpleNamespace(output=args.output, model=config.model_name, checkpoint=path),
  )
  print(f'wrote {path} and {", ".join(names)} to {args.output}')
  print(
    'mean attention distance (pixels), per layer:',
    np.round(result['attention_distance'].mean(axis=1), 1).tolist(),
  )


if __name__ == '__main__':
  main()
