"""Few-shot linear evaluation (paper 4.1) of a checkpoint.

  python -m vit_jax.fewshot --checkpoint=ViT-B_16.npz --model=ViT-B_16 --datasets=cifar10,pets

Prints the accuracies per dataset and shot count (mean over seeds); with a
workdir, also writes them there, into files of its own (`fewshot.json`,
TensorBoard under `tensorboard/fewshot`): a training run's `summary.json`
and `metrics.jsonl` stay as the run wrote them. The method:
`vit_jax.evaluation.fewshot`.
"""

import argparse
import json
import os
import sys

from vit_jax import files
from vit_jax import run_log

RESULTS_FILE = 'fewshot.json'


def main(argv=None) -> int:
  ints = lambda text: tuple(int(x) for x in text.split(','))  # noqa: E731
  parser = argparse.ArgumentParser(
    prog='python -m vit_jax.fewshot',
    description='Few-shot linear evaluation (paper 4.1) of a checkpoint.',
  )
  parser.add_argument('--checkpoint', required=True, help='.npz file or a workdir')
  parser.add_argument(
    '--model', help='MODEL_CONFIGS name, e.g. ViT-B_16 (default: the one a workdir records)'
  )
  parser.add_argument(
    '--datasets', required=True, help='comma-separated datasets the input pipeline reads'
  )
  # None: the method's defaults (vit_jax.evaluation.fewshot), read after JAX starts.
  parser.add_argument('--shots', type=ints, help='default: 1,5,10,25')
  parser.add_argument('--seeds', type=ints, help='default: 0,1,2')
  parser.add_argument('--l2_reg', type=float, help='default: 1024')
  parser.add_argument('--train_split', default='train')
  parser.add_argument('--test_split', default='test')
  parser.add_argument('--crop', type=int, default=None, help="default: the checkpoint's")
  parser.add_argument('--batch', type=int, default=256)
  parser.add_argument('--tfds_data_dir', default=None)
  parser.add_argument('--tfds_manual_dir', default=None)
  parser.add_argument(
    '--workdir',
    default=None,
    help='write fewshot.json and TensorBoard scalars here '
    '(default: the checkpoint, when it is a workdir)',
  )
  run_log.add_verbosity_flag(parser)
  args = parser.parse_args(argv)
  run_log.quiet_libraries(args.verbosity)

  import jax
  import ml_collections

  from vit_jax import checkpoint
  from vit_jax import sharding
  from vit_jax.data import sources
  from vit_jax.evaluation import fewshot
  from vit_jax.evaluation import inference

  args.shots = args.shots or fewshot.DEFAULT_SHOTS
  args.seeds = args.seeds or fewshot.DEFAULT_SEEDS
  args.l2_reg = args.l2_reg or fewshot.DEFAULT_L2_REG
  try:
    loaded = inference.load_model(args.checkpoint, args.model)
    config = ml_collections.ConfigDict(
      {
        'pp': {'crop': args.crop or loaded.image_size},
        'batch_eval': args.batch,
        'tfds_data_dir': args.tfds_data_dir,
        'tfds_manual_dir': args.tfds_manual_dir,
        'fewshot': {
          'datasets': tuple(args.datasets.split(',')),
          'shots': args.shots,
          'seeds': args.seeds,
          'l2_reg': args.l2_reg,
          'train_split': args.train_split,
          'test_split': args.test_split,
        },
      }
    )
    batch_sharding = sharding.batch_sharding(sharding.make_mesh())
    params = jax.device_put(loaded.params, sharding.replicated(batch_sharding.mesh))
    scalars = fewshot.evaluate_datasets(config, loaded.model, params, batch_sharding)
  except (checkpoint.CheckpointError, inference.InputError, sources.DataError, ValueError) as e:
    print(f'error: {e}', file=sys.stderr)
    return 1

  for name, value in scalars.items():
    if '-seed' not in name:
      print(f'{name:40s} {value:.4f}')
  workdir = args.workdir or (args.checkpoint if os.path.isdir(args.checkpoint) else None)
  if workdir and jax.process_index() == 0:
    print(f'wrote {_write(workdir, scalars)}')
  return 0


def _write(workdir: str, scalars: dict) -> str:
  """Adds `scalars` to `WORKDIR/fewshot.json` (results of other datasets kept); its path."""
  path = os.path.join(workdir, RESULTS_FILE)
  results = {}
  if files.exists(path):
    with files.open_file(path) as f:
      results = json.load(f)
  results.update(scalars)
  files.makedirs(workdir)
  files.write_text(path, json.dumps(results, indent=2, sort_keys=True) + '\n')
  try:
    import tensorflow as tf
  except ImportError:  # no TensorBoard summaries without TensorFlow; the JSON is written
    return path
  writer = tf.summary.create_file_writer(os.path.join(workdir, 'tensorboard', 'fewshot'))
  with writer.as_default(step=0):
    for name, value in scalars.items():
      tf.summary.scalar(name, value)
  writer.close()
  return path


if __name__ == '__main__':
  raise SystemExit(main())
