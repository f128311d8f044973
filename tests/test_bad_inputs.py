"""Every input a real user has (issue 25): each case with the one line it must print, or the
result it must give.

A path, an image, a config value or a signal enters through the commands; the
tables below hold what a user has typed or has on disk, and what must come
back. The fast tier runs the argparse commands in this process; the slow tier
(`@pytest.mark.slow`) runs `python -m vit_jax.main` and the other commands as a
user does, in a C locale without UTF-8 mode (file names are bytes there), on a
folder whose path, class and file names are French, Russian, Chinese and
Latin-1 bytes.

Remote storage is out of reach by construction, not by chance: the host lookup
of `vit_jax.core.files` is replaced (in children too), so the tests say the same on
a machine with network.
"""

import concurrent.futures
import errno
import io
import json
import os
import signal
import subprocess
import sys
import time

from conftest import param_shapes
from conftest import random_like
from conftest import said
from conftest import subprocess_env
import numpy as np
from PIL import Image
import pytest

from vit_jax import checkpoint
from vit_jax import workdir as workdir_lib
from vit_jax.configs import architectures
from vit_jax.configs import demo
from vit_jax.configs import flag
from vit_jax.configs.data import data_config
from vit_jax.configs.model_spec import Architecture
from vit_jax.configs.model_spec import naflex_of
from vit_jax.core import cli
from vit_jax.core import files
from vit_jax.data import images
from vit_jax.data import on_device
from vit_jax.data import pipeline
from vit_jax.data.sources import DataError
from vit_jax.evaluation import classify
from vit_jax.models import vit_checkpoint

SIZE = 32  # the `testing` model (16 px patches) at a 2 x 2 grid
# A folder named in three scripts and with spaces; classes and files likewise, and one file
# whose name is Latin-1 bytes (not UTF-8: Python sees surrogate escapes, in any locale).
FOLDER = 'données данные 数据'
CLASSES = ['zéro', 'один', '二 two']
LATIN1_FILE = b'caf\xe9 latin-1.png'
OFFLINE = ('storage.googleapis.com', 'Temporary failure in name resolution')


def _digit_pngs(root, per_split=(('train', 12), ('test', 4))):
  """DIR/<split>/<class>/<file> of digits 0, 1, 2 under the non-ASCII names above."""
  from vit_jax.data.readers import builtin

  pixels, labels = builtin.load_digits()
  for split, count in per_split:
    for label, name in enumerate(CLASSES):
      folder = os.path.join(os.fsencode(root), os.fsencode(split), name.encode('utf-8'))
      os.makedirs(folder)
      members = np.flatnonzero(labels == label)[: 2 * count]
      for i, index in enumerate(members[:count] if split == 'train' else members[count:]):
        name_bytes = LATIN1_FILE if (split, i) == ('train', 0) else f'échantillon {i} 图.png'
        if isinstance(name_bytes, str):
          name_bytes = name_bytes.encode('utf-8')
        Image.fromarray(pixels[index]).save(os.path.join(folder, name_bytes), format='PNG')
  return str(root)


@pytest.fixture(scope='module')
def folder(tmp_path_factory):
  return _digit_pngs(tmp_path_factory.mktemp('data') / FOLDER)


def _params(num_classes, favourite=None):
  shapes = param_shapes(architectures.MODEL_CONFIGS['testing'], num_classes, SIZE)
  params = random_like(shapes, scale=0.02)
  if favourite is not None:  # the head prefers one class, whatever the image
    params['head']['kernel'] = np.zeros_like(params['head']['kernel'])
    params['head']['bias'] = np.where(np.arange(num_classes) == favourite, 20.0, 0.0)
  return params


def _workdir(path, dataset, *, finished=True, favourite=1, num_classes=len(CLASSES)):
  """A training workdir of the `testing` model on `dataset`: finished (params.npz) or
  stopped (only a checkpoint at step 5, as a preempted run leaves it)."""
  import orbax.checkpoint as ocp

  os.makedirs(path)
  (path / 'config.json').write_text(json.dumps({'model': 'testing', 'dataset': dataset}))
  params = _params(num_classes, favourite)
  if finished:
    checkpoint.save_npz(params, path / 'params.npz')
  else:
    manager = ocp.CheckpointManager(workdir_lib.checkpoints_dir(str(path), absolute=True))
    state = {'params': params, 'step': np.asarray(5, np.int32)}  # (orbax 0.11: no numpy scalars)
    manager.save(5, args=ocp.args.Composite(state=ocp.args.StandardSave(state)))
    manager.wait_until_finished()
    manager.close()
  return str(path)


def _run(main, argv, capsys):
  """(exit status, stdout, stderr) of a command's `main(argv)` as `python -m` runs it."""
  capsys.readouterr()
  try:
    code = cli.run(main, argv)
  except SystemExit as e:
    code = e.code
  out, err = capsys.readouterr()
  return code, out, err


# ---------------------------------------------------------------------------
# Item 2: every image mode reaches the model as the same pixels in evaluation, predict and
# analyze (one decoding function, `vit_jax.data.images`). EXIF orientation is not applied,
# as TensorFlow and the official pipeline: a file's stored pixels, everywhere.


def _exif_rotated(grey):
  image = Image.fromarray(np.stack([grey, 255 - grey, grey // 2], -1))
  exif = Image.Exif()
  exif[0x0112] = 6  # Orientation: rotate 90 degrees clockwise to display
  buffer = io.BytesIO()
  image.save(buffer, 'JPEG', quality=95, exif=exif.tobytes())
  return buffer.getvalue()


def _mode_images():
  """{file name: encoded bytes} of one digit in every mode PIL opens that a folder holds."""
  from vit_jax.data.readers import builtin

  grey = np.asarray(
    Image.fromarray(builtin.load_digits()[0][0][..., 0]).resize((24, 20), Image.NEAREST)
  )
  rgb = Image.fromarray(np.stack([grey, 255 - grey, grey // 3], -1))

  def encoded(image, fmt, **kw):
    buffer = io.BytesIO()
    image.save(buffer, fmt, **kw)
    return buffer.getvalue()

  grey16 = Image.fromarray(grey.astype(np.uint16) * 257)  # 16-bit samples, mode I;16
  la = Image.fromarray(grey).convert('LA')
  la.putalpha(90)
  rgba = rgb.convert('RGBA')
  rgba.putalpha(128)
  palette_alpha = rgb.convert('P', palette=Image.ADAPTIVE, colors=16)
  palette_alpha.info['transparency'] = 0
  return {
    'grey 8-bit.png': encoded(Image.fromarray(grey), 'PNG'),
    'grey 16-bit.png': encoded(grey16, 'PNG'),
    'grey and alpha.png': encoded(la, 'PNG'),
    'palette.png': encoded(rgb.convert('P', palette=Image.ADAPTIVE, colors=16), 'PNG'),
    'palette transparent.png': encoded(palette_alpha, 'PNG', transparency=0),
    'rgba.png': encoded(rgba, 'PNG'),
    'bilevel.png': encoded(Image.fromarray(grey).convert('1'), 'PNG'),
    'cmyk.jpg': encoded(rgb.convert('CMYK'), 'JPEG', quality=95),
    'exif rotated.jpg': _exif_rotated(grey),
    'rgb.jpg': encoded(rgb, 'JPEG', quality=95),
    'palette.gif': encoded(rgb.convert('P', palette=Image.ADAPTIVE, colors=16), 'GIF'),
    'rgb.bmp': encoded(rgb, 'BMP'),
  }


MODES = sorted(_mode_images())


@pytest.fixture(scope='module')
def mode_folder(tmp_path_factory):
  """A folder dataset whose test split holds every mode (class a), and its eval pixels."""
  root = tmp_path_factory.mktemp('modes')
  for split in ('train', 'test'):
    for label in ('a', 'b'):
      os.makedirs(root / split / label)
  for name, data in _mode_images().items():
    (root / 'test' / 'a' / name).write_bytes(data)
    (root / 'train' / 'a' / name).write_bytes(data)
  for split in ('train', 'test'):
    (root / split / 'b' / 'x.bmp').write_bytes(_mode_images()['rgb.bmp'])
  config = data_config()
  config.update(dataset=str(root), batch_eval=len(MODES) + 1)
  config.pp.crop = SIZE
  from conftest import batch_sharding

  batches = list(pipeline.make_eval_iterator(config, batch_sharding(), split='test', raw=True))
  evaluated = [np.asarray(b['image'])[np.asarray(b['mask']).astype(bool)] for b in batches]
  return root, np.concatenate(evaluated)


@pytest.mark.parametrize('name', MODES)
def test_every_image_mode_gives_the_evaluation_pixels_in_predict_and_analyze(name, mode_folder):
  from vit_jax import analyze

  root, evaluated = mode_folder
  path = root / 'test' / 'a' / name
  pixels = classify.read_pixels(path, SIZE)
  same = [e for e in evaluated if np.array_equal(pixels, e)]
  assert same, name
  # The floats: the host's scaling, within its stated bound of the device's.
  analysed = analyze._readable([path], SIZE, [])[1][0]
  np.testing.assert_array_equal(analysed, classify.read_image(path, SIZE))
  assert (
    np.abs(analysed - np.asarray(on_device.normalise(same[0]))).max() <= on_device.MAX_DIFFERENCE
  )


def test_a_16_bit_digit_is_the_8_bit_digit_and_exif_is_not_applied(mode_folder):
  root = mode_folder[0] / 'test' / 'a'
  # 16-bit samples keep their high byte: the same pixels as the 8-bit file (ba6a7de clipped
  # them to two grey levels, and predicted another class).
  np.testing.assert_array_equal(
    classify.read_image(root / 'grey 16-bit.png', SIZE),
    classify.read_image(root / 'grey 8-bit.png', SIZE),
  )
  rotated = (root / 'exif rotated.jpg').read_bytes()
  stored = images.decode(rotated)  # the stored pixels, 24 wide and 20 high
  assert stored.shape == (20, 24, 3)
  np.testing.assert_array_equal(
    classify.read_image(root / 'exif rotated.jpg', SIZE),
    images.to_float(images.eval_array(stored, SIZE)),
  )


# ---------------------------------------------------------------------------
# The argparse commands, in this process: (command, arguments, the one line it must print).
# {tmp}: a temporary folder; {npz}: a checkpoint of the `testing` model; {png}: an image;
# {file}: an existing file; {run}: a finished workdir.

ERRORS = [
  # Item 6: remote storage out of reach is one line naming the path, the cause and what to do.
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
  # Item 7 and the like: a path that names the wrong kind of thing, said before the work.
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
  # Issue 35, category 8: every missing flag at once (argparse named --out, then the group).
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


@pytest.fixture
def offline(monkeypatch):
  """gs:// out of reach, as on a machine without network, whatever this one has."""
  monkeypatch.setattr(
    files, '_unreachable', lambda scheme: OFFLINE if scheme == 'gs' else None, raising=False
  )


@pytest.fixture
def inputs(tmp_path):
  """The files the ERRORS arguments name."""
  npz = checkpoint.save_npz(_params(3), tmp_path / 'model.npz')
  png = tmp_path / 'images' / 'digit.png'
  png.parent.mkdir()
  Image.fromarray(np.zeros((8, 8), np.uint8)).save(png)
  (tmp_path / 'file.txt').write_text('a file')
  (tmp_path / 'empty.png').write_bytes(b'')
  (tmp_path / 'text.jpg').write_text('not an image')
  (tmp_path / 'notes').mkdir()
  (tmp_path / 'notes' / 'a.txt').write_text('not an image')
  (tmp_path / 'latin1.txt').write_bytes('café\nthé\nlait\n'.encode('latin-1'))
  return {'tmp': tmp_path, 'npz': npz, 'png': png, 'file': tmp_path / 'file.txt'}


@pytest.mark.parametrize(
  'name, argv, line', ERRORS, ids=[f'{i}-{case[0]}' for i, case in enumerate(ERRORS)]
)
def test_a_bad_input_is_one_line(name, argv, line, inputs, offline, capsys):
  import importlib

  main = importlib.import_module(f'vit_jax.{name}').main
  code, _, err = _run(main, [a.format(**inputs) for a in argv], capsys)
  lines = err.strip().splitlines()
  assert code == 2 and len(lines) == 1, err
  assert lines[0].startswith('error: ' + line.format(**inputs)), err


# ---------------------------------------------------------------------------
# Results the commands must give.


@pytest.mark.parametrize(
  'model, crop, line',
  [
    (
      'ViT-Demo_4',
      30,
      'the 4 px that one patch of ViT-Demo_4 covers: the last 2 px of each row '
      'and column would be dropped; use --config.pp.crop=32 or 28',
    ),
    (
      'R50+ViT-B_16',
      200,
      'the 16 px that one patch of R50+ViT-B_16 covers: the last 8 px of each '
      'row and column would be dropped; use --config.pp.crop=208 or 192',
    ),
  ],
)
def test_a_resolution_the_patches_do_not_tile_is_one_line(model, crop, line):
  """Issue 35, category 4: the demo at pp.crop=30 trained with 2 px of each image dropped, and
  predict then resized to 28 px. The fine-tuning recipe tiles: 392 px for 14 px patches."""
  from vit_jax.configs import ConfigError
  from vit_jax.configs import recipes
  from vit_jax.training import program

  config = demo.get_config()
  config.update(model=model)
  config.pp.crop = crop
  with pytest.raises(ConfigError) as e:
    program.validate(config, 1)
  assert str(e.value) == f'pp.crop={crop} is not a multiple of {line}'
  assert recipes.finetune('ViT-H_14,cifar10').pp.crop == 392
  program.validate(recipes.finetune('ViT-H_14,cifar10'), 8)


def test_predict_says_why_classes_are_class_i(tmp_path, folder, capsys):
  """Issue 35, category 4: names that fall back to class_<i> say why, and what to do."""
  import shutil

  from vit_jax import predict

  npz = checkpoint.save_npz(_params(3), tmp_path / 'bare.npz')
  moved = shutil.copytree(folder, tmp_path / 'data')
  run = _workdir(tmp_path / 'run', str(moved))
  shutil.rmtree(moved)  # the dataset the run trained on, gone
  image = os.path.join(folder, 'test', CLASSES[0])
  line = 'python -m vit_jax.predict: classes named class_<i>: '
  code, out, err = _run(predict.main, [f'--checkpoint={npz}', '--model=testing', image], capsys)
  assert code == 0 and '(class 1)' in out and 'class_1' in out, err
  assert (
    err
    == line
    + 'a 3-way head, not an ImageNet one (1000 or 21843); pass --labels=FILE, one name per line\n'
  )
  code, out, err = _run(predict.main, [f'--checkpoint={run}', image], capsys)
  assert code == 0 and err.startswith(
    f'{line}its dataset {moved} does not open here ({moved}: no such folder'
  ), err
  assert err.endswith('; pass --labels=FILE, one name per line\n') and err.count('\n') == 1


def test_a_class_name_with_a_newline_is_one_line_of_predict(tmp_path, capsys):
  """Issue 35, category 8: a class folder whose name holds a newline broke predict's lines (the
  second half read as the next file's name); control characters are shown as escapes."""
  from vit_jax import predict

  root = tmp_path / 'data'
  for split in ('train', 'test'):
    for name in ('a', 'b\nc.png', 'd'):
      (root / split / name).mkdir(parents=True)
      Image.fromarray(np.zeros((8, 8), np.uint8)).save(root / split / name / 'x.png')
  run = _workdir(tmp_path / 'run', str(root), favourite=1)
  code, out, err = _run(predict.main, [f'--checkpoint={run}', str(root / 'test' / 'a')], capsys)
  assert code == 0, err
  assert out.splitlines() == [
    str(root / 'test' / 'a' / 'x.png'),
    '  1. 100.00%  b\\nc.png  (class 1)',
    '  2.   0.00%  a  (class 0)',
    '  3.   0.00%  d  (class 2)',
  ]


def test_predict_names_a_folder_trained_workdirs_classes(folder, tmp_path, capsys):
  """Item 8: the class folders' names, not class_0, class_1, ..."""
  from vit_jax import predict

  run = _workdir(tmp_path / 'run', folder, favourite=1)
  code, out, err = _run(
    predict.main, [f'--checkpoint={run}', f'{folder}/test/{CLASSES[0]}'], capsys
  )
  assert code == 0, err
  assert out.count(f'  1. 100.00%  {CLASSES[1]}  (class 1)') == 4, out


def test_an_unfinished_workdir_is_read_from_its_checkpoint(folder, tmp_path, capsys):
  """Item 8: a preempted run has no params.npz; its newest checkpoint is read, and said so."""
  from vit_jax import evaluate
  from vit_jax import predict

  run = _workdir(tmp_path / 'stopped', folder, finished=False, favourite=2)
  code, out, err = _run(
    predict.main, [f'--checkpoint={run}', f'{folder}/test/{CLASSES[0]}'], capsys
  )
  assert code == 0, err
  assert (
    f'{run} has no params.npz (its run has not finished): using its checkpoint at step 5' in err
  )
  assert out.count(f'  1. 100.00%  {CLASSES[2]}  (class 2)') == 4, out
  code, out, err = _run(evaluate.main, [f'--checkpoint={run}', f'--dataset={folder}'], capsys)
  assert code == 0 and json.loads(out)['top1'] == pytest.approx(1 / 3), err


def test_analyze_skips_an_unreadable_image_and_titles_the_model(tmp_path, inputs, capsys):
  """Item 8: as predict, an unreadable image is named and left out (exit 1); the figures and
  analysis.json name the model a workdir records, not None."""
  from vit_jax import analyze

  run = _workdir(tmp_path / 'run', 'digits')
  argv = [f'--checkpoint={run}', f'--images={inputs["png"]},{tmp_path}/text.jpg']
  code, out, err = _run(analyze.main, argv + [f'--output={tmp_path}/out'], capsys)
  assert code == 1 and out.startswith('wrote attention_distance.png'), err
  assert f'skipped {tmp_path}/text.jpg: not a readable image' in err and 'Traceback' not in err
  summary = json.loads((tmp_path / 'out' / 'analysis.json').read_text())
  assert summary['model'] == 'testing' and summary['images'] == [str(inputs['png'])]


@pytest.mark.parametrize('fmt, name', [('npz', 'params.npz'), ('timm', 'model.safetensors')])
def test_export_to_a_folder_writes_the_file_inside(fmt, name, inputs, capsys):
  """Item 7: a folder as --output of a one-file format (the README shows one for hf)."""
  from vit_jax import export

  if fmt == 'timm':
    pytest.importorskip('safetensors')
  out = inputs['tmp'] / 'exported'
  out.mkdir()
  argv = [f'--checkpoint={inputs["npz"]}', '--model=testing', f'--format={fmt}', f'--output={out}']
  code, printed, err = _run(export.main, argv, capsys)
  assert code == 0 and printed.startswith(f'wrote {fmt} to {out / name}'), err
  assert (out / name).stat().st_size > 1000
  from vit_jax.interop import export as interop

  assert interop.output_path('onnx', f'{out}/') == f'{out}/model.onnx'
  assert interop.output_path('onnx', str(out / 'm.onnx')) == str(out / 'm.onnx')


# Issue 35, category 2: (command, arguments, what the line says the output is); {run}: a
# finished workdir, {tmp}, {npz}, {png} as above. Each would have replaced the run's files.
OVER_A_RUN = [
  (
    'export',
    ['--checkpoint={npz}', '--model=testing', '--format=npz', '--output={run}'],
    '{run}/params.npz is in {run}, which',
  ),
  (
    'export',
    ['--checkpoint={npz}', '--model=testing', '--format=npz', '--output={run}/params.npz'],
    '{run}/params.npz is in {run}, which',
  ),
  ('export', ['--checkpoint={npz}', '--model=testing', '--format=hf', '--output={run}'], '{run}'),
  (
    'analyze',
    ['--checkpoint={npz}', '--model=testing', '--images={png}', '--output={run}'],
    '{run}',
  ),
  (
    'evaluate',
    ['--checkpoint={npz}', '--model=testing', '--dataset=digits', '--output={run}/summary.json'],
    '{run}/summary.json is in {run}, which',
  ),
  ('jft', ['--folder={tmp}/images', '--out={run}'], '{run}'),
  (
    'benchmark',
    ['--model=testing', '--json={run}/summary.json'],
    '{run}/summary.json is in {run}, which',
  ),
]


@pytest.mark.parametrize(
  'name, argv, what', OVER_A_RUN, ids=[f'{i}-{case[0]}' for i, case in enumerate(OVER_A_RUN)]
)
def test_no_command_writes_over_a_runs_work(name, argv, what, inputs, tmp_path, capsys):
  """`export --format=npz --output=<workdir>` replaced the run's final weights without a word;
  every command that writes refuses in one line (`workdir.check_output`), before its work."""
  import importlib

  run = _workdir(tmp_path / 'run', 'digits')
  workdir_lib.write_summary(run, {'step': 5, 'model': 'testing'})
  before = {f: (tmp_path / 'run' / f).read_bytes() for f in os.listdir(run)}
  main = importlib.import_module(f'vit_jax.{name}').main
  paths = {**inputs, 'run': run}
  code, out, err = _run(main, [a.format(**paths) for a in argv], capsys)
  assert code == 2 and out == '' and len(err.strip().splitlines()) == 1, err
  assert err.startswith(
    f"error: --{argv[-1][2:].split('=')[0]} {what.format(**paths)} holds a run's work (params.npz"
  ), err
  assert {f: (tmp_path / 'run' / f).read_bytes() for f in os.listdir(run)} == before


def test_an_export_beside_a_runs_files_is_written(inputs, tmp_path, capsys):
  """What the guard leaves alone: a file of another name in the run's folder, a sub-folder."""
  from vit_jax import export

  run = _workdir(tmp_path / 'run', 'digits')
  for output in (f'{run}/exported.npz', f'{run}/export/'):
    argv = [f'--checkpoint={run}', '--format=npz', f'--output={output}']
    code, out, err = _run(export.main, argv, capsys)
    assert code == 0 and out.startswith('wrote npz to '), err
  assert sorted(os.listdir(run)) == ['config.json', 'export', 'exported.npz', 'params.npz']


def test_jft_prints_its_result_on_stdout(folder, tmp_path, capsys):
  """Item 8: the result is a line on stdout (ba6a7de logged it on stderr); class names in
  info.json are the folders' names as text."""
  from vit_jax import jft

  argv = [f'--folder={folder}/test', f'--out={tmp_path}/shards', '--shards=2']
  code, out, err = _run(jft.main, argv, capsys)
  assert code == 0 and err == '', err
  assert out == (
    f'wrote 12 examples of split train (3 classes) in 2 shards to {tmp_path}/shards; '
    '0 corrupt images skipped\n'
  )
  info = json.loads((tmp_path / 'shards' / 'info.json').read_text(encoding='utf-8'))
  assert info['class_names'] == CLASSES


def test_a_run_a_signal_stopped_exits_as_shells_expect(capsys):
  """Issue 35, category 8: a training run stopped by Ctrl-C exited 2, as a bad input; now 130
  (128 + SIGINT), and 143 for SIGTERM, as a shell reports a process the signal ended."""
  from vit_jax.training import stopping

  for sig, status in ((signal.SIGINT, 130), (signal.SIGTERM, 143)):
    with pytest.raises(SystemExit) as e:
      with cli.reported():
        raise stopping.Stopped('interrupted (Ctrl-C) at step 7; checkpoint written to run', sig)
    assert e.value.code == status
  assert capsys.readouterr().err.count('error: interrupted (Ctrl-C) at step 7;') == 2


def test_ctrl_c_in_a_command_is_one_line(inputs, monkeypatch, capsys):
  """Item 5, outside training: nothing to save; one line and exit status 130."""
  from vit_jax import predict

  def interrupted(*args, **kwargs):
    raise KeyboardInterrupt

  monkeypatch.setattr(classify, 'predict', interrupted)
  argv = [f'--checkpoint={inputs["npz"]}', '--model=testing', str(inputs['png'])]
  assert _run(predict.main, argv, capsys)[::2] == (130, 'error: interrupted (Ctrl-C)\n')


def test_a_reader_that_goes_away_ends_a_command_quietly(tmp_path):
  """`python -m vit_jax.predict ... | head -1`: the command stops without a BrokenPipeError
  traceback, with a shell's exit status for it (141), as `cat` would."""
  command = (
    'import sys\n'
    'from vit_jax.core import cli\n'
    'def main():\n'
    '  for i in range(10**6):\n'
    "    print(f'image_{i}.png: class {i % 10}')\n"
    'sys.exit(cli.run(main))\n'
  )
  script = tmp_path / 'lines.py'
  script.write_text(command)
  result = subprocess.run(
    ['bash', '-c', f'set -o pipefail; {sys.executable} {script} | head -1'],
    capture_output=True,
    text=True,
    env=subprocess_env(),
    timeout=120,
  )
  assert result.stdout == 'image_0.png: class 0\n'
  assert result.returncode == 141 and said(result.stderr) == [], result.stderr[-3000:]


# ---------------------------------------------------------------------------
# Config files (item 4 and 7), in this process: what `flag.ConfigFlag` checks before and after
# absl reads the file. The slow tier runs them through python -m vit_jax.main.


def test_a_misspelt_field_in_a_config_file_is_named_with_the_field_it_meant():
  config = demo.get_config()
  assert flag.unknown_fields(config) == ''
  config.total_step = 4
  assert flag.unknown_fields(config) == (
    "unknown config field 'total_step' (no run reads it); did you mean total_steps?"
  )
  config = demo.get_config()
  config.pp.crops = 8
  assert "'pp.crops' (no run reads it); did you mean pp.crop?" in flag.unknown_fields(config)
  config.fewshots = {'datasets': ('cifar10',)}  # one line: the first unknown field, by name
  assert "'fewshots' (no run reads it); did you mean fewshot?" in flag.unknown_fields(config)


@pytest.mark.parametrize(
  'name, text, line',
  [
    ('syntax.py', 'def get_config(:\n', 'line 1: SyntaxError: invalid syntax: def get_config(:;'),
    ('config.yaml', 'total_steps: 4\n', 'is not a Python file: a config is a .py file'),
    ('folder.py/', '', 'is not a Python file'),
    ('nul.py', 'x = 1\0\n', 'SyntaxError'),
  ],
)
def test_a_config_file_that_is_not_python_is_one_line(name, text, line, tmp_path, capsys):
  path = tmp_path / name.rstrip('/')
  if name.endswith('/'):
    path.mkdir()
  else:
    path.write_text(text)
  with pytest.raises(SystemExit) as e:
    flag.check_config_file(str(path), 'configs/demo.py')
  err = capsys.readouterr().err.strip()
  assert e.value.code == 2 and err.startswith(f'error: config file {path}') and line in err, err


def test_a_workdir_that_is_a_file_is_one_line(tmp_path):
  (tmp_path / 'file').write_text('')
  workdir_lib.check_folder(str(tmp_path / 'new' / 'run'))  # made when missing: fine
  for path, where in [('file', 'is a file'), ('file/run', f'is inside the file {tmp_path}/file')]:
    with pytest.raises(workdir_lib.WorkdirError, match=f'^{tmp_path}/{path} {where}: a workdir'):
      workdir_lib.check_folder(str(tmp_path / path))


# ---------------------------------------------------------------------------
# Issue 46, round four: a custom 1000-class head, registers on a checkpoint, arrays registered
# in Python, environments, a full disk, help. Each test below failed on c8cff89's code.


def _dead_pid() -> int:
  """The id of a process that has ended (what a kill -9 leaves behind in a temporary name)."""
  child = subprocess.Popen([sys.executable, '-c', 'pass'])
  child.wait()
  return child.pid


def test_a_1000_class_head_gets_its_runs_names_never_imagenets(tmp_path, capsys):
  """A 1000-class head trained on a folder that is gone got ImageNet-1k's names (`cellular
  telephone (class 487)`) from predict and export's id2label: the run's own record
  (dataset.json) names them; without one, class_<i> and why; a bare file is ImageNet's."""
  from vit_jax import export
  from vit_jax import predict

  names = [f'k{i:04d}' for i in range(1000)]
  image = tmp_path / 'x.png'
  Image.fromarray(np.zeros((8, 8), np.uint8)).save(image)
  gone = str(tmp_path / 'gone')
  recorded = _workdir(tmp_path / 'recorded', gone, favourite=487, num_classes=1000)
  (tmp_path / 'recorded' / 'dataset.json').write_text(json.dumps(_record(gone, names)))
  old = _workdir(tmp_path / 'old', gone, favourite=487, num_classes=1000)
  bare = checkpoint.save_npz(_params(1000, 487), tmp_path / 'bare.npz')
  code, out, err = _run(predict.main, [f'--checkpoint={recorded}', '--top_k=1', str(image)], capsys)
  assert code == 0 and out.splitlines()[1] == '  1. 100.00%  k0487  (class 487)' and not err, err
  code, out, err = _run(predict.main, [f'--checkpoint={old}', '--top_k=1', str(image)], capsys)
  assert code == 0 and out.splitlines()[1] == '  1. 100.00%  class_487  (class 487)', out
  assert err.startswith(
    f'python -m vit_jax.predict: classes named class_<i>: its dataset {gone} does not open here'
  ), err
  argv = [f'--checkpoint={bare}', '--model=testing', '--top_k=1', str(image)]
  code, out, err = _run(predict.main, argv, capsys)
  assert out.splitlines()[1].startswith('  1. 100.00%  cellular telephone, cellular phone'), out
  for run, label in ((recorded, 'k0487'), (old, 'LABEL_487')):
    argv = [f'--checkpoint={run}', '--format=hf', f'--output={tmp_path}/hf_{label}']
    code, out, err = _run(export.main, argv, capsys)
    assert code == 0, err
    hf = json.loads((tmp_path / f'hf_{label}' / 'config.json').read_text())
    assert hf['id2label']['487'] == label


def test_an_npz_label_past_a_million_classes_is_one_line_at_once(tmp_path):
  """One label of 2,000,000,000 (no class_names) built two billion class names: 111 s,
  10.7 GB and a MemoryError."""
  from vit_jax.data.readers import arrays

  x = np.zeros((4, 8, 8, 3), np.uint8)
  path = tmp_path / 'data.npz'
  np.savez(path, x_train=x, y_train=np.array([0, 1, 2, 2_000_000_000]), x_test=x, y_test=[0] * 4)
  start = time.perf_counter()
  with pytest.raises(DataError) as e:
    arrays.load(str(path))
  assert time.perf_counter() - start < 5
  assert str(e.value) == (
    f'{path}: y_train holds a label 2000000000, which would make 2,000,000,001 classes; labels '
    'are class ids 0..K-1: renumber them (np.unique(y, return_inverse=True)[1]) or give '
    'class_names'
  )


@pytest.mark.parametrize('before, after', [(0, 2), (2, 0), (1, 3)])
def test_registers_added_or_dropped_on_a_checkpoint_keep_the_rest(before, after, tmp_path, capsys):
  """`--config.pretrained_path=RUN --config.num_registers=1` on a run without registers was
  'cannot resize 15 to 16 patch positions; only square grids (square images)': registers the
  checkpoint lacks start as a fresh model's (token and position row), those the model lacks
  are dropped, every other row and parameter is loaded, and the table says so."""
  config = architectures.MODEL_CONFIGS['testing']
  config.num_registers = before
  pretrained = random_like(param_shapes(config, 5, SIZE), seed=1)
  path = checkpoint.save_npz(pretrained, tmp_path / 'run.npz')
  config.num_registers = after
  init = random_like(param_shapes(config, 3, 2 * SIZE), seed=2)  # at 64 px: a 4x4 grid
  params = checkpoint.load_pretrained(
    pretrained_path=str(path), init_params=init, model_config=config
  )
  posemb = params['Transformer']['posembed_input']['pos_embedding']
  old = pretrained['Transformer']['posembed_input']['pos_embedding']
  fresh = init['Transformer']['posembed_input']['pos_embedding']
  kept = min(before, after)
  assert posemb.shape == (1, 1 + after + 16, 10)
  np.testing.assert_array_equal(posemb[:, : 1 + kept], old[:, : 1 + kept])
  np.testing.assert_array_equal(posemb[:, 1 + kept : 1 + after], fresh[:, 1 + kept : 1 + after])
  np.testing.assert_array_equal(
    posemb[:, 1 + after :],
    vit_checkpoint.resize_posemb(old[:, [0, *range(1 + before, 5 + before)]], 17, 1)[:, 1:],
  )
  if after:
    if kept:
      np.testing.assert_array_equal(
        params['registers'][:, :kept], pretrained['registers'][:, :kept]
      )
    np.testing.assert_array_equal(params['registers'][:, kept:], init['registers'][:, kept:])
  else:
    assert 'registers' not in params
  for key, value in checkpoint.flatten(pretrained).items():
    if not key.startswith(('head/', 'registers', 'Transformer/posembed_input')):
      np.testing.assert_array_equal(checkpoint.flatten(params)[key], value, err_msg=key)
  table = capsys.readouterr().out
  if after > before:
    assert (
      f're-initialised  registers (1, {after}, 10): {after - kept} new register token(s) and '
      f"their position rows, as a fresh model's ({kept} kept)"
    ) in table, table
  else:
    assert f'dropped         registers (1, {before}, 10): {before} register token(s)' in table


def _record(dataset, classes, *, registered=False):
  """dataset.json as a run writes it (`vit_jax.data.datasets.record`)."""
  path = None if registered else os.path.realpath(dataset)
  return {
    'dataset': dataset,
    'path': path,
    'registered': registered,
    'num_classes': len(classes) if isinstance(classes, list) else classes,
    'class_names': classes if isinstance(classes, list) else None,
  }


def _handmade_run(path, config, *, step=4, dataset_record=None, checkpoint_step=None):
  """A workdir as a stopped run leaves it: config.json, dataset.json (when given), and a
  checkpoint (params only: what `vit_jax.evaluation.loader` reads) or a summary short of the
  end."""
  import orbax.checkpoint as ocp

  os.makedirs(path)
  workdir_lib.write_config(str(path), config)
  if dataset_record is not None:
    (path / 'dataset.json').write_text(json.dumps(dataset_record))
  if checkpoint_step is None:
    workdir_lib.write_summary(str(path), {'step': step, 'model': config.model})
    return str(path)
  manager = ocp.CheckpointManager(workdir_lib.checkpoints_dir(str(path), absolute=True))
  state = {'params': _params(3), 'step': np.asarray(checkpoint_step, np.int32)}
  manager.save(checkpoint_step, args=ocp.args.Composite(state=ocp.args.StandardSave(state)))
  manager.wait_until_finished()
  manager.close()
  return str(path)


def test_a_run_on_arrays_registered_in_python_resumed_without_them_says_how(tmp_path):
  """Resumed from the command line, such a run sent the user to download the name from TFDS
  (`myarrays: not prepared in ~/tensorflow_datasets/...; run python -m vit_jax.prepare`)."""
  from conftest import tiny_run_config

  from vit_jax.training import loop
  from vit_jax.training import resume

  config = tiny_run_config(dataset='myarrays')
  run = _handmade_run(
    tmp_path / 'run', config, dataset_record=_record('myarrays', 10, registered=True)
  )
  with pytest.raises(resume.ResumeError) as e:
    loop.train_and_evaluate(config, run)
  assert str(e.value) == (
    f"{run} holds a run on 'myarrays', arrays registered in Python (register_arrays), which "
    'this process has not registered: resume it from Python, calling '
    "vit_jax.input_pipeline.register_arrays('myarrays', x_train=..., y_train=..., ...) with the "
    'same arrays before train_and_evaluate'
  )


def test_register_arrays_twice_under_a_name_takes_the_same_arrays_only(monkeypatch):
  """A second `register_arrays('mine', ...)` replaced the first silently."""
  from vit_jax.data import datasets
  from vit_jax.data.readers import arrays

  monkeypatch.setattr(arrays, '_REGISTERED', {})
  x, y = np.zeros((4, 8, 8, 3), np.uint8), np.array([0, 1, 0, 1])
  datasets.register_arrays('mine', x_train=x, y_train=y)
  datasets.register_arrays('mine', x_train=x.copy(), y_train=y)  # a notebook cell run again
  with pytest.raises(DataError) as e:
    datasets.register_arrays('mine', x_train=x + 1, y_train=y)
  assert str(e.value) == (
    "register_arrays: 'mine' holds other arrays already in this process; pick another name, "
    'or pass replace=True to read these under it from now on'
  )
  datasets.register_arrays('mine', replace=True, x_train=x + 1, y_train=y)
  assert arrays._data('mine')['splits']['train'][0]().max() == 1


def _outside(bounds: str):
  """A value just outside an interval '[a, b)' of `schema.Field.bounds`."""
  low, high = (float(v) for v in bounds[1:-1].split(','))
  if low == float('-inf'):
    return float('nan')
  if high != float('inf'):
    return high if bounds[-1] == ')' else high + 1
  return low if bounds[0] == '(' else low - 1


def _numeric_fields():
  from vit_jax.configs import schema

  return [f for f in schema.FIELDS if f.type in (int, float) or getattr(f, 'bounds', None)]


@pytest.mark.parametrize('name', [f.name for f in _numeric_fields()])
def test_every_number_field_has_bounds_and_a_value_outside_is_one_line(name):
  """`--config.num_registers=-1` (52 lines) and `--config.pp.crop=0` (58, OpenCV) reached a
  library; every number of the schema now has its interval, checked before anything runs."""
  from conftest import tiny_run_config

  from vit_jax.configs import ConfigError
  from vit_jax.configs import schema
  from vit_jax.training import program

  field = next(f for f in schema.FIELDS if f.name == name)
  assert field.bounds, f'{name}: a number without bounds'
  config = tiny_run_config()
  program.validate(config, 1)  # its value now passes
  value = _outside(field.bounds)
  value = int(value) if field.type is int and value == value else value
  *sections, last = name.split('.')
  target = config
  for section in sections:
    target = target[section]
  if field.type is tuple:
    target[last] = (value,)
  else:
    with target.ignore_type():
      target[last] = value
  with pytest.raises(ConfigError) as e:
    program.validate(config, 1)
  assert str(e.value).startswith(f'{name}=') and '\n' not in str(e.value), str(e.value)


def test_a_numeric_field_without_bounds_is_found():
  from vit_jax.configs import schema

  assert {f.name for f in _numeric_fields()} >= {'num_registers', 'pp.crop', 'seed', 'b2'}
  assert not [f.name for f in schema.FIELDS if f.type in (int, float) and not f.bounds]


@pytest.mark.parametrize('platform', ['gpu', 'cuda'])
def test_a_platform_the_machine_lacks_is_one_line(platform, inputs):
  """`JAX_PLATFORMS=gpu` (41 lines) and `=cuda` (36, a bare AssertionError) without a GPU."""
  env = subprocess_env()
  env['JAX_PLATFORMS'] = platform
  argv = ['-m', 'vit_jax.predict', f'--checkpoint={inputs["npz"]}', '--model=testing']
  result = subprocess.run(
    [sys.executable, *argv, str(inputs['png'])], env=env, capture_output=True, text=True
  )
  if result.returncode == 0:
    pytest.skip(f'this machine has a {platform} device')
  assert result.returncode == 2 and said(result.stderr) == [
    f'error: JAX_PLATFORMS={platform}: JAX cannot start it on this machine (its GPU plugin '
    'found no GPU, or no CUDA); unset JAX_PLATFORMS to use what the machine has, or set '
    'JAX_PLATFORMS=cpu'
  ], result.stderr[-3000:]


def test_analyze_reads_a_naflex_checkpoint_with_a_plain_vits_attention(tmp_path, capsys):
  """`analyze` on a NaFlex checkpoint was `KeyError: 'intermediates'` (27 lines): its blocks now
  sow their attention where the analyses ask, the weights of a plain ViT that computes the
  same (its class token's position row zero, its patches' the NaFlex grid)."""
  from vit_jax import analyze
  from vit_jax.evaluation import figures
  from vit_jax.evaluation import loader
  from vit_jax.models import naflex

  config = architectures.MODEL_CONFIGS['testing']
  model = naflex.NaFlexViT(3, naflex_of(Architecture.of(config), (2, 2), 'bilinear'))
  shapes = param_shapes(config, 3, 16, module=model)
  flat = checkpoint.flatten(random_like(shapes, seed=3, scale=0.3))
  path = checkpoint.save_npz(checkpoint.unflatten(flat), tmp_path / 'naflex.npz')
  table = flat['Transformer/posembed_input/pos_embedding']
  plain = dict(flat)
  plain['Transformer/posembed_input/pos_embedding'] = np.concatenate(
    [np.zeros((1, 1, 10), np.float32), table.reshape(1, 4, 10)], axis=1
  )
  images_ = np.random.default_rng(0).uniform(-1, 1, (3, SIZE, SIZE, 3)).astype(np.float32)
  got = figures.attention_weights(loader.model_from_flat(flat, 'testing', 'naflex'), images_)
  want = figures.attention_weights(loader.model_from_flat(plain, 'testing', 'plain'), images_)
  assert len(got) == len(want) == 1
  np.testing.assert_allclose(got[0], want[0], atol=1e-6)
  argv = [f'--checkpoint={path}', '--model=testing', '--images=digits', f'--output={tmp_path}/a']
  code, out, err = _run(analyze.main, argv, capsys)
  assert code == 0 and out.startswith('wrote attention_distance.png'), err
  summary = json.loads((tmp_path / 'a' / 'analysis.json').read_text())
  assert np.shape(summary['posemb_similarity']['values']) == (2, 2, 2, 2)


# What main and compile say to a flag or a config file they cannot take: (command, arguments,
# environment, the line). Each reaches no JAX, so the processes start in a second.
FLAG_CASES = [
  (
    'main',
    ['--foo'],
    {},
    'error: unknown flag --foo; the flags are --config, --coordinator_address, --num_processes, '
    '--process_id, --verbosity, --workdir and --config.FIELD=VALUE (python -m vit_jax.main '
    '--help lists them)',
  ),
  ('main', ['--workdr=x'], {}, 'error: unknown flag --workdr; did you mean --workdir? the flags'),
  (
    'main',
    ['--config={tmp}/imports.py'],
    {},
    'error: config file {tmp}/imports.py, line 1: ModuleNotFoundError: No module named '
    "'no_such_module' (import no_such_module); install the module or fix the import",
  ),
  (
    'main',
    ['--config={tmp}/returns_dict.py', '--config.total_steps=4'],
    {},
    'error: config file {tmp}/returns_dict.py: get_config() returned a dict, not an '
    'ml_collections.ConfigDict; return one',
  ),
  (
    'main',
    ['--config=configs/vit_b16.py:imagenet21k'],
    {},
    'error: config file configs/vit_b16.py not found in {tmp}; the clone has {root}/configs/'
    'vit_b16.py: pass --config={root}/configs/vit_b16.py:imagenet21k (or run from {root})',
  ),
  (
    'main',
    ['--config.total_steps=0'],  # were the variable ignored, this line would say so instead
    {'VIT_JAX_VERBOSITY': 'abc'},
    "error: VIT_JAX_VERBOSITY='abc' is not an integer; set -1 (warnings only, the default), 0 "
    '(full library logs) or 1 (debug), or unset it',
  ),
  (
    'compile',
    ['--config={root}/configs/demo.py', '--bar=1'],
    {},
    'error: unknown flag --bar; the flags are --config, --fit,',
  ),
]


@pytest.mark.parametrize(
  'command, argv, env, line', FLAG_CASES, ids=[f'{i}-{c[0]}' for i, c in enumerate(FLAG_CASES)]
)
def test_a_flag_or_config_file_main_cannot_take_is_one_line(command, argv, env, line, tmp_path):
  """A config file importing a missing module (55 lines) or whose get_config returns a dict
  (23), `Did you mean: coordinator_address ?` for --foo, "configs live in configs/" from
  another folder, and VIT_JAX_VERBOSITY=abc ignored unseen."""
  (tmp_path / 'imports.py').write_text('import no_such_module\n')
  (tmp_path / 'returns_dict.py').write_text('def get_config():\n  return {"total_steps": 4}\n')
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  argv = [a.format(tmp=tmp_path, root=root) for a in argv]
  result = subprocess.run(
    [sys.executable, '-m', f'vit_jax.{command}', *argv]
    + ([f'--workdir={tmp_path}/w'] if command == 'main' else []),
    env={**subprocess_env(), **env},
    capture_output=True,
    text=True,
    cwd=tmp_path,
    timeout=300,
  )
  lines = said(result.stderr)
  assert result.returncode == 2 and len(lines) == 1, result.stderr[-3000:]
  assert lines[0].startswith(line.format(tmp=tmp_path, root=root)), lines[0]
  assert not os.path.exists(tmp_path / 'w')


@pytest.mark.parametrize('command', ['main', 'compile'])
def test_help_of_main_and_compile_lists_their_flags_and_every_config_field(command):
  """`main --help` showed neither --config nor a field (exit 1); `compile --help` printed
  `error: --config is required`."""
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


class _Full:
  """Writes that fail as on a full disk, after `after` bytes."""

  @staticmethod
  def savez(file, **arrays):
    file.write(b'\0' * 1000)
    raise OSError(errno.ENOSPC, 'No space left on device', getattr(file, 'name', None))

  @staticmethod
  def safetensors(*args, **kwargs):
    from safetensors import SafetensorError

    raise SafetensorError(
      'Error while serializing: I/O error: No space left on device (os error 28)'
    )


@pytest.mark.parametrize('fmt', ['npz', 'hf', 'timm'])
def test_an_export_onto_a_full_disk_is_one_line_and_leaves_nothing(
  fmt, inputs, monkeypatch, capsys
):
  """hf onto a full disk was a 22-line SafetensorError, npz 43 lines and a 1 MB x.npz.tmp-*
  left behind."""
  pytest.importorskip('safetensors')
  from vit_jax import export
  from vit_jax.interop import torch_layout

  monkeypatch.setattr(checkpoint.np, 'savez', _Full.savez)
  monkeypatch.setattr(torch_layout, 'save_safetensors', _Full.safetensors)
  out = inputs['tmp'] / 'out'
  out.mkdir()
  argv = [f'--checkpoint={inputs["npz"]}', '--model=testing', f'--format={fmt}']
  code, _, err = _run(export.main, argv + [f'--output={out}/x'], capsys)
  assert code == 2 and err == (
    f'error: {out}/x: cannot write it (no space left on device); nothing was written there. '
    'Free space there, or pass another --output\n'
  ), err
  assert os.listdir(out) == []


def test_a_full_disk_or_a_kill_leaves_no_temporary_npz_for_good(tmp_path, monkeypatch):
  """Training's full-disk path left `params.npz.tmp-*` in the workdir for good: a failed write
  removes its file, and the next write one that a killed process left."""
  params = _params(3)
  stale = tmp_path / f'params.npz.tmp-{_dead_pid()}'
  stale.write_bytes(b'half a file')
  running = tmp_path / f'params.npz.tmp-{os.getppid()}'  # a live process's write: kept
  running.write_bytes(b'being written')
  with monkeypatch.context() as patch:
    patch.setattr(checkpoint.np, 'savez', _Full.savez)
    with pytest.raises(OSError):
      checkpoint.save_npz(params, tmp_path / 'params.npz')
  assert sorted(os.listdir(tmp_path)) == [running.name]
  checkpoint.save_npz(params, tmp_path / 'params.npz')
  assert sorted(os.listdir(tmp_path)) == ['params.npz', running.name]


def test_an_export_a_kill_cut_short_is_cleaned_by_the_next(inputs, capsys):
  """A `kill -9` during an export left its temporary file beside the output, and the next
  export of the same path left it there."""
  from vit_jax import export

  out, pid = inputs['tmp'] / 'exports', _dead_pid()
  (out / f'.x.npz.tmp-{pid}' / 'x.npz').mkdir(parents=True)  # a staged export, killed
  (out / f'x.npz.tmp-{pid}').write_bytes(b'half')  # c8cff89's save_npz, killed
  argv = [f'--checkpoint={inputs["npz"]}', '--model=testing', '--format=npz']
  code, out_, err = _run(export.main, argv + [f'--output={out}/x.npz'], capsys)
  assert code == 0, err
  assert os.listdir(out) == ['x.npz']


@pytest.mark.slow
def test_a_savedmodel_export_replaces_what_a_killed_one_left(inputs, capsys):
  """TensorFlow writes a SavedModel's variables under variables/variables_temp first; a kill
  -9 left that folder, and the next export into the same folder kept it."""
  pytest.importorskip('tensorflow')
  from vit_jax import export

  out = inputs['tmp'] / 'sm'
  left = out / 'variables' / 'variables_temp' / 'part-00000-of-00001.data-00000-of-00001.temp'
  left.parent.mkdir(parents=True)
  left.write_bytes(b'half')
  argv = [f'--checkpoint={inputs["npz"]}', '--model=testing', '--format=savedmodel']
  code, out_, err = _run(export.main, argv + [f'--output={out}'], capsys)
  assert code == 0 and out_ == f'wrote savedmodel to {out}\n' and err == '', err
  assert sorted(os.listdir(out / 'variables')) == [
    'variables.data-00000-of-00001',
    'variables.index',
  ]
  assert [p for p in os.listdir(inputs['tmp']) if '.tmp-' in p] == []


def test_a_library_writing_during_an_export_is_not_shown(inputs, monkeypatch, capfd):
  """`export --format=savedmodel` printed 4 TensorFlow lines, `--format=onnx` 4 torch lines:
  what the exporters write to stdout and stderr is hidden (and shown if the export fails)."""
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
  argv = [f'--checkpoint={inputs["npz"]}', '--model=testing', '--format=onnx']
  assert export.main(argv + [f'--output={inputs["tmp"]}/m.onnx']) == 0
  out, err = capfd.readouterr()
  assert out == f'wrote onnx to {inputs["tmp"]}/m.onnx\n' and err == '', (out, err)
  assert (inputs['tmp'] / 'm.onnx').read_bytes() == b'onnx'
  with pytest.raises(ValueError):
    with console.library_output_hidden():
      os.write(2, b'why it failed\n')
      raise ValueError('a bug')
  assert capfd.readouterr().err == 'why it failed\n'


def test_out_of_memory_under_naflex_names_the_token_budget():
  """`--config.naflex_tokens='(4,100000)'` ran out of memory with advice about accum_steps,
  remat and batch, never the budget that padded every image to 100,000 tokens."""
  from conftest import tiny_run_config
  import jax

  from vit_jax.training import loop

  config = tiny_run_config(naflex_tokens=(4, 100_000))
  with pytest.raises(loop.TrainingError) as e:
    with loop._out_of_memory_advice(config):
      raise jax.errors.JaxRuntimeError('RESOURCE_EXHAUSTED: Out of memory allocating 9 GB')
  assert str(e.value) == (
    'out of device memory at batch 32 per step of up to 100,000 tokens an image: lower the '
    'largest budget in --config.naflex_tokens (now (4, 100000)), raise --config.accum_steps '
    '(now 1), or lower --config.batch'
  )


def test_a_class_folder_added_between_runs_is_said_as_the_data_changing(tmp_path, folder):
  """A class folder added between runs got "if the config changed since the run started, run
  it with the original one": the config had not changed, the data had."""
  import shutil

  from conftest import tiny_run_config

  from vit_jax.training import loop
  from vit_jax.training import resume

  data = shutil.copytree(folder, tmp_path / 'data')
  config = tiny_run_config(dataset=str(data), **{'pp.crop': SIZE})
  run = _handmade_run(
    tmp_path / 'run', config, dataset_record=_record(str(data), CLASSES), checkpoint_step=4
  )
  for split in ('train', 'test'):
    shutil.copytree(data / split / CLASSES[0], data / split / 'new')
  with pytest.raises(resume.ResumeError) as e:
    loop.train_and_evaluate(config, run)
  assert str(e.value) == (
    f"{data} has 4 classes now, the run in {run} was trained on 3 (added 'new'): the data "
    'changed since the run started. To resume it, restore the data as it was; to train on the '
    f'new classes, use another --workdir (--config.pretrained_path={run} starts from its '
    'weights)'
  )


@pytest.mark.parametrize('spelling', ['trailing slash', 'relative', 'symlink'])
def test_the_same_data_spelled_otherwise_resumes(spelling, tmp_path, folder, monkeypatch, capsys):
  """The same dataset spelled with a trailing slash, a relative path or a symlink was refused
  on resume (`holds a run with dataset=... where this command has ...`)."""
  import shutil

  from conftest import tiny_run_config

  from vit_jax.training import loop

  data = shutil.copytree(folder, tmp_path / 'data')
  config = tiny_run_config(dataset=str(data))
  run = _handmade_run(tmp_path / 'run', config, step=24, dataset_record=_record(str(data), CLASSES))
  monkeypatch.chdir(tmp_path)
  os.symlink(data, tmp_path / 'link')
  config.dataset = {'trailing slash': f'{data}/', 'relative': 'data', 'symlink': 'link'}[spelling]
  capsys.readouterr()
  assert loop.train_and_evaluate(config, run) == {'step': 24, 'model': 'testing'}
  assert f'{run} has finished: step 24' in capsys.readouterr().out


def test_predict_on_a_workdir_says_nothing_of_its_training_folder(tmp_path, folder, capsys, caplog):
  """predict and export on a workdir printed the training folder's scan warnings
  (`WARNING:root:DATA/train: skipped 2 corrupt image(s) ...`) for an unrelated image: a run's
  record names its classes without a scan, and an older run's scan is silent."""
  import logging
  import shutil

  from vit_jax import predict
  from vit_jax.data.readers import folder as folder_reader

  data = shutil.copytree(folder, tmp_path / 'data')
  (data / 'train' / CLASSES[0] / 'broken.png').write_bytes(b'\x89PNG\r\n\x1a\nnot a png')
  (data / 'train' / 'notes.txt').write_text('left out')
  image = tmp_path / 'x.png'
  Image.fromarray(np.zeros((8, 8), np.uint8)).save(image)
  for name, record in (('old', None), ('recorded', _record(str(data), CLASSES))):
    folder_reader.warn_once.cache_clear()
    run = _workdir(tmp_path / name, str(data))
    if record:
      (tmp_path / name / 'dataset.json').write_text(json.dumps(record))
    caplog.clear()
    logging.getLogger().setLevel(logging.WARNING)
    argv = [f'--checkpoint={run}', '--top_k=1', str(image)]
    code, out, err = _run(predict.main, argv, capsys)
    assert code == 0 and err == '' and f'{CLASSES[1]}  (class 1)' in out, err
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [], name


@pytest.mark.skipif(
  not __import__('importlib').util.find_spec('libtpu'), reason='libtpu is not installed'
)
def test_the_python_api_leaves_out_a_tpu_that_is_not_there(tmp_path):
  """`train.train_and_evaluate` from Python printed libtpu's 5 lines (`E0000 ...
  INVALID_ARGUMENT`) on a machine without a TPU (the commands had hidden them)."""
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


def test_an_image_without_an_extension_is_an_image_to_training_as_to_predict(tmp_path, folder):
  """A PNG without an extension was 'not an image' to the folder scan, yet predicted when
  named."""
  import shutil

  from vit_jax.data.readers import folder as folder_reader

  data = shutil.copytree(folder, tmp_path / 'data')
  png = next((data / 'train' / CLASSES[0]).glob('*.png'))
  shutil.copy(png, data / 'train' / CLASSES[0] / 'IMG_0001')
  (data / 'train' / CLASSES[0] / 'README').write_text('not an image')
  found, _, others = folder_reader.images_under(str(data / 'train' / CLASSES[0]))
  assert 'IMG_0001' in found and others == ['README']
  config = data_config()
  config.update(dataset=str(data))
  assert pipeline.get_info(config).num_train == 3 * 12 + 1
  assert len(classify.image_files([str(data / 'train' / CLASSES[0])])) == 13


def _bomb_png(width=14_000, height=14_000) -> bytes:
  """A valid PNG of `width` x `height` black pixels (196 M: over PIL's limit), 200 kB on disk."""
  import struct
  import zlib

  chunk = lambda kind, data: (  # noqa: E731
    struct.pack('>I', len(data)) + kind + data + struct.pack('>I', zlib.crc32(kind + data))
  )
  packer, rows = zlib.compressobj(9), []
  for _ in range(height // 1000):
    rows.append(packer.compress(bytes((width + 1) * 1000)))
  header = struct.pack('>IIBBBBB', width, height, 8, 0, 0, 0, 0)
  png = b'\x89PNG\r\n\x1a\n' + chunk(b'IHDR', header)
  return png + chunk(b'IDAT', b''.join(rows) + packer.flush()) + chunk(b'IEND', b'')


def test_a_decompression_bomb_is_called_too_large_not_corrupt(tmp_path, inputs, capsys, caplog):
  """A decompression-bomb PNG was 'corrupt' to training, and predict's hint said 'pass a JPEG
  or PNG file' for a PNG."""
  import logging

  from vit_jax import predict

  root = _digit_pngs(tmp_path / 'bombed', (('train', 2), ('test', 1)))
  bomb = tmp_path / 'bombed' / 'train' / CLASSES[0] / 'bomb.png'
  bomb.write_bytes(_bomb_png())
  argv = [f'--checkpoint={inputs["npz"]}', '--model=testing', str(bomb)]
  code, _, err = _run(predict.main, argv, capsys)
  assert code == 2 and err == (
    f'error: {bomb}: an image too large to decode (196,000,000 pixels, more than the '
    '178,956,970 that PIL decodes (a decompression-bomb guard)); pass a smaller copy\n'
  )
  config = data_config()
  config.update(dataset=root)
  with caplog.at_level(logging.WARNING):
    assert pipeline.get_info(config).num_train == 6
  assert 'skipped 1 image(s) too large to decode of 7: ' in caplog.text
  assert 'corrupt' not in caplog.text


def test_few_shot_keys_name_a_folder_by_its_last_part(tmp_path, folder, inputs, capsys):
  """Few-shot metric keys embedded the dataset's absolute path (`fewshot//<abs path>/odd_1shot`)."""
  from vit_jax import fewshot

  argv = [f'--checkpoint={inputs["npz"]}', '--model=testing', f'--datasets={folder}/']
  code, out, err = _run(fewshot.main, argv + ['--shots=1', '--seeds=0', '--crop=32'], capsys)
  assert code == 0, err
  assert out.startswith(f'fewshot/{os.path.basename(folder)}_1shot '), out
  from vit_jax.evaluation.fewshot import metric_name

  assert metric_name('/a/odd', ['/a/odd', '/b/odd/']) == 'a/odd'
  assert metric_name('cifar10', ['cifar10', '/x/cifar10']) == 'cifar10'


def test_fields_a_run_recorded_that_this_version_does_not_read_are_said_and_kept(
  tmp_path, monkeypatch, capsys
):
  """A config.json with fields of another version was resumed and rewritten without them,
  silently."""
  from conftest import tiny_run_config

  from vit_jax.training import loop

  config = tiny_run_config()
  run = _handmade_run(tmp_path / 'run', config, step=4)
  recorded = json.loads((tmp_path / 'run' / 'config.json').read_text())
  recorded.update(old_field=7, pp={**recorded['pp'], 'old_crop': 3})
  (tmp_path / 'run' / 'config.json').write_text(json.dumps(recorded))

  class Stop(Exception):
    pass

  def stop(*args, **kwargs):
    raise Stop

  monkeypatch.setattr(loop, 'set_up', stop)
  capsys.readouterr()
  with pytest.raises(Stop):
    loop.train_and_evaluate(config, run)
  assert capsys.readouterr().out == (
    f'config.json of {run} records fields this version does not read (old_field, pp.old_crop): '
    'resumed without them, kept in the file\n'
  )
  kept = json.loads((tmp_path / 'run' / 'config.json').read_text())
  assert kept['old_field'] == 7 and kept['pp']['old_crop'] == 3


def test_a_naflex_runs_preprocessing_line_says_its_budgets():
  """A NaFlex run's preprocessing line described a square crop to pp.crop."""
  from conftest import tiny_run_config

  config = tiny_run_config(model='ViT-Demo_4', naflex_tokens=(4, 9, 16))
  line = pipeline.describe_preprocessing(config)
  assert line.startswith(
    'preprocessing: train inception crop (area 0.5-1) at its own aspect ratio, resized to a '
    'budget drawn from 4, 9, 16 tokens (NaFlex), no flip; eval resize to 16 px.'
  ), line


# ---------------------------------------------------------------------------
# Paths that are not text (item 1): file names in bytes of another encoding reach Python as
# surrogate escapes; they are printed as their bytes and written as UTF-8 text.


def test_a_file_name_in_any_encoding_prints_and_writes(folder):
  latin1 = os.fsdecode(os.path.join(os.fsencode(folder), b'train', 'zéro'.encode(), LATIN1_FILE))
  assert files.text(latin1).endswith('zéro/caf\ufffd latin-1.png')
  assert files.text('données') == 'données'
  for encoding, escaped in [('utf-8', str.encode), ('ascii', _escaped)]:
    raw = io.BytesIO()
    stream = io.TextIOWrapper(raw, encoding=encoding)
    stream.reconfigure(errors='vit_jax.text')
    print(latin1, CLASSES[1], file=stream)
    stream.flush()
    # The Latin-1 name as its own bytes; letters the stream cannot encode as escapes.
    expected = escaped(os.path.join(folder, 'train', 'zéro')) + b'/' + LATIN1_FILE
    assert raw.getvalue() == expected + b' ' + escaped(CLASSES[1]) + b'\n'


def _escaped(text):
  return text.encode('ascii', 'backslashreplace')


def test_a_decompression_bomb_in_a_training_folder_is_skipped(tmp_path, caplog):
  """Item 7: a huge image is left out like a corrupt one (ba6a7de: a traceback at set-up)."""
  import logging
  import struct
  import zlib

  root = _digit_pngs(tmp_path / 'bombed', (('train', 2), ('test', 1)))
  width = height = 14_000  # 196 M pixels, over PIL's limit; 200 kB on disk
  chunk = lambda kind, data: (  # noqa: E731
    struct.pack('>I', len(data)) + kind + data + struct.pack('>I', zlib.crc32(kind + data))
  )
  packer, rows = zlib.compressobj(9), []
  for _ in range(height // 1000):
    rows.append(packer.compress(bytes((width + 1) * 1000)))
  header = struct.pack('>IIBBBBB', width, height, 8, 0, 0, 0, 0)
  png = b'\x89PNG\r\n\x1a\n' + chunk(b'IHDR', header)
  png += chunk(b'IDAT', b''.join(rows) + packer.flush()) + chunk(b'IEND', b'')
  (tmp_path / 'bombed' / 'train' / CLASSES[0] / 'bomb.png').write_bytes(png)
  config = data_config()
  config.update(dataset=root, batch=3)
  config.pp.crop = SIZE
  with caplog.at_level(logging.WARNING):
    info = pipeline.get_info(config)
  assert info.num_train == 6 and 'bomb.png' in caplog.text


def test_host_memory_running_out_for_a_batch_is_one_line():
  """Item 7: a batch the host cannot hold (10^9 images of 4096 px: numpy refuses at once, so
  the test needs no memory), as the input pipeline allocates each batch."""
  from vit_jax.data import host

  with pytest.raises(DataError, match='^out of host memory for a batch of 1000000000 ') as e:
    host.batch_buffer((10**9, 4096, 4096, 3), np.float32)
  assert '\n' not in str(e.value)


# ---------------------------------------------------------------------------
# python -m vit_jax.main, as a user runs it: (arguments, files to write first, the one line).

LOOKUP_PATCHED = (
  'import runpy, sys; from vit_jax.core import files; '
  f'files._unreachable = lambda scheme: {OFFLINE!r} if scheme == "gs" else None; '
  'sys.argv[0] = "vit_jax.main"; runpy.run_module("vit_jax.main", run_name="__main__")'
)
_TYPO = 'from vit_jax.configs import demo\n\n\ndef get_config():\n  config = demo.get_config()\n'
MAIN_ERRORS = [
  # Item 4: as a flag would be (--config.total_step=4: "unknown config field 'total_step'").
  (
    ['--config={tmp}/typo.py'],
    {'typo.py': _TYPO + '  config.total_step = 4\n  return config\n'},
    "config file {tmp}/typo.py: unknown config field 'total_step' (no run reads it); did you "
    'mean total_steps?',
  ),
  (
    ['--config={tmp}/typo.py'],
    {'typo.py': _TYPO + '  config.pp.crops = 8\n  return config\n'},
    "config file {tmp}/typo.py: unknown config field 'pp.crops' (no run reads it); did you mean "
    'pp.crop?',
  ),
  # Item 7.
  (
    ['--config={tmp}/syntax.py'],
    {'syntax.py': 'def get_config(:\n'},
    'config file {tmp}/syntax.py, line 1: SyntaxError: invalid syntax: def get_config(:; fix',
  ),
  (
    ['--config={tmp}/config.yaml'],
    {'config.yaml': 'total_steps: 4\n'},
    'config file {tmp}/config.yaml is not a Python file',
  ),
  (
    ['--workdir={tmp}/file.txt'],
    {'file.txt': ''},
    "{tmp}/file.txt is a file: a workdir is a folder (made when missing) for the run's",
  ),
  # Item 3, through the command.
  (
    ['--config.dataset={tmp}/data'],
    {'data/train/circle/a.png': 'png', 'data/train/square/a.png': 'png'}
    | {'data/test/Circle/a.png': 'png', 'data/test/square/a.png': 'png'},
    "{tmp}/data: class folder 'Circle' is in test but not in train (is it 'circle' there?)",
  ),
  # Item 6: the fine-tuning recipe's default pretrained checkpoint, and a gs:// workdir.
  (
    ['--config=configs/finetune.py:testing,digits'],
    {},
    '--config.pretrained_path: gs://vit_models/imagenet21k/testing.npz: cannot reach '
    'storage.googleapis.com (Temporary failure in name resolution): no network here; copy the '
    'files to a local folder and pass that path instead (--config.pretrained_path=LOCAL_COPY.npz)',
  ),
  (
    ['--workdir=gs://bucket/run'],
    {},
    'gs://bucket/run/config.json: cannot reach storage.googleapis.com',
  ),
]


def _write(tmp_path, written):
  for name, text in written.items():
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    if text == 'png':
      Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(path)
    else:
      path.write_text(text)


def _main(tmp_path, argv, env=None, **kw):
  args = [a.format(tmp=tmp_path) for a in argv]
  if not any(a.startswith('--workdir') for a in args):
    args.append(f'--workdir={tmp_path}/run')
  return subprocess.run(
    [sys.executable, '-c', LOOKUP_PATCHED, *args],
    env=env or subprocess_env(),
    cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    capture_output=True,
    text=True,
    timeout=300,
    **kw,
  )


@pytest.mark.slow
def test_main_says_one_line_for_each_bad_input(tmp_path):
  def case(i):
    argv, written, _ = MAIN_ERRORS[i]
    _write(tmp_path / str(i), written)
    return _main(tmp_path / str(i), argv)

  # A process start each (most of the time): two at a time.
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    results = list(pool.map(case, range(len(MAIN_ERRORS))))
  for i, result in enumerate(results):
    lines = said(result.stderr)
    assert result.returncode == 2 and lines == [lines[-1]], result.stderr[-2000:]
    assert lines[-1].startswith('error: ' + MAIN_ERRORS[i][2].format(tmp=tmp_path / str(i)))
    assert not os.path.exists(tmp_path / str(i) / 'run' / 'lock.json')


# ---------------------------------------------------------------------------
# Item 1 and 5 end to end, in a C locale without UTF-8 mode (Python's file system encoding is
# ASCII there: every non-ASCII name is bytes): train on the folder into a workdir named in
# French, Ctrl-C (a checkpoint and one line), then predict, evaluate, fewshot and analyze the
# stopped run and convert the folder to shards, then resume to the end.

C_LOCALE = {'LC_ALL': 'C', 'LANG': 'C', 'PYTHONUTF8': '0', 'PYTHONCOERCECLOCALE': '0'}
TINY = [
  '--config.model=testing',
  f'--config.pp.crop={SIZE}',
  '--config.batch=12',
  '--config.batch_eval=12',
  '--config.total_steps=400',
  '--config.warmup_steps=2',
  '--config.progress_every=2',
  '--config.eval_every=1000',
  '--config.checkpoint_every=1000',
  '--config.tensorboard=True',
]
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


def _wait_for(predicate, process, timeout=300, check=True):
  deadline = time.time() + timeout
  while time.time() < deadline and not predicate():
    if check and process.poll() is not None:
      raise AssertionError(f'ended early: {process.communicate()[1][-3000:]}')
    time.sleep(0.002 if not check else 0.05)


@pytest.mark.slow
def test_a_folder_named_in_any_script_trains_stops_predicts_and_resumes(folder, tmp_path):
  env = subprocess_env(**C_LOCALE)
  run = str(tmp_path / 'exécution')
  command = [sys.executable, '-m', 'vit_jax.main', f'--config.dataset={folder}', f'--workdir={run}']
  process = subprocess.Popen(command + TINY, env=env, stderr=subprocess.PIPE, text=True)
  metrics = os.path.join(run, 'metrics.jsonl')
  _wait_for(lambda: os.path.exists(metrics) and os.path.getsize(metrics) > 0, process)
  process.send_signal(signal.SIGINT)
  stderr = process.communicate(timeout=300)[1]
  if process.returncode == 0:
    pytest.skip('the run finished before Ctrl-C arrived')  # a very fast machine
  lines = said(stderr)
  step = workdir_lib.saved_steps(run)
  # 130: what a shell reports for a process Ctrl-C ended (issue 35; it was 2).
  assert process.returncode == 130 and len(step) == 1 and lines == [lines[-1]], stderr[-3000:]
  assert lines[-1] == (
    f'error: interrupted (Ctrl-C) at step {step[0]}; checkpoint written to {run}; run the same '
    'command again to resume'
  )
  assert not os.path.exists(os.path.join(run, 'lock.json'))

  # The stopped run, through every command, in the same locale.
  (tmp_path / 'commands.py').write_text(COMMANDS)
  images = os.path.join(folder, 'train', CLASSES[0])
  result = subprocess.run(
    [sys.executable, tmp_path / 'commands.py', folder, images, run, str(tmp_path / 'analysé')],
    env=env,
    capture_output=True,
    timeout=300,
  )
  out = result.stdout.decode('utf-8', 'replace')
  assert 'Traceback' not in result.stderr.decode('utf-8', 'replace'), result.stderr[-3000:]
  for name in ('predict', 'evaluate', 'fewshot', 'analyze'):
    assert f'exit vit_jax.{name} 0' in out, (out, result.stderr[-3000:])
  assert os.fsencode(os.path.join(folder, 'train', 'zéro')) + b'/' + LATIN1_FILE in result.stdout

  finished = subprocess.run(command + TINY, env=env, capture_output=True, text=True, timeout=300)
  assert finished.returncode == 0, finished.stderr[-3000:]
  assert f'Resuming from the checkpoint at step {step[0]}' in finished.stdout
  assert json.load(open(os.path.join(run, 'summary.json')))['step'] == 400


def test_signals_ask_for_a_checkpoint_only_where_one_holds_something_new(tmp_path):
  """Item 5, the policy (`training.stopping.Stop`), signal by signal in this process: before the
  first step a signal stops at once (inside `held`, once the block is done); while stepping
  the first asks for a checkpoint at the next step and a second ends the process at once; a
  stop whose raise Python swallowed (a garbage collector callback) is raised again at the next
  check."""
  import threading

  from vit_jax.training import stopping

  if threading.current_thread() is not threading.main_thread():
    pytest.skip('signal handlers run in the main thread only')
  previous = signal.getsignal(signal.SIGINT)
  stop = stopping.Stop(str(tmp_path))
  try:
    # Inside `held` (taking the workdir's lock) a signal waits for the block's end.
    reached = []
    with pytest.raises(stopping.StopNow, match=r'^preempted \(SIGTERM\): stopped at once'):
      with stop.held():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.5)
        reached.append('the end of the block')
    assert reached == ['the end of the block']
    stop.now = ''
    with pytest.raises(
      stopping.StopNow, match=r'^preempted \(SIGTERM\): stopped at once, without a'
    ):
      os.kill(os.getpid(), signal.SIGTERM)
      time.sleep(5)
    with pytest.raises(stopping.StopNow, match=r'^preempted \(SIGTERM\): stopped at once'):
      stop.check()  # had the raise been lost
    stop.now = ''
    stop.stepping = True
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.1)
    assert stop.requested == signal.SIGINT and stop.pending and not stop.now
    assert stop.stopped_line(7).startswith('interrupted (Ctrl-C) at step 7; checkpoint written')
    exits = []  # the second signal ends the process (os._exit): here, it is only counted
    stop._exit_now = exits.append
    with pytest.raises(stopping.StopNow, match=r'^interrupted \(Ctrl-C\) again: stopped at once'):
      os.kill(os.getpid(), signal.SIGINT)
      time.sleep(5)
    assert exits == [stop.now]
    # Inside `held`, a second signal does not wait for the block either.
    stop.now, stop.stepping, stop.requested = '', False, None
    with pytest.raises(stopping.StopNow, match=r'^preempted \(SIGTERM\): stopped at once'):
      with stop.held():  # (the counting `_exit_now` returns, and the handler raises)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
    assert exits[1].startswith('preempted (SIGTERM) again: stopped at once, without a new')
  finally:
    stop.restore()
  assert signal.getsignal(signal.SIGINT) is previous


def test_a_signal_while_the_last_checkpoint_is_written_waits_for_it(tmp_path):
  """Item 5: Ctrl-C after the last step, as orbax writes the final checkpoint, used to cut the
  write short (a temporary folder left, orbax's traceback logged, the run's last steps lost);
  now the write ends, then the run stops in one line that names the checkpoint kept."""
  import threading
  import types

  from vit_jax.training import loop
  from vit_jax.training import stopping

  if threading.current_thread() is not threading.main_thread():
    pytest.skip('signal handlers run in the main thread only')

  class Manager:  # orbax's, as far as `train` uses it after the last step
    def wait_until_finished(self):
      os.kill(os.getpid(), signal.SIGINT)
      time.sleep(0.2)
      os.makedirs(tmp_path / 'checkpoints' / '30')
      written.append(30)

  written = []
  run = types.SimpleNamespace(
    workdir=str(tmp_path), manager=Manager(), config=types.SimpleNamespace(total_steps=30)
  )
  steps_done = types.SimpleNamespace(state=types.SimpleNamespace(step=30))
  stop = stopping.Stop(str(tmp_path))
  try:
    with pytest.raises(stopping.StopNow) as stopped:
      loop.train(run, steps_done, [], stop)
  finally:
    stop.restore()
  assert written == [30]
  assert str(stopped.value) == (
    'interrupted (Ctrl-C): stopped at once, without a new checkpoint (the checkpoint at step 30 '
    'is kept); run the same command again to resume'
  )


@pytest.mark.slow
def test_a_second_ctrl_c_or_a_signal_during_set_up_stops_at_once(tmp_path):
  """Item 5, as a user meets it: the second Ctrl-C does not wait for the checkpoint; SIGTERM
  while the run sets up (compiles) has nothing to save. Both: one line, the lock released."""
  command = [sys.executable, '-m', 'vit_jax.main', *TINY]
  cases = [
    ('second', signal.SIGINT, 'metrics.jsonl', 'interrupted (Ctrl-C) again'),
    ('set-up', signal.SIGTERM, 'lock.json', 'preempted (SIGTERM)'),
  ]

  def case(name, sig, wait_for):
    run = str(tmp_path / name)
    process = subprocess.Popen(
      [*command, f'--workdir={run}'], env=subprocess_env(), stderr=subprocess.PIPE, text=True
    )
    path = os.path.join(run, wait_for)
    _wait_for(lambda: os.path.exists(path) and os.path.getsize(path) > 0, process)
    process.send_signal(sig)
    if name == 'second':  # again once the checkpoint the first asked for is being written
      writing = lambda: any('tmp' in n for n in os.listdir(os.path.join(run, 'checkpoints')))  # noqa: E731
      _wait_for(lambda: writing() or process.poll() is not None, process, check=False)
      process.send_signal(sig)
    stderr = process.communicate(timeout=300)[1]
    return process.returncode, stderr, run

  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    results = list(pool.map(lambda c: case(*c[:3]), cases))
  for (code, stderr, run), (name, sig, _, what) in zip(results, cases):
    lines = said(stderr)
    if name == 'second' and 'interrupted (Ctrl-C) at step' in stderr:
      pytest.skip('the checkpoint was written before the second Ctrl-C')  # a very fast machine
    assert code == 128 + sig and lines == [lines[-1]], stderr[-3000:]
    assert lines[-1].startswith(f'error: {what}: stopped at once, without a new checkpoint (')
    assert lines[-1].endswith('); run the same command again to resume')
    assert not os.path.exists(os.path.join(run, 'lock.json'))


@pytest.mark.slow
def test_jft_converts_a_folder_named_in_any_script(folder, tmp_path):
  """Item 1: shards of the folder in a C locale, the Latin-1 file name included."""
  result = subprocess.run(
    [sys.executable, '-m', 'vit_jax.jft', f'--folder={folder}/train', f'--out={tmp_path}/é'],
    env=subprocess_env(**C_LOCALE),
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.startswith('wrote 36 examples of split train (3 classes) in 16 shards')
  info = json.loads((tmp_path / 'é' / 'info.json').read_text(encoding='utf-8'))
  assert info['class_names'] == CLASSES
