"""Architecture registry: `MODEL_CONFIGS['ViT-B_16']` -> a model ConfigDict.

Sizes from paper Table 1 (B, L, H) and the later Ti and S sizes. Each entry
unpacks into `vit_jax.models.VisionTransformer(num_classes=..., **config)`.
Every lookup returns a fresh copy, so editing one does not change the registry.
"""

import collections.abc
import difflib

import ml_collections

from vit_jax.configs import UnknownModelError

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

# Hybrids: ViT on a BiT ResNet feature map with 1x1 patches. The name's patch
# number is the backbone's total stride: three stages give 16, four give 32.
_HYBRIDS = {
  'R50+ViT-B_16': ('B', (3, 4, 9)),
  'R26+ViT-B_32': ('B', (2, 2, 2, 2)),
  'R50+ViT-L_32': ('L', (3, 4, 6, 3)),
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
  size, units = _HYBRIDS[name]
  config = vit_config(size, 1, name=name)
  config.resnet = {'num_layers': units, 'width_factor': 1}
  return config


def demo_config():
  """The demo model: a 4-layer ViT with 4x4 patches for small images (not public)."""
  config = vit_config('Ti', 4, name='ViT-Demo_4')
  config.hidden_size = 128
  config.transformer.update(mlp_dim=256, num_heads=4, num_layers=4)
  return config


def testing_config():
  """A tiny ViT for unit tests (not a public checkpoint)."""
  config = vit_config('Ti', 16, name='testing')
  config.hidden_size = 16
  config.transformer.update(mlp_dim=32, num_heads=2, num_layers=1)
  return config


def _factories():
  factories = {}
  for size, patch in _VIT_NAMES:
    name = f'ViT-{size}_{patch}'
    factories[name] = lambda s=size, p=patch: vit_config(s, p)
    factories[f'{name}-gap'] = lambda s=size, p=patch, n=name: vit_config(
      s, p, classifier='gap', name=f'{n}-gap'
    )
  for name in _HYBRIDS:
    factories[name] = lambda n=name: hybrid_config(n)
  factories['ViT-Demo_4'] = demo_config
  factories['testing'] = testing_config
  return factories


class _Registry(collections.abc.Mapping):
  """Read-only name -> ConfigDict mapping that builds a new config per lookup."""

  def __init__(self, factories):
    self._factories = factories

  def __getitem__(self, name):
    if name not in self._factories:
      close = difflib.get_close_matches(name, self._factories, n=3, cutoff=0.5)
      hint = (
        f'did you mean {", ".join(close)}?' if close else 'see vit_jax.configs.models.MODEL_CONFIGS'
      )
      raise UnknownModelError(f'unknown model {name!r}: {hint}')
    return self._factories[name]()

  def __iter__(self):
    return iter(self._factories)

  def __len__(self):
    return len(self._factories)


MODEL_CONFIGS = _Registry(_factories())
