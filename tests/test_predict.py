"""Prediction CLI, class-name files, image reading, checkpoint -> model inference."""

import json
import os
import pathlib
import subprocess
import sys

from conftest import CLASSES
from conftest import command_error
from conftest import dataset_record
from conftest import run_command
from conftest import tiny_params
from conftest import tiny_workdir
import jax
import jax.numpy as jnp
import numpy as np
from PIL import Image
import pytest

from vit_jax import checkpoint
from vit_jax import models
from vit_jax import predict
from vit_jax.configs import architectures
from vit_jax.configs import model_spec
from vit_jax.evaluation import classify
from vit_jax.evaluation import loader

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_shipped_imagenet_names():
  names_1k = classify.class_names(1000)
  names_21k = classify.class_names(21843)
  assert len(names_1k) == 1000 and len(names_21k) == 21843
  assert all(n.strip() == n and n for n in names_1k + names_21k)
  # Well-known ImageNet-1k indices.
  assert names_1k[0] == 'tench, Tinca tinca'
  assert names_1k[1] == 'goldfish, Carassius auratus'
  assert names_1k[207] == 'golden retriever'
  assert names_1k[281] == 'tabby, tabby cat'
  assert names_1k[999] == 'toilet tissue, toilet paper, bathroom tissue'
  assert names_21k[0] == 'organism, being'
  assert classify.class_names(3) == ['class_0', 'class_1', 'class_2']


def test_names_follow_the_sorted_wordnet_ids_of_independent_sources():
  """Order = sorted WordNet ids, as TFDS imagenet2012 and timm's i21k synsets."""
  timm_info = os.path.join(os.path.dirname(pytest.importorskip('timm').__file__), 'data', '_info')
  tfds = pytest.importorskip('tensorflow_datasets')
  read = lambda *parts: pathlib.Path(*parts).read_text(encoding='utf-8')  # noqa: E731
  lemma = dict(
    line.split('\t') for line in read(timm_info, 'imagenet_synset_to_lemma.txt').splitlines()
  )
  tfds_1k = read(os.path.dirname(tfds.__file__), 'datasets', 'imagenet2012', 'labels.txt').split()
  ids_21k = read(timm_info, 'imagenet21k_goog_synsets.txt').split()
  assert tfds_1k == sorted(tfds_1k) and ids_21k == sorted(ids_21k) and len(set(ids_21k)) == 21843
  assert classify.class_names(1000) == [lemma[i] for i in tfds_1k]
  assert classify.class_names(21843) == [lemma[i] for i in ids_21k]


def test_labels_file(tmp_path):
  path = tmp_path / 'labels.txt'
  path.write_text('cat\ndog\n\n')
  assert classify.class_names(2, str(path)) == ['cat', 'dog']
  with pytest.raises(loader.InputError, match='2 names for a head of 3 classes'):
    classify.class_names(3, str(path))


def test_read_image_scales_to_minus_one_one_and_resizes(tmp_path):
  path = tmp_path / 'solid.png'
  Image.fromarray(np.full((10, 30, 3), [255, 0, 51], np.uint8)).save(path)
  image = classify.read_image(str(path), 16)
  assert image.shape == (16, 16, 3) and image.dtype == np.float32
  np.testing.assert_allclose(image[3, 7], [1.0, -1.0, 51 / 127.5 - 1], rtol=1e-6)
  grey = tmp_path / 'grey.png'
  Image.fromarray(np.full((8, 8), 255, np.uint8), mode='L').save(grey)
  np.testing.assert_allclose(classify.read_image(str(grey), 4), np.ones((4, 4, 3)))


def test_unreadable_image_is_a_one_line_error(tmp_path):
  bad = tmp_path / 'broken.jpg'
  bad.write_bytes(b'\xff\xd8 not really a jpeg')
  with pytest.raises(loader.InputError, match='broken.jpg: not a readable image') as e:
    classify.read_image(str(bad), 8)
  assert '\n' not in str(e.value)
  with pytest.raises(loader.InputError, match='no such image file'):
    classify.image_files([str(tmp_path / 'missing.png')])


def test_image_files_expands_directories_and_commas(tmp_path):
  for name in ('b.png', 'a.JPG', 'notes.txt'):
    (tmp_path / name).write_bytes(b'')
  one = str(tmp_path / 'b.png')
  assert classify.image_files([str(tmp_path), f'{one},{one}']) == [
    str(tmp_path / 'a.JPG'),
    one,
    one,
    one,
  ]


@pytest.mark.parametrize(
  'name,stride',
  [
    ('R50+ViT-B_16', 16),
    ('R26+ViT-B_32', 32),
    ('R50+ViT-L_32', 32),
    ('R+ViT-Ti_16', 32),  # the ResNet root alone (/4), then 8x8 patches
    ('ViT-B_8', 8),
  ],
)
def test_the_stride_is_the_token_stride(name, stride):
  config = architectures.MODEL_CONFIGS[name]
  assert model_spec.Architecture.of(config).stride == stride
  model = models.VisionTransformer(num_classes=None, **config)
  shapes = jax.eval_shape(
    lambda: model.init(jax.random.key(0), jnp.zeros((1, 128, 128, 3)), train=False)
  )['params']
  assert (
    shapes['Transformer']['posembed_input']['pos_embedding'].shape[1] == 1 + (128 // stride) ** 2
  )


def write_checkpoint(path, num_classes, size=48, favourites=(), config_name='testing', **kw):
  """A random model whose head prefers `favourites`, in that order, for any image."""
  config = architectures.MODEL_CONFIGS[config_name]
  config.update(kw)
  model = models.VisionTransformer(num_classes=num_classes, **config)
  shapes = jax.eval_shape(
    lambda: model.init(jax.random.key(0), jnp.zeros((1, size, size, 3)), train=False)
  )['params']
  rng = np.random.default_rng(0)
  params = jax.tree.map(lambda s: rng.normal(0, 0.02, s.shape).astype(np.float32), shapes)
  params['head']['kernel'] = np.zeros_like(params['head']['kernel'])
  bias = np.zeros(num_classes, np.float32)
  for rank, index in enumerate(favourites):
    bias[index] = 20.0 - rank
  params['head']['bias'] = bias
  return checkpoint.save_npz(params, path)


def solid_png(path, colour=(10, 200, 30), size=(20, 24)):
  Image.fromarray(np.full((*size, 3), colour, np.uint8)).save(path)
  return str(path)


def test_load_model_reads_classes_and_resolution(tmp_path):
  path = write_checkpoint(tmp_path / 'c.npz', 7, size=48, representation_size=8)
  loaded = loader.load_model(path, 'testing')
  assert loaded.model.num_classes == 7 and loaded.spec.architecture.representation_size == 8
  assert (loaded.spec.image_size, loaded.spec.grid, loaded.spec.stride) == (48, 3, 16)
  with pytest.raises(
    checkpoint.CheckpointError,
    match=r'encoder_norm/bias has shape \(10,\), the model expects \(192,\)',
  ):
    loader.load_model(path, 'ViT-Ti_16')
  with pytest.raises(checkpoint.CheckpointError, match='not 0 class token.* check --model'):
    loader.load_model(path, 'ViT-Ti_16-gap')
  with pytest.raises(loader.InputError, match="unknown model 'ViT-Q_16'"):
    loader.load_model(path, 'ViT-Q_16')


def test_predict_prints_imagenet_names(tmp_path, capsys):
  path = write_checkpoint(tmp_path / 'in1k.npz', 1000, favourites=(207, 281, 0, 1, 999, 5))
  image = solid_png(tmp_path / 'x.png')
  assert predict.main([f'--checkpoint={path}', '--model=testing', image]) == 0
  lines = capsys.readouterr().out.splitlines()
  assert lines[0] == image
  assert len(lines) == 6
  assert lines[1].endswith('golden retriever  (class 207)') and lines[1].startswith('  1.')
  assert 'tabby, tabby cat  (class 281)' in lines[2]
  assert 'tench, Tinca tinca' in lines[3]
  assert lines[5].endswith('toilet tissue, toilet paper, bathroom tissue  (class 999)')
  assert float(lines[1].split()[1].rstrip('%')) == pytest.approx(
    100 / (1 + np.exp(-1) + np.exp(-2) + np.exp(-3) + np.exp(-4) + np.exp(-5) + 994 * np.exp(-20)),
    abs=0.01,
  )


def test_predict_21k_names_and_custom_labels(tmp_path, capsys):
  path = write_checkpoint(tmp_path / 'in21k.npz', 21843, size=32, favourites=(12345,))
  image = solid_png(tmp_path / 'x.png')
  assert predict.main([f'--checkpoint={path}', '--model=testing', '--top_k=1', image]) == 0
  expected = classify.class_names(21843)[12345]
  assert capsys.readouterr().out.splitlines()[1].endswith(f'{expected}  (class 12345)')

  path = write_checkpoint(tmp_path / 'three.npz', 3, favourites=(2,))
  labels = tmp_path / 'labels.txt'
  labels.write_text('red\ngreen\nblue\n')
  assert (
    predict.main([f'--checkpoint={path}', '--model=testing', f'--labels={labels}', image, image])
    == 0
  )
  out = capsys.readouterr().out.splitlines()
  assert len(out) == 2 * 4 and out[1].endswith('blue  (class 2)') and 'class_' not in out[2]


@pytest.mark.slow
def test_cli_errors_are_one_line_without_traceback(tmp_path):
  path = write_checkpoint(tmp_path / 'c.npz', 10)
  image = solid_png(tmp_path / 'x.png')
  broken = tmp_path / 'broken.png'
  broken.write_bytes(b'garbage')
  cases = [
    ([f'--checkpoint={tmp_path / "nope.npz"}', '--model=testing', image], 'no such checkpoint'),
    ([f'--checkpoint={path}', '--model=ViT-B_16', image], 'the model expects (768,)'),
    ([f'--checkpoint={path}', '--model=testing', str(broken)], 'not a readable image'),
  ]
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS='cpu')
  for args, message in cases:
    run = subprocess.run(
      [sys.executable, '-m', 'vit_jax.predict', *args],
      capture_output=True,
      text=True,
      env=env,
      cwd=tmp_path,
      timeout=120,
    )
    assert run.returncode == 2, run.stderr
    assert 'Traceback' not in run.stderr
    errors = [line for line in run.stderr.splitlines() if 'error:' in line]
    assert len(errors) == 1 and message in errors[0], run.stderr


def test_commands_read_the_model_from_a_workdir_and_predict_skips_bad_images(tmp_path, capsys):
  from vit_jax import analyze
  from vit_jax import evaluate
  from vit_jax import export
  from vit_jax import fewshot

  workdir = tmp_path / 'run'
  workdir.mkdir()
  write_checkpoint(workdir / 'params.npz', 10, size=32, favourites=(3,))
  (workdir / 'summary.json').write_text(json.dumps({'model': 'testing', 'dataset': 'digits'}))
  folder = tmp_path / 'images'
  folder.mkdir()
  good = [solid_png(folder / 'a.png'), solid_png(folder / 'c.png')]
  (folder / 'b.png').write_bytes(b'not a png')

  assert predict.main([f'--checkpoint={workdir}', str(folder)]) == 1
  out, err = capsys.readouterr()
  assert [line for line in out.splitlines() if not line.startswith(' ')] == good
  firsts = [line for line in out.splitlines() if line.startswith('  1. ')]
  assert len(firsts) == 2 and all(line.endswith('(class 3)') for line in firsts)  # its favourite
  assert 'b.png: not a readable image' in err
  assert '1 of 3 image(s) unreadable, 2 predicted' in err and 'Traceback' not in err

  # No --model for the other commands either: summary.json names it.
  assert evaluate.main([f'--checkpoint={workdir}', '--dataset=digits', '--batch=120']) == 0
  assert json.loads(capsys.readouterr().out)['examples'] == 359
  args = [f'--checkpoint={workdir}', '--datasets=digits', '--shots=2', '--seeds=0']
  assert fewshot.main(args + ['--batch=120', f'--workdir={tmp_path / "fs"}']) == 0
  assert 'digits_2shot' in capsys.readouterr().out
  assert analyze.main([f'--checkpoint={workdir}', '--images=digits', f'--output={tmp_path}']) == 0
  assert (
    export.main([f'--checkpoint={workdir}', '--format=npz', f'--output={tmp_path / "x.npz"}']) == 0
  )
  assert (
    checkpoint.flatten(checkpoint.load(tmp_path / 'x.npz')).keys()
    == checkpoint.flatten(checkpoint.load(workdir)).keys()
  )
  # A bare .npz does not say which model it holds.
  err = command_error(predict.main, [f'--checkpoint={workdir / "params.npz"}', good[0]], capsys)
  assert 'pass --model' in err


# ---------------------------------------------------------------------------
# Class names: a run's own, and why they fall back to class_<i>; stopped workdirs.


def test_predict_says_why_classes_are_class_i(tmp_path, digit_folder, capsys):
  """Names that fall back to class_<i> say why, and what to do."""
  import shutil

  from vit_jax import predict

  npz = checkpoint.save_npz(tiny_params(3), tmp_path / 'bare.npz')
  moved = shutil.copytree(digit_folder, tmp_path / 'data')
  run = tiny_workdir(tmp_path / 'run', str(moved))
  shutil.rmtree(moved)  # the dataset the run trained on, gone
  image = os.path.join(digit_folder, 'test', CLASSES[0])
  line = 'python -m vit_jax.predict: classes named class_<i>: '
  code, out, err = run_command(
    predict.main, [f'--checkpoint={npz}', '--model=testing', image], capsys
  )
  assert code == 0 and '(class 1)' in out and 'class_1' in out, err
  assert (
    err
    == line
    + 'a 3-way head, not an ImageNet one (1000 or 21843); pass --labels=FILE, one name per line\n'
  )
  code, out, err = run_command(predict.main, [f'--checkpoint={run}', image], capsys)
  assert code == 0 and err.startswith(
    f'{line}its dataset {moved} does not open here ({moved}: no such folder'
  ), err
  assert err.endswith('; pass --labels=FILE, one name per line\n') and err.count('\n') == 1


def test_a_class_name_with_a_newline_is_one_line_of_predict(tmp_path, capsys):
  """A class folder whose name holds a newline keeps predict's lines one per class: control
  characters are shown as escapes."""
  from vit_jax import predict

  root = tmp_path / 'data'
  for split in ('train', 'test'):
    for name in ('a', 'b\nc.png', 'd'):
      (root / split / name).mkdir(parents=True)
      Image.fromarray(np.zeros((8, 8), np.uint8)).save(root / split / name / 'x.png')
  run = tiny_workdir(tmp_path / 'run', str(root), favourite=1)
  code, out, err = run_command(
    predict.main, [f'--checkpoint={run}', str(root / 'test' / 'a')], capsys
  )
  assert code == 0, err
  assert out.splitlines() == [
    str(root / 'test' / 'a' / 'x.png'),
    '  1. 100.00%  b\\nc.png  (class 1)',
    '  2.   0.00%  a  (class 0)',
    '  3.   0.00%  d  (class 2)',
  ]


def test_predict_names_a_folder_trained_workdirs_classes(digit_folder, tmp_path, capsys):
  """A workdir trained on a folder gives the class folders' names, not class_0, class_1, ..."""
  from vit_jax import predict

  run = tiny_workdir(tmp_path / 'run', digit_folder, favourite=1)
  code, out, err = run_command(
    predict.main, [f'--checkpoint={run}', f'{digit_folder}/test/{CLASSES[0]}'], capsys
  )
  assert code == 0, err
  assert out.count(f'  1. 100.00%  {CLASSES[1]}  (class 1)') == 4, out


def test_an_unfinished_workdir_is_read_from_its_checkpoint(digit_folder, tmp_path, capsys):
  """A preempted run has no params.npz; its newest checkpoint is read, and said so."""
  from vit_jax import evaluate
  from vit_jax import predict

  run = tiny_workdir(tmp_path / 'stopped', digit_folder, finished=False, favourite=2)
  code, out, err = run_command(
    predict.main, [f'--checkpoint={run}', f'{digit_folder}/test/{CLASSES[0]}'], capsys
  )
  assert code == 0, err
  assert (
    f'{run} has no params.npz (its run has not finished): using its checkpoint at step 5' in err
  )
  assert out.count(f'  1. 100.00%  {CLASSES[2]}  (class 2)') == 4, out
  code, out, err = run_command(
    evaluate.main, [f'--checkpoint={run}', f'--dataset={digit_folder}'], capsys
  )
  assert code == 0 and json.loads(out)['top1'] == pytest.approx(1 / 3), err


def test_a_1000_class_head_gets_its_runs_names_never_imagenets(tmp_path, capsys):
  """A 1000-class head trained on a folder that is gone gets the run's own class names (its
  dataset.json) from predict and export's id2label, never ImageNet-1k's; without a record,
  class_<i> and why; a bare file is ImageNet's."""
  from vit_jax import export
  from vit_jax import predict

  names = [f'k{i:04d}' for i in range(1000)]
  image = tmp_path / 'x.png'
  Image.fromarray(np.zeros((8, 8), np.uint8)).save(image)
  gone = str(tmp_path / 'gone')
  recorded = tiny_workdir(tmp_path / 'recorded', gone, favourite=487, num_classes=1000)
  (tmp_path / 'recorded' / 'dataset.json').write_text(json.dumps(dataset_record(gone, names)))
  old = tiny_workdir(tmp_path / 'old', gone, favourite=487, num_classes=1000)
  bare = checkpoint.save_npz(tiny_params(1000, 487), tmp_path / 'bare.npz')
  code, out, err = run_command(
    predict.main, [f'--checkpoint={recorded}', '--top_k=1', str(image)], capsys
  )
  assert code == 0 and out.splitlines()[1] == '  1. 100.00%  k0487  (class 487)' and not err, err
  code, out, err = run_command(
    predict.main, [f'--checkpoint={old}', '--top_k=1', str(image)], capsys
  )
  assert code == 0 and out.splitlines()[1] == '  1. 100.00%  class_487  (class 487)', out
  assert err.startswith(
    f'python -m vit_jax.predict: classes named class_<i>: its dataset {gone} does not open here'
  ), err
  argv = [f'--checkpoint={bare}', '--model=testing', '--top_k=1', str(image)]
  code, out, err = run_command(predict.main, argv, capsys)
  assert out.splitlines()[1].startswith('  1. 100.00%  cellular telephone, cellular phone'), out
  for run, label in ((recorded, 'k0487'), (old, 'LABEL_487')):
    argv = [f'--checkpoint={run}', '--format=hf', f'--output={tmp_path}/hf_{label}']
    code, out, err = run_command(export.main, argv, capsys)
    assert code == 0, err
    hf = json.loads((tmp_path / f'hf_{label}' / 'config.json').read_text())
    assert hf['id2label']['487'] == label


def test_predict_on_a_workdir_says_nothing_of_its_training_folder(
  tmp_path, digit_folder, capsys, caplog
):
  """predict on a workdir says nothing of the training folder (no `DATA/train: skipped 2 corrupt
  image(s) ...` for an unrelated image): a run's record names its classes without a scan, and an
  older run's scan is silent."""
  import logging
  import shutil

  from vit_jax import predict
  from vit_jax.data.readers import folder as folder_reader

  data = shutil.copytree(digit_folder, tmp_path / 'data')
  (data / 'train' / CLASSES[0] / 'broken.png').write_bytes(b'\x89PNG\r\n\x1a\nnot a png')
  (data / 'train' / 'notes.txt').write_text('left out')
  image = tmp_path / 'x.png'
  Image.fromarray(np.zeros((8, 8), np.uint8)).save(image)
  for name, record in (('old', None), ('recorded', dataset_record(str(data), CLASSES))):
    folder_reader.warn_once.cache_clear()
    run = tiny_workdir(tmp_path / name, str(data))
    if record:
      (tmp_path / name / 'dataset.json').write_text(json.dumps(record))
    caplog.clear()
    logging.getLogger().setLevel(logging.WARNING)
    argv = [f'--checkpoint={run}', '--top_k=1', str(image)]
    code, out, err = run_command(predict.main, argv, capsys)
    assert code == 0 and err == '' and f'{CLASSES[1]}  (class 1)' in out, err
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [], name
