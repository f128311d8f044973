"""The ViT families people fine-tune from today, under timm's names: DINOv2 (with registers),
DINOv3, DeiT, DeiT III, SigLIP / SigLIP 2 (attention-pooled and mean-pooled), CLIP and EVA-02.

Each is the paper's encoder with a few options (`configs.model_spec.Architecture`'s and its
`Block`'s), set as timm's `timm.create_model(name)` sets them (timm 1.0):

- DINOv2 (Oquab et al. 2023): LayerScale 1e-5, exact GELU; the giant's MLP SwiGLU;
- DINOv2 with registers (Darcet et al. 2023): as DINOv2, 4 registers, position embeddings for
  the patches alone (`posemb='patches'`, timm's `no_embed_class`);
- DeiT (Touvron et al. 2021; the distilled models' second token aside): the paper's ViT with
  the exact GELU;
- DeiT III (Touvron et al. 2022): LayerScale 1e-6, `posemb='patches'`, exact GELU;
- SigLIP (Zhai et al. 2023), SigLIP 2: the MAP head, no class token, exact GELU (SigLIP 2's
  so400m/16, B/32, L/16 at 512 and giant: the tanh GELU); timm's `_siglip_gap` models
  (PaliGemma's towers among them) pool by the mean of the tokens instead;
- SigLIP 2 NaFlex (Tschannen et al. 2025; timm's `naflexvit_*_siglip`): NaFlex's 2D position
  table (16x16, resampled bilinearly with antialiasing to each image's grid), the MAP head
  over the real patches, the tanh GELU;
- CLIP (Radford et al. 2021): `pre_norm` and no patch bias, LayerNorm eps 1e-5, exact GELU
  or OpenAI's quick GELU;
- EVA-02 (Fang et al. 2023): SwiGLU, no key bias, rotary embeddings (a 16x16 reference
  grid), the mean of the patches normalised after pooling; B and L a LayerNorm inside the MLP;
- DINOv3 (Siméoni et al. 2025): the class token and 4 registers, no position table but
  rotary embeddings on patch centres normalised to [-1, 1] (`rotary='normalised'`), LayerScale
  1e-5, exact GELU, no q/k/v biases (the `_qkvb` models: the query's and value's), LayerNorm
  eps 1e-5, the mean of the patches (timm's default pooling); SwiGLU at S+, H+ and 7B.

SigLIP 2's weights load into SigLIP's architecture (timm's `.v2_webli` tags). A model's input
statistics (the mean and std of [0, 1] pixels it normalises with; [-1, 1] is every model's input
here) belong to its weights, not to its architecture: an entry carries those of timm's default
weights of its name, and a checkpoint converted from timm those of its own (`timm_weights`).
`architectures.MODEL_CONFIGS` holds every name of `MODELS`.
"""

from typing import Optional

import ml_collections

from vit_jax.configs import timm_weights

# DINOv3 (timm's `vit_*_dinov3`): the class token, 4 registers, no position table but rotary
# embeddings, the mean of the patches (timm's default pooling), LayerScale 1e-5, eps 1e-5.
_DINOV3 = {'classifier': 'token_gap', 'num_registers': 4, 'posemb': 'none', 'rotary': 'normalised'}
_DINOV3_BLOCK = {'layer_scale': 1e-5, 'mlp': 'gelu', 'norm_eps': 1e-5}
# family -> (entry options, `transformer` (block) options).
FAMILIES = {
  'dinov2': ({}, {'layer_scale': 1e-5, 'mlp': 'gelu'}),
  'dinov2_reg': ({'num_registers': 4, 'posemb': 'patches'}, {'layer_scale': 1e-5, 'mlp': 'gelu'}),
  'deit': ({}, {'mlp': 'gelu'}),
  'deit3': ({'posemb': 'patches'}, {'layer_scale': 1e-6, 'mlp': 'gelu'}),
  'siglip': ({'classifier': 'map'}, {'mlp': 'gelu'}),
  'siglip_gap': ({'classifier': 'gap'}, {'mlp': 'gelu'}),
  'clip': ({'pre_norm': True}, {'mlp': 'gelu', 'norm_eps': 1e-5}),
  'clip_quickgelu': ({'pre_norm': True}, {'mlp': 'quick_gelu', 'norm_eps': 1e-5}),
  'eva02': (
    {'classifier': 'token_gap', 'final_norm': 'pooled', 'rotary': (16, 16)},
    {'mlp': 'swiglu', 'biases': 'no_key'},
  ),
  'siglip_naflex': (
    {
      'classifier': 'map',
      'posemb': 'grid',
      'posemb_grid': (16, 16),
      'posemb_resample': 'bilinear_antialias',
    },
    {'mlp': 'gelu_tanh'},
  ),
  'dinov3': (_DINOV3, {**_DINOV3_BLOCK, 'biases': 'no_qkv'}),
  'dinov3_qkvb': (_DINOV3, {**_DINOV3_BLOCK, 'biases': 'no_key'}),
}

# timm's name -> (family, (hidden_size, mlp_dim, num_heads, num_layers), patch size, extra
# `transformer` options). A SwiGLU MLP's mlp_dim is its gated width (half of its first layer).
_TI, _S = (192, 768, 3, 12), (384, 1536, 6, 12)
_B, _L = (768, 3072, 12, 12), (1024, 4096, 16, 24)
_SO400M, _H = (1152, 4304, 16, 27), (1280, 5120, 16, 32)
_GOPT = (1536, 6144, 16, 40)  # SigLIP 2's giant (opt)
_TANH, _SWIGLU = {'mlp': 'gelu_tanh'}, {'mlp': 'swiglu'}
# CLIP's sizes: (timm's size and patch, dims, patch, {family: resolutions}).
_CLIP = (
  ('xsmall_patch16', (256, 1024, 4, 10), 16, {'clip': (224,), 'clip_quickgelu': ()}),
  ('medium_patch32', (512, 2048, 8, 12), 32, {'clip': (224,), 'clip_quickgelu': ()}),
  ('medium_patch16', (512, 2048, 8, 12), 16, {'clip': (224,), 'clip_quickgelu': ()}),
  ('betwixt_patch32', (640, 2560, 10, 12), 32, {'clip': (224,), 'clip_quickgelu': ()}),
  ('base_patch32', _B, 32, {'clip': (224, 256, 384, 448), 'clip_quickgelu': (224,)}),
  ('base_patch16', _B, 16, {'clip': (224, 384), 'clip_quickgelu': (224,)}),
  ('base_patch16_plus', (896, 3584, 14, 12), 16, {'clip': (240,), 'clip_quickgelu': ()}),
  ('large_patch14', _L, 14, {'clip': (224, 336), 'clip_quickgelu': (224, 336)}),
  ('huge_patch14', _H, 14, {'clip': (224, 336, 378), 'clip_quickgelu': (224, 378)}),
  ('giant_patch14', (1408, 6144, 16, 40), 14, {'clip': (224,), 'clip_quickgelu': ()}),
  ('gigantic_patch14', (1664, 8192, 16, 48), 14, {'clip': (224, 378), 'clip_quickgelu': (224,)}),
)
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
    f'deit_{size}_patch16_224': ('deit', dims, 16, {})
    for size, dims in (('tiny', _TI), ('small', _S), ('base', _B))
  },
  'deit_base_patch16_384': ('deit', _B, 16, {}),
  **{
    f'deit3_{size}_patch16_{res}': ('deit3', dims, 16, {})
    for size, dims in (('small', _S), ('medium', (512, 2048, 8, 12)), ('base', _B), ('large', _L))
    for res in (224, 384)
    if (size, res) != ('medium', 384)
  },
  'deit3_huge_patch14_224': ('deit3', _H, 14, {}),
  **{f'vit_base_patch16_siglip_{res}': ('siglip', _B, 16, {}) for res in (224, 256, 384, 512)},
  'vit_base_patch32_siglip_256': ('siglip', _B, 32, _TANH),
  **{
    f'vit_large_patch16_siglip_{res}': ('siglip', _L, 16, _TANH if res == 512 else {})
    for res in (256, 384, 512)
  },
  **{f'vit_so400m_patch14_siglip_{res}': ('siglip', _SO400M, 14, {}) for res in (224, 378, 384)},
  **{f'vit_so400m_patch16_siglip_{res}': ('siglip', _SO400M, 16, _TANH) for res in (256, 384, 512)},
  **{f'vit_giantopt_patch16_siglip_{res}': ('siglip', _GOPT, 16, _TANH) for res in (256, 384)},
  **{
    f'vit_base_patch16_siglip_gap_{res}': ('siglip_gap', _B, 16, {}) for res in (224, 256, 384, 512)
  },
  'vit_base_patch32_siglip_gap_256': ('siglip_gap', _B, 32, _TANH),
  **{
    f'vit_large_patch16_siglip_gap_{res}': ('siglip_gap', _L, 16, _TANH if res == 512 else {})
    for res in (256, 384, 512)
  },
  **{
    f'vit_so400m_patch14_siglip_gap_{res}': ('siglip_gap', _SO400M, 14, {})
    for res in (224, 378, 384, 448, 896)
  },
  **{
    f'vit_so400m_patch16_siglip_gap_{res}': ('siglip_gap', _SO400M, 16, _TANH)
    for res in (256, 384, 512)
  },
  **{
    f'vit_giantopt_patch16_siglip_gap_{res}': ('siglip_gap', _GOPT, 16, _TANH) for res in (256, 384)
  },
  **{
    f'vit_{size}_clip{quick}_{res}': (family, dims, patch, {})
    for quick, family in (('', 'clip'), ('_quickgelu', 'clip_quickgelu'))
    for size, dims, patch, sizes in _CLIP
    for res in sizes[family]
  },
  'naflexvit_base_patch16_siglip': ('siglip_naflex', _B, 16, {}),
  'naflexvit_so400m_patch16_siglip': ('siglip_naflex', _SO400M, 16, {}),
  **{
    f'vit_{size}_patch16_dinov3{qkvb}': (f'dinov3{qkvb}', dims, 16, extra)
    for qkvb in ('', '_qkvb')
    for size, dims, extra in (
      ('tiny', _TI, {}),
      ('small', _S, {}),
      ('small_plus', _S, _SWIGLU),
      ('base', _B, {}),
      ('large', _L, {}),
      ('huge_plus', (1280, 5120, 20, 32), _SWIGLU),
      ('7b', (4096, 8192, 32, 40), _SWIGLU),
    )
    if (size, qkvb) not in (('tiny', ''), ('7b', '_qkvb'))
  },
  **{f'eva02_tiny_patch14_{res}': ('eva02', (192, 512, 3, 12), 14, {}) for res in (224, 336)},
  **{f'eva02_small_patch14_{res}': ('eva02', (384, 1024, 6, 12), 14, {}) for res in (224, 336)},
  **{
    f'eva02_base_patch14_{res}': ('eva02', (768, 2048, 12, 12), 14, {'mlp_norm': True})
    for res in (224, 448)
  },
  **{
    f'eva02_large_patch14_{res}': ('eva02', (1024, 2730, 16, 24), 14, {'mlp_norm': True})
    for res in (224, 448)
  },
}


def family_of(name: str) -> Optional[str]:
  """The family of registry entry `name`, None for the paper's and other models."""
  return MODELS[name][0] if name in MODELS else None


def config(name: str) -> ml_collections.ConfigDict:
  """The registry entry of timm model `name` (`VisionTransformer`'s keywords)."""
  family, (hidden, mlp, heads, layers), patch, extra = MODELS[name]
  entry, block = FAMILIES[family]
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
  stats = timm_weights.default(name).input_stats
  if stats is not None:
    out.input_stats = stats
  return out


_TITLES = {
  'dinov2': 'DINOv2',
  'dinov2_reg': 'DINOv2 with registers',
  'deit': 'DeiT',
  'deit3': 'DeiT III',
  'siglip': 'SigLIP, SigLIP 2',
  'siglip_gap': 'SigLIP, SigLIP 2 (mean-pooled)',
  'clip': 'CLIP',
  'clip_quickgelu': 'CLIP (OpenAI quick GELU)',
  'eva02': 'EVA-02',
  'siglip_naflex': 'SigLIP 2 NaFlex',
  'dinov3': 'DINOv3',
  'dinov3_qkvb': 'DINOv3 (q/v biases)',
}


def markdown_table() -> str:
  """docs/checkpoints_and_export.md's table of the families (tests/test_families.py holds the
  two equal): each family's timm names, its options as the registry sets them, and the input
  statistics of timm's default weights of its names (a file's own tag may take others)."""
  rows = [
    "| family | timm names | options | default weights' input statistics |",
    '|---|---|---|---|',
  ]
  for family, (entry, block) in FAMILIES.items():
    names = ', '.join(f'`{n}`' for n, m in MODELS.items() if m[0] == family)
    options = [f'{k}={v!r}' for k, v in {**entry, **block}.items()]
    extra = {(k, v) for n, m in MODELS.items() if m[0] == family for k, v in m[3].items()}
    for k, v in sorted(extra):
      having = [f'`{n}`' for n, m in MODELS.items() if m[0] == family and m[3].get(k) == v]
      options.append(f'{k}={v!r} (only {", ".join(having)})')
    stats = _statistics_cell([n for n, m in MODELS.items() if m[0] == family])
    rows.append(f'| {_TITLES[family]} | {names} | {", ".join(options)} | {stats} |')
  return '\n'.join(rows)


def _statistics_cell(names) -> str:
  """The statistics of timm's default weights of `names`: one key of `timm_weights.STATISTICS`,
  or each name's where they differ."""
  keys = {n: timm_weights.statistics_name(n, timm_weights.tags(n)[0]) for n in names}
  titles = {n: timm_weights.STATISTICS_TITLES[k] for n, k in keys.items()}
  if len(set(titles.values())) == 1:
    return next(iter(titles.values()))
  return ', '.join(f'`{n}`: {t}' for n, t in titles.items())
