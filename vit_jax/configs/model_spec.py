"""The model of a run or of a checkpoint, typed and resolved once: `Architecture`, `Block`,
`Compute` and the `ModelSpec` that carries them.

- `Block`: what every encoder block computes. Its choices are slots, each one value of a
  closed set (`MLPS`, `BIASES`), so that no two options can contradict each other.
- `Architecture`: the whole model as its parameters and outputs follow from it: width,
  depth, patches, the block, pooling, prefix tokens, the position table, rotary embeddings,
  the norms around the encoder, input statistics, a hybrid's ResNet, pre-logits.
- `Compute`: how the model runs (dtype, attention implementation, FP8, remat, scan, padding
  of odd token counts): built once from a run's config and handed to the model; never part of
  a checkpoint.
- `ModelSpec`: an architecture at a resolution (and NaFlex's token budgets), built once and
  handed down to what builds, loads, exports or feeds the model.

The registry (`architectures.MODEL_CONFIGS`) keeps the official vit_jax format, a ConfigDict
of `VisionTransformer`'s keywords; `Architecture.of` converts one once. Defaults live in these
declarations alone.
"""

import dataclasses
from typing import Any, Optional, Tuple

import ml_collections

from vit_jax.configs import ConfigError
from vit_jax.configs import architectures
from vit_jax.configs import schema

# The MLP slot: the original code's tanh approximation of GELU, the exact GELU (timm's default,
# with which DINOv2, DeiT III, SigLIP and CLIP run there), OpenAI CLIP's x * sigmoid(1.702 x),
# or SwiGLU (Shazeer 2020: the first layer twice as wide, silu(gate) * value).
MLPS = ('gelu_tanh', 'gelu', 'quick_gelu', 'swiglu')
# The biases slot: everywhere (the paper), none in the keys' projection (EVA-02: with rotary
# embeddings a key bias is rotated per position), none in the q/k/v projections (DINOv3), none
# there and in the LayerNorms (ViT-22B); a run's config may set it (`block.biases`).
BIASES = schema.allowed('block.biases')
# The encoder's normalisation layers (every one the block's options make: the blocks', the q/k
# norms, the MLP's, pre-norm, the final norm): LayerNorm (the paper), or RMSNorm (Zhang and
# Sennrich 2019: x / rms(x) * scale, no centring and no bias, whatever the biases slot says).
NORMS = ('layer', 'rms')
# Pooling: the class token (paper 3.1), the mean token, the mean of the patches behind a class
# token, multi-head attention pooling (big_vision's MAP head), or every token.
CLASSIFIERS = ('token', 'gap', 'map', 'unpooled', 'token_unpooled', 'token_gap')
# The position table: a learned row per token, prefix tokens included (paper 3.1); a row per
# patch, the prefix tokens without one (timm's `no_embed_class`: DINOv2 with registers, DeiT
# III); NaFlex's 2D table of `posemb_grid`, resampled to each image's grid, the prefix without
# one; or no absolute table at all.
POSEMBS = ('tokens', 'patches', 'grid', 'none')
# Rotary embeddings named by their scheme rather than a reference grid: DINOv3's.
ROTARIES = ('normalised',)
# Where the final LayerNorm acts: on every token (`encoder_norm`), or on the pooled
# representation (`fc_norm`: EVA-02, timm's gap models).
FINAL_NORMS = ('tokens', 'pooled')
# The pooling a NaFlex ViT takes (`models.naflex`): the class token, the mean of the real
# patches, or the MAP head over them (SigLIP 2); the others read token positions that differ
# from image to image.
NAFLEX_CLASSIFIERS = ('token', 'gap', 'map')
# What a run's config may change of the block (`schema.FIELDS`' `block.*`): fields of `Block`.
BLOCK_OPTIONS = tuple(f.name[len('block.') :] for f in schema.FIELDS if f.name.startswith('block.'))


def _one_of(what: str, value, allowed) -> None:
  if value not in allowed:
    raise ConfigError(f'{what}={value!r}: use one of {", ".join(map(repr, allowed))}')


@dataclasses.dataclass(frozen=True)
class Block:
  """One encoder block (paper eq. 2-3 and the variants of later ViTs)."""

  mlp_dim: int
  num_heads: int
  dropout_rate: float = 0.0
  attention_dropout_rate: float = 0.0
  mlp: str = 'gelu_tanh'  # MLPS
  mlp_norm: bool = False  # EVA-02's sub-LN: a LayerNorm of the MLP's hidden layer
  biases: str = 'all'  # BIASES
  qk_norm: bool = False  # ViT-22B: LayerNorm of queries and keys per head
  parallel_block: bool = False  # ViT-22B: attention and MLP read one LayerNorm, added together
  layer_scale: Optional[float] = None  # LayerScale's initial gamma (CaiT); None: none
  norm_eps: float = 1e-6  # every LayerNorm's epsilon (the original code's; CLIP: 1e-5)
  norm: str = 'layer'  # NORMS: the encoder's normalisation layers
  # Stochastic depth (Huang et al. 2016; DINOv2 trains with it): in training each residual
  # branch is dropped for an example with this probability, kept ones scaled by 1 / (1 - p).
  drop_path_rate: float = 0.0

  def __post_init__(self):
    _one_of('mlp', self.mlp, MLPS)
    _one_of('biases', self.biases, BIASES)
    _one_of('norm', self.norm, NORMS)


@dataclasses.dataclass(frozen=True)
class ResNet:
  """A hybrid's BiT ResNet stem (paper 3.1 "Hybrid Architecture")."""

  num_layers: Tuple[int, ...]  # units per stage; () is the root alone (R+ViT-Ti_16)
  width_factor: float = 1


@dataclasses.dataclass(frozen=True)
class Architecture:
  """A ViT: everything its parameters and outputs follow from, at any resolution."""

  name: Optional[str]  # the registry's name (timm's for the newer families)
  hidden_size: int
  num_layers: int
  patch_size: Tuple[int, int]
  block: Block
  classifier: str = 'token'  # CLASSIFIERS
  num_registers: int = 0  # register tokens after the class token (Darcet et al. 2023)
  posemb: str = 'tokens'  # POSEMBS
  posemb_grid: Optional[Tuple[int, int]] = None  # posemb='grid': the table's rows, columns
  # posemb='grid': how the table meets each image's grid (`models.positions.NAFLEX_RESAMPLE`)
  posemb_resample: str = 'bilinear'
  # Rotary embeddings (`models.rotary`): measured on this (rows, columns) reference grid
  # (EVA-02), or 'normalised' (DINOv3: patch centres on [-1, 1] per axis, channel k paired with
  # k + head_dim / 2); None: none.
  rotary: Optional[Any] = None
  pre_norm: bool = False  # CLIP: a LayerNorm of the embedded tokens, no patch-embedding bias
  final_norm: str = 'tokens'  # FINAL_NORMS
  # (mean, std) per channel of pixels in [0, 1] that the weights take; None: [-1, 1] as given.
  input_stats: Optional[Tuple[Tuple[float, ...], Tuple[float, ...]]] = None
  resnet: Optional[ResNet] = None
  representation_size: Optional[int] = None  # the pre-logits width (paper 3.1); None: none

  def __post_init__(self):
    _one_of('classifier', self.classifier, CLASSIFIERS)
    _one_of('posemb', self.posemb, POSEMBS)
    _one_of('final_norm', self.final_norm, FINAL_NORMS)
    grid = isinstance(self.rotary, tuple) and len(self.rotary) == 2
    if self.rotary is not None and not grid and self.rotary not in ROTARIES:
      raise ConfigError(
        f'rotary={self.rotary!r}: use a (rows, columns) reference grid (EVA-02) or one of '
        f'{", ".join(map(repr, ROTARIES))}'
      )
    if (self.posemb == 'grid') != (self.posemb_grid is not None):
      raise ConfigError(
        f"posemb={self.posemb!r} with posemb_grid={self.posemb_grid}: NaFlex's 2D table "
        "(posemb='grid') and its grid come together"
      )
    if self.posemb != 'grid' and self.posemb_resample != 'bilinear':
      raise ConfigError(
        f'posemb_resample={self.posemb_resample!r} resamples a NaFlex table, and '
        f'posemb={self.posemb!r} has none'
      )
    if self.posemb == 'patches' and not self.num_prefix_tokens:
      raise ConfigError(
        f"posemb='patches' leaves the prefix tokens out of the table, and classifier="
        f"{self.classifier!r} with {self.num_registers} registers has none; use posemb='tokens'"
      )

  @classmethod
  def of(cls, entry) -> 'Architecture':
    """The architecture of a registry entry (the official format: `hidden_size`, `patches`,
    `transformer`, `classifier`, ...; a ConfigDict or dict). Keys it does not know are a
    ConfigError naming them."""
    entry = dict(entry)
    transformer = dict(entry.pop('transformer'))
    patch = tuple(dict(entry.pop('patches'))['size'])
    resnet = entry.pop('resnet', None)
    if resnet is not None:
      resnet = ResNet(tuple(resnet['num_layers']), resnet['width_factor'])
    stats = entry.pop('input_stats', None)
    if stats is not None:
      stats = tuple(tuple(float(v) for v in part) for part in stats)
    for key in ('posemb_grid', 'rotary'):
      if entry.get(key) is not None and not isinstance(entry[key], str):
        entry[key] = tuple(entry[key])
    known = {f.name for f in dataclasses.fields(cls)} - {'name', 'block', 'num_layers'}
    unknown = sorted(set(entry) - known - {'model_name'}) + sorted(
      set(transformer) - {f.name for f in dataclasses.fields(Block)} - {'num_layers'}
    )
    if unknown:
      raise ConfigError(f'model config: unknown option(s) {", ".join(unknown)}')
    num_layers = transformer.pop('num_layers')
    return cls(
      name=entry.pop('model_name', None),
      num_layers=num_layers,
      patch_size=patch,
      block=Block(**transformer),
      resnet=resnet,
      input_stats=stats,
      **entry,
    )

  def as_config(self) -> ml_collections.ConfigDict:
    """The official format of this architecture (`VisionTransformer`'s keywords): what
    `Architecture.of` reads, with only the fields that differ from their defaults."""
    entry = {
      'model_name': self.name,
      'patches': {'size': self.patch_size},
      'hidden_size': self.hidden_size,
      'transformer': {'num_layers': self.num_layers, **_changed(self.block, ('mlp_dim',))},
      'classifier': self.classifier,
      'representation_size': self.representation_size,
    }
    entry['transformer'].update(mlp_dim=self.block.mlp_dim, num_heads=self.block.num_heads)
    rest = _changed(self, ('name', 'hidden_size', 'num_layers', 'patch_size', 'block'))
    rest.pop('classifier', None)
    rest.pop('representation_size', None)
    if self.resnet is not None:
      rest['resnet'] = dataclasses.asdict(self.resnet)
    entry.update(rest)
    return ml_collections.ConfigDict(entry)

  @property
  def has_class_token(self) -> bool:
    """Whether the class token is prepended (paper 3.1)."""
    return self.classifier in ('token', 'token_unpooled', 'token_gap')

  @property
  def num_prefix_tokens(self) -> int:
    """The tokens before the patches: the class token, then the registers."""
    return int(self.has_class_token) + self.num_registers

  @property
  def posemb_prefix(self) -> int:
    """The prefix tokens that have rows in the 1D position table: all of them
    (posemb='tokens'), else none."""
    return self.num_prefix_tokens if self.posemb == 'tokens' else 0

  @property
  def stride(self) -> int:
    """Input pixels per token step: the patch size, times the hybrid's ResNet stride (root conv
    /2 and max-pool /2, then /2 in every stage after the first; R+ViT-Ti_16 has the root only)."""
    if self.resnet is not None:
      return self.patch_size[0] * 4 * 2 ** max(len(self.resnet.num_layers) - 1, 0)
    return self.patch_size[0]

  @property
  def head_dim(self) -> int:
    return self.hidden_size // self.block.num_heads

  def changed(self, **fields) -> 'Architecture':
    """This architecture with `fields` replaced; `Block` fields by name too."""
    block = {k: fields.pop(k) for k in list(fields) if k in _BLOCK_FIELDS}
    if block:
      fields['block'] = dataclasses.replace(fields.get('block', self.block), **block)
    return dataclasses.replace(self, **fields)


_BLOCK_FIELDS = frozenset(f.name for f in dataclasses.fields(Block))


def _changed(obj, leave_out=()) -> dict:
  """The fields of dataclass `obj` whose values differ from the declared defaults."""
  return {
    f.name: getattr(obj, f.name)
    for f in dataclasses.fields(obj)
    if f.name not in leave_out
    and (f.default is dataclasses.MISSING or getattr(obj, f.name) != f.default)
  }


@dataclasses.dataclass(frozen=True)
class Compute:
  """How a model runs; none of it changes the parameters or what they mean.

  `dtype`: what every layer computes in (parameters stay float32); `attention`: the
  implementation (`schema.allowed('attention')`: 'auto' takes cuDNN's fused kernel where it
  applies); `fp8`: the encoder's dense layers as FP8 products (`models.fp8`); `remat` with
  `remat_policy` (a `jax.checkpoint_policies` name): blocks recomputed in the backward pass;
  `scan`: the blocks as one `nn.scan`; `pad_odd`: whether an odd token count is padded to even
  (None: where attention runs on cuDNN, whose backward pass refuses odd counts);
  `attention_chunk`: the written-out attention takes this many queries at a time, recomputing
  their logits in the backward pass (0: all at once; `attention.chunked_attention`).
  """

  dtype: Any = 'float32'
  attention: str = 'auto'
  fp8: bool = False
  remat: bool = False
  remat_policy: str = 'nothing_saveable'
  scan: bool = False
  pad_odd: Optional[bool] = None
  attention_chunk: int = 0

  @classmethod
  def of(cls, config) -> 'Compute':
    """The compute options of a run's config."""
    return cls(
      dtype=config.dtype,
      attention=config.attention,
      fp8=config.fp8,
      remat=config.remat,
      remat_policy=config.remat_policy,
      scan=config.scan_layers,
      attention_chunk=config.attention_chunk,
    )


def registered(name: str) -> Architecture:
  """Registry entry `name` as an `Architecture`; an unknown name is UnknownModelError (one
  line, with the closest names)."""
  return Architecture.of(architectures.MODEL_CONFIGS[name])


def resolve(
  name: str,
  *,
  num_layers: Optional[int] = None,
  patch_size=None,
  num_registers: int = 0,
  representation_size: Optional[int] = None,
  dropout: Optional[Tuple[float, float]] = None,
  block: Optional[dict] = None,
  drop_path: Optional[float] = None,
) -> Architecture:
  """Registry entry `name` with the given parts changed (None: the entry's own): the depth, the
  patch size (FlexiViT; a number, or (rows, columns)), register tokens, the pre-logits width,
  (dropout, attention dropout), `Block` fields (a None value keeps the entry's) and stochastic
  depth (`Block.drop_path_rate`)."""
  arch = registered(name)
  changes = {k: v for k, v in (block or {}).items() if v is not None}
  if dropout is not None:
    changes.update(dropout_rate=dropout[0], attention_dropout_rate=dropout[1])
  if drop_path is not None:
    changes['drop_path_rate'] = drop_path
  if representation_size is not None:
    changes['representation_size'] = representation_size
  if num_layers is not None:
    changes['num_layers'] = num_layers
  if num_registers:
    changes['num_registers'] = num_registers
  if patch_size is not None:
    changes['patch_size'] = (
      tuple(patch_size) if isinstance(patch_size, tuple) else (patch_size,) * 2
    )
  return arch.changed(**changes)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """A model as everything that builds, loads, exports or feeds it needs it: its
  `Architecture` at a resolution."""

  architecture: Architecture
  image_size: int  # px per side: a run's pp.crop; a checkpoint's, from its position embeddings
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
      drop_path=config.drop_path_rate,
    )
    crop = config.pp.crop
    step = arch.stride
    if crop % step:
      lower, upper = crop - crop % step, crop - crop % step + step
      raise ConfigError(
        f'pp.crop={crop} is not a multiple of the {step} px that one patch of {config.model} '
        f'covers: the last {crop % step} px of each row and column would be dropped; use '
        f'--config.pp.crop={upper}' + (f' or {lower}' if lower else '')
      )
    if arch.posemb == 'grid' and not config.naflex_tokens:
      raise ConfigError(
        f'{config.model} is a NaFlex model (2D position table): set --config.naflex_tokens, '
        'the token budgets it trains at (e.g. 256,576)'
      )
    if config.naflex_tokens:
      arch = naflex_of(arch, (crop // step,) * 2, config.naflex_resample)
    elif config.task == 'mpp':
      check_plain(arch, 'task=mpp')
    return cls(arch, crop, tuple(config.naflex_tokens))

  @property
  def name(self) -> str:
    return self.architecture.name

  @property
  def patch_size(self) -> int:
    return self.architecture.patch_size[0]

  @property
  def stride(self) -> int:
    """Input pixels per token step (`Architecture.stride`)."""
    return self.architecture.stride

  @property
  def num_prefix_tokens(self) -> int:
    return self.architecture.num_prefix_tokens

  @property
  def posemb_prefix(self) -> int:
    return self.architecture.posemb_prefix

  @property
  def grid(self) -> int:
    """Patches per side at `image_size`."""
    return self.image_size // self.stride

  @property
  def naflex(self) -> bool:
    return self.architecture.posemb == 'grid'

  @property
  def hybrid(self) -> bool:
    return self.architecture.resnet is not None

  def changed(self, **fields) -> 'ModelSpec':
    """This spec with architecture fields replaced (`Architecture.changed`)."""
    return dataclasses.replace(self, architecture=self.architecture.changed(**fields))


# What only `models.VisionTransformer` builds: the options of the newer families
# (`configs.families`) that NaFlex's and masked patch prediction's models do not take.
_VIT_ONLY = (
  ('posemb', 'tokens'),
  ('rotary', None),
  ('pre_norm', False),
  ('final_norm', 'tokens'),
  ('input_stats', None),
)


def check_plain(arch: Architecture, what: str) -> None:
  """ConfigError unless `arch` uses none of the options only `VisionTransformer` builds."""
  only = [k for k, default in _VIT_ONLY if getattr(arch, k) != default]
  if only:
    raise ConfigError(
      f'{arch.name} sets {", ".join(only)}, which {what} does not build (its model is the '
      "paper's ViT and registers); fine-tune it as a ViT, or pick a model without them"
    )


def naflex_of(arch: Architecture, grid: Tuple[int, int], resample: str) -> Architecture:
  """`arch` as a NaFlex ViT with a 2D position table of `grid`; ConfigError for a model NaFlex
  cannot be (another pooling, a hybrid, an option only the ViT builds)."""
  what = 'NaFlex (naflex_tokens)'
  # A NaFlex model of timm's (SigLIP 2's) has the 2D table already: a new grid replaces it.
  plain = arch.changed(posemb='tokens', posemb_grid=None, posemb_resample='bilinear')
  check_plain(plain if arch.posemb == 'grid' else arch, what)
  for bad, which in (
    (arch.classifier not in NAFLEX_CLASSIFIERS, f'classifier={arch.classifier!r}'),
    (arch.resnet is not None, 'a hybrid'),
  ):
    if bad:
      raise ConfigError(
        f'{what}: NaFlex trains a plain ViT with token, gap or MAP pooling, not {which}; change '
        'the model or leave naflex_tokens empty'
      )
  return arch.changed(posemb='grid', posemb_grid=tuple(grid), posemb_resample=resample)
