"""The model of a run or of a checkpoint, resolved once: a `ModelSpec`.

A run's config names a registry entry (`architectures.MODEL_CONFIGS`) and changes parts of
it: depth, patch size, registers, block options, dropout, pre-logits. A checkpoint's
parameters fix the same parts by their shapes (`models.vit_checkpoint.spec_of`). Either way
the answer is one frozen `ModelSpec`, built once and handed down to what needs the
architecture: the model's construction (`models.build`), FlexiViT, checkpoint adaptation,
export, and the input pipeline (NaFlex's budgets and patch size). This module is the one
reader of the registry besides the official API's modules.
"""

import dataclasses
from typing import Optional, Tuple

import ml_collections

from vit_jax.configs import ConfigError
from vit_jax.configs import architectures
from vit_jax.configs import schema

# The pooling a NaFlex ViT takes (`models.naflex`): the class token, or the mean of the real
# patches; every other head reads token positions that differ from image to image.
NAFLEX_CLASSIFIERS = ('token', 'gap')
# `VisionTransformer`'s options for the newer families (`configs.families`) that NaFlex's and
# masked patch prediction's models do not take.
VIT_ONLY_OPTIONS = ('no_embed_class', 'pre_norm', 'fc_norm', 'rotary', 'input_mean', 'input_std')
# What a config's `block` section may set (`schema.FIELDS`), each as the `transformer` entry of
# that name: a `models.vit.BlockConfig` field.
BLOCK_OPTIONS = tuple(f.name[len('block.') :] for f in schema.FIELDS if f.name.startswith('block.'))


def registered(name: str) -> ml_collections.ConfigDict:
  """A fresh copy of registry entry `name`; an unknown name is UnknownModelError (one line,
  with the closest names)."""
  return architectures.MODEL_CONFIGS[name]


def has_class_token(classifier: str) -> bool:
  """Whether a model of `classifier` prepends the class token (paper 3.1)."""
  return classifier in ('token', 'token_unpooled', 'token_gap')


def prefix_tokens(classifier: str, num_registers: int = 0) -> int:
  """The tokens before the patches: the class token, then the registers (Darcet et al. 2023)."""
  return int(has_class_token(classifier)) + num_registers


def embedded_prefix(architecture) -> int:
  """The prefix tokens with rows in the 1D position embeddings: all of them, or none in
  timm's `no_embed_class` layout (DINOv2 with registers, DeiT III: `configs.families`)."""
  if architecture.get('no_embed_class', False):
    return 0
  return prefix_tokens(
    architecture.get('classifier', 'token'), architecture.get('num_registers', 0)
  )


def stride(architecture) -> int:
  """Input pixels per token step: the patch size, times the hybrid's ResNet stride (root conv /2
  and max-pool /2, then /2 in every stage after the first; R+ViT-Ti_16 has the root only)."""
  patch = architecture.patches.size[0]
  if architecture.get('resnet') is not None:
    return patch * 4 * 2 ** max(len(architecture.resnet.num_layers) - 1, 0)
  return patch


def resolve(
  name: str,
  *,
  num_layers: Optional[int] = None,
  patch_size=None,
  num_registers: int = 0,
  representation_size: Optional[int] = None,
  dropout: Optional[Tuple[float, float]] = None,
  block: Optional[dict] = None,
  drop_path: float = 0.0,
) -> ml_collections.ConfigDict:
  """Registry entry `name` with the given parts changed (None: the entry's own): the depth, the
  patch size (FlexiViT; a number, or (rows, columns)), register tokens, the pre-logits width,
  (dropout, attention dropout), the block options (`BLOCK_OPTIONS`; a None value keeps the
  entry's) and stochastic depth (`drop_path`, the blocks' `drop_path_rate`)."""
  arch = registered(name)
  if dropout is not None:
    arch.transformer.update(dropout_rate=dropout[0], attention_dropout_rate=dropout[1])
  if representation_size is not None:
    arch.representation_size = representation_size
  if num_layers is not None:
    arch.transformer.num_layers = num_layers
  if num_registers:
    arch.num_registers = num_registers
  if patch_size is not None:
    arch.patches.size = tuple(patch_size) if isinstance(patch_size, tuple) else (patch_size,) * 2
  for option, value in (block or {}).items():
    if value is not None:
      arch.transformer[option] = value
  if drop_path:
    arch.transformer.drop_path_rate = drop_path
  return arch


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """A model as everything that builds, loads, exports or feeds it needs it.

  `architecture` holds `VisionTransformer`'s keywords (`VisionTransformer(num_classes=...,
  **spec.architecture)`); the rest is what the model's shapes follow from.
  """

  architecture: ml_collections.FrozenConfigDict
  image_size: int  # px per side: a run's pp.crop; a checkpoint's, from its position embeddings
  # NaFlex (`models.naflex`): the (rows, columns) of its learned 2D position table; None for a
  # ViT, whose position embeddings are one row per token.
  posemb_grid: Optional[Tuple[int, int]] = None
  naflex_tokens: Tuple[int, ...] = ()  # the token budgets a NaFlex run trains at

  @classmethod
  def of(cls, config) -> 'ModelSpec':
    """The model of a run's `config`; ConfigError (one line) for one it cannot have: a crop
    that the patches do not tile, NaFlex of a hybrid or of another pooling."""
    arch = resolve(
      config.model,
      num_layers=config.depth,
      patch_size=config.patch_size,
      num_registers=config.num_registers,
      representation_size=config.representation_size,
      dropout=(config.dropout_rate, config.attention_dropout_rate),
      block=dict(config.block),
      drop_path=config.get('drop_path_rate', 0.0),
    )
    only = [option for option in VIT_ONLY_OPTIONS if arch.get(option)]
    other = 'NaFlex (naflex_tokens)' if config.naflex_tokens else 'task=mpp'
    if only and (config.naflex_tokens or config.task == 'mpp'):
      raise ConfigError(
        f'{config.model} sets {", ".join(only)}, which {other} does not build (its model is '
        "the paper's ViT and registers); fine-tune it as a ViT, or pick a model without them"
      )
    crop = config.pp.crop
    step = stride(arch)
    if crop % step:
      lower, upper = crop - crop % step, crop - crop % step + step
      raise ConfigError(
        f'pp.crop={crop} is not a multiple of the {step} px that one patch of {config.model} '
        f'covers: the last {crop % step} px of each row and column would be dropped; use '
        f'--config.pp.crop={upper}' + (f' or {lower}' if lower else '')
      )
    posemb_grid = None
    if config.naflex_tokens:
      _check_naflex(arch, f'naflex_tokens={tuple(config.naflex_tokens)}')
      posemb_grid = (crop // step, crop // step)
      arch.posemb_resample = config.naflex_resample
    return cls(
      ml_collections.FrozenConfigDict(arch), crop, posemb_grid, tuple(config.naflex_tokens)
    )

  @property
  def name(self) -> str:
    return self.architecture.model_name

  @property
  def patch_size(self) -> int:
    return self.architecture.patches.size[0]

  @property
  def stride(self) -> int:
    """Input pixels per token step (`stride`): the patch size, or a hybrid's."""
    return stride(self.architecture)

  @property
  def num_prefix_tokens(self) -> int:
    return prefix_tokens(self.architecture.classifier, self.architecture.get('num_registers', 0))

  @property
  def posemb_prefix(self) -> int:
    """The prefix tokens with position embeddings (`embedded_prefix`)."""
    return embedded_prefix(self.architecture)

  @property
  def grid(self) -> int:
    """Patches per side at `image_size`."""
    return self.image_size // self.stride

  @property
  def naflex(self) -> bool:
    return self.posemb_grid is not None

  @property
  def hybrid(self) -> bool:
    return self.architecture.get('resnet') is not None

  def changed(self, **parts) -> 'ModelSpec':
    """This spec with architecture entries replaced (`patches`, `num_registers`, ...)."""
    arch = self.architecture.as_configdict()
    for key, value in parts.items():
      arch[key] = value
    return dataclasses.replace(self, architecture=ml_collections.FrozenConfigDict(arch))


def _check_naflex(arch, what: str) -> None:
  unsupported = [
    (arch.classifier not in NAFLEX_CLASSIFIERS, f'classifier={arch.classifier!r}'),
    (arch.get('resnet') is not None, 'a hybrid'),
  ]
  for bad, which in unsupported:
    if bad:
      raise ConfigError(
        f'{what}: NaFlex trains a plain ViT with token or gap pooling, not {which}; change '
        'the model or leave naflex_tokens empty'
      )
