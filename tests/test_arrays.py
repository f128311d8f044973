"""NumPy arrays as a dataset: .npz, a folder of .npy, arrays in Python; the same batches as
the same pixels read from image files; one-line errors for what a user may hand over."""

import os
import subprocess
import sys

from conftest import data_config
from conftest import subprocess_env
import numpy as np
from PIL import Image
import pytest

from vit_jax.data import datasets
from vit_jax.data import pipeline
from vit_jax.data.readers import arrays
from vit_jax.data.readers import builtin
from vit_jax.data.sources import DataError


@pytest.fixture(scope='module')
def photos():
  """24 crops of scikit-learn's photos at 40 x 52 px, labels 0, 1, 2 in turn."""
  from sklearn.datasets import load_sample_images

  rng = np.random.default_rng(0)
  out = []
  for i in range(24):
    photo = load_sample_images().images[i % 2]
    y, x = rng.integers(0, 427 - 160), rng.integers(0, 640 - 208)
    out.append(photo[y : y + 160 : 4, x : x + 208 : 4])
  return np.stack(out), np.arange(24) % 3


def _batches(dataset, steps=2, **overrides):
  config = data_config(dataset, **{'batch': 8, 'batch_eval': 8, 'pp.crop': 24, **overrides})
  it = pipeline.make_train_iterator(config, None, raw=True)
  train = [next(it) for _ in range(steps)]
  return train, list(pipeline.make_eval_iterator(config, None, split='train', raw=True))


def _assert_same(a, b):
  for x, y in zip(a, b):
    assert sorted(x) == sorted(y)
    for key in x:
      np.testing.assert_array_equal(x[key], y[key], err_msg=key)


def test_an_npz_a_npy_folder_registered_arrays_and_png_files_give_the_same_batches(
  photos, tmp_path
):
  """Same source, same order, same crops and flips: arrays go through the pipeline as image
  files do (a PNG decodes to its exact pixels; a JPEG's would differ)."""
  x, y = photos
  npz = str(tmp_path / 'photos.npz')
  np.savez(npz, x_train=x, y_train=y)
  folder = tmp_path / 'npy'
  folder.mkdir()
  np.save(folder / 'x_train.npy', x)
  np.save(folder / 'y_train.npy', y[:, None])  # Keras's CIFAR labels are [N, 1]
  name = datasets.register_arrays('photos_in_memory', x_train=x, y_train=y)
  pngs = tmp_path / 'pngs'
  for i, (image, label) in enumerate(zip(x, y)):  # the folder's order: class, then file name
    (pngs / 'train' / f'c{label}').mkdir(parents=True, exist_ok=True)
    Image.fromarray(image).save(pngs / 'train' / f'c{label}' / f'{i:02d}.png')
  order = np.lexsort((np.arange(24), y))
  np.savez(str(tmp_path / 'sorted.npz'), x_train=x[order], y_train=y[order])
  # RandAugment on top: the same per-image code after the crop.
  extra = {'pp.randaug_layers': 1, 'input_threads': 2}
  want_train, want_eval = _batches(npz, **extra)
  assert want_train[0]['image'].dtype == np.uint8 and want_train[0]['image'].shape == (8, 24, 24, 3)
  for dataset in (str(folder), name):
    got_train, got_eval = _batches(dataset, **extra)
    _assert_same(got_train, want_train)
    _assert_same(got_eval, want_eval)
  _assert_same(_batches(str(pngs), **extra)[0], _batches(str(tmp_path / 'sorted.npz'), **extra)[0])
  info = pipeline.get_info(data_config(npz, **{'pp.test': 'train[:4]'}))
  assert (info.num_classes, info.num_train, info.class_names) == (3, 24, ['0', '1', '2'])


def test_grey_arrays_are_the_rgb_ones_and_threads_change_nothing(tmp_path):
  pixels, labels = builtin.load_digits()  # grey replicated to RGB
  grey = str(tmp_path / 'grey.npz')
  np.savez(grey, x_train=pixels[:300, ..., 0], y_train=labels[:300])
  rgb = str(tmp_path / 'rgb.npz')
  np.savez(rgb, x_train=pixels[:300], y_train=labels[:300], x_test=pixels[300:310],
           y_test=labels[300:310], class_names=list('abcdefghij'))  # fmt: skip
  one = _batches(grey, steps=3, input_threads=1, **{'pp.mixup': 0.2, 'batch': 128})
  three = _batches(rgb, steps=3, input_threads=3, **{'pp.mixup': 0.2, 'batch': 128})
  _assert_same(one[0], three[0])  # past the epoch boundary (300 / 128)
  _assert_same(one[1], three[1])
  assert pipeline.get_info(data_config(rgb)).class_names == list('abcdefghij')


def test_split_slices_resume_and_the_other_splits(tmp_path):
  pixels, labels = builtin.load_digits()
  path = str(tmp_path / 'd.npz')
  np.savez(path, x_train=pixels[:100], y_train=labels[:100], x_val=pixels[100:130],
           y_val=labels[100:130])  # fmt: skip
  config = data_config(path, **{'batch': 16, 'pp.crop': 16, 'pp.train': 'train[:80%]',
                               'pp.test': 'val'})  # fmt: skip
  info = pipeline.get_info(config)
  assert (info.num_train, info.num_test) == (80, 30)
  it = pipeline.make_train_iterator(config, None)
  for _ in range(6):  # past the epoch boundary (80 / 16 = 5)
    next(it)
  state = it.get_state()
  expected = next(it)
  again = next(pipeline.make_train_iterator(config, None, state=state))
  np.testing.assert_array_equal(again['image'], expected['image'])
  assert set(np.asarray(again['label'])) <= set(labels[:80])
  with pytest.raises(DataError, match=r"no split 'test' \(has train, val\)"):
    pipeline.get_info(data_config(path))


# What a user may hand over, and the one line that comes back.
_DIGITS = builtin.load_digits()
_X, _Y = _DIGITS[0][:20], _DIGITS[1][:20]
BAD = [
  ({'x_train': _X.astype(np.float32) / 255, 'y_train': _Y},
   'x_train: images of dtype float32; give uint8 pixels 0..255 (floats in [0, 1]: '
   'np.round(x * 255).astype(np.uint8))'),
  ({'x_train': _X.transpose(0, 3, 1, 2), 'y_train': _Y},
   'x_train: images of shape (20, 3, 8, 8) have their channels first; give [N, H, W, C] '
   '(x.transpose(0, 2, 3, 1))'),
  ({'x_train': np.concatenate([_X, _X[..., :1]], -1), 'y_train': _Y},
   'x_train: images of shape (20, 8, 8, 4); give uint8 [N, H, W, 3] (RGB), [N, H, W, 1] or '
   '[N, H, W] (grey) (RGBA: x[..., :3])'),
  ({'x_train': _X[0], 'y_train': _Y},
   'x_train has 8 images but y_train 20 labels; give each image one label'),
  ({'x_train': _X, 'y_train': _Y[:19]},
   'x_train has 20 images but y_train 19 labels; give each image one label'),
  ({'x_train': _X, 'y_train': _Y.astype(np.float32)},
   'y_train: labels of dtype float32; give integer class ids (y.astype(np.int64) if they are '
   'whole numbers)'),
  ({'x_train': _X, 'y_train': np.eye(10, dtype=np.int64)[_Y]},
   'y_train: labels of shape (20, 10); give integer class ids [N] (one-hot labels: y.argmax(1))'),
  ({'x_train': _X, 'y_train': _Y - 1}, 'y_train: a label -1 < 0; labels are class ids 0..K-1'),
  ({'x_train': _X, 'y_train': np.zeros(20, int)},
   'every label is 0; classification needs at least two classes'),
  ({'x_train': _X, 'y_train': _Y, 'class_names': ['a', 'b']},
   'a label 9 but 2 class_names; give a name per class'),
  ({'x_train': _X}, 'x_train without y_train; save one label per image'),
  ({'images': _X, 'labels': _Y},
   'no x_<split> arrays (has images, labels); save x_<split> uint8 [N, H, W, 3] and y_<split> '
   'int [N], as keras.datasets gives them'),
  ({'x_train': np.array([_X[0], _X[1, :4]], dtype=object), 'y_train': _Y[:2]},
   'x_train: an object array (Python objects, e.g. a list of differently sized images), which '
   'is not loaded (allow_pickle=False)'),
]  # fmt: skip


@pytest.mark.parametrize('arrays_, line', BAD, ids=[f'{i}' for i in range(len(BAD))])
def test_what_is_wrong_with_an_npz_is_one_line(arrays_, line, tmp_path):
  path = str(tmp_path / 'bad.npz')
  np.savez(path, **arrays_)
  with pytest.raises(DataError) as e:
    pipeline.get_info(data_config(path))
  assert str(e.value) == f'{path}: {line}' or str(e.value).startswith(f'{path}: {line}')
  if 'object array' in line:
    return  # np.asarray of such arrays is what register_arrays refuses below
  with pytest.raises(DataError) as e:
    datasets.register_arrays('handed_over', **arrays_)
  assert str(e.value).startswith(f'handed_over: {line.split(";")[0]}')


def test_files_and_names_that_are_not_arrays_are_one_line(tmp_path):
  (tmp_path / 'text.npz').write_text('not a zip')
  with pytest.raises(DataError, match=r'text\.npz: not a readable \.npz archive \('):
    pipeline.get_info(data_config(str(tmp_path / 'text.npz')))
  with pytest.raises(DataError, match=r'missing\.npz: no such file; pass an existing'):
    pipeline.get_info(data_config(str(tmp_path / 'missing.npz')))
  with pytest.raises(DataError, match='names a dataset or a path already'):
    datasets.register_arrays('digits', x_train=_X, y_train=_Y)
  with pytest.raises(DataError, match='not a NumPy array of pixels'):
    datasets.register_arrays('lists', x_train=_X.tolist(), y_train=_Y)
  with pytest.raises(DataError, match="unknown array 'labels'"):
    datasets.register_arrays('typo', x_train=_X, y_train=_Y, labels=_Y)


def test_a_bad_npz_is_one_line_from_the_command_line(tmp_path):
  path = tmp_path / 'floats.npz'
  np.savez(path, x_train=_X.astype(np.float64), y_train=_Y, x_test=_X, y_test=_Y)
  result = subprocess.run(
    [sys.executable, '-m', 'vit_jax.main', f'--workdir={tmp_path / "w"}',
     f'--config.dataset={path}', '--config.model=testing'],
    env=subprocess_env(), capture_output=True, text=True, timeout=300,
  )  # fmt: skip
  assert result.returncode == 2, result.stderr[-3000:]
  assert result.stderr.strip().splitlines()[-1] == (
    f'error: {path}: x_train: images of dtype float64; give uint8 pixels 0..255 (floats in '
    '[0, 1]: np.round(x * 255).astype(np.uint8))'
  )


def test_npy_files_are_memory_mapped_and_an_npz_read_once(tmp_path):
  np.save(tmp_path / 'x_train.npy', _X)
  np.save(tmp_path / 'y_train.npy', _Y)
  data = arrays.load(str(tmp_path))
  assert isinstance(data['splits']['train'][0](), np.memmap)
  path = str(tmp_path / 'd.npz')
  np.savez(path, x_train=_X, y_train=_Y)
  data = arrays.load(path)
  assert data['splits']['train'][0]() is data['splits']['train'][0]()  # one copy in memory
  assert os.path.getsize(path) > _X.nbytes
