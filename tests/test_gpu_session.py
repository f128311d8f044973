"""The GPU lease script (benchmarks/gpu_session.py) on a CPU, as the GPU image has it: no TensorFlow."""

import json
import os
import subprocess
import sys

from conftest import ROOT
from conftest import subprocess_env
import pytest


@pytest.mark.slow
def test_the_loop_item_runs_without_tensorflow(tmp_path):
  # Every Python process of the session imports this first: `import tensorflow` fails there.
  site = tmp_path / 'site'
  site.mkdir()
  (site / 'sitecustomize.py').write_text(
    "import sys\nsys.modules['tensorflow'] = None\nsys.modules['tensorflow_datasets'] = None\n"
  )
  env = subprocess_env()
  env['PYTHONPATH'] = os.pathsep.join([str(site), env.get('PYTHONPATH', ''), str(ROOT)]).strip(
    os.pathsep
  )
  out = tmp_path / 'out'
  proc = subprocess.run(
    [sys.executable, 'benchmarks/gpu_session.py', f'--out={out}', '--smoke', '--only=loop'],
    capture_output=True,
    text=True,
    cwd=ROOT,
    env=env,
    timeout=600,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  loop = json.loads((out / 'loop.json').read_text())
  assert 'error' not in loop, loop
  for key in ('loop_in_memory_img_per_sec', 'loop_jpeg_folder_img_per_sec',
              'bare_step_img_per_sec', 'host_pipeline_img_per_sec'):  # fmt: skip
    assert loop[key] > 0, key
  bare = loop['bare_step_img_per_sec']
  assert loop['loop_over_step_jpeg_folder'] == round(loop['loop_jpeg_folder_img_per_sec'] / bare, 3)
  assert loop['input_is_the_limit'] == (loop['host_pipeline_img_per_sec'] < bare)
  summary = json.loads((out / 'summary.json').read_text())
  assert [item['item'] for item in summary['items']] == ['loop']
