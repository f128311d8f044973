r"""Train on a Cloud TPU VM or pod slice: create it, install vit_jax, run on every worker, fetch.

  python launch/tpu_vm.py --name=vit-b16 --zone=us-central2-b --accelerator_type=v4-32 \
      --workdir=gs://BUCKET/vit/b16 --config=vit_jax/configs/demo.py --dry-run \
      -- --config.batch=4096

Actions (positional, default `create install run fetch`):
  create   gcloud compute tpus tpu-vm create
  install  copy the working tree (committed files with their edits, and untracked files
           git does not ignore, such as a new config) to every worker, pip install ".[tpu]"
  run      python3 -m vit_jax.main on all workers at once (--worker=all); each worker
           finds the others itself (jax.distributed on TPU pod slices). With
           --detach it runs in the background, appending to vit_jax/run.log
  logs     the last lines of worker 0's run.log (after run --detach)
  fetch    copy summary.json and params.npz from the gs:// workdir to --results
  delete   delete the TPU VM

The workdir must be on Cloud Storage: a pod's workers share no disk, and a
rerun of `run` resumes from the checkpoints there; a rerun of `install` unpacks
the new code over the checkout and deletes nothing.

Multi-slice (`--num_slices=N`, N > 1): N slices of `--accelerator_type` joined
over the data-centre network, created as one queued resource (`gcloud compute
tpus queued-resources create --node-count=N`); every action then addresses all
workers of all slices (`--node=all --worker=all`). JAX finds the slices itself
(the runtime sets MEGASCALE_*); the trainer's mesh gets a `slice` axis of N,
the outer part of data parallelism, so only gradient reductions cross slices
(docs/speed_and_scale.md). Give the batch for all slices together.
"""

import os
import re
import sys

import common

ACTIONS = ('create', 'install', 'run', 'logs', 'fetch', 'delete')
LOG = 'run.log'


def commands(args) -> list:
  where = [f'--zone={args.zone}'] + ([f'--project={args.project}'] if args.project else [])
  if args.num_slices > 1:
    tpu = ['gcloud', 'compute', 'tpus', 'queued-resources']
    nodes = ['--node=all']
  else:
    tpu = ['gcloud', 'compute', 'tpus', 'tpu-vm']
    nodes = []
  ssh = tpu + ['ssh', args.name] + where + nodes + ['--worker=all']
  out = []
  for action in args.actions:
    if action == 'create':
      if args.num_slices > 1:
        out.append(
          tpu
          + ['create', args.name]
          + where
          + [
            f'--node-count={args.num_slices}',
            f'--node-prefix={args.name}',
            f'--accelerator-type={args.accelerator_type}',
            f'--runtime-version={args.version}',
          ]
          + (['--spot'] if args.spot else [])
        )
      else:
        out.append(
          tpu
          + ['create', args.name]
          + where
          + [f'--accelerator-type={args.accelerator_type}', f'--version={args.version}']
          + (['--spot'] if args.spot else [])
        )
    elif action == 'install':
      archive, make_archive, note = common.local_archive(args.name)
      print(note, file=sys.stderr)
      out.append(make_archive)
      out.append(
        tpu + ['scp', archive, f'{args.name}:{common.ARCHIVE}'] + where + nodes + ['--worker=all']
      )
      out.append(ssh + [f'--command={common.unpack_and_install("tpu")}'])
    elif action == 'run':
      run = common.shell_join(common.main_command('python3', args))
      if args.detach:
        # Survives the ssh session; `logs` shows worker 0's output.
        run = f'nohup {run} >> {LOG} 2>&1 < /dev/null &'  # after the log of runs before
      out.append(ssh + [f'--command=cd {common.REMOTE_DIR} && {run}'])
    elif action == 'logs':
      out.append(
        tpu
        + ['ssh', args.name]
        + where
        + (['--node=0'] if nodes else [])
        + ['--worker=0', f'--command=tail -n 100 {common.REMOTE_DIR}/{LOG}']
      )
    elif action == 'fetch':
      workdir = args.workdir.rstrip('/')
      out.append(['mkdir', '-p', args.results])
      out.append(
        [
          'gcloud',
          'storage',
          'cp',
          f'{workdir}/summary.json',
          f'{workdir}/params.npz',
          args.results,
        ]
      )
    elif action == 'delete':
      force = ['--force'] if args.num_slices > 1 else []  # the slices with the request
      out.append(tpu + ['delete', args.name] + where + force + ['--quiet'])
  return out


def main(argv=None) -> int:
  parser = common.Parser(
    prog='launch/tpu_vm.py',
    description=__doc__,
    formatter_class=common.argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument('actions', nargs='*', metavar='ACTION', help=f'any of {", ".join(ACTIONS)}')
  parser.add_argument('--name', required=True, help='TPU VM name')
  parser.add_argument('--zone', required=True, help='e.g. us-central2-b')
  parser.add_argument('--accelerator_type', default='v4-8', help='e.g. v4-8, v4-32, v5litepod-16')
  parser.add_argument(
    '--version',
    default='tpu-ubuntu2204-base',
    help='TPU software version (v5e: v2-alpha-tpuv5-lite, v6e: v2-alpha-tpuv6e)',
  )
  parser.add_argument('--project', help="GCP project (default: gcloud's)")
  parser.add_argument('--spot', action='store_true', help='a Spot (preemptible) TPU VM')
  parser.add_argument(
    '--detach',
    action='store_true',
    help='run in the background (nohup), so the training outlives the ssh session',
  )
  parser.add_argument('--results', default='results', help='local folder for fetched results')
  parser.add_argument(
    '--num_slices',
    type=int,
    default=1,
    help='slices of --accelerator_type joined over the data-centre network (multi-slice)',
  )
  common.add_common_flags(parser, 'gs://BUCKET/PATH for checkpoints, logs and results')
  args = parser.parse(argv)
  # A detached run is not finished when `run` returns: fetch later.
  args.actions = args.actions or ['create', 'install', 'run'] + ([] if args.detach else ['fetch'])
  unknown = [a for a in args.actions if a not in ACTIONS]
  if unknown:
    parser.error(f'unknown action {unknown[0]!r}; use any of {", ".join(ACTIONS)}')
  if args.num_slices < 1:
    parser.error(f'--num_slices={args.num_slices}: give 1 (one slice) or more')
  if not args.workdir.startswith('gs://'):
    parser.error(f'--workdir={args.workdir}: TPU workers share no disk; pass gs://BUCKET/PATH')
  if not re.fullmatch(r'v\d+[a-z]*-\d+', args.accelerator_type):
    parser.error(
      f'--accelerator_type={args.accelerator_type}: expected a type such as v4-8, '
      'v4-32 or v5litepod-16'
    )
  if (
    'install' in args.actions
    and not os.path.isdir(os.path.join(common.ROOT, '.git'))
    and not os.path.isfile(os.path.join(common.ROOT, '.git'))
  ):
    parser.error(f'{common.ROOT} is not a git checkout; install ships its working tree by git')
  return common.execute(commands(args), args.dry_run)


if __name__ == '__main__':
  sys.exit(main())
