"""The networks of self-distillation as DINOv2 trains them (Oquab et al. 2023): a ViT backbone
with a mask token, the DINO head, and the backbone at another crop size.

`build` makes the student's networks (the teacher is the same networks on the EMA of the
student's parameters) from a `ModelSpec` and a `Compute`: the backbone (`Backbone`) is the
spec's ViT returning every token after the final LayerNorm, with `mask_token` (iBOT's masked
patches), its parameters under the names of `vit.VisionTransformer`'s (`embedding`, `cls`,
`registers`, `Transformer/...`), so that a run's teacher loads, exports and fine-tunes as any
ViT. Beside them
the parameter tree holds the heads, `dino_head` (the class token's) and, when iBOT has its own,
`ibot_head` (the masked patches'): `vit_checkpoint` drops them when fine-tuning.

The DINO head (Caron et al. 2021): an MLP (`Dense_{i}`, exact GELU between layers) down to a
bottleneck, L2 normalisation, then weight-normalised prototypes (Salimans & Kingma 2016):
`prototypes/kernel` v [bottleneck, K] and `prototypes/scale` g [K], the layer's weight
g * v / |v| per prototype; g starts at 1 and trains (DINOv2's `last_layer`).

Crops of another size (the local crops) go through the same backbone with its position
embeddings resized to their grid inside the step (`at_grid`), as DINOv2's
`interpolate_pos_encoding` does, so gradients reach the one table.
"""

from typing import Any, NamedTuple, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from vit_jax.configs.model_spec import Architecture
from vit_jax.configs.model_spec import Compute
from vit_jax.models import vit
from vit_jax.models import vit_checkpoint

_POSEMB = ('Transformer', 'posembed_input', 'pos_embedding')
HEADS = ('dino_head', 'ibot_head')  # the parameters beside the backbone's


class Backbone(nn.Module):
  """`architecture`'s ViT up to its final LayerNorm, with iBOT's mask token: images [B, H, W, 3]
  in [-1, 1] -> tokens [B, 1 + patches, D], the class token first (registers dropped).

  `masks` (bool [B, patches]): those patch embeddings replaced by `mask_token` (DINOv2: zeros
  at start) before the learned tokens and the position embeddings join them. Its parameters
  are `vit.VisionTransformer`'s of the same architecture (no head), and `mask_token`."""

  architecture: Architecture
  compute: Compute = Compute()

  @nn.compact
  def __call__(self, images, masks=None, *, train: bool):
    a = self.architecture
    dtype = jnp.dtype(self.compute.dtype)
    x = vit.embed_patches(vit.normalise_input(images, a.input_stats), a, dtype)
    token = self.param('mask_token', nn.initializers.zeros, (1, 1, x.shape[-1]), jnp.float32)
    if masks is not None:
      x = jnp.where(masks[..., None], token.astype(x.dtype), x)
    grid = (images.shape[1] // a.patch_size[0], images.shape[2] // a.patch_size[1])
    x = vit.prepend_tokens(self, x, a)
    x = vit.Encoder(a, self.compute, name='Transformer')(x, train=train, grid=grid)
    return vit.drop_registers(x, a)


class DinoHead(nn.Module):
  """MLP -> L2 norm -> weight-normalised prototypes: [..., D] -> logits [..., K] float32.

  The MLP computes in `dtype`; the normalised bottleneck meets the prototypes in `dtype` with a
  float32 result, since the logits are divided by temperatures down to 0.04.
  """

  prototypes: int
  hidden_dim: int = 2048
  bottleneck_dim: int = 256
  num_layers: int = 3
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    # DINOv2: trunc_normal_(std=0.02) of weights (its bounds are +-2 absolute, i.e. none at
    # this scale), zero biases.
    dense = lambda n, i: nn.Dense(
      n, dtype=self.dtype, kernel_init=nn.initializers.normal(0.02), name=f'Dense_{i}'
    )
    widths = [self.hidden_dim] * (self.num_layers - 1) + [self.bottleneck_dim]
    x = x.astype(self.dtype)
    for i, width in enumerate(widths):
      x = dense(width, i)(x)
      if i < len(widths) - 1:
        x = nn.gelu(x, approximate=False)
    x = x.astype(jnp.float32)
    # torch's F.normalize: x / max(|x|, 1e-12)
    x = x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), 1e-12)
    return WeightNormPrototypes(self.prototypes, self.dtype, name='prototypes')(x)


class WeightNormPrototypes(nn.Module):
  """x @ (g * v / |v|): a bias-free linear layer whose columns have length g."""

  prototypes: int
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    shape = (x.shape[-1], self.prototypes)
    # torch's nn.Linear default (kaiming-uniform, a=sqrt(5)): U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
    bound = 1.0 / np.sqrt(shape[0])
    init = lambda key, s, dtype: jax.random.uniform(key, s, dtype, -bound, bound)
    v = self.param('kernel', init, shape, jnp.float32)
    g = self.param('scale', nn.initializers.ones, (self.prototypes,), jnp.float32)
    w = v * (g / jnp.linalg.norm(v, axis=0))
    return jnp.dot(x.astype(self.dtype), w.astype(self.dtype), preferred_element_type=jnp.float32)


class Networks(NamedTuple):
  """What the student (and its EMA, the teacher) computes with, on one parameter tree.

  `backbone.apply({'params': params}, images, masks=..., train=...)` -> tokens [B, T, D] after
  the final LayerNorm, the class token first, then the patches (registers dropped);
  `dino_head` reads `params['dino_head']`; `ibot_head` is None when iBOT shares the DINO head.
  """

  backbone: nn.Module
  dino_head: DinoHead
  ibot_head: Optional[DinoHead]
  spec: Any  # the backbone's ModelSpec

  def init(self, rng):
    """Fresh parameters: the backbone's, `dino_head`'s and, if separate, `ibot_head`'s."""
    keys = jax.random.split(rng, 3)
    size = self.spec.image_size
    params = dict(self.backbone.init(keys[0], jnp.zeros((1, size, size, 3)), train=False)['params'])
    width = self.spec.architecture.hidden_size
    features = jnp.zeros((1, width), jnp.float32)
    params['dino_head'] = self.dino_head.init(keys[1], features)['params']
    if self.ibot_head is not None:
      params['ibot_head'] = self.ibot_head.init(keys[2], features)['params']
    return params

  def patch_head(self, params):
    """(module, its parameters) that the masked patch tokens go through."""
    if self.ibot_head is None:
      return self.dino_head, params['dino_head']
    return self.ibot_head, params['ibot_head']

  @property
  def num_prefix(self) -> int:
    """Tokens before the patches in the backbone's output: the class token alone."""
    return 1


def build(spec, config, compute: Compute = Compute()) -> Networks:
  """The student's networks of the model `spec` (a `ModelSpec` whose architecture has a class
  token and puts its final norm on every token: `training.dino.check_model`) with the heads of
  `config.dino` and `config.ibot`, running as `compute`."""
  backbone = Backbone(spec.architecture, compute)
  dtype = jnp.dtype(compute.dtype)
  dino = config.dino
  dino_head = DinoHead(
    dino.prototypes, dino.head_hidden, dino.head_bottleneck, dino.head_layers, dtype
  )
  ibot_head = None
  if config.ibot.separate_head:
    ibot = config.ibot
    ibot_head = DinoHead(
      ibot.prototypes, ibot.head_hidden, ibot.head_bottleneck, ibot.head_layers, dtype
    )
  return Networks(backbone, dino_head, ibot_head, spec)


def features(spec, compute: Compute = Compute()) -> nn.Module:
  """The backbone's class token after the final norm, as `vit.VisionTransformer` without a head
  computes it on the same parameters (the mask token unread): what k-NN and probes read."""
  return vit.VisionTransformer(None, spec.architecture, compute)


def at_grid(params, spec, grid: int, method: str):
  """`params` with the position embeddings of the backbone resized from the spec's patch grid
  to `grid` x `grid` by `method` (`vit_checkpoint.POSEMB_RESIZE`; DINOv2 and timm take bicubic),
  as one linear map per axis that gradients flow through; the prefix rows as they are."""
  old = spec.grid
  if grid == old:
    return params
  prefix = spec.architecture.posemb_prefix
  posemb = params[_POSEMB[0]][_POSEMB[1]][_POSEMB[2]]
  matrix = jnp.asarray(vit_checkpoint.resize_matrix(old, grid, method), jnp.float32)
  table = posemb[0, prefix:].reshape(old, old, -1)
  table = jnp.einsum('ah,bw,hwd->abd', matrix, matrix, table, precision='highest')
  posemb = jnp.concatenate([posemb[:, :prefix], table.reshape(1, grid * grid, -1)], axis=1)
  transformer = {**params[_POSEMB[0]], _POSEMB[1]: {_POSEMB[2]: posemb}}
  return {**params, _POSEMB[0]: transformer}


def backbone_only(params) -> dict:
  """The backbone's parameters: what a ViT of the same spec loads (heads and mask token out)."""
  return {k: v for k, v in params.items() if k not in HEADS + ('mask_token',)}
