"""How `python -m vit_jax.main` joins a run of several processes, and the launch mistakes that
would leave it hanging or idle, named in one line before any work.

The processes find each other through `jax.distributed.initialize`: from the
flags (`--coordinator_address`, `--num_processes`, `--process_id`), or from
the environment of a TPU pod slice or a SLURM job step. Under SLURM that is
one process per task of `srun`, each driving the GPU numbered SLURM_LOCALID,
meeting at the first node's NodeAddr; a coordinator they cannot reach ends
each of them in one line (`vit_jax.core.coordinator`). Launch mistakes:

- a command run once in an allocation of several tasks (in the batch script
  or an `salloc` shell, without `srun`) has no job step to read;
- fewer tasks on a node than GPUs leaves GPUs idle (one task per node drives
  GPU 0 alone);
- a process count that differs from SLURM's task count (flags that contradict
  the job) would have processes wait for others that never come.
"""

import os
import re
from typing import Optional

from vit_jax.core import coordinator
from vit_jax.core.errors import UserError


class LaunchError(UserError, RuntimeError):
  """The processes of a run were started in a way that cannot work; one line, the fix."""


def tasks_on_node(environ) -> Optional[int]:
  """The tasks of this job step on this node, from SLURM_STEP_TASKS_PER_NODE ("2(x3),1": two
  on each of the first three nodes, one on the fourth) and SLURM_NODEID; None if unknown."""
  spec = environ.get('SLURM_STEP_TASKS_PER_NODE') or environ.get('SLURM_TASKS_PER_NODE')
  if not spec:
    return None
  counts = []
  for part in spec.split(','):
    match = re.fullmatch(r'(\d+)(?:\(x(\d+)\))?', part.strip())
    if not match:
      return None
    counts += [int(match.group(1))] * int(match.group(2) or 1)
  node = int(environ.get('SLURM_NODEID', '0'))
  return counts[node] if node < len(counts) else None


def slurm_mistake(environ, num_processes: Optional[int] = None) -> str:
  """What is wrong with this SLURM launch before JAX starts ('' when nothing is);
  `num_processes`: the flag's, if given."""
  tasks = int(environ.get('SLURM_NTASKS', '1') or 1)
  if num_processes and 'SLURM_STEP_ID' in environ and num_processes != tasks:
    return _count_mismatch(tasks, num_processes)
  if tasks <= 1 or num_processes:
    return ''
  if 'SLURM_STEP_ID' not in environ:
    return (
      f'this SLURM allocation has {tasks} tasks, but the command runs once, outside srun (in '
      'the batch script or an salloc shell): start it with `srun python -m vit_jax.main ...`, '
      'one process per task (launch/slurm.py writes such a script), or with `srun --ntasks=1` '
      'for one process'
    )
  gpus = int(environ.get('SLURM_GPUS_ON_NODE', '0') or 0)
  here = tasks_on_node(environ)
  if gpus and here and here < gpus:
    return (
      f'{here} task{"s" if here > 1 else ""} on a node with {gpus} GPUs: JAX gives each task '
      f'the GPU numbered SLURM_LOCALID, so {gpus - here} of them would sit idle. Start one '
      f'task per GPU (srun --ntasks-per-node={gpus}; launch/slurm.py does)'
    )
  return ''


def initialize(
  coordinator_address: Optional[str],
  num_processes: Optional[int],
  process_id: Optional[int],
  environ=os.environ,
) -> None:
  """jax.distributed for a run of several processes; one process when nothing says otherwise.
  LaunchError for the mistakes in the module's docstring; under srun, a coordinator that the
  processes cannot reach ends each of them in one line (`coordinator.Join`)."""
  import jax

  mistake = slurm_mistake(environ, num_processes)
  if mistake:
    raise LaunchError(mistake)
  # CPU processes talk through gloo; accelerators ignore this setting.
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  tasks = int(environ.get('SLURM_NTASKS', '1') or 1)
  place = None
  if 'SLURM_STEP_ID' in environ and tasks > 1:
    place = coordinator.slurm_coordinator(environ, coordinator_address)
    rank = int(environ['SLURM_PROCID']) if process_id is None else process_id
    join = coordinator.Join(place, rank, tasks, coordinator.this_node(environ), environ)
    join.run(
      lambda address, timeout: jax.distributed.initialize(
        coordinator_address=address,
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=timeout,
      )
    )
  elif coordinator_address or num_processes:
    jax.distributed.initialize(
      coordinator_address=coordinator_address,
      num_processes=num_processes,
      process_id=process_id,
    )
  elif len(environ.get('TPU_WORKER_HOSTNAMES', '').split(',')) > 1:
    jax.distributed.initialize()  # a TPU pod slice: JAX finds the others itself
  if 'SLURM_STEP_ID' in environ and jax.process_count() != tasks:
    raise LaunchError(_count_mismatch(tasks, jax.process_count()))
  if jax.process_count() > 1:
    _announce(place, environ)


def _announce(place, environ) -> None:
  """Each process records its node (for the line that names a lost one); process 0 prints
  where they all run, once: `4 processes: 0-1 on n1, 2-3 on n2; coordinator n1 (...)`."""
  import jax
  from jax._src import distributed  # the client jax.distributed.initialize made

  client = distributed.global_state.client
  coordinator.publish_node(client, jax.process_index(), coordinator.this_node(environ))
  try:
    client.wait_at_barrier('vit_jax/nodes', 60_000)
  except Exception:  # noqa: BLE001  a process gone already: the run says so at its first step
    return
  if jax.process_index() != 0:
    return
  nodes = {int(k.rsplit('/', 1)[1]): v for k, v in client.key_value_dir_get('vit_jax/node/')}
  groups = []  # [node, first rank, last rank], runs of consecutive ranks on one node
  for rank in sorted(nodes):
    if groups and groups[-1][0] == nodes[rank] and groups[-1][2] == rank - 1:
      groups[-1][2] = rank
    else:
      groups.append([nodes[rank], rank, rank])
  where = ', '.join(
    f'{first}{f"-{last}" if last > first else ""} on {node}' for node, first, last in groups
  )
  met = f'; coordinator {place.named()}' if place else ''
  print(f'{jax.process_count()} processes: {where}{met}', flush=True)


def _count_mismatch(tasks: int, processes: int) -> str:
  return (
    f'SLURM started {tasks} task{"s" if tasks > 1 else ""} but JAX would join {processes} '
    f'process{"es" if processes > 1 else ""}: under srun leave out --coordinator_address, '
    '--num_processes and --process_id (SLURM gives them), or start as many tasks'
  )
