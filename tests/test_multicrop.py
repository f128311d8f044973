"""DINOv2's multi-crop input on the host against its reference: torchvision's transforms as
DINOv2's `DataAugmentationDINO` composes them (crop boxes by a KS statistic, pixels exactly or
within one level), DINOv2's and lightly's block masks (masked fractions by a KS statistic),
and batches that are a pure function of (seed, step)."""

import math

import numpy as np
import pytest

from vit_jax.data import multicrop
from vit_jax.data import order
from vit_jax.data import sources

scipy_stats = pytest.importorskip('scipy.stats')
torch = pytest.importorskip('torch')
transforms = pytest.importorskip('torchvision.transforms')
functional = pytest.importorskip('torchvision.transforms.functional')
Image = pytest.importorskip('PIL.Image')

# KS critical value at alpha = 0.001 for two samples of n: 1.95 * sqrt(2 / n).
N_DRAWS = 3000
KS_CRITICAL = 1.95 * math.sqrt(2 / N_DRAWS)


def _photo(seed=0, height=72, width=96):
  """An RGB image with structure (gradients and noise) for the pixel comparisons."""
  rng = np.random.default_rng(seed)
  y, x = np.mgrid[:height, :width]
  base = np.stack([x * 255 / width, y * 255 / height, (x + y) * 127 / (width + height)], -1)
  return np.clip(base + rng.normal(0, 30, base.shape), 0, 255).astype(np.uint8)


@pytest.mark.parametrize('scale', [(0.32, 1.0), (0.05, 0.32)])
def test_crop_boxes_follow_torchvisions_distribution(scale):
  height, width = 300, 200
  torch.manual_seed(0)
  img = Image.new('RGB', (width, height))
  ref = [transforms.RandomResizedCrop.get_params(img, scale, list(multicrop.RATIO))]
  ref += [transforms.RandomResizedCrop.get_params(img, scale, list(multicrop.RATIO))
          for _ in range(N_DRAWS - 1)]  # fmt: skip
  rng = np.random.default_rng(0)
  ours = [multicrop.crop_window(rng, height, width, scale) for _ in range(N_DRAWS)]
  for what in (lambda b: b[2] * b[3] / (height * width), lambda b: b[3] / b[2]):
    statistic = scipy_stats.ks_2samp([what(b) for b in ours], [what(b) for b in ref]).statistic
    assert statistic < KS_CRITICAL, statistic
  for top, left, h, w in ours:
    assert 0 <= top <= height - h and 0 <= left <= width - w


def test_crop_pixels_equal_torchvisions_resized_crop():
  image = _photo()
  pil = Image.fromarray(image)
  window = (5, 11, 40, 52)
  none = multicrop.Photometric()
  got = multicrop.crop(pil, window, 24, False, none)
  want = functional.resized_crop(pil, *window, [24, 24], transforms.InterpolationMode.BICUBIC)
  np.testing.assert_array_equal(got, np.asarray(want))
  flipped = multicrop.crop(pil, window, 24, True, none)
  np.testing.assert_array_equal(flipped, np.asarray(functional.hflip(want)))


def test_colour_jitter_grey_solarise_equal_torchvisions():
  # A positive hue turn: torchvision 0.15 under NumPy 2 refuses negative ones (np.uint8 of a
  # negative float); ours wraps them as it did under NumPy 1.
  hue = 0.07
  pil = Image.fromarray(_photo(1))
  factors = (1.3, 0.7, 1.15, hue)
  p = multicrop.Photometric(jitter_order=(2, 0, 3, 1), factors=factors, grey=True, solarise=True)
  got = multicrop.apply_photometric(pil, p)
  want = functional.adjust_saturation(pil, factors[2])
  want = functional.adjust_brightness(want, factors[0])
  want = functional.adjust_hue(want, factors[3])
  want = functional.adjust_contrast(want, factors[1])
  want = functional.rgb_to_grayscale(want, num_output_channels=3)
  want = functional.solarize(want, multicrop.SOLARISE_THRESHOLD)
  np.testing.assert_array_equal(got, np.asarray(want))


def test_blur_within_one_level_of_torchvisions():
  pil = Image.fromarray(_photo(2))
  got = multicrop.apply_photometric(pil, multicrop.Photometric(blur_sigma=1.3))
  want = np.asarray(functional.gaussian_blur(pil, [9, 9], [1.3, 1.3]))
  diff = np.abs(got.astype(int) - want.astype(int))
  assert diff.max() <= 1 and diff.mean() < 0.01, (diff.max(), diff.mean())


def test_probabilities_are_those_dinov2s_code_applies():
  """The reference's own objects: its jitter, grey, blur and solarisation probabilities per
  crop (its blur passes 1 - p to RandomApply: what it applies is read, not what it says)."""
  augmentations = pytest.importorskip('dinov2.data.augmentations')
  ref = augmentations.DataAugmentationDINO((0.32, 1.0), (0.05, 0.32), 8, 224, 98)

  def applied(compose):
    found = {'jitter': 0.0, 'grey': 0.0, 'blur': 0.0, 'solarise': 0.0}
    stack = list(compose.transforms)
    while stack:
      t = stack.pop(0)
      if isinstance(t, transforms.Compose):
        stack = list(t.transforms) + stack
      elif isinstance(t, transforms.RandomApply):
        inner = t.transforms[0]
        key = 'blur' if isinstance(inner, transforms.GaussianBlur) else 'jitter'
        found[key] = t.p
        if key == 'blur':
          assert tuple(inner.sigma) == multicrop.BLUR_SIGMA
          assert tuple(inner.kernel_size) == (multicrop.BLUR_KERNEL,) * 2
        else:
          assert (inner.brightness[1] - 1, inner.contrast[1] - 1, inner.saturation[1] - 1,
                  inner.hue[1]) == pytest.approx(multicrop.JITTER)  # fmt: skip
      elif isinstance(t, transforms.RandomGrayscale):
        found['grey'] = t.p
      elif isinstance(t, transforms.RandomSolarize):
        found['solarise'] = t.p
        assert t.threshold == multicrop.SOLARISE_THRESHOLD
    return found

  for compose, (blur, solarise) in (
    (ref.global_transfo1, multicrop.GLOBAL_1),
    (ref.global_transfo2, multicrop.GLOBAL_2),
    (ref.local_transfo, multicrop.LOCAL),
  ):
    found = applied(compose)
    assert found == pytest.approx(
      {
        'jitter': multicrop.JITTER_PROBABILITY,
        'grey': multicrop.GREY_PROBABILITY,
        'blur': blur,
        'solarise': solarise,
      }
    )
  # And our draws take them: frequencies within 4 standard deviations.
  rng = np.random.default_rng(0)
  draws = [multicrop.draw_photometric(rng, *multicrop.GLOBAL_2) for _ in range(N_DRAWS)]
  for rate, p in (
    (np.mean([bool(d.jitter_order) for d in draws]), multicrop.JITTER_PROBABILITY),
    (np.mean([d.grey for d in draws]), multicrop.GREY_PROBABILITY),
    (np.mean([d.blur_sigma > 0 for d in draws]), multicrop.GLOBAL_2[0]),
    (np.mean([d.solarise for d in draws]), multicrop.GLOBAL_2[1]),
  ):
    assert abs(rate - p) < 4 * math.sqrt(p * (1 - p) / N_DRAWS) + 1e-9, (rate, p)


def _ours_fractions(grid, counts, seed=0):
  rng = np.random.default_rng(seed)
  return [multicrop.block_mask(rng, grid, c, 0.5 * grid * grid).mean() for c in counts]


def test_block_masks_follow_dinov2s_and_lightlys_distributions():
  masking = pytest.importorskip('dinov2.data.masking')
  lightly_utils = pytest.importorskip('lightly.models.utils')
  import random

  grid = 16
  rng = np.random.default_rng(1)
  counts = [int(grid * grid * rng.uniform(0.1, 0.5)) for _ in range(N_DRAWS // 3)]
  random.seed(0)
  generator = masking.MaskingGenerator((grid, grid), max_num_patches=0.5 * grid * grid)
  dinov2_fractions = [generator(c).mean() for c in counts]
  torch.manual_seed(0)
  lightly_fractions = [
    lightly_utils.random_block_mask_image((grid, grid), c).float().mean().item() for c in counts
  ]
  ours = _ours_fractions(grid, counts)
  critical = 1.95 * math.sqrt(2 / len(counts))
  for reference in (dinov2_fractions, lightly_fractions):
    statistic = scipy_stats.ks_2samp(ours, reference).statistic
    assert statistic < critical, statistic
  # Never more than asked; rectangles of at least 4 patches fill most of the target.
  assert all(f * grid * grid <= c for f, c in zip(ours, counts))
  assert np.mean(ours) > 0.8 * np.mean(counts) / grid**2


def _settings(**overrides):
  base = dict(
    global_size=16,
    local_size=8,
    num_local=3,
    global_scale=(0.32, 1.0),
    local_scale=(0.05, 0.32),
    flip=True,
    patch_size=4,
    mask_probability=0.5,
    mask_ratio=(0.1, 0.5),
  )
  return multicrop.Settings(**{**base, **overrides})


def test_crop_masks_masked_fraction_and_probability():
  settings = _settings(global_size=64)  # a 16x16 grid
  rng = np.random.default_rng(2)
  masks = np.stack([multicrop.crop_mask(rng, settings) for _ in range(N_DRAWS)])
  masked = masks.any(axis=1)
  assert abs(masked.mean() - 0.5) < 4 * math.sqrt(0.25 / N_DRAWS)
  assert masks.sum(axis=1).max() <= settings.mask_slots == 128


def _source(n=40):
  rng = np.random.default_rng(3)
  pixels = rng.integers(0, 256, (n, 12, 10, 3), dtype=np.uint8)
  return sources.array_source('toy', pixels, np.arange(n) % 4, 4)


def _batches(step, *, process_index=0, process_count=1, threads=1, batch=8):
  keys = order.keys(7)
  it = multicrop.TrainBatches(
    _source(),
    _settings(),
    local_batch=batch // process_count,
    start_step=step,
    keys=keys,
    process_index=process_index,
    process_count=process_count,
    num_threads=threads,
  )
  return next(it)


def test_batches_are_a_function_of_seed_and_step():
  one = _batches(3)
  assert one['global'].shape == (8, 2, 16, 16, 3) and one['global'].dtype == np.uint8
  assert one['local'].shape == (8, 3, 8, 8, 3)
  assert one['masks'].shape == (8, 2, 16) and one['masks'].dtype == bool
  threaded = _batches(3, threads=3)
  halves = [_batches(3, process_index=p, process_count=2) for p in range(2)]
  for key in ('global', 'local', 'masks', 'label'):
    np.testing.assert_array_equal(one[key], threaded[key])
    np.testing.assert_array_equal(one[key], np.concatenate([h[key] for h in halves]))
  assert not np.array_equal(one['global'], _batches(4)['global'])
  # The two global crops of an image differ (their own boxes and colours).
  assert not np.array_equal(one['global'][:, 0], one['global'][:, 1])
