"""Throughput of the input pipeline alone, at 224 px, on this machine.

  python -m vit_jax.benchmark_input [--dataset=DIR|PATH.npz] [--json=PATH] [--threads=1,2]
      [--processes=2,4]

Times host batches (no devices; uint8, as they cross to the devices) of the
train pipeline (inception crop, flip, resize to 224) with 1, 2, ... threads,
next to a bare single-thread PIL decode of the same files (the ceiling), and
reports their ratio; the same photos held in memory and the built-in digits
at the same threads; the bare decode in n processes at once (what n busy cores
give without the pipeline); with --processes, the busiest thread count split
into processes x threads, all at once. Then where one image's time goes,
RandAugment + mixup, evaluation (exact pixels), TFRecord shards and a restore
at step 10^6. Without --dataset it writes ImageNet-like JPEGs made from
scikit-learn's sample photos into --dir (a temp dir by default). An in-memory
--dataset (an .npz, a folder of .npy files, digits) is timed by threads alone.
"""

import json
import sys
import tempfile

from vit_jax.core import cli
from vit_jax.core import console


def _parser():
  parser = cli.parser('benchmark_input', __doc__, whole_doc=False)
  parser.add_argument(
    '--dataset', help='an image folder DIR/train/<class>/<image>, or arrays (.npz, digits) to time'
  )
  parser.add_argument('--images', type=int, default=1000, help='images to write without --dataset')
  parser.add_argument('--batch', type=int, default=128)
  parser.add_argument('--steps', type=int, default=10, help='timed batches per measurement')
  parser.add_argument('--threads', default='1,2', help='comma-separated thread counts to time')
  parser.add_argument(
    '--processes',
    default='',
    help='comma-separated process counts: the most threads split into processes x threads',
  )
  parser.add_argument('--rounds', type=int, default=3, help='alternating rounds; the best counts')
  parser.add_argument('--dir', help='work dir for written files (default: a new temp dir)')
  parser.add_argument('--json', help='write the results here')
  parser.add_argument(
    '--quick',
    action='store_true',
    help='only the train pipeline (folder, in memory), the ceilings and --processes',
  )
  console.add_verbosity_flag(parser)
  return parser


def main(argv=None):
  args = _parser().parse_args(argv)
  console.quiet_libraries(args.verbosity)

  from vit_jax import workdir
  from vit_jax.bench import input_speed
  from vit_jax.data import readers

  with cli.reported():
    if args.json:
      workdir.check_output(args.json, '--json')
    if args.dir:
      workdir.check_output(args.dir, '--dir', folder=True)

  threads = [int(t) for t in args.threads.split(',')]
  with cli.reported():
    if args.dataset and readers.reader_for(args.dataset).name in ('arrays', 'builtin'):
      out = input_speed.measure_arrays(
        args.dataset, batch=args.batch, steps=args.steps, threads=threads, rounds=args.rounds
      )
    else:
      work_dir = args.dir or tempfile.mkdtemp(prefix='vit_jax_bench_')
      folder, paths = input_speed.training_folder(args.dataset, args.images, work_dir)
      out = input_speed.measure(
        folder,
        paths,
        batch=args.batch,
        steps=args.steps,
        threads=threads,
        rounds=args.rounds,
        quick=args.quick,
        work_dir=work_dir,
        processes=[int(p) for p in args.processes.split(',') if p],
      )
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(out, f, indent=2)
      f.write('\n')
    print(f'wrote {args.json}')


if __name__ == '__main__':
  sys.exit(cli.run(main))
