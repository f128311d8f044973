r"""Compiles the paper's pre-training configs for TPU v3 slices, and the giant ViTs: the docs' TPU tables.

  python benchmarks/tpu_table.py [--only=NAME] [--max_compiles=2]

Runs `python -m vit_jax.compile --fit` for each entry below, in order, and
writes `benchmarks/tpu/<name>.json` as each finishes (an entry whose record
exists is skipped, so the script resumes). A full-size compile takes minutes
on a 2-core machine. The figures are the TPU compiler's estimates, not
measurements.
"""

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# (record name, config, topology, extra overrides), in priority order: the two
# models of paper Table 2 first.
ENTRIES = [
  # Adam's state sharded over 8 cores (FSDP): replicated, each of the 128 cores updates all
  # 304M parameters, 6% of the step (libtpu's estimate: 0.277 s against 0.261 s).
  ('vit_l16_jft_v3-128', 'configs/vit_l16.py:jft', 'v3-128', ['--config.mesh.fsdp=8']),
  ('vit_h14_jft_v3-256', 'configs/vit_h14.py:jft', 'v3-256', []),
  ('vit_b16_jft_v3-32', 'configs/vit_b16.py:jft', 'v3-32', []),
  ('vit_b32_jft_v3-32', 'configs/vit_b32.py:jft', 'v3-32', []),
  ('vit_l32_jft_v3-64', 'configs/vit_l32.py:jft', 'v3-64', []),
  ('r50_vit_b16_jft_v3-64', 'configs/r50_vit_b16.py:jft', 'v3-64', []),
  # Fine-tuning (384 px, batch 512) on the small slices users rent and the
  # TPUs a Colab notebook gets (v2-8: 8 GiB per core; v5e-1, v6e-1).
  ('finetune_b16_384_v3-8', 'configs/finetune.py:ViT-B_16,cifar10', 'v3-8', []),
  ('finetune_b16_384_v5e-1', 'configs/finetune.py:ViT-B_16,cifar10', 'v5e-1', []),
  ('finetune_b16_384_v2-8', 'configs/finetune.py:ViT-B_16,cifar10', 'v2-8', []),
  ('finetune_b16_384_v6e-1', 'configs/finetune.py:ViT-B_16,cifar10', 'v6e-1', []),
  ('finetune_b16_384_v4-8', 'configs/finetune.py:ViT-B_16,cifar10', 'v4-8', []),
  ('finetune_l16_384_v3-8', 'configs/finetune.py:ViT-L_16,cifar10', 'v3-8', []),
  # The paper's higher-resolution fine-tuning (ViT-L/16 at 512 px, Table 2).
  (
    'finetune_l16_512_v4-8',
    'configs/finetune.py:ViT-L_16,cifar10',
    'v4-8',
    ['--config.pp.crop=512'],
  ),
  (
    'finetune_b16_512_v3-8',
    'configs/finetune.py:ViT-B_16,cifar10',
    'v3-8',
    ['--config.pp.crop=512'],
  ),
  # The same pre-training steps on 256-chip slices of the newer generations.
  ('vit_b16_jft_v5p-512', 'configs/vit_b16.py:jft', 'v5p-512', []),
  ('vit_b16_jft_v6e-256', 'configs/vit_b16.py:jft', 'v6e-256', []),
  ('vit_b16_jft_v5e-256', 'configs/vit_b16.py:jft', 'v5e-256', []),
  ('vit_b16_jft_v4-512', 'configs/vit_b16.py:jft', 'v4-512', []),
  ('vit_l16_jft_v5p-512', 'configs/vit_l16.py:jft', 'v5p-512', []),
  ('vit_l16_jft_v6e-256', 'configs/vit_l16.py:jft', 'v6e-256', []),
  ('vit_l16_jft_v5e-256', 'configs/vit_l16.py:jft', 'v5e-256', []),
  ('vit_l16_jft_v4-512', 'configs/vit_l16.py:jft', 'v4-512', []),
  # ImageNet-21k pre-training: the JFT step with 21,843 classes.
  ('vit_b16_i21k_v3-32', 'configs/vit_b16.py:imagenet21k', 'v3-32', []),
  ('vit_l16_i21k_v3-128', 'configs/vit_l16.py:imagenet21k', 'v3-128', []),
  ('vit_h14_i21k_v3-256', 'configs/vit_h14.py:imagenet21k', 'v3-256', []),
  ('vit_b32_i21k_v3-32', 'configs/vit_b32.py:imagenet21k', 'v3-32', []),
  ('vit_l32_i21k_v3-64', 'configs/vit_l32.py:imagenet21k', 'v3-64', []),
  ('r50_vit_b16_i21k_v3-64', 'configs/r50_vit_b16.py:imagenet21k', 'v3-64', []),
]


# Beyond the paper (docs/speed_and_scale.md): the giant ViTs, scanned and
# rematerialised (configs/giant.py), with FSDP and tensor parallelism. The
# ViT-22B entries keep the paper's 64 images per chip (65,536 on 1,024 chips),
# in 4 micro-batches on v4 (32 GiB per chip) and 2 on v5p (95 GiB), whose
# programs libtpu also gives a step-time estimate.
GIANT_ENTRIES = [
  (
    'vit_22b_jft_v4-512',
    'configs/giant.py:ViT-22B_14',
    'v4-512',
    [
      '--config.batch=16384',
      '--config.batch_eval=4096',
      '--config.accum_steps=4',
      '--config.mesh.fsdp=64',
      '--config.mesh.model=4',
    ],
  ),
  (
    'vit_22b_jft_v4-2048',
    'configs/giant.py:ViT-22B_14',
    'v4-2048',
    [
      '--config.batch=65536',
      '--config.batch_eval=4096',
      '--config.accum_steps=4',
      '--config.mesh.fsdp=64',
      '--config.mesh.model=4',
    ],
  ),
  (
    'vit_22b_jft_v5p-2048',
    'configs/giant.py:ViT-22B_14',
    'v5p-2048',
    [
      '--config.batch=65536',
      '--config.batch_eval=4096',
      '--config.accum_steps=2',
      '--config.mesh.fsdp=64',
      '--config.mesh.model=4',
    ],
  ),
  ('vit_g14_jft_v5e-256', 'configs/giant.py:ViT-g_14', 'v5e-256', ['--config.mesh.fsdp=16']),
  ('vit_G14_jft_v4-256', 'configs/giant.py:ViT-G_14', 'v4-256', ['--config.mesh.fsdp=16']),
  # v5p, whose programs libtpu costs: the compiler's step time.
  ('vit_g14_jft_v5p-256', 'configs/giant.py:ViT-g_14', 'v5p-256', ['--config.mesh.fsdp=16']),
  ('vit_G14_jft_v5p-256', 'configs/giant.py:ViT-G_14', 'v5p-256', ['--config.mesh.fsdp=16']),
]


# Self-distillation as DINOv2 (configs/dinov2.py, docs/self_supervised.md): its ViT-L/14 and
# ViT-g/14 recipes at 2,048 images a step (DINOv2: 32 and 12 per GPU), every crop counted in
# the closed-form FLOPs (bench/flops.py).
DINO_ENTRIES = [
  ('dinov2_vitl14_v5p-128', 'configs/dinov2.py:ViT-L_14', 'v5p-128', ['--config.remat=True']),
  ('dinov2_vitg14_v5p-256', 'configs/dinov2.py:ViT-g_14', 'v5p-256', ['--config.mesh.fsdp=16']),
]


# Paper Table 2, TPUv3-core-days to pre-train (REFERENCE.md section 6).
# ViT-L/16 on ImageNet-21k: the paper's Table 2, third column (0.23k).
PAPER_CORE_DAYS = {
  'vit_l16_jft_v3-128': 680,
  'vit_h14_jft_v3-256': 2500,
  'vit_l16_i21k_v3-128': 230,
}


def _record(name):
  path = os.path.join(ROOT, 'benchmarks', 'tpu', f'{name}.json')
  if not os.path.exists(path):
    return None
  with open(path, encoding='utf-8') as f:
    return json.load(f)


def _mfu(record) -> str:
  # No closed-form FLOPs for the hybrids' ResNet stem, hence no MFU for them.
  mfu = record['mfu_upper_bound']
  return '-' if mfu is None else f'{mfu:.2f}'


def markdown() -> str:
  """The docs' tables, from the records written so far: pre-training on v3, fine-tuning, newer chips."""
  columns = (
    '| run | slice | HBM per device | fitting overrides | step time (lower bound) '
    '| img/s (upper bound) | MFU (upper bound) | {cost} |{extra} compiled |'
  )
  tables = {
    'v3': [
      columns.format(cost='TPUv3-core-days (lower bound)', extra=' paper Table 2 |'),
      '|---|---|---:|---|---:|---:|---:|---:|---:|---|',
    ],
    'finetune': [
      columns.format(cost='chip-hours for the run (lower bound)', extra=''),
      '|---|---|---:|---|---:|---:|---:|---:|---|',
    ],
    'newer': [
      columns.format(cost='img/s per chip (upper bound)', extra=''),
      '|---|---|---:|---|---:|---:|---:|---:|---|',
    ],
  }
  for name, config, topology, extra in ENTRIES:
    r = _record(name)
    if r is None:
      continue
    run = f'`{config}`' + ''.join(f' `{x}`' for x in extra)
    table = (
      'finetune' if name.startswith('finetune') else 'v3' if topology.startswith('v3') else 'newer'
    )
    if not r['fits']:
      tables[table].append(
        f'| {run} | {topology} | does not fit: {r["hbm_bytes_per_device"] / 2**30:.2f} GiB needed '
        f'| none found | | | | |' + (' |' if table == 'v3' else '') + f' {_compiled(r)} |'
      )
      continue
    roofline = r['step_seconds_estimate'] is None
    if roofline:
      # libtpu gave no time estimate for this program: the roofline bound instead
      # (FLOPs at the chip's peak, or the collectives at its bandwidth).
      seconds = max(
        r['flops_per_step_per_device'] / r['peak_flops_per_device'], r['comm_seconds_lower_bound']
      )
      r = dict(r, step_seconds_estimate=seconds, img_per_sec_estimate=r['batch'] / seconds)
      r['chip_days'] = seconds * r['total_steps'] * r['chips'] / 86400
    cost = {
      'v3': f'{r.get("core_days", 0):,.0f} | {f"{PAPER_CORE_DAYS[name]:,}" if name in PAPER_CORE_DAYS else ""}',
      'finetune': f'{r.get("chip_days", 0) * 24:,.1f}',
      'newer': f'{r["img_per_sec_estimate"] / r["chips"]:,.0f}',
    }[table]
    tables[table].append(
      f'| {run} | {topology} | {r["hbm_bytes_per_device"] / 2**30:.2f} GiB '
      f'| {" ".join(r.get("overrides") or []) or "none"} | {r["step_seconds_estimate"]:.3f} s'
      f'{" (roofline)" if roofline else ""} '
      f'| {r["img_per_sec_estimate"]:,.0f} | {_mfu(r)} | {cost} | {_compiled(r)} |'
    )
  return '\n\n'.join('\n'.join(rows) for rows in tables.values() if len(rows) > 2)


def _compiled(record) -> str:
  """When and at which commit a record was compiled (`made`; `stamp` for the older records)."""
  made = record.get('made') or {}
  return f'{made.get("date", "")} `{made.get("commit", "")}`' if made else ''


def stamp(path: str, command: str) -> bool:
  """Gives a record compiled before records said what made them a `made`: the compile command,
  and the commit that last wrote the file and its date (the code it was compiled with is that
  commit's or older). False if it has one."""
  with open(path, encoding='utf-8') as f:
    record = json.load(f)
  if record.get('made'):
    return False
  git = ['git', 'log', '-1', '--format=%h %cs', '--', os.path.relpath(path, ROOT)]
  commit, date = subprocess.run(git, cwd=ROOT, capture_output=True, text=True).stdout.split()
  record['made'] = {
    'command': command,
    'date': date,
    'commit': commit,
    'stamped': 'not recorded when compiled: the commit that last wrote this record, and its date',
  }
  with open(path, 'w', encoding='utf-8') as f:
    json.dump(record, f, indent=1)
  return True


def giant_markdown() -> str:
  """The giant ViTs' table, from the records written so far.

  The compiler's step-time estimate is missing for the v4 and v5e programs
  (see docs/speed_and_scale.md), so the table also gives two bounds every
  record has: compute at the chip's peak (closed-form FLOPs) and
  communication over ICI (the compiled collectives' bytes), and the MFU they
  allow if nothing overlaps.
  """
  rows = [
    '| run | slice | mesh (data x fsdp x model) | batch (micro-batches) | HBM per chip | compute '
    'at peak | communication (lower bound) | MFU if not overlapped | compiler step time | compiled |',
    '|---|---|---|---:|---:|---:|---:|---:|---|---|',
  ]
  for name, config, topology, _ in GIANT_ENTRIES:
    path = os.path.join(ROOT, 'benchmarks', 'tpu', f'{name}.json')
    if not os.path.exists(path):
      continue
    with open(path, encoding='utf-8') as f:
      r = json.load(f)
    m = r['mesh']
    compute = r['closed_form_flops_per_step_per_device'] / r['peak_flops_per_device']
    comm = r['comm_seconds_lower_bound'] or 0.0
    step = 'none given'
    if r['step_seconds_estimate']:
      step = f'{r["step_seconds_estimate"]:.2f} s (MFU {r["mfu_upper_bound"]:.2f})'
    rows.append(
      f'| `{config}` | {topology} ({r["chips"]} chips) | {m["slice"] * m["data"]} x {m["fsdp"]} x '
      f'{m["model"]} | {r["batch"]:,} ({r["accum_steps"]}) '
      f'| {r["hbm_bytes_per_device"] / 2**30:.2f} of {r["hbm_capacity_bytes"] / 2**30:.2f} GiB'
      f'{"" if r["fits"] else " (does not fit)"} | {compute:.2f} s | {comm:.2f} s '
      f'| {compute / (compute + comm):.2f} | {step} | {_compiled(r)} |'
    )
  return '\n'.join(rows)


def dino_markdown() -> str:
  """The self-distillation recipes' table (TPU and GPU records), from the records written so
  far: memory, the compiler's FLOPs against the closed form of every crop, the step-time
  bounds and the MFU they allow."""
  import gpu_table

  rows = [
    '| run | devices | fitting overrides | memory per device | FLOPs per step and device '
    '(closed form) | compute at peak | communication (lower bound) | step time | img/s per '
    'device (upper bound) | MFU (upper bound) | compiled |',
    '|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|',
  ]
  entries = [(n, c, t, e, 'tpu') for n, c, t, e in DINO_ENTRIES]
  entries += [(n, c, t, e, 'gpu') for n, c, t, e in gpu_table.DINO_ENTRIES]
  for name, config, topology, extra, folder in entries:
    path = os.path.join(ROOT, 'benchmarks', folder, f'{name}.json')
    if not os.path.exists(path):
      continue
    with open(path, encoding='utf-8') as f:
      r = json.load(f)
    run = f'`{config}`' + ''.join(f' `{x}`' for x in extra)
    if 'error' in r:
      rows.append(f'| {run} | {topology} | does not fit | | | | | | | | {_compiled(r)} |')
      continue
    if not r.get('fits', True):  # what it needs against what a device has
      need, has = r['hbm_bytes_per_device'] / 2**30, r['hbm_capacity_bytes'] / 2**30
      rows.append(
        f'| {run} | {topology} | does not fit as it is (`--fit` names remat, FSDP) '
        f'| {need:.1f} GiB of {has:.1f} | | | | | | | {_compiled(r)} |'
      )
      continue
    devices = r['devices']
    closed = r['closed_form_flops_per_step_per_device']
    flops = r.get('flops_per_step_per_device', closed)  # GPU records: the closed form alone
    compute = closed / r['peak_flops_per_device']
    comm = r.get('comm_seconds_lower_bound') or 0.0
    seconds = (
      r.get('step_seconds_estimate') or r.get('step_seconds_lower_bound') or max(compute, comm)
    )
    memory = r['hbm_bytes_per_device'] / 2**30
    rows.append(
      f'| {run} | {topology} | {" ".join(r.get("overrides") or []) or "none"} '
      f'| {memory:.1f} GiB | {flops:.3g} ({closed:.3g}) | {compute:.3f} s | {comm:.3f} s '
      f'| {seconds:.3f} s | {r["batch"] / devices / seconds:,.0f} '
      f'| {closed / (seconds * r["peak_flops_per_device"]):.2f} | {_compiled(r)} |'
    )
  return '\n'.join(rows)


def compile_entry(name, config, topology, extra, max_compiles, folder='tpu'):
  """Runs the compile command for one entry (its record: benchmarks/<folder>/<name>.json) and
  prints the end of what it said; returns the record's path, the exit status and the error
  lines."""
  path = os.path.join(ROOT, 'benchmarks', folder, f'{name}.json')
  command = [
    sys.executable,
    '-m',
    'vit_jax.compile',
    f'--config={config}',
    f'--topology={topology}',
    '--fit',
    f'--max_compiles={max_compiles}',
    f'--json={path}',
    *extra,
  ]
  print(' '.join(command[1:]), flush=True)
  result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
  lines = [
    line
    for line in (result.stdout + result.stderr).splitlines()
    if line.strip()
    and not line.startswith(('E0000', 'W0000', 'I0000', 'WARNING', '=== ', 'learning/'))
  ]
  print('\n'.join(lines[-16:]), flush=True)
  return path, result.returncode, [line for line in lines if line.startswith('error: ')]


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--only', help='run this entry only')
  parser.add_argument('--max_compiles', type=int, default=2)
  parser.add_argument('--markdown', action='store_true', help='print the table of the records')
  parser.add_argument(
    '--again', action='store_true', help='compile entries whose record exists too (a new step)'
  )
  parser.add_argument(
    '--stamp', action='store_true', help="give records compiled without 'made' their commit"
  )
  args = parser.parse_args()
  if args.markdown:
    print(markdown() + '\n\n' + giant_markdown())
    return
  for name, config, topology, extra in ENTRIES + GIANT_ENTRIES + DINO_ENTRIES:
    if args.only and name != args.only:
      continue
    path = os.path.join(ROOT, 'benchmarks', 'tpu', f'{name}.json')
    if args.stamp:
      command = f'python -m vit_jax.compile --config={config} --topology={topology} --fit'
      if os.path.exists(path) and stamp(path, ' '.join([command, *extra])):
        print('stamped', path)
      continue
    if os.path.exists(path) and not args.again:
      continue
    compile_entry(name, config, topology, extra, args.max_compiles)


if __name__ == '__main__':
  main()
