r"""Pre-train or fine-tune a ViT: `python -m vit_jax.main`.

  python -m vit_jax.main                                   # the offline demo
  python -m vit_jax.main --config=configs/vit_l16.py:imagenet21k --workdir=gs://bucket/run
  python -m vit_jax.main --config=configs/finetune.py:ViT-B_16,cifar10 --workdir=DIR \
      --config.batch=256 --config.accum_steps=2

Running the same command on the same workdir resumes the run. Multi-host:
every process runs the same command; pass --coordinator_address,
--num_processes and --process_id, or leave them out on TPU VMs and under SLURM
(detected) or on a single host.
"""

import logging as py_logging
import os
import re
import sys

from absl import app
from absl import flags
from absl import logging

from vit_jax.configs import flag
from vit_jax.configs import schema
from vit_jax.core import cli
from vit_jax.core import console
from vit_jax.core import processes

_CONFIG = flag.ConfigFlag(
  'Experiment config file, optionally with `:ARGS` (default: the demo).',
  default=os.path.join(os.path.dirname(__file__), 'configs', 'demo.py'),
  example='--config=configs/vit_b16.py:imagenet21k',
  doc=__doc__,
)
_WORKDIR = flags.DEFINE_string(
  'workdir',
  None,
  'Directory (local or gs://) for checkpoints, logs and results; default: workdirs/<config name>.',
)
_COORDINATOR = flags.DEFINE_string(
  'coordinator_address', None, 'host:port of process 0, for jax.distributed.initialize.'
)
_NUM_PROCESSES = flags.DEFINE_integer('num_processes', None, 'Number of processes.')
_PROCESS_ID = flags.DEFINE_integer('process_id', None, 'This process index.')


def _fit_warmup(config, argv) -> None:
  """A warm-up the config file chose but the run is too short for: `schema.fitted_warmup`.

  Only when --config.warmup_steps is not on the command line: a value the
  user chose is checked, not changed (`schema.warmup_before_the_end`).
  """
  if any(a.startswith('--config.warmup_steps') for a in argv):
    return
  warmup = schema.fitted_warmup(config)
  if warmup is not None:
    import jax

    if jax.process_index() == 0:
      print(
        f"warmup_steps {config.warmup_steps} -> {warmup}: the config's warm-up is longer than "
        f'total_steps={config.total_steps} (set --config.warmup_steps to choose)',
        flush=True,
      )
    config.warmup_steps = warmup


def _default_workdir(argv):
  """workdirs/<config name>[_<config args>], e.g. workdirs/finetune_ViT-B_16_cifar10."""
  spec = flag.config_spec(argv) or 'demo'
  path, _, args = spec.partition(':')
  name = os.path.splitext(os.path.basename(path))[0]
  return os.path.join('workdirs', '_'.join([name] + [a for a in re.split(r'[,:]', args) if a]))


def main(argv):
  if len(argv) > 1:
    cli.fail(f'unexpected arguments {argv[1:]}; flags are --config, --workdir, --config.FIELD=...')
  # absl attached its log handler after parsing: apply --verbosity to it too.
  verbosity = (
    flags.FLAGS.verbosity if flags.FLAGS['verbosity'].present else console.verbosity_in(sys.argv)
  )
  console.quiet_libraries(verbosity)
  if verbosity < 1:
    # Orbax logs every checkpoint operation at INFO; keep the run's own lines readable.
    logging.get_absl_handler().addFilter(
      lambda record: record.levelno >= py_logging.WARNING or 'orbax' not in record.pathname
    )
  from vit_jax.core import hardware  # imports JAX: after quiet_libraries

  # On a GPU, JAX takes 75% of its memory by default; `python -m vit_jax.compile
  # --topology=h100-8` and the launch scripts count on 90% (read as its backends start).
  os.environ.setdefault('XLA_PYTHON_CLIENT_MEM_FRACTION', str(hardware.GPU_MEMORY_FRACTION))
  # Everything that may ask JAX for its platform or raise a UserError is inside: a launch that
  # cannot work (vit_jax.core.processes), JAX_PLATFORMS naming an absent platform, a bad run.
  with cli.reported():
    processes.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
    # Imported here: these pull in JAX and the input pipeline.
    from vit_jax.training import loop

    config = _CONFIG.value  # an official vit_jax config already translated
    _fit_warmup(config, sys.argv)
    workdir = _WORKDIR.value or _default_workdir(sys.argv)
    loop.train_and_evaluate(config, workdir)


if __name__ == '__main__':
  # A Ctrl-C that training did not turn into a checkpoint (vit_jax.training.stopping): one line.
  sys.exit(cli.run(app.run, main, flags_parser=_CONFIG.parse))
