"""The ViT families people fine-tune from today, under timm's names: DINOv2 (with registers),
DeiT III, SigLIP / SigLIP 2, CLIP and EVA-02.

Each is the paper's encoder with a few options (`configs.model_spec.Architecture`'s and its
`Block`'s), set as timm's `timm.create_model(name)` sets them (timm 1.0):

- DINOv2 (Oquab et al. 2023): LayerScale 1e-5, exact GELU; the giant's MLP SwiGLU;
- DINOv2 with registers (Darcet et al. 2023): as DINOv2, 4 registers, position embeddings for
  the patches alone (`posemb='patches'`, timm's `no_embed_class`);
- DeiT III (Touvron et al. 2022): LayerScale 1e-6, `posemb='patches'`, exact GELU;
- SigLIP (Zhai et al. 2023), SigLIP 2: the MAP head, no class token, exact GELU;
- CLIP (Radford et al. 2021): `pre_norm` and no patch bias, LayerNorm eps 1e-5, exact GELU
  or OpenAI's quick GELU;
- EVA-02 (Fang et al. 2023): SwiGLU, no key bias, rotary embeddings (a 16x16 reference
  grid), the mean of the patches normalised after pooling; B and L a LayerNorm inside the MLP.

SigLIP 2's weights load into SigLIP's architecture (timm's `.v2_webli` tags). Each family
carries the input statistics its weights were trained with (timm's `pretrained_cfg` mean and
std of pixels in [0, 1]; SigLIP's are [-1, 1], every model's input here).
`architectures.MODEL_CONFIGS` holds every name of `MODELS`.
"""

from typing import Optional, Tuple

import ml_collections

IMAGENET = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
OPENAI_CLIP = ((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))

# family -> (entry options, `transformer` (block) options, (input mean, std) or None for [-1, 1]).
FAMILIES = {
  'dinov2': ({}, {'layer_scale': 1e-5, 'mlp': 'gelu'}, IMAGENET),
  'dinov2_reg': (
    {'num_registers': 4, 'posemb': 'patches'},
    {'layer_scale': 1e-5, 'mlp': 'gelu'},
    IMAGENET,
  ),
  'deit3': ({'posemb': 'patches'}, {'layer_scale': 1e-6, 'mlp': 'gelu'}, IMAGENET),
  'siglip': ({'classifier': 'map'}, {'mlp': 'gelu'}, None),
  'clip': ({'pre_norm': True}, {'mlp': 'gelu', 'norm_eps': 1e-5}, OPENAI_CLIP),
  'clip_quickgelu': ({'pre_norm': True}, {'mlp': 'quick_gelu', 'norm_eps': 1e-5}, OPENAI_CLIP),
  'eva02': (
    {'classifier': 'token_gap', 'final_norm': 'pooled', 'rotary': (16, 16)},
    {'mlp': 'swiglu', 'biases': 'no_key'},
    OPENAI_CLIP,
  ),
}

# timm's name -> (family, (hidden_size, mlp_dim, num_heads, num_layers), patch size, extra
# `transformer` options). A SwiGLU MLP's mlp_dim is its gated width (half of its first layer).
_S, _B, _L = (384, 1536, 6, 12), (768, 3072, 12, 12), (1024, 4096, 16, 24)
_SO400M = (1152, 4304, 16, 27)
MODELS = {
  **{
    f'vit_{size}_patch14{reg}_dinov2': (family, dims, 14, {})
    for reg, family in (('', 'dinov2'), ('_reg4', 'dinov2_reg'))
    for size, dims in (('small', _S), ('base', _B), ('large', _L))
  },
  **{
    f'vit_giant_patch14{reg}_dinov2': (family, (1536, 4096, 24, 40), 14, {'mlp': 'swiglu'})
    for reg, family in (('', 'dinov2'), ('_reg4', 'dinov2_reg'))
  },
  **{
    f'deit3_{size}_patch16_{res}': ('deit3', dims, 16, {})
    for size, dims in (('small', _S), ('medium', (512, 2048, 8, 12)), ('base', _B), ('large', _L))
    for res in (224, 384)
    if (size, res) != ('medium', 384)
  },
  'deit3_huge_patch14_224': ('deit3', (1280, 5120, 16, 32), 14, {}),
  **{f'vit_base_patch16_siglip_{res}': ('siglip', _B, 16, {}) for res in (224, 256, 384, 512)},
  **{f'vit_large_patch16_siglip_{res}': ('siglip', _L, 16, {}) for res in (256, 384)},
  **{f'vit_so400m_patch14_siglip_{res}': ('siglip', _SO400M, 14, {}) for res in (224, 384)},
  **{f'vit_so400m_patch16_siglip_{res}': ('siglip', _SO400M, 16, {}) for res in (256, 384)},
  'vit_base_patch32_clip_224': ('clip', _B, 32, {}),
  'vit_base_patch16_clip_224': ('clip', _B, 16, {}),
  'vit_large_patch14_clip_224': ('clip', _L, 14, {}),
  'vit_huge_patch14_clip_224': ('clip', (1280, 5120, 16, 32), 14, {}),
  'vit_base_patch32_clip_quickgelu_224': ('clip_quickgelu', _B, 32, {}),
  'vit_base_patch16_clip_quickgelu_224': ('clip_quickgelu', _B, 16, {}),
  'vit_large_patch14_clip_quickgelu_224': ('clip_quickgelu', _L, 14, {}),
  'eva02_tiny_patch14_224': ('eva02', (192, 512, 3, 12), 14, {}),
  'eva02_small_patch14_224': ('eva02', (384, 1024, 6, 12), 14, {}),
  'eva02_base_patch14_224': ('eva02', (768, 2048, 12, 12), 14, {'mlp_norm': True}),
  'eva02_large_patch14_224': ('eva02', (1024, 2730, 16, 24), 14, {'mlp_norm': True}),
}


def family_of(name: str) -> Optional[str]:
  """The family of registry entry `name`, None for the paper's and other models."""
  return MODELS[name][0] if name in MODELS else None


def input_statistics(family: str) -> Optional[Tuple[tuple, tuple]]:
  """(mean, std) of pixels in [0, 1] that `family`'s weights take; None: [-1, 1]."""
  return FAMILIES[family][2]


def config(name: str) -> ml_collections.ConfigDict:
  """The registry entry of timm model `name` (`VisionTransformer`'s keywords)."""
  family, (hidden, mlp, heads, layers), patch, extra = MODELS[name]
  entry, block, statistics = FAMILIES[family]
  out = ml_collections.ConfigDict(
    {
      'model_name': name,
      'patches': {'size': (patch, patch)},
      'hidden_size': hidden,
      'transformer': {
        'mlp_dim': mlp,
        'num_heads': heads,
        'num_layers': layers,
        'attention_dropout_rate': 0.0,
        'dropout_rate': 0.0,
        **block,
        **extra,
      },
      'classifier': 'token',
      'representation_size': None,
    }
  )
  out.update(entry)
  if statistics is not None:
    out.input_stats = statistics
  return out


_TITLES = {
  'dinov2': 'DINOv2',
  'dinov2_reg': 'DINOv2 with registers',
  'deit3': 'DeiT III',
  'siglip': 'SigLIP, SigLIP 2',
  'clip': 'CLIP',
  'clip_quickgelu': 'CLIP (OpenAI quick GELU)',
  'eva02': 'EVA-02',
}


def markdown_table() -> str:
  """docs/checkpoints_and_export.md's table of the families (tests/test_families.py holds the
  two equal): each family's timm names, its options as the registry sets them, its input."""
  rows = [
    '| family | timm names | options | input (mean, std of [0, 1] pixels) |',
    '|---|---|---|---|',
  ]
  for family, (entry, block, statistics) in FAMILIES.items():
    names = ', '.join(f'`{n}`' for n, m in MODELS.items() if m[0] == family)
    options = [f'{k}={v!r}' for k, v in {**entry, **block}.items()]
    extra = {(k, v) for n, m in MODELS.items() if m[0] == family for k, v in m[3].items()}
    for k, v in sorted(extra):
      having = [f'`{n}`' for n, m in MODELS.items() if m[0] == family and m[3].get(k) == v]
      options.append(f'{k}={v!r} (only {", ".join(having)})')
    stats = '[-1, 1] as given' if statistics is None else f'{statistics[0]}, {statistics[1]}'
    rows.append(f'| {_TITLES[family]} | {names} | {", ".join(options)} | {stats} |')
  return '\n'.join(rows)
