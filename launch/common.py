"""What the launch scripts share: flags passed to vit_jax.main, printing or running commands.

Each script builds a list of commands (argv lists, or a file to write), then
either prints them (`--dry-run`: exactly what would run, shell-quoted, one per
line) or runs them in order, stopping at the first failure. Only the standard
library is used, so the scripts run where vit_jax is not installed.
"""

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
from typing import List, NamedTuple, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The share of each GPU's memory JAX's allocator takes (its default is 0.75):
# what `python -m vit_jax.compile --topology=h100-8` checks a program against
# (vit_jax.bench.gpus.MEMORY_FRACTION). The rest stays for the CUDA context,
# cuDNN and cuBLAS handles and NCCL's buffers.
GPU_ENV = {'XLA_PYTHON_CLIENT_MEM_FRACTION': '0.9'}
REMOTE_DIR = 'vit_jax'  # the checkout on remote machines, relative to the login directory
ARCHIVE = 'vit_jax-src.tar.gz'


class WriteFile(NamedTuple):
  """A file to write locally (printed as a here-document in a dry run)."""

  path: str
  content: str


class Parser(argparse.ArgumentParser):
  """argparse with one-line errors; `-- --config.FIELD=VALUE ...` goes to vit_jax.main."""

  def error(self, message):
    self.exit(2, f'{self.prog}: error: {message}\n')

  def parse(self, argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index('--') if '--' in argv else len(argv)
    args = self.parse_args(argv[:split])
    overrides = argv[split + 1 :]
    bad = [a for a in overrides if not a.startswith('--config.')]
    if bad:
      self.error(f'after --, only --config.FIELD=VALUE overrides for vit_jax.main, not {bad[0]}')
    args.overrides = overrides
    return args


def add_common_flags(parser: Parser, workdir_help: str) -> None:
  parser.add_argument('--workdir', required=True, help=workdir_help)
  parser.add_argument(
    '--config',
    help='vit_jax.main --config, a path relative to the repository '
    'root (default: the demo), e.g. vit_jax/configs/demo.py',
  )
  parser.add_argument(
    '--dry-run',
    '--dry_run',
    dest='dry_run',
    action='store_true',
    help='print the commands instead of running them',
  )


def main_command(python: str, args, workdir: str = '') -> List[str]:
  """`python -m vit_jax.main` with the run's flags (on `workdir`, default --workdir)."""
  command = [python, '-m', 'vit_jax.main', f'--workdir={workdir or args.workdir}']
  if args.config:
    command.append(f'--config={args.config}')
  return command + list(args.overrides)


# Untracked files shipped with the working tree at most (a dataset or a run left in the
# checkout would otherwise travel to every machine): more is refused, naming the largest.
UNTRACKED_LIMIT = 50 * 2**20


def _git(*args) -> str:
  result = subprocess.run(['git', '-C', ROOT, *args], capture_output=True, text=True)
  if result.returncode:
    why = (result.stderr.strip().splitlines() or ['no reason given'])[0]
    print(f'error: git {args[0]} in {ROOT}: {why}; the code is shipped from a git checkout',
          file=sys.stderr)  # fmt: skip
    raise SystemExit(2)
  return result.stdout


def local_archive(name: str) -> tuple:
  """(path, command, note): the working tree as the user has it -- the committed files with
  their edits (`git stash create`: a commit of them that touches neither the tree nor the
  stash) and the untracked files git does not ignore (a new config) -- as a tarball to copy
  to machines, and a line saying what it adds to HEAD. More than UNTRACKED_LIMIT of
  untracked files is refused in one line (exit status 2)."""
  path = os.path.join(tempfile.gettempdir(), f'{name}-{ARCHIVE}')
  edited = _git('stash', 'create').strip()
  untracked = sorted(
    f for f in _git('ls-files', '-z', '--others', '--exclude-standard').split('\0') if f
  )
  sizes = {f: os.path.getsize(os.path.join(ROOT, f)) for f in untracked}
  if sum(sizes.values()) > UNTRACKED_LIMIT:
    largest = max(sizes, key=sizes.get)
    print(
      f'error: {sum(sizes.values()) / 2**20:,.0f} MiB of untracked files in {ROOT} would be '
      f'shipped (the largest: {largest}); add them to .gitignore, or move them out of the '
      'checkout',
      file=sys.stderr,
    )
    raise SystemExit(2)
  extra = []
  for f in untracked:  # each under its own folder: --add-file takes the prefix before it
    folder = os.path.dirname(f)
    extra += [f'--prefix={REMOTE_DIR}/{folder + "/" if folder else ""}', f'--add-file={f}']
  changed = len(_git('diff', 'HEAD', '--name-only').split()) if edited else 0
  parts = [f'{changed} edited'] if changed else []
  if untracked:
    shown = ', '.join(untracked[:3]) + (', ...' if len(untracked) > 3 else '')
    parts.append(f'{len(untracked)} untracked ({shown})')
  note = (
    f'shipping the working tree of {ROOT}: HEAD with {" and ".join(parts)} file(s)'
    if parts
    else f'shipping {ROOT} at HEAD (no edits, no untracked files)'
  )
  command = ['git', '-C', ROOT, 'archive', '--format=tar.gz', *extra, f'--prefix={REMOTE_DIR}/']
  return path, command + ['-o', path, edited or 'HEAD'], note


def unpack(archive: str = ARCHIVE) -> str:
  """Remote shell line: the archive's files over the checkout. Nothing there is deleted or
  replaced but the code's own files: a run's workdir inside it, its log, a virtualenv stay."""
  return f'mkdir -p {REMOTE_DIR} && tar xzf {archive}'


def unpack_and_install(extra: str, python: str = 'python3') -> str:
  """Remote shell line: unpack the archive over the checkout and pip-install it."""
  return f'{unpack()} && {python} -m pip install -q -e "./{REMOTE_DIR}[{extra}]"'


def shell_join(command: Sequence[str]) -> str:
  return shlex.join(command)


def execute(commands: Sequence, dry_run: bool) -> int:
  """Prints (dry run) or runs `commands` in order; returns an exit status."""
  for command in commands:
    if isinstance(command, WriteFile):
      if dry_run:
        print(f"cat > {shlex.quote(command.path)} <<'EOF'\n{command.content}EOF")
      else:
        os.makedirs(os.path.dirname(os.path.abspath(command.path)), exist_ok=True)
        with open(command.path, 'w', encoding='utf-8') as f:
          f.write(command.content)
        print(f'wrote {command.path}', flush=True)
      continue
    print(shell_join(command), flush=True)
    if dry_run:
      continue
    try:
      status = subprocess.run(command, check=False).returncode
    except FileNotFoundError:
      print(
        f'error: {command[0]} not found; install it (gcloud: https://cloud.google.com/sdk, '
        'sbatch: run on a SLURM login node)',
        file=sys.stderr,
      )
      return 1
    if status:
      if status != 2:  # 2: the command said what is wrong in one `error:` line of its own
        print(f'error: exit status {status} from: {shell_join(command)}', file=sys.stderr)
      return status
  return 0
