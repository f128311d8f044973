"""Models: the ViT (`vit`), the ResNet of the hybrids (`resnet`), masked patch prediction (`mpp`),
NaFlex (`naflex`), FlexiViT (`flexi`); `build` makes the model of a `configs.model_spec.ModelSpec`.

Also the official `vit_jax.models` API: `models.get_model(name, **kw)`,
`models.VisionTransformer(num_classes=..., **MODEL_CONFIGS[name])`, and its blocks built
with their official keywords (`models.Encoder1DBlock(mlp_dim=..., num_heads=...)`).
"""

import jax.numpy as _jnp

from vit_jax.configs import architectures as _architectures
from vit_jax.models import naflex as _naflex
from vit_jax.models import vit as _vit
from vit_jax.models.resnet import StdConv  # noqa: F401
from vit_jax.models.vit import AddPositionEmbs  # noqa: F401
from vit_jax.models.vit import MlpBlock  # noqa: F401
from vit_jax.models.vit import MultiHeadDotProductAttention  # noqa: F401
from vit_jax.models.vit import VisionTransformer


def get_model(name, **kw):
  """The official `models.get_model`: `VisionTransformer(**MODEL_CONFIGS[name], **kw)`.

  Mixer and LiT names raise a one-line KeyError saying they are out of scope.
  """
  return VisionTransformer(**_architectures.MODEL_CONFIGS[name], **kw)


def build(spec, num_classes, *, dtype=_jnp.float32, attention='auto', remat=False,
          remat_policy='nothing_saveable', scan=False, head_bias_init=0.0, fp8=False):  # fmt: skip
  """The model of `spec` (a `configs.model_spec.ModelSpec`) with a head of `num_classes` (None:
  its pre-logits features), computing in `dtype`: a `naflex.NaFlexViT` where the spec has a 2D
  position table, else a `VisionTransformer`."""
  options = dict(
    num_classes=num_classes,
    head_bias_init=head_bias_init,
    dtype=dtype,
    attention=attention,
    remat=remat,
    remat_policy=remat_policy,
    scan=scan,
    fp8=fp8,
    **spec.architecture,
  )
  if spec.naflex:
    return _naflex.NaFlexViT(posemb_grid=spec.posemb_grid, **options)
  return VisionTransformer(**options)


# The official blocks took their options as keywords; ours take one `vit.BlockConfig`.


def Encoder1DBlock(  # noqa: N802  the official class's name
  mlp_dim, num_heads, dropout_rate=0.1, attention_dropout_rate=0.1, *, name=None, **options
):
  """The official `models.Encoder1DBlock`: a `vit.Encoder1DBlock` of those options (and any
  other `BlockConfig` field: dtype, attention, parallel_block, ...)."""
  block = _vit.BlockConfig(mlp_dim, num_heads, dropout_rate, attention_dropout_rate, **options)
  return _vit.Encoder1DBlock(block, name=name)


def Encoder(  # noqa: N802  the official class's name
  num_layers,
  mlp_dim,
  num_heads,
  dropout_rate=0.1,
  attention_dropout_rate=0.1,
  *,
  remat=False,
  remat_policy='nothing_saveable',
  scan=False,
  name=None,
  **options,
):
  """The official `models.Encoder`: a `vit.Encoder` of `num_layers` such blocks."""
  block = _vit.BlockConfig(mlp_dim, num_heads, dropout_rate, attention_dropout_rate, **options)
  return _vit.Encoder(
    num_layers, block, remat=remat, remat_policy=remat_policy, scan=scan, name=name
  )
