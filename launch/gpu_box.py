r"""Train on one GPU machine, this one or another over ssh: set up a venv, check the GPU, run.

  python launch/gpu_box.py --workdir=runs/b16 --config=vit_jax/configs/demo.py --dry-run
  python launch/gpu_box.py --host=me@gpu-box --workdir=runs/b16 --dry-run -- --config.batch=256

Actions (positional, default `setup run`, plus `fetch` with --host):
  setup  a virtualenv with vit_jax[gpu] (jax with CUDA 12 wheels) installed from
         this checkout (with --host: its working tree as it is, edits and untracked
         files git does not ignore included, copied over by scp)
  run    check that JAX sees a GPU (else one `error:` line), then
         python -m vit_jax.main with 90% of each
         GPU's memory for JAX (XLA_PYTHON_CLIENT_MEM_FRACTION, what
         `python -m vit_jax.compile --topology=h100-8` checks against); all local
         GPUs are used by the one process, so the same recipe fits an 8-GPU box
  fetch  (--host) copy summary.json and params.npz back to --results

Rerunning `run` with the same workdir resumes from its checkpoints. With --host
a relative --workdir is in the remote login directory (not in the checkout),
and no action deletes or replaces a file there but the code's own: `setup`
again unpacks the new code over the checkout, and `run` again resumes.
"""

import os
import sys

import common

ACTIONS = ('setup', 'run', 'fetch')
# Fails (and stops the run) when JAX has no GPU backend: no driver, or a CPU-only jax. The
# libraries' start-up noise (an installed libtpu, the CUDA plugin without a driver) is hidden;
# what is wrong is one `error:` line with exit status 2, as vit_jax's commands say it.
_GPU_CHECK_CODE = """import os, sys
err = os.dup(2)
os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
try:
    import jax
    gpus, why = jax.devices("gpu"), ""
except Exception as e:
    gpus, why = [], (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
os.dup2(err, 2)
if not gpus:
    print("error: JAX sees no GPU on this machine (" + why + "); check that nvidia-smi lists "
          "one and that the venv holds vit_jax[gpu] (JAX with its CUDA wheels: run setup)",
          file=sys.stderr)
    sys.exit(2)
print(len(gpus), "GPU(s):", gpus[0].device_kind)
"""
# One line, as the dry run prints every command (`exec` of the code above).
_GPU_CHECK = f'exec({_GPU_CHECK_CODE!r})'


def commands(args) -> list:
  python = os.path.join(args.venv, 'bin', 'python')
  check = [python, '-c', _GPU_CHECK]
  train = common.main_command(python, args)
  env = [f'{name}={value}' for name, value in common.GPU_ENV.items()]
  out = []
  if not args.host:
    for action in args.actions:
      if action == 'setup':
        out.append(['python3', '-m', 'venv', args.venv])
        out.append([python, '-m', 'pip', 'install', '-q', '-e', f'{common.ROOT}[gpu]'])
      elif action == 'run':
        out += [check, ['env', *env, *train]]
    return out

  def remote(*lines):
    return ['ssh', args.host, ' && '.join(lines)]

  # A relative workdir is in the login directory, beside the checkout rather than inside it.
  remote_workdir = args.workdir if os.path.isabs(args.workdir) else f'../{args.workdir}'
  train = common.main_command(python, args, workdir=remote_workdir)

  cd = f'cd {common.REMOTE_DIR}'
  for action in args.actions:
    if action == 'setup':
      archive, make_archive, note = common.local_archive('gpu_box')
      print(note, file=sys.stderr)
      out.append(make_archive)
      out.append(['scp', archive, f'{args.host}:{common.ARCHIVE}'])
      out.append(
        remote(
          common.unpack(),
          cd,
          f'python3 -m venv {args.venv}',
          f'{python} -m pip install -q -e ".[gpu]"',
        )
      )
    elif action == 'run':
      export = f'export {" ".join(env)}'
      out.append(remote(cd, export, common.shell_join(check), common.shell_join(train)))
    elif action == 'fetch':
      out.append(['mkdir', '-p', args.results])
      out.append(
        [
          'scp',
          f'{args.host}:{args.workdir}/summary.json',
          f'{args.host}:{args.workdir}/params.npz',
          args.results,
        ]
      )
  return out


def main(argv=None) -> int:
  parser = common.Parser(
    prog='launch/gpu_box.py',
    description=__doc__,
    formatter_class=common.argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument('actions', nargs='*', metavar='ACTION', help=f'any of {", ".join(ACTIONS)}')
  parser.add_argument('--host', help='user@machine to run on over ssh (default: this machine)')
  parser.add_argument('--venv', default='.venv', help='virtualenv path (relative: to the checkout)')
  parser.add_argument('--results', default='results', help='local folder for fetched results')
  common.add_common_flags(parser, 'directory for checkpoints, logs and results')
  args = parser.parse(argv)
  args.actions = args.actions or (['setup', 'run'] + (['fetch'] if args.host else []))
  unknown = [a for a in args.actions if a not in ACTIONS]
  if unknown:
    parser.error(f'unknown action {unknown[0]!r}; use any of {", ".join(ACTIONS)}')
  if 'fetch' in args.actions and not args.host:
    parser.error('fetch copies results from --host; without it they are already in --workdir')
  if not args.host:
    args.venv = os.path.join(common.ROOT, args.venv)
    os.chdir(common.ROOT)  # `--config` paths are relative to the checkout
  return common.execute(commands(args), args.dry_run)


if __name__ == '__main__':
  sys.exit(main())
