"""The public `.npz` checkpoints as files: load, save, and load for fine-tuning.

The files are plain `numpy.savez` archives whose keys are `/`-joined
parameter paths (`Transformer/encoderblock_0/MlpBlock_3/Dense_0/kernel`).
`load` accepts the original release, the newer Flax numbering and the
`params/` / `opt/target/` prefixes of big_vision-era files, and the Flax
`checkpoint_<step>` files of the official train.py, and returns the
parameter tree of `vit_jax.models.VisionTransformer` as numpy arrays.
What is done to that tree (its names, the scanned layout, fine-tuning's
resizing and head) is the model's: `vit_jax.models.vit_checkpoint`.
"""

import io
import json
import os
import re
from typing import Any, Mapping, Optional
import zipfile

import numpy as np

from vit_jax import workdir
from vit_jax.configs import model_spec
from vit_jax.core import files
from vit_jax.models import vit_checkpoint
from vit_jax.models.vit_checkpoint import CheckpointError

# The official API's `checkpoint.interpolate_posembed`, kept under its old address.
from vit_jax.models.vit_checkpoint import interpolate_posembed  # noqa: F401

Params = Mapping[str, Any]

_ZIP_MAGIC = b'PK\x03\x04'  # every .npz (numpy.savez) starts with it


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


def check_tree(params: Params, expected: Params, what: str = 'checkpoint') -> None:
  """Raises CheckpointError naming the first key whose presence or shape differs.

  `expected` may hold arrays or `jax.ShapeDtypeStruct`s (from `jax.eval_shape`).
  """
  got, want = flatten(params), flatten(expected)
  for key in sorted(set(got) | set(want)):
    if key not in got:
      raise CheckpointError(
        f'{what} lacks {key} {vit_checkpoint.shape_of(want[key])} that the model has; '
        'is it a checkpoint of another model?'
      )
    if key not in want:
      raise CheckpointError(
        f'{what} has {key} {vit_checkpoint.shape_of(got[key])} that the model lacks; '
        'is it a checkpoint of another model?'
      )
    if vit_checkpoint.shape_of(got[key]) != vit_checkpoint.shape_of(want[key]):
      raise CheckpointError(
        f'{what}: {key} has shape {vit_checkpoint.shape_of(got[key])}, the model expects '
        f'{vit_checkpoint.shape_of(want[key])}; check --model (or use load_pretrained to '
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
  params = unflatten(vit_checkpoint.canonical(load_flat(path)))
  if like is not None:
    check_tree(params, vit_checkpoint.unstack_blocks(like), what=os.fspath(path))
    if vit_checkpoint.is_stacked(like):  # a model with scan_layers=True
      params = vit_checkpoint.stack_blocks(params)
  return params


def save_npz(params: Params, path: str, metadata: Optional[dict] = None) -> str:
  """Writes `params` in the public layout; returns `path`.

  Local files are written to a temporary name and renamed, so a killed process
  never leaves a truncated file under `path` (a failed write removes its temporary file, the
  next write one that a killed process left). Arrays are stored as their numpy
  dtype; bfloat16 leaves are widened to float32 (numpy cannot read bfloat16
  from `.npz` without pickling). `metadata` (JSON data: the model's name, the weights'
  preprocessing) is the archive's comment, which `numpy.load` and every reader of the
  arrays pass over (`npz_metadata` reads it).
  """
  path = os.fspath(path)
  flat = {}
  for key, value in flatten(vit_checkpoint.unstack_blocks(params)).items():
    array = np.asarray(value)
    flat[key] = array.astype(np.float32) if array.dtype.name == 'bfloat16' else array
  if files.is_remote(path):
    buffer = io.BytesIO()
    np.savez(buffer, **flat)
    _comment(buffer, metadata)
    with files.open_file(path, 'wb') as f:
      f.write(buffer.getvalue())
    return path
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with files.temporary_beside(path) as tmp:  # removed if the write fails (a full disk)
    with open(tmp, 'w+b') as f:
      np.savez(f, **flat)
      _comment(f, metadata)
    os.replace(tmp, path)
  return path


_METADATA = b'vit_jax metadata '  # the comment's start: a comment of another tool is not ours


def _comment(f, metadata: Optional[dict]) -> None:
  if metadata:
    f.seek(0)
    with zipfile.ZipFile(f, 'a') as archive:
      archive.comment = _METADATA + json.dumps(metadata, sort_keys=True).encode()


def npz_metadata(path: str) -> dict:
  """What `save_npz` recorded with a `.npz` (a workdir: its params.npz), {} for none (a file of
  another tool, a Flax checkpoint, an unreadable file: `load` names those)."""
  try:
    path = resolve(path)
    if _is_flax_checkpoint(path):
      return {}
    with files.open_file(path, 'rb') as f:
      with zipfile.ZipFile(f) as archive:
        comment = archive.comment
  except (CheckpointError, OSError, zipfile.BadZipFile, ValueError):
    return {}
  if not comment.startswith(_METADATA):
    return {}
  try:
    data = json.loads(comment[len(_METADATA) :].decode())
  except (UnicodeDecodeError, ValueError):
    return {}
  return data if isinstance(data, dict) else {}


# ---------------------------------------------------------------------------
# Fine-tuning.


def load_pretrained(
  *,
  pretrained_path: str,
  init_params: Params,
  model_config: Mapping,
  verbose: bool = True,
  posemb_resize: str = 'zoom',
  patch_resize: str = 'bilinear',
) -> dict:
  """Loads a pre-trained checkpoint for fine-tuning a model (paper 3.2): `load`, then
  `vit_checkpoint.adapt` (the backbone kept, the head `init_params`' own, pre-training's
  layers dropped, position embeddings resized to the new resolution).

  Args:
    pretrained_path: a released `.npz`, or a workdir holding `params.npz`.
    init_params: freshly initialised parameters of the model to fine-tune.
    model_config: its architecture (a `model_spec.Architecture`, or a `MODEL_CONFIGS` entry
      as the official code passes), for the tokens before the patches.
    verbose: print a table of what was kept, resized, dropped or re-initialised.
    posemb_resize: how position embeddings change resolution
      (`vit_checkpoint.POSEMB_RESIZE`);
      'zoom' is the official code's (and big_vision's), whose fine-tuning
      recipe this package follows; timm resizes with 'bicubic_antialias'.
    patch_resize: the resize that a new patch size's PI-resize of the patch embedding
      inverts (`vit_checkpoint.PATCH_RESIZE`; FlexiViT's 'bilinear', timm's
      'bicubic_antialias').

  Returns:
    A parameter tree with the structure and shapes of `init_params`.
  """
  restored = flatten(load(pretrained_path))
  stacked = vit_checkpoint.is_stacked(init_params)  # a model with scan_layers=True
  init = flatten(vit_checkpoint.unstack_blocks(init_params))
  if not isinstance(model_config, model_spec.Architecture):
    model_config = model_spec.Architecture.of(model_config)
  out, report = vit_checkpoint.adapt(
    restored, init, model_config, posemb_resize, pretrained_path, patch_resize
  )
  if verbose:
    num_kept = sum(int(np.size(out[k])) for k in report['kept'])
    rows = [('kept', f'{len(report["kept"])} arrays, {num_kept:,} parameters')]
    rows += [('resized', r) for r in report['resized']]
    rows += [('dropped', d) for d in sorted(report['dropped'])]
    rows += [('re-initialised', r) for r in sorted(report['re-initialised'])]
    print(f'load_pretrained {pretrained_path}:')
    for action, what in rows:
      print(f'  {action:<15} {what}')
  return vit_checkpoint.stack_blocks(unflatten(out)) if stacked else unflatten(out)
