r"""Evaluate a checkpoint on a whole dataset split: exact top-1 and top-5.

  python -m vit_jax.evaluate --checkpoint=ViT-B_16.npz --model=ViT-B_16 \
      --dataset=imagenet2012 --tfds_data_dir=DATA_DIR  # where `vit_jax.prepare` put it

Every example of the split is counted exactly once. For ImageNet, the ReaL
labels (Beyer et al. 2020) are evaluated too when `imagenet2012_real` is
prepared in the same data directory (`python -m vit_jax.prepare
imagenet2012_real`): precision@1 over the validation images that have a ReaL
label. Prints the numbers as JSON, and writes them to --output when given.
"""

import json
import os
import sys

from vit_jax.configs.data import data_config
from vit_jax.core import cli
from vit_jax.core import console


def main(argv=None) -> int:
  parser = cli.parser('evaluate', __doc__, whole_doc=False)
  cli.add_checkpoint_flags(parser)
  parser.add_argument(
    '--fp8',
    action='store_true',
    help="bfloat16 with the encoder's dense layers as FP8 products, the kernels rounded to FP8 "
    'once as the checkpoint loads (FP8 tensor cores on Hopper/Ada GPUs, emulated elsewhere)',
  )
  parser.add_argument('--dataset', required=True, help='a dataset the input pipeline reads')
  parser.add_argument('--split', default='test', help="'test', 'train' or a split expression")
  parser.add_argument(
    '--crop', type=cli.positive_int, default=None, help="resolution (default: the checkpoint's)"
  )
  parser.add_argument(
    '--resize', type=cli.positive_int, help='resize to this, then centre-crop to --crop'
  )
  parser.add_argument('--batch', type=cli.positive_int, default=256)
  parser.add_argument('--tfds_data_dir', default=None)
  parser.add_argument('--tfds_manual_dir', default=None)
  parser.add_argument('--output', default=None, help='also write the JSON here')
  console.add_verbosity_flag(parser)
  args = parser.parse_args(argv)
  console.quiet_libraries(args.verbosity)

  from vit_jax.data import pipeline
  from vit_jax.evaluation import classify
  from vit_jax.evaluation import loader

  if args.output:
    _check_output(args.output)
  with cli.reported():
    loaded = loader.load_from_flags(args, parser.prog)
    data = data_config()
    data.update(
      dataset=args.dataset,
      batch_eval=args.batch,
      tfds_data_dir=args.tfds_data_dir,
      tfds_manual_dir=args.tfds_manual_dir,
    )
    data.pp.crop = args.crop
    data.pp.resize = args.resize
    # The split opened first: a dataset that is not there is said before any wait is shown.
    source = pipeline.split_source(data, args.split)
    with console.heartbeat(f'{parser.prog}: evaluating on {args.dataset} {args.split}'):
      numbers = classify.evaluate_checkpoint(
        loaded, data, args.split, warn=lambda line: print(line, file=sys.stderr), source=source
      )
  result = {'checkpoint': args.checkpoint, 'dataset': args.dataset, 'split': args.split, **numbers}
  text = json.dumps(result, indent=2)
  print(text)
  if args.output:
    with cli.writing(args.output), open(args.output, 'w', encoding='utf-8') as f:
      f.write(text + '\n')
  return 0


def _check_output(path: str) -> None:
  """--output a run can write at its end: checked before the evaluation, not after it."""
  folder = os.path.dirname(os.path.abspath(path))
  if os.path.isdir(path):
    cli.fail(f'--output {path} is a folder; pass a file name for the JSON')
  if not os.path.isdir(folder):
    cli.fail(f'--output {path}: no folder {folder}; make it or pass another file name')
  from vit_jax import workdir

  with cli.reported():
    workdir.check_output(path, '--output')


if __name__ == '__main__':
  sys.exit(cli.run(main))
