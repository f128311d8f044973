"""Every command's errors: one `error:` line on stderr and exit status 2 (`vit_jax.core.cli`).

An input error (a file that is not there, an unknown model or dataset) and a
usage error (an unknown flag) of each command. In-process for the argparse
commands; every command, main and compile included, once more as a user runs
it, in a subprocess (slow: a process start each). Then the table of what users
pass that cannot work (remote storage out of reach, a path of the wrong kind,
images and label files that do not read, values out of range), each with its
line; help that lists every flag; library output hidden.
"""

import importlib
import inspect
import os
import subprocess
import sys
import textwrap

from conftest import ROOT
from conftest import command_error
from conftest import run_command
from conftest import said
from conftest import subprocess_env
import pytest

from vit_jax.core import cli

# command: (arguments of an input error, what its line says)
INPUT_ERRORS = {
  'main': (['--config=configs/nope.py'], 'config file configs/nope.py not found'),
  'compile': (['--config=configs/nope.py'], 'config file configs/nope.py not found'),
  'predict': (
    ['--checkpoint={tmp}/nope.npz', '--model=testing', '{tmp}/x.png'],
    '{tmp}/x.png: no such image file or directory',
  ),
  'evaluate': (
    ['--checkpoint={tmp}/nope.npz', '--model=testing', '--dataset=digits'],
    '{tmp}/nope.npz: no such checkpoint',
  ),
  'fewshot': (
    ['--checkpoint={tmp}/nope.npz', '--model=testing', '--datasets=digits'],
    '{tmp}/nope.npz: no such checkpoint',
  ),
  'knn': (
    ['--checkpoint={tmp}/nope.npz', '--model=testing', '--datasets=digits'],
    '{tmp}/nope.npz: no such checkpoint',
  ),
  'analyze': (
    ['--checkpoint={tmp}/nope.npz', '--images={tmp}/x.png', '--output={tmp}/out'],
    '{tmp}/x.png: no such image file or directory',
  ),
  'export': (
    ['--checkpoint={tmp}/nope.npz', '--model=testing', '--format=npz', '--output={tmp}/x.npz'],
    '{tmp}/nope.npz: no such checkpoint',
  ),
  'benchmark': (['--model=ViT-B16', '--no_record'], "unknown model 'ViT-B16': did you mean"),
  'benchmark_input': (['--dataset={tmp}'], '{tmp}: no train/ folder'),
  'prepare': (['no_such_dataset', '--data_dir={tmp}'], "unknown dataset 'no_such_dataset'"),
  'jft': (['--folder={tmp}/nope', '--out={tmp}/shards'], '{tmp}/nope: no such folder'),
}
COMMANDS = sorted(INPUT_ERRORS)
# main and compile parse absl flags when run as programs: only the subprocess test runs them.
IN_PROCESS = [name for name in COMMANDS if name not in ('main', 'compile')]


def _case(name, tmp_path):
  argv, message = INPUT_ERRORS[name]
  return [a.format(tmp=tmp_path) for a in argv], message.format(tmp=tmp_path)


def test_every_command_is_covered():
  import pkgutil

  import vit_jax

  commands = {
    m.name
    for m in pkgutil.iter_modules(vit_jax.__path__)
    if not m.ispkg and 'if __name__ ==' in open(f'{vit_jax.__path__[0]}/{m.name}.py').read()
  }
  assert commands == set(COMMANDS)


@pytest.mark.parametrize('name', IN_PROCESS)
def test_an_input_error_is_one_line_with_exit_status_2(name, tmp_path, capsys):
  argv, message = _case(name, tmp_path)
  main = importlib.import_module(f'vit_jax.{name}').main
  assert command_error(main, argv, capsys).startswith(f'error: {message}')


@pytest.mark.parametrize('name', IN_PROCESS)
def test_a_usage_error_is_one_line_with_exit_status_2(name, capsys):
  main = importlib.import_module(f'vit_jax.{name}').main
  line = command_error(main, ['--no_such_flag=1'], capsys)
  assert 'no_such_flag' in line or 'required' in line
  assert line.endswith(f'(see python -m vit_jax.{name} --help)')


@pytest.mark.slow
@pytest.mark.parametrize('name', COMMANDS)
def test_every_command_as_a_program(name, tmp_path):
  argv, message = _case(name, tmp_path)
  for args, start in [(argv, f'error: {message}'), (['--no_such_flag=1'], 'error: ')]:
    result = subprocess.run(
      [sys.executable, '-m', f'vit_jax.{name}', *args],
      env=subprocess_env(),
      capture_output=True,
      text=True,
      timeout=300,
    )
    assert result.returncode == cli.EXIT_ERROR == 2, result.stderr[-2000:]
    lines = said(result.stderr)
    assert len(lines) == 1 and lines[0].startswith(start), result.stderr[-2000:]
    assert 'no_such_flag' in lines[0] or args is argv or 'required' in lines[0]


def test_a_long_wait_says_it_goes_on(monkeypatch, tmp_path, capsys):
  """A long wait (compiling for a big topology, evaluating at 384 px, benchmarking) is never
  silent: `console.heartbeat` says what runs at least every 30 s, on stderr (stdout keeps the
  result alone); here with a fake slow call and 0.05 s beats."""
  import json
  import re
  import time

  from vit_jax import evaluate
  from vit_jax.bench import speed
  from vit_jax.core import console
  from vit_jax.evaluation import classify

  assert console.HEARTBEAT_S < 30
  lines = []
  with console.heartbeat('compiling', say=lines.append, every=0.05):
    time.sleep(0.5)
  assert len(lines) >= 3 and all(re.fullmatch(r'compiling: 0m00s so far', l) for l in lines)
  said_after = len(lines)
  time.sleep(0.2)
  assert len(lines) == said_after  # silent once the block is done
  with console.heartbeat('quick', say=lines.append, every=5):
    pass
  assert len(lines) == said_after  # a short wait says nothing

  monkeypatch.setattr(console, 'HEARTBEAT_S', 0.05)

  def slow(*args, **kwargs):
    time.sleep(0.5)
    return {'top1': 0.5, 'examples': 2}

  monkeypatch.setattr(classify, 'evaluate_checkpoint', slow)
  from conftest import param_shapes
  from conftest import random_like

  from vit_jax import checkpoint
  from vit_jax.configs import architectures

  npz = tmp_path / 'testing.npz'
  checkpoint.save_npz(
    random_like(param_shapes(architectures.MODEL_CONFIGS['testing'], 10, 16)), npz
  )
  capsys.readouterr()
  assert evaluate.main([f'--checkpoint={npz}', '--model=testing', '--dataset=digits']) == 0
  out, err = capsys.readouterr()
  assert json.loads(out)['top1'] == 0.5
  beats = err.splitlines()
  assert len(beats) >= 3 and set(beats) == {
    'python -m vit_jax.evaluate: evaluating on digits test: 0m00s so far'
  }, err

  from vit_jax import benchmark

  monkeypatch.setattr(speed, 'run', lambda opts: slow() and {})
  monkeypatch.setattr(speed, 'summary', lambda record: 'timed')
  assert benchmark.main(['--model=testing', '--no_record']) == 0
  out, err = capsys.readouterr()
  assert out == 'timed\n' and len(err.splitlines()) >= 3, err
  assert set(err.splitlines()) == {
    'python -m vit_jax.benchmark: testing infer at batch 8: 0m00s so far'
  }, err


NOISE = """
import sys, warnings
from vit_jax.core import console
console.quiet_libraries(-1)
try:
  import torchvision  # noqa: F401  (its image extension does not load beside a CPU-only torch)
except ImportError:
  pass
from PIL import Image
from vit_jax.evaluation import classify
Image.MAX_IMAGE_PIXELS = 100  # the image below (144 px) between the limit and twice it
classify.read_image(sys.argv[1], 16)
print('read')
"""


@pytest.mark.slow
def test_start_up_noise_the_readme_says_is_hidden_is_hidden(tmp_path):
  """TensorFlow's native start-up lines in `prepare` (absl's notice and `I... oneDNN custom
  operations are on`), torchvision's warnings beside a CPU-only torch, PIL's decompression-bomb
  warning in predict are hidden: stderr holds only what the command says."""
  from PIL import Image

  pytest.importorskip('tensorflow')
  image = tmp_path / 'big.png'
  Image.new('RGB', (12, 12)).save(image)
  (tmp_path / 'noise.py').write_text(NOISE)
  runs = [
    [sys.executable, '-m', 'vit_jax.prepare', 'no_such_dataset', f'--data_dir={tmp_path}'],
    [sys.executable, str(tmp_path / 'noise.py'), str(image)],
  ]
  results = [
    subprocess.run(r, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    for r in runs
  ]
  # Only the lines of the GPU plugin, which CI installs on machines without a GPU, pass.
  from conftest import gpu_plugin_notice

  errors = [[x for x in r.stderr.splitlines() if not gpu_plugin_notice(x)] for r in results]
  assert errors[0] == [
    "error: unknown dataset 'no_such_dataset': use a prepared TFDS name, a "
    'preset (docs/data.md), digits, or a folder path'
  ], results[0].stderr
  assert results[1].stdout == 'read\n' and errors[1] == [], results[1].stderr


def test_setup_py_admits_the_oldest_versions_ci_tests():
  """Each lower bound in setup.py is the version .ci/oldest.txt pins, which .ci/run installs
  and tests (a bound below it, such as jax 0.5.3 without jax.set_mesh, admits a version the
  main job dies on); the versions installed here are at least those."""
  import importlib.metadata
  import re

  from conftest import ROOT

  setup = (ROOT / 'setup.py').read_text(encoding='utf-8')
  pinned = dict(
    re.findall(r'^([\w-]+)==([\d.]+)$', (ROOT / '.ci' / 'oldest.txt').read_text(), re.M)
  )
  assert sorted(pinned) == ['flax', 'jax', 'jaxlib', 'numpy', 'optax', 'orbax-checkpoint']
  as_tuple = lambda v: (*(int(x) for x in v.split('.')[:3]), 0, 0)[:3]  # noqa: E731
  for name, version in pinned.items():
    bound = re.search(rf"'{name}>=([\d.]+)'", setup)
    assert bound and as_tuple(bound.group(1)) == as_tuple(version), name
    assert as_tuple(importlib.metadata.version(name)) >= as_tuple(version), name


# ---------------------------------------------------------------------------
# One error class: what a user can fix is one line, a bug keeps its traceback.

_PLANTED = textwrap.dedent("""
  import importlib, sys
  command, target, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
  owner, name = target.rsplit('.', 1)
  def bug(*args, **kwargs):
    raise {error}('a planted bug')
  module = importlib.import_module(command)
  setattr(module if owner == command else importlib.import_module(owner), name, bug)
  from vit_jax.core import cli
  if hasattr(module, '_CONFIG'):  # absl commands (main, compile)
    from absl import app
    sys.argv = [command] + argv
    sys.exit(cli.run(app.run, module.main, flags_parser=module._CONFIG.parse))
  sys.exit(cli.run(module.main, argv))
""")

# Each command, a function it calls inside its `cli.reported()` block, and arguments that get
# it there.
_COMMANDS = {
  'main': ('vit_jax.training.loop.train_and_evaluate', ['--workdir={tmp}/w']),
  'compile': ('vit_jax.bench.topology.describe', ['--config={root}/configs/demo.py']),
  'predict': ('vit_jax.evaluation.loader.load_model', ['--checkpoint={tmp}/x.npz', '{tmp}/a.png']),
  'evaluate': (
    'vit_jax.evaluation.loader.load_model',
    ['--checkpoint={tmp}/x.npz', '--dataset=digits'],
  ),
  'fewshot': (
    'vit_jax.evaluation.loader.load_model',
    ['--checkpoint={tmp}/x.npz', '--datasets=digits'],
  ),
  'knn': (
    'vit_jax.evaluation.loader.load_model',
    ['--checkpoint={tmp}/x.npz', '--datasets=digits'],
  ),
  'analyze': (
    'vit_jax.evaluation.loader.load_model',
    ['--checkpoint={tmp}/x.npz', '--images=digits', '--output={tmp}/out'],
  ),
  'export': (
    'vit_jax.interop.export.export',
    ['--checkpoint={tmp}/x.npz', '--format=npz', '--output={tmp}/y.npz'],
  ),
  'benchmark': ('vit_jax.bench.speed.run', ['--model=ViT-Demo_4', '--no_record']),
  'benchmark_input': ('vit_jax.bench.input_speed.measure_arrays', ['--dataset=digits']),
  'prepare': ('vit_jax.data.prepare.prepare', ['mnist']),
  'jft': ('vit_jax.jft._examples', ['--folder={tmp}', '--out={tmp}/shards']),
}


@pytest.mark.parametrize('command', sorted(_COMMANDS))
def test_every_command_reports_a_user_error_in_one_line_and_a_bug_with_its_traceback(
  command, tmp_path
):
  """Every command catches `UserError` and nothing else: the same function raising a
  UserError gives one `error:` line and exit status 2, raising a ValueError (the built-in
  type most user errors also derive from) its traceback and exit status 1."""
  (tmp_path / 'a.png').write_bytes(b'')
  target, argv = _COMMANDS[command]
  argv = [a.format(tmp=tmp_path, root=ROOT) for a in argv]
  outcome = {}
  for error in ('UserError', 'ValueError'):
    script = _PLANTED.format(error=error)
    if error == 'UserError':
      script = 'from vit_jax.core.errors import UserError\n' + script
    proc = subprocess.run(
      [sys.executable, '-c', script, f'vit_jax.{command}', target, *argv],
      capture_output=True,
      text=True,
      env=subprocess_env(),
      timeout=300,
    )
    outcome[error] = proc
  user, bug = outcome['UserError'], outcome['ValueError']
  assert user.returncode == 2, user.stderr[-2000:]
  assert user.stderr.strip().splitlines()[-1] == 'error: a planted bug', user.stderr[-2000:]
  assert 'Traceback' not in user.stderr
  assert bug.returncode == 1, bug.stderr[-2000:]
  assert 'Traceback (most recent call last)' in bug.stderr
  assert bug.stderr.rstrip().endswith('ValueError: a planted bug'), bug.stderr[-2000:]


def test_every_error_a_command_catches_is_a_user_error():
  """The house's error classes (read from the source: importing every module would need every
  extra) all derive from `UserError`, directly or through another of them, so a command
  catches one class; `cli.reported` takes no list."""
  import ast
  import pathlib

  bases = {}
  for path in sorted(pathlib.Path(cli.__file__).parent.parent.rglob('*.py')):
    for node in ast.walk(ast.parse(path.read_text(encoding='utf-8'))):
      if isinstance(node, ast.ClassDef) and node.name.endswith('Error'):
        bases[node.name] = [getattr(b, 'id', getattr(b, 'attr', '')) for b in node.bases]

  def is_user_error(name):
    return name == 'UserError' or any(is_user_error(b) for b in bases.get(name, []) if b in bases)

  assert len(bases) >= 18, sorted(bases)  # the error classes are found (18 or more)
  assert sorted(name for name in bases if not is_user_error(name)) == []
  assert list(inspect.signature(cli.reported).parameters) == []


# ---------------------------------------------------------------------------
# Every command's bad input is one line; help lists the flags; library output hidden.


ERRORS = [
  # Remote storage out of reach is one line naming the path, the cause and what to do.
  (
    'predict',
    ['--checkpoint=gs://vit_models/imagenet21k/ViT-B_16.npz', '--model=testing', '{png}'],
    'gs://vit_models/imagenet21k/ViT-B_16.npz: cannot reach storage.googleapis.com (Temporary '
    'failure in name resolution): no network here; copy the files to a local folder',
  ),
  (
    'evaluate',
    ['--checkpoint=gs://bucket/run', '--dataset=digits'],
    'gs://bucket/run: cannot reach storage.googleapis.com',
  ),
  (
    'fewshot',
    ['--checkpoint=gs://bucket/run', '--datasets=digits'],
    'gs://bucket/run: cannot reach storage.googleapis.com',
  ),
  (
    'analyze',
    ['--checkpoint=gs://bucket/run', '--images={png}', '--output={tmp}/a'],
    'gs://bucket/run: cannot reach storage.googleapis.com',
  ),
  (
    'export',
    ['--checkpoint=gs://bucket/run', '--format=npz', '--output={tmp}/x.npz'],
    'gs://bucket/run: cannot reach storage.googleapis.com',
  ),
  (
    'evaluate',
    ['--checkpoint={npz}', '--model=testing', '--dataset=gs://bucket/shards'],
    'gs://bucket/shards/info.json: cannot reach storage.googleapis.com',
  ),
  # A path that names the wrong kind of thing, said before the work.
  (
    'evaluate',
    ['--checkpoint={npz}', '--model=testing', '--dataset=digits', '--output={tmp}/no/x.json'],
    '--output {tmp}/no/x.json: no folder {tmp}/no; make it or pass another file name',
  ),
  (
    'evaluate',
    ['--checkpoint={npz}', '--model=testing', '--dataset=digits', '--output={tmp}'],
    '--output {tmp} is a folder; pass a file name for the JSON',
  ),
  (
    'fewshot',
    ['--checkpoint={npz}', '--model=testing', '--datasets=digits', '--workdir={file}'],
    "{file} is a file: a workdir is a folder (made when missing) for the run's checkpoints",
  ),
  (
    'analyze',
    ['--checkpoint={npz}', '--model=testing', '--images={png}', '--output={file}'],
    '--output {file} is a file; pass a folder for the figures',
  ),
  (
    'export',
    ['--checkpoint={npz}', '--model=testing', '--format=hf', '--output={file}'],
    '--output {file} is a file; --format=hf writes a folder',
  ),
  ('jft', ['--folder={tmp}', '--out={file}'], '--out {file} is a file; pass a folder'),
  # Every missing flag at once, not one at a time.
  (
    'jft',
    [],
    'the following arguments are required: --folder or --csv, --out (see python -m vit_jax.jft',
  ),
  ('jft', ['--out={tmp}/s'], 'the following arguments are required: --folder or --csv (see'),
  # Images and label files that cannot be read.
  (
    'predict',
    ['--checkpoint={npz}', '--model=testing', '{tmp}/empty.png'],
    '{tmp}/empty.png: an empty file, not an image; pass a JPEG or PNG file',
  ),
  (
    'predict',
    ['--checkpoint={npz}', '--model=testing', '{tmp}/text.jpg'],
    '{tmp}/text.jpg: not a readable image',
  ),
  (
    'predict',
    ['--checkpoint={npz}', '--model=testing', '{tmp}/notes'],
    '{tmp}/notes: a directory without images (JPEG, PNG, WebP, TIFF, BMP, GIF or another',
  ),
  (
    'predict',
    ['--checkpoint={npz}', '--model=testing', '--labels={tmp}/latin1.txt', '{png}'],
    "{tmp}/latin1.txt: cannot read the labels file ('utf-8' codec can't decode byte 0xe9",
  ),
  (
    'analyze',
    ['--checkpoint={npz}', '--model=testing', '--images={tmp}/text.jpg', '--output={tmp}/a'],
    '{tmp}/text.jpg: not a readable image',
  ),
  (
    'predict',
    ['--checkpoint={png}', '--model=testing', '{png}'],
    "{png}: not an .npz checkpoint (an .npz is a zip archive; this file starts with b'\\x89PNG')",
  ),
  # Values out of range: said as the flag's, not as an error deep inside.
  (
    'evaluate',
    ['--checkpoint={npz}', '--model=testing', '--dataset=digits', '--batch=0'],
    'argument --batch: 0 must be at least 1 (see python -m vit_jax.evaluate --help)',
  ),
  (
    'evaluate',
    ['--checkpoint={npz}', '--model=testing', '--dataset=digits', '--crop=48'],
    '--crop=48: the checkpoint takes 32 px images (its position embeddings hold a 2x2 patch',
  ),
  (
    'fewshot',
    ['--checkpoint={npz}', '--model=testing', '--datasets=digits', '--shots=1,five'],
    "argument --shots: '1,five': pass integers of at least 1, like 1,5,10,25",
  ),
  (
    'fewshot',
    ['--checkpoint={npz}', '--model=testing', '--datasets=digits,'],
    "--datasets='digits,': an empty name; pass cifar10,pets",
  ),
  ('predict', ['--checkpoint={npz}', '--top_k=0', '{png}'], 'argument --top_k: 0 must be at'),
  # Where nothing can be written, and a CSV that is not text.
  (
    'export',
    ['--checkpoint={npz}', '--model=testing', '--format=npz', '--output=/proc/x.npz'],
    '/proc/x.npz: cannot write it (No such file or directory); pass a path you can write',
  ),
  (
    'jft',
    ['--csv={png}', '--out={tmp}/shards'],
    '{png}: not text (a NUL byte); pass a CSV of lines "path,label_id;..."',
  ),
]


@pytest.mark.parametrize(
  'name, argv, line', ERRORS, ids=[f'{i}-{case[0]}' for i, case in enumerate(ERRORS)]
)
def test_a_bad_input_is_one_line(name, argv, line, user_files, offline, capsys):
  import importlib

  main = importlib.import_module(f'vit_jax.{name}').main
  code, _, err = run_command(main, [a.format(**user_files) for a in argv], capsys)
  lines = err.strip().splitlines()
  assert code == 2 and len(lines) == 1, err
  assert lines[0].startswith('error: ' + line.format(**user_files)), err


@pytest.mark.parametrize('command', ['main', 'compile'])
def test_help_of_main_and_compile_lists_their_flags_and_every_config_field(command):
  """`main --help` and `compile --help` exit 0 listing their flags, `--config` among them, and
  every config field with its default and type."""
  from vit_jax.configs import schema

  result = subprocess.run(
    [sys.executable, '-m', f'vit_jax.{command}', '--help'],
    env=subprocess_env(),
    capture_output=True,
    text=True,
  )
  assert result.returncode == 0 and said(result.stderr) == [], result.stderr[-3000:]
  out = result.stdout
  flags_ = {'main': ['--workdir', '--coordinator_address'], 'compile': ['--topology', '--fit']}
  for name in ['--config=FILE[:ARGS]', '--verbosity=N', *flags_[command]]:
    assert f'\n  {name}' in out, name
  for field in schema.FIELDS:
    assert f'\n  --config.{field.name}={field.default!r} (' in out, field.name
  assert '--config.pp.crop=224 (int in [1, inf))' in out


ARGPARSE_COMMANDS = [
  'predict',
  'evaluate',
  'fewshot',
  'analyze',
  'export',
  'benchmark',
  'benchmark_input',
  'prepare',
  'jft',
]


@pytest.mark.parametrize('command', ARGPARSE_COMMANDS)
def test_help_of_every_other_command_lists_its_flags(command, capsys):
  import importlib

  module = importlib.import_module(f'vit_jax.{command}')
  with pytest.raises(SystemExit) as e:
    module.main(['--help'])
  out = capsys.readouterr().out
  assert e.value.code == 0 and 'options:' in out and '--help' in out and '--verbosity' in out


def test_a_library_writing_during_an_export_is_not_shown(user_files, monkeypatch, capfd):
  """What the exporters write to stdout and stderr (TensorFlow's lines for --format=savedmodel,
  torch's for --format=onnx) is hidden, and shown if the export fails."""
  from vit_jax import export
  from vit_jax.core import console
  from vit_jax.interop import onnx

  def noisy(loaded, output):  # as torch.onnx and TensorFlow write, natively and from Python
    os.write(1, b'[torch.onnx] Obtain model graph for `VisionTransformer` ...\n')
    os.write(2, b'W0000 00:00:1.2 3 tf_logging.cc:1] a library line\n')
    print('[torch.onnx] Translate the graph into ONNX... \u2705')
    with open(output, 'wb') as f:
      f.write(b'onnx')
    return output

  monkeypatch.setattr(onnx, 'save', noisy)
  console.quiet_libraries(-1)
  capfd.readouterr()
  argv = [f'--checkpoint={user_files["npz"]}', '--model=testing', '--format=onnx']
  assert export.main(argv + [f'--output={user_files["tmp"]}/m.onnx']) == 0
  out, err = capfd.readouterr()
  assert out == f'wrote onnx to {user_files["tmp"]}/m.onnx\n' and err == '', (out, err)
  assert (user_files['tmp'] / 'm.onnx').read_bytes() == b'onnx'
  with pytest.raises(ValueError):
    with console.library_output_hidden():
      os.write(2, b'why it failed\n')
      raise ValueError('a bug')
  assert capfd.readouterr().err == 'why it failed\n'


@pytest.mark.skipif(
  not __import__('importlib').util.find_spec('libtpu'), reason='libtpu is not installed'
)
def test_the_python_api_leaves_out_a_tpu_that_is_not_there(tmp_path):
  """`train.train_and_evaluate` from Python says nothing of a TPU the machine lacks (libtpu's
  `E0000 ... INVALID_ARGUMENT` lines hidden, as the commands hide them)."""
  script = (
    'from vit_jax import train\n'
    'from vit_jax.configs import demo\n'
    'config = demo.get_config()\n'
    'config.batch = 0\n'
    'try:\n'
    f'  train.train_and_evaluate(config, {str(tmp_path / "w")!r})\n'
    'except ValueError as e:\n'
    '  print(e)\n'
  )
  env = subprocess_env()
  del env['JAX_PLATFORMS']
  result = subprocess.run([sys.executable, '-c', script], env=env, capture_output=True, text=True)
  assert result.stdout.startswith('batch=0 must be at least 1'), result.stderr[-3000:]
  assert said(result.stderr) == [], result.stderr[-3000:]
