"""Paths and names in any script or encoding: a folder whose path, class and file names are
French, Russian, Chinese and Latin-1 bytes trains, stops, resumes and goes through every
command, also in a C locale without UTF-8 mode (file names are bytes there); names print as
their bytes and are written as UTF-8 text."""

import io
import json
import os
import signal
import subprocess
import sys

from conftest import CLASSES
from conftest import LATIN1_FILE
from conftest import MAIN
from conftest import STOPPABLE_RUN
from conftest import said
from conftest import subprocess_env
from conftest import wait_for_child
import pytest

from vit_jax import workdir as workdir_lib
from vit_jax.core import files

C_LOCALE = {'LC_ALL': 'C', 'LANG': 'C', 'PYTHONUTF8': '0', 'PYTHONCOERCECLOCALE': '0'}


COMMANDS = """
import sys
from vit_jax import analyze, evaluate, fewshot, predict
from vit_jax.core import cli
folder, images, run, out = sys.argv[1:]  # no letter outside ASCII here: argv brings them as bytes
for main, argv in [
  (predict.main, [f'--checkpoint={run}', images]),
  (evaluate.main, [f'--checkpoint={run}', f'--dataset={folder}']),
  (fewshot.main, [f'--checkpoint={run}', f'--datasets={folder}', '--shots=1', '--seeds=0']),
  (analyze.main, [f'--checkpoint={run}', f'--images={images}', f'--output={out}']),
]:
  print('exit', main.__module__, cli.run(main, argv), flush=True)
"""


@pytest.mark.slow
def test_a_folder_named_in_any_script_trains_stops_predicts_and_resumes(digit_folder, tmp_path):
  env = subprocess_env(**C_LOCALE)
  run = str(tmp_path / 'exécution')
  command = [*MAIN, f'--config.dataset={digit_folder}', f'--workdir={run}']
  process = subprocess.Popen(command + STOPPABLE_RUN, env=env, stderr=subprocess.PIPE, text=True)
  metrics = os.path.join(run, 'metrics.jsonl')
  wait_for_child(lambda: os.path.exists(metrics) and os.path.getsize(metrics) > 0, process)
  process.send_signal(signal.SIGINT)
  stderr = process.communicate(timeout=300)[1]
  if process.returncode == 0:
    pytest.skip('the run finished before Ctrl-C arrived')  # a very fast machine
  lines = said(stderr)
  step = workdir_lib.saved_steps(run)
  # 130: what a shell reports for a process Ctrl-C ended.
  assert process.returncode == 130 and len(step) == 1 and lines == [lines[-1]], stderr[-3000:]
  assert lines[-1] == (
    f'error: interrupted (Ctrl-C) at step {step[0]}; checkpoint written to {run}; run the same '
    'command again to resume'
  )
  assert not os.path.exists(os.path.join(run, 'lock.json'))

  # The stopped run, through every command, in the same locale.
  (tmp_path / 'commands.py').write_text(COMMANDS)
  images = os.path.join(digit_folder, 'train', CLASSES[0])
  result = subprocess.run(
    [
      sys.executable,
      tmp_path / 'commands.py',
      digit_folder,
      images,
      run,
      str(tmp_path / 'analysé'),
    ],
    env=env,
    capture_output=True,
    timeout=300,
  )
  out = result.stdout.decode('utf-8', 'replace')
  assert 'Traceback' not in result.stderr.decode('utf-8', 'replace'), result.stderr[-3000:]
  for name in ('predict', 'evaluate', 'fewshot', 'analyze'):
    assert f'exit vit_jax.{name} 0' in out, (out, result.stderr[-3000:])
  assert (
    os.fsencode(os.path.join(digit_folder, 'train', 'zéro')) + b'/' + LATIN1_FILE in result.stdout
  )

  finished = subprocess.run(
    command + STOPPABLE_RUN, env=env, capture_output=True, text=True, timeout=300
  )
  assert finished.returncode == 0, finished.stderr[-3000:]
  assert f'Resuming from the checkpoint at step {step[0]}' in finished.stdout
  assert json.load(open(os.path.join(run, 'summary.json')))['step'] == 400


@pytest.mark.slow
def test_jft_converts_a_folder_named_in_any_script(digit_folder, tmp_path):
  """Shards of the folder in a C locale, the Latin-1 file name included."""
  result = subprocess.run(
    [sys.executable, '-m', 'vit_jax.jft', f'--folder={digit_folder}/train', f'--out={tmp_path}/é'],
    env=subprocess_env(**C_LOCALE),
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.startswith('wrote 36 examples of split train (3 classes) in 16 shards')
  info = json.loads((tmp_path / 'é' / 'info.json').read_text(encoding='utf-8'))
  assert info['class_names'] == CLASSES


def test_a_file_name_in_any_encoding_prints_and_writes(digit_folder):
  latin1 = os.fsdecode(
    os.path.join(os.fsencode(digit_folder), b'train', 'zéro'.encode(), LATIN1_FILE)
  )
  assert files.text(latin1).endswith('zéro/caf\ufffd latin-1.png')
  assert files.text('données') == 'données'
  for encoding, escaped in [('utf-8', str.encode), ('ascii', _escaped)]:
    raw = io.BytesIO()
    stream = io.TextIOWrapper(raw, encoding=encoding)
    stream.reconfigure(errors='vit_jax.text')
    print(latin1, CLASSES[1], file=stream)
    stream.flush()
    # The Latin-1 name as its own bytes; letters the stream cannot encode as escapes.
    expected = escaped(os.path.join(digit_folder, 'train', 'zéro')) + b'/' + LATIN1_FILE
    assert raw.getvalue() == expected + b' ' + escaped(CLASSES[1]) + b'\n'


def _escaped(text):
  return text.encode('ascii', 'backslashreplace')
