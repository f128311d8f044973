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
import os
import re
import sys
from typing import NoReturn

from vit_jax.core.errors import UserError

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
  """A `UserError` ends the command as one line (`fail`), and so does JAX failing to start the
  platforms `JAX_PLATFORMS` names (`platform_missing`); any other error passes, with its
  traceback."""
  try:
    yield
  except UserError as e:
    fail(e)
  except (RuntimeError, AssertionError) as e:
    missing = platform_missing(e)
    if missing is None:
      raise
    fail(missing)


def platform_missing(error: BaseException):
  """The line for JAX failing to start a platform that $JAX_PLATFORMS names (`gpu` or `cuda`
  on a machine without a GPU: a RuntimeError, or a bare AssertionError in JAX's backend set-up),
  else None. Told apart from a bug by asking JAX for its devices again: a backend that did not
  start fails again, at once."""
  wanted = os.environ.get('JAX_PLATFORMS', '')
  jax = sys.modules.get('jax')
  if not wanted or jax is None:
    return None
  try:
    jax.devices()
    return None  # the platforms are up: `error` is something else
  except (RuntimeError, AssertionError) as again:
    text = (message_of(again) or message_of(error)).strip()
  backend = re.search(r"Unable to initialize backend '(\w+)'", text)
  if any(name in wanted for name in ('gpu', 'cuda', 'rocm')):
    why = 'its GPU plugin found no GPU, or no CUDA'
  elif backend:
    why = f'no {backend.group(1)} backend here'
  else:
    why = (text.splitlines() or ['no such device'])[0][:160]
  return (
    f'JAX_PLATFORMS={wanted}: JAX cannot start it on this machine ({why}); unset JAX_PLATFORMS '
    'to use what the machine has, or set JAX_PLATFORMS=cpu'
  )


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


def add_checkpoint_flags(parser, checkpoint: str = '.npz file or a workdir with params.npz'):
  """--checkpoint (what it may be: `checkpoint`), --model, --patch_size and --resample: the
  flags of every command that reads a checkpoint."""
  parser.add_argument('--checkpoint', required=True, help=checkpoint)
  parser.add_argument(
    '--model', help='MODEL_CONFIGS name, e.g. ViT-B_16 (default: the one a workdir records)'
  )
  parser.add_argument(
    '--patch_size',
    type=positive_int,
    help="load the checkpoint at this patch size (FlexiViT's PI-resize; default: its own)",
  )
  parser.add_argument(
    '--resample',
    choices=('bilinear', 'bilinear_antialias', 'bicubic_antialias'),
    help='how position tables and patch kernels are resampled: at --patch_size (default: the '
    "official zoom and FlexiViT's bilinear PI-resize) and a NaFlex ViT's table to each image's "
    "grid (default: the run's, else bilinear; a timm NaFlexVit file needs it); timm's default "
    'is bicubic_antialias',
  )


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
