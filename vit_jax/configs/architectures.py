"""Architecture registry: `MODEL_CONFIGS['ViT-B_16']` -> a model ConfigDict.

Sizes from paper Table 1 (B, L, H), the later Ti and S sizes, and the giant
ViTs that followed (g, G, e, 22B; `GIANTS`). Each entry
unpacks into `vit_jax.models.VisionTransformer(num_classes=..., **config)`.
Every lookup returns a fresh copy, so editing one does not change the registry.

The names are the official vit_jax's (google-research/vision_transformer,
`vit_jax/configs/models.py`), with the same architectures and parameter
counts, plus this package's `-gap` spellings and its demo model, and the newer families under
timm's names (`configs.families`: DINOv2, DeiT III, SigLIP, CLIP, EVA-02). The
official `get_*_config()` functions and `AUGREG_CONFIGS` are views of this
one registry, importable by the official path `vit_jax.configs.models` too. MLP-Mixer and LiT are not part of this package: asking for one
says so in one line.
"""

import collections.abc
import difflib

import ml_collections

from vit_jax.configs import UnknownModelError
from vit_jax.configs import families

# name: (hidden_size, mlp_dim, num_heads, num_layers)
_SIZES = {
  'Ti': (192, 768, 3, 12),
  'S': (384, 1536, 6, 12),
  'B': (768, 3072, 12, 12),
  'L': (1024, 4096, 16, 24),
  'H': (1280, 5120, 16, 32),
}

# The public ViT checkpoints: (size, patch).
_VIT_NAMES = [
  ('Ti', 16),
  ('S', 16),
  ('S', 32),
  ('B', 8),
  ('B', 16),
  ('B', 32),
  ('L', 16),
  ('L', 32),
  ('H', 14),
]

# Global average pooling, no pre-logits: the official names of the AugReg
# checkpoints trained so. This package spells them `-gap` for every ViT too.
_GAP_NOREP = ('ViT-S_16', 'ViT-B_16', 'ViT-S_32', 'ViT-B_32')

# Hybrids: ViT on a BiT ResNet feature map, (size, patch, units per stage).
# The root (conv /2, max-pool /2) and every stage after the first halve the
# map: three stages and 1x1 patches give /16, four give /32. R+ViT-Ti_16 is
# the root alone with 8x8 patches (/32 in all, as the official config).
_HYBRIDS = {
  'R+ViT-Ti_16': ('Ti', 8, ()),
  'R50+ViT-B_16': ('B', 1, (3, 4, 9)),
  'R26+ViT-B_32': ('B', 1, (2, 2, 2, 2)),
  'R26+ViT-S_32': ('S', 1, (2, 2, 2, 2)),
  'R50+ViT-L_32': ('L', 1, (3, 4, 6, 3)),
}

# transformer.dropout_rate of the official model configs; 0.0 for the rest.
# The official fine-tuning trains with it, so `recipes.finetune` does too.
_DROPOUT = {
  'ViT-L_16': 0.1,
  'ViT-H_14': 0.1,
  'R50+ViT-B_16': 0.1,
  'R50+ViT-L_32': 0.1,
  'testing': 0.1,
  'testing-unpooled': 0.1,
}

_OUT_OF_SCOPE = ('Mixer-', 'LiT-')

# Beyond the paper: (hidden_size, mlp_dim, num_heads, num_layers, block flags),
# patch 14, no class token; global average pooling, or with the `-map` suffix
# the multi-head attention pooling these papers train with (big_vision's
# MAPHead: models.vit.MAPHead). Published sizes
# (no head): ViT-g/14 1,011M and ViT-G/14 1,843M (Zhai et al. 2022, Table 2),
# ViT-e 3.9B (Chen et al. 2022, PaLI; with its MAP head), ViT-22B
# 21.7B (Dehghani et al. 2023, Table 1), whose blocks run attention and MLP in
# parallel, normalise queries and keys, and have no biases in the q/k/v
# projections and LayerNorms.
GIANTS = {
  'ViT-g_14': (1408, 6144, 16, 40, {}),
  'ViT-G_14': (1664, 8192, 16, 48, {}),
  'ViT-e_14': (1792, 15360, 16, 56, {}),
  'ViT-22B_14': (
    6144,
    24576,
    48,
    48,
    {'parallel_block': True, 'qk_norm': True, 'biases': 'no_qkv_or_norm'},
  ),
}


def vit_config(size, patch, *, classifier='token', representation_size=None, name=None):
  """A ViT of a named size (`'Ti'` ... `'H'`) and square patch size."""
  hidden, mlp, heads, layers = _SIZES[size]
  return ml_collections.ConfigDict(
    {
      'model_name': name or f'ViT-{size}_{patch}',
      'patches': {'size': (patch, patch)},
      'hidden_size': hidden,
      'transformer': {
        'mlp_dim': mlp,
        'num_heads': heads,
        'num_layers': layers,
        'attention_dropout_rate': 0.0,
        'dropout_rate': 0.0,
      },
      'classifier': classifier,
      'representation_size': representation_size,
    }
  )


def hybrid_config(name):
  """An R+ViT hybrid from `_HYBRIDS`."""
  size, patch, units = _HYBRIDS[name]
  config = vit_config(size, patch, name=name)
  config.resnet = {'num_layers': units, 'width_factor': 1}
  return config


def giant_config(name, classifier='gap'):
  """A ViT from `GIANTS`; named `{name}-map` with the MAP head."""
  hidden, mlp, heads, layers, flags = GIANTS[name]
  suffix = '' if classifier == 'gap' else f'-{classifier}'
  config = vit_config('B', 14, classifier=classifier, name=name + suffix)
  config.hidden_size = hidden
  config.transformer.update(mlp_dim=mlp, num_heads=heads, num_layers=layers, **flags)
  return config


def demo_config():
  """The demo model: a 4-layer ViT with 4x4 patches for small images (not public)."""
  config = vit_config('Ti', 4, name='ViT-Demo_4')
  config.hidden_size = 128
  config.transformer.update(mlp_dim=256, num_heads=4, num_layers=4)
  return config


def testing_config(classifier='token'):
  """The official tiny ViT for unit tests (not a public checkpoint): 21,390 parameters."""
  name = 'testing' if classifier == 'token' else f'testing-{classifier}'
  config = vit_config('Ti', 16, classifier=classifier, name=name)
  config.hidden_size = 10
  config.transformer.update(mlp_dim=10, num_heads=2, num_layers=1)
  return config


def _with_dropout(factory, name):
  def build():
    config = factory()
    config.transformer.dropout_rate = _DROPOUT.get(name, 0.0)
    return config

  return build


def _factories():
  factories = {}
  for size, patch in _VIT_NAMES:
    name = f'ViT-{size}_{patch}'
    factories[name] = lambda s=size, p=patch: vit_config(s, p)
    for suffix in ('-gap', '-gap-norep') if name in _GAP_NOREP else ('-gap',):
      factories[name + suffix] = lambda s=size, p=patch, n=name + suffix: vit_config(
        s, p, classifier='gap', name=n
      )
  for name in _HYBRIDS:
    factories[name] = lambda n=name: hybrid_config(n)
  for name in GIANTS:
    factories[name] = lambda n=name: giant_config(n)
    factories[name + '-map'] = lambda n=name: giant_config(n, 'map')
  factories['ViT-Demo_4'] = demo_config
  factories['testing'] = testing_config
  factories['testing-unpooled'] = lambda: testing_config('unpooled')
  factories['testing-map'] = lambda: testing_config('map')
  for name in families.MODELS:  # DINOv2, DeiT III, SigLIP, CLIP, EVA-02 under timm's names
    factories[name] = lambda n=name: families.config(n)
  # Dropout by the architecture's name: ViT-L_16-gap trains as ViT-L_16.
  return {
    name: _with_dropout(factory, name.replace('-gap-norep', '').replace('-gap', ''))
    for name, factory in factories.items()
  }


class _Registry(collections.abc.Mapping):
  """Read-only name -> ConfigDict mapping that builds a new config per lookup."""

  def __init__(self, factories, what):
    self._factories = factories
    self._what = what

  def __getitem__(self, name):
    if name not in self._factories:
      if isinstance(name, str) and name.startswith(_OUT_OF_SCOPE):
        raise UnknownModelError(
          f'{name}: MLP-Mixer and LiT models are not part of this package (ViT and R+ViT '
          'hybrids only); use google-research/vision_transformer for them'
        )
      close = difflib.get_close_matches(str(name), self._factories, n=3, cutoff=0.5)
      hint = f'did you mean {", ".join(close)}?' if close else f'see {self._what}'
      raise UnknownModelError(f'unknown model {name!r}: {hint}')
    return self._factories[name]()

  def __iter__(self):
    return iter(self._factories)

  def __len__(self):
    return len(self._factories)


_FACTORIES = _factories()
MODEL_CONFIGS = _Registry(_FACTORIES, 'vit_jax.configs.architectures.MODEL_CONFIGS')


def _augreg_name(name):
  return name.replace('ViT-', '').replace('+', '_')


# The official AugReg lookup: the first part of an AugReg file name
# ('R_Ti_16' of 'R_Ti_16-i21k-300ep-lr_0.001-...npz') -> its architecture.
# The official table leaves out the models AugReg did not train.
AUGREG_CONFIGS = _Registry(
  {
    _augreg_name(name): factory
    for name, factory in _FACTORIES.items()
    if name not in ('testing', 'testing-map', 'ViT-L_32', 'R50+ViT-B_16', 'ViT-H_14', 'ViT-Demo_4')
    and name.removesuffix('-map') not in GIANTS
    and not name.endswith('-gap')
    and name not in families.MODELS
  },
  'vit_jax.configs.architectures.AUGREG_CONFIGS',
)


def _getter(name):
  def get_config():
    return MODEL_CONFIGS[name]

  get_config.__doc__ = f'The official `get_*_config` spelling of MODEL_CONFIGS[{name!r}].'
  return get_config


# The official vit_jax's config functions, by their names there.
get_testing_config = _getter('testing')
get_testing_unpooled_config = _getter('testing-unpooled')
get_ti16_config = _getter('ViT-Ti_16')
get_s16_config = _getter('ViT-S_16')
get_b16_config = _getter('ViT-B_16')
get_l16_config = _getter('ViT-L_16')
get_h14_config = _getter('ViT-H_14')
get_s16_gap_norep_config = _getter('ViT-S_16-gap-norep')
get_b16_gap_norep_config = _getter('ViT-B_16-gap-norep')
get_b8_config = _getter('ViT-B_8')
get_s32_config = _getter('ViT-S_32')
get_b32_config = _getter('ViT-B_32')
get_l32_config = _getter('ViT-L_32')
get_s32_gap_norep_config = _getter('ViT-S_32-gap-norep')
get_b32_gap_norep_config = _getter('ViT-B_32-gap-norep')
get_r_ti16_config = _getter('R+ViT-Ti_16')
get_r50_b16_config = _getter('R50+ViT-B_16')
get_r26_b32_config = _getter('R26+ViT-B_32')
get_r26_s32_config = _getter('R26+ViT-S_32')
get_r50_l32_config = _getter('R50+ViT-L_32')
# Out of scope: these raise the one-line UnknownModelError above.
get_mixer_b16_config = _getter('Mixer-B_16')
get_mixer_b32_config = _getter('Mixer-B_32')
get_mixer_l16_config = _getter('Mixer-L_16')
get_lit_b16b_config = _getter('LiT-B16B')
get_lit_b16b_2_config = _getter('LiT-B16B_2')
get_lit_l16l_config = _getter('LiT-L16L')
get_lit_l16s_config = _getter('LiT-L16S')
get_lit_l16ti_config = _getter('LiT-L16Ti')
