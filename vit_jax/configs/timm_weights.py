"""Each timm file's own preprocessing: what timm's `pretrained_cfg` of its `name.tag` says.

timm (1.0) keeps preprocessing with the weights, not with the architecture: one name has tags
of other statistics or crops (`vit_large_patch14_clip_224.openai` takes OpenAI CLIP's mean and
std, its default tag `laion2b_ft_in12k_in1k` 0.5 and 0.5). A `Preprocessing` is one tag's:
the pixel statistics that the model normalises its input with, and timm's evaluation
transform (`timm.data.create_transform` of `resolve_data_config`): the shorter side resized to
floor(size / crop_pct) with `interpolation` (PIL's, as torchvision applies it to PIL images),
the centre `size` x `size` cropped; `crop_mode='squash'` resizes both sides to that length
instead. A converted timm file records its `Preprocessing` (`interop.export`), and predict,
evaluate, few-shot and a run fine-tuned from it apply it; the paper's models keep the official
resize (`data.images.eval_image`).

`WEIGHTS` holds every tag timm 1.0 registers for the models of `configs.families`
(tests/test_families.py walks timm's registry and holds the two equal); `PAPER_WEIGHTS` those
of timm's names for the paper's models, whose statistics say which of them are the paper's
weights ([-1, 1] pixels: mean = std = 0.5).
"""

import dataclasses
import math
from typing import Dict, List, Optional, Tuple

# Pixel statistics of [0, 1] pixels: (mean, std) per channel.
STATISTICS = {
  'imagenet': ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
  'openai_clip': (
    (0.48145466, 0.4578275, 0.40821073),
    (0.26862954, 0.26130258, 0.27577711),
  ),
  'half': ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),  # [-1, 1]: the paper's models, SigLIP
  'sat493m': ((0.43, 0.411, 0.296), (0.213, 0.156, 0.143)),  # DINOv3's satellite weights
}

# How the docs and messages name them.
STATISTICS_TITLES = {
  'imagenet': "ImageNet's mean and std",
  'openai_clip': "OpenAI CLIP's mean and std",
  'half': '[-1, 1] pixels (mean = std = 0.5)',
  'sat493m': "SAT-493M's mean and std",
}

CROP_MODES = ('center', 'squash')
DEFAULT_CROP_PCT = 0.875  # timm's, for a config.json that records none


@dataclasses.dataclass(frozen=True)
class Preprocessing:
  """One timm `name.tag`'s preprocessing (see the module's docstring)."""

  weights: str  # timm's 'name.tag'; 'name' where every tag the file may be shares it
  mean: Tuple[float, ...]
  std: Tuple[float, ...]
  size: int  # px per side of the crop
  crop_pct: float
  interpolation: str = 'bicubic'
  crop_mode: str = 'center'

  @property
  def scale_size(self) -> int:
    """timm's resize target: floor(size / crop_pct) px (the shorter side, or both: 'squash')."""
    return math.floor(self.size / self.crop_pct)

  @property
  def input_stats(self) -> Optional[Tuple[tuple, tuple]]:
    """`Architecture.input_stats` of weights of this preprocessing: (mean, std); None for
    [-1, 1] pixels, what every model here takes."""
    if (self.mean, self.std) == STATISTICS['half']:
      return None
    return self.mean, self.std

  def at(self, size: int) -> 'Preprocessing':
    """The same transform cropping `size` px (a checkpoint or run at another resolution)."""
    return dataclasses.replace(self, size=int(size))

  def line(self) -> str:
    """The preprocessing in one line, as conversion and prediction show it."""
    resize = (
      f'both sides to {self.scale_size} px'
      if self.crop_mode == 'squash'
      else f'the shorter side to {self.scale_size} px'
    )
    return (
      f'preprocessing of {self.weights}: resize {resize} ({self.interpolation}, crop_pct '
      f'{self.crop_pct:g}), centre crop {self.size} px, mean {_numbers(self.mean)}, std '
      f'{_numbers(self.std)}'
    )

  def named(self, weights: str) -> 'Preprocessing':
    return dataclasses.replace(self, weights=weights)

  def summary(self) -> str:
    """Its statistics and crop, in a few words (the tags a file may be, told apart)."""
    squash = ', squash' if self.crop_mode == 'squash' else ''
    return (
      f'mean {_numbers(self.mean)}, std {_numbers(self.std)}, crop_pct {self.crop_pct:g}{squash}'
    )

  def to_json(self) -> dict:
    return dataclasses.asdict(self)

  @classmethod
  def from_json(cls, data: dict) -> 'Preprocessing':
    fields = {f.name for f in dataclasses.fields(cls)}
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items() if k in fields}
    return cls(**values)


def _numbers(values) -> str:
  return '(' + ', '.join(f'{v:g}' for v in values) + ')'


# timm name -> (input size, {tag: (statistics, crop_pct, head classes[, crop_mode])}), the
# first tag timm's default (what `timm.create_model(name, pretrained=True)` loads). Every
# interpolation is bicubic. A head of 0 classes: features only.
WEIGHTS = {
  'vit_small_patch14_dinov2': (518, {'lvd142m': ('imagenet', 1.0, 0)}),
  'vit_base_patch14_dinov2': (518, {'lvd142m': ('imagenet', 1.0, 0)}),
  'vit_large_patch14_dinov2': (518, {'lvd142m': ('imagenet', 1.0, 0)}),
  'vit_small_patch14_reg4_dinov2': (518, {'lvd142m': ('imagenet', 1.0, 0)}),
  'vit_base_patch14_reg4_dinov2': (518, {'lvd142m': ('imagenet', 1.0, 0)}),
  'vit_large_patch14_reg4_dinov2': (518, {'lvd142m': ('imagenet', 1.0, 0)}),
  'vit_giant_patch14_dinov2': (518, {'lvd142m': ('imagenet', 1.0, 0)}),
  'vit_giant_patch14_reg4_dinov2': (518, {'lvd142m': ('imagenet', 1.0, 0)}),
  'deit3_small_patch16_224': (
    224,
    {'fb_in1k': ('imagenet', 0.9, 1000), 'fb_in22k_ft_in1k': ('imagenet', 1.0, 1000)},
  ),
  'deit3_small_patch16_384': (
    384,
    {'fb_in1k': ('imagenet', 1.0, 1000), 'fb_in22k_ft_in1k': ('imagenet', 1.0, 1000)},
  ),
  'deit3_medium_patch16_224': (
    224,
    {'fb_in1k': ('imagenet', 0.9, 1000), 'fb_in22k_ft_in1k': ('imagenet', 1.0, 1000)},
  ),
  'deit3_base_patch16_224': (
    224,
    {'fb_in1k': ('imagenet', 0.9, 1000), 'fb_in22k_ft_in1k': ('imagenet', 1.0, 1000)},
  ),
  'deit3_base_patch16_384': (
    384,
    {'fb_in1k': ('imagenet', 1.0, 1000), 'fb_in22k_ft_in1k': ('imagenet', 1.0, 1000)},
  ),
  'deit3_large_patch16_224': (
    224,
    {'fb_in1k': ('imagenet', 0.9, 1000), 'fb_in22k_ft_in1k': ('imagenet', 1.0, 1000)},
  ),
  'deit3_large_patch16_384': (
    384,
    {'fb_in1k': ('imagenet', 1.0, 1000), 'fb_in22k_ft_in1k': ('imagenet', 1.0, 1000)},
  ),
  'deit3_huge_patch14_224': (
    224,
    {'fb_in1k': ('imagenet', 0.9, 1000), 'fb_in22k_ft_in1k': ('imagenet', 1.0, 1000)},
  ),
  'vit_base_patch16_siglip_224': (224, {'v2_webli': ('half', 0.9, 0), 'webli': ('half', 0.9, 0)}),
  'vit_base_patch16_siglip_256': (
    256,
    {'v2_webli': ('half', 0.9, 0), 'webli': ('half', 0.9, 0), 'webli_i18n': ('half', 0.9, 0)},
  ),
  'vit_base_patch16_siglip_384': (384, {'v2_webli': ('half', 0.9, 0), 'webli': ('half', 0.9, 0)}),
  'vit_base_patch16_siglip_512': (512, {'v2_webli': ('half', 0.9, 0), 'webli': ('half', 0.9, 0)}),
  'vit_large_patch16_siglip_256': (256, {'v2_webli': ('half', 0.9, 0), 'webli': ('half', 0.9, 0)}),
  'vit_large_patch16_siglip_384': (384, {'v2_webli': ('half', 0.9, 0), 'webli': ('half', 0.9, 0)}),
  'vit_so400m_patch14_siglip_224': (224, {'v2_webli': ('half', 0.9, 0), 'webli': ('half', 0.9, 0)}),
  'vit_so400m_patch14_siglip_384': (384, {'webli': ('half', 0.9, 0)}),
  'vit_so400m_patch16_siglip_256': (
    256,
    {'v2_webli': ('half', 0.9, 0), 'webli_i18n': ('half', 0.9, 0)},
  ),
  'vit_so400m_patch16_siglip_384': (384, {'v2_webli': ('half', 0.9, 0)}),
  'vit_base_patch32_clip_224': (
    224,
    {
      'laion2b_ft_in12k_in1k': ('openai_clip', 0.9, 1000),
      'openai_ft_in12k_in1k': ('openai_clip', 0.9, 1000),
      'laion2b_ft_in1k': ('openai_clip', 0.9, 1000),
      'openai_ft_in1k': ('openai_clip', 0.9, 1000),
      'laion2b': ('openai_clip', 0.9, 512),
      'laion400m_e32': ('openai_clip', 0.9, 512),
      'datacompxl': ('openai_clip', 1.0, 512),
      'metaclip_2pt5b': ('openai_clip', 1.0, 512),
      'metaclip_400m': ('openai_clip', 1.0, 512),
      'openai': ('openai_clip', 0.9, 512),
    },
  ),
  'vit_base_patch16_clip_224': (
    224,
    {
      'laion2b_ft_in12k_in1k': ('openai_clip', 0.95, 1000),
      'openai_ft_in12k_in1k': ('openai_clip', 0.95, 1000),
      'laion2b_ft_in1k': ('openai_clip', 1.0, 1000),
      'openai_ft_in1k': ('openai_clip', 0.9, 1000),
      'laion2b_ft_in12k': ('openai_clip', 0.9, 11821),
      'openai_ft_in12k': ('openai_clip', 0.9, 11821),
      'laion2b': ('openai_clip', 1.0, 512),
      'laion400m_e32': ('openai_clip', 1.0, 512),
      'datacompxl': ('openai_clip', 1.0, 512),
      'dfn2b': ('openai_clip', 1.0, 512),
      'metaclip_2pt5b': ('openai_clip', 1.0, 512),
      'metaclip_400m': ('openai_clip', 1.0, 512),
      'openai': ('openai_clip', 0.9, 512),
    },
  ),
  'vit_large_patch14_clip_224': (
    224,
    {
      'laion2b_ft_in12k_in1k': ('half', 1.0, 1000),
      'openai_ft_in12k_in1k': ('openai_clip', 1.0, 1000),
      'laion2b_ft_in1k': ('half', 1.0, 1000),
      'openai_ft_in1k': ('openai_clip', 1.0, 1000),
      'laion2b_ft_in12k': ('half', 1.0, 11821),
      'openai_ft_in12k': ('openai_clip', 1.0, 11821),
      'laion2b': ('half', 1.0, 768),
      'laion400m_e32': ('openai_clip', 1.0, 768),
      'datacompxl': ('openai_clip', 1.0, 768),
      'dfn2b_s39b': ('openai_clip', 1.0, 768),
      'dfn2b': ('openai_clip', 1.0, 768),
      'metaclip_2pt5b': ('openai_clip', 1.0, 768),
      'metaclip_400m': ('openai_clip', 1.0, 768),
      'openai': ('openai_clip', 1.0, 768),
      'apple_mclip2_dfndr2b': ('openai_clip', 1.0, 768),
    },
  ),
  'vit_huge_patch14_clip_224': (
    224,
    {
      'laion2b_ft_in12k_in1k': ('openai_clip', 1.0, 1000),
      'laion2b_ft_in1k': ('openai_clip', 1.0, 1000),
      'laion2b_ft_in12k': ('openai_clip', 1.0, 11821),
      'laion2b': ('openai_clip', 1.0, 1024),
      'dfn5b': ('openai_clip', 1.0, 1024),
      'metaclip2_worldwide': ('openai_clip', 1.0, 1024),
      'metaclip_2pt5b': ('openai_clip', 1.0, 1024),
      'metaclip_altogether': ('openai_clip', 1.0, 1024),
    },
  ),
  'vit_base_patch32_clip_quickgelu_224': (
    224,
    {
      'laion400m_e32': ('openai_clip', 0.9, 512),
      'metaclip_2pt5b': ('openai_clip', 1.0, 512),
      'metaclip_400m': ('openai_clip', 1.0, 512),
      'openai': ('openai_clip', 0.9, 512),
    },
  ),
  'vit_base_patch16_clip_quickgelu_224': (
    224,
    {
      'metaclip_2pt5b': ('openai_clip', 1.0, 512),
      'metaclip_400m': ('openai_clip', 1.0, 512),
      'openai': ('openai_clip', 0.9, 512),
    },
  ),
  'vit_large_patch14_clip_quickgelu_224': (
    224,
    {
      'dfn2b': ('openai_clip', 1.0, 768),
      'metaclip_2pt5b': ('openai_clip', 1.0, 768),
      'metaclip_400m': ('openai_clip', 1.0, 768),
      'openai': ('openai_clip', 1.0, 768),
    },
  ),
  'eva02_tiny_patch14_224': (224, {'mim_in22k': ('openai_clip', 0.9, 0)}),
  'eva02_small_patch14_224': (224, {'mim_in22k': ('openai_clip', 0.9, 0)}),
  'eva02_base_patch14_224': (224, {'mim_in22k': ('openai_clip', 0.9, 0)}),
  'eva02_large_patch14_224': (
    224,
    {'mim_in22k': ('openai_clip', 0.9, 0), 'mim_m38m': ('openai_clip', 0.9, 0)},
  ),
  'deit_base_patch16_224': (224, {'fb_in1k': ('imagenet', 0.9, 1000)}),
  'deit_base_patch16_384': (384, {'fb_in1k': ('imagenet', 1.0, 1000)}),
  'deit_small_patch16_224': (224, {'fb_in1k': ('imagenet', 0.9, 1000)}),
  'deit_tiny_patch16_224': (224, {'fb_in1k': ('imagenet', 0.9, 1000)}),
  'vit_base_patch16_siglip_gap_224': (
    224,
    {'v2_webli': ('half', 0.9, 0), 'webli': ('half', 0.9, 0)},
  ),
  'vit_base_patch16_siglip_gap_256': (
    256,
    {'v2_webli': ('half', 0.9, 0), 'webli': ('half', 0.9, 0), 'webli_i18n': ('half', 0.9, 0)},
  ),
  'vit_base_patch16_siglip_gap_384': (
    384,
    {'v2_webli': ('half', 0.9, 0), 'webli': ('half', 0.9, 0)},
  ),
  'vit_base_patch16_siglip_gap_512': (
    512,
    {'v2_webli': ('half', 0.9, 0), 'webli': ('half', 0.9, 0)},
  ),
  'vit_base_patch32_siglip_gap_256': (256, {'v2_webli': ('half', 0.9, 0)}),
  'vit_giantopt_patch16_siglip_gap_256': (256, {'v2_webli': ('half', 0.9, 0)}),
  'vit_giantopt_patch16_siglip_gap_384': (384, {'v2_webli': ('half', 0.9, 0)}),
  'vit_large_patch16_siglip_gap_256': (
    256,
    {'v2_webli': ('half', 0.9, 0), 'webli': ('half', 0.9, 0)},
  ),
  'vit_large_patch16_siglip_gap_384': (
    384,
    {'v2_webli': ('half', 0.9, 0), 'webli': ('half', 0.9, 0)},
  ),
  'vit_large_patch16_siglip_gap_512': (512, {'v2_webli': ('half', 0.9, 0)}),
  'vit_so400m_patch14_siglip_gap_224': (
    224,
    {
      'v2_webli': ('half', 0.9, 0),
      'webli': ('half', 0.9, 0),
      'pali_mix': ('half', 0.9, 0),
      'pali_pt': ('half', 0.9, 0),
      'pali2_3b_pt': ('half', 0.9, 0),
      'pali2_10b_pt': ('half', 0.9, 0),
    },
  ),
  'vit_so400m_patch14_siglip_gap_378': (
    378,
    {
      'v2_webli': ('half', 0.9, 0),
      'webli': ('half', 1.0, 0),
      'webli_ft_in1k': ('half', 1.0, 1000, 'squash'),
    },
  ),
  'vit_so400m_patch14_siglip_gap_384': (384, {'webli': ('half', 1.0, 0)}),
  'vit_so400m_patch14_siglip_gap_448': (
    448,
    {
      'pali_mix': ('half', 1.0, 0),
      'pali_pt': ('half', 1.0, 0),
      'pali_refcoco_seg': ('half', 1.0, 0),
      'pali_ocrvqa': ('half', 1.0, 0),
      'pali2_3b_pt': ('half', 1.0, 0),
      'pali2_10b_pt': ('half', 1.0, 0),
      'pali2_3b_docci': ('half', 1.0, 0),
      'pali2_10b_docci': ('half', 1.0, 0),
    },
  ),
  'vit_so400m_patch14_siglip_gap_896': (
    896,
    {
      'pali_pt': ('half', 1.0, 0),
      'pali_refcoco_seg': ('half', 1.0, 0),
      'pali_ocrvqa': ('half', 1.0, 0),
      'pali2_3b_pt': ('half', 1.0, 0),
      'pali2_10b_pt': ('half', 1.0, 0),
    },
  ),
  'vit_so400m_patch16_siglip_gap_256': (
    256,
    {'v2_webli': ('half', 0.9, 0), 'webli_i18n': ('half', 0.9, 0)},
  ),
  'vit_so400m_patch16_siglip_gap_384': (384, {'v2_webli': ('half', 0.9, 0)}),
  'vit_so400m_patch16_siglip_gap_512': (512, {'v2_webli': ('half', 0.9, 0)}),
  'vit_7b_patch16_dinov3': (
    256,
    {'lvd1689m': ('imagenet', 1.0, 0), 'sat493m': ('sat493m', 1.0, 0)},
  ),
  'vit_base_patch16_dinov3': (256, {'lvd1689m': ('imagenet', 1.0, 0)}),
  'vit_base_patch16_dinov3_qkvb': (
    256,
    {'lvd1689m': ('imagenet', 1.0, 0), 'eupe_lvd1689m': ('imagenet', 1.0, 0)},
  ),
  'vit_huge_plus_patch16_dinov3': (256, {'lvd1689m': ('imagenet', 1.0, 0)}),
  'vit_huge_plus_patch16_dinov3_qkvb': (256, {'lvd1689m': ('imagenet', 1.0, 0)}),
  'vit_large_patch16_dinov3': (
    256,
    {'lvd1689m': ('imagenet', 1.0, 0), 'sat493m': ('sat493m', 1.0, 0)},
  ),
  'vit_large_patch16_dinov3_qkvb': (
    256,
    {'lvd1689m': ('imagenet', 1.0, 0), 'sat493m': ('sat493m', 1.0, 0)},
  ),
  'vit_small_patch16_dinov3': (256, {'lvd1689m': ('imagenet', 1.0, 0)}),
  'vit_small_patch16_dinov3_qkvb': (
    256,
    {'lvd1689m': ('imagenet', 1.0, 0), 'eupe_lvd1689m': ('imagenet', 1.0, 0)},
  ),
  'vit_small_plus_patch16_dinov3': (256, {'lvd1689m': ('imagenet', 1.0, 0)}),
  'vit_small_plus_patch16_dinov3_qkvb': (256, {'lvd1689m': ('imagenet', 1.0, 0)}),
  'vit_tiny_patch16_dinov3_qkvb': (256, {'eupe_lvd1689m': ('imagenet', 1.0, 0)}),
  'naflexvit_base_patch16_siglip': (384, {'v2_webli': ('half', 1.0, 0)}),
  'naflexvit_so400m_patch16_siglip': (384, {'v2_webli': ('half', 1.0, 0)}),
  'vit_base_patch32_siglip_256': (256, {'v2_webli': ('half', 0.9, 0)}),
  'vit_large_patch16_siglip_512': (512, {'v2_webli': ('half', 0.9, 0)}),
  'vit_so400m_patch14_siglip_378': (
    378,
    {
      'v2_webli': ('half', 0.9, 0),
      'webli': ('half', 0.9, 0),
      'webli_ft_in1k': ('half', 1.0, 1000, 'squash'),
    },
  ),
  'vit_so400m_patch16_siglip_512': (512, {'v2_webli': ('half', 0.9, 0)}),
  'vit_giantopt_patch16_siglip_256': (256, {'v2_webli': ('half', 0.9, 0)}),
  'vit_giantopt_patch16_siglip_384': (384, {'v2_webli': ('half', 0.9, 0)}),
  'vit_xsmall_patch16_clip_224': (224, {'tinyclip_yfcc15m': ('openai_clip', 0.9, 512)}),
  'vit_medium_patch32_clip_224': (224, {'tinyclip_laion400m': ('openai_clip', 0.9, 512)}),
  'vit_medium_patch16_clip_224': (224, {'tinyclip_yfcc15m': ('openai_clip', 0.9, 512)}),
  'vit_betwixt_patch32_clip_224': (224, {'tinyclip_laion400m': ('openai_clip', 0.9, 512)}),
  'vit_base_patch32_clip_256': (256, {'datacompxl': ('openai_clip', 1.0, 512)}),
  'vit_base_patch32_clip_384': (
    384,
    {
      'laion2b_ft_in12k_in1k': ('openai_clip', 1.0, 1000),
      'openai_ft_in12k_in1k': ('openai_clip', 0.95, 1000, 'squash'),
    },
  ),
  'vit_base_patch32_clip_448': (448, {'laion2b_ft_in12k_in1k': ('openai_clip', 1.0, 1000)}),
  'vit_base_patch16_clip_384': (
    384,
    {
      'laion2b_ft_in12k_in1k': ('openai_clip', 1.0, 1000, 'squash'),
      'laion2b_ft_in1k': ('openai_clip', 1.0, 1000, 'squash'),
      'openai_ft_in1k': ('openai_clip', 1.0, 1000, 'squash'),
      'openai_ft_in12k_in1k': ('openai_clip', 0.95, 1000, 'squash'),
    },
  ),
  'vit_base_patch16_plus_clip_240': (240, {'laion400m_e32': ('openai_clip', 1.0, 640)}),
  'vit_large_patch14_clip_336': (
    336,
    {
      'laion2b_ft_in12k_in1k': ('half', 1.0, 1000, 'squash'),
      'laion2b_ft_in1k': ('half', 1.0, 1000, 'squash'),
      'openai': ('openai_clip', 1.0, 768),
      'openai_ft_in12k_in1k': ('openai_clip', 1.0, 1000, 'squash'),
    },
  ),
  'vit_huge_patch14_clip_336': (
    336,
    {'laion2b_ft_in12k_in1k': ('openai_clip', 1.0, 1000, 'squash')},
  ),
  'vit_huge_patch14_clip_378': (
    378,
    {
      'dfn5b': ('openai_clip', 1.0, 1024),
      'metaclip2_worldwide': ('openai_clip', 1.0, 1024, 'squash'),
    },
  ),
  'vit_giant_patch14_clip_224': (224, {'laion2b': ('openai_clip', 1.0, 1024)}),
  'vit_gigantic_patch14_clip_224': (
    224,
    {
      'laion2b': ('openai_clip', 1.0, 1280),
      'metaclip2_worldwide': ('openai_clip', 1.0, 1280),
      'metaclip_2pt5b': ('openai_clip', 1.0, 1280),
    },
  ),
  'vit_gigantic_patch14_clip_378': (
    378,
    {'metaclip2_worldwide': ('openai_clip', 1.0, 1280, 'squash')},
  ),
  'vit_large_patch14_clip_quickgelu_336': (336, {'openai': ('openai_clip', 1.0, 768)}),
  'vit_huge_patch14_clip_quickgelu_224': (
    224,
    {
      'dfn5b': ('openai_clip', 1.0, 1024),
      'metaclip2_worldwide': ('openai_clip', 1.0, 1024),
      'metaclip_2pt5b': ('openai_clip', 1.0, 1024),
    },
  ),
  'vit_huge_patch14_clip_quickgelu_378': (378, {'dfn5b': ('openai_clip', 1.0, 1024)}),
  'vit_gigantic_patch14_clip_quickgelu_224': (224, {'metaclip_2pt5b': ('openai_clip', 1.0, 1280)}),
  'eva02_tiny_patch14_336': (336, {'mim_in22k_ft_in1k': ('openai_clip', 1.0, 1000)}),
  'eva02_small_patch14_336': (336, {'mim_in22k_ft_in1k': ('openai_clip', 1.0, 1000)}),
  'eva02_base_patch14_448': (
    448,
    {
      'mim_in22k_ft_in22k_in1k': ('openai_clip', 1.0, 1000, 'squash'),
      'mim_in22k_ft_in1k': ('openai_clip', 1.0, 1000),
      'mim_in22k_ft_in22k': ('openai_clip', 1.0, 21841, 'squash'),
    },
  ),
  'eva02_large_patch14_448': (
    448,
    {
      'mim_in22k_ft_in22k_in1k': ('openai_clip', 1.0, 1000, 'squash'),
      'mim_in22k_ft_in1k': ('openai_clip', 1.0, 1000),
      'mim_in22k_ft_in22k': ('openai_clip', 1.0, 21841, 'squash'),
      'mim_m38m_ft_in1k': ('openai_clip', 1.0, 1000),
      'mim_m38m_ft_in22k': ('openai_clip', 1.0, 21841, 'squash'),
      'mim_m38m_ft_in22k_in1k': ('openai_clip', 1.0, 1000, 'squash'),
    },
  ),
}

# The paper's models under timm's names (`interop.timm.TIMM_NAMES`), in the same layout.
PAPER_WEIGHTS = {
  'vit_tiny_patch16_224': (
    224,
    {'augreg_in21k_ft_in1k': ('half', 0.9, 1000), 'augreg_in21k': ('half', 0.9, 21843)},
  ),
  'vit_tiny_patch16_384': (384, {'augreg_in21k_ft_in1k': ('half', 1.0, 1000)}),
  'vit_small_patch16_224': (
    224,
    {
      'augreg_in21k_ft_in1k': ('half', 0.9, 1000),
      'augreg_in1k': ('half', 0.9, 1000),
      'augreg_in21k': ('half', 0.9, 21843),
      'dino': ('imagenet', 0.9, 0),
    },
  ),
  'vit_small_patch16_384': (
    384,
    {'augreg_in21k_ft_in1k': ('half', 1.0, 1000), 'augreg_in1k': ('half', 1.0, 1000)},
  ),
  'vit_small_patch32_224': (
    224,
    {'augreg_in21k_ft_in1k': ('half', 0.9, 1000), 'augreg_in21k': ('half', 0.9, 21843)},
  ),
  'vit_small_patch32_384': (384, {'augreg_in21k_ft_in1k': ('half', 1.0, 1000)}),
  'vit_base_patch8_224': (
    224,
    {
      'augreg2_in21k_ft_in1k': ('half', 0.9, 1000),
      'augreg_in21k_ft_in1k': ('half', 0.9, 1000),
      'augreg_in21k': ('half', 0.9, 21843),
      'dino': ('imagenet', 0.9, 0),
    },
  ),
  'vit_base_patch16_224': (
    224,
    {
      'augreg2_in21k_ft_in1k': ('half', 0.9, 1000),
      'augreg_in21k_ft_in1k': ('half', 0.9, 1000),
      'orig_in21k_ft_in1k': ('half', 0.9, 1000),
      'augreg_in1k': ('half', 0.9, 1000),
      'orig_in21k': ('half', 0.9, 0),
      'augreg_in21k': ('half', 0.9, 21843),
      'sam_in1k': ('half', 0.9, 1000),
      'bamboo': ('openai_clip', 1.0, 115217),
      'dino': ('imagenet', 0.9, 0),
      'mae': ('imagenet', 0.9, 0),
    },
  ),
  'vit_base_patch16_384': (
    384,
    {
      'augreg_in21k_ft_in1k': ('half', 1.0, 1000),
      'orig_in21k_ft_in1k': ('half', 1.0, 1000),
      'augreg_in1k': ('half', 1.0, 1000),
    },
  ),
  'vit_base_patch32_224': (
    224,
    {
      'augreg_in21k_ft_in1k': ('half', 0.9, 1000),
      'augreg_in1k': ('half', 0.9, 1000),
      'orig_in21k': ('half', 0.9, 0),
      'augreg_in21k': ('half', 0.9, 21843),
      'sam_in1k': ('half', 0.9, 1000),
    },
  ),
  'vit_base_patch32_384': (
    384,
    {'augreg_in21k_ft_in1k': ('half', 1.0, 1000), 'augreg_in1k': ('half', 1.0, 1000)},
  ),
  'vit_large_patch16_224': (
    224,
    {
      'augreg_in21k_ft_in1k': ('half', 0.9, 1000),
      'orig_in21k': ('half', 0.9, 0),
      'augreg_in21k': ('half', 0.9, 21843),
      'mae': ('imagenet', 0.9, 0),
    },
  ),
  'vit_large_patch16_384': (384, {'augreg_in21k_ft_in1k': ('half', 1.0, 1000)}),
  'vit_large_patch32_224': (224, {'orig_in21k': ('half', 0.9, 0)}),
  'vit_large_patch32_384': (384, {'orig_in21k_ft_in1k': ('half', 1.0, 1000)}),
  'vit_huge_patch14_224': (
    224,
    {'orig_in21k': ('half', 0.9, 0), 'untrained': ('half', 0.9, 1000), 'mae': ('imagenet', 0.9, 0)},
  ),
  'vit_base_r50_s16_224': (224, {'orig_in21k': ('half', 0.9, 0)}),
  'vit_base_r50_s16_384': (384, {'orig_in21k_ft_in1k': ('half', 1.0, 1000)}),
  'vit_base_r26_s32_224': (224, {'untrained': ('half', 0.9, 1000)}),
  'vit_large_r50_s32_224': (
    224,
    {'augreg_in21k_ft_in1k': ('half', 0.9, 1000), 'augreg_in21k': ('half', 0.9, 21843)},
  ),
  'vit_large_r50_s32_384': (384, {'augreg_in21k_ft_in1k': ('half', 1.0, 1000)}),
}


def _table(name: str) -> tuple:
  return WEIGHTS[name] if name in WEIGHTS else PAPER_WEIGHTS[name]


def has_tags(name: str) -> bool:
  """Whether timm registers weights of `name` that this table holds."""
  return name in WEIGHTS or name in PAPER_WEIGHTS


def tags(name: str) -> List[str]:
  """timm's tags of `name`, its default first."""
  return list(_table(name)[1])


def head_classes(name: str, tag: str) -> int:
  """The classes of the head that the weights `name.tag` hold (0: features only)."""
  return _table(name)[1][tag][2]


def preprocessing(name: str, tag: str, size: Optional[int] = None) -> Preprocessing:
  """The preprocessing of `name.tag` (at `size` px when given)."""
  default_size, entries = _table(name)
  statistics, crop_pct, _, *rest = entries[tag]
  mean, std = STATISTICS[statistics]
  mode = rest[0] if rest else 'center'
  return Preprocessing(f'{name}.{tag}', mean, std, size or default_size, crop_pct, 'bicubic', mode)


def default(name: str) -> Preprocessing:
  """The preprocessing of timm's default weights of `name`."""
  return preprocessing(name, tags(name)[0])


def statistics_name(name: str, tag: str) -> str:
  """The key of STATISTICS that `name.tag` takes."""
  return _table(name)[1][tag][0]


def groups(name: str, candidates: List[str]) -> Dict[tuple, List[str]]:
  """`candidates` (tags of `name`) grouped by their preprocessing, in table order."""
  out: Dict[tuple, List[str]] = {}
  for tag in candidates:
    p = preprocessing(name, tag)
    out.setdefault(dataclasses.astuple(dataclasses.replace(p, weights='')), []).append(tag)
  return out
