"""The command line of every `python -m vit_jax.NAME`: one `error:` line, one exit code.

An error a user can cause (a flag, a file, a config that cannot run, a
dataset that is not there) ends a command with one line on stderr,
`error: what is wrong; what to do`, and exit status `EXIT_ERROR` (2, what
argparse gives a bad command line), whether the mistake is in the flags or in
what they name. Only the error types a command names are caught
(`reported`): a bug keeps its traceback. (`python -m vit_jax.predict` exits 1
when some images were unreadable and the others predicted: a partial result.)

Commands that take `--config` (main, compile) share `ConfigFlag`: the file is
checked before absl reads it, an unknown `--config.FIELD` names the closest
field (or what replaces an official-only one), a `ConfigError` raised by the
config file is its own line, and a config written for the official vit_jax is
translated (`configs.official`) once, here, before any command sees it.
"""

import argparse
import contextlib
import os
import re
import sys
from typing import NoReturn, Optional

EXIT_ERROR = 2


def fail(message) -> NoReturn:
  """Ends the command: `error: message` on stderr, exit status EXIT_ERROR."""
  print(f'error: {message_of(message)}', file=sys.stderr, flush=True)
  sys.exit(EXIT_ERROR)


def message_of(error) -> str:
  """The text of an error raised on purpose (its first argument), or of a plain string."""
  if isinstance(error, BaseException):
    return str(error.args[0]) if error.args else str(error)
  return str(error)


@contextlib.contextmanager
def reported(*errors):
  """Errors of the types `errors` end the command as one line (`fail`); others pass."""
  try:
    yield
  except errors as e:
    fail(e)


class ArgumentParser(argparse.ArgumentParser):
  """argparse whose usage errors are one `error:` line (no usage block) with EXIT_ERROR."""

  def error(self, message):
    fail(f'{message} (see {self.prog} --help)')


def parser(name: str, doc: str, *, whole_doc: bool = True) -> ArgumentParser:
  """The parser of `python -m vit_jax.NAME`, described by the command's docstring."""
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

  def parse(self, argv):
    """absl flag parsing, with one-line errors for the user's mistakes (not for bugs)."""
    from absl import flags

    from vit_jax import run_log
    from vit_jax.configs import ConfigError

    # Before anything imports TensorFlow or JAX: their start-up logs stay hidden.
    run_log.quiet_libraries(run_log.verbosity_in(argv))
    spec = config_spec(argv)
    if spec is None and self._default is None:
      fail(f'--config is required, e.g. {self._example}')
    if spec is None:
      argv = argv[:1] + [f'--config={self._default}'] + argv[1:]
    elif not os.path.exists(spec.split(':', 1)[0]):
      fail(
        f'config file {spec.split(":", 1)[0]} not found; configs live in configs/ '
        f'(e.g. {self._example})'
      )
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
      from vit_jax.configs import ConfigError
      from vit_jax.configs import official

      with reported(ConfigError):
        self._translated = official.translate(self._holder.value)
    return self._translated


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
