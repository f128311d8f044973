"""Models: the ViT (`vit`; its `attention` and `positions`), the ResNet of the hybrids
(`resnet`), masked patch prediction (`mpp`), NaFlex (`naflex`), FlexiViT (`flexi`); `build`
makes the model of a `configs.model_spec.ModelSpec`.

Also the official `vit_jax.models` API, as a facade over the typed modules:
`models.get_model(name, **kw)`, `models.VisionTransformer(num_classes=...,
**MODEL_CONFIGS[name])`, and the encoder and its blocks built with their official keywords
(`models.Encoder1DBlock(mlp_dim=..., num_heads=...)`). Each converts its keywords once into an
`Architecture` or `Block` and a `Compute`, so the official names are functions, not classes.
"""

import dataclasses
from typing import Optional

from vit_jax.configs import architectures as _architectures
from vit_jax.configs.model_spec import Architecture
from vit_jax.configs.model_spec import Block
from vit_jax.configs.model_spec import Compute
from vit_jax.models import naflex as _naflex
from vit_jax.models import vit as _vit
from vit_jax.models.attention import MultiHeadDotProductAttention  # noqa: F401
from vit_jax.models.positions import AddPositionEmbs  # noqa: F401
from vit_jax.models.resnet import StdConv  # noqa: F401
from vit_jax.models.vit import MlpBlock  # noqa: F401

_COMPUTE = frozenset(f.name for f in dataclasses.fields(Compute))


def _split(options: dict):
  """(the architecture's or block's keywords, a `Compute` of the rest)."""
  compute = {k: options.pop(k) for k in list(options) if k in _COMPUTE}
  return options, Compute(**compute)


def build(spec, num_classes: Optional[int], compute: Compute = Compute(), head_bias_init=0.0):
  """The model of `spec` (a `configs.model_spec.ModelSpec`) with a head of `num_classes` (None:
  its pre-logits features), running as `compute`: a `naflex.NaFlexViT` where the architecture
  has NaFlex's 2D position table, else a `vit.VisionTransformer`."""
  cls = _naflex.NaFlexViT if spec.naflex else _vit.VisionTransformer
  return cls(num_classes, spec.architecture, compute, head_bias_init)


def VisionTransformer(num_classes=None, *, head_bias_init=0.0, **options):  # noqa: N802
  """The official `models.VisionTransformer(num_classes=..., **config)`: a
  `vit.VisionTransformer` of the registry entry's keywords (`Architecture.of`) and of the
  `Compute` fields among them (dtype, attention, remat, scan, fp8, ...)."""
  entry, compute = _split(options)
  return _vit.VisionTransformer(num_classes, Architecture.of(entry), compute, head_bias_init)


def get_model(name, **kw):
  """The official `models.get_model`: `VisionTransformer(**MODEL_CONFIGS[name], **kw)`.

  Mixer and LiT names raise a one-line KeyError saying they are out of scope.
  """
  return VisionTransformer(**_architectures.MODEL_CONFIGS[name], **kw)


def Encoder1DBlock(  # noqa: N802  the official class's name
  mlp_dim, num_heads, dropout_rate=0.1, attention_dropout_rate=0.1, *, name=None, **options
):
  """The official `models.Encoder1DBlock`: a `vit.Encoder1DBlock` of those options (and any
  other `Block` or `Compute` field: parallel_block, mlp, dtype, attention, ...)."""
  options, compute = _split(options)
  block = Block(mlp_dim, num_heads, dropout_rate, attention_dropout_rate, **options)
  return _vit.Encoder1DBlock(block, compute, name=name)


def Encoder(  # noqa: N802  the official class's name
  num_layers, mlp_dim, num_heads, dropout_rate=0.1, attention_dropout_rate=0.1, *, name=None,
  **options,
):  # fmt: skip
  """The official `models.Encoder`: a `vit.Encoder` of `num_layers` such blocks, learned 1D
  position embeddings for every token, the final LayerNorm; `Compute` fields (remat, scan,
  ...) among the options. It takes its width from its input."""
  options, compute = _split(options)
  block = Block(mlp_dim, num_heads, dropout_rate, attention_dropout_rate, **options)
  arch = Architecture(None, 0, num_layers, (1, 1), block)  # no patches of its own
  return _vit.Encoder(arch, compute, name=name)
