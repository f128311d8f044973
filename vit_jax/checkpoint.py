"""The public `.npz` checkpoints: load, save, and adapt for fine-tuning.

The files are plain `numpy.savez` archives whose keys are `/`-joined
parameter paths (`Transformer/encoderblock_0/MlpBlock_3/Dense_0/kernel`).
`load` accepts the original release, the newer Flax numbering and the
`params/` / `opt/target/` prefixes of big_vision-era files, and the Flax
`checkpoint_<step>` files of the official train.py, and returns the
parameter tree of `vit_jax.models.VisionTransformer` as numpy arrays.
"""

import functools
import io
import math
import os
import re
from typing import Any, Mapping, Optional
import zipfile

import jax
import numpy as np

from vit_jax import workdir
from vit_jax.core import files
from vit_jax.core.errors import UserError

Params = Mapping[str, Any]

_PREFIXES = ('opt/target/', 'params/')
# Newer Flax numbering inside an encoder block -> the original release's.
_NEW_BLOCK_NAMES = {
  'LayerNorm_1': 'LayerNorm_2',
  'MultiHeadDotProductAttention_0': 'MultiHeadDotProductAttention_1',
  'MlpBlock_0': 'MlpBlock_3',
}
_POSEMB = 'Transformer/posembed_input/pos_embedding'
_EMBEDDING = 'embedding/kernel'
_ZIP_MAGIC = b'PK\x03\x04'  # every .npz (numpy.savez) starts with it
# Layers only pre-training uses (paper 3.1 pre-logits; B.1.2 masked patch
# prediction); fine-tuning drops them when the new model has none.
_PRETRAINING_ONLY = ('pre_logits/', 'mask_token', 'mpp_head/')


class CheckpointError(UserError, ValueError):
  """A checkpoint that cannot be read or does not fit the model; one line."""


# What flax.training.checkpoints.save_checkpoint writes, as the official
# train.py does: a msgpack file (flax < 0.7) or an orbax directory.
_FLAX_CHECKPOINT = re.compile(r'checkpoint_(\d+)$')


def _is_flax_checkpoint(path: str) -> bool:
  return bool(_FLAX_CHECKPOINT.match(os.path.basename(path.rstrip('/'))))


def resolve(path: str) -> str:
  """A `.npz` path, a directory holding `params.npz` (a training workdir), or a
  Flax `checkpoint_<step>` of the official train.py (its workdir: the latest)."""
  path = os.fspath(path)
  if files.isdir(path) and not _is_flax_checkpoint(path):
    candidate = workdir.params_path(path.rstrip('/'))
    if files.exists(candidate):
      return candidate
    steps = [
      (int(match.group(1)), name)
      for name in files.listdir(path)
      for match in [_FLAX_CHECKPOINT.match(name)]
      if match
    ]
    if not steps:
      raise CheckpointError(
        f'{path}: a directory without {workdir.PARAMS_FILE} or checkpoint_<step>; pass the .npz '
        'file itself'
      )
    return path.rstrip('/') + '/' + max(steps)[1]
  if not files.exists(path):
    raise CheckpointError(
      f'{path}: no such checkpoint; check the path (released files: '
      'gs://vit_models/imagenet21k/ViT-B_16.npz and friends)'
    )
  return path


def _find_params(tree, depth: int = 3):
  """The shallowest mapping holding `Transformer`: the parameters inside a saved train state.

  The official train.py saves (params, opt_state, step); its flax.optim-era
  versions saved (optimizer, step), parameters under `target`. Optimizer
  moments mirror the parameters deeper down, so the shallowest match wins.
  """
  level = [tree]
  for _ in range(depth + 1):
    below = []
    for node in level:
      if isinstance(node, Mapping):
        if 'Transformer' in node:
          return node
        below.extend(node.values())
      elif isinstance(node, (list, tuple)):
        below.extend(node)
    level = below
  return None


def _load_flax_checkpoint(path: str) -> dict:
  try:
    if files.isdir(path):
      import orbax.checkpoint as ocp

      tree = ocp.PyTreeCheckpointer().restore(files.absolute(path))
    else:
      from flax import serialization

      with files.open_file(path, 'rb') as f:
        tree = serialization.msgpack_restore(f.read())
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise CheckpointError(
      f'{path}: not a readable Flax checkpoint ({type(e).__name__}: {e}); '
      'it may be truncated or still being written'
    ) from None
  params = _find_params(tree)
  if params is None:
    raise CheckpointError(
      f'{path}: a Flax checkpoint without ViT parameters (no Transformer/ inside); '
      'is it from the official vit_jax train.py?'
    )
  return {key: np.asarray(value) for key, value in flatten(params).items()}


# ---------------------------------------------------------------------------
# Trees.


def flatten(tree: Params, prefix: str = '') -> dict:
  """Nested mapping -> {'a/b/c': leaf}."""
  flat = {}
  for key, value in tree.items():
    path = f'{prefix}{key}'
    if isinstance(value, Mapping):
      flat.update(flatten(value, path + '/'))
    else:
      flat[path] = value
  return flat


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


def unflatten(flat: Mapping[str, Any]) -> dict:
  """{'a/b/c': leaf} -> nested dicts."""
  tree = {}
  for path, value in flat.items():
    *parents, leaf = path.split('/')
    node = tree
    for p in parents:
      node = node.setdefault(p, {})
    node[leaf] = value
  return tree


def recover_tree(keys, values) -> dict:
  """The official `checkpoint.recover_tree`: '/'-joined keys and values -> nested dicts."""
  return unflatten(dict(zip(keys, values)))


def _canonical(flat: dict) -> dict:
  """Maps the key variants of released files onto this model's names."""
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


def _shape(x) -> tuple:
  return tuple(np.shape(x))


def check_tree(params: Params, expected: Params, what: str = 'checkpoint') -> None:
  """Raises CheckpointError naming the first key whose presence or shape differs.

  `expected` may hold arrays or `jax.ShapeDtypeStruct`s (from `jax.eval_shape`).
  """
  got, want = flatten(params), flatten(expected)
  for key in sorted(set(got) | set(want)):
    if key not in got:
      raise CheckpointError(
        f'{what} lacks {key} {_shape(want[key])} that the model has; '
        'is it a checkpoint of another model?'
      )
    if key not in want:
      raise CheckpointError(
        f'{what} has {key} {_shape(got[key])} that the model lacks; '
        'is it a checkpoint of another model?'
      )
    if _shape(got[key]) != _shape(want[key]):
      raise CheckpointError(
        f'{what}: {key} has shape {_shape(got[key])}, the model expects '
        f'{_shape(want[key])}; check --model (or use load_pretrained to '
        'change resolution or classes)'
      )


# ---------------------------------------------------------------------------
# Load and save.


def load_flat(path: str) -> dict:
  """Reads a `.npz` (or Flax checkpoint) into {'key': np.ndarray} as stored (no renaming)."""
  path = resolve(path)
  if _is_flax_checkpoint(path):
    return _load_flax_checkpoint(path)
  try:
    if files.is_remote(path):
      with files.open_file(path, 'rb') as f:
        data = io.BytesIO(f.read())
      head = data.getvalue()[:4]
    else:
      data = path
      with open(path, 'rb') as f:
        head = f.read(4)
    if head != _ZIP_MAGIC:
      # np.load would read other files as pickles and suggest allow_pickle=True.
      raise CheckpointError(
        f'{path}: not an .npz checkpoint (an .npz is a zip archive; this file starts with '
        f'{head!r}); pass a file written by numpy.savez, such as a released ViT .npz or a '
        "workdir's params.npz"
      )
    with np.load(data, allow_pickle=False) as npz:
      return {key: _array(npz, key, path) for key in npz.files}
  except CheckpointError:
    raise
  except (zipfile.BadZipFile, EOFError, OSError, ValueError, KeyError) as e:
    raise CheckpointError(
      f'{path}: not a readable .npz checkpoint ({type(e).__name__}: {e}); '
      'the file may be truncated, download it again'
    ) from None


def _array(npz, key: str, path: str) -> np.ndarray:
  """`npz[key]`; an array of Python objects (a pickle: loading it could run any code) is
  refused as such, not as a damaged file."""
  try:
    return npz[key]
  except ValueError as e:
    if 'allow_pickle' not in str(e):
      raise
    raise CheckpointError(
      f'{path}: {key!r} is an array of Python objects (a pickle), not numbers; it is not '
      'loaded, since unpickling can run any code. Pass a checkpoint of numeric arrays '
      '(numpy.savez of the parameters)'
    ) from None


def load(path: str, like: Optional[Params] = None) -> dict:
  """Reads a public `.npz` (or a workdir's `params.npz`) into a parameter tree.

  Args:
    path: local path or `gs://...`; a directory means its `params.npz`; a
      Flax `checkpoint_<step>` (file or directory) of the official train.py,
      or its workdir (the latest), gives the parameters inside.
    like: optional parameter tree (arrays or `jax.eval_shape` structs) the
      result must match key for key and shape for shape.

  Returns:
    Nested dicts of numpy arrays, in this package's (original release) naming.
  """
  params = unflatten(_canonical(load_flat(path)))
  if like is not None:
    check_tree(params, unstack_blocks(like), what=os.fspath(path))
    if is_stacked(like):  # a model with scan_layers=True
      params = stack_blocks(params)
  return params


def save_npz(params: Params, path: str) -> str:
  """Writes `params` in the public layout; returns `path`.

  Local files are written to a temporary name and renamed, so a killed process
  never leaves a truncated file under `path`. Arrays are stored as their numpy
  dtype; bfloat16 leaves are widened to float32 (numpy cannot read bfloat16
  from `.npz` without pickling).
  """
  path = os.fspath(path)
  flat = {}
  for key, value in flatten(unstack_blocks(params)).items():
    array = np.asarray(value)
    flat[key] = array.astype(np.float32) if array.dtype.name == 'bfloat16' else array
  if files.is_remote(path):
    buffer = io.BytesIO()
    np.savez(buffer, **flat)
    with files.open_file(path, 'wb') as f:
      f.write(buffer.getvalue())
    return path
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tmp = f'{path}.tmp-{os.getpid()}'
  with open(tmp, 'wb') as f:
    np.savez(f, **flat)
  os.replace(tmp, path)
  return path


# ---------------------------------------------------------------------------
# Fine-tuning.


# How position embeddings are resized for a new resolution (paper 3.2):
# 'zoom' is the official `interpolate_posembed`, `scipy.ndimage.zoom(order=1)`
# on the grid: linear, the corner embeddings stay on the corners. 'bilinear'
# samples at half-pixel centres, as torch's `interpolate(mode='bilinear',
# align_corners=False)`; kept for runs that started from it.
POSEMB_RESIZE = ('zoom', 'bilinear')


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
def pi_resize_matrix(old: int, new: int) -> np.ndarray:
  """[new, old] float64: FlexiViT's PI-resize of one axis of a patch-embedding kernel.

  With B the bilinear resize of a patch (`bilinear_matrix`), the new kernel is
  pinv(B^T) @ kernel: tokens of a resized patch equal the old tokens whenever
  B has full column rank (upsampling), a least-squares fit when shrinking.
  Bilinear resizing is separable, so the 2D matrix is the Kronecker product of
  the two axes' and its pseudo-inverse the product of theirs.
  """
  return np.linalg.pinv(bilinear_matrix(old, new).T)


def resize_patch_embedding(kernel: np.ndarray, patch_size) -> np.ndarray:
  """PI-resize (FlexiViT, Beyer et al. 2023) of an `embedding/kernel` [ph, pw, C, D] to
  [patch_size[0], patch_size[1], C, D], in float64; big_vision's `flexi` and timm's
  `resample_patch_embed(..., interpolation='bilinear', antialias=False)` compute the same."""
  rows = pi_resize_matrix(kernel.shape[0], int(patch_size[0]))
  cols = pi_resize_matrix(kernel.shape[1], int(patch_size[1]))
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
    method: 'zoom' (the official code's) or 'bilinear'.

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
  else:
    import jax

    # No antialias: shrinking samples the grid rather than blurring it.
    grid = jax.image.resize(
      grid.astype(np.float32), (g_new, g_new, grid.shape[-1]), 'bilinear', antialias=False
    )
  grid = np.asarray(grid, np.float32).reshape(1, new, -1)
  return np.concatenate([prefix.astype(np.float32), grid], axis=1)


def interpolate_posembed(posemb, num_tokens: int, has_class_token: bool) -> np.ndarray:
  """The official `checkpoint.interpolate_posembed`: `resize_posemb` with 'zoom'."""
  return resize_posemb(np.asarray(posemb), num_tokens, int(has_class_token), 'zoom')


def load_pretrained(
  *,
  pretrained_path: str,
  init_params: Params,
  model_config: Mapping,
  verbose: bool = True,
  posemb_resize: str = 'zoom',
) -> dict:
  """Loads a pre-trained checkpoint for fine-tuning a model (paper 3.2).

  The backbone is kept. The head is replaced by `init_params`' head (zeros:
  paper 3.2), `pre_logits` is dropped when the new model has none, as are
  the `mask_token` and `mpp_head` of masked patch prediction (`vit_jax.models.mpp`),
  and position embeddings are resized when the resolution differs.

  Args:
    pretrained_path: a released `.npz`, or a workdir holding `params.npz`.
    init_params: freshly initialised parameters of the model to fine-tune.
    model_config: its config (a `MODEL_CONFIGS` entry), for the classifier.
    verbose: print a table of what was kept, resized, dropped or re-initialised.
    posemb_resize: how position embeddings change resolution (POSEMB_RESIZE);
      'zoom' is the official code's (and big_vision's), whose fine-tuning
      recipe this package follows.

  Returns:
    A parameter tree with the structure and shapes of `init_params`.
  """
  restored = flatten(load(pretrained_path))
  stacked = is_stacked(init_params)  # a model with scan_layers=True
  init = flatten(unstack_blocks(init_params))
  num_prefix = 1 if model_config.get('classifier', 'token') in ('token', 'token_unpooled') else 0
  num_prefix += model_config.get('num_registers', 0)
  out, report = _adapt(restored, init, num_prefix, posemb_resize, pretrained_path)
  if verbose:
    num_kept = sum(int(np.size(out[k])) for k in report['kept'])
    rows = [('kept', f'{len(report["kept"])} arrays, {num_kept:,} parameters')]
    rows += [('resized', r) for r in report['resized']]
    rows += [('dropped', d) for d in sorted(report['dropped'])]
    rows += [('re-initialised', r) for r in sorted(report['re-initialised'])]
    print(f'load_pretrained {pretrained_path}:')
    for action, what in rows:
      print(f'  {action:<15} {what}')
  return stack_blocks(unflatten(out)) if stacked else unflatten(out)


def _adapt(restored: dict, init: dict, num_prefix: int, posemb_resize: str, what) -> tuple:
  """(flat parameters shaped as `init`, what was kept, resized, dropped, re-initialised)."""
  out = {}
  report = {'kept': [], 'resized': [], 'dropped': [], 're-initialised': []}
  for key, value in init.items():
    if key.startswith('head/') or key not in restored and key.startswith('pre_logits/'):
      out[key] = value
      report['re-initialised'].append(f'{key} {_shape(value)}')
    elif key not in restored:
      raise CheckpointError(
        f'{what} lacks {key} {_shape(value)} that the model '
        'has; is it a checkpoint of another model?'
      )
    elif key == _POSEMB and _shape(restored[key]) != _shape(value):
      out[key] = resize_posemb(restored[key], value.shape[1], num_prefix, posemb_resize)
      report['resized'].append(
        f'{key} {_shape(restored[key])} -> {_shape(value)} ({posemb_resize})'
      )
    elif key == _EMBEDDING and _shape(restored[key]) != _shape(value) == (
      _shape(value)[:2] + _shape(restored[key])[2:]
    ):  # another patch size (FlexiViT)
      out[key] = resize_patch_embedding(restored[key], value.shape[:2])
      report['resized'].append(f'{key} {_shape(restored[key])} -> {_shape(value)} (PI-resize)')
    elif _shape(restored[key]) != _shape(value):
      raise CheckpointError(
        f'{what}: {key} has shape {_shape(restored[key])}, the '
        f'model expects {_shape(value)}; check the model name'
      )
    else:
      out[key] = restored[key]
      report['kept'].append(key)
  for key in sorted(set(restored) - set(init)):
    if not key.startswith(('head/',) + _PRETRAINING_ONLY):
      raise CheckpointError(
        f'{what} has {key} {_shape(restored[key])} that the '
        'model lacks; is it a checkpoint of another model?'
      )
    if key.startswith(_PRETRAINING_ONLY):
      report['dropped'].append(f'{key} {_shape(restored[key])}')
  return out, report
