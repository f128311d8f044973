r"""The whole GPU measurement of one device lease, in priority order, a record after each item.

  python benchmarks/gpu_session.py --out=/tmp/records --archive=$OUT/records.tgz \
      [--budget_s=480] [--only=NAME,...]
  python benchmarks/gpu_session.py --out=/tmp/smoke --smoke     # the same code on a CPU, tiny

A lease is rare and short (15 minutes of device time a session, 10 a command),
so this script runs what matters most first and writes each record as soon as
it exists: (1) ViT-L/16 training in bf16 and with FP8 products (`--fp8`),
(2) ViT-B/16 bf16 training against timm, (3) ViT-B/16 inference in bf16 and
FP8 (the kernels rounded once), (4) ViT-H/14 training in bf16 and FP8, (5)
ViT-B/16 bf16 inference against timm, the timm items with the kernels that took
the most device time (`--profile`) and the step's memory as the GPU compiler
predicted it on a CPU (benchmarks/gpu_hlo) beside the peak measured on the card,
(6) the demo's bf16 and FP8 loss curves over 200 steps (benchmarks/fp8_curves.py),
(7) ViT-B/16 training with FP8; (8, 9) the XLA options A/B, ours alone: each candidate against
the programs as built (`hardware.GPU_COMPILER_OPTIONS`), run after run; (10) the
whole loop (`python -m vit_jax.main` for 160 steps on the digits in memory, on
a JPEG folder read by the host's cores and on TFRecord shards of it, each
against the bare step, steady state and whole run; the host input pipeline
alone by threads and processes; no TensorFlow needed), then ViT-L/16 and ViT-H/14
at 224 px and the fine-tuning resolutions, with their largest batch. Each
item is `python -m vit_jax.benchmark` (timm in the same process, interleaved,
the same warm-up and timed steps) at each of its batches, so each side's best
batch is in the records; `summary.json` collects them. An item starts only if
its runs fit in the time left at the seconds per run that the 2026-11-26 H200
lease took (or a guess, where noted); the ones left are listed, so the next
call resumes with `--only`. A lease returns at most 8 files: `--archive`
packs --out into one .tar.gz after every item, so a call cut off at its limit
still returns what was done.
"""

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from typing import NamedTuple, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # vit_jax from this checkout, installed or not (the GPU image has it not)
B16_TRAIN = ['--model=ViT-B_16', '--mode=train', '--dtype=bfloat16', '--optimizer=adam']
B16_INFER = ['--model=ViT-B_16', '--mode=infer', '--dtype=bfloat16']
L16_TRAIN = ['--model=ViT-L_16', '--mode=train', '--dtype=bfloat16', '--optimizer=adam']


class Item(NamedTuple):
  name: str
  flags: Optional[list]  # benchmark flags; None: a script of its own (SCRIPTS)
  batches: list
  needs_timm: bool
  seconds: float  # per run (per batch and variant), process start and compiles included
  variants: Optional[dict] = None  # name: extra flags, each run at every batch (A/B)
  profile: bool = False  # --profile: the kernels that took the most device time, in the record


# XLA options that the compiled programs leave out (benchmarks/gpu_hlo.py), each timed against
# the programs as built.
XLA_OPTIONS = {
  'as_built': [],
  'triton_gemm_on': ['--xla_flags=--xla_gpu_enable_triton_gemm=true'],
  'command_buffers_off': ['--xla_flags=--xla_gpu_enable_command_buffer='],
}


# Seconds per run: the H200 lease of 2026-11-26 (benchmarks/gpu_measured/h200_20261126:
# 82-92 s with timm's training, 41-44 s with its inference, about 52 s for ours alone at
# ViT-B/16), 5 s more where --profile traces 3 more steps (a guess); the loop: its H100
# phases of 2026-11-26 (../shared/measured/h100_20261126: bare step 46 s, a 40-step run
# 52-89 s, 4,096 photos 22 s) at 160 steps and three sources, a guess; the larger models
# and the search are guesses.
# The B/16 batches are those benchmarks/gpu_hlo.py compiles (the predicted memory). Each
# side's best batch was among them on the H200 (ours 512 training, 1024 inference; timm 512
# both); training at 128 and inference at 256 were slower for both and are left out.
# FP8 products (vit_jax.models.fp8) against bf16, ours alone, at the largest batch
# of the 2026-11-26 records for B/16 and its memory scaled by 3.5 for L/16 (141 GB on an H200).
FP8 = {'bf16': [], 'fp8': ['--fp8']}
H14_TRAIN = ['--model=ViT-H_14', '--mode=train', '--dtype=bfloat16', '--optimizer=adam']
# First, what one call of 480 s holds at these seconds per run: FP8 (models/fp8.py: forward
# and input-gradient products in FP8, weight gradients in bf16, no FP8 transpose) against bf16
# for ViT-L/16 training, ViT-B/16 training against timm, FP8 against bf16 for ViT-B/16
# inference (the kernels rounded once) and ViT-H/14 training; then ViT-B/16 inference against
# timm. H/14's batch: L/16's 256 took 45 GiB, H/14 costs 2.7x its FLOPs per image (a guess).
ITEMS = [
  Item('l16_train_fp8', [*L16_TRAIN], [256], False, 70, FP8, profile=True),
  Item('b16_train_vs_timm', [*B16_TRAIN, '--compare=timm'], [512], True, 95, profile=True),
  Item('b16_infer_fp8', [*B16_INFER], [1024], False, 45, FP8),
  Item('h14_train_fp8', [*H14_TRAIN], [96], False, 75, FP8),
  Item('b16_infer_vs_timm', [*B16_INFER, '--compare=timm'], [512, 1024], True, 50, profile=True),
  Item('fp8_curves', None, [], False, 60),
  Item('b16_train_fp8', B16_TRAIN, [512], False, 55, {'fp8': ['--fp8']}),
  Item('b16_train_xla_options', B16_TRAIN, [512], False, 55, XLA_OPTIONS),
  Item('b16_infer_xla_options', B16_INFER, [1024], False, 45, XLA_OPTIONS),
  Item('loop', None, [], False, 420),
  Item('l16_train', ['--model=ViT-L_16', '--mode=train', '--dtype=bfloat16'], [64, 128], False, 70),
  Item('h14_train', ['--model=ViT-H_14', '--mode=train', '--dtype=bfloat16'], [32, 64], False, 90),
  Item(
    'l16_train_384',
    ['--model=ViT-L_16', '--mode=train', '--dtype=bfloat16', '--resolution=384', '--optimizer=sgd'],
    [32],
    False,
    90,
  ),
  Item(
    'h14_train_518',
    [
      '--model=ViT-H_14',
      '--mode=train',
      '--dtype=bfloat16',
      '--resolution=518',
      '--optimizer=sgd',
      '--remat',
      '--accum_steps=4',
    ],
    [32],
    False,
    150,
  ),
  Item('b16_train_maxbatch', [*B16_TRAIN, '--find_max_batch'], [None], False, 300),
]
# On a CPU: the same items, shrunk to seconds (tests/test_gpu_session.py). The `testing` model
# (one block of width 10; timm builds it too): a third of ViT-Ti/16's seconds per run, and the
# loop's own model, so that its bare step times what its runs train.
SMOKE = [
  '--model=testing',
  '--resolution=32',
  '--dtype=float32',
  '--warmup=1',
  '--steps=1',
  '--repeats=1',
]


def _benchmark(flags, batch, path, smoke):
  command = [sys.executable, '-m', 'vit_jax.benchmark', *flags, f'--json={path}']
  if batch is not None:
    command.append(f'--batch={batch}')
  if smoke:  # argparse keeps the last value of a repeated flag
    command += [*SMOKE, '--batch=2', '--memory_budget_gib=0.05']
  return subprocess.run(command, cwd=ROOT, capture_output=True, text=True)


def _has(module):
  import importlib.util

  return importlib.util.find_spec(module) is not None


# The whole loop: the model, resolution, batch and steps of `python -m vit_jax.main`
# against the bare step, on in-memory data, a JPEG folder and shards of it. 160 steps with a
# progress line every 20: the steady state is the median rate of the intervals after step 40
# (compilation, the first batches and the pipeline's ramp before it); the whole run's rate
# (summary.json: every step after the first) is kept next to it.
LOOP = dict(model='ViT-B_16', crop=224, batch=256, steps=160, dtype='bfloat16', images=4096,
            progress_every=20, steady_after=40)  # fmt: skip
LOOP_SMOKE = dict(model='testing', crop=32, batch=8, steps=6, dtype='float32', images=16,
                  progress_every=2, steady_after=2)  # fmt: skip
LOOP_THREADS = '1,2,4,8,16'  # benchmark_input on the GPU machine's cores (16 on the H100s)


ERROR_LINES = 25


def _error(result) -> str:
  """The end of a failed child's stderr: enough of a traceback to fix it after the lease."""
  lines = result.stderr.strip().splitlines() or ['(no output)']
  return '\n'.join(lines[-ERROR_LINES:])


def _run_module(module, args):
  """`python -m MODULE ARGS` in the repository; a failure raises the end of its stderr."""
  result = subprocess.run(
    [sys.executable, '-m', module, *args], cwd=ROOT, capture_output=True, text=True
  )
  if result.returncode:
    raise RuntimeError(f'{module}: {_error(result)}')


def _read_json(path):
  with open(path, encoding='utf-8') as f:
    return json.load(f)


def _write_json(path, record):
  with open(path, 'w', encoding='utf-8') as f:
    json.dump(record, f, indent=1)


def loop_rates(workdir, steady_after: int) -> dict:
  """The rates of a finished `python -m vit_jax.main` run: the median of its progress
  intervals after step `steady_after` (metrics.jsonl), and the whole run's (summary.json)."""
  with open(os.path.join(workdir, 'metrics.jsonl'), encoding='utf-8') as f:
    lines = [json.loads(line) for line in f]
  intervals = [l['img_per_sec'] for l in lines if 'img_per_sec' in l and l['step'] > steady_after]
  intervals.sort()
  middle = len(intervals) // 2
  steady = (intervals[middle] + intervals[~middle]) / 2 if intervals else 0.0
  return {
    'steady_img_per_sec': round(steady, 1),
    'interval_img_per_sec': [round(r, 1) for r in intervals],
    'whole_run_img_per_sec': round(_read_json(os.path.join(workdir, 'summary.json'))[
      'img_per_sec'], 1),
  }  # fmt: skip


def run_loop(out, smoke) -> dict:
  """`python -m vit_jax.main` on the digits (in memory), a JPEG folder and TFRecord shards of
  it, each against the bare step at the same model, batch and resolution (steady state and
  whole run); then the host pipeline alone on the folder by threads (LOOP_THREADS), the bare
  decode in as many processes, and the cores split into processes x threads. Runs without
  TensorFlow (the GPU image has none). `loop.json` is written after each phase, with the
  seconds each took, so a run cut short keeps what it measured."""
  import tempfile

  c = LOOP_SMOKE if smoke else LOOP
  work = tempfile.mkdtemp(prefix='vit_jax_loop_')
  record = {'item': 'loop', **c, 'phase_seconds': {}}
  path = os.path.join(out, 'loop.json')

  def phase(name, measure):
    start = time.perf_counter()
    try:
      measure()
    finally:
      record['phase_seconds'][name] = round(time.perf_counter() - start, 1)
      _write_json(path, record)

  try:
    _measure_loop(record, c, work, out, smoke, phase)
  except RuntimeError as e:
    record['error'] = str(e)
  _write_json(path, record)  # written whatever happened: a lease is rare
  return record


def _loop_flags(c):
  return [
    '--config=configs/demo.py',
    f'--config.model={c["model"]}',
    f'--config.pp.crop={c["crop"]}',
    f'--config.batch={c["batch"]}',
    f'--config.batch_eval={c["batch"]}',
    f'--config.total_steps={c["steps"]}',
    '--config.warmup_steps=1',
    f'--config.dtype={c["dtype"]}',
    '--config.optimizer=adam',
    '--config.eval_every=1000000',
    '--config.checkpoint_every=1000000',
    f'--config.progress_every={c["progress_every"]}',
  ]


def _measure_loop(record, c, work, out, smoke, phase):
  from vit_jax.bench import input_speed

  folder, shards = os.path.join(work, 'photos'), os.path.join(work, 'shards')
  common = _loop_flags(c)
  some = f'--config.pp.test=train[:{c["batch"]}]'  # a test split of one batch

  def main_run(name, flags):
    workdir = os.path.join(work, name)
    _run_module('vit_jax.main', [f'--workdir={workdir}', *common, *flags])
    rates = loop_rates(workdir, c['steady_after'])
    bare = record['bare_step_img_per_sec']
    rates['steady_over_step'] = round(rates['steady_img_per_sec'] / bare, 3)
    rates['whole_run_over_step'] = round(rates['whole_run_img_per_sec'] / bare, 3)
    record[name] = rates

  def bare_step():
    step = os.path.join(out, 'loop_bare_step.json')
    flags = [f'--model={c["model"]}', '--mode=train', f'--dtype={c["dtype"]}', '--optimizer=adam',
             f'--resolution={c["crop"]}', '--num_classes=10']  # fmt: skip
    result = _benchmark(flags, c['batch'], step, smoke)
    if result.returncode:
      raise RuntimeError(f'vit_jax.benchmark: {_error(result)}')
    record['bare_step_img_per_sec'] = _read_json(step)['vit_jax']['img_per_sec']

  def host_pipeline():
    pipeline = os.path.join(out, 'loop_host_pipeline.json')
    threads = '1,2' if smoke else LOOP_THREADS
    cores = max(int(t) for t in threads.split(','))
    _run_module('vit_jax.benchmark_input', [
      f'--dataset={folder}', '--quick', f'--batch={c["batch"]}', '--steps=8', '--rounds=1',
      f'--threads={threads}', f'--processes={",".join(str(p) for p in (2, 4, 8, 16) if p <= cores)}',
      f'--json={pipeline}'])  # fmt: skip
    measured = _read_json(pipeline)
    record['host_pipeline_img_per_sec'] = measured['img_per_sec']
    record['host_pipeline_by_threads'] = {
      n: t['img_per_sec'] for n, t in measured['threads'].items()
    }

  phase('bare_step', bare_step)
  phase('loop_in_memory', lambda: main_run('loop_in_memory', []))
  phase('write_photos', lambda: input_speed.write_photos(folder, c['images']))
  phase(
    'loop_jpeg_folder', lambda: main_run('loop_jpeg_folder', [f'--config.dataset={folder}', some])
  )
  phase('write_shards', lambda: _run_module('vit_jax.jft', [
    f'--folder={os.path.join(folder, "train")}', f'--out={shards}']))  # fmt: skip
  # Shards are JFT-style, multi-label: the paper's sigmoid loss (B.1).
  shard_flags = [f'--config.dataset={shards}', some, '--config.loss=sigmoid']
  phase('loop_shards', lambda: main_run('loop_shards', shard_flags))
  phase('host_pipeline', host_pipeline)
  record['input_is_the_limit'] = (
    record['host_pipeline_img_per_sec'] < record['bare_step_img_per_sec']
  )


GPU_HLO = os.path.join(ROOT, 'benchmarks', 'gpu_hlo')


def predicted_memory(flags, batch) -> Optional[int]:
  """The compiler's estimate of a ViT-B/16 step's memory, compiled for an H100 on a CPU
  (benchmarks/gpu_hlo, the same step and batch), or None where it has no record."""
  if '--model=ViT-B_16' not in flags or batch is None:
    return None
  mode = 'train' if '--mode=train' in flags else 'infer'
  try:
    record = _read_json(os.path.join(GPU_HLO, f'vit_b16_{mode}_h100-1.json'))
  except OSError:
    return None
  rows = [row for row in record['batches'] if row['batch'] == batch]
  return rows[0]['memory_estimate_bytes'] if rows else None


def _entry(record, flags, batch) -> dict:
  """What a run's record says: img/s of each side, the profile's top kernels, and the memory
  measured on the card beside the compiler's estimates (here and on the card)."""
  entry = {}
  for side in ('vit_jax', 'timm'):
    if side in record:
      entry[f'{side}_img_per_sec'] = record[side]['img_per_sec']
  if 'max_batch' in record:
    entry['max_batch'] = record['max_batch']
  if 'profile' in record:
    entry['top_kernels'] = [(k['name'], k['share']) for k in record['profile'].get('top', [])[:10]]
  ours, predicted = record.get('vit_jax', {}), predicted_memory(flags, batch)
  if predicted and ours.get('memory_source', '').startswith('device peak'):
    entry['memory'] = {
      'measured_peak_bytes': ours['memory_bytes'],
      'predicted_bytes': predicted,  # compiled for an H100 on a CPU, no autotuning
      'estimate_on_the_card_bytes': ours['memory_estimate_bytes'],
      'predicted_over_measured': round(predicted / ours['memory_bytes'], 4),
    }
  return entry


def run_item(item: Item, out, smoke) -> dict:
  if item.flags is None:
    return SCRIPTS[item.name](out, smoke)
  flags = item.flags
  if item.needs_timm and not (_has('timm') and _has('torch')):
    flags = [f for f in flags if f != '--compare=timm']
  results = []
  for batch in item.batches:
    for variant, extra in (item.variants or {'': []}).items():
      name = '_'.join(
        [item.name, *([f'b{batch}'] if batch else []), *([variant] if variant else [])]
      )
      path = os.path.join(out, f'{name}.json')
      profile = ['--profile=' + os.path.join(tempfile.gettempdir(), name)] if item.profile else []
      start = time.perf_counter()
      result = _benchmark([*flags, *extra, *profile], batch, path, smoke)
      entry = {'batch': batch, 'seconds': round(time.perf_counter() - start, 1), 'record': path}
      if variant:
        entry['variant'] = variant
      if result.returncode:
        entry['error'] = _error(result)
      else:
        entry.update(_entry(_read_json(path), flags, batch))
      results.append(entry)
  return {'item': item.name, 'runs': results}


def run_fp8_curves(out, smoke) -> dict:
  """benchmarks/fp8_curves.py: the demo's bf16 and fp8 loss curves over 200 steps (4 smoke)."""
  path = os.path.join(out, 'fp8_curves.json')
  steps = 4 if smoke else 200
  command = [sys.executable, os.path.join(ROOT, 'benchmarks', 'fp8_curves.py'), f'--steps={steps}',
             f'--json={path}']  # fmt: skip
  result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
  if result.returncode:
    return {'item': 'fp8_curves', 'error': _error(result)}
  record = _read_json(path)
  return {'item': 'fp8_curves', 'max_relative_difference': record['max_relative_difference'],
          'tail_mean_loss': record['tail_mean_loss']}  # fmt: skip


SCRIPTS = {'loop': run_loop, 'fp8_curves': run_fp8_curves}


def _archive(out, path):
  """--out as one .tar.gz at `path` (written aside, then renamed: never half a file)."""
  with tarfile.open(path + '.part', 'w:gz') as tar:
    tar.add(out, arcname=os.path.basename(os.path.normpath(out)))
  os.replace(path + '.part', path)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--out', required=True, help='directory for the records')
  parser.add_argument('--archive', help='also pack --out into this .tar.gz after every item')
  parser.add_argument('--budget_s', type=float, default=480, help='start no item past this')
  parser.add_argument('--only', help='comma-separated item names')
  parser.add_argument('--smoke', action='store_true', help='tiny models, for a CPU')
  args = parser.parse_args(argv)
  os.makedirs(args.out, exist_ok=True)
  only = set(args.only.split(',')) if args.only else None
  unknown = (only or set()) - {item.name for item in ITEMS}
  if unknown:
    parser.error(f'--only: no item {", ".join(sorted(unknown))}; the items: '
                 + ', '.join(item.name for item in ITEMS))  # fmt: skip
  start, done, skipped = time.perf_counter(), [], []
  for item in ITEMS:
    if only and item.name not in only:
      continue
    runs = max(1, len(item.batches)) * len(item.variants or [None])
    if time.perf_counter() - start + item.seconds * runs > args.budget_s:
      skipped.append(item.name)
      continue
    done.append(run_item(item, args.out, args.smoke))
    print(json.dumps(done[-1]), flush=True)
    _write_json(os.path.join(args.out, 'summary.json'), {'items': done, 'not_started': skipped})
    if args.archive:
      _archive(args.out, args.archive)
  if skipped:
    print(
      f'not started (time budget): {",".join(skipped)}; run again with --only={",".join(skipped)}'
    )
  _write_json(os.path.join(args.out, 'summary.json'), {'items': done, 'not_started': skipped})
  if args.archive:
    _archive(args.out, args.archive)


if __name__ == '__main__':
  main()
