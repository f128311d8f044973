r"""Whether self-distillation learns on the built-in digits: the demo's frozen features against the
same model's random initialisation and the raw pixels.

  python -m vit_jax.main --config=configs/dino_demo.py --workdir=workdirs/dino_demo
  python benchmarks/dino_digits.py --workdir=workdirs/dino_demo [--record]

For each of (the run's teacher, the same architecture freshly initialised, the 64 raw pixels):
few-shot linear probes (`evaluation.fewshot`: ridge on standardised features, l2 = 2^10, as
`python -m vit_jax.fewshot`) with 1, 5 and 10 images per class over seeds 0-4, and k-NN with all
1,438 training labels (`evaluation.knn`: cosine, k = 20, T = 0.07, as `python -m vit_jax.knn`),
on the 359 test images. `--record` writes `benchmarks/<time>_dino_digits.json` with the run's
summary (its steps, time and last collapse monitors) beside the figures.
"""

import argparse
import datetime
import json
import os

import jax
import numpy as np

SHOTS = (1, 5, 10)
SEEDS = (0, 1, 2, 3, 4)


def digits_pixels():
  """(train, test) as (raw 8x8 grey pixels [N, 64] float32, labels)."""
  from vit_jax.data.readers import builtin

  images, labels = builtin.load_digits()
  train, test = builtin.digits_split_indices()
  x = images[..., 0].reshape(len(images), -1).astype(np.float32)
  return (x[train], labels[train]), (x[test], labels[test])


def model_features(model, params, crop: int):
  """(train, test) features of `model` on the digits at `crop` px (evaluation preprocessing)."""
  from vit_jax.configs.data import data_config
  from vit_jax.core import sharding
  from vit_jax.data import pipeline
  from vit_jax.evaluation import fewshot

  data = data_config()
  data.update(dataset='digits', batch_eval=512)
  data.pp.crop = crop
  batch_sharding = sharding.batch_sharding(sharding.make_mesh())
  params = jax.device_put(params, sharding.replicated(batch_sharding.mesh))
  out = []
  for split in ('train', 'test'):
    batches = pipeline.make_eval_iterator(data, batch_sharding, split=split, raw=True)
    out.append(fewshot.extract_features(model, params, batches))
  return out


def figures(train, test) -> dict:
  from vit_jax.evaluation import fewshot
  from vit_jax.evaluation import knn

  probes = fewshot.fewshot_accuracy(
    *train, *test, num_classes=10, shots=SHOTS, seeds=SEEDS, l2_reg=fewshot.DEFAULT_L2_REG
  )
  return {
    **{f'{n}shot': probes[n]['mean'] for n in SHOTS},
    **{f'{n}shot_per_seed': probes[n]['per_seed'] for n in SHOTS},
    'knn': knn.knn_accuracy(*train, test[0], test[1], num_classes=10, k=20, temperature=0.07),
  }


def measure(workdir: str) -> dict:
  """The figures of the run in `workdir`, of its model at random initialisation (seed 0) and of
  the raw pixels."""
  from vit_jax.evaluation import loader

  loaded = loader.load_model(workdir)
  random_params = loaded.model.init(
    jax.random.key(0), np.zeros((1, loaded.spec.image_size, loaded.spec.image_size, 3)), train=False
  )['params']
  return {
    'teacher': figures(*model_features(loaded.model, loaded.params, loaded.spec.image_size)),
    'random_init': figures(*model_features(loaded.model, random_params, loaded.spec.image_size)),
    'raw_pixels': figures(*digits_pixels()),
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--workdir', required=True)
  parser.add_argument('--record', action='store_true')
  args = parser.parse_args()
  results = measure(args.workdir)
  for name, r in results.items():
    shots = '  '.join(f'{n}-shot {100 * r[f"{n}shot"]:.1f}%' for n in SHOTS)
    print(f'{name:12s} {shots}  k-NN {100 * r["knn"]:.1f}%')
  if args.record:
    from vit_jax import workdir as workdir_lib

    summary = workdir_lib.read_summary(args.workdir)
    record = {
      'command': 'python -m vit_jax.main --config=configs/dino_demo.py --workdir=WORKDIR',
      'run': {k: summary.get(k) for k in ('step', 'test_accuracy', 'wall_time_s', 'img_per_sec')},
      'shots': SHOTS,
      'seeds': SEEDS,
      **results,
    }
    stamp = datetime.datetime.now().strftime('%Y-%m-%dT%H%M')
    path = os.path.join(os.path.dirname(__file__), f'{stamp}_dino_digits.json')
    with open(path, 'w') as f:
      json.dump(record, f, indent=1)
    print(f'wrote {path}')


if __name__ == '__main__':
  main()
