"""Few-shot linear evaluation (paper 4.1) of a checkpoint.

  python -m vit_jax.fewshot --checkpoint=ViT-B_16.npz --model=ViT-B_16 --datasets=cifar10,pets

Prints the accuracies per dataset and shot count (mean over seeds); with a
workdir, also writes them there, into files of its own (`fewshot.json`,
TensorBoard under `tensorboard/fewshot`): a training run's `summary.json`
and `metrics.jsonl` stay as the run wrote them. The method:
`vit_jax.evaluation.fewshot`.
"""

import argparse

from vit_jax.core import cli
from vit_jax.core import console
from vit_jax.workdir import run_log


def _parser():
  parser = cli.parser('fewshot', __doc__, whole_doc=False)
  cli.add_checkpoint_flags(parser)
  parser.add_argument(
    '--datasets', required=True, help='comma-separated datasets the input pipeline reads'
  )
  # None: the method's defaults (vit_jax.evaluation.fewshot), read after JAX starts.
  parser.add_argument('--shots', type=cli.positive_ints, help='default: 1,5,10,25')
  parser.add_argument('--seeds', type=_seeds, help='default: 0,1,2')
  parser.add_argument('--l2_reg', type=float, help='default: 1024')
  parser.add_argument('--train_split', default='train')
  parser.add_argument('--test_split', default='test')
  parser.add_argument('--crop', type=cli.positive_int, help="default: the checkpoint's")
  parser.add_argument('--batch', type=cli.positive_int, default=256)
  parser.add_argument('--tfds_data_dir', default=None)
  parser.add_argument('--tfds_manual_dir', default=None)
  parser.add_argument(
    '--workdir',
    default=None,
    help='write fewshot.json and TensorBoard scalars here '
    '(default: the checkpoint, when it is a workdir)',
  )
  console.add_verbosity_flag(parser)
  return parser


def main(argv=None) -> int:
  parser = _parser()
  args = parser.parse_args(argv)
  console.quiet_libraries(args.verbosity)

  import jax

  from vit_jax import workdir as workdir_lib
  from vit_jax.evaluation import fewshot
  from vit_jax.evaluation import loader

  with cli.reported():
    if args.workdir:
      workdir_lib.check_folder(args.workdir)  # before the evaluation, not after it
    datasets = args.datasets.split(',')
    if not all(datasets):
      raise loader.InputError(f'--datasets={args.datasets!r}: an empty name; pass cifar10,pets')
    loaded = loader.load_from_flags(args, parser.prog)
    method = ('shots', 'seeds', 'l2_reg', 'train_split', 'test_split', 'crop', 'batch')
    with console.heartbeat(f'{parser.prog}: few-shot probes on {args.datasets}'):
      scalars = fewshot.evaluate_checkpoint(
        loaded,
        datasets,
        **{k: getattr(args, k) for k in method},
        tfds_data_dir=args.tfds_data_dir,
        tfds_manual_dir=args.tfds_manual_dir,
      )
  for name, value in scalars.items():
    if '-seed' not in name:
      print(f'{name:40s} {value:.4f}')
  workdir = args.workdir or (args.checkpoint if workdir_lib.is_workdir(args.checkpoint) else None)
  if workdir and jax.process_index() == 0:
    with cli.reported():
      with workdir_lib.storage_errors(workdir):
        print(f'wrote {run_log.record_fewshot(workdir, scalars)}')
  return 0


def _seeds(text: str) -> tuple:
  try:
    return tuple(int(part) for part in text.split(','))
  except ValueError:
    raise argparse.ArgumentTypeError(f'{text!r}: pass integers like 0,1,2') from None


if __name__ == '__main__':
  raise SystemExit(cli.run(main))
