"""DINOv2's multi-crop input on the host: 2 global crops, N local crops and iBOT's block masks.

Per image, as DINOv2's `DataAugmentationDINO` (torchvision on PIL images) computes it, with
the probabilities its released code applies:

- each crop a random resized crop (torchvision's: area fraction uniform in the scale range,
  aspect ratio log-uniform in [3/4, 4/3], 10 attempts, then a centre crop), resized bicubically
  (PIL's filter) to its size, then flipped with probability 1/2 (where flips suit the data:
  `pp.flip`, off for the digits);
- colour jitter with probability 0.8 (brightness 0.4, contrast 0.4, saturation 0.2, hue 0.1
  in a random order, PIL's operations), grey with probability 0.2;
- Gaussian blur (9x9, sigma uniform in [0.1, 2] px at DINOv2's 224 px global crops, in
  proportion to the global crop at other sizes, so that a blur takes the same share of an image
  at any resolution) with probability 0 for the first global crop, 0.9 for the second and 0.5
  for local crops; solarisation (threshold 128) with probability
  0.2 for the second global crop. DINOv2's code passes 1 - p to torchvision's `RandomApply`
  (`GaussianBlur(p=1.0)` never blurs): these are the probabilities its checkpoints were
  trained with (facebookresearch/dinov2#411, dinov3#286 say so).
- iBOT's masks of the global crops: each crop is masked with `mask_probability`, a fraction
  of its patches uniform in `mask_ratio`, as rectangles of at least 4 patches with a
  log-uniform aspect ratio in [0.3, 1/0.3] (DINOv2's `MaskingGenerator`). DINOv2 spreads the
  fractions evenly over a batch's masked crops; here each crop draws its own (the same
  distribution per crop), so a batch is the same whatever the number of processes.

Every draw of an example comes from one NumPy generator seeded by (the run's augmentation key,
the example's stream position): a batch is a pure function of (seed, step), as the rest of the
host pipeline (`host.py`). Batches: 'global' uint8 [b, 2, G, G, 3], 'local' uint8 [b, L, l, l,
3], 'masks' bool [b, 2, (G/p)^2], and the labels the source has (unused by the task).
"""

import dataclasses
import math
from typing import Tuple

import numpy as np

from vit_jax.data import host
from vit_jax.data import images
from vit_jax.data.sources import DataError

NUM_GLOBAL = 2
RATIO = (3 / 4, 4 / 3)  # torchvision's RandomResizedCrop default
CROP_ATTEMPTS = 10
JITTER_PROBABILITY = 0.8
JITTER = (0.4, 0.4, 0.2, 0.1)  # brightness, contrast, saturation, hue
GREY_PROBABILITY = 0.2
BLUR_KERNEL = 9
BLUR_SIGMA = (0.1, 2.0)  # in pixels of a global crop of BLUR_AT px: in proportion at others
BLUR_AT = 224
# (blur, solarise) probabilities of the first global crop, the second, and the local crops.
GLOBAL_1, GLOBAL_2, LOCAL = (0.0, 0.0), (0.9, 0.2), (0.5, 0.0)
SOLARISE_THRESHOLD = 128
# iBOT's blocks (DINOv2's MaskingGenerator defaults).
MIN_BLOCK = 4
BLOCK_ASPECT = 0.3
BLOCK_ATTEMPTS = 10


@dataclasses.dataclass(frozen=True)
class Settings:
  """What the multi-crop input of a run draws (from `config.dino`, `config.ibot`, `pp`)."""

  global_size: int
  local_size: int
  num_local: int
  global_scale: Tuple[float, float]
  local_scale: Tuple[float, float]
  flip: bool
  patch_size: int
  mask_probability: float
  mask_ratio: Tuple[float, float]

  @classmethod
  def of(cls, config, patch_size: int, flip: bool) -> 'Settings':
    return cls(
      int(config.pp.crop),
      int(config.dino.local_crop),
      int(config.dino.local_crops),
      tuple(float(x) for x in config.dino.global_scale),
      tuple(float(x) for x in config.dino.local_scale),
      bool(flip),
      int(patch_size),
      float(config.ibot.mask_probability),
      tuple(float(x) for x in config.ibot.mask_ratio),
    )

  @property
  def grid(self) -> int:
    """Patches per side of a global crop."""
    return self.global_size // self.patch_size

  @property
  def mask_slots(self) -> int:
    """The most patches a crop's mask covers: the step gathers this many per crop."""
    return int(self.grid * self.grid * self.mask_ratio[1])


# ---------------------------------------------------------------------------
# One crop.


def crop_window(rng, height: int, width: int, scale, ratio=RATIO):
  """(top, left, h, w) of torchvision's `RandomResizedCrop.get_params`: up to 10 draws of an
  area fraction uniform in `scale` and an aspect ratio (w / h) log-uniform in `ratio`, the
  first that fits placed uniformly; else the largest centred box within `ratio`."""
  area = height * width
  log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
  for _ in range(CROP_ATTEMPTS):
    target = area * rng.uniform(scale[0], scale[1])
    aspect = math.exp(rng.uniform(*log_ratio))
    w = int(round(math.sqrt(target * aspect)))
    h = int(round(math.sqrt(target / aspect)))
    if 0 < w <= width and 0 < h <= height:
      return int(rng.integers(0, height - h + 1)), int(rng.integers(0, width - w + 1)), h, w
  in_ratio = width / height
  if in_ratio < min(ratio):
    w, h = width, int(round(width / min(ratio)))
  elif in_ratio > max(ratio):
    h, w = height, int(round(height * max(ratio)))
  else:
    w, h = width, height
  return (height - h) // 2, (width - w) // 2, h, w


@dataclasses.dataclass(frozen=True)
class Photometric:
  """One crop's colour and blur draws (None: not applied)."""

  jitter_order: Tuple[int, ...] = ()  # of (brightness, contrast, saturation, hue); () = none
  factors: Tuple[float, float, float, float] = (1.0, 1.0, 1.0, 0.0)
  grey: bool = False
  blur_sigma: float = 0.0  # 0: no blur
  solarise: bool = False


def draw_photometric(
  rng, blur_probability: float, solarise_probability: float, blur_scale: float = 1.0
) -> Photometric:
  """The colour and blur draws of one crop, in torchvision's order and ranges; the blur's sigma
  times `blur_scale`."""
  order_, factors = (), (1.0, 1.0, 1.0, 0.0)
  if rng.uniform() < JITTER_PROBABILITY:
    order_ = tuple(int(i) for i in rng.permutation(4))
    b, c, s, h = JITTER
    factors = (
      rng.uniform(1 - b, 1 + b),
      rng.uniform(1 - c, 1 + c),
      rng.uniform(1 - s, 1 + s),
      rng.uniform(-h, h),
    )
  grey = rng.uniform() < GREY_PROBABILITY
  sigma = blur_scale * rng.uniform(*BLUR_SIGMA) if rng.uniform() < blur_probability else 0.0
  solarise = bool(rng.uniform() < solarise_probability)
  return Photometric(order_, factors, bool(grey), float(sigma), solarise)


def _pil():
  from PIL import Image
  from PIL import ImageEnhance

  return Image, ImageEnhance


def adjust_hue(image, factor: float):
  """PIL image with its hue turned by `factor` of a full turn (torchvision's PIL adjust_hue)."""
  Image, _ = _pil()
  h, s, v = image.convert('HSV').split()
  shift = int(factor * 255) % 256  # numpy's uint8 of the float: truncated, then wrapped
  hue = ((np.asarray(h, np.int32) + shift) % 256).astype(np.uint8)
  return Image.merge('HSV', (Image.fromarray(hue, 'L'), s, v)).convert('RGB')


def apply_photometric(image, p: Photometric) -> np.ndarray:
  """PIL RGB image -> uint8 [h, w, 3] after jitter, grey, blur and solarisation."""
  Image, ImageEnhance = _pil()
  enhancers = (ImageEnhance.Brightness, ImageEnhance.Contrast, ImageEnhance.Color)
  for i in p.jitter_order:
    image = adjust_hue(image, p.factors[3]) if i == 3 else enhancers[i](image).enhance(p.factors[i])
  if p.grey:
    image = image.convert('L').convert('RGB')
  pixels = np.asarray(image)
  if p.blur_sigma:
    pixels = gaussian_blur(pixels, p.blur_sigma)
  if p.solarise:
    pixels = np.where(pixels >= SOLARISE_THRESHOLD, 255 - pixels, pixels).astype(np.uint8)
  return pixels


def gaussian_blur(pixels: np.ndarray, sigma: float) -> np.ndarray:
  """uint8 [h, w, 3] blurred as torchvision's `gaussian_blur` (a 9-tap Gaussian per axis,
  reflected edges, float32, rounded half to even)."""
  from vit_jax.data.images import _cv2

  x = np.linspace(-(BLUR_KERNEL // 2), BLUR_KERNEL // 2, BLUR_KERNEL, dtype=np.float32)
  kernel = np.exp(-0.5 * (x / np.float32(sigma)) ** 2)
  kernel = (kernel / kernel.sum()).astype(np.float32)
  cv2 = _cv2()
  blurred = cv2.sepFilter2D(
    pixels.astype(np.float32), -1, kernel, kernel, borderType=cv2.BORDER_REFLECT_101
  )
  return np.clip(np.rint(blurred), 0, 255).astype(np.uint8)


def crop(image, window, size: int, flip: bool, photometric: Photometric, out=None) -> np.ndarray:
  """One crop of a PIL image: `window` (top, left, h, w) resized bicubically to `size`, mirrored
  when `flip`, then `photometric`; written into `out` where given."""
  Image, _ = _pil()
  top, left, h, w = window
  region = image.crop((left, top, left + w, top + h)).resize((size, size), Image.BICUBIC)
  if flip:
    region = region.transpose(Image.FLIP_LEFT_RIGHT)
  pixels = apply_photometric(region, photometric)
  if out is None:
    return pixels
  out[...] = pixels
  return out


# ---------------------------------------------------------------------------
# iBOT's block masks.


def block_mask(rng, grid: int, num_masked: int, max_block=None) -> np.ndarray:
  """bool [grid, grid] with up to `num_masked` patches masked, as rectangles: each of at least
  `MIN_BLOCK` patches and a log-uniform aspect ratio, placed uniformly; a rectangle adds only
  where it overlaps no more than it may add, and after `BLOCK_ATTEMPTS` misses in a row the
  mask stays as it is (DINOv2's `MaskingGenerator`)."""
  mask = np.zeros((grid, grid), bool)
  max_block = num_masked if max_block is None else max_block
  log_aspect = (math.log(BLOCK_ASPECT), math.log(1 / BLOCK_ASPECT))
  count = 0
  while count < num_masked:
    room = min(num_masked - count, max_block)
    added = 0
    for _ in range(BLOCK_ATTEMPTS):
      target = MIN_BLOCK + (room - MIN_BLOCK) * rng.random()  # room may be below MIN_BLOCK
      aspect = math.exp(rng.uniform(*log_aspect))
      h = int(round(math.sqrt(target * aspect)))
      w = int(round(math.sqrt(target / aspect)))
      if w < grid and h < grid:
        top = int(rng.integers(0, grid - h + 1))
        left = int(rng.integers(0, grid - w + 1))
        block = mask[top : top + h, left : left + w]
        new = h * w - int(block.sum())
        if 0 < new <= room:
          block[...] = True
          added = new
      if added:
        break
    if not added:
      break
    count += added
  return mask


def crop_mask(rng, settings: Settings) -> np.ndarray:
  """bool [(G/p)^2] of one global crop: masked with `mask_probability`, a fraction of its
  patches uniform in `mask_ratio` (DINOv2's largest block: half the patches)."""
  grid = settings.grid
  n = grid * grid
  if rng.uniform() >= settings.mask_probability:
    return np.zeros(n, bool)
  count = int(n * rng.uniform(*settings.mask_ratio))
  return block_mask(rng, grid, count, max_block=0.5 * n).reshape(-1)


# ---------------------------------------------------------------------------
# One image, a batch.


def example_rng(key: int, position: int):
  """The generator of every draw of the example at stream `position`."""
  return np.random.default_rng([int(key) & 0xFFFFFFFFFFFFFFFF, int(position)])


def views(image: np.ndarray, rng, settings: Settings, out_global, out_local, out_masks) -> None:
  """The crops and masks of one decoded image (uint8 [h, w, 3]) into the batch's rows."""
  Image, _ = _pil()
  pil = Image.fromarray(image)
  height, width = image.shape[:2]
  kinds = [(settings.global_size, settings.global_scale, GLOBAL_1, out_global[0])]
  kinds.append((settings.global_size, settings.global_scale, GLOBAL_2, out_global[1]))
  kinds += [(settings.local_size, settings.local_scale, LOCAL, row) for row in out_local]
  for size, scale, (blur, solarise), out in kinds:
    window = crop_window(rng, height, width, scale)
    flip = settings.flip and rng.uniform() < 0.5
    photometric = draw_photometric(rng, blur, solarise, settings.global_size / BLUR_AT)
    crop(pil, window, size, flip, photometric, out)
  for c in range(NUM_GLOBAL):
    out_masks[c] = crop_mask(rng, settings)


def decode_for_crops(data: bytes, settings: Settings) -> np.ndarray:
  """An encoded image decoded at the smallest JPEG scale that still gives every crop its
  size from its smallest box (a local crop's minimum area)."""
  size = images.image_size(data)
  if size is None:
    return images.decode(data)
  height, width = size
  side = min(height, width)
  smallest = [
    (math.sqrt(settings.global_scale[0]) * side, settings.global_size),
    (math.sqrt(settings.local_scale[0]) * side, settings.local_size),
  ]
  scale = min(images.dct_scale(int(box), int(box), out) for box, out in smallest)
  return images.decode(data, -(-height // scale), -(-width // scale), fast=True)


class TrainBatches(host.TrainBatches):
  """Process-local multi-crop batches of steps start, start+1, ... (see the module docstring);
  the threads, order and prefetching of `host.TrainBatches`."""

  def __init__(self, source, settings: Settings, **kwargs):
    self._settings = settings
    super().__init__(source, None, **kwargs)

  def _submit(self, step):
    positions, idx = self._indices(step)
    s, b = self._settings, self._b
    grid = s.grid
    out = {
      'global': host.batch_buffer((b, NUM_GLOBAL, s.global_size, s.global_size, 3), np.uint8),
      'local': host.batch_buffer((b, s.num_local, s.local_size, s.local_size, 3), np.uint8),
      'masks': np.zeros((b, NUM_GLOBAL, grid * grid), bool),
    }
    jobs = [self._pool.submit(self._views, idx[r], positions[r], r, out) for r in host._chunks(b)]
    return step, jobs, out

  def _views(self, idx, positions, rows, out):
    source, s = self._source, self._settings
    items, labels = source.fetch(idx)
    for k, i in enumerate(rows):
      if source.decoded:
        image = items[k]
      else:
        image = host._decoded(source, idx[k], items[k], lambda d: decode_for_crops(d, s))
      rng = example_rng(self._aug_key, positions[k])
      views(image, rng, s, out['global'][i], out['local'][i], out['masks'][i])
    return labels

  def _finish(self, submitted):
    _, jobs, out = submitted
    return {**out, 'label': np.concatenate([job.result() for job in jobs])}


def train_line(config, flip: bool) -> str:
  """The train transform of a self-distillation run, in words (`pipeline.Preprocessing`)."""
  d, ibot = config.dino, config.ibot
  scale = lambda s: f'area {s[0]:g}-{s[1]:g}'
  return (
    f'2 global crops ({scale(d.global_scale)}) to {config.pp.crop} px and '
    f'{d.local_crops} local crops ({scale(d.local_scale)}) to {d.local_crop} px, '
    f'{"horizontal flip" if flip else "no flip"}, colour jitter, grey, blur and solarisation as '
    f'DINOv2, iBOT masks of {ibot.mask_ratio[0]:g}-{ibot.mask_ratio[1]:g} of the patches in '
    f'{ibot.mask_probability:g} of the global crops (docs/self_supervised.md)'
  )


def check(settings: Settings, num_train: int, batch: int, name: str) -> None:
  """DataError for a split too small for a batch of distinct images: the losses compare each
  image's crops with the others' (KoLeo's nearest neighbour, Sinkhorn-Knopp's balance)."""
  if num_train < batch:
    raise DataError(
      f'{name}: the train split has {num_train} images, fewer than a batch of {batch}: every '
      'batch would hold copies of one image, which self-distillation pushes apart; lower '
      '--config.batch or add images'
    )
