r"""Train on a SLURM cluster: write an sbatch script beside the run, submit it.

  python launch/slurm.py --nodes=4 --gpus_per_node=8 --workdir=/shared/runs/b16 \
      --partition=gpu --time=24:00:00 --venv=/shared/vit_jax/.venv --dry-run \
      -- --config.batch=4096
  python launch/slurm.py --gpus_per_node=0 --tasks_per_node=2 --workdir=runs/cpu --dry-run

One process per GPU (`--ntasks-per-node` = GPUs per node), all started by
`srun`; with --gpus_per_node=0 (a CPU partition, or a cluster without GPU
GRES) --tasks_per_node processes per node and no GRES. `python -m
vit_jax.main` sees SLURM_NTASKS > 1 and calls `jax.distributed.initialize()`
with the process count and index from SLURM, the coordinator at the first
node's NodeAddr (vit_jax.core.coordinator), and JAX gives each process the GPU
numbered SLURM_LOCALID; so the script needs no addresses or ports. (One
process per node would drive a single GPU: JAX maps local id 0 to GPU 0.)
--nodes=MIN-MAX takes whole nodes and starts the tasks on as many as the job
got: requeued after a node was lost, it goes on with fewer.

Preemption and the time limit: SLURM sends SIGTERM --grace_s seconds before
the time limit, on preemption and on `scancel --signal=TERM`; every process
checkpoints after the same next step and exits with status 143. The script
then requeues its own job (`scontrol requeue`), which resumes from that
checkpoint, so a run longer than --time goes on through as many attempts as it
needs, up to --max_attempts. A drained node of the job (checked every
--drain_check_s) stops the run the same way. A process that dies (status 128
+ its signal) ends the others (`--kill-on-bad-exit`, and their one line naming
it) and the job requeues the same way; a lost node ends the others alike, and
SLURM requeues the job once it marks the node down. Errors of the run itself
(status 1 or 2: processes that cannot meet, too) and Ctrl-C (130) end the job. Each attempt appends to one log beside the run,
`WORKDIR/slurm-JOBID.out`, under a line naming the attempt; each line of the
processes starts with their rank (`srun --label`).

The workdir must be visible from every node (a shared filesystem, or gs://;
the run checks); a relative one is taken in the checkout the job runs in
(--repo, default: this checkout), which must be on a shared filesystem too.
Resubmitting the same script resumes from its checkpoints.
"""

import os
import re
import sys

import common

# The exit status of a run that a signal stopped after its checkpoint (128 + SIGTERM), of one
# whose process was lost (the same; vit_jax.training.stopping), and of Ctrl-C (128 + SIGINT).
_PREEMPTED, _INTERRUPTED = 143, 130


def workdir(args) -> str:
  """The run's workdir as the job sees it: a relative one is inside --repo, where it runs."""
  if '://' in args.workdir or os.path.isabs(args.workdir):
    return args.workdir
  return os.path.join(args.repo, args.workdir)


def sbatch_script(args) -> str:
  run_dir = workdir(args)
  log_dir = run_dir if '://' not in run_dir else '.'
  tasks = args.tasks_per_node or args.gpus_per_node
  elastic = args.min_nodes != args.max_nodes
  lines = [
    '#!/bin/bash',
    f'#SBATCH --job-name={args.job_name}',
    f'#SBATCH --nodes={args.nodes}',
  ]
  # A range of nodes: whole nodes, and srun starts the tasks on as many as the job got (a task
  # count fixed in the request would hold a requeued job back until it gets them all again).
  lines += ['#SBATCH --exclusive'] if elastic else [f'#SBATCH --ntasks-per-node={tasks}']
  lines += [f'#SBATCH --gpus-per-node={args.gpus_per_node}'] if args.gpus_per_node else []
  lines += [] if elastic else [f'#SBATCH --cpus-per-task={args.cpus_per_gpu}']
  lines += [
    f'#SBATCH --time={args.time}',
    f'#SBATCH --output={os.path.join(log_dir, "slurm-%j.out")}',
    # A requeued job appends to its log rather than starting it afresh.
    '#SBATCH --open-mode=append',
    # SIGTERM to the processes this long before the time limit (and on preemption): they
    # checkpoint at the next step and exit 143, and the script requeues the job below.
    # --requeue lets SLURM requeue it itself after a node failure.
    f'#SBATCH --signal=TERM@{args.grace_s}',
    '#SBATCH --requeue',
  ]
  lines += [f'#SBATCH --partition={args.partition}'] if args.partition else []
  lines += [f'#SBATCH --account={args.account}'] if args.account else []
  lines += (
    [f'source {common.shlex.quote(os.path.join(args.venv, "bin", "activate"))}']
    if args.venv
    else []
  )
  lines += ['set -uo pipefail']  # (after the venv's script, which may read unset variables)
  if args.gpus_per_node:
    lines += [f'export {name}={value}' for name, value in common.GPU_ENV.items()]
  train = common.main_command('python', args, workdir=run_dir)
  # Every task sees all the node's GPUs; JAX picks GPU SLURM_LOCALID itself. --label starts
  # each line with the rank of the process that wrote it.
  srun = ['srun', '--kill-on-bad-exit=1', '--label']
  srun += [f'--ntasks-per-node={tasks}', f'--cpus-per-task={args.cpus_per_gpu}'] if elastic else []
  lines += [
    f'cd {common.shlex.quote(args.repo)}',
    'attempt=$((${SLURM_RESTART_COUNT:-0} + 1))',
    f'echo "=== vit_jax: job $SLURM_JOB_ID, attempt $attempt of at most {args.max_attempts}, '
    'started $(date -u +%Y-%m-%dT%H:%M:%SZ) on $SLURM_JOB_NODELIST ==="',
  ]
  if args.drain_check_s:
    lines += [
      # A node of the job drained (wanted back, for maintenance say): the run stops at its next
      # step with a checkpoint, as for a preemption, and the job requeues below.
      'watch_drain() {',
      '  trap \'kill "$nap" 2>/dev/null; exit 0\' TERM',
      f'  while sleep {args.drain_check_s} & nap=$! && wait "$nap"; do',
      '    drained=$(scontrol show node --oneliner "$SLURM_JOB_NODELIST" |',
      '      awk \'/ State=[^ ]*DRAIN/ {sub("NodeName=", "", $1); print $1}\' | paste -sd,)',
      '    if [ -n "$drained" ]; then',
      '      echo "=== vit_jax: node $drained drained: the run stops at its next step with a'
      ' checkpoint, and the job requeues ==="',
      '      scancel --signal=TERM "$SLURM_JOB_ID"',
      '      exit 0',
      '    fi',
      '  done',
      '}',
      common.shell_join(srun + train) + ' &',
      'run=$!',
      'watch_drain &',
      'watcher=$!',
      'wait "$run"',
      'status=$?',
      'kill "$watcher" 2>/dev/null',
    ]
  else:
    lines += [common.shell_join(srun + train), 'status=$?']
  lines += [
    f'if [ "$status" -ge 128 ] && [ "$status" -ne {_INTERRUPTED} ]; then',
    f'  if [ "$attempt" -lt {args.max_attempts} ]; then',
    '    echo "=== vit_jax: attempt $attempt stopped (status $status: preempted, the time limit,'
    ' a drained node or a process lost); requeueing job $SLURM_JOB_ID to resume from its'
    ' checkpoint ==="',
    '    scontrol requeue "$SLURM_JOB_ID" && exit 0',
    '  else',
    f'    echo "=== vit_jax: error: attempt $attempt stopped (status $status) and was the last of'
    f' --max_attempts={args.max_attempts}; resubmit the job (sbatch) to resume ==="',
    '  fi',
    'fi',
    'exit "$status"',
  ]
  return '\n'.join(lines) + '\n'


def commands(args) -> list:
  run_dir = workdir(args)
  script = args.script or (
    os.path.join(run_dir, 'launch.sbatch') if '://' not in run_dir else f'{args.job_name}.sbatch'
  )
  return [common.WriteFile(script, sbatch_script(args)), ['sbatch', script]]


def time_limit_s(text: str):
  """SLURM's --time in seconds (None: no limit); ValueError for what sbatch would refuse.
  Forms: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS; UNLIMITED, INFINITE or 0."""
  if text.strip().upper() in ('UNLIMITED', 'INFINITE'):
    return None
  match = re.fullmatch(r'(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?', text.strip())
  if not match:
    raise ValueError(text)
  days, first, second, third = match.groups()
  numbers = [int(x) for x in (first, second, third) if x is not None]
  if days is not None:  # D-HH[:MM[:SS]]
    hours, minutes, seconds = (numbers + [0, 0])[:3]
  elif len(numbers) == 3:
    hours, minutes, seconds = numbers
  else:  # MM[:SS]
    hours, (minutes, seconds) = 0, (numbers + [0])[:2]
  total = ((int(days or 0) * 24 + hours) * 60 + minutes) * 60 + seconds
  return total or None


def _first_file(path: str) -> str:
  """The path itself or the first folder above it that is a file ('' if none is)."""
  path = os.path.abspath(path)
  while not os.path.exists(path):
    parent = os.path.dirname(path)
    if parent == path:
      return ''
    path = parent
  return '' if os.path.isdir(path) else path


def check(parser, args) -> None:
  """Every flag that sbatch or the run would refuse, or that would leave nothing but a
  traceback, as one line before anything is written or submitted."""
  nodes = re.fullmatch(r'(\d+)(?:-(\d+))?', args.nodes)
  if not nodes:
    parser.error(f'--nodes={args.nodes}: pass a number of nodes (4), or a range (2-4) to let a '
                 'requeued job go on with fewer')  # fmt: skip
  args.min_nodes, args.max_nodes = int(nodes.group(1)), int(nodes.group(2) or nodes.group(1))
  if min(args.min_nodes, args.max_attempts, args.tasks_per_node or 1) < 1 or args.gpus_per_node < 0:
    parser.error(
      '--nodes, --tasks_per_node and --max_attempts must be at least 1, --gpus_per_node at least 0'
    )
  if args.min_nodes > args.max_nodes:
    parser.error(
      f'--nodes={args.nodes}: the range goes down; pass MIN-MAX, e.g. 1-{args.min_nodes}'
    )
  if args.gpus_per_node == 0 and not args.tasks_per_node:
    parser.error('--gpus_per_node=0 runs on CPUs: give the processes per node, --tasks_per_node=N')
  if args.gpus_per_node and args.tasks_per_node not in (None, args.gpus_per_node):
    parser.error(
      f'--tasks_per_node={args.tasks_per_node} with --gpus_per_node={args.gpus_per_node}: JAX '
      'gives each process the GPU numbered SLURM_LOCALID, so it takes one process per GPU; '
      'leave out --tasks_per_node'
    )
  if args.cpus_per_gpu < 1:
    parser.error(f'--cpus_per_gpu={args.cpus_per_gpu}: each process needs at least 1 CPU core')
  if args.drain_check_s < 0:
    parser.error(
      f'--drain_check_s={args.drain_check_s}: pass seconds between checks, or 0 for none'
    )
  try:
    limit = time_limit_s(args.time)
  except ValueError:
    parser.error(f'--time={args.time}: not a SLURM time limit; pass HH:MM:SS, D-HH:MM:SS or '
                 'minutes, e.g. --time=24:00:00')  # fmt: skip
  if not 1 <= args.grace_s <= 65535:
    parser.error(f'--grace_s={args.grace_s}: pass the seconds (1 to 65535) before the time limit '
                 'at which the run checkpoints and the job requeues')  # fmt: skip
  if limit is not None and args.grace_s >= limit:
    parser.error(f'--grace_s={args.grace_s} is not less than --time={args.time} ({limit} s): '
                 'the run would be told to stop as it starts; pass a longer --time or a shorter '
                 '--grace_s')  # fmt: skip
  if args.config:
    path = args.config.split(':', 1)[0]
    if not os.path.isfile(os.path.join(args.repo, path)):
      parser.error(f'--config={args.config}: no such file in {args.repo}, where the job runs '
                   'vit_jax.main (a path relative to the checkout, e.g. '
                   'vit_jax/configs/demo.py)')  # fmt: skip
  run_dir = workdir(args)
  if '://' not in run_dir and _first_file(run_dir):
    parser.error(f'--workdir={args.workdir}: {_first_file(run_dir)} is a file; pass a directory '
                 'for the run (it need not exist yet)')  # fmt: skip
  if args.script and (
    os.path.isdir(args.script) or _first_file(os.path.dirname(args.script) or '.')
  ):
    parser.error(f'--script={args.script}: not a file that can be written; pass a file path')


def main(argv=None) -> int:
  parser = common.Parser(
    prog='launch/slurm.py',
    description=__doc__,
    formatter_class=common.argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument(
    '--nodes',
    default='1',
    help='nodes: N, or MIN-MAX to let a job requeued after a node was lost go on with fewer',
  )
  parser.add_argument(
    '--gpus_per_node', type=int, default=8, help='GPUs per node, one process each; 0: CPU only'
  )
  parser.add_argument(
    '--tasks_per_node',
    type=int,
    help='processes per node (default: --gpus_per_node; give it with --gpus_per_node=0)',
  )
  parser.add_argument(
    '--cpus_per_gpu', type=int, default=8, help='CPU cores per process, for the input pipeline'
  )
  parser.add_argument(
    '--time', default='24:00:00', help='wall-clock limit: HH:MM:SS, D-HH:MM:SS or minutes'
  )
  parser.add_argument(
    '--grace_s',
    type=int,
    default=300,
    help='seconds before the time limit to signal the run to checkpoint',
  )
  parser.add_argument(
    '--max_attempts',
    type=int,
    default=10,
    help='attempts of the job at most: it requeues itself after a preemption, the time limit '
    'or a lost process until then',
  )
  parser.add_argument(
    '--drain_check_s',
    type=int,
    default=60,
    help='seconds between checks for a drained node of the job (the run then checkpoints and '
    'the job requeues); 0: no checks',
  )
  parser.add_argument('--partition', help='SLURM partition')
  parser.add_argument('--account', help='SLURM account')
  parser.add_argument('--job_name', default='vit_jax')
  parser.add_argument('--venv', help='virtualenv with vit_jax installed, on every node')
  parser.add_argument('--repo', default=common.ROOT, help='checkout to run from, on every node')
  parser.add_argument('--script', help='where to write the sbatch script (default: in the workdir)')
  common.add_common_flags(parser, 'shared directory (or gs://) for checkpoints, logs and results')
  args = parser.parse(argv)
  args.repo = os.path.abspath(args.repo)
  check(parser, args)
  return common.execute(commands(args), args.dry_run)


if __name__ == '__main__':
  sys.exit(main())
