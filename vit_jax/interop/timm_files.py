"""What a timm file holds: its model and its weights, from where it lies and from its tensors.

A timm state_dict records neither its model's name nor its weights' tag, and timm keeps the
preprocessing with the tag (`configs.timm_weights`). What says what a file is, surest first:

- what lies with it (`where`): a timm `config.json` beside it (timm's `push_to_hub` writes its
  `architecture` and `pretrained_cfg`), the hub cache's folder `models--timm--NAME.TAG` (where
  `timm.create_model(NAME, pretrained=True)` puts its download), or a file or folder named
  NAME[.TAG] after a timm name of `configs.timm_weights`;
- its tensors (`model_name`): each family's marks (`_MARKS`), the class token, the width, MLP
  width, patch size and grid; a file of a family we do not have by its own marks (`_OTHERS`).

--model and --tag may settle what neither says, never contradict it (`check_model`): a file
converted as another model would be fed the wrong pixels or the wrong activation, silently.
"""

import json
import math
import os
import re
from typing import Dict, List, NamedTuple, Optional

from vit_jax import checkpoint
from vit_jax.configs import families
from vit_jax.configs import model_spec
from vit_jax.configs import timm_weights
from vit_jax.interop import hf
from vit_jax.interop import timm

PREPROCESSING_METADATA = 'vit_jax_preprocessing'  # where our timm exports record it
# timm's `push_to_hub` writes it beside the weights; the name of the transformers' file too.
CONFIG_FILE = hf.CONFIG_FILE


class Place(NamedTuple):
  """What lies with a file: the timm name and tag it says, and where it says it."""

  name: str
  tag: Optional[str]
  source: str  # 'config.json beside it', 'its folder models--timm--...', ...
  pretrained_cfg: Optional[dict] = None  # a timm config.json's, the file's own preprocessing


_HUB_FOLDER = re.compile(r'^models--timm--([A-Za-z0-9_]+)(?:\.([A-Za-z0-9_]+))?$')
_NAMED = re.compile(r'^([a-z0-9_]+)(?:\.([A-Za-z0-9_]+))?$')
_SUFFIXES = ('.safetensors', '.pth', '.pt', '.bin')


def where(path: str) -> Optional[Place]:
  """What lies with the timm file `path` (see the module's docstring); None for nothing."""
  path = os.path.abspath(path)
  beside = os.path.join(os.path.dirname(path), CONFIG_FILE)
  try:
    with open(beside, encoding='utf-8') as f:
      config = json.load(f)
  except (OSError, ValueError):
    config = None
  if isinstance(config, dict) and isinstance(config.get('architecture'), str):
    cfg = config.get('pretrained_cfg') if isinstance(config.get('pretrained_cfg'), dict) else {}
    return Place(config['architecture'], cfg.get('tag'), f"{beside} (timm's config)", cfg)
  parts = path.split(os.sep)
  for part in reversed(parts[:-1]):
    hub = _HUB_FOLDER.match(part)
    if hub:
      return Place(hub.group(1), hub.group(2), f"its folder {part} (timm's hub download)")
  base = parts[-1]
  for suffix in _SUFFIXES:
    base = base.removesuffix(suffix)
  for part in [base] + list(reversed(parts[:-1])):
    named = _NAMED.match(part)
    if named and timm_weights.has_tags(named.group(1)):
      return Place(named.group(1), named.group(2), f'its name {part}')
  return None


def split_tag(text: Optional[str]):
  """--tag's (name, tag): 'NAME.TAG' or 'TAG' (name None); (None, None) for no --tag."""
  if not text:
    return None, None
  name, _, tag = text.rpartition('.')
  return name or None, tag


# ---------------------------------------------------------------------------
# Names: timm's and ours.


def _paper_names() -> Dict[str, str]:
  """timm's names of the paper's models -> ours (`ViT-B_16` for vit_base_patch16_224/384)."""
  out = {}
  for ours, base in timm.TIMM_NAMES.items():
    out[f'{base}_224'] = ours
    if base in timm.TIMM_384:
      out[f'{base}_384'] = ours
  return out


def our_name(timm_name: str) -> Optional[str]:
  """The model of ours that timm's `timm_name` is (the same for a family's), else None."""
  if timm_name in families.MODELS:
    return timm_name
  return _paper_names().get(timm_name)


# Families of timm's that vit_jax does not convert: a prefix of their timm names, their title.
_OTHER_NAMES = (
  ('beitv2_', 'BEiT v2'),
  ('beit3_', 'BEiT-3'),
  ('beit_', 'BEiT'),
  ('deit_', 'DeiT (distilled, with its second token)'),
  ('cait_', 'CaiT'),
  ('swin', 'Swin Transformer'),
  ('eva02_', 'EVA-02 (its CLIP towers and 336/448 px models)'),
  ('eva_', 'EVA'),
  ('vit_', "timm's ViT variants"),
  ('naflexvit_', "timm's NaFlexViT"),
)


def _other_family(name: str) -> Optional[str]:
  """The title of a timm name of a family we do not convert (by its prefix), else None."""
  if our_name(name) is not None:
    return None
  for prefix, title in _OTHER_NAMES:
    if name.startswith(prefix):
      return title
  return None


# What the tensors of a family we do not convert show: (title, keys all present, keys absent).
_OTHERS = (
  ('Swin Transformer', ('layers.0.blocks.0.attn.relative_position_bias_table',), ()),
  ('CaiT', ('blocks_token_only.0.norm1.weight',), ()),
  ('DeiT (distilled, with its second token)', ('dist_token',), ()),
  ('BEiT', ('blocks.0.gamma_1', 'blocks.0.attn.relative_position_bias_table'), ()),
  ('BEiT', ('rel_pos_bias.relative_position_bias_table',), ()),
)

# Marks that a family of ours shares (EVA-02's q/v biases, DINOv3's LayerScale without a
# table), told only where no family's fits.
_OTHERS_UNFIT = (
  ('EVA', ('blocks.0.attn.q_bias', 'pos_embed'), ()),
  ("timm's rotary ViT (vit_*_rope_*)", ('blocks.0.gamma_1',), ('pos_embed',)),
)


def other_family(state, marks=_OTHERS) -> Optional[str]:
  """The title of a family we do not convert whose marks the tensors show, else None."""
  for title, present, absent in marks:
    if all(k in state for k in present) and not any(k in state for k in absent):
      return title
  return None


def unsupported(what: str, why: str) -> checkpoint.CheckpointError:
  return checkpoint.CheckpointError(
    f"{what}: {why}, a family vit_jax does not convert (its models: the paper's and "
    'vit_jax.configs.families); it cannot be imported'
  )


# ---------------------------------------------------------------------------
# The model from the tensors.


def _marks(arch) -> set:
  """The state_dict keys that timm's model of `arch` has and the paper's ViT has not (its Eva
  layout, that of the rotary models, names LayerScale `gamma_1`)."""
  scale = 'blocks.0.gamma_1' if arch.rotary is not None else 'blocks.0.ls1.gamma'
  return {
    mark
    for mark, has in (
      ('norm_pre.weight', arch.pre_norm),
      ('attn_pool.latent', arch.classifier == 'map'),
      ('reg_token', arch.num_registers > 0),
      (scale, arch.block.layer_scale is not None),
      ('fc_norm.weight', arch.final_norm == 'pooled'),
      ('cls_token', arch.has_class_token),
      ('pos_embed', arch.posemb != 'none'),
    )
    if has
  }


_ALL_MARKS = ('norm_pre.weight', 'attn_pool.latent', 'reg_token', 'blocks.0.ls1.gamma')
_ALL_MARKS += ('blocks.0.gamma_1', 'fc_norm.weight', 'cls_token', 'pos_embed')


def _attention_biases(state) -> str:
  """Which biases the first block's q/k/v projections have: 'all' (fused, timm's ViT), 'no_key'
  (the query's and value's: timm's Eva, EVA-02), or 'none'."""
  if 'blocks.0.attn.qkv.bias' in state:
    return 'all'
  if any(f'blocks.0.attn.{k}' in state for k in ('q_bias', 'q_proj.bias')):
    return 'no_key'
  return 'none'


def _arch_biases(arch) -> str:
  return {'all': 'all', 'no_key': 'no_key'}.get(arch.block.biases, 'none')


def _mlp_layout(state) -> str:
  """The first block's MLP: a SwiGLU with its gate apart ('apart', timm's `fc1_g`) or packed
  into a first layer twice the MLP's width ('packed'), or one activation ('plain')."""
  if 'blocks.0.mlp.fc1_g.weight' in state:
    return 'apart'
  fc1, fc2 = _shape(state, 'blocks.0.mlp.fc1.weight'), _shape(state, 'blocks.0.mlp.fc2.weight')
  return 'packed' if fc1 and fc2 and fc1[0] == 2 * fc2[1] else 'plain'


def _arch_mlp_layout(arch) -> str:
  if arch.block.mlp != 'swiglu':
    return 'plain'
  return 'apart' if arch.rotary is not None and timm.eva_apart(arch)[1] else 'packed'


def _shape(state, key):
  return tuple(state[key].shape) if key in state else None


def _sizes(state):
  """(width, MLP width, patch size) of a timm ViT or NaFlexVit file, None for another file; a
  SwiGLU's MLP width is its gated one (timm's Eva keeps the gate apart, `fc1_g`)."""
  fc2 = _shape(state, 'blocks.0.mlp.fc2.weight')
  kernel = _shape(state, 'patch_embed.proj.weight')
  linear = _shape(state, 'embeds.proj.weight')  # NaFlexVit's: [width, patch * patch * 3]
  if fc2 is None or (kernel is None and linear is None):
    return None
  if kernel is None:
    patch = math.isqrt(linear[1] // 3) if len(linear) == 2 else linear[2]
    return linear[0], fc2[1], patch
  return kernel[0], fc2[1], kernel[2]


def _naflex_marks(arch) -> set:
  """The keys that timm's NaFlexVit of `arch` has beyond the blocks."""
  return {
    mark
    for mark, has in (
      ('embeds.cls_token', arch.has_class_token),
      ('embeds.reg_token', arch.num_registers > 0),
      ('attn_pool.latent', arch.classifier == 'map'),
    )
    if has
  }


def family_fits(state) -> List[str]:
  """The family models (`configs.families.MODELS`) whose layout the tensors show, at any
  resolution: the keys that set a model apart (`_marks`), the attention's biases, the MLP's
  layout, the width, MLP width and patch size."""
  sizes = _sizes(state)
  if sizes is None:
    return []
  if 'embeds.proj.weight' in state:  # timm's NaFlexVit: the NaFlex models of timm's
    present = {
      m for m in ('embeds.cls_token', 'embeds.reg_token', 'attn_pool.latent') if m in state
    }
    return [
      name
      for name in families.MODELS
      for arch in [model_spec.registered(name)]
      if arch.posemb == 'grid'
      and (arch.hidden_size, arch.block.mlp_dim, arch.patch_size[0]) == sizes
      and _naflex_marks(arch) == present
    ]
  present = {mark for mark in _ALL_MARKS if mark in state}
  biases, mlp = _attention_biases(state), _mlp_layout(state)
  fits = []
  for name in families.MODELS:
    arch = model_spec.registered(name)
    if arch.posemb == 'grid' or (arch.hidden_size, arch.block.mlp_dim, arch.patch_size[0]) != sizes:
      continue  # (NaFlex's models are timm's NaFlexVit, whose files are told apart above)
    layout = (_marks(arch), _arch_biases(arch), _arch_mlp_layout(arch))
    if layout == (present, biases, mlp):
      fits.append(name)
  return fits


def _paper_fits(state) -> List[str]:
  """The paper's models (timm's `vit_*` names, ours `ViT-*`, `-gap` for mean pooling) whose
  sizes a plain ViT file's tensors show."""
  sizes = _sizes(state)
  if sizes is None or any(k.startswith('patch_embed.backbone') for k in state):
    return []
  fits = []
  for ours in timm.TIMM_NAMES:
    name = ours if 'cls_token' in state else f'{ours}-gap'
    try:
      arch = model_spec.registered(name)
    except KeyError:
      continue
    if arch.resnet is None and (arch.hidden_size, arch.block.mlp_dim, arch.patch_size[0]) == sizes:
      fits.append(name)
  return fits


def _grid_fits(name: str, rows: int) -> bool:
  """Whether `rows` position embeddings are the grid of `name`'s resolution suffix."""
  arch = model_spec.registered(name)
  side = int(re.search(r'_(\d+)$', name).group(1)) // arch.patch_size[0]
  return rows - arch.posemb_prefix == side * side


_ACTIVATIONS = {
  'gelu': 'exact GELU',
  'gelu_tanh': 'tanh GELU',
  'quick_gelu': 'quick GELU',
  'swiglu': 'SwiGLU',
}


def _named(name: str) -> str:
  """`name` and what tells it apart from a model of the same tensors: its MLP's activation and
  its default weights' input."""
  activation = _ACTIVATIONS[model_spec.registered(name).block.mlp]
  if name not in families.MODELS:
    return f"{name} (the paper's: {activation}, [-1, 1] pixels)"
  statistics = timm_weights.statistics_name(name, timm_weights.tags(name)[0])
  return f'{name} ({activation}, {timm_weights.STATISTICS_TITLES[statistics]})'


def model_name(state, what: str) -> str:
  """The model of a timm file that nothing beside it names, from its tensors; a file of a
  family we do not have, or one whose tensors fit models that differ in what the file does
  not record (an activation, input statistics), is one line naming them."""
  title = other_family(state)
  if title is not None:
    raise unsupported(what, f'its tensors are those of {title}')
  fits = family_fits(state)
  title = None if fits else other_family(state, _OTHERS_UNFIT)
  if title is not None:
    raise unsupported(what, f'its tensors are those of {title}')
  rows = _shape(state, 'pos_embed')
  if fits and rows is not None:
    at_size = [n for n in fits if re.search(r'_(\d+)$', n) is None or _grid_fits(n, rows[1])]
    fits = at_size or fits
    if len(at_size) > 1 and len({_layout(n) for n in at_size}) == 1:
      raise checkpoint.CheckpointError(
        f'{what}: its tensors fit {" and ".join(at_size)}, whose resolutions give the same grid '
        "and which timm's weights crop at their own; pass --model naming the one it holds"
      )
  if not fits or all(_plain(n) for n in fits):
    fits += _paper_fits(state)  # the paper's layout: its models fit too
  kinds = {}  # an architecture (whatever its name) -> the first name of it
  for name in fits:
    kinds.setdefault(_layout(name), name)
  if len(kinds) == 1 and fits[0] in families.MODELS:
    return fits[0]
  if not kinds:
    sizes = _sizes(state)
    sizes = f' (width {sizes[0]}, MLP {sizes[1]}, patch {sizes[2]})' if sizes else ''
    raise checkpoint.CheckpointError(
      f'{what}: its tensors{sizes} fit no model of vit_jax.configs.architectures.MODEL_CONFIGS '
      'by their sizes and layout; pass --model naming the one whose architecture it is'
    )
  raise checkpoint.CheckpointError(
    f'{what}: its tensors fit {" and ".join(_named(n) for n in kinds.values())}, which differ '
    'in what the file does not record; pass --model naming the one whose weights it holds'
  )


def _layout(name: str):
  """Registry entry `name`'s architecture whatever its name: names that differ in their
  resolution alone have one."""
  return model_spec.registered(name).changed(name=None)


def _plain(name: str) -> bool:
  """Whether a family's file has the paper's layout (DeiT, SigLIP's mean-pooled models)."""
  if name not in families.MODELS:
    return False
  arch = model_spec.registered(name)
  return _marks(arch) <= {'cls_token', 'pos_embed'} and _arch_biases(arch) == 'all'


def check_model(name: str, state, place: Optional[Place], what: str) -> None:
  """Refuses --model=`name` where what lies with the file, or its tensors, show another model
  (see the module's docstring)."""
  if place is not None:
    named = our_name(place.name)
    if named is None:
      title = _other_family(place.name)
      raise unsupported(
        what, f"{place.source} names timm's {place.name}" + (f' ({title})' if title else '')
      )
    if named != name:
      ours = '' if named == place.name else f', our {named}'
      raise checkpoint.CheckpointError(
        f"--model={name}: {place.source} names timm's {place.name}{ours}; leave --model out "
        '(or rename the file, if that name is not what it holds)'
      )
    if name not in families.MODELS and place.tag and timm_weights.has_tags(place.name):
      if place.tag in timm_weights.tags(place.name):
        weights = timm_weights.preprocessing(place.name, place.tag)
        if weights.input_stats is not None:
          raise checkpoint.CheckpointError(
            f"{what}: {place.source} says it holds timm's {place.name}.{place.tag}, weights "
            f"that take other input statistics (mean {weights.mean}) than the paper's "
            f'{name} ([-1, 1] pixels); vit_jax does not convert them'
          )
    return
  fits = family_fits(state)
  if name in fits:
    return
  title = other_family(state) or (None if fits else other_family(state, _OTHERS_UNFIT))
  if title is not None:
    raise unsupported(what, f'its tensors are those of {title}')
  if not fits:
    return
  if name not in families.MODELS and all(_plain(n) for n in fits):
    return  # a plain ViT's tensors: --model settles whose weights they are
  raise checkpoint.CheckpointError(
    f'--model={name}: the tensors of {what} show the layout of '
    f'{" and ".join(sorted(set(fits)))}, not of {name}; leave --model out'
  )


# ---------------------------------------------------------------------------
# The weights' preprocessing.


def preprocessing(
  name: str, state, what: str, place: Optional[Place], tag: Optional[str]
) -> timm_weights.Preprocessing:
  """The preprocessing of the weights a timm file of family model `name` holds: its
  config.json's, else that of --tag (`tag`: 'TAG' or 'NAME.TAG') or the tag its place names,
  else the one that every tag of `name` with its head's classes shares; tags that differ are
  one line naming them and --tag."""
  size = timm_weights.default(name).size
  if place is not None and place.pretrained_cfg and 'mean' in place.pretrained_cfg:
    return _from_config(name, place, size)
  named, tag = split_tag(tag)
  if named not in (None, name):
    raise checkpoint.CheckpointError(
      f'--tag={named}.{tag}: {what} holds {name}; pass --tag={name}.TAG or TAG alone'
    )
  tags = timm_weights.tags(name)
  if tag is None and place is not None and place.name == name:
    tag = place.tag
  if tag is not None:
    if tag not in tags:
      raise checkpoint.CheckpointError(
        f"--tag={tag}: timm's {name} has the weights {', '.join(tags)}; pass one of them"
      )
    return timm_weights.preprocessing(name, tag)
  classes = int(state['head.weight'].shape[0]) if 'head.weight' in state else 0
  with_head = [t for t in tags if timm_weights.head_classes(name, t) == classes]
  groups = timm_weights.groups(name, with_head or tags)
  if len(groups) == 1:
    (candidates,) = groups.values()
    if len(candidates) == 1:
      return timm_weights.preprocessing(name, candidates[0])
    return timm_weights.preprocessing(name, candidates[0]).named(name)
  default = timm_weights.preprocessing(name, tags[0])
  if (
    not with_head
    and len({timm_weights.preprocessing(name, g[0]).input_stats for g in groups.values()}) == 1
  ):
    # A head of its own (a fine-tune): whichever tag it started from, the model's input is the
    # same; the evaluation crop is taken from timm's default weights, and says so.
    return default.named(f'{name}.{tags[0]} (assumed: its head fits no tag; --tag names another)')
  heads = f' with a {classes}-class head' if with_head else ''
  described = '; '.join(
    f'{", ".join(t)}: {timm_weights.preprocessing(name, t[0]).summary()}' for t in groups.values()
  )
  raise checkpoint.CheckpointError(
    f"{what}: timm's weights of {name}{heads} differ in preprocessing ({described}); pass "
    f'--tag naming its weights (e.g. --tag={name}.{next(iter(groups.values()))[0]})'
  )


def _from_config(name: str, place: Place, size: int) -> timm_weights.Preprocessing:
  """The preprocessing a timm config.json beside the file records (its pretrained_cfg)."""
  cfg = place.pretrained_cfg
  input_size = cfg.get('input_size') or (3, size, size)
  weights = f'{name}.{place.tag}' if place.tag else name
  return timm_weights.Preprocessing(
    weights,
    tuple(float(v) for v in cfg['mean']),
    tuple(float(v) for v in cfg['std']),
    int(input_size[-1]),
    float(cfg.get('crop_pct', timm_weights.DEFAULT_CROP_PCT)),
    cfg.get('interpolation', 'bicubic'),
    cfg.get('crop_mode', 'center'),
  )


def recorded(metadata: dict) -> Optional[timm_weights.Preprocessing]:
  """The preprocessing our timm export recorded in a file's metadata, else None."""
  if not metadata.get(PREPROCESSING_METADATA):
    return None
  return timm_weights.Preprocessing.from_json(json.loads(metadata[PREPROCESSING_METADATA]))
