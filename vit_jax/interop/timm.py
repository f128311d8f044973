"""timm's PyTorch `VisionTransformer`: our parameters as its state_dict, and back.

timm names (`vit_base_patch16_224`, `vit_base_r50_s16_224`, ...) hold the
same architectures; its state_dict fuses query, key and value into one
`blocks.N.attn.qkv` weight and puts a hybrid's ResNet under
`patch_embed.backbone`. Two numerical details differ from timm's defaults,
and `build_model` sets them to ours:

- GELU: the original code (and ours) uses the tanh approximation; timm's
  ViT defaults to the exact GELU. `act_layer='gelu_tanh'` matches.
- Hybrids: our convs standardise kernels as the original code,
  (w - mean) / (std + 1e-5), and the GroupNorms use eps 1e-6; timm's
  hybrids divide by sqrt(var + 1e-8) and use GroupNorm eps 1e-5.
  `build_model` gives timm's ResNet the original formula.

timm has no pre-logits layer (it dropped it for the released ImageNet-21k
files), so a checkpoint with `pre_logits` exports as timm's features-only
model (no head), like timm's own `*.orig_in21k` weights.
"""

import functools
import math
import re
from typing import Dict, Optional, Tuple

import numpy as np

from vit_jax import checkpoint
from vit_jax.configs import families
from vit_jax.configs import model_spec
from vit_jax.interop import torch_layout

# Released architectures -> timm's names (without the `_<resolution>` suffix).
TIMM_NAMES = {
  'ViT-Ti_16': 'vit_tiny_patch16',
  'ViT-S_16': 'vit_small_patch16',
  'ViT-S_32': 'vit_small_patch32',
  'ViT-B_8': 'vit_base_patch8',
  'ViT-B_16': 'vit_base_patch16',
  'ViT-B_32': 'vit_base_patch32',
  'ViT-L_16': 'vit_large_patch16',
  'ViT-L_32': 'vit_large_patch32',
  'ViT-H_14': 'vit_huge_patch14',
  'R50+ViT-B_16': 'vit_base_r50_s16',
  'R26+ViT-B_32': 'vit_base_r26_s32',
  'R50+ViT-L_32': 'vit_large_r50_s32',
}
# Of those, the ones timm also registers at 384 px.
TIMM_384 = (
  'vit_tiny_patch16',
  'vit_small_patch16',
  'vit_small_patch32',
  'vit_base_patch16',
  'vit_base_patch32',
  'vit_large_patch16',
  'vit_large_patch32',
  'vit_base_r50_s16',
  'vit_large_r50_s32',
)

# Options beyond the paper's ViT (`torch_layout.beyond_paper`) that timm's VisionTransformer
# has too, under its names and `build_model`'s arguments: they export.
WRITES = ('layer_scale',)

STD_CONV_EPS = 1e-5  # models_resnet.StdConv: (w - mean) / (std + eps)
GROUP_NORM_EPS = 1e-6  # flax.linen.GroupNorm's default, as the original code

_BLOCK = r'^Transformer/encoderblock_(\d+)/'
_RULES = (
  (r'^cls$', 'cls_token'),
  (r'^registers$', 'reg_token'),
  (r'^Transformer/posembed_input/pos_embedding$', 'pos_embed'),
  (r'^embedding/', 'patch_embed.proj.'),
  (r'^Transformer/encoder_norm/', 'norm.'),
  (r'^Transformer/pre_norm/', 'norm_pre.'),  # CLIP
  (r'^fc_norm/', 'fc_norm.'),  # the LayerNorm after pooling (EVA-02, timm's gap models)
  (_BLOCK + r'MlpBlock_3/LayerNorm_0/', r'blocks.\1.mlp.norm.'),  # EVA-02's sub-LN
  (_BLOCK + r'LayerNorm_0/', r'blocks.\1.norm1.'),
  (_BLOCK + r'LayerNorm_2/', r'blocks.\1.norm2.'),
  (_BLOCK + r'MultiHeadDotProductAttention_1/(query|key|value)/', r'blocks.\1.attn.qkv.'),
  (_BLOCK + r'MultiHeadDotProductAttention_1/out/', r'blocks.\1.attn.proj.'),
  (_BLOCK + r'MlpBlock_3/Dense_0/', r'blocks.\1.mlp.fc1.'),
  (_BLOCK + r'MlpBlock_3/Dense_1/', r'blocks.\1.mlp.fc2.'),
  (_BLOCK + r'(ls[12])/', r'blocks.\1.\2.'),
  (r'^MAPHead_0/probe$', 'attn_pool.latent'),
  (r'^MAPHead_0/MultiHeadDotProductAttention_0/query/', 'attn_pool.q.'),
  (r'^MAPHead_0/MultiHeadDotProductAttention_0/(key|value)/', 'attn_pool.kv.'),
  (r'^MAPHead_0/MultiHeadDotProductAttention_0/out/', 'attn_pool.proj.'),
  (r'^MAPHead_0/LayerNorm_0/', 'attn_pool.norm.'),
  (r'^MAPHead_0/MlpBlock_0/Dense_0/', 'attn_pool.mlp.fc1.'),
  (r'^MAPHead_0/MlpBlock_0/Dense_1/', 'attn_pool.mlp.fc2.'),
  (r'^head/', 'head.'),
  (r'^conv_root/', 'patch_embed.backbone.stem.conv.'),
  (r'^gn_root/', 'patch_embed.backbone.stem.norm.'),
)
_QKV = {'query': (0, 3), 'key': (1, 3), 'value': (2, 3)}
_KV = {'key': (0, 2), 'value': (1, 2)}  # the MAP head fuses keys and values only


def timm_name(key: str) -> Tuple[Optional[str], Optional[Tuple[int, int]]]:
  """Our key -> (timm state_dict key, (chunk, chunks) of a fused q/k/v or k/v, or None)."""
  unit = re.match(r'^block(\d+)/unit(\d+)/(conv|gn)(\d|_proj)/(kernel|scale|bias)$', key)
  if unit:
    stage, index, kind, which, leaf = unit.groups()
    module = 'conv' if kind == 'conv' else 'norm'
    sub = f'downsample.{module}' if which == '_proj' else f'{module}{which}'
    leaf = 'bias' if leaf == 'bias' else 'weight'
    return (
      f'patch_embed.backbone.stages.{int(stage) - 1}.blocks.{int(index) - 1}.{sub}.{leaf}',
      None,
    )
  qkv = re.match(_BLOCK + r'MultiHeadDotProductAttention_1/(query|key|value)/', key)
  kv = re.match(r'^MAPHead_0/MultiHeadDotProductAttention_0/(key|value)/', key)
  chunk = _QKV[qkv.group(2)] if qkv else _KV[kv.group(1)] if kv else None
  return torch_layout.rename(key, _RULES), chunk


def _pooling_kwargs(classifier: str) -> dict:
  # fc_norm=False: the final LayerNorm acts on every token before pooling, as ours.
  return {
    'token': {},
    'gap': {'class_token': False, 'global_pool': 'avg', 'fc_norm': False},
    'map': {'class_token': False, 'global_pool': 'map'},
    'unpooled': {'class_token': False, 'global_pool': ''},
    'token_unpooled': {'global_pool': ''},
  }[classifier]


def registered_name(arch, image_size: int) -> Optional[str]:
  """timm's registered name for an architecture at `image_size`: a family's own name
  (`configs.families` keeps timm's), a released architecture's at 224 or 384 px; else None."""
  if arch.name in families.MODELS:
    return arch.name  # create_model_kwargs sets what differs
  name = (arch.name or '').removesuffix('-gap')
  if name not in TIMM_NAMES:
    return None
  released = model_spec.registered(name)
  same = ('hidden_size', 'num_layers', 'patch_size', 'block', 'resnet')
  if any(getattr(arch, field) != getattr(released, field) for field in same):
    return None  # same name, other sizes or block options (a shrunk test model)
  base = TIMM_NAMES[name]
  return f'{base}_384' if image_size == 384 and base in TIMM_384 else f'{base}_224'


def create_model_kwargs(arch, num_classes: Optional[int], image_size: int) -> dict:
  """Keyword arguments of `timm.create_model(registered_name(...), **kwargs)`."""
  if arch.name in families.MODELS:
    return _family_kwargs(arch, num_classes, image_size)
  return {
    'num_classes': num_classes or 0,
    'img_size': image_size,
    'act_layer': 'gelu_tanh',
    **_pooling_kwargs(arch.classifier),
    **({'reg_tokens': arch.num_registers} if arch.num_registers else {}),
  }


def _family_kwargs(arch, num_classes: Optional[int], image_size: int) -> dict:
  """`create_model_kwargs` of a model under timm's own name (`configs.families`): its head,
  resolution and the sizes that differ from timm's model of that name (a run's depth, a
  shrunk test model)."""
  registered = model_spec.registered(arch.name)
  kwargs = {'num_classes': num_classes or 0, 'img_size': image_size}
  changed = lambda field: getattr(arch, field) != getattr(registered, field)  # noqa: E731
  if changed('hidden_size'):
    kwargs['embed_dim'] = arch.hidden_size
  if changed('num_layers'):
    kwargs['depth'] = arch.num_layers
  if arch.block.num_heads != registered.block.num_heads:
    kwargs['num_heads'] = arch.block.num_heads
  if changed('hidden_size') or arch.block.mlp_dim != registered.block.mlp_dim:
    kwargs['mlp_ratio'] = _mlp_ratio(arch)
  if changed('patch_size'):
    kwargs['patch_size'] = arch.patch_size
  if changed('num_registers'):  # timm's Eva (the rotary models) names it its own way
    kwargs['num_reg_tokens' if arch.rotary is not None else 'reg_tokens'] = arch.num_registers
  return kwargs


def _mlp_ratio(arch) -> float:
  """timm's `mlp_ratio` of `arch`: its MLP's first width over the model's (a packed SwiGLU's
  first layer is twice the gated width, except in timm's `Eva` models, the rotary ones, whose
  ratio is of the gated width)."""
  hidden, mlp_dim = arch.hidden_size, arch.block.mlp_dim
  packed = arch.block.mlp == 'swiglu' and arch.rotary is None
  width = 2 * mlp_dim if packed else mlp_dim
  ratio = width / hidden
  if int(hidden * ratio) != width:
    raise torch_layout.ExportError(
      f'timm sizes the MLP as a ratio of the width; {width}/{hidden} does not round-trip'
    )
  return ratio


def _std_conv_layer():
  """timm's SAME-padded StdConv2dSame, standardising as the original code (models_resnet)."""
  torch = torch_layout.require('torch')
  from timm.layers import StdConv2dSame
  from timm.layers.padding import pad_same

  class OriginalStdConv2dSame(StdConv2dSame):
    def forward(self, x):
      if self.same_pad:
        x = pad_same(x, self.kernel_size, self.stride, self.dilation)
      w = self.weight - self.weight.mean(dim=(1, 2, 3), keepdim=True)
      # (w - mean) / (std + eps), where timm divides by sqrt(var + eps).
      w = w / (torch.sqrt((w * w).mean(dim=(1, 2, 3), keepdim=True)) + self.eps)
      return torch.nn.functional.conv2d(
        x, w, self.bias, self.stride, self.padding, self.dilation, self.groups
      )

  return functools.partial(OriginalStdConv2dSame, eps=STD_CONV_EPS)


def build_model(arch, num_classes: Optional[int], image_size: int):
  """timm's `VisionTransformer` of `arch`, numerically ours (tanh GELU, our eps); a model under
  timm's own name (`configs.families`) as `timm.create_model` of that name builds it."""
  timm = torch_layout.require('timm')
  if arch.name in families.MODELS:
    kwargs = _family_kwargs(arch, num_classes, image_size)
    return timm.create_model(arch.name, pretrained=False, **kwargs).eval()
  from timm.layers import GroupNormAct
  from timm.layers import HybridEmbed
  from timm.models import resnetv2

  hidden, mlp_dim = arch.hidden_size, arch.block.mlp_dim
  if int(hidden * (mlp_dim / hidden)) != mlp_dim:
    raise torch_layout.ExportError(
      f'timm sizes the MLP as a ratio of the width; {mlp_dim}/{hidden} does not round-trip'
    )
  kwargs = dict(
    img_size=image_size,
    patch_size=arch.patch_size,
    embed_dim=hidden,
    depth=arch.num_layers,
    num_heads=arch.block.num_heads,
    mlp_ratio=mlp_dim / hidden,
    num_classes=num_classes or 0,
    act_layer='gelu_tanh',
    reg_tokens=arch.num_registers,
    init_values=arch.block.layer_scale,
    **_pooling_kwargs(arch.classifier),
  )
  if arch.resnet is not None:
    # timm's own hybrids: ResNetV2(preact=False, stem_type='same', StdConv2dSame),
    # here with the original standardisation and epsilons.
    backbone = resnetv2.ResNetV2(
      layers=arch.resnet.num_layers,
      num_classes=0,
      global_pool='',
      preact=False,
      stem_type='same',
      width_factor=arch.resnet.width_factor,
      conv_layer=_std_conv_layer(),
      norm_layer=functools.partial(GroupNormAct, num_groups=32, eps=GROUP_NORM_EPS),
    )
    kwargs['embed_layer'] = functools.partial(HybridEmbed, backbone=backbone)
  return timm.models.vision_transformer.VisionTransformer(**kwargs).eval()


def to_timm(flat: Dict[str, np.ndarray], arch=None) -> Dict[str, np.ndarray]:
  """Our flat parameters (no `pre_logits`) -> timm's state_dict as numpy arrays; a rotary
  `arch` gets the layout of timm's `Eva` models (`_to_eva`)."""
  if 'pre_logits/kernel' in flat:
    raise torch_layout.ExportError(
      "timm's ViT has no pre-logits layer; drop pre_logits and the head first (export does this)"
    )
  eva = arch is not None and arch.rotary is not None
  if eva:  # a zero key bias for the fused projection's bias, which _to_eva leaves out
    flat = dict(flat)
    for key in [k for k in flat if k.endswith('MultiHeadDotProductAttention_1/query/bias')]:
      flat.setdefault(key.replace('/query/', '/key/'), np.zeros_like(flat[key]))
  state = torch_layout.to_torch_state(flat, timm_name)
  if eva:
    state = _to_eva(state, *eva_apart(arch))
  return state


def eva_apart(arch) -> Tuple[bool, bool]:
  """Whether timm's `Eva` of `arch` keeps q, k, v apart (EVA-02's B and L: those with the MLP's
  LayerNorm), and the SwiGLU's gate and value apart (those too, and DINOv3's SwiGLU models)."""
  swiglu = arch.block.mlp == 'swiglu'
  return arch.block.mlp_norm, swiglu and (arch.block.mlp_norm or arch.rotary == 'normalised')


# ---------------------------------------------------------------------------
# timm's `Eva` (its rotary models: EVA-02, DINOv3) names its blocks' q/k/v, MLP and LayerScale
# its own way. EVA-02's B and L (those with the MLP's LayerNorm) keep q, k, v apart (`q_proj`,
# `k_proj`, `v_proj`) and the SwiGLU's gate and value apart (`fc1_g`, `fc1_x`); its Ti and S
# fuse q/k/v (`qkv`, with `q_bias` and `v_bias`) and pack the SwiGLU as `fc1` (gate first);
# DINOv3 fuses q/k/v (biases none, or `q_bias` and `v_bias`: the `_qkvb` models) and keeps its
# SwiGLU's gate and value apart. None has a key bias, nor have ours (`biases='no_key'` or
# 'no_qkv'): a fused bias gets zeros in its place. LayerScale's gammas are `gamma_1`, `gamma_2`.

_EVA_BLOCK = re.compile(r'^(blocks\.\d+\.)(attn\.qkv|mlp\.fc1)\.(weight|bias)$')
_LAYER_SCALE = re.compile(r'^(blocks\.\d+\.)ls([12])\.gamma$')
_EVA_SCALE = re.compile(r'^(blocks\.\d+\.)gamma_([12])$')


def _to_eva(state: Dict[str, np.ndarray], apart: bool, gate_apart: bool) -> Dict[str, np.ndarray]:
  """A state_dict in the ViT's names (fused `attn.qkv`, packed `mlp.fc1`, LayerScale `ls1`)
  -> `Eva`'s (`_eva_apart`; LayerScale `gamma_1`)."""
  out = {}
  for key, value in state.items():
    match = _EVA_BLOCK.match(key)
    scale = _LAYER_SCALE.match(key)
    if scale:
      out[f'{scale.group(1)}gamma_{scale.group(2)}'] = value
      continue
    if not match:
      out[key] = value
      continue
    block, module, leaf = match.groups()
    if module == 'attn.qkv':
      q, k, v = np.split(value, 3, axis=0)
      if apart and leaf == 'weight':
        out.update({f'{block}attn.{n}_proj.weight': w for n, w in zip('qkv', (q, k, v))})
      elif apart:
        out.update({f'{block}attn.q_proj.bias': q, f'{block}attn.v_proj.bias': v})
      elif leaf == 'weight':
        out[f'{block}attn.qkv.weight'] = value
      else:
        out.update({f'{block}attn.q_bias': q, f'{block}attn.v_bias': v})
    elif gate_apart:  # the SwiGLU's gate, then its value
      gate, x = np.split(value, 2, axis=0)
      out.update({f'{block}mlp.fc1_g.{leaf}': gate, f'{block}mlp.fc1_x.{leaf}': x})
    else:
      out[key] = value
  return {k: np.ascontiguousarray(v) for k, v in out.items()}


def _from_eva(state: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
  """`Eva`'s state_dict -> the ViT's names (`_to_eva`'s inverse; the fused bias's keys zero)."""
  out = {}
  blocks = sorted({m.group(1) for m in map(re.compile(r'^(blocks\.\d+\.)').match, state) if m})
  taken = set()
  for block in blocks:
    names = {
      'q': (f'{block}attn.q_proj.weight', f'{block}attn.q_proj.bias', f'{block}attn.q_bias'),
      'k': (f'{block}attn.k_proj.weight',),
      'v': (f'{block}attn.v_proj.weight', f'{block}attn.v_proj.bias', f'{block}attn.v_bias'),
    }
    if names['q'][0] in state:  # q, k, v apart
      weights = [state[names[n][0]] for n in 'qkv']
      out[f'{block}attn.qkv.weight'] = np.concatenate(weights, axis=0)
      taken.update(names[n][0] for n in 'qkv')
    q_bias = next((n for n in names['q'][1:] if n in state), None)
    v_bias = next((n for n in names['v'][1:] if n in state), None)
    if q_bias and v_bias:
      zeros = np.zeros_like(state[q_bias])
      out[f'{block}attn.qkv.bias'] = np.concatenate([state[q_bias], zeros, state[v_bias]])
      taken.update((q_bias, v_bias))
    for leaf in ('weight', 'bias'):
      gate, x = f'{block}mlp.fc1_g.{leaf}', f'{block}mlp.fc1_x.{leaf}'
      if gate in state and x in state:
        out[f'{block}mlp.fc1.{leaf}'] = np.concatenate([state[gate], state[x]], axis=0)
        taken.update((gate, x))
  for key in state:
    scale = _EVA_SCALE.match(key)
    if scale:
      out[f'{scale.group(1)}ls{scale.group(2)}.gamma'] = state[key]
      taken.add(key)
  out.update({k: v for k, v in state.items() if k not in taken})
  return out


def _square(n: int) -> Optional[int]:
  """The side of a square grid of `n` > 0 patches, else None."""
  side = math.isqrt(max(n, 0))
  return side if n > 0 and side * side == n else None


def _position_layout(state, arch, what: str) -> bool:
  """Whether timm's `pos_embed` has rows for the patches alone (`no_embed_class=True`: the
  class token and registers get no position embedding, as DINOv2 and DeiT III) rather than
  for the prefix tokens too (False, ours). The row count decides unless both fit, which
  registers allow on small grids (9 rows: 3x3 patches, or a class token, 4 registers and
  2x2 patches); then a model under timm's own name decides (its `posemb`)."""
  rows = int(state['pos_embed'].shape[1])
  prefix = arch.num_prefix_tokens
  embedded, alone = _square(rows - prefix), _square(rows) if prefix else None
  if embedded and alone:
    if arch.name in families.MODELS:
      return arch.posemb == 'patches'
    raise checkpoint.CheckpointError(
      f"{what}: its {rows} position embeddings fit both of timm's layouts: {alone}x{alone} "
      f'patches with the {prefix} class/register token(s) unembedded (no_embed_class=True) '
      f'or {embedded}x{embedded} patches with them embedded (no_embed_class=False); pass '
      "--model naming a model of timm's whose layout is known (vit_jax.configs.families)"
    )
  if alone:
    return True
  if not embedded:
    raise checkpoint.CheckpointError(
      f'{what}: its {rows} position embeddings are neither {prefix} class/register token(s) '
      "and a square patch grid (timm's no_embed_class=False) nor a square grid alone "
      f'(no_embed_class=True), as {arch.name} (classifier={arch.classifier}) needs; '
      'check --model'
    )
  return False


def from_timm(state: Dict[str, np.ndarray], arch, what: str) -> Dict[str, np.ndarray]:
  """timm's state_dict -> our flat parameters for `arch` (checked key by key).

  Either position layout of timm's converts: rows for the prefix tokens and patches (ours),
  or for the patches alone (`no_embed_class=True`), which gets zero rows for the prefix
  tokens: the class token and registers plus zero are themselves, so the model is the same.
  """
  table = arch.posemb != 'none'  # rotary embeddings alone: no table (DINOv3)
  if table and ('pos_embed' not in state or np.ndim(state['pos_embed']) != 3):
    raise checkpoint.CheckpointError(
      f'{what}: no pos_embed [1, tokens, width]; is it a timm ViT state_dict?'
    )
  if not table and 'pos_embed' in state:
    raise checkpoint.CheckpointError(
      f'{what}: has a position table (pos_embed), which {arch.name} has not; check --model'
    )
  if arch.rotary is not None:
    state = _from_eva(state)
  if 'fc_norm.weight' in state and arch.final_norm != 'pooled':
    raise checkpoint.CheckpointError(
      f"{what}: normalises after pooling (fc_norm), unlike the paper's ViT and "
      f'{arch.name}; pass --model naming a model that does (an EVA-02 of '
      'vit_jax.configs.families)'
    )
  num_classes = int(state['head.weight'].shape[0]) if 'head.weight' in state else None
  if 'reg_token' in state:  # timm's register tokens
    arch = arch.changed(num_registers=int(state['reg_token'].shape[1]))
  if 'blocks.0.ls1.gamma' in state:  # timm's LayerScale (init_values; the value only initialises)
    arch = arch.changed(layer_scale=1.0)
  blocks = {k.split('.')[1] for k in state if k.startswith('blocks.')}
  arch = arch.changed(num_layers=len(blocks) or arch.num_layers)  # as a run's
  if table and _position_layout(state, arch, what) and arch.posemb == 'tokens':
    posemb = np.asarray(state['pos_embed'])
    zeros = np.zeros((1, arch.num_prefix_tokens, posemb.shape[-1]), posemb.dtype)
    state = {**state, 'pos_embed': np.concatenate([zeros, posemb], axis=1)}
  rows = int(state['pos_embed'].shape[1]) if table else None
  expected = torch_layout.expected_shapes(arch, num_classes, rows, what)
  return torch_layout.from_torch_state(state, expected, timm_name, what)


# ---------------------------------------------------------------------------
# NaFlex (vit_jax.models.naflex) <-> timm's NaFlexVit (timm.models.naflexvit).

_NAFLEX_RULES = (
  (r'^cls$', 'embeds.cls_token'),
  (r'^registers$', 'embeds.reg_token'),
  (r'^Transformer/posembed_input/pos_embedding$', 'embeds.pos_embed'),
  (r'^embedding/bias$', 'embeds.proj.bias'),
) + _RULES[4:]
_NAFLEX_KERNEL = ('embedding/kernel', 'embeds.proj.weight')


def is_naflex(flat) -> bool:
  """Whether flat parameters are a NaFlex ViT's: a 2D grid of position embeddings."""
  posemb = flat.get('Transformer/posembed_input/pos_embedding')
  return posemb is not None and np.ndim(posemb) == 4


def _naflex_name(key: str):
  name, chunk = timm_name(key)
  return torch_layout.rename(key, _NAFLEX_RULES), chunk


def to_timm_naflex(flat: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
  """A NaFlex ViT's flat parameters -> timm NaFlexVit's state_dict: the patch embedding a
  Linear over (row, column, channel)-flattened patches (timm's channels-last layout)."""
  if 'pre_logits/kernel' in flat:
    raise torch_layout.ExportError(
      "timm's NaFlexVit has no pre-logits layer; drop pre_logits and the head first"
    )
  ours, theirs = _NAFLEX_KERNEL
  kernel = np.asarray(flat[ours])
  state = torch_layout.to_torch_state({k: v for k, v in flat.items() if k != ours}, _naflex_name)
  state[theirs] = np.ascontiguousarray(kernel.reshape(-1, kernel.shape[-1]).T, np.float32)
  return state


# NaFlexViT's `posemb_resample` -> timm's (pos_embed_interp_mode, pos_embed_antialias).
NAFLEX_RESAMPLE = {
  'bilinear': ('bilinear', False),
  'bilinear_antialias': ('bilinear', True),
  'bicubic_antialias': ('bicubic', True),
}
RESAMPLE_METADATA = 'vit_jax_posemb_resample'  # where our exports record it


def from_timm_naflex(
  state: Dict[str, np.ndarray], arch, what: str, resample: Optional[str]
) -> Dict[str, np.ndarray]:
  """timm NaFlexVit's state_dict -> our NaFlex flat parameters for `arch` as a NaFlex ViT whose
  `posemb_resample` is `resample` (one of NAFLEX_RESAMPLE, how the position table is
  resampled to each image's grid), which the file itself does not record.

  The patch embedding may be timm's `embed_proj_type='linear'` (a Linear over
  (row, column, channel)-flattened patches) or 'conv' (a Conv2d [D, C, P, P]).
  """
  from vit_jax.models import naflex

  ours, theirs = _NAFLEX_KERNEL
  posemb = state.get('embeds.pos_embed')
  if posemb is None or np.ndim(posemb) != 4 or theirs not in state:
    raise checkpoint.CheckpointError(
      f'{what}: no embeds.pos_embed [1, rows, columns, width] with an embeds.proj; '
      'is it a timm NaFlexVit with learned position embeddings?'
    )
  if resample not in NAFLEX_RESAMPLE:
    modes = ', '.join(
      f'{name} ({mode}{", antialias" if aa else ""})'
      for name, (mode, aa) in NAFLEX_RESAMPLE.items()
    )
    raise torch_layout.ExportError(
      f'{what}: a timm NaFlexVit file does not record how its position table is resampled to '
      f"each image's grid (timm's pos_embed_interp_mode and pos_embed_antialias; its default "
      f'is bicubic with antialias); say which with --resample: one of {modes}'
    )
  grid = tuple(int(g) for g in posemb.shape[1:3])
  arch = arch.changed(posemb='grid', posemb_grid=grid, posemb_resample=resample)
  num_classes = int(state['head.weight'].shape[0]) if 'head.weight' in state else None
  # The patch size is the file's (a run may train at another than its model name's): a conv's
  # [D, C, P, P], or a linear's [D, P * P * C].
  weight = state[theirs]
  patch = int(weight.shape[2]) if np.ndim(weight) == 4 else math.isqrt(int(weight.shape[1]) // 3)
  arch = arch.changed(patch_size=(patch, patch))
  if 'embeds.reg_token' in state:
    arch = arch.changed(num_registers=int(state['embeds.reg_token'].shape[1]))
  if 'blocks.0.ls1.gamma' in state:
    arch = arch.changed(layer_scale=1.0)
  blocks = {k.split('.')[1] for k in state if k.startswith('blocks.')}
  arch = arch.changed(num_layers=len(blocks) or arch.num_layers)
  model = naflex.NaFlexViT(num_classes, arch)
  shapes = checkpoint.flatten(
    jax_eval_shape(model, (1, posemb.shape[1] * patch, posemb.shape[2] * patch, 3))
  )
  expected = {k: tuple(v.shape) for k, v in shapes.items() if k != ours}
  rest = {k: v for k, v in state.items() if k != theirs}
  flat = torch_layout.from_torch_state(rest, expected, _naflex_name, what)
  weight, shape = np.asarray(state[theirs]), tuple(shapes[ours].shape)
  if weight.ndim == 4:  # the conv's [D, C, P, P]
    kernel = weight.transpose(2, 3, 1, 0)
  else:  # the linear's [D, P * P * C], patches flattened (row, column, channel) as ours
    kernel = weight.T.reshape(shape) if weight.size == math.prod(shape) else weight
  if kernel.shape != shape:
    raise checkpoint.CheckpointError(
      f'{what}: {theirs} has shape {weight.shape}, {ours} needs {shape}; check --model'
    )
  flat[ours] = np.ascontiguousarray(kernel)
  return flat


def jax_eval_shape(model, image_shape):
  """The parameter shapes of `model` at an image of `image_shape`."""
  import jax
  import jax.numpy as jnp

  return jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros(image_shape), train=False))[
    'params'
  ]


_ACT_LAYERS = {'gelu_tanh': 'gelu_tanh', 'gelu': 'gelu', 'quick_gelu': 'quick_gelu'}


def build_naflex_model(arch, num_classes: Optional[int], posemb_grid=None):
  """timm's `NaFlexVit` of a NaFlex ViT's architecture (a `model_spec.Architecture`, or a
  registry entry), numerically ours: its MLP's GELU, its pooling, the final LayerNorm before pooling
  (fc_norm=False), position embeddings resampled as its `posemb_resample` says
  (NAFLEX_RESAMPLE; ours: vit_jax.models.positions.GridPositionEmbs), its table of
  `posemb_grid` (None: the architecture's)."""
  torch_layout.require('timm')
  from timm.models import naflexvit

  if not isinstance(arch, model_spec.Architecture):
    arch = model_spec.Architecture.of(arch)
  hidden, mlp_dim = arch.hidden_size, arch.block.mlp_dim
  interp_mode, antialias = NAFLEX_RESAMPLE[arch.posemb_resample]
  return naflexvit.NaFlexVit(
    num_classes=num_classes or 0,
    patch_size=arch.patch_size,
    embed_dim=hidden,
    depth=arch.num_layers,
    num_heads=arch.block.num_heads,
    mlp_ratio=mlp_dim / hidden,
    class_token=arch.classifier == 'token',
    global_pool={'token': 'token', 'gap': 'avg', 'map': 'map'}[arch.classifier],
    fc_norm=False,
    act_layer=_ACT_LAYERS[arch.block.mlp],
    embed_proj_type='linear',
    pos_embed_grid_size=tuple(int(g) for g in (posemb_grid or arch.posemb_grid)),
    pos_embed_interp_mode=interp_mode,
    pos_embed_antialias=antialias,
    reg_tokens=arch.num_registers,
    init_values=arch.block.layer_scale,
  ).eval()
