"""FlexiViT (Beyer et al., CVPR 2023): one set of ViT weights at many patch sizes.

The patch-embedding kernel is PI-resized to another patch size (the
pseudo-inverse of the bilinear resize of a patch, `vit_checkpoint.pi_resize_matrix`)
and the position embeddings resized to the new grid, as fine-tuning at another
resolution resizes them (`vit_checkpoint.resize_posemb`, 'zoom'). On the host this
loads any checkpoint at another patch size (`load_at_patch_size`: predict,
evaluate, export; fine-tuning does it in `checkpoint.load_pretrained`). In a
training step, `random_patch_grad` draws one of a list of patch sizes per
step and resizes the model's own kernel and position embeddings to it on the
fly (FlexiViT's recipe), so gradients reach the one underlying set.
"""

from typing import Sequence

import jax
import jax.numpy as jnp

from vit_jax.core.errors import UserError
from vit_jax.models import vit_checkpoint

_KERNEL = 'embedding/kernel'
_POSEMB = 'Transformer/posembed_input/pos_embedding'
_PATCH_DRAW = 0x50415443  # the patch-size draw's key: the dropout key folded with this


class PatchSizeError(UserError, ValueError):
  """A patch size that does not fit the model or the images; one line."""


def check_patch_sizes(spec, sizes: Sequence[int]) -> None:
  """PatchSizeError unless every size tiles the images of `spec` (a `ModelSpec`), a plain ViT."""
  if spec.hybrid:
    raise PatchSizeError(
      f'{spec.name}: a hybrid embeds ResNet features, not pixels; patch sizes apply '
      'to plain ViTs only'
    )
  for size in sizes:
    if size < 1 or spec.image_size % size:
      raise PatchSizeError(
        f'patch size {size} does not tile {spec.image_size} px images; use one that divides '
        f'{spec.image_size}'
      )


def at_patch_size(
  flat: dict,
  patch_size: int,
  image_size: int,
  num_prefix: int,
  posemb_resize: str = 'zoom',
  patch_resize: str = 'bilinear',
) -> dict:
  """Flat parameters {'a/b': array} moved to `patch_size` at `image_size` px (NumPy).

  The kernel is PI-resized over `patch_resize`'s resize, the position embeddings resized to
  the new grid by `posemb_resize` (`vit_checkpoint.PATCH_RESIZE`, `POSEMB_RESIZE`; timm's
  defaults are 'bicubic_antialias' for both).
  """
  out = dict(flat)
  size = (patch_size, patch_size)
  out[_KERNEL] = vit_checkpoint.resize_patch_embedding(flat[_KERNEL], size, patch_resize)
  grid = image_size // patch_size
  if _POSEMB in flat:  # a model with rotary embeddings alone has no table (posemb='none')
    out[_POSEMB] = vit_checkpoint.resize_posemb(
      flat[_POSEMB], num_prefix + grid * grid, num_prefix, posemb_resize
    )
  return out


def load_at_patch_size(flat: dict, spec, patch_size: int, resample=None) -> tuple:
  """(flat parameters, spec) of a checkpoint moved to `patch_size`: a ViT's kernel PI-resized
  and its position embeddings resized to the new grid at the same image size; a NaFlex ViT's
  kernel alone (its 2D table is resampled per image anyway). `resample` (PATCH_RESIZE's,
  timm's default 'bicubic_antialias') is the resize of both; None: FlexiViT's bilinear
  PI-resize and the official zoom."""
  if spec.naflex:
    size = (patch_size, patch_size)
    kernel = vit_checkpoint.resize_patch_embedding(flat[_KERNEL], size, resample or 'bilinear')
    flat = {**flat, _KERNEL: kernel}
  else:
    check_patch_sizes(spec, [patch_size])
    flat = at_patch_size(
      flat,
      patch_size,
      spec.image_size,
      spec.posemb_prefix,
      resample or 'zoom',
      resample or 'bilinear',
    )
  return flat, spec.changed(patch_size=(patch_size, patch_size))


def _resized(params, base, size, image_size, num_prefix, posemb_resize, patch_resize):
  """`at_patch_size` inside a traced step: the same linear maps as float32 matmuls."""
  if size == base:
    return params
  kernel = params['embedding']['kernel']
  pinv = jnp.asarray(vit_checkpoint.pi_resize_matrix(base, size, patch_resize), jnp.float32)
  kernel = jnp.einsum('ah,bw,hwcd->abcd', pinv, pinv, kernel, precision='highest')
  resized = {**params, 'embedding': {**params['embedding'], 'kernel': kernel}}
  if 'posembed_input' not in params['Transformer']:  # no table (posemb='none')
    return resized
  posemb = params['Transformer']['posembed_input']['pos_embedding']
  old, new = image_size // base, image_size // size
  zoom = jnp.asarray(vit_checkpoint.resize_matrix(old, new, posemb_resize), jnp.float32)
  grid = posemb[0, num_prefix:].reshape(old, old, -1)
  grid = jnp.einsum('ah,bw,hwd->abd', zoom, zoom, grid, precision='highest')
  posemb = jnp.concatenate([posemb[:, :num_prefix], grid.reshape(1, new * new, -1)], axis=1)
  transformer = {**params['Transformer'], 'posembed_input': {'pos_embedding': posemb}}
  return {**resized, 'Transformer': transformer}


def random_patch_grad(
  model,
  sizes: Sequence[int],
  image_size: int,
  objective,
  compute=None,
  posemb_resize: str = 'zoom',
  patch_resize: str = 'bilinear',
):
  """A training `grad_fn(params, batch, rng) -> (loss, grads)` that runs each call at a patch
  size drawn uniformly from `sizes` (one per step, or per micro-batch), the parameters and
  their gradients staying at the model's own patch size. `objective(logits, batch)` is
  the loss; `compute(params)` casts the resized float32 parameters to the compute dtype
  (`vit.compute_params`), once per call. The resizes are `at_patch_size`'s.

  One compiled program holds every size; `lax.switch` picks one branch, each branch its
  own loss and gradient (a switch inside the gradient would carry every branch's saved
  activations, zeros but as large as the largest patch count's: measured as slow as
  always drawing the smallest patch). The draw comes from the dropout key, so it is the
  same on every device and a pure function of the step.
  """
  base = model.architecture.patch_size[0]
  num_prefix = model.architecture.posemb_prefix

  def at(size):
    sized = model.clone(architecture=model.architecture.changed(patch_size=(size, size)))

    def loss(params, batch, rng):
      resized = _resized(params, base, size, image_size, num_prefix, posemb_resize, patch_resize)
      resized = compute(resized) if compute else resized
      logits = sized.apply({'params': resized}, batch['image'], train=True, rngs={'dropout': rng})
      return objective(logits, batch)

    return jax.value_and_grad(loss)

  def grad_fn(params, batch, rng):
    index = jax.random.randint(jax.random.fold_in(rng, _PATCH_DRAW), (), 0, len(sizes))
    return jax.lax.switch(index, [at(s) for s in sizes], params, batch, rng)

  return grad_fn
