"""Image files as users have them: every mode PIL opens reaches the model as the same pixels in
evaluation, predict and analyze (one decoding function, `vit_jax.data.images`); a file's stored
pixels, EXIF orientation not applied (as TensorFlow and the official pipeline); an image
without an extension is an image; a decompression bomb is too large, not corrupt."""

import io
import os

from conftest import CLASSES
from conftest import TESTING_SIZE
from conftest import batch_sharding
from conftest import digit_pngs
from conftest import run_command
import numpy as np
from PIL import Image
import pytest

from vit_jax.configs.data import data_config
from vit_jax.data import images
from vit_jax.data import on_device
from vit_jax.data import pipeline
from vit_jax.evaluation import classify


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
  config.pp.crop = TESTING_SIZE
  batches = list(pipeline.make_eval_iterator(config, batch_sharding(), split='test', raw=True))
  evaluated = [np.asarray(b['image'])[np.asarray(b['mask']).astype(bool)] for b in batches]
  return root, np.concatenate(evaluated)


@pytest.mark.parametrize('name', MODES)
def test_every_image_mode_gives_the_evaluation_pixels_in_predict_and_analyze(name, mode_folder):
  from vit_jax import analyze

  root, evaluated = mode_folder
  path = root / 'test' / 'a' / name
  pixels = classify.read_pixels(path, TESTING_SIZE)
  same = [e for e in evaluated if np.array_equal(pixels, e)]
  assert same, name
  # The floats: the host's scaling, within its stated bound of the device's.
  analysed = analyze._readable([path], TESTING_SIZE, [])[1][0]
  np.testing.assert_array_equal(analysed, classify.read_image(path, TESTING_SIZE))
  assert (
    np.abs(analysed - np.asarray(on_device.normalise(same[0]))).max() <= on_device.MAX_DIFFERENCE
  )


def test_a_16_bit_digit_is_the_8_bit_digit_and_exif_is_not_applied(mode_folder):
  root = mode_folder[0] / 'test' / 'a'
  # 16-bit samples keep their high byte: the same pixels as the 8-bit file (not clipped to two
  # grey levels).
  np.testing.assert_array_equal(
    classify.read_image(root / 'grey 16-bit.png', TESTING_SIZE),
    classify.read_image(root / 'grey 8-bit.png', TESTING_SIZE),
  )
  rotated = (root / 'exif rotated.jpg').read_bytes()
  stored = images.decode(rotated)  # the stored pixels, 24 wide and 20 high
  assert stored.shape == (20, 24, 3)
  np.testing.assert_array_equal(
    classify.read_image(root / 'exif rotated.jpg', TESTING_SIZE),
    images.to_float(images.eval_array(stored, TESTING_SIZE)),
  )


def test_an_image_without_an_extension_is_an_image_to_training_as_to_predict(
  tmp_path, digit_folder
):
  """A PNG without an extension is an image to the folder scan, as to predict when named."""
  import shutil

  from vit_jax.data.readers import folder as folder_reader

  data = shutil.copytree(digit_folder, tmp_path / 'data')
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


def test_a_decompression_bomb_is_called_too_large_not_corrupt(tmp_path, user_files, capsys, caplog):
  """A decompression-bomb PNG is too large to decode, not corrupt: to training and to predict,
  whose line asks for a smaller copy."""
  import logging

  from vit_jax import predict

  root = digit_pngs(tmp_path / 'bombed', (('train', 2), ('test', 1)))
  bomb = tmp_path / 'bombed' / 'train' / CLASSES[0] / 'bomb.png'
  bomb.write_bytes(_bomb_png())
  argv = [f'--checkpoint={user_files["npz"]}', '--model=testing', str(bomb)]
  code, _, err = run_command(predict.main, argv, capsys)
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


def test_a_decompression_bomb_in_a_training_folder_is_skipped(tmp_path, caplog):
  """A huge image in a training folder is left out like a corrupt one, and named."""
  import logging

  root = digit_pngs(tmp_path / 'bombed', (('train', 2), ('test', 1)))
  (tmp_path / 'bombed' / 'train' / CLASSES[0] / 'bomb.png').write_bytes(_bomb_png())
  config = data_config()
  config.update(dataset=root, batch=3)
  config.pp.crop = TESTING_SIZE
  with caplog.at_level(logging.WARNING):
    info = pipeline.get_info(config)
  assert info.num_train == 6 and 'bomb.png' in caplog.text
