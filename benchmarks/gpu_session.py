r"""The whole GPU measurement of one device lease, in priority order, a record after each item.

  python benchmarks/gpu_session.py --out=$OUT [--budget_s=540] [--only=NAME,...]
  python benchmarks/gpu_session.py --out=/tmp/smoke --smoke     # the same code on a CPU, tiny

A lease is rare and short (30 minutes of device time a session, 10 a command),
so this script runs what matters most first and writes each record as soon as
it exists: (1) ViT-B/16 bf16 training against timm, (2) ViT-B/16 bf16
inference against timm, (3) the whole loop (`python -m vit_jax.main` on the
digits in memory and on a JPEG folder read by the host's cores, against the
bare step and the host input pipeline alone; no TensorFlow needed), then ViT-L/16 and ViT-H/14
at 224 px and the fine-tuning resolutions, with their largest batch. Each
item is `python -m vit_jax.benchmark` (timm in the same process, interleaved,
the same warm-up and timed steps) at each of its batches, so each side's best
batch is in the records; `summary.json` collects them. Items that do not fit
in the time left are skipped and listed, so the next call resumes with
`--only`.
"""

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # vit_jax from this checkout, installed or not (the GPU image has it not)
B16_TRAIN = ['--model=ViT-B_16', '--mode=train', '--dtype=bfloat16', '--optimizer=adam']
B16_INFER = ['--model=ViT-B_16', '--mode=infer', '--dtype=bfloat16']
# (name, benchmark flags, batches, needs timm)
ITEMS = [
  ('b16_train_vs_timm', [*B16_TRAIN, '--compare=timm'], [128, 256, 512], True),
  ('b16_infer_vs_timm', [*B16_INFER, '--compare=timm'], [256, 512, 1024], True),
  ('loop', None, [], False),
  ('l16_train', ['--model=ViT-L_16', '--mode=train', '--dtype=bfloat16'], [64, 128], False),
  ('h14_train', ['--model=ViT-H_14', '--mode=train', '--dtype=bfloat16'], [32, 64], False),
  (
    'l16_train_384',
    ['--model=ViT-L_16', '--mode=train', '--dtype=bfloat16', '--resolution=384', '--optimizer=sgd'],
    [32],
    False,
  ),
  (
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
  ),
  ('b16_train_maxbatch', [*B16_TRAIN, '--find_max_batch'], [None], False),
]
# On a CPU: the same items, shrunk to seconds (tests/test_gpu_session.py).
SMOKE = [
  '--model=ViT-Ti_16',
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
# against the bare step, on in-memory data and on a JPEG folder.
LOOP = dict(model='ViT-B_16', crop=224, batch=256, steps=40, dtype='bfloat16', images=4096)
LOOP_SMOKE = dict(model='testing', crop=32, batch=8, steps=2, dtype='float32', images=8)


def _last_line(result) -> str:
  return (result.stderr.strip().splitlines() or ['(no output)'])[-1]


def _run_module(module, args):
  """`python -m MODULE ARGS` in the repository; a failure raises its last stderr line."""
  result = subprocess.run(
    [sys.executable, '-m', module, *args], cwd=ROOT, capture_output=True, text=True
  )
  if result.returncode:
    raise RuntimeError(f'{module}: {_last_line(result)}')


def _read_json(path):
  with open(path, encoding='utf-8') as f:
    return json.load(f)


def _main_rate(flags, workdir) -> float:
  """img/s of `python -m vit_jax.main` (its summary: wall time after the first step)."""
  _run_module('vit_jax.main', [f'--workdir={workdir}', *flags])
  return _read_json(os.path.join(workdir, 'summary.json'))['img_per_sec']


def run_loop(out, smoke) -> dict:
  """`python -m vit_jax.main` on the digits (in memory) and on a JPEG folder, the bare
  step at the same model, batch and resolution, and the host pipeline alone on the
  folder with every core: is the loop within 10% of the step, and if not, is the
  input the limit? Runs without TensorFlow (the GPU image has none)."""
  import tempfile

  from vit_jax.bench import input_speed

  c = LOOP_SMOKE if smoke else LOOP
  work = tempfile.mkdtemp(prefix='vit_jax_loop_')
  folder = os.path.join(work, 'photos')
  input_speed.write_photos(folder, c['images'])
  common = [
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
    '--config.progress_every=10',
  ]
  record = {'item': 'loop', **c}
  try:
    _measure_loop(record, c, common, folder, work, out, smoke)
  except RuntimeError as e:
    record['error'] = str(e)
  with open(os.path.join(out, 'loop.json'), 'w', encoding='utf-8') as f:
    json.dump(record, f, indent=1)  # written whatever happened: a lease is rare
  return record


def _measure_loop(record, c, common, folder, work, out, smoke):
  record['loop_in_memory_img_per_sec'] = _main_rate(common, os.path.join(work, 'digits'))
  record['loop_jpeg_folder_img_per_sec'] = _main_rate(
    [*common, f'--config.dataset={folder}', f'--config.pp.test=train[:{c["batch"]}]'],
    os.path.join(work, 'folder'),
  )
  step = os.path.join(out, 'loop_bare_step.json')
  flags = [f'--model={c["model"]}', '--mode=train', f'--dtype={c["dtype"]}', '--optimizer=adam',
           f'--resolution={c["crop"]}', '--num_classes=10']  # fmt: skip
  result = _benchmark(flags, c['batch'], step, smoke)
  if result.returncode:
    raise RuntimeError(f'vit_jax.benchmark: {_last_line(result)}')
  record['bare_step_img_per_sec'] = _read_json(step)['vit_jax']['img_per_sec']
  pipeline = os.path.join(out, 'loop_host_pipeline.json')
  _run_module(
    'vit_jax.benchmark_input',
    [
      f'--dataset={folder}',
      '--quick',
      f'--batch={c["batch"]}',
      '--steps=8',
      '--rounds=1',
      f'--threads={os.cpu_count()}',
      f'--json={pipeline}',
    ],  # fmt: skip
  )
  record['host_pipeline_img_per_sec'] = _read_json(pipeline)['img_per_sec']
  bare = record['bare_step_img_per_sec']
  for case in ('in_memory', 'jpeg_folder'):
    record[f'loop_over_step_{case}'] = round(record[f'loop_{case}_img_per_sec'] / bare, 3)
  record['input_is_the_limit'] = record['host_pipeline_img_per_sec'] < bare


def run_item(name, flags, batches, needs_timm, out, smoke) -> dict:
  if flags is None:
    return run_loop(out, smoke)
  if needs_timm and not (_has('timm') and _has('torch')):
    flags = [f for f in flags if f != '--compare=timm']
  results = []
  for batch in batches:
    path = os.path.join(out, f'{name}_b{batch}.json' if batch else f'{name}.json')
    start = time.perf_counter()
    result = _benchmark(flags, batch, path, smoke)
    entry = {'batch': batch, 'seconds': round(time.perf_counter() - start, 1), 'record': path}
    if result.returncode:
      entry['error'] = _last_line(result)
    else:
      record = _read_json(path)
      for side in ('vit_jax', 'timm'):
        if side in record:
          entry[f'{side}_img_per_sec'] = record[side]['img_per_sec']
      if 'max_batch' in record:
        entry['max_batch'] = record['max_batch']
    results.append(entry)
  return {'item': name, 'runs': results}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--out', required=True, help='directory for the records ($OUT on a lease)')
  parser.add_argument('--budget_s', type=float, default=540, help='stop starting items after this')
  parser.add_argument('--item_estimate_s', type=float, default=60, help='time one run may take')
  parser.add_argument('--only', help='comma-separated item names')
  parser.add_argument('--smoke', action='store_true', help='tiny models, for a CPU')
  args = parser.parse_args(argv)
  os.makedirs(args.out, exist_ok=True)
  only = set(args.only.split(',')) if args.only else None
  start, done, skipped = time.perf_counter(), [], []
  for name, flags, batches, needs_timm in ITEMS:
    if only and name not in only:
      continue
    if time.perf_counter() - start + args.item_estimate_s * max(1, len(batches)) > args.budget_s:
      skipped.append(name)
      continue
    done.append(run_item(name, flags, batches, needs_timm, args.out, args.smoke))
    print(json.dumps(done[-1]), flush=True)
    with open(os.path.join(args.out, 'summary.json'), 'w', encoding='utf-8') as f:
      json.dump({'items': done, 'not_started': skipped}, f, indent=1)
  if skipped:
    print(
      f'not started (time budget): {",".join(skipped)}; run again with --only={",".join(skipped)}'
    )
  with open(os.path.join(args.out, 'summary.json'), 'w', encoding='utf-8') as f:
    json.dump({'items': done, 'not_started': skipped}, f, indent=1)


if __name__ == '__main__':
  main()
