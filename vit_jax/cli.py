"""The command line of every `python -m vit_jax.NAME`: one `error:` line, one exit code.

An error a user can cause (a flag, a file, a config that cannot run, a
dataset that is not there) ends a command with one line on stderr,
`error: what is wrong; what to do`, and exit status `EXIT_ERROR` (2, what
argparse gives a bad command line), whether the mistake is in the flags or in
what they name. Only `errors.UserError`, the base of every error raised on
purpose, is caught (`reported`, and an OSError at the path a command writes,
`writing`): an error of any other type is a bug and keeps its traceback.
(`predict` and `analyze` exit 1 when some images were unreadable and the
others used: a partial result.)

Commands that take `--config` (main, compile) share `ConfigFlag`: the file is
checked before absl reads it (there, a Python file that compiles), an unknown
`--config.FIELD` names the closest field (or what replaces an official-only
one), a `ConfigError` raised by the config file is its own line, a config
written for the official vit_jax is translated (`configs.official`) once,
here, before any command sees it, and a field the file sets that no run reads
(`config.total_step = 4`) is refused like a misspelt flag.

Ctrl-C: a command that `run` starts ends in one line, `error: interrupted
(Ctrl-C)`, with exit status `EXIT_INTERRUPTED` (130, what a shell reports for
it); a training run handles it itself, as SIGTERM: a checkpoint, one line,
and the same exit status, 130 (143 for SIGTERM; `vit_jax.training.stopping`). A closed stdout (`| head`)
ends a command quietly with exit status `EXIT_BROKEN_PIPE` (141, a shell's for it).
Output: a path whose name is not text in this locale's encoding is printed
as the bytes it has on disk, other characters the terminal cannot show as
escapes (`text_streams`), never a UnicodeEncodeError.
"""

import argparse
import codecs
import contextlib
import difflib
import os
import re
import sys
from typing import NoReturn, Optional

from vit_jax.errors import UserError

EXIT_ERROR = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT (signal_status)
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE


def fail(message) -> NoReturn:
  """Ends the command: `error: message` on stderr, exit status EXIT_ERROR (or the error's own
  `exit_status`: a run stopped by a signal, `signal_status`)."""
  print(f'error: {message_of(message)}', file=sys.stderr, flush=True)
  sys.exit(getattr(message, 'exit_status', EXIT_ERROR))


def signal_status(signum: int) -> int:
  """The exit status a shell gives a process that signal `signum` ended: 128 + signum."""
  return 128 + int(signum)


def note(prog: str, text: str) -> None:
  """`prog: text` on stderr, a remark beside the result; nothing for an empty `text`."""
  if text:
    print(f'{prog}: {text}', file=sys.stderr, flush=True)


def message_of(error) -> str:
  """The text of an error raised on purpose (its first argument), or of a plain string."""
  if isinstance(error, BaseException):
    return str(error.args[0]) if error.args else str(error)
  return str(error)


@contextlib.contextmanager
def reported():
  """A `UserError` ends the command as one line (`fail`); any other error passes, with its
  traceback."""
  try:
    yield
  except UserError as e:
    fail(e)


def run(main, *args, **kwargs) -> int:
  """`main(*args, **kwargs)`, the command's exit status; a Ctrl-C that reaches here is one line,
  a reader of stdout that went away (`| head`) ends the command quietly, as `cat` does."""
  try:
    return main(*args, **kwargs)
  except KeyboardInterrupt:
    print('error: interrupted (Ctrl-C)', file=sys.stderr, flush=True)
    return EXIT_INTERRUPTED
  except BrokenPipeError:
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's flush at exit
    return EXIT_BROKEN_PIPE


def _bytes_or_escapes(error):
  """Encoding error handler: surrogate-escaped bytes (a file name that is not valid text in the
  file system's encoding) as those bytes, other characters as backslash escapes."""
  if not isinstance(error, UnicodeEncodeError):
    raise error
  text = error.object[error.start : error.end]
  if all('\udc80' <= c <= '\udcff' for c in text):
    return bytes(ord(c) - 0xDC00 for c in text), error.end
  return codecs.backslashreplace_errors(error)


codecs.register_error('vit_jax.text', _bytes_or_escapes)


def text_streams() -> None:
  """stdout and stderr print any path and any class name (see the module docstring)."""
  for stream in (sys.stdout, sys.stderr):
    if hasattr(stream, 'reconfigure'):
      stream.reconfigure(errors='vit_jax.text')


@contextlib.contextmanager
def writing(path: str):
  """An OSError writing `path` (or a file inside it) ends the command as one line; others pass."""
  try:
    yield
  except OSError as e:
    name = getattr(e, 'filename', None)
    where = os.path.abspath(path)
    if name is None or not os.path.abspath(os.fsdecode(name)).startswith(where):
      raise
    fail(f'{path}: cannot write it ({e.strerror or e}); pass a path you can write')


def one_line(text: str) -> str:
  """`text` with its control characters (a newline in a class folder's name) as escapes: one
  result, one line."""
  return re.sub(r'[\x00-\x1f\x7f]', lambda m: repr(m.group())[1:-1], text)


def positive_int(text: str) -> int:
  """argparse type: an integer of at least 1 (a batch, a count)."""
  try:
    value = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f'{text!r} is not an integer') from None
  if value < 1:
    raise argparse.ArgumentTypeError(f'{value} must be at least 1')
  return value


def positive_ints(text: str) -> tuple:
  """argparse type: comma-separated integers of at least 1 (`1,5,10,25`)."""
  try:
    return tuple(positive_int(part) for part in text.split(','))
  except argparse.ArgumentTypeError:
    raise argparse.ArgumentTypeError(
      f'{text!r}: pass integers of at least 1, like 1,5,10,25'
    ) from None


class ArgumentParser(argparse.ArgumentParser):
  """argparse whose usage errors are one `error:` line (no usage block) with EXIT_ERROR."""

  def error(self, message):
    fail(f'{message} (see {self.prog} --help)')


def parser(name: str, doc: str, *, whole_doc: bool = True) -> ArgumentParser:
  """The parser of `python -m vit_jax.NAME`, described by the command's docstring."""
  text_streams()
  return ArgumentParser(
    prog=f'python -m vit_jax.{name}',
    description=doc if whole_doc else doc.strip().split('\n', 1)[0],
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )


class ConfigFlag:
  """`--config=FILE[:ARGS]` and `--config.FIELD=VALUE` for an absl command.

  `default`: the config file used when --config is absent (None: required,
  `example` says what to pass). `parse` is the command's `flags_parser` for
  `absl.app.run`; `value` is the translated config.
  """

  def __init__(self, help_text: str, *, default: Optional[str] = None, example: str = ''):
    from ml_collections import config_flags

    # No default here: ml_collections would parse it, and any --config.FIELD,
    # at import. `parse` substitutes `default` when --config is absent.
    self._holder = config_flags.DEFINE_config_file('config', None, help_text, lock_config=True)
    self._default = default
    self._example = example
    self._translated = None
    self._file = default

  def parse(self, argv):
    """absl flag parsing, with one-line errors for the user's mistakes (not for bugs)."""
    from absl import flags

    from vit_jax import run_log
    from vit_jax.configs import ConfigError

    # Before anything imports TensorFlow or JAX: their start-up logs stay hidden.
    run_log.quiet_libraries(run_log.verbosity_in(argv))
    text_streams()
    spec = config_spec(argv)
    if spec is None and self._default is None:
      fail(f'--config is required, e.g. {self._example}')
    if spec is None:
      argv = argv[:1] + [f'--config={self._default}'] + argv[1:]
    else:
      check_config_file(spec.split(':', 1)[0], self._example)
    self._file = (spec or self._default).split(':', 1)[0]
    try:
      argv = flags.FLAGS(argv)
      # ml_collections applies --config.FIELD overrides when the value is first read.
      _ = self._holder.value
      return argv
    except ConfigError as e:  # raised on purpose by the config file (vit_jax.configs.recipes)
      fail(e)
    except AttributeError as e:
      fail(_attribute_error(e, argv))
    except flags.Error as e:
      fail(_flags_error(e))

  @property
  def value(self):
    """The config, an official vit_jax one read as this package's (`configs.official`)."""
    if self._translated is None:
      from vit_jax.configs import official

      with reported():
        translated = official.translate(self._holder.value)
      unknown = unknown_fields(translated)
      if unknown:
        fail(f'config file {self._file}: {unknown}')
      self._translated = translated
    return self._translated


def check_config_file(path: str, example: str) -> None:
  """A --config file that absl can load: there, a file, Python that compiles; else one line."""
  if not os.path.exists(path):
    fail(f'config file {path} not found; configs live in configs/ (e.g. {example})')
  if not os.path.isfile(path) or not path.endswith('.py'):
    fail(
      f'config file {path} is not a Python file: a config is a .py file whose get_config() '
      f'returns a ConfigDict (e.g. {example})'
    )
  try:
    with open(path, 'rb') as f:
      compile(f.read(), path, 'exec')
  except (SyntaxError, ValueError) as e:  # ValueError: null bytes
    where = f', line {e.lineno}' if getattr(e, 'lineno', None) else ''
    text = (getattr(e, 'text', None) or '').strip()
    shown = f': {text[:80]}' if text else ''
    fail(
      f'config file {path}{where}: {type(e).__name__}: {getattr(e, "msg", e)}{shown}; '
      'fix the file (a config is Python)'
    )


def _field_names(config, prefix: str = '') -> list:
  """Dotted names of every field of a ConfigDict, parents before their children."""
  import ml_collections

  names = []
  for key, value in config.items():
    names.append(prefix + key)
    if isinstance(value, ml_collections.ConfigDict):
      names += _field_names(value, f'{prefix}{key}.')
  return names


def unknown_fields(config) -> str:
  """'' when every field of `config` is one a run reads (`configs.schema.FIELDS`); else
  what to say about the first other one: a misspelt field in a config file, as a flag would be."""
  from vit_jax.configs import schema

  known = schema.names()
  for name in _field_names(config):
    parent = name.rpartition('.')[0]
    if name in known or (parent and parent not in known):
      continue  # a field of a known section, or inside an unknown one (named already)
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    hint = f'did you mean {close[0]}?' if close else 'see vit_jax/configs/schema.py for the fields'
    return f'unknown config field {name!r} (no run reads it); {hint}'
  return ''


def config_spec(argv) -> Optional[str]:
  """The FILE[:ARGS] of `--config=` in `argv`, or None."""
  return next((a.split('=', 1)[1] for a in argv if a.startswith('--config=')), None)


def _override_names(argv) -> set:
  """Field names of the --config.A.B=... overrides in `argv`."""
  names = set()
  for arg in argv:
    if arg.startswith('--config.'):
      names.update(arg[len('--config.') :].split('=', 1)[0].split('.'))
  return names


def _attribute_error(e: AttributeError, argv) -> str:
  """The line for a --config.FIELD the locked config lacks, or a config file without its
  get_*config function; any other AttributeError is a bug in the config file and is re-raised."""
  from vit_jax.configs import official

  text = str(e).replace('\\', '')
  if re.search(r"module '[\w.]+' has no attribute 'get_\w*config'", text):
    return f'config file: {text.splitlines()[0]}'
  quoted = re.search(r"'(\w+)'", text)
  if not quoted or quoted.group(1) not in _override_names(argv):
    raise e
  match = re.search(r'Did you mean "([\w.]+)" instead of "([\w.]+)"', text)
  field = match.group(2) if match else quoted.group(1)
  if official.hint(field):
    return f'unknown config field {field!r}: {official.hint(field)}'
  if match:
    return f'unknown config field {field!r}; did you mean {match.group(1)}?'
  return f'unknown config field {field!r}; see the config file'


def _flags_error(e) -> str:
  """absl wraps what the config file raised: a ConfigError there is the user's argument,
  anything else a bug whose traceback absl's message carries. (ml_collections re-raises the
  file's exception as its own type with the traceback as message: the innermost ConfigError
  holds the real message.)"""
  from vit_jax.configs import ConfigError

  cause, original = e.__cause__ or e.__context__, None
  while cause is not None:
    original = cause if isinstance(cause, ConfigError) else original
    cause = cause.__cause__ or cause.__context__
  return message_of(original) if original is not None else str(e)
