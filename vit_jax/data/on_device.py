"""What happens to a batch on the devices, inside the jitted steps: [-1, 1] floats and Mixup.

Batches cross from the host as uint8 pixels (4x fewer bytes than float32, over
PCIe and through host memory), with their labels and, under Mixup, each
example's weight. `prepare` turns them into what the model and the loss take,
inside the same jit as the train or eval step:

- pixels become (x - 127.5) * (1 / 127.5): two elementwise operations that
  fuse into whatever reads the pixels, on every backend. The subtraction is
  exact, so the one rounding is the multiplication's, and no backend can fuse
  the pair into a differently rounded multiply-add: the floats are the same on
  TPU, GPU and CPU. They differ from the host's `images.to_float` (x / 127.5 - 1,
  TensorFlow's operations) by at most 2^-24 (`MAX_DIFFERENCE`) on 174 of the 256
  values. A lookup table of the host's values would be bitwise the host's, but a
  gather costs a TPU step 4x (a 256-entry table read per pixel);
- Mixup (Zhang et al. 2018, as AugReg): each image with its batch neighbour
  (pairs (2k, 2k+1) never straddle two processes' shares, whose batches are
  even), p * x + (1 - p) * partner, labels likewise as soft [B, K]. The host
  draws p per step (`host.mixup_weight`); XLA may fuse the mix into a
  multiply-add, so mixed pixels can differ from a NumPy mix by one ulp
  (docs/data.md). Soft labels come out bitwise the same.
"""

import jax
import jax.numpy as jnp
import numpy as np

# |normalise(x) - images.to_float(x)| over all 256 pixel values (tests/test_train_step.py).
MAX_DIFFERENCE = 2.0**-24


def normalise(pixels):
  """uint8 [...] -> float32 in [-1, 1]; floating input is taken as already in [-1, 1]."""
  if jnp.issubdtype(pixels.dtype, jnp.floating):
    return pixels
  if pixels.dtype != jnp.uint8:
    raise TypeError(f'images must be uint8 pixels or floats in [-1, 1], not {pixels.dtype}')
  return (pixels.astype(jnp.float32) - 127.5) * np.float32(1 / 127.5)


def mixup(inputs, labels, weights, num_classes: int):
  """(float images, soft labels [B, K]) mixed pairwise; `weights` [B] is each example's own p."""
  if labels.ndim == 1:
    labels = jax.nn.one_hot(labels, num_classes, dtype=jnp.float32)

  def mix(x):
    w = weights.reshape((-1,) + (1,) * (x.ndim - 1))
    partner = x.reshape((-1, 2) + x.shape[1:])[:, ::-1].reshape(x.shape)
    return w * x + (1.0 - w) * partner

  return mix(inputs), mix(labels)


def prepare(batch: dict, num_classes: int) -> dict:
  """A batch as it crosses to the devices -> the batch the model and the loss take.

  'image' uint8 (or floats already in [-1, 1]) -> float32 in [-1, 1]; with a
  'mixup' entry (the host's per-example weights) images and labels are mixed
  and the entry is consumed. Other entries ('mask') pass through.
  """
  out = dict(batch)
  out['image'] = normalise(batch['image'])
  if 'mixup' in out:
    out['image'], out['label'] = mixup(out['image'], out['label'], out.pop('mixup'), num_classes)
  return out
