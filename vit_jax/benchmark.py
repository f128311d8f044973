r"""Time a ViT step against timm and the machine's peak: `python -m vit_jax.benchmark`.

  python -m vit_jax.benchmark --model=ViT-B_16 --mode=infer --batch=8 --compare=timm
  python -m vit_jax.benchmark --model=ViT-S_16 --mode=train --batch=16 --compare=timm
  python -m vit_jax.benchmark --model=ViT-B_16 --mode=train --batch=256 --dtype=bfloat16 \
      --compare=timm                                        # on a GPU: timm under torch.compile
  python -m vit_jax.benchmark --model=ViT-H_14 --mode=train --resolution=518 --remat \
      --optimizer=sgd --find_max_batch                      # largest batch that fits
  python -m vit_jax.benchmark --model=ViT-B_16 --mode=infer --batch=1024 --dtype=bfloat16 \
      --profile=/tmp/trace                                  # where the device's time goes

`train` times the real train step (`vit_jax.training.steps.train_step`: forward,
backward, clipping, optimizer, NaN guard) on one device; `infer` times the
forward pass. Steps are synchronised; the rate is the median over timed steps
after warm-up. `--profile=DIR` then traces --steps more steps of ours
(`jax.profiler`) and lists in the record the kernels that took the most device
time; `--optim_dtype=bfloat16` keeps Adam's first moment in bf16. With `--compare=timm` the same network runs in timm in the same
process, ours and timm's steps interleaved (A B A B ...), so both see the same
machine load. MFU = model FLOPs per second / a stable peak, so it is at most
1: the vendor's dense bf16 figure on known accelerators, and on CPUs the
fastest large matmul ever measured on this machine (recorded in
~/.cache/vit_jax/peak_flops.json; a busy machine does not lower it); the
record names which (`peak.peak_source`). Every run writes a JSON record into
--workdir (default workdirs/benchmark/) or to --json; the project's reference
records are written with --workdir=benchmarks.
"""

import dataclasses
import json
import os
import sys

from vit_jax.core import cli
from vit_jax.core import console


def _parser():
  from vit_jax.bench import speed
  from vit_jax.models.attention import ATTENTION

  p = cli.parser('benchmark', __doc__)
  d = speed.Options()
  p.add_argument('--model', default=d.model, help='a MODEL_CONFIGS name, e.g. ViT-B_16')
  p.add_argument('--mode', default=d.mode, choices=('infer', 'train'))
  p.add_argument('--batch', type=int, default=d.batch)
  p.add_argument('--resolution', type=int, default=d.resolution)
  p.add_argument('--dtype', default=d.dtype, choices=('float32', 'bfloat16'))
  p.add_argument('--accum_steps', type=int, default=d.accum_steps)
  p.add_argument('--remat', action='store_true')
  p.add_argument('--optimizer', default=d.optimizer, choices=('adam', 'sgd'))
  p.add_argument(
    '--optim_dtype',
    default=d.optim_dtype,
    choices=('float32', 'bfloat16'),
    help="Adam's first moment / SGD's momentum (default: %(default)s, as timm's Adam)",
  )
  p.add_argument('--num_classes', type=int, default=d.num_classes)
  p.add_argument('--attention', default=d.attention, choices=ATTENTION)
  p.add_argument(
    '--fp8',
    action='store_true',
    help="the encoder's dense layers as FP8 products (FP8 tensor cores on Hopper/Ada GPUs)",
  )
  p.add_argument('--warmup', type=int, default=d.warmup)
  p.add_argument('--steps', type=int, default=d.steps, help='timed steps per repeat and side')
  p.add_argument('--repeats', type=int, default=d.repeats)
  p.add_argument('--compare', choices=('timm',))
  p.add_argument(
    '--timm_compile',
    type=lambda s: s.lower() in ('1', 'true', 'yes'),
    help='torch.compile the timm model (default: on CUDA only)',
  )
  p.add_argument('--threads', type=int, help='torch threads (default: the cores XLA uses)')
  p.add_argument(
    '--profile',
    help='trace --steps more steps of ours into this directory (jax.profiler); the record '
    'lists the kernels that took the most device time',
  )
  p.add_argument('--xla_flags', default='', help='appended to XLA_FLAGS before JAX starts')
  p.add_argument(
    '--find_max_batch',
    action='store_true',
    help='search the largest batch that fits instead of timing',
  )
  p.add_argument(
    '--memory_budget_gib',
    type=float,
    default=78.0,
    help="on CPU, --find_max_batch compares XLA's estimate with this budget "
    '(default: the usable memory of an 80 GB H100)',
  )
  p.add_argument(
    '--workdir',
    default=os.path.join('workdirs', 'benchmark'),
    help='directory for the record, named <time>_<platform>_<model>_... (default: %(default)s)',
  )
  p.add_argument('--json', help='write the record to this file instead')
  p.add_argument('--no_record', action='store_true', help='write no JSON record')
  console.add_verbosity_flag(p)
  return p


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  # Before TensorFlow and JAX start: their start-up logs stay hidden.
  console.quiet_libraries(console.verbosity_in(argv))
  import jax

  from vit_jax import workdir
  from vit_jax.bench import memory
  from vit_jax.bench import speed

  parser = _parser()
  args = parser.parse_args(argv)
  # On GPUs JAX reserves 75% of the memory when it starts: leave torch its share
  # when comparing, and let a single-library run use the whole device.
  os.environ.setdefault('XLA_PYTHON_CLIENT_PREALLOCATE', 'false' if args.compare else 'true')
  os.environ.setdefault('XLA_PYTHON_CLIENT_MEM_FRACTION', '0.95')
  if args.xla_flags:
    if jax._src.xla_bridge.backends_are_initialized():
      cli.fail('--xla_flags must be set before JAX starts')
    os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' ' + args.xla_flags).strip()
  with cli.reported():
    if args.json:
      workdir.check_output(args.json, '--json')
  fields = {f.name for f in dataclasses.fields(speed.Options)}
  opts = speed.Options(**{k: v for k, v in vars(args).items() if k in fields})
  doing = f'{parser.prog}: {opts.model} {opts.mode} at batch {opts.batch}'
  with cli.reported(), console.heartbeat(doing):
    if args.find_max_batch:
      speed.validate(opts)
      record = memory.find_max_batch(
        opts, speed.build_step, speed.JaxRunner, budget_bytes=args.memory_budget_gib * 2**30
      )
      print(memory.describe(record))
    else:
      record = speed.run(opts)
      print(speed.summary(record))
  path = args.json or (None if args.no_record else speed.record_path(record, args.workdir))
  if path:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, 'w', encoding='utf-8') as f:
      json.dump(record, f, indent=1)
    print(f'wrote {path}')
  return 0


if __name__ == '__main__':
  sys.exit(cli.run(main))
