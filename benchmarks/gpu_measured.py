r"""The README's measured GPU table, from one lease's records (`benchmarks/gpu_measured/<lease>/`).

  python benchmarks/gpu_measured.py [benchmarks/gpu_measured/h200_20261127]

Prints, in Markdown, each `python -m vit_jax.benchmark` record of the lease
(ours and, where compared, timm at the same batch), each side's best batch, and
the single-library variants. MFU is img/s x the closed-form FLOPs per image
(`vit_jax.bench.flops`) over the record's peak (the spec sheet's dense bf16), so
records whose compiler gave no FLOP count are comparable with the others; FP8 runs
(`--fp8`) are counted against the same bf16 peak, so their MFU compares with bf16's.
"""

import glob
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = os.path.join(ROOT, 'benchmarks', 'gpu_measured', 'h200_20261127')
GiB = 2**30


def load(directory):
  """The lease's benchmark records (no summaries, no loop), by file name."""
  records = {}
  for path in sorted(glob.glob(os.path.join(directory, '*.json'))):
    with open(path, encoding='utf-8') as f:
      record = json.load(f)
    if record.get('benchmark', '').startswith('vit_jax.benchmark') and 'vit_jax' in record:
      records[os.path.basename(path)] = record
  return records


def mfu(record, side):
  flops = record['flops_per_image']['analytic']
  return record[side]['img_per_sec'] * flops / record['peak']['peak_flops']


def _what(record):
  o = record['options']
  model = o['model'].replace('_', '/')
  what = f'{model} ' + ('training (Adam)' if o['mode'] == 'train' else 'inference')
  changes = [f'attention={o["attention"]}'] if o['attention'] != 'auto' else []
  if o.get('optim_dtype', 'float32') != 'float32':
    changes.append(f'first moment {o["optim_dtype"]}')
  if o.get('fp8'):
    changes.append('fp8 products')
  xla_flags = record['command'].split('--xla_flags=')[1:]
  if xla_flags:
    changes.append(xla_flags[0].split()[0].lstrip('-'))
  return what + (', ' + ', '.join(changes) if changes else '')


def rows(records):
  """One Markdown row per record: compared ones first, by mode and batch."""
  order = sorted(
    records.values(),
    key=lambda r: ('timm' not in r, r['options']['model'], r['options']['mode'] != 'train',
                   r['options']['batch'], _what(r)),
  )  # fmt: skip
  out = []
  for r in order:
    ours, timm = r['vit_jax'], r.get('timm')
    cells = [
      _what(r),
      f'{r["options"]["batch"]:,}',
      f'{ours["img_per_sec"]:,.0f}',
      f'{timm["img_per_sec"]:,.0f}' if timm else '-',
      f'{r["ratio_vs_timm"]:.3f}' if timm else '-',
      f'{mfu(r, "vit_jax"):.3f}' + (f' / {mfu(r, "timm"):.3f}' if timm else ''),
      f'{ours["memory_bytes"] / GiB:.1f} GiB',
    ]
    out.append('| ' + ' | '.join(cells) + ' |')
  return out


def best(records, mode):
  """(ours img/s, its batch, timm img/s, its batch): each side at its best batch."""
  compared = [r for r in records.values() if 'timm' in r and r['options']['mode'] == mode]
  ours = max(compared, key=lambda r: r['vit_jax']['img_per_sec'])
  timm = max(compared, key=lambda r: r['timm']['img_per_sec'])
  return (
    ours['vit_jax']['img_per_sec'],
    ours['options']['batch'],
    timm['timm']['img_per_sec'],
    timm['options']['batch'],
  )


def table(records) -> str:
  lines = [
    '| 224 px, bf16 | batch | vit_jax img/s | timm img/s | vit_jax / timm '
    '| MFU vit_jax / timm | memory (JAX peak) |',
    '|---|---:|---:|---:|---:|---|---:|',
    *rows(records),
    '',
  ]
  for mode, name in (('train', 'training'), ('infer', 'inference')):
    ours, ours_batch, timm, timm_batch = best(records, mode)
    lines.append(
      f'- Best batch each side, {name}: vit_jax {ours:,.0f} img/s (batch {ours_batch}), '
      f'timm {timm:,.0f} (batch {timm_batch}): **{ours / timm:.3f}x**'
    )
  return '\n'.join(lines)


def main(argv):
  directory = argv[0] if argv else DEFAULT
  print(table(load(directory)))


if __name__ == '__main__':
  main(sys.argv[1:])
