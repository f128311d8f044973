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


@pytest.mark.slow
def test_the_loop_item_runs_as_on_the_gpu_image(tmp_path):
  site = tmp_path / 'site'
  site.mkdir()
  (site / 'sitecustomize.py').write_text(GPU_IMAGE.format(root=str(ROOT)))
  env = subprocess_env()
  env['PYTHONPATH'] = str(site)  # not the checkout: the script must find it itself
  out = tmp_path / 'out'
  proc = subprocess.run(
    [
      sys.executable,
      'benchmarks/gpu_session.py',
      f'--out={out}',
      '--smoke',
      '--only=loop',
      f'--archive={tmp_path / "records.tgz"}',
    ],  # fmt: skip
    capture_output=True,
    text=True,
    cwd=ROOT,
    env=env,
    timeout=600,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  loop = json.loads((out / 'loop.json').read_text())
  assert 'error' not in loop, loop
  bare = loop['bare_step_img_per_sec']
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


def test_the_readme_quotes_the_measured_gpu_table_as_the_records_give_it(monkeypatch):
  monkeypatch.syspath_prepend(str(ROOT / 'benchmarks'))
  import gpu_measured

  records = gpu_measured.load(gpu_measured.DEFAULT)
  assert len(records) == 9  # 3 + 3 batches against timm, 3 variants of ours alone
  table = gpu_measured.table(records)
  readme = (ROOT / 'README.md').read_text(encoding='utf-8')
  for line in table.splitlines():
    assert line in readme, line
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


def test_the_loops_steady_state_is_the_median_interval_after_step_40(tmp_path, monkeypatch):
  monkeypatch.syspath_prepend(str(ROOT / 'benchmarks'))
  import gpu_session

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
