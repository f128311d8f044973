r"""The tables in docs/ that records or declarations give, written from them, never typed.

  python benchmarks/docs_tables.py           # name the tables that differ from their records
  python benchmarks/docs_tables.py --write   # write them, after a script wrote new records

A table stands between `<!-- table: NAME -->` and `<!-- end table -->`, NAME one of
`TABLES`; each generator reads the records under benchmarks/ (the scripts that write
them say how). tests/test_docs_tables.py holds every marked table to its records.
"""

import argparse
import glob
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gpu_measured  # noqa: E402
import gpu_table  # noqa: E402
import tpu_table  # noqa: E402

from vit_jax.configs import families  # noqa: E402
from vit_jax.configs import schema  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = 2**30
# The marker, the table's lines (none before its first writing), the end marker.
MARKED = re.compile(r'(<!-- table: (\S+) -->\n)((?:(?!<!-- ).*\n)*)(<!-- end table -->)')
DOCS = (
  'README.md',
  *(
    os.path.join('docs', n)
    for n in sorted(os.listdir(os.path.join(ROOT, 'docs')))
    if n.endswith('.md')
  ),
)


def _record(name: str) -> dict:
  with open(os.path.join(ROOT, 'benchmarks', name), encoding='utf-8') as f:
    return json.load(f)


# `python -m vit_jax.benchmark --compare=timm` on this project's 2-core CPU, two runs each.
CPU_RUNS = {
  'ViT-B/16 inference, batch 8, 224 px': (
    '20261121T1050_cpu_ViT-B_16_infer_b8.json',
    '20261121T1129_cpu_ViT-B_16_infer_b8.json',
  ),
  'ViT-S/16 training, batch 16, 224 px (Adam)': (
    '20261121T1052_cpu_ViT-S_16_train_b16.json',
    '20261121T1130_cpu_ViT-S_16_train_b16.json',
  ),
}


def cpu_speed() -> str:
  """Ours against timm on the CPU, each run's figures side by side."""
  rows = [
    '| | vit_jax img/s | timm img/s | vit_jax / timm | MFU vit_jax / timm |',
    '|---|---|---|---|---|',
  ]
  for what, names in CPU_RUNS.items():
    runs = [_record(n) for n in names]
    ours = ', '.join(f'{r["vit_jax"]["img_per_sec"]:.2f}' for r in runs)
    timm = ', '.join(f'{r["timm"]["img_per_sec"]:.2f}' for r in runs)
    ratio = ', '.join(f'{r["vit_jax"]["img_per_sec"] / r["timm"]["img_per_sec"]:.2f}' for r in runs)
    mfu = ', '.join(f'{r["vit_jax"]["mfu"]:.2f} / {r["timm"]["mfu"]:.2f}' for r in runs)
    rows.append(f'| {what} | {ours} | {timm} | **{ratio}** | {mfu} |')
  return '\n'.join(rows)


def max_batch() -> str:
  """`--find_max_batch` records: the largest micro-batch per 80 GB device, fine-tuning (SGD)."""
  found = {}
  for path in sorted(glob.glob(os.path.join(ROOT, 'benchmarks', '*_maxbatch.json'))):
    r = _record(os.path.basename(path))
    found[r['options']['model'], r['options']['resolution']] = r['max_micro_batch']
  columns = ((224,), (384, 392), (518,))
  rows = ['| model | 224 px | 384 px (H/14: 392) | 518 px |', '|---|---:|---:|---:|']
  for model in sorted({m for m, _ in found}, key=lambda m: ('BLH'.index(m[4]), m)):
    cells = [
      next((f'{found[model, s]}' for s in sizes if (model, s) in found), '') for sizes in columns
    ]
    rows.append(f'| {model.replace("_", "/")} | ' + ' | '.join(cells) + ' |')
  return '\n'.join(rows)


LOOP = '20261121T1109_cpu_loop.json'
_LOOP_CASES = {
  'demo': 'demo (ViT-Demo_4, 16 px, batch 128, digits)',
  's16': 'ViT-S/16, 224 px, batch 16, digits',
}


def loop() -> str:
  """`benchmarks/measure_loop.py`: the whole loop against the bare step."""
  cases = _record(LOOP)['cases']
  rows = ['| | `vit_jax.main` img/s | bare step img/s | loop / step |', '|---|---|---|---|']
  for key, what in _LOOP_CASES.items():
    c = cases[key]
    loop_rate, step_rate = c['loop_img_per_sec'], c['step_img_per_sec']
    digits = 0 if step_rate >= 100 else 1
    rows.append(
      f'| {what} | {loop_rate:.{digits}f} | {step_rate:.{digits}f} | {c["loop_over_step"]:.3f} |'
    )
  return '\n'.join(rows)


def gpu_attention() -> str:
  """`benchmarks/gpu_attention.py`: ViT-B/16's gradient on one H100 with each attention."""
  record = _record(os.path.join('gpu', 'attention_vit_b16_h100-1.json'))
  lengths = list(record['results'])
  names = {
    'cudnn': 'cuDNN as JAX offers it',
    'cudnn, padded (auto)': "cuDNN, padded by one masked token (`'auto'`)",
    'xla': "JAX's XLA implementation (`'xla'`)",
    'explicit': "written out (`'explicit'`)",
  }
  rows = ['| attention | ' + ' | '.join(lengths) + ' |', '|---|' + '---|' * len(lengths)]
  for key, what in names.items():
    cells = []
    for length in lengths:
      r = record['results'][length][key]
      if not r['compiles']:
        cells.append(f'refused: {r["error"]}')
        continue
      fused = r['library_kernels'].get('__cudnn$fmhaSoftmax')
      kernels = f'{fused} fused forward + {fused} backward kernels, ' if fused else ''
      cells.append(f'{kernels}{r["temp_bytes"] / GiB:.2f} GiB temporaries')
    rows.append(f'| {what} | ' + ' | '.join(cells) + ' |')
  return '\n'.join(rows)


_CHANGES = {
  'as_built': 'as built',
  '1_pad_in_every_layer': 'odd sequence padded in every layer (q, k, v padded, output sliced)',
  '2_patch_embedding_as_convolution': 'patch embedding as a convolution',
  '3_float32_parameters_in_the_program': 'parameters float32 in the program, cast in every layer',
  '5_qkv_as_one_einsum': 'q, k, v as one einsum (a transpose and a bias add per q, k, v)',
  '5_layout_left_to_xla': 'layout left to XLA (activations batch innermost, transposed)',
  'gelu_intermediates_kept': "GELU's intermediates kept for the backward pass (a GELU kernel)",
  'all_undone': 'all of these at once',
}


def gpu_kernels() -> str:
  """`benchmarks/gpu_hlo.py`: what a ViT-B/16 block launches on one H100, and with each of the
  program's choices undone on its own."""
  results = _record(os.path.join('gpu_hlo', 'ablations_h100-1.json'))['results']
  train, infer = results['train b512'], results['infer b1024']
  rows = [
    '| ViT-B/16 on one H100, per block | training (Adam, batch 512): kernels | GiB written '
    '| inference (batch 1024): kernels | GiB written |',
    '|---|---:|---:|---:|---:|',
  ]
  for key, what in _CHANGES.items():
    t, i = train[key], infer[key]
    rows.append(
      f'| {what} | {t["kernels_per_block"]:.0f} | {t["bytes_written_per_block"] / GiB:.2f} '
      f'| {i["kernels_per_block"]:.0f} | {i["bytes_written_per_block"] / GiB:.2f} |'
    )
  return '\n'.join(rows)


def _latest(pattern: str) -> tuple:
  """(name, record) of the newest record matching `pattern` under benchmarks/ (its name's
  leading time stamp orders them)."""
  paths = sorted(glob.glob(os.path.join(ROOT, 'benchmarks', pattern)))
  return os.path.basename(paths[-1]), _record(os.path.basename(paths[-1]))


def dino_digits() -> str:
  """`benchmarks/dino_digits.py --record`: the demo's frozen features against the same model at
  random initialisation and the raw pixels (few-shot ridge probes, k-NN)."""
  name, r = _latest('*_dino_digits.json')
  shots = r['shots']
  rows = [
    '| features | ' + ' | '.join(f'{n}-shot' for n in shots) + ' | k-NN (all labels) |',
    '|---|' + '---:|' * (len(shots) + 1),
  ]
  titles = {
    'teacher': f'self-distillation, {r["run"]["step"]} steps (the teacher)',
    'random_init': 'the same ViT, randomly initialised',
    'raw_pixels': 'the 64 raw pixels',
  }
  for key, title in titles.items():
    f = r[key]
    cells = ' | '.join(f'{100 * f[f"{n}shot"]:.1f}%' for n in shots)
    rows.append(f'| {title} | {cells} | {100 * f["knn"]:.1f}% |')
  return '\n'.join(rows) + f'\n\n(`benchmarks/{name}`)'


def dino_step_cost() -> str:
  """`benchmarks/dino_step_cost.py --record`: the self-distillation step against a supervised
  step of the same backbone on this project's CPU."""
  name, r = _latest('*_dino_step_cost.json')
  rows = [
    '| step (batch {batch}, float32) | s/step | FLOPs (XLA) | FLOPs (closed form) | MFU |'.format(
      batch=r['batch']
    ),
    '|---|---:|---:|---:|---:|',
  ]
  for key, title in (('self_distillation', 'self-distillation'), ('supervised', 'supervised')):
    x = r[key]
    rows.append(
      f'| {title} | {x["seconds_per_step"]:.2f} | {x["xla_flops_per_step"]:.3g} '
      f'| {x["closed_form_flops_per_step"]:.3g} | {x["mfu"]:.3f} |'
    )
  rows.append(
    f'| ratio | **{r["time_ratio"]:.2f}x** | {r["xla_flops_ratio"]:.2f}x '
    f'| {r["closed_form_flops_ratio"]:.2f}x | |'
  )
  return (
    '\n'.join(rows)
    + f'\n\n(`{r["recipe"]}`, load average {r["load_average_1min"]:.1f}; `benchmarks/{name}`)'
  )


_TIER_ORDER = ('suite', 'fast', 'equivalence')


def _suite_records() -> dict:
  """{tier: its newest record} of `benchmarks/suite_time.py`, runs of chosen files left out."""
  newest = {}
  for path in sorted(glob.glob(os.path.join(ROOT, 'benchmarks', 'suite', '*.json'))):
    with open(path, encoding='utf-8') as f:
      record = json.load(f)
    if record['tier'] != 'files' and record['date'] >= newest.get(record['tier'], {}).get(
      'date', ''
    ):
      newest[record['tier']] = {**record, 'path': os.path.relpath(path, ROOT)}
  order = lambda tier: (_TIER_ORDER.index(tier) if tier in _TIER_ORDER else len(_TIER_ORDER), tier)
  return {tier: newest[tier] for tier in sorted(newest, key=order)}


def suite_tiers() -> str:
  """`benchmarks/suite_time.py`: each tier of the suite, its newest record."""
  rows = [
    '| tier | command | passed, skipped | wall time | machine | load average (mean, max) | record |',
    '|---|---|---|---:|---|---|---|',
  ]
  for tier, r in _suite_records().items():
    m, c, load = r['machine'], r['counts'], r['load_average']
    cpu = f'{m["cpu_cores"]}-core {m["cpu"]} ({m["vector_isa"]})'
    busy = f'{load["mean"]:.1f}, {load["max"]:.1f}' if load else 'not sampled'
    rows.append(
      f'| {tier} | `{r["command"]}` | {c["passed"]}, {c["skipped"]} '
      f'| {r["wall_s"] / 60:.1f} min | {cpu} | {busy} | `{r["path"]}` ({r["date"][:10]}) |'
    )
  if len(rows) == 2:
    rows.append('| (no record yet: `python benchmarks/suite_time.py`) | | | | | | |')
  return '\n'.join(rows)


def suite_slowest() -> str:
  """The slowest tests of the newest record of the whole suite."""
  record = _suite_records().get('suite')
  rows = ['| test | seconds |', '|---|---:|']
  for entry in record['slowest'] if record else []:
    rows.append(f'| `{entry["test"]}` | {entry["seconds"]:,.0f} |')
  if not record:
    rows.append('| (no record of the whole suite yet: `python benchmarks/suite_time.py`) | |')
  return '\n'.join(rows)


_RECIPES = {
  'bf16': 'bf16, no FP8',
  'all_fp8_qkv_merged': 'all three products FP8, q, k, v one product',
  'all_fp8': 'all three products FP8',
  'bf16_weight_gradient_qkv_merged': 'weight gradient bf16, q, k, v one product',
  'bf16_weight_gradient_gelu_kept': "weight gradient bf16, GELU's intermediates kept",
  'bf16_weight_gradient': 'weight gradient bf16 (`--config.fp8=True`)',
}


def fp8_recipes() -> str:
  """`benchmarks/fp8_recipes.py`: per encoder block, each FP8 recipe's FP8 GEMMs, FP8 bytes
  written transposed, and the kernels and bytes outside GEMMs and attention."""
  record = _record(os.path.join('fp8', 'recipes_h100-1.json'))
  rows = [
    '| per block, batch 128 | model | FP8 GEMMs | FP8 MB transposed (read in FP8 / rounded '
    'so) | kernels outside GEMMs and attention | GB they write | memory (GiB) |',
    '|---|---|---:|---:|---:|---:|---:|',
  ]
  for model, results in record['results'].items():
    for key, what in _RECIPES.items():
      r = results[key]
      rows.append(
        f'| {what} | {model} | {r["fp8_gemms_per_block"]:.0f} | '
        f'{r["fp8_transposed_bytes_per_block"] / 1e6:.1f} / '
        f'{r["cast_transposed_bytes_per_block"] / 1e6:.1f} | {r["other_kernels_per_block"]:.0f} '
        f'| {r["other_bytes_written_per_block"] / 1e9:.2f} | '
        f'{r["memory_estimate_bytes"] / GiB:.2f} |'
      )
  return '\n'.join(rows)


def gpu_overlap() -> str:
  """`benchmarks/gpu_overlap.py`: the share of each step's gradient bytes scheduled under
  matmuls, per bucket size."""
  record = _record(os.path.join('gpu', 'overlap.json'))
  sizes = record['candidates_mib']
  rows = [
    '| step | ' + ' | '.join(f'{mib} MiB buckets' for mib in sizes) + ' |',
    '|---|' + '---:|' * len(sizes),
  ]
  for model in ('ViT-B_16', 'ViT-L_16'):
    for topology, cases in record[model].items():
      first = cases[f'{sizes[0]}_mib']
      accum = f', {first["accum_steps"]} micro-batches' if first['accum_steps'] > 1 else ''
      what = f'{model.replace("_", "/")} on {topology} ({first["bytes"] / 2**20:.0f} MiB{accum})'
      shares = [f'{cases[f"{mib}_mib"]["share_under_matmuls"]:.0%}' for mib in sizes]
      rows.append(f'| {what} | ' + ' | '.join(shares) + ' |')
  return '\n'.join(rows)


TABLES = {
  'schema.markdown_table': schema.markdown_table,  # the config fields, from their declarations
  'families.markdown_table': families.markdown_table,  # the families, from the registry
  'fp8_recipes': fp8_recipes,
  'gpu_overlap': gpu_overlap,
  'tpu_table.markdown': tpu_table.markdown,
  'tpu_table.giant_markdown': tpu_table.giant_markdown,
  'tpu_table.dino_markdown': tpu_table.dino_markdown,
  'gpu_table.markdown': gpu_table.markdown,
  'gpu_measured.table': lambda: gpu_measured.table(gpu_measured.load(gpu_measured.DEFAULT)),
  'gpu_attention': gpu_attention,
  'gpu_kernels': gpu_kernels,
  'cpu_speed': cpu_speed,
  'max_batch': max_batch,
  'loop': loop,
  'dino_digits': dino_digits,
  'dino_step_cost': dino_step_cost,
  'suite_tiers': suite_tiers,
  'suite_slowest': suite_slowest,
}


def marked(text: str) -> list:
  """(NAME, the table as written) of every marked table in `text`."""
  return [(m.group(2), m.group(3).rstrip('\n')) for m in MARKED.finditer(text)]


def regenerate(text: str) -> str:
  """`text` with every marked table written from its records."""
  return MARKED.sub(lambda m: m.group(1) + TABLES[m.group(2)]() + '\n' + m.group(4), text)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--write', action='store_true', help='write the tables from the records')
  args = parser.parse_args()
  for name in DOCS:
    path = os.path.join(ROOT, name)
    with open(path, encoding='utf-8') as f:
      text = f.read()
    new = regenerate(text)
    if new == text:
      continue
    if args.write:
      with open(path, 'w', encoding='utf-8') as f:
        f.write(new)
      print(f'wrote {name}')
    else:
      stale = [n for (n, old), (_, now) in zip(marked(text), marked(new)) if old != now]
      print(f'{name}: {", ".join(stale)} differ from their records (--write writes them)')


if __name__ == '__main__':
  main()
