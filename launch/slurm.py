r"""Train on a multi-node GPU cluster with SLURM: write an sbatch script, submit it.

  python launch/slurm.py --nodes=4 --gpus_per_node=8 --workdir=/shared/runs/b16 \
      --partition=gpu --time=24:00:00 --venv=/shared/vit_jax/.venv --dry-run \
      -- --config.batch=4096

One process per GPU (`--ntasks-per-node` = GPUs per node), all started by
`srun`. `python -m vit_jax.main` sees SLURM_NTASKS > 1 and calls
`jax.distributed.initialize()`, which reads the coordinator (the first node),
the process count and index from SLURM, and gives each process the GPU
numbered SLURM_LOCALID; so the script needs no addresses or ports. (One
process per node would drive a single GPU: JAX maps local id 0 to GPU 0.)

The workdir must be visible from every node (a shared filesystem, or gs://);
resubmitting the same script resumes from its checkpoints. The repository is
used in place (--repo, default: this checkout), so it must be on a shared
filesystem too.
"""

import os
import sys

import common


def sbatch_script(args) -> str:
  log_dir = args.workdir if '://' not in args.workdir else '.'
  lines = [
    '#!/bin/bash',
    f'#SBATCH --job-name={args.job_name}',
    f'#SBATCH --nodes={args.nodes}',
    f'#SBATCH --ntasks-per-node={args.gpus_per_node}',
    f'#SBATCH --gpus-per-node={args.gpus_per_node}',
    f'#SBATCH --cpus-per-task={args.cpus_per_gpu}',
    f'#SBATCH --time={args.time}',
    f'#SBATCH --output={os.path.join(log_dir, "slurm-%j.out")}',
  ]
  # SIGTERM this long before the time limit (and on preemption): the trainer
  # checkpoints at the next step and exits; resubmitting resumes. --requeue
  # lets SLURM restart the job itself after a node failure or preemption.
  lines += [f'#SBATCH --signal=TERM@{args.grace_s}', '#SBATCH --requeue']
  lines += [f'#SBATCH --partition={args.partition}'] if args.partition else []
  lines += [f'#SBATCH --account={args.account}'] if args.account else []
  lines += ['set -euo pipefail']
  lines += (
    [f'source {common.shlex.quote(os.path.join(args.venv, "bin", "activate"))}']
    if args.venv
    else []
  )
  lines += [f'export {name}={value}' for name, value in common.GPU_ENV.items()]
  lines += [
    f'cd {common.shlex.quote(args.repo)}',
    # Every task sees all the node's GPUs; JAX picks GPU SLURM_LOCALID itself.
    'srun --kill-on-bad-exit=1 ' + common.shell_join(common.main_command('python', args)),
  ]
  return '\n'.join(lines) + '\n'


def commands(args) -> list:
  script = args.script or (
    os.path.join(args.workdir, 'launch.sbatch')
    if '://' not in args.workdir
    else f'{args.job_name}.sbatch'
  )
  return [common.WriteFile(script, sbatch_script(args)), ['sbatch', script]]


def main(argv=None) -> int:
  parser = common.Parser(
    prog='launch/slurm.py',
    description=__doc__,
    formatter_class=common.argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument('--nodes', type=int, default=1)
  parser.add_argument('--gpus_per_node', type=int, default=8)
  parser.add_argument(
    '--cpus_per_gpu', type=int, default=8, help='CPU cores per process, for the input pipeline'
  )
  parser.add_argument('--time', default='24:00:00', help='wall-clock limit, HH:MM:SS')
  parser.add_argument(
    '--grace_s',
    type=int,
    default=300,
    help='seconds before the time limit to signal the run to checkpoint',
  )
  parser.add_argument('--partition', help='SLURM partition')
  parser.add_argument('--account', help='SLURM account')
  parser.add_argument('--job_name', default='vit_jax')
  parser.add_argument('--venv', help='virtualenv with vit_jax[gpu] installed, on every node')
  parser.add_argument('--repo', default=common.ROOT, help='checkout to run from, on every node')
  parser.add_argument('--script', help='where to write the sbatch script (default: in the workdir)')
  common.add_common_flags(parser, 'shared directory (or gs://) for checkpoints, logs and results')
  args = parser.parse(argv)
  if args.nodes < 1 or args.gpus_per_node < 1:
    parser.error('--nodes and --gpus_per_node must be at least 1')
  return common.execute(commands(args), args.dry_run)


if __name__ == '__main__':
  sys.exit(main())
