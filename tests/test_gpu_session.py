"""The GPU lease script (benchmarks/gpu_session.py) on a CPU, as the GPU image has it: no TensorFlow,
vit_jax not installed."""

import json
import os
import subprocess
import sys
import tarfile

from conftest import ROOT
from conftest import subprocess_env
import numpy as np
import pytest

# What the GPU image has: no TensorFlow, and vit_jax not installed (only the checkout,
# which `python -m` finds from its working directory). Every Python process of the
# session imports this first.
GPU_IMAGE = """
import os, sys
sys.modules['tensorflow'] = None
sys.modules['tensorflow_datasets'] = None
root = os.path.realpath({root!r})
sys.path[:] = [p for p in sys.path if os.path.realpath(p or '.') != root]
sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, '__module__', '').startswith('__editable__')]
"""


def _smoke_session(out, *flags, env=None):
  """`python benchmarks/gpu_session.py --smoke` with `flags`, its records in `out`."""
  return subprocess.run(
    [sys.executable, 'benchmarks/gpu_session.py', f'--out={out}', '--smoke', *flags],
    capture_output=True,
    text=True,
    cwd=ROOT,
    env=env or subprocess_env(),
    timeout=600,
  )


@pytest.mark.slow
def test_the_loop_item_runs_as_on_the_gpu_image(tmp_path):
  site = tmp_path / 'site'
  site.mkdir()
  (site / 'sitecustomize.py').write_text(GPU_IMAGE.format(root=str(ROOT)))
  env = subprocess_env()
  env['PYTHONPATH'] = str(site)  # not the checkout: the script must find it itself
  out = tmp_path / 'out'
  proc = _smoke_session(out, '--only=loop', f'--archive={tmp_path / "records.tgz"}', env=env)
  assert proc.returncode == 0, proc.stderr[-3000:]
  loop = json.loads((out / 'loop.json').read_text())
  assert 'error' not in loop, loop
  bare = loop['bare_step_img_per_sec']
  # The bare step is the loop's own model and resolution.
  options = json.loads((out / 'loop_bare_step.json').read_text())['options']
  assert (options['model'], options['resolution']) == (loop['model'], loop['crop'])
  assert bare > 0 and loop['host_pipeline_img_per_sec'] > 0
  for source in ('loop_in_memory', 'loop_jpeg_folder', 'loop_shards'):
    rates = loop[source]
    # 6 steps, a progress line every 2: the intervals after step 2 are those ending at 4 and 6.
    assert len(rates['interval_img_per_sec']) == 2, source
    assert rates['steady_img_per_sec'] == pytest.approx(
      np.mean(rates['interval_img_per_sec']), 1e-3
    )
    assert rates['steady_over_step'] == round(rates['steady_img_per_sec'] / bare, 3)
    assert rates['whole_run_over_step'] == round(rates['whole_run_img_per_sec'] / bare, 3)
  assert set(loop['host_pipeline_by_threads']) == {'1', '2'}
  assert loop['input_is_the_limit'] == (loop['host_pipeline_img_per_sec'] < bare)
  assert set(loop['phase_seconds']) == {
    'bare_step', 'loop_in_memory', 'write_photos', 'loop_jpeg_folder', 'write_shards',
    'loop_shards', 'host_pipeline'
  }  # fmt: skip
  summary = json.loads((out / 'summary.json').read_text())
  assert [item['item'] for item in summary['items']] == ['loop']
  # The one file a lease brings back holds every record.
  with tarfile.open(tmp_path / 'records.tgz') as tar:
    names = sorted(os.path.basename(n) for n in tar.getnames() if n.endswith('.json'))
  assert names == sorted(p.name for p in out.glob('*.json'))
  assert 'loop.json' in names and 'summary.json' in names


def test_the_docs_quote_the_measured_gpu_table_as_the_records_give_it(monkeypatch):
  monkeypatch.syspath_prepend(str(ROOT / 'benchmarks'))
  import gpu_measured

  records = gpu_measured.load(gpu_measured.DEFAULT)
  # 1 + 2 batches against timm; ours alone: the XLA options A/B (3), ViT-L/16 bf16 and fp8
  assert len(records) == 8
  table = gpu_measured.table(records)
  docs = (ROOT / 'docs' / 'speed_and_scale.md').read_text(encoding='utf-8')
  for line in table.splitlines():
    assert line in docs, line
  # Each side at its best batch, straight from the records.
  train = [r for r in records.values() if r['options']['mode'] == 'train' and 'timm' in r]
  ours, _, timm, _ = gpu_measured.best(records, 'train')
  assert ours == max(r['vit_jax']['img_per_sec'] for r in train)
  assert timm == max(r['timm']['img_per_sec'] for r in train)
  # MFU on the closed form: ViT-B/16 training is 3 x 2 x 17.6 GMACs per image (paper).
  record = records['b16_train_vs_timm_b512.json']
  assert gpu_measured.mfu(record, 'vit_jax') == pytest.approx(
    record['vit_jax']['img_per_sec'] * 3 * 2 * 17.6e9 / 989e12, rel=0.005
  )


def _session(monkeypatch):
  monkeypatch.syspath_prepend(str(ROOT / 'benchmarks'))
  import gpu_session

  return gpu_session


def test_the_loops_steady_state_is_the_median_interval_after_step_40(tmp_path, monkeypatch):
  gpu_session = _session(monkeypatch)
  rates = {20: 2506.0, 40: 3115.0, 60: 3203.0, 80: 3223.0, 100: 3259.0, 120: 3258.0, 140: 3226.0}
  lines = [{'step': s, 'train_loss': 1.0, 'img_per_sec': r} for s, r in rates.items()]
  lines.insert(3, {'step': 60, 'test_accuracy': 0.5})  # an evaluation line has no rate
  (tmp_path / 'metrics.jsonl').write_text(''.join(json.dumps(l) + '\n' for l in lines))
  (tmp_path / 'summary.json').write_text(json.dumps({'img_per_sec': 2760.08}))
  got = gpu_session.loop_rates(str(tmp_path), steady_after=40)
  assert got['interval_img_per_sec'] == [3203.0, 3223.0, 3226.0, 3258.0, 3259.0]
  assert (got['steady_img_per_sec'], got['whole_run_img_per_sec']) == (3226.0, 2760.1)
  lines.append({'step': 160, 'img_per_sec': 3203.0})  # six intervals: the middle two's mean
  (tmp_path / 'metrics.jsonl').write_text(''.join(json.dumps(l) + '\n' for l in lines))
  assert gpu_session.loop_rates(str(tmp_path), 40)['steady_img_per_sec'] == (3223 + 3226) / 2


def test_every_b16_run_has_the_compilers_memory_prediction_for_its_batch(monkeypatch):
  """The committed compile records (benchmarks/gpu_hlo) hold the step of every B/16 batch the
  session times, so each run's record gets the predicted memory beside the measured one."""
  session = _session(monkeypatch)
  b16 = [item for item in session.ITEMS if item.flags and '--model=ViT-B_16' in item.flags]
  assert {item.name for item in b16} >= {'b16_train_vs_timm', 'b16_infer_vs_timm'}
  for item in b16:
    for batch in item.batches:
      if batch is None:
        continue
      mode = 'train' if '--mode=train' in item.flags else 'infer'
      record = json.loads(
        (ROOT / 'benchmarks' / 'gpu_hlo' / f'vit_b16_{mode}_h100-1.json').read_text()
      )
      (row,) = [r for r in record['batches'] if r['batch'] == batch]
      assert session.predicted_memory(item.flags, batch) == row['memory_estimate_bytes'] > 2**30


def test_a_run_entry_sets_the_predicted_memory_beside_the_measured_peak(monkeypatch):
  session = _session(monkeypatch)
  record = {
    'vit_jax': {
      'img_per_sec': 3500.0,
      'memory_bytes': 40_000_000_000,
      'memory_source': 'device peak (process)',
      'memory_estimate_bytes': 39_000_000_000,
    },
    'timm': {'img_per_sec': 3400.0},
    'profile': {'top': [{'name': f'kernel_{i}', 'share': 0.01 * i} for i in range(12)]},
  }
  entry = session._entry(record, session.B16_TRAIN, 512)
  predicted = session.predicted_memory(session.B16_TRAIN, 512)
  assert entry['memory'] == {
    'measured_peak_bytes': 40_000_000_000,
    'predicted_bytes': predicted,
    'estimate_on_the_card_bytes': 39_000_000_000,
    'predicted_over_measured': round(predicted / 40_000_000_000, 4),
  }
  assert entry['top_kernels'] == [(f'kernel_{i}', 0.01 * i) for i in range(10)]
  assert (entry['vit_jax_img_per_sec'], entry['timm_img_per_sec']) == (3500.0, 3400.0)
  # On a CPU the memory is XLA's estimate, not a measurement: nothing to compare.
  record['vit_jax']['memory_source'] = 'XLA estimate'
  assert 'memory' not in session._entry(record, session.B16_TRAIN, 512)
  assert session.predicted_memory(['--model=ViT-L_16', '--mode=train'], 64) is None


@pytest.mark.slow
def test_the_xla_option_items_run_each_variant_at_each_batch(tmp_path):
  out = tmp_path / 'out'
  proc = _smoke_session(out, '--only=b16_infer_xla_options')
  assert proc.returncode == 0, proc.stderr[-3000:]
  (item,) = json.loads((out / 'summary.json').read_text())['items']
  assert [(r['batch'], r['variant']) for r in item['runs']] == [
    (1024, 'as_built'), (1024, 'triton_gemm_on'), (1024, 'command_buffers_off')
  ]  # fmt: skip
  assert all('error' not in r and r['vit_jax_img_per_sec'] > 0 for r in item['runs'])
  flags = json.loads((out / 'b16_infer_xla_options_b1024_triton_gemm_on.json').read_text())
  assert flags['machine']['xla_flags'].endswith('--xla_gpu_enable_triton_gemm=true')
