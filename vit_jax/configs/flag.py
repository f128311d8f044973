"""`--config=FILE[:ARGS]` and `--config.FIELD=VALUE`, as a user types them.

The commands that take `--config` (main, compile) share `ConfigFlag`: the file is
checked before absl reads it (there, a Python file that compiles), an unknown
`--config.FIELD` names the closest field (or what replaces an official-only
one), a `ConfigError` raised by the config file is its own line, a config
written for the official vit_jax is translated (`configs.official`) once,
here, before any command sees it, and a field the file sets that no run reads
(`config.total_step = 4`) is refused like a misspelt flag. So are an unknown
flag (naming the command's own flags), a config file whose import fails or whose
`get_config()` returns no ConfigDict, and a relative path typed in another
folder (naming the clone's file). `--help` lists the command's flags and every
config field with its default, values and doc.
"""

import difflib
import os
import re
import sys
import textwrap
import traceback
from typing import Optional

from absl import flags
import ml_collections
from ml_collections import config_flags

from vit_jax.configs import ConfigError
from vit_jax.configs import official
from vit_jax.configs import schema
from vit_jax.core import cli
from vit_jax.core import console


class ConfigFlag:
  """`--config=FILE[:ARGS]` and `--config.FIELD=VALUE` for an absl command.

  `default`: the config file used when --config is absent (None: required,
  `example` says what to pass). `parse` is the command's `flags_parser` for
  `absl.app.run`; `value` is the translated config.
  """

  def __init__(
    self, help_text: str, *, default: Optional[str] = None, example: str = '', doc: str = ''
  ):
    # No default here: ml_collections would parse it, and any --config.FIELD,
    # at import. `parse` substitutes `default` when --config is absent.
    self._holder = config_flags.DEFINE_config_file('config', None, help_text, lock_config=True)
    self._default = default
    self._example = example
    self._doc = doc  # the command's docstring, the head of its --help
    self._translated = None
    self._file = default

  def parse(self, argv):
    """absl flag parsing, with one-line errors for the user's mistakes (not for bugs)."""
    # Before anything imports TensorFlow or JAX: their start-up logs stay hidden.
    console.quiet_libraries(console.verbosity_in(argv))
    cli.text_streams()
    if any(a in HELP_FLAGS for a in argv[1:]):
      try:
        print(self.help(argv[0]), flush=True)
      except BrokenPipeError:  # `--help | head`: quiet, as `cli.run` ends a command
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(cli.EXIT_BROKEN_PIPE)
      sys.exit(0)
    spec = config_spec(argv)
    if spec is None and self._default is None:
      cli.fail(f'--config is required, e.g. {self._example}')
    if spec is None:
      argv = argv[:1] + [f'--config={self._default}'] + argv[1:]
    else:
      path, _, args = spec.partition(':')
      check_config_file(path, self._example, args)
    self._file = (spec or self._default).split(':', 1)[0]
    try:
      argv = flags.FLAGS(argv)
      # ml_collections applies --config.FIELD overrides when the value is first read.
      config = self._holder.value
      if not isinstance(config, ml_collections.ConfigDict):
        cli.fail(_not_a_config_dict(self._file, config))
      return argv
    except ImportError as e:
      cli.fail(_import_error(e, self._file))
    except ConfigError as e:  # raised on purpose by the config file (vit_jax.configs.recipes)
      cli.fail(e)
    except AttributeError as e:
      cli.fail(_attribute_error(e, argv))
    except flags.UnrecognizedFlagError as e:
      cli.fail(_unknown_flag(e, argv[0]))
    except flags.Error as e:
      cli.fail(_flags_error(e, spec or self._default))

  def help(self, program: str) -> str:
    """--help: the command's docstring, its flags, and every config field with its default,
    values and doc (the table of docs/training.md, `python -m vit_jax.configs.schema`)."""
    lines = [self._doc.strip('\n'), '', 'flags:']
    for f in _command_flags():
      if f.name == 'config':
        text = f.help if self._default else f'{f.help} Required.'
        lines.append(_wrapped('--config=FILE[:ARGS]', f'{text} e.g. {self._example}'))
      elif f.name == 'verbosity':
        lines.append(_wrapped('--verbosity=N', console.VERBOSITY_HELP))
      else:
        default = '' if f.default is None else f' (default: {f.default})'
        lines.append(_wrapped(f'--{f.name}{default}', f.help))
    lines += [
      '',
      'config fields: --config.FIELD=VALUE sets one over the config file (default, values, '
      'what it is;',
      'the same table is in docs/training.md and `python -m vit_jax.configs.schema`):',
      *_field_help(),
    ]
    return '\n'.join(lines)

  @property
  def value(self):
    """The config, an official vit_jax one read as this package's (`configs.official`)."""
    if self._translated is None:
      with cli.reported():
        translated = official.translate(self._holder.value)
      unknown = unknown_fields(translated)
      if unknown:
        cli.fail(f'config file {self._file}: {unknown}')
      self._translated = translated
    return self._translated


HELP_FLAGS = ('--help', '-help', '-h', '--helpshort', '--helpfull', '-?')
# absl's own flags that a user of these commands may want (the rest are absl's internals).
_ABSL_FLAGS_SHOWN = ('verbosity',)


def _command_flags() -> list:
  """The flags of the command (this package's), then absl's that matter here, by name."""
  by_module = flags.FLAGS.flags_by_module_dict()
  ours = [f for module, fs in by_module.items() if 'vit_jax' in module for f in fs]
  theirs = [flags.FLAGS[name] for name in _ABSL_FLAGS_SHOWN if name in flags.FLAGS]
  return sorted({f.name: f for f in ours + theirs}.values(), key=lambda f: f.name)


def _wrapped(head: str, text: str) -> str:
  """`  head` and `text` below it, indented, wrapped at 100 columns."""
  body = textwrap.fill(
    text, width=100, initial_indent=' ' * 6, subsequent_indent=' ' * 6, break_on_hyphens=False
  )
  return f'  {head}\n{body}'


def _field_help() -> list:
  lines = []
  for field in schema.FIELDS:
    values = ', '.join(field.allowed) if field.allowed else field.type.__name__
    if field.bounds:
      values += f' in {field.bounds}'
    lines.append(_wrapped(f'--config.{field.name}={field.default!r} ({values})', field.doc))
  return lines


def _unknown_flag(e, program: str) -> str:
  """absl's "Unknown command line flag 'foo'. Did you mean: coordinator_address ?" as one
  line naming a close flag of this command only, and where the flags are listed."""
  name = getattr(e, 'flagname', None) or str(e)
  names = [f.name for f in _command_flags()]
  close = difflib.get_close_matches(name, names, n=1, cutoff=0.75)
  hint = f'did you mean --{close[0]}? ' if close else ''
  command = _command_name(program)
  return (
    f'unknown flag --{name}; {hint}the flags are {", ".join("--" + n for n in names)} and '
    f'--config.FIELD=VALUE ({command} --help lists them)'
  )


def _command_name(program: str) -> str:
  name = os.path.splitext(os.path.basename(program or ''))[0]
  return f'python -m vit_jax.{name}' if name and name != '__main__' else 'the command'


def _not_a_config_dict(path: str, config) -> str:
  return (
    f'config file {path}: get_config() returned a {type(config).__name__}, not an '
    'ml_collections.ConfigDict; return one (ml_collections.ConfigDict({...}), or start from '
    'vit_jax.configs.common.get_config() as configs/vit_b16.py does)'
  )


def _import_error(e: ImportError, path: str) -> str:
  """A config file's own import that fails: one line naming the line and the module. An
  import that fails inside our package or a library is a bug there, and keeps its traceback."""
  frames = traceback.extract_tb(e.__traceback__)
  if not frames or os.path.abspath(frames[-1].filename) != os.path.abspath(path):
    raise e
  line = frames[-1]
  return (
    f'config file {path}, line {line.lineno}: {type(e).__name__}: {e} ({(line.line or "").strip()}); '
    'install the module or fix the import'
  )


def _clone_root() -> str:
  """The folder that holds the `vit_jax` package: a clone's root, where configs/ is."""
  return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def check_config_file(path: str, example: str, args: str = '') -> None:
  """A --config file that absl can load: there, a file, Python that compiles; else one line
  (`args`: what followed the path after a colon, for the command line it suggests)."""
  if not os.path.exists(path):
    clone = os.path.join(_clone_root(), path)
    if not os.path.isabs(path) and os.path.isfile(clone):
      cli.fail(
        f'config file {path} not found in {os.getcwd()}; the clone has {clone}: pass '
        f'--config={clone}{":" + args if args else ""} (or run from {_clone_root()})'
      )
    folder = os.path.join(_clone_root(), 'configs')
    where = folder if os.path.isdir(folder) else os.path.join(_clone_root(), 'vit_jax', 'configs')
    cli.fail(f'config file {path} not found; configs live in {where} (e.g. {example})')
  if not os.path.isfile(path) or not path.endswith('.py'):
    cli.fail(
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
    cli.fail(
      f'config file {path}{where}: {type(e).__name__}: {getattr(e, "msg", e)}{shown}; '
      'fix the file (a config is Python)'
    )


def _field_names(config, prefix: str = '') -> list:
  """Dotted names of every field of a ConfigDict, parents before their children."""
  names = []
  for key, value in config.items():
    names.append(prefix + key)
    if isinstance(value, ml_collections.ConfigDict):
      names += _field_names(value, f'{prefix}{key}.')
  return names


def unknown_fields(config) -> str:
  """'' when every field of `config` is one a run reads (`configs.schema`); else
  what to say about the first other one: a misspelt field in a config file, as a flag would be."""
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


def _flags_error(e, spec: str) -> str:
  """absl wraps what the config file raised: a ConfigError there is the user's argument, and
  so is a call of `get_config` with arguments it does not take (`spec`'s `:ARGS`); anything
  else is a bug whose traceback absl's message carries. (ml_collections re-raises the file's
  exception as its own type with the traceback as message: the innermost ConfigError holds
  the real message.)"""
  cause, original, call = e.__cause__ or e.__context__, None, None
  while cause is not None:
    original = cause if isinstance(cause, ConfigError) else original
    call = cause if _a_call_of_get_config(cause) else call
    cause = cause.__cause__ or cause.__context__
  if original is not None:
    return cli.message_of(original)
  if call is not None:
    path, colon, args = spec.partition(':')
    text = str(call).splitlines()[0]
    if 'takes 0 positional arguments' in text:
      fix = f'it takes no :ARGS, pass --config={path}'
    elif colon:
      fix = f'pass the arguments its get_config takes after the colon (see {path})'
    else:
      fix = f'it needs arguments: pass --config={path}:ARGS (see {path})'
    return f'--config={spec}: {text}; {fix}'
  return str(e)


def _a_call_of_get_config(error: BaseException) -> bool:
  """A TypeError raised by the call of a config file's `get_config` itself (the arguments do
  not fit its signature), not inside it: its innermost frame is the caller's."""
  if not isinstance(error, TypeError) or 'get_config()' not in str(error):
    return False
  frames = traceback.extract_tb(error.__traceback__)
  return bool(frames) and os.path.basename(frames[-1].filename) == 'config_flags.py'
