r"""Compile a run's train step for a TPU slice or NVIDIA GPUs on this machine: fit, speed, cost.

  python -m vit_jax.compile --config=configs/vit_l16.py:jft --topology=v3-256 [--fit] \
      [--json=PATH] [--config.FIELD=VALUE ...]
  python -m vit_jax.compile --config=configs/vit_b16.py:imagenet21k --topology=h100-16 --fit

The real TPU compiler (libtpu: `pip install -e ".[tpu]"`) compiles the very
train and eval steps the trainer runs, for the devices of the named slice
(v3-8, v4-128, v5e-256, v6e-64, ... or v3:4x4), on any CPU machine. It prints
HBM per device against the chip's, FLOPs per step against the closed form,
the compiler's step-time estimate (a lower bound) with the img/s and MFU it
implies (upper bounds), the collectives and their bytes, the matmul dtypes,
and the whole run's cost in chip-days. Estimates, not measurements.
`--fit` searches the smallest change that fits (accumulation, remat, FSDP).

GPUs (`h100-8`: one box of 8; `h100-1`, `h100-16` = two boxes, `h200-8`,
`a100-8`, `a100_40g-8`; `pip install -e ".[gpu]"`, no GPU needed): the GPU
compiler compiles the same steps, with the choices the trainer makes on that
GPU (cuDNN attention); the record gives memory per GPU against the card,
the attention kernel, the collectives over NVLink and between boxes, a
roofline lower bound on the step time, and the launch command that runs it.
"""

import json
import os
import sys

# The compiler runs on the host; JAX itself needs no accelerator here (and on a
# CPU machine with libtpu installed would otherwise probe for a TPU).
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

from absl import app  # noqa: E402
from absl import flags  # noqa: E402

from vit_jax.configs import flag  # noqa: E402
from vit_jax.core import cli  # noqa: E402
from vit_jax.core import console  # noqa: E402

_CONFIG = flag.ConfigFlag(
  'Experiment config file, optionally with `:ARGS`.',
  example='--config=configs/vit_b16.py:imagenet21k',
  doc=__doc__,
)
_TOPOLOGY = flags.DEFINE_string(
  'topology',
  'v3-8',
  'TPU slice (v3-8, v4-128, v5e-256, v3:4x4, ...) or GPUs (h100-8, a100-16, ...)',
)
_NUM_SLICES = flags.DEFINE_integer('num_slices', 1, 'Slices joined over the data-centre network.')
_FIT = flags.DEFINE_bool('fit', False, 'If it does not fit, search overrides that do.')
_MAX_COMPILES = flags.DEFINE_integer('max_compiles', 6, 'Compiles --fit may try.')
_JSON = flags.DEFINE_string('json', None, 'Write the record here as JSON.')

GiB = 2**30


_exit = cli.fail  # one `error:` line and the usage-error exit status, as every command


def _command_line(overrides: dict) -> str:
  given = [a for a in sys.argv[1:] if a.startswith('--config')]
  keys = {f'--config.{k}' for k in overrides}
  given = [a for a in given if a.split('=', 1)[0] not in keys]
  extra = [f'--config.{k}={v}' for k, v in overrides.items()]
  return ' '.join(['python -m vit_jax.main', *given, *extra, '--workdir=DIR'])


def _describe(record: dict) -> str:
  r = record
  gib = lambda b: f'{b / GiB:.2f} GiB'
  tm = r['train_memory']
  lines = [
    f'{r["model"]} on {r["topology"]} ({r["topology_shape"]}, {r["chips"]} chips, '
    f'{r["devices"]} devices; mesh {" ".join(f"{k}={v}" for k, v in r["mesh"].items())}): batch '
    f'{r["batch"]} (accum {r["accum_steps"]}{", remat" if r["remat"] else ""}), {r["dtype"]}, '
    f'{r["image_size"]} px',
    f'  HBM per device   {gib(r["hbm_bytes_per_device"])} of {gib(r["hbm_capacity_bytes"])}: '
    f'arguments {gib(tm["argument_bytes"])}, temporaries {gib(tm["temp_bytes"])}, code '
    f'{gib(tm["code_bytes"])}, aliased (donated) {gib(tm["alias_bytes"])}',
    f'  FLOPs per device {r["flops_per_step_per_device"]:.4g} per step'
    + (
      f' (closed form {r["closed_form_flops_per_step_per_device"]:.4g}: '
      f'{r["flops_vs_closed_form"]:.3f}x)'
      if r['flops_vs_closed_form']
      else ''
    ),
  ]
  if r['step_seconds_estimate']:
    lines.append(
      f'  step time        >= {r["step_seconds_estimate"]:.4g} s (compiler estimate); '
      f'<= {r["img_per_sec_estimate"]:,.0f} img/s'
      + (f', MFU <= {r["mfu_upper_bound"]:.3f}' if r['mfu_upper_bound'] else '')
    )
  else:
    lines.append('  step time        the compiler gave no estimate')
  by_op = r.get('time_by_op')
  if by_op:
    lines.append(
      f"  time by op       matmuls {100 * by_op['matmul_share']:.1f}% of the kernels' estimated "
      'cycles; the most expensive other ops:'
    )
    for other in by_op['top_other']:
      op = other['op'] if len(other['op']) <= 90 else '...' + other['op'][-87:]
      lines.append(f'    {100 * other["share"]:5.1f}%  {op}')
  for c in r['collectives']:
    lines.append(
      f'  {c["op"]:16s} x{c["count"]} over {c["group_size"]} devices: {c["bytes"] / 2**20:,.1f} MiB'
      f' per step, {c["moved_bytes"] / 2**20:,.1f} MiB sent per device'
    )
  if 'cross_slice' in r:
    x = r['cross_slice']
    lines.append(
      f'  across slices    {", ".join(x["kinds"]) or "nothing"}: '
      f'{x["bytes_per_step"] / 2**20:,.1f} MiB per step and device (data-centre network)'
    )
  if r['comm_seconds_lower_bound']:
    lines.append(f'  communication    >= {r["comm_seconds_lower_bound"]:.4g} s per step (ICI)')
  dtypes = ', '.join(f'{k}: {v}' for k, v in sorted(r['matmul_dtypes'].items()))
  lines.append(f'  matmuls          {dtypes}')
  if 'chip_days' in r:
    lines.append(
      f'  whole run        {r["total_steps"]:,} steps: >= {r["chip_days"]:,.1f} chip-days '
      f'({r["core_days"]:,.1f} TPU-core-days)'
    )
  lines.append('  (estimates of the TPU compiler, not measurements)')
  return '\n'.join(lines)


def main(argv):
  if len(argv) > 1:
    _exit(f'unexpected arguments {argv[1:]}')
  with cli.reported():  # JAX_PLATFORMS naming an absent platform, as every command: one line
    _compile_and_report()


def _compile_and_report() -> None:
  from vit_jax import workdir
  from vit_jax.bench import aot
  from vit_jax.bench import gpu_record
  from vit_jax.bench import gpus
  from vit_jax.bench import topology
  from vit_jax.core.errors import UserError

  if _JSON.value:
    with cli.reported():
      workdir.check_output(_JSON.value, '--json')
  config = _CONFIG.value
  on_gpu = gpus.is_gpu_name(_TOPOLOGY.value)
  doing = f'python -m vit_jax.compile: compiling {config.model} for {_TOPOLOGY.value}'
  try:
    if on_gpu and _NUM_SLICES.value > 1:
      _exit('--num_slices is for TPU slices; name GPUs by their count, e.g. --topology=h100-32')
    target = gpus.describe(_TOPOLOGY.value) if on_gpu else None
    target = target or topology.describe(_TOPOLOGY.value, _NUM_SLICES.value)
    overrides = {}
    with console.heartbeat(doing):  # a big topology compiles for minutes
      try:
        compiled = aot.compile_run(config, target)
      except aot.DoesNotFit as error:
        if not _FIT.value:
          _exit(aot.fit_message(error, config, target))
        compiled, overrides = _fit(config, target, error)
  except UserError as e:
    _exit(str(e))
  record = gpu_record.analyse(compiled) if on_gpu else aot.analyse(compiled)
  if overrides:
    record['overrides'] = [f'--config.{k}={v}' for k, v in overrides.items()]
  if on_gpu:
    record['launch'] = gpu_record.launch_command(target, sys.argv[1:], overrides)
  print(gpu_record.describe(record) if on_gpu else _describe(record))
  if overrides:
    print(f'fits with: {_command_line(overrides)}')
  if on_gpu:
    print(f'run it with: {record["launch"]}')
  if _JSON.value:
    record['made'] = _made()
    os.makedirs(os.path.dirname(os.path.abspath(_JSON.value)), exist_ok=True)
    with open(_JSON.value, 'w', encoding='utf-8') as f:
      json.dump(record, f, indent=1)
    print(f'wrote {_JSON.value}')


def _made() -> dict:
  """What made a record: the command line, the date, the checkout's commit (where it is one)
  and the compiler's versions, so that a record says how old it is."""
  import datetime
  import subprocess

  from vit_jax.core import hardware

  try:
    commit = subprocess.run(
      ['git', 'rev-parse', '--short', 'HEAD'],
      cwd=os.path.dirname(os.path.abspath(__file__)),
      capture_output=True,
      text=True,
    ).stdout.strip()
  except OSError:  # no git
    commit = ''
  return {
    'command': 'python -m vit_jax.compile ' + ' '.join(sys.argv[1:]),
    'date': datetime.date.today().isoformat(),
    'commit': commit or None,
    'versions': hardware.library_versions(('jax', 'jaxlib', 'libtpu', 'jax-cuda12-plugin')),
  }


def _fit(config, tpu, error):
  """The first candidate override set that compiles within memory, at most --max_compiles tries."""
  from vit_jax.bench import aot

  devices = len(tpu.devices)
  tried = []
  for overrides in aot.candidates(config, devices, error):
    if len(tried) >= _MAX_COMPILES.value:
      break
    tried.append(overrides)
    print(f'trying {overrides} ...', flush=True)
    try:
      return aot.compile_run(aot.with_overrides(config, overrides), tpu), overrides
    except aot.DoesNotFit:
      continue
  _exit(
    f'{config.model} at batch {config.batch} does not fit {tpu.name} with any of '
    f'{len(tried)} tried overrides ({tried}); use a larger slice or raise --max_compiles'
  )


if __name__ == '__main__':
  sys.exit(cli.run(app.run, main, flags_parser=_CONFIG.parse))
