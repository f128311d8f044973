"""Image folders and JFT-style shards: formats, labels, corrupt files, bad input."""

import json
import logging
import os
import re

from conftest import CLASSES
from conftest import batch_sharding
from conftest import data_config
from conftest import run_command
import numpy as np
from PIL import Image
import pytest

from vit_jax import jft
from vit_jax.core import cli
from vit_jax.data import example_proto
from vit_jax.data import pipeline
from vit_jax.data import records
from vit_jax.data.readers import shards
from vit_jax.data.sources import DataError

# Class colours: after any crop/flip/resize an image keeps its colour.
_COLOURS = {'cat': (200, 30, 30), 'dog': (30, 200, 30), 'eel': (30, 30, 200)}
_FORMATS = [
  ('jpg', 'RGB'),
  ('png', 'L'),
  ('png', 'RGBA'),
  ('bmp', 'RGB'),
  ('gif', 'RGB'),
  ('JPEG', 'RGB'),
]


def _image(colour, mode, rng, size=(40, 30)):
  pixels = np.clip(np.array(colour) + rng.integers(-10, 10, size[::-1] + (3,)), 0, 255)
  image = Image.fromarray(pixels.astype(np.uint8), 'RGB')
  if mode == 'L':
    return image.convert('L')
  if mode == 'RGBA':
    image = image.convert('RGBA')
    image.putalpha(128)
  return image


def make_folder(root, splits=(('train', 6), ('test', 4)), seed=0):
  rng = np.random.default_rng(seed)
  for split, per_class in splits:
    for name, colour in _COLOURS.items():
      os.makedirs(os.path.join(root, split, name))
      for i in range(per_class):
        ext, mode = _FORMATS[i % len(_FORMATS)]
        _image(colour, mode, rng).save(os.path.join(root, split, name, f'{i}.{ext}'))
  return root


def _corrupt(root):
  """A truncated JPEG and a non-image with an image name."""
  good = os.path.join(root, 'train', 'dog', '0.jpg')
  data = open(good, 'rb').read()
  with open(os.path.join(root, 'train', 'dog', 'truncated.jpg'), 'wb') as f:
    f.write(data[: len(data) // 2])
  with open(os.path.join(root, 'train', 'cat', 'garbage.png'), 'wb') as f:
    f.write(b'this is not a png' * 10)


def _config(dataset, **pp):
  pp = {f'pp.{k}': v for k, v in pp.items()}
  return data_config(dataset, **{'batch': 6, 'batch_eval': 5, 'pp.crop': 8, **pp})


def _colour_class(images):
  """Class index from the dominant channel of each image in [-1, 1]."""
  return np.argmax(np.asarray(images).mean(axis=(1, 2)), axis=-1)


def test_folder_formats_labels_and_exact_eval(tmp_path):
  root = make_folder(tmp_path / 'pets')
  config = _config(root)
  info = pipeline.get_info(config)
  assert (info.num_train, info.num_test, info.num_classes) == (18, 12, 3)
  assert info.class_names == ['cat', 'dog', 'eel']
  it = pipeline.make_train_iterator(config, batch_sharding())
  for _ in range(4):
    batch = next(it)
    assert batch['image'].shape == (6, 8, 8, 3)
    # Every format decodes to RGB of its class colour (grey PNGs: equal channels).
    rgb = np.asarray(batch['image'])
    grey = np.ptp(rgb.mean(axis=(1, 2)), axis=-1) < 0.05
    np.testing.assert_array_equal(_colour_class(rgb)[~grey], np.asarray(batch['label'])[~grey])
  batches = list(pipeline.make_eval_iterator(config, batch_sharding()))
  mask = np.concatenate([b['mask'] for b in batches])
  labels = np.concatenate([b['label'] for b in batches])
  assert len(mask) == 15 and mask.sum() == 12
  np.testing.assert_array_equal(labels[:12], [0] * 4 + [1] * 4 + [2] * 4)


def _as_users_have_it(root):
  """A folder as tools leave it: notebook checkpoints, macOS archive metadata, a git
  folder, dot-files and a note beside the images; WebP and TIFF images, and JPEGs in a
  sub-folder of their class folder; the colour of each image says its class."""
  rng = np.random.default_rng(0)
  for split in ('train', 'test'):
    for name, colour in list(_COLOURS.items())[:2]:
      folder = root / split / name
      (folder / 'phone').mkdir(parents=True)
      for file, fmt in (('a.png', 'PNG'), ('b.webp', 'WEBP'), ('c.tiff', 'TIFF')):
        _image(colour, 'RGB', rng).save(folder / file, format=fmt, lossless=True)
      _image(colour, 'RGB', rng).save(folder / 'phone' / 'd.jpg', quality=95)
      (folder / '.ipynb_checkpoints').mkdir()
      _image(_COLOURS['eel'], 'RGB', rng).save(folder / '.ipynb_checkpoints' / 'a-checkpoint.png')
      (folder / '.DS_Store').write_bytes(b'\0\0\0\1Bud1')
      (folder / 'notes.txt').write_text('taken on 2026-11-26')
    (root / split / '.git' / 'objects').mkdir(parents=True)
    (root / split / '.ipynb_checkpoints').mkdir()
  (root / '__MACOSX' / 'train' / 'cat').mkdir(parents=True)
  (root / '__MACOSX' / 'train' / 'cat' / '._a.png').write_bytes(b'\0\5\x16\7')
  return root


def test_a_folder_as_users_have_it(tmp_path, caplog, capsys):
  """Tools' folders are neither splits, classes nor images (and said, once per split); WebP and TIFF
  train as predict reads them (one list of endings, from `decode`); images in a class folder's
  sub-folders are that class's; `predict DIR` finds the images in the class folders; `evaluate` on a
  folder with only test/ works."""
  from conftest import param_shapes
  from conftest import random_like

  from vit_jax import checkpoint
  from vit_jax import evaluate
  from vit_jax.configs import architectures
  from vit_jax.data import images
  from vit_jax.evaluation import classify

  assert {'.jpg', '.jpeg', '.png', '.webp', '.tif', '.tiff', '.bmp', '.gif'} <= set(
    images.extensions()
  )
  root = _as_users_have_it(tmp_path / 'photos')
  config = _config(root)
  with caplog.at_level(logging.WARNING):
    info = pipeline.get_info(config)
    batches = list(pipeline.make_eval_iterator(config, batch_sharding()))
  assert (info.num_train, info.num_test, info.class_names) == (8, 8, ['cat', 'dog'])
  images_ = np.concatenate([b['image'] for b in batches])[:8]
  np.testing.assert_array_equal(_colour_class(images_), [0] * 4 + [1] * 4)
  said = [r.getMessage() for r in caplog.records]
  assert (
    said.count(
      f"{root}: left out tools' folders and files (__MACOSX); images are JPEG, PNG, WebP, TIFF, BMP, GIF or another format PIL reads"
    )
    == 1
  )
  for split in ('train', 'test'):
    assert (
      said.count(
        f"{root}/{split}: left out tools' folders and files (.git, .ipynb_checkpoints, "
        'cat/.DS_Store, cat/.ipynb_checkpoints, dog/.DS_Store, ... (6 in all)) and files that '
        'are not images (cat/notes.txt, dog/notes.txt); images are JPEG, PNG, WebP, TIFF, BMP, '
        'GIF or another format PIL reads'
      )
      == 1
    ), said
  assert len(said) == 3, said

  examples, names = shards.examples_from_folder(str(root / 'train'))
  assert names == ['cat', 'dog'] and [l for _, l in examples] == [[0]] * 4 + [[1]] * 4
  assert [os.path.relpath(p, root) for p, _ in examples][:4] == [
    'train/cat/a.png',
    'train/cat/b.webp',
    'train/cat/c.tiff',
    'train/cat/phone/d.jpg',
  ]
  assert len(classify.image_files([str(root)])) == 16

  # evaluate on a copy that has only the test split.
  import shutil

  shutil.copytree(root / 'test', tmp_path / 'test only' / 'test')
  npz = tmp_path / 'testing.npz'
  shapes = param_shapes(architectures.MODEL_CONFIGS['testing'], 2, 16)
  checkpoint.save_npz(random_like(shapes, scale=0.02), npz)
  capsys.readouterr()
  argv = [f'--checkpoint={npz}', '--model=testing', f'--dataset={tmp_path / "test only"}']
  code = evaluate.main(argv)
  assert code == 0 and json.loads(capsys.readouterr().out)['examples'] == 8


def test_symlinked_sub_folders_of_a_class_folder_are_read_as_real_ones(tmp_path):
  """A class folder's images at any depth, through symlinked sub-folders too (a shared
  folder of images linked in), as through a real sub-folder and a symlinked class folder;
  a link back up the tree is read once, not in a loop. Training, predict and the shards
  converter list the same images."""
  from vit_jax.data.readers import folder
  from vit_jax.evaluation import classify

  rng = np.random.default_rng(0)
  shared = tmp_path / 'shared'
  for name in ('cat', 'dog'):
    (shared / name).mkdir(parents=True)
    for i in range(3):
      _image(_COLOURS[name], 'RGB', rng).save(shared / name / f's{i}.png')
  root = tmp_path / 'data'
  for name in ('cat', 'dog'):
    (root / 'train' / name / 'real').mkdir(parents=True)
    _image(_COLOURS[name], 'RGB', rng).save(root / 'train' / name / 'a.png')
    _image(_COLOURS[name], 'RGB', rng).save(root / 'train' / name / 'real' / 'b.png')
    os.symlink(shared / name, root / 'train' / name / 'linked')
    os.symlink(root / 'train' / name, root / 'train' / name / 'real' / 'loop')
  paths, labels = folder.labelled_images(str(root / 'train'), ['cat', 'dog'])
  relative = [os.path.relpath(p, root / 'train') for p in paths]
  want = [f'{n}/{f}' for n in ('cat', 'dog') for f in ('a.png', *(f'linked/s{i}.png' for i in range(3)), 'real/b.png')]  # fmt: skip
  assert relative == want and labels == [0] * 5 + [1] * 5
  assert len(classify.image_files([str(root)])) == 10
  examples, _ = shards.examples_from_folder(str(root / 'train'))
  assert len(examples) == 10


def test_rgba_and_grey_become_rgb_like_pil(tmp_path):
  root = make_folder(tmp_path / 'f', splits=(('train', 3), ('test', 3)))
  config = _config(root, crop=40)  # no resize: 40x30 -> 40x40 only stretches rows
  batches = list(pipeline.make_eval_iterator(config, batch_sharding()))
  images = np.round((np.concatenate([b['image'] for b in batches]) + 1) * 127.5)
  tf = pytest.importorskip('tensorflow')

  for k in (1, 2):  # the grey PNG and the RGBA PNG (lossless, unlike the JPEG)
    name = os.path.join(root, 'test', 'cat', f'{k}.png')
    rgb = np.asarray(Image.open(name).convert('RGB'))
    expected = tf.round(tf.image.resize(rgb, [40, 40])).numpy()
    np.testing.assert_array_equal(images[k], expected)


def test_corrupt_files_are_skipped_counted_and_named(tmp_path, caplog):
  root = make_folder(tmp_path / 'c')
  _corrupt(root)
  with caplog.at_level(logging.WARNING):
    info = pipeline.get_info(_config(root))
  assert info.num_train == 18  # 20 files, 2 left out
  assert 'skipped 2 corrupt image(s) of 20' in caplog.text
  assert 'truncated.jpg' in caplog.text and 'garbage.png' in caplog.text
  batch = next(pipeline.make_train_iterator(_config(root), batch_sharding()))
  assert batch['image'].shape == (6, 8, 8, 3)


def test_corrupt_files_fail_when_asked(tmp_path):
  root = make_folder(tmp_path / 'c')
  _corrupt(root)
  config = _config(root)
  config.corrupt_images = 'fail'
  with pytest.raises(DataError, match=r'garbage\.png: corrupt or truncated') as e:
    pipeline.get_info(config)
  assert '\n' not in str(e.value)


def test_folder_errors_name_the_folder(tmp_path):
  root = make_folder(tmp_path / 'e')
  os.makedirs(root / 'train' / 'fox')
  with pytest.raises(DataError, match=r'train/fox: empty class folder'):
    pipeline.get_info(_config(root))
  os.rmdir(root / 'train' / 'fox')
  with pytest.raises(DataError, match=r"no split folder 'val' \(has test, train\)"):
    pipeline.get_info(_config(root, test='val'))
  with pytest.raises(DataError, match='no such folder'):
    pipeline.get_info(_config(tmp_path / 'missing'))


def test_a_class_folder_in_only_one_split_is_refused_unless_allowed(tmp_path):
  root = make_folder(tmp_path / 'typo')
  os.rename(root / 'test' / 'cat', root / 'test' / 'Cat')  # a typo in one split
  with pytest.raises(DataError) as e:
    pipeline.get_info(_config(root))
  assert str(e.value) == (
    f"{root}: class folder 'Cat' is in test but not in train (is it 'cat' there?); give every "
    'split the same class folders, or set --config.allow_missing_classes=True'
  )
  config = _config(root)
  config.allow_missing_classes = True
  info = pipeline.get_info(config)  # asked for: four classes, one of them without train images
  assert info.num_classes == 4 and info.class_names == ['Cat', 'cat', 'dog', 'eel']


def test_a_single_class_folder_is_refused(tmp_path):
  root = tmp_path / 'one'
  for split in ('train', 'test'):
    os.makedirs(root / split / 'cat')
    _image(_COLOURS['cat'], 'RGB', np.random.default_rng(0)).save(root / split / 'cat' / '0.png')
  with pytest.raises(DataError, match='only one class folder .cat.; .* at least two') as e:
    pipeline.get_info(_config(root))
  assert '\n' not in str(e.value)


def _sized_folder(root, size):
  rng = np.random.default_rng(0)
  for name in ('a', 'b'):
    for split in ('train', 'test'):
      os.makedirs(root / split / name)
      for i in range(3):
        _image(_COLOURS['cat'], 'RGB', rng, size).save(root / split / name / f'{i}.png')
  return root


def test_small_images_get_gentle_crops_and_the_run_says_so(tmp_path):
  # Digits-sized images: crops keep at least half the image; photo-sized ones
  # keep ImageNet's augmentation (paper B.1.1). Both are flipped unless asked.
  small = _config(_sized_folder(tmp_path / 'small', (8, 8)))
  text = pipeline.Preprocessing.of(small).describe()
  assert text.startswith(
    'preprocessing: train inception crop (area 0.5-1) to 8 px, horizontal flip;'
  )
  assert 'dataset defaults (small images: shorter side 8 px < 64)' in text
  large = _config(_sized_folder(tmp_path / 'large', (96, 80)))
  text = pipeline.Preprocessing.of(large).describe()
  assert 'inception crop (area 0.05-1)' in text and 'horizontal flip' in text
  assert "dataset defaults (the paper's, B.1.1)" in text
  chosen = _config(tmp_path / 'small', flip=False)
  text = pipeline.Preprocessing.of(chosen).describe()
  assert 'no flip' in text and 'set: flip' in text
  assert '--config.pp.flip' in text and 'docs/data.md' in text


# ---------------------------------------------------------------------------
# JFT-style shards.


@pytest.mark.parametrize('file_format', ['tfrecord', 'array_record'])
def test_shards_from_folder_round_trip(tmp_path, file_format):
  root = make_folder(tmp_path / 'src')
  out = tmp_path / 'shards'
  for split in ('train', 'test'):
    jft.main(
      [
        '--folder',
        str(root / split),
        '--out',
        str(out),
        '--split',
        split,
        '--shards',
        '3',
        '--format',
        file_format,
      ]
    )
  info = json.load(open(out / 'info.json'))
  assert info['class_names'] == ['cat', 'dog', 'eel'] and info['file_format'] == file_format
  assert [f['num_examples'] for f in info['splits']['train']] == [6, 6, 6]
  config = _config(out)
  data_info = pipeline.get_info(config)
  assert data_info.multi_label and (data_info.num_train, data_info.num_test) == (18, 12)
  batch = next(pipeline.make_train_iterator(config, batch_sharding()))
  label = np.asarray(batch['label'])
  assert label.shape == (6, 3) and np.all(label.sum(1) == 1)  # multi-hot of one class
  rgb = np.asarray(batch['image'])
  grey = np.ptp(rgb.mean(axis=(1, 2)), axis=-1) < 0.05
  np.testing.assert_array_equal(_colour_class(rgb)[~grey], label.argmax(1)[~grey])
  seen = np.concatenate([b['label'] for b in pipeline.make_eval_iterator(config, batch_sharding())])
  assert seen[:12].sum(0).tolist() == [4, 4, 4]


def test_shards_from_csv_keep_every_label(tmp_path):
  root = make_folder(tmp_path / 'src', splits=(('train', 2),))
  files = sorted((root / 'train').glob('*/*'))
  lines = [f'{f.relative_to(tmp_path)},{i % 5};{(i * 3) % 7}' for i, f in enumerate(files)]
  (tmp_path / 'labels.csv').write_text('\n'.join(lines) + '\n')
  out = tmp_path / 'shards'
  jft.main(
    [
      '--csv',
      str(tmp_path / 'labels.csv'),
      '--out',
      str(out),
      '--num_classes',
      '7',
      '--shards',
      '2',
    ]
  )
  source = shards.open_split(str(out), 'train')
  items, labels = source.fetch(np.arange(source.num_examples))
  by_image = {f.read_bytes(): str(f.relative_to(tmp_path)) for f in files}
  got = {by_image[item]: np.flatnonzero(label).tolist() for item, label in zip(items, labels)}
  want = {str(f.relative_to(tmp_path)): sorted({i % 5, (i * 3) % 7}) for i, f in enumerate(files)}
  assert got == want


def test_truncated_shard_is_named(tmp_path):
  root = make_folder(tmp_path / 'src', splits=(('train', 4),))
  out = tmp_path / 'shards'
  jft.main(['--folder', str(root / 'train'), '--out', str(out), '--shards', '2'])
  shard = out / 'train-00001-of-00002.tfrecord'
  data = shard.read_bytes()
  shard.write_bytes(data[: len(data) - 100])
  config = _config(out, train='train[6:]')  # only the second shard
  with pytest.raises(DataError, match='train-00001-of-00002.tfrecord: truncated'):
    next(pipeline.make_train_iterator(config, batch_sharding()))


def test_bad_csv_line_is_named(tmp_path, capsys):
  (tmp_path / 'bad.csv').write_text('a.jpg,1;2\nb.jpg,cat\n')
  with pytest.raises(SystemExit) as exit_info:
    jft.main(['--csv', str(tmp_path / 'bad.csv'), '--out', str(tmp_path / 'o')])
  assert exit_info.value.code == cli.EXIT_ERROR
  assert re.match(r'error: .*bad.csv:2: expected "path,label_id', capsys.readouterr().err)


def test_shards_keep_names_in_any_encoding(tmp_path):
  """A file named in Latin-1 bytes (not UTF-8: surrogate escapes in Python), a class named so
  and a CSV in UTF-8: the record's image/id is the file's exact bytes, info.json gives the
  class name back unchanged, the CSV's paths are the files'."""
  root = os.fsencode(tmp_path)
  latin1, utf8 = root + b'/caf\xe9.png', root + '/été.png'.encode()
  for path in (latin1, utf8):
    Image.new('RGB', (8, 8), (200, 10, 10)).save(path, format='PNG')
  (tmp_path / 'labels.csv').write_bytes(b'caf\xe9.png,0\n' + 'été.png,1\n'.encode())
  examples = shards.examples_from_csv(str(tmp_path / 'labels.csv'))
  assert [os.fsencode(path) for path, _ in examples] == [latin1, utf8]
  names = [os.fsdecode(b'caf\xe9'), 'été']
  shards.write_shards(examples, str(tmp_path / 'out'), 'train', num_classes=2, class_names=names)
  assert json.load(open(tmp_path / 'out' / 'info.json'))['class_names'] == names
  (name,) = [f['file'] for f in json.load(open(tmp_path / 'out' / 'info.json'))['splits']['train']]
  reader = records.open_records([(str(tmp_path / 'out' / name), 0, 2)], 'tfrecord')
  ids = {bytes(example_proto.parse(r)['image/id'][0]) for r in reader.read([0, 1])}
  assert ids == {latin1, utf8}


# ---------------------------------------------------------------------------
# jft's result line.


def test_jft_prints_its_result_on_stdout(digit_folder, tmp_path, capsys):
  """The result is a line on stdout; class names in info.json are the folders' names as text."""
  from vit_jax import jft

  argv = [f'--folder={digit_folder}/test', f'--out={tmp_path}/shards', '--shards=2']
  code, out, err = run_command(jft.main, argv, capsys)
  assert code == 0 and err == '', err
  assert out == (
    f'wrote 12 examples of split train (3 classes) in 2 shards to {tmp_path}/shards; '
    '0 corrupt images skipped\n'
  )
  info = json.loads((tmp_path / 'shards' / 'info.json').read_text(encoding='utf-8'))
  assert info['class_names'] == CLASSES
