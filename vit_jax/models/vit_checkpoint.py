"""The ViT's parameter tree as checkpoints hold it: its names, layouts and the surgery that
fine-tuning does on it (paper 3.2), on trees in memory.

`canonical` maps the key variants of released files (the original release, newer Flax
numbering, big_vision's prefixes, scanned blocks and root position embedding) onto this
model's names; `stack_blocks` and `unstack_blocks` move between the scanned
(`Transformer/encoderblock` with a layer axis) and the released (`encoderblock_{i}`) layout;
`resize_posemb` and `resize_patch_embedding` move a checkpoint to another resolution or patch
size; `adapt` turns a pre-trained tree into one to fine-tune; `spec_of` reads the model a tree
holds from its shapes (`configs.model_spec.ModelSpec`). Reading and writing files is
`vit_jax.checkpoint`'s, which calls these (and re-exports the official API's names).
"""

import functools
import math
import re
from typing import Mapping, Optional

import jax
import numpy as np

from vit_jax.configs import model_spec
from vit_jax.configs import schema
from vit_jax.configs.model_spec import ModelSpec
from vit_jax.core.errors import UserError
from vit_jax.models import resample

_PREFIXES = ('opt/target/', 'params/')
# Newer Flax numbering inside an encoder block -> the original release's.
_NEW_BLOCK_NAMES = {
  'LayerNorm_1': 'LayerNorm_2',
  'MultiHeadDotProductAttention_0': 'MultiHeadDotProductAttention_1',
  'MlpBlock_0': 'MlpBlock_3',
}
_POSEMB = 'Transformer/posembed_input/pos_embedding'
_BLOCK = re.compile(r'^Transformer/encoderblock_(\d+)/')
_EMBEDDING = 'embedding/kernel'
# Layers only pre-training uses (paper 3.1 pre-logits; B.1.2 masked patch
# prediction; self-distillation's heads, models.dino); fine-tuning drops them when the new
# model has none, and a model that has them (continued pre-training) starts them fresh where
# the checkpoint has none.
_PRETRAINING_ONLY = ('pre_logits/', 'mask_token', 'mpp_head/', 'dino_head/', 'ibot_head/')


class CheckpointError(UserError, ValueError):
  """A checkpoint that cannot be read or does not fit the model; one line."""


def shape_of(x) -> tuple:
  """An array's (or a shape struct's) shape as a tuple, for messages."""
  return tuple(np.shape(x))


def canonical(flat: dict) -> dict:
  """Flat parameters {'a/b': array} of a released file (any of its key variants) in this
  model's names."""
  for prefix in _PREFIXES:
    if any(k.startswith(prefix) for k in flat):
      flat = {k[len(prefix) :]: v for k, v in flat.items() if k.startswith(prefix)}
      break

  out = {}
  for key, value in flat.items():
    # big_vision with `scan=True`: one block whose leaves carry a layer axis.
    if key.startswith('Transformer/encoderblock/'):
      rest = key[len('Transformer/encoderblock/') :]
      for i, layer_value in enumerate(value):
        out[f'Transformer/encoderblock_{i}/{rest}'] = layer_value
      continue
    out[key] = value

  renamed = {}
  for key, value in out.items():
    match = re.match(r'(Transformer/encoderblock_\d+/)([^/]+)(/.*)', key)
    if match and match.group(2) in _NEW_BLOCK_NAMES:
      key = match.group(1) + _NEW_BLOCK_NAMES[match.group(2)] + match.group(3)
    # Old hybrid files store GroupNorm scale/bias as (1, 1, 1, C).
    if re.search(r'(^|/)gn[^/]*/(scale|bias)$', key) and value.ndim == 4:
      value = value.reshape(-1)
    renamed[key] = value

  # big_vision keeps the position embedding at the root and adds it to the
  # patches only, before the class token is prepended. Our class token gets the
  # embedding's first row, so a zero row makes the two models compute the same.
  if 'pos_embedding' in renamed:
    posemb = renamed.pop('pos_embedding')
    if 'cls' in renamed:
      posemb = np.concatenate([np.zeros_like(posemb[:, :1]), posemb], axis=1)
    renamed[_POSEMB] = posemb
  return renamed


def _is_stacked_encoder(node) -> bool:
  return isinstance(node, Mapping) and 'encoderblock' in node


def _is_unrolled_encoder(node) -> bool:
  return isinstance(node, Mapping) and 'encoderblock_0' in node


def is_stacked(tree) -> bool:
  """Whether `tree` holds scanned encoder blocks (`Transformer/encoderblock` with a layer axis)."""
  found = []
  jax.tree.map(lambda n: found.append(_is_stacked_encoder(n)), tree, is_leaf=_is_stacked_encoder)
  return any(found)


def _layer(x, i):
  if isinstance(x, jax.ShapeDtypeStruct):
    sharding = getattr(x, 'sharding', None)
    if isinstance(sharding, jax.sharding.NamedSharding):
      spec = tuple(sharding.spec)[1:]
      sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec))
    return jax.ShapeDtypeStruct(x.shape[1:], x.dtype, sharding=sharding)
  return x[i]


def _stack(layers):
  first = layers[0]
  if isinstance(first, jax.ShapeDtypeStruct):
    return jax.ShapeDtypeStruct((len(layers),) + tuple(first.shape), first.dtype)
  if isinstance(first, np.ndarray):
    return np.stack(layers)
  return jax.numpy.stack(layers)


def unstack_blocks(tree):
  """Scanned blocks -> `encoderblock_{i}`, wherever they occur in `tree` (params, optimizer state).

  The layout of released files, exports and checkpoints; the inverse of
  `stack_blocks`. Arrays (numpy or jax) are sliced, shape structs reshaped.
  """

  def unstack(node):
    if not _is_stacked_encoder(node):
      return node
    node = dict(node)
    stacked = node.pop('encoderblock')
    num_layers = jax.tree.leaves(stacked)[0].shape[0]
    for i in range(num_layers):
      node[f'encoderblock_{i}'] = jax.tree.map(lambda x, i=i: _layer(x, i), stacked)
    return node

  return jax.tree.map(unstack, tree, is_leaf=_is_stacked_encoder)


def stack_blocks(tree):
  """`encoderblock_{i}` -> one `encoderblock` whose leaves have a leading layer axis (nn.scan)."""

  def stack(node):
    if not _is_unrolled_encoder(node):
      return node
    node = dict(node)
    num_layers = sum(1 for k in node if re.fullmatch(r'encoderblock_\d+', k))
    layers = [node.pop(f'encoderblock_{i}') for i in range(num_layers)]
    node['encoderblock'] = jax.tree.map(lambda *xs: _stack(xs), *layers)
    return node

  return jax.tree.map(stack, tree, is_leaf=_is_unrolled_encoder)


# How position embeddings are resized for a new resolution (paper 3.2):
# 'zoom' is the official `interpolate_posembed`, `scipy.ndimage.zoom(order=1)`
# on the grid: linear, the corner embeddings stay on the corners. 'bilinear'
# samples at half-pixel centres, as torch's `interpolate(mode='bilinear',
# align_corners=False)`; kept for runs that started from it. The antialiased
# ones are torch's `interpolate(..., antialias=True)` (`resample.antialias_window`): timm resizes
# position embeddings and patch kernels with 'bicubic_antialias' by default.
POSEMB_RESIZE = schema.allowed('posemb_resize')
# The resizes a FlexiViT PI-resize inverts (`pi_resize_matrix`): bilinear is FlexiViT's and
# big_vision's; timm's `resample_patch_embed` defaults to 'bicubic_antialias'.
PATCH_RESIZE = schema.allowed('patch_resize')


def resize_matrix(old: int, new: int, method: str) -> np.ndarray:
  """[new, old] float64: one axis resized from `old` to `new` samples by `method`
  (POSEMB_RESIZE)."""
  if method == 'zoom':
    return zoom_matrix(old, new)
  if method == 'bilinear':
    return bilinear_matrix(old, new)
  return resample.antialias_window(np.arange(new, dtype=np.float64), float(new), old, method)


def _zoom_axis(grid: np.ndarray, axis: int, size: int) -> np.ndarray:
  """Linear resampling of `axis` to `size` points, first and last on the old first and last."""
  old = grid.shape[axis]
  # scipy.ndimage.zoom (grid_mode=False): output point i reads input point
  # i * (old - 1) / (size - 1); a single output point reads point 0.
  coords = np.arange(size) * ((old - 1) / (size - 1) if size > 1 else 0.0)
  lo = np.floor(coords).astype(np.int64)
  hi = np.minimum(lo + 1, old - 1)
  shape = [1] * grid.ndim
  shape[axis] = size
  frac = (coords - lo).reshape(shape)
  return np.take(grid, lo, axis=axis) * (1 - frac) + np.take(grid, hi, axis=axis) * frac


def zoom_matrix(old: int, new: int) -> np.ndarray:
  """[new, old] float64: the 'zoom' resize of one grid axis as a matrix."""
  return _zoom_axis(np.eye(old), 0, new)


def bilinear_matrix(old: int, new: int) -> np.ndarray:
  """[new, old] float64: bilinear resampling of one axis at half-pixel centres, edges
  clamped, no antialiasing (tf.image.resize; torch's interpolate, align_corners=False)."""
  src = np.maximum((np.arange(new) + 0.5) * (old / new) - 0.5, 0.0)
  lo = np.minimum(np.floor(src).astype(np.int64), old - 1)
  hi = np.minimum(lo + 1, old - 1)
  frac = src - lo
  matrix = np.zeros((new, old))
  np.add.at(matrix, (np.arange(new), lo), 1.0 - frac)
  np.add.at(matrix, (np.arange(new), hi), frac)
  return matrix


@functools.lru_cache(maxsize=32)
def pi_resize_matrix(old: int, new: int, method: str = 'bilinear') -> np.ndarray:
  """[new, old] float64: FlexiViT's PI-resize of one axis of a patch-embedding kernel.

  With B the resize of a patch by `method` (PATCH_RESIZE; FlexiViT's is bilinear), the new
  kernel is pinv(B^T) @ kernel: tokens of a resized patch equal the old tokens whenever
  B has full column rank (upsampling), a least-squares fit when shrinking.
  These resizes are separable, so the 2D matrix is the Kronecker product of
  the two axes' and its pseudo-inverse the product of theirs.
  """
  if method not in PATCH_RESIZE:
    raise CheckpointError(f'patch_resize={method!r}: use one of {", ".join(PATCH_RESIZE)}')
  return np.linalg.pinv(resize_matrix(old, new, method).T)


def resize_patch_embedding(kernel: np.ndarray, patch_size, method: str = 'bilinear') -> np.ndarray:
  """PI-resize (FlexiViT, Beyer et al. 2023) of an `embedding/kernel` [ph, pw, C, D] to
  [patch_size[0], patch_size[1], C, D] over `method`'s resize (PATCH_RESIZE), in float64;
  big_vision's `flexi` and timm's `resample_patch_embed(..., interpolation='bilinear',
  antialias=False)` compute the 'bilinear' one, timm's defaults 'bicubic_antialias'."""
  rows = pi_resize_matrix(kernel.shape[0], int(patch_size[0]), method)
  cols = pi_resize_matrix(kernel.shape[1], int(patch_size[1]), method)
  resized = np.einsum('ah,bw,hwcd->abcd', rows, cols, np.asarray(kernel, np.float64))
  return resized.astype(np.asarray(kernel).dtype)


def resize_posemb(
  posemb: np.ndarray, num_tokens: int, num_prefix_tokens: int, method: str = 'zoom'
) -> np.ndarray:
  """Resizes the square grid of position embeddings (paper 3.2); see POSEMB_RESIZE.

  Args:
    posemb: [1, num_prefix_tokens + g*g, D].
    num_tokens: new sequence length, num_prefix_tokens + G*G.
    num_prefix_tokens: leading rows kept as they are (1 for the class token).
    method: 'zoom' (the official code's), 'bilinear', or an antialiased one (timm's default:
      'bicubic_antialias').

  Returns:
    [1, num_tokens, D] float32.
  """
  if method not in POSEMB_RESIZE:
    raise CheckpointError(f'posemb_resize={method!r}: use one of {", ".join(POSEMB_RESIZE)}')
  prefix, grid = posemb[:, :num_prefix_tokens], posemb[0, num_prefix_tokens:]
  old, new = len(grid), num_tokens - num_prefix_tokens
  g_old, g_new = math.isqrt(old), math.isqrt(new)
  if g_old * g_old != old or g_new * g_new != new:
    raise CheckpointError(
      f'position embeddings: cannot resize {old} to {new} patch positions; '
      'only square grids (square images) can be interpolated'
    )
  grid = grid.reshape(g_old, g_old, -1)
  if method == 'zoom':
    grid = grid.astype(np.float64)
    grid = _zoom_axis(_zoom_axis(grid, 0, g_new), 1, g_new)
  elif method != 'bilinear':
    matrix = resize_matrix(g_old, g_new, method)
    grid = np.einsum('ah,bw,hwd->abd', matrix, matrix, grid.astype(np.float64))
  else:
    # No antialias: shrinking samples the grid rather than blurring it.
    grid = jax.image.resize(
      grid.astype(np.float32), (g_new, g_new, grid.shape[-1]), 'bilinear', antialias=False
    )
  grid = np.asarray(grid, np.float32).reshape(1, new, -1)
  return np.concatenate([prefix.astype(np.float32), grid], axis=1)


def interpolate_posembed(posemb, num_tokens: int, has_class_token: bool) -> np.ndarray:
  """The official `checkpoint.interpolate_posembed`: `resize_posemb` with 'zoom'."""
  return resize_posemb(np.asarray(posemb), num_tokens, int(has_class_token), 'zoom')


def block_options_of(names) -> dict:
  """The `Block` fields that the parameter names of one encoder block ('LayerNorm_0/scale',
  ...) show: what a checkpoint holds of its blocks' options."""
  attention = 'MultiHeadDotProductAttention_1/'
  if 'LayerNorm_0/bias' not in names:
    biases = 'no_qkv_or_norm'
  elif attention + 'query/bias' not in names:
    biases = 'no_qkv'
  elif attention + 'key/bias' not in names:
    biases = 'no_key'
  else:
    biases = 'all'
  return {
    'parallel_block': 'LayerNorm_2/scale' not in names,
    'qk_norm': attention + 'query_norm/scale' in names,
    'biases': biases,
    'layer_scale': 1.0 if 'ls1/gamma' in names else None,  # the value only initialises
    'mlp_norm': 'MlpBlock_3/LayerNorm_0/scale' in names,
  }


def spec_of(flat: dict, name: str, what: str, image_size: Optional[int] = None) -> ModelSpec:
  """The model that flat parameters ({'a/b': array} in this model's names, blocks unrolled) of
  registry model `name` hold: what their shapes fix taken from them (depth, a plain ViT's patch
  size, the pre-logits width, registers, block options, the resolution its position
  embeddings hold; a 2D table is a NaFlex ViT), the rest from the registry. A model without a
  position table (posemb='none': rotary embeddings alone) holds no resolution: `image_size`
  is its (None: the patch size times 16). CheckpointError (one line) for shapes that `name`
  cannot have; `what` names the parameters in it."""
  registered = model_spec.registered(name)
  kernel = flat.get(_EMBEDDING)
  patch = None
  if registered.resnet is None and kernel is not None and np.ndim(kernel) == 4:
    patch = tuple(int(n) for n in np.shape(kernel)[:2])  # a run may train at another patch
  blocks = {m.group(1) for m in map(_BLOCK.match, flat) if m}  # a run may set its depth
  first = [key.split('/', 2)[2] for key in flat if key.startswith('Transformer/encoderblock_0/')]
  arch = model_spec.resolve(
    name,
    num_layers=len(blocks) or None,
    block=block_options_of(first) if first else None,
    patch_size=patch,
    num_registers=int(np.shape(flat['registers'])[1]) if 'registers' in flat else 0,
    representation_size=(
      int(np.shape(flat['pre_logits/kernel'])[-1]) if 'pre_logits/kernel' in flat else None
    ),
  )
  posemb = flat.get(_POSEMB)
  if posemb is not None and np.ndim(posemb) == 4:  # NaFlex's table of rows x columns
    if arch.classifier not in model_spec.NAFLEX_CLASSIFIERS:
      raise CheckpointError(
        f'{what} is a NaFlex ViT (2D position embeddings); {arch.name} pools with '
        f'{arch.classifier!r}, NaFlex with one of {model_spec.NAFLEX_CLASSIFIERS}: check --model'
      )
    grid = tuple(int(g) for g in np.shape(posemb)[1:3])
    arch = arch.changed(posemb='grid', posemb_grid=grid)
    return ModelSpec(arch, grid[0] * arch.patch_size[0])
  if posemb is None and arch.posemb == 'none':
    return ModelSpec(arch, image_size or _NO_TABLE_GRID * arch.stride)
  if posemb is None or np.ndim(posemb) != 3:
    raise CheckpointError(
      f'{what}: no {_POSEMB} of shape [1, tokens, width]; is it a ViT checkpoint?'
    )
  grid = square_grid(np.shape(posemb)[1], arch, what)
  return ModelSpec(arch, grid * arch.stride)


_NO_TABLE_GRID = 16  # patches per side of a checkpoint without a table, unless told otherwise


def square_grid(num_tokens: int, architecture, what: str) -> int:
  """Patches per side of `num_tokens` position embeddings of `architecture`: its prefix tokens
  with rows in the table, then a square grid; CheckpointError for other counts."""
  num_prefix = architecture.posemb_prefix
  num_patches = num_tokens - num_prefix
  grid = math.isqrt(max(num_patches, 0))
  if num_patches < 1 or grid * grid != num_patches:
    raise CheckpointError(
      f'{what}: {num_tokens} position embeddings are not {num_prefix} class token(s) + a square '
      f'patch grid, as {architecture.name} (classifier={architecture.classifier}) needs; '
      'check --model'
    )
  return grid


_REGISTERS = 'registers'


def match_registers(restored: dict, init: dict, architecture) -> tuple:
  """`restored` with as many register tokens (Darcet et al. 2023) as the model `init` is of:
  a released ViT without registers fine-tuned with some, or a run's registers dropped.

  The registers kept keep their tokens and position rows; new ones take `init`'s (a fresh
  model's), rows placed after the class token as `vit.prepend_tokens` lays them out; dropped
  ones lose both. Returns (flat parameters, {'re-initialised': [...], 'dropped': [...]}).
  """
  old = int(restored[_REGISTERS].shape[1]) if _REGISTERS in restored else 0
  new = int(init[_REGISTERS].shape[1]) if _REGISTERS in init else 0
  report = {'re-initialised': [], 'dropped': []}
  if old == new or _POSEMB not in restored or _POSEMB not in init:
    return restored, report
  first = int(architecture.has_class_token)
  posemb, fresh = restored[_POSEMB], init[_POSEMB]
  kept = min(old, new)
  if posemb.ndim == 3 and architecture.posemb != 'patches':
    # A 1D table holds a row per register (posemb='tokens'; 'patches': none); a NaFlex model's
    # 2D table has none, so the new rows there are placeholders `adapt` drops.
    added = (
      fresh[:, first + kept : first + new]
      if np.ndim(fresh) == 3
      else np.zeros((1, new - kept, posemb.shape[-1]), np.float32)
    )
    rows = [posemb[:, : first + kept], added, posemb[:, first + old :]]
    posemb = np.concatenate([np.asarray(r, np.float32) for r in rows], axis=1)
  out = {k: v for k, v in restored.items() if k != _REGISTERS}
  out[_POSEMB] = posemb.astype(np.asarray(restored[_POSEMB]).dtype)
  if new:
    parts = [np.asarray(restored[_REGISTERS])[:, :kept]] if kept else []
    out[_REGISTERS] = np.concatenate(parts + [np.asarray(init[_REGISTERS])[:, kept:]], axis=1)
    report['re-initialised'].append(
      f'{_REGISTERS} {shape_of(init[_REGISTERS])}: {new - kept} new register token(s) and their '
      f"position rows, as a fresh model's ({kept} kept)"
    )
  if old > new:
    report['dropped'].append(
      f'{_REGISTERS} {shape_of(restored[_REGISTERS])}: {old - new} register token(s) and their '
      f'position rows ({new} kept)'
    )
  return out, report


def adapt(
  restored: dict,
  init: dict,
  architecture,
  posemb_resize: str = 'zoom',
  what='checkpoint',
  patch_resize: str = 'bilinear',
) -> tuple:
  """Pre-trained parameters made into those of a model to fine-tune (paper 3.2).

  The backbone is kept. The head is `init`'s (zeros: paper 3.2), `pre_logits` is dropped
  when the new model has none, as are the `mask_token` and `mpp_head` of masked patch
  prediction (`vit_jax.models.mpp`) and self-distillation's heads (`vit_jax.models.dino`), and
  those the new model has but the checkpoint lacks are `init`'s; position embeddings are resized when the resolution
  differs (`posemb_resize`, see POSEMB_RESIZE), the patch-embedding kernel when the patch
  size does (FlexiViT, over `patch_resize`: see PATCH_RESIZE); register tokens the checkpoint lacks are added as a fresh model's, and
  those the model lacks dropped (`match_registers`).

  Args:
    restored: the pre-trained flat parameters {'a/b': array} in this model's names
      (`canonical`), blocks unrolled.
    init: the new model's freshly initialised flat parameters, blocks unrolled.
    architecture: its `model_spec.Architecture`, for the tokens before the patches (classifier,
      registers, which of them have position embeddings).
    posemb_resize: 'zoom' (the official code's and big_vision's), 'bilinear', or an
      antialiased one (timm's: 'bicubic_antialias'); see POSEMB_RESIZE.
    what: the checkpoint's name in errors.
    patch_resize: the resize that a new patch size's PI-resize inverts (PATCH_RESIZE).

  Returns:
    (flat parameters shaped as `init`, {'kept', 'resized', 'dropped', 're-initialised':
    [what, one line each]}).
  """
  # The prefix rows of a 1D table: the model's own, or, for a NaFlex model started from a plain
  # ViT, those of the paper's layout (a row per prefix token; NaFlex takes no other).
  grid = architecture.posemb == 'grid'
  num_prefix = architecture.num_prefix_tokens if grid else architecture.posemb_prefix
  restored, registers = match_registers(restored, init, architecture)
  out = {}
  report = {'kept': [], 'resized': [], 'dropped': [], 're-initialised': []}
  for key, value in init.items():
    out[key], action, line = _adapted(
      key, value, restored, num_prefix, posemb_resize, what, patch_resize
    )
    report[action].append(line)
  for key in sorted(set(restored) - set(init)):
    if not key.startswith(('head/',) + _PRETRAINING_ONLY):
      raise CheckpointError(
        f'{what} has {key} {shape_of(restored[key])} that the '
        'model lacks; is it a checkpoint of another model?'
      )
    if key.startswith(_PRETRAINING_ONLY):
      report['dropped'].append(f'{key} {shape_of(restored[key])}')
  if registers['re-initialised']:  # partly new: said as such, not as kept
    report['kept'].remove(_REGISTERS)
  for action, lines in registers.items():
    report[action] += lines
  return out, report


def resize_posemb_grid(table: np.ndarray, rows: int, cols: int, method: str = 'zoom') -> np.ndarray:
  """A 2D table of position embeddings [1, h, w, D] (a NaFlex ViT's) resized to
  [1, rows, cols, D] by `method` (POSEMB_RESIZE), one axis after the other; float32."""
  if method not in POSEMB_RESIZE:
    raise CheckpointError(f'posemb_resize={method!r}: use one of {", ".join(POSEMB_RESIZE)}')
  grid = np.asarray(table, np.float64)[0]
  down = resize_matrix(grid.shape[0], rows, method)
  across = resize_matrix(grid.shape[1], cols, method)
  return np.einsum('ah,bw,hwd->abd', down, across, grid)[None].astype(np.float32)


def _between_layouts(posemb, init, num_prefix: int, method: str, what: str) -> tuple:
  """(the table of `init`'s layout from `posemb`, how): a plain ViT's 1D table [1, prefix +
  g*g, D] and a NaFlex ViT's 2D one [1, rows, cols, D] (no rows for prefix tokens), either way
  or between two 2D grids; the patches' grid is resized by `method`. A NaFlex table becomes
  a plain one with `init`'s (fresh) rows for the prefix tokens."""
  posemb = np.asarray(posemb)
  if posemb.ndim == 3:
    patches = posemb[0, num_prefix:]
    side = math.isqrt(len(patches))
    if side * side != len(patches):
      raise CheckpointError(
        f'{what}: its {posemb.shape[1]} position embeddings are no {num_prefix} prefix rows and '
        'a square grid of patches; fine-tune it as the model it is'
      )
    grid = patches.reshape(1, side, side, -1)
    rows = 'row' if num_prefix == 1 else 'rows'
    dropped = f', {num_prefix} prefix {rows} dropped' if num_prefix else ''
  else:
    grid, dropped = posemb, ''
  if np.ndim(init) == 4:
    resized = resize_posemb_grid(grid, init.shape[1], init.shape[2], method)
    return resized.astype(np.asarray(posemb).dtype), f'as a 2D grid, {method}{dropped}'
  side = math.isqrt(init.shape[1] - num_prefix)
  table = resize_posemb_grid(grid, side, side, method).reshape(1, side * side, -1)
  prefix = np.asarray(init[:, :num_prefix], np.float32)
  fresh = f', {num_prefix} fresh prefix row{"" if num_prefix == 1 else "s"}' if num_prefix else ''
  return np.concatenate([prefix, table], axis=1), f'from a 2D grid, {method}{fresh}'


def _adapted(key, value, restored, num_prefix, posemb_resize, what, patch_resize) -> tuple:
  """(the fine-tuning value of `init`'s `key`, what `adapt` did, its report line)."""
  if key.startswith('head/') or key not in restored and key.startswith(_PRETRAINING_ONLY):
    return value, 're-initialised', f'{key} {shape_of(value)}'
  if key not in restored:
    raise CheckpointError(
      f'{what} lacks {key} {shape_of(value)} that the model has; is it a checkpoint of another '
      'model?'
    )
  old, new = shape_of(restored[key]), shape_of(value)
  if key == _POSEMB and old != new and (len(old) == 4 or len(new) == 4):
    resized, how = _between_layouts(restored[key], value, num_prefix, posemb_resize, what)
    return resized, 'resized', f'{key} {old} -> {new} ({how})'
  if key == _POSEMB and old != new:
    resized = resize_posemb(restored[key], value.shape[1], num_prefix, posemb_resize)
    return resized, 'resized', f'{key} {old} -> {new} ({posemb_resize})'
  if key == _EMBEDDING and old != new == new[:2] + old[2:]:  # another patch size (FlexiViT)
    resized = resize_patch_embedding(restored[key], value.shape[:2], patch_resize)
    how = 'PI-resize' + ('' if patch_resize == 'bilinear' else f', {patch_resize}')
    return resized, 'resized', f'{key} {old} -> {new} ({how})'
  if old != new:
    raise CheckpointError(
      f'{what}: {key} has shape {old}, the model expects {new}; check the model name'
    )
  return restored[key], 'kept', key
