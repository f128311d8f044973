"""What a command shows on the terminal: progress and ETA, heartbeats through long waits, and
how much of the libraries' own logs.

Progress, evaluation and the final `Done:` line are plain lines on stdout,
where a person reads them and a script can parse them. The libraries' start-up
logs (TensorFlow, XLA, absl INFO) are hidden unless asked for with
`--verbosity=0` (or higher) or the environment variable VIT_JAX_VERBOSITY:
`quiet_libraries` sets that up before TensorFlow or JAX starts.
"""

import contextlib
import glob
import importlib.util
import logging as py_logging
import os
import re
import sys
import tempfile
import threading
import time
from typing import Optional
import warnings

from absl import logging


def format_duration(seconds: float) -> str:
  seconds = int(seconds)
  hours, rest = divmod(seconds, 3600)
  minutes, seconds = divmod(rest, 60)
  return f'{hours}h{minutes:02d}m' if hours else f'{minutes}m{seconds:02d}s'


class Progress:
  """Throughput and ETA between progress lines."""

  def __init__(self, total_steps: int, first_step: int, batch_size: int):
    self.total_steps = total_steps
    self.batch_size = batch_size
    self._last_step, self._last_time = first_step, time.perf_counter()
    self.img_per_sec = 0.0
    self.step_time = 0.0

  def update(self, step: int) -> dict:
    """Call after `step`'s metrics are on the host; returns img/s and ETA."""
    now = time.perf_counter()
    steps = step - self._last_step
    if steps > 0:
      step_time = (now - self._last_time) / steps
      self.img_per_sec = self.batch_size / step_time
      self.step_time = step_time
    self._last_step, self._last_time = step, now
    return {'img_per_sec': self.img_per_sec}

  def restart_clock(self, step: int) -> None:
    """Excludes time spent outside training steps (evaluation, checkpoints)."""
    self._last_step, self._last_time = step, time.perf_counter()

  def line(self, step: int, loss: float, lr: float) -> str:
    eta = (self.total_steps - step) * self.step_time
    return (
      f'step {step}/{self.total_steps}  loss {loss:.4f}  lr {lr:.3g}  '
      f'{self.img_per_sec:,.0f} img/s  ETA {format_duration(eta)}'
    )


# Seconds between the lines of a long wait (`heartbeat`): under 30, so that a compile or an
# evaluation never looks hung for longer, even when the machine is slow to wake the thread.
HEARTBEAT_S = 20.0


def _to_stderr(line: str) -> None:
  print(line, file=sys.stderr, flush=True)


@contextlib.contextmanager
def heartbeat(what: str, say=_to_stderr, every: Optional[float] = None):
  """While the block runs, `say('{what}: 1m20s so far')` every `every` s (HEARTBEAT_S).

  For the waits that print nothing of their own (compiling a big program,
  evaluating a whole split, timing a benchmark). Lines go to stderr by
  default, where they do not mix with a command's result on stdout; a
  block shorter than `every` says nothing.
  """
  every = HEARTBEAT_S if every is None else every
  done, start = threading.Event(), time.perf_counter()

  def beat():
    while not done.wait(every):
      say(f'{what}: {format_duration(time.perf_counter() - start)} so far')

  thread = threading.Thread(target=beat, name='heartbeat', daemon=True)
  thread.start()
  try:
    yield
  finally:
    done.set()
    thread.join()


# ---------------------------------------------------------------------------
# What the commands show of the libraries' logs.

VERBOSITY_ENV = 'VIT_JAX_VERBOSITY'


def default_verbosity() -> int:
  """absl's scale: -1 (default) warnings only, 0 INFO (full logs), 1 debug. A value that is not
  an integer ends the command in one line (it would otherwise be ignored unseen)."""
  text = os.environ.get(VERBOSITY_ENV, '-1')
  try:
    return int(text)
  except ValueError:
    from vit_jax.core import cli

    cli.fail(
      f'{VERBOSITY_ENV}={text!r} is not an integer; set -1 (warnings only, the default), 0 (full '
      'library logs) or 1 (debug), or unset it'
    )


def verbosity_in(argv) -> int:
  """--verbosity=N (or -v N) in `argv`, else $VIT_JAX_VERBOSITY: read before any parser runs."""
  for i, arg in enumerate(argv):
    for name in ('--verbosity', '-verbosity', '--v', '-v'):
      value = arg[len(name) + 1 :] if arg.startswith(name + '=') else None
      if arg == name and i + 1 < len(argv):
        value = argv[i + 1]
      if value is not None and value.lstrip('-').isdigit():
        return int(value)
  return default_verbosity()


_NO_TPU_HOST = {
  'TPU_SKIP_MDS_QUERY': '1',
  'TPU_ACCELERATOR_TYPE': 'v4-8',
  'TPU_WORKER_HOSTNAMES': 'localhost',
  'TPU_WORKER_ID': '0',
}


def _libtpu_without_tpu() -> bool:
  """libtpu is installed but no PCI device has Google's vendor id (0x1ae0: TPU chips)."""
  if importlib.util.find_spec('libtpu') is None:
    return False
  for path in glob.glob('/sys/bus/pci/devices/*/vendor'):
    try:
      with open(path, encoding='ascii') as f:
        if f.read().strip() == '0x1ae0':
          return False
    except OSError:
      continue
  return True


def _platforms_here() -> str:
  gpu = os.path.exists('/dev/nvidia0') and any(
    importlib.util.find_spec(name) for name in ('jax_cuda12_plugin', 'jax_cuda13_plugin')
  )
  return 'cuda,cpu' if gpu else 'cpu'


def leave_out_an_absent_tpu() -> None:
  """For the Python API, where JAX is imported before anything of ours runs: libtpu without a
  TPU left out of the platforms JAX starts (its five lines of errors, one `E0000 ...
  INVALID_ARGUMENT`), as `quiet_libraries` does for the commands. Nothing where the user chose
  the platforms, or where JAX has started them already."""
  if os.environ.get('JAX_PLATFORMS') or not _libtpu_without_tpu():
    return
  import jax

  if not jax.config.jax_platforms:
    jax.config.update('jax_platforms', _platforms_here())


# What native libraries log before absl's logging is set up, whatever TF_CPP_MIN_LOG_LEVEL says:
# INFO lines (`I1126 12:00:00.123456  4242 port.cc:153] oneDNN custom operations are on ...`)
# and absl's notice that comes before them.
_NATIVE_INFO = re.compile(
  r'I\d{4} [\d:.]+ +\d+ \S+:\d+\] |WARNING: All log messages before absl::InitializeLog\(\)'
)


@contextlib.contextmanager
def native_info_hidden():
  """Drops the native INFO lines written to stderr (file descriptor 2) inside the block, as
  TensorFlow's import does, when `quiet_libraries` (or the user) hid INFO logs; the block's
  other stderr lines are written after it, in their order."""
  if os.environ.get('TF_CPP_MIN_LOG_LEVEL', '0') in ('', '0'):
    yield
    return
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile() as caught:
    os.dup2(caught.fileno(), 2)
    try:
      yield
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
      caught.seek(0)
      for line in caught.read().decode('utf-8', 'replace').splitlines(keepends=True):
        if not _NATIVE_INFO.match(line):
          sys.stderr.write(line)
      sys.stderr.flush()


VERBOSITY_HELP = (
  f'-1 (default, or ${VERBOSITY_ENV}): warnings only; 0: full library logs (TensorFlow, XLA, '
  'absl INFO); 1: debug'
)


@contextlib.contextmanager
def library_output_hidden(quiet_on=lambda error: False):
  """Drops what the block writes to stdout and stderr (file descriptors 1 and 2: a library's
  progress and start-up lines, TensorFlow's and torch's exporters) when `quiet_libraries` hid
  the libraries' logs. If the block fails, its output is written after all (it may explain a
  bug), unless `quiet_on(error)`: an error that is said in one line anyway."""
  if os.environ.get('TF_CPP_MIN_LOG_LEVEL', '0') in ('', '0'):
    yield
    return
  sys.stdout.flush()
  sys.stderr.flush()
  saved = [os.dup(1), os.dup(2)]
  with tempfile.TemporaryFile() as caught:
    os.dup2(caught.fileno(), 1)
    os.dup2(caught.fileno(), 2)
    # Python's own writes too, wherever sys.stdout points (a notebook, a test's capture).
    python = open(os.dup(caught.fileno()), 'w', encoding='utf-8', errors='replace')
    failed = None
    try:
      with contextlib.redirect_stdout(python), contextlib.redirect_stderr(python):
        yield
    except BaseException as e:
      failed = e
      raise
    finally:
      python.close()
      for fd, copy in ((1, saved[0]), (2, saved[1])):
        os.dup2(copy, fd)
        os.close(copy)
      if failed is not None and not quiet_on(failed):
        caught.seek(0)
        sys.stderr.write(caught.read().decode('utf-8', 'replace'))
        sys.stderr.flush()


def add_verbosity_flag(parser) -> None:
  """`--verbosity` for an argparse command, with the same scale as absl's."""
  parser.add_argument('--verbosity', type=int, default=default_verbosity(), help=VERBOSITY_HELP)


def quiet_libraries(verbosity: int) -> None:
  """Below 0, hides the C++ start-up logs of TensorFlow and XLA and absl's INFO lines.

  Takes effect for TensorFlow and XLA only when called before they are
  imported; variables the user set are kept.
  """
  if verbosity >= 0:
    logging.set_verbosity(logging.DEBUG if verbosity > 0 else logging.INFO)
    return
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')  # TensorFlow/XLA C++: errors only
  os.environ.setdefault('GRPC_VERBOSITY', 'ERROR')
  os.environ.setdefault('GLOG_minloglevel', '2')
  if _libtpu_without_tpu():
    # libtpu (the [tpu] extra) on a machine without TPUs prints a screen of
    # errors when JAX tries it; leave it out of the platforms JAX starts.
    if 'JAX_PLATFORMS' not in os.environ:
      os.environ['JAX_PLATFORMS'] = _platforms_here()
    # Describing a slice (`vit_jax.compile`), libtpu asks the cloud's metadata
    # server about this host and logs five lines, one of them `E0000`, when
    # there is none: name a one-host TPU VM instead (the records of programs
    # compiled either way are the same but for the compile time).
    for name, value in _NO_TPU_HOST.items():
      os.environ.setdefault(name, value)
  logging.set_verbosity(logging.WARNING)
  # Libraries' notes to their own developers (torch.onnx, orbax): not for users.
  warnings.filterwarnings('ignore', category=FutureWarning)
  warnings.filterwarnings('ignore', category=DeprecationWarning)
  # torchvision, which transformers and torch.onnx may import, warns that its image extension
  # does not load beside a CPU-only torch, and of its beta namespaces; PIL that a large image
  # could be a decompression bomb (predict reads it, or refuses it past twice the limit).
  warnings.filterwarnings('ignore', category=UserWarning, module=r'torchvision(\.|$)')
  warnings.filterwarnings('ignore', message=r'Image size \(\d+ pixels\) exceeds limit')
  # JAX logs a GPU plugin that finds no GPU or CUDA with its traceback, then runs on the CPU (or,
  # where $JAX_PLATFORMS asks for the GPU, fails: `cli.platform_missing` says so in one line).
  py_logging.getLogger('jax._src.xla_bridge').addFilter(
    lambda record: not record.getMessage().startswith('Jax plugin configuration error')
  )
  # TFDS warns that an unprepared dataset's folder "has no dataset_info.json"
  # before our own one-line error says what to do about it.
  py_logging.getLogger('absl').addFilter(
    lambda record: 'has no dataset_info.json' not in record.getMessage()
  )
  # Warnings that remain are read by people: `WARNING: ...`, without absl's prefix.
  logging.get_absl_handler().setFormatter(py_logging.Formatter('%(levelname)s: %(message)s'))
  py_logging.getLogger().setLevel(py_logging.WARNING)
