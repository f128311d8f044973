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
from ml_collections import config_flags

from vit_jax import run_log
from vit_jax.configs import ConfigError
from vit_jax.configs import official

_DEMO_CONFIG = os.path.join(os.path.dirname(__file__), 'configs', 'demo.py')

# No default here: ml_collections would parse it, and any --config.FIELD, at
# import. `_parse_flags` substitutes the demo config when --config is absent.
_CONFIG = config_flags.DEFINE_config_file(
  'config',
  None,
  'Experiment config file, optionally with `:ARGS` (default: the demo).',
  lock_config=True,
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


def _override_names(argv) -> set:
  """Field names of the --config.A.B=... overrides in `argv`."""
  names = set()
  for arg in argv:
    if arg.startswith('--config.'):
      names.update(arg[len('--config.') :].split('=', 1)[0].split('.'))
  return names


def _parse_flags(argv):
  """absl flag parsing, with one-line errors for the user's mistakes (not for bugs)."""
  # Before anything imports TensorFlow or JAX: their start-up logs stay hidden.
  run_log.quiet_libraries(run_log.verbosity_in(argv))
  config_arg = next((a.split('=', 1)[1] for a in argv if a.startswith('--config=')), None)
  if config_arg is None:
    argv = argv[:1] + [f'--config={_DEMO_CONFIG}'] + argv[1:]
  elif not os.path.exists(config_arg.split(':', 1)[0]):
    _exit(
      f'config file {config_arg.split(":", 1)[0]} not found; configs live in configs/ '
      '(e.g. --config=configs/vit_b16.py:imagenet21k)'
    )
  try:
    argv = flags.FLAGS(argv)
    # ml_collections applies --config.FIELD overrides when the value is first read.
    _ = _CONFIG.value
    return argv
  except ConfigError as e:  # raised on purpose by the config file (vit_jax.configs.recipes)
    _exit(e.args[0] if e.args else str(e))
  except AttributeError as e:
    # A --config.FIELD that the locked config does not have, or a config file
    # without its get_*config function: one line. Any other AttributeError is a
    # bug in the config file and keeps its traceback.
    text = str(e).replace('\\', '')
    if re.search(r"module '[\w.]+' has no attribute 'get_\w*config'", text):
      _exit(f'config file: {text.splitlines()[0]}')
    quoted = re.search(r"'(\w+)'", text)
    if not quoted or quoted.group(1) not in _override_names(argv):
      raise
    match = re.search(r'Did you mean "([\w.]+)" instead of "([\w.]+)"', text)
    field = match.group(2) if match else quoted.group(1)
    if official.hint(field):
      _exit(f'unknown config field {field!r}: {official.hint(field)}')
    if match:
      _exit(f'unknown config field {field!r}; did you mean {match.group(1)}?')
    _exit(f'unknown config field {field!r}; see the config file')
  except flags.Error as e:
    # absl wraps what the config file raised; a ConfigError there is the user's
    # argument, anything else a bug whose traceback absl's message carries.
    # (ml_collections re-raises the file's exception as its own type with the
    # traceback as message: the innermost ConfigError holds the real message.)
    cause, original = e.__cause__ or e.__context__, None
    while cause is not None:
      original = cause if isinstance(cause, ConfigError) else original
      cause = cause.__cause__ or cause.__context__
    if original is not None:
      _exit(original.args[0] if original.args else str(original))
    _exit(str(e))


def _exit(message):
  print(f'error: {message}', file=sys.stderr)
  sys.exit(2)


def _fit_warmup(config, argv) -> None:
  """A warm-up the config file chose but the run is too short for: a tenth of the run.

  Only when --config.warmup_steps is not on the command line: a value the
  user chose is checked, not changed (training.loop.validate).
  """
  if any(a.startswith('--config.warmup_steps') for a in argv):
    return
  if config.total_steps >= 1 and config.warmup_steps >= config.total_steps:
    import jax

    warmup = config.total_steps // 10
    if jax.process_index() == 0:
      print(
        f"warmup_steps {config.warmup_steps} -> {warmup}: the config's warm-up is longer than "
        f'total_steps={config.total_steps} (set --config.warmup_steps to choose)',
        flush=True,
      )
    config.warmup_steps = warmup


def _initialize_distributed():
  """jax.distributed for multi-host runs; single process when nothing says otherwise."""
  import jax

  # CPU processes talk through gloo; accelerators ignore this setting.
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  if _COORDINATOR.value or _NUM_PROCESSES.value:
    jax.distributed.initialize(
      coordinator_address=_COORDINATOR.value,
      num_processes=_NUM_PROCESSES.value,
      process_id=_PROCESS_ID.value,
    )
  elif (
    int(os.environ.get('SLURM_NTASKS', '1')) > 1
    or len(os.environ.get('TPU_WORKER_HOSTNAMES', '').split(',')) > 1
  ):
    jax.distributed.initialize()  # detects SLURM and TPU pod slices itself


def _default_workdir(argv):
  """workdirs/<config name>[_<config args>], e.g. workdirs/finetune_ViT-B_16_cifar10."""
  spec = next((a.split('=', 1)[1] for a in argv if a.startswith('--config=')), 'demo')
  path, _, args = spec.partition(':')
  name = os.path.splitext(os.path.basename(path))[0]
  return os.path.join('workdirs', '_'.join([name] + [a for a in re.split(r'[,:]', args) if a]))


def main(argv):
  if len(argv) > 1:
    _exit(f'unexpected arguments {argv[1:]}; flags are --config, --workdir, --config.FIELD=...')
  # absl attached its log handler after parsing: apply --verbosity to it too.
  verbosity = (
    flags.FLAGS.verbosity if flags.FLAGS['verbosity'].present else run_log.verbosity_in(sys.argv)
  )
  run_log.quiet_libraries(verbosity)
  if verbosity < 1:
    # Orbax logs every checkpoint operation at INFO; keep the run's own lines readable.
    logging.get_absl_handler().addFilter(
      lambda record: record.levelno >= py_logging.WARNING or 'orbax' not in record.pathname
    )
  _initialize_distributed()

  # Imported here: these pull in TensorFlow for the input pipeline.
  from vit_jax import checkpoint
  from vit_jax import workdir as workdir_lib
  from vit_jax.data import pipeline
  from vit_jax.training import loop

  config = _CONFIG.value
  _fit_warmup(config, sys.argv)
  workdir = _WORKDIR.value or _default_workdir(sys.argv)
  try:
    loop.train_and_evaluate(config, workdir)
  except (
    loop.TrainingError,
    ConfigError,  # also an unknown model name (a KeyError of MODEL_CONFIGS)
    checkpoint.CheckpointError,
    pipeline.DataError,
    workdir_lib.WorkdirError,
  ) as e:
    _exit(e.args[0] if e.args else str(e))


if __name__ == '__main__':
  app.run(main, flags_parser=_parse_flags)
