"""k-NN classification (DINO's evaluation of frozen features) of a checkpoint.

  python -m vit_jax.knn --checkpoint=workdirs/dino_demo --datasets=digits
  python -m vit_jax.knn --checkpoint=ViT-B_16.npz --model=ViT-B_16 --datasets=cifar10 --k=20

Prints the accuracy per dataset: each test image's k most cosine-similar training images
vote for their class with weight exp(cosine / T) (k = 20, T = 0.07 as DINO); with a workdir,
also writes them there (`knn.json`). The method: `vit_jax.evaluation.knn`.
"""

from vit_jax.core import cli
from vit_jax.core import console


def _parser():
  parser = cli.parser('knn', __doc__, whole_doc=False)
  cli.add_checkpoint_flags(parser)
  parser.add_argument(
    '--datasets', required=True, help='comma-separated datasets the input pipeline reads'
  )
  parser.add_argument('--k', type=cli.positive_int, default=20, help='neighbours that vote')
  parser.add_argument(
    '--temperature', type=float, default=0.07, help='a vote weighs exp(cosine / temperature)'
  )
  parser.add_argument('--train_split', default='train')
  parser.add_argument('--test_split', default='test')
  parser.add_argument('--crop', type=cli.positive_int, help="default: the checkpoint's")
  parser.add_argument('--batch', type=cli.positive_int, default=256)
  parser.add_argument('--tfds_data_dir', default=None)
  parser.add_argument('--tfds_manual_dir', default=None)
  parser.add_argument(
    '--workdir',
    default=None,
    help='write knn.json here (default: the checkpoint, when it is a workdir)',
  )
  console.add_verbosity_flag(parser)
  return parser


def main(argv=None) -> int:
  parser = _parser()
  args = parser.parse_args(argv)
  console.quiet_libraries(args.verbosity)

  import jax

  from vit_jax import workdir as workdir_lib
  from vit_jax.evaluation import knn
  from vit_jax.evaluation import loader

  with cli.reported():
    if args.workdir:
      workdir_lib.check_folder(args.workdir)
    datasets = args.datasets.split(',')
    if not all(datasets):
      raise loader.InputError(f'--datasets={args.datasets!r}: an empty name; pass digits,cifar10')
    if not args.temperature > 0:
      raise loader.InputError(f'--temperature={args.temperature}: use a positive number')
    loaded = loader.load_from_flags(args, parser.prog)
    method = ('k', 'temperature', 'train_split', 'test_split', 'crop', 'batch')
    with console.heartbeat(f'{parser.prog}: k-NN on {args.datasets}'):
      scalars = knn.evaluate_checkpoint(
        loaded,
        datasets,
        **{k: getattr(args, k) for k in method},
        tfds_data_dir=args.tfds_data_dir,
        tfds_manual_dir=args.tfds_manual_dir,
      )
  for name, value in scalars.items():
    print(f'{name:40s} {value:.4f}')
  workdir = args.workdir or (args.checkpoint if workdir_lib.is_workdir(args.checkpoint) else None)
  if workdir and jax.process_index() == 0:
    with cli.reported():
      with workdir_lib.storage_errors(workdir):
        print(f'wrote {knn.record(workdir, scalars, k=args.k, temperature=args.temperature)}')
  return 0


if __name__ == '__main__':
  raise SystemExit(cli.run(main))
