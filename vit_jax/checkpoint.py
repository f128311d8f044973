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
from vit_jax.configs import families
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
      # A transformers (or Hub) model folder: its weights under the names transformers gives.
      weights = ('model.safetensors', 'pytorch_model.bin')
      if any(files.exists(os.path.join(path, name)) for name in weights):
        raise CheckpointError(_convert_first(path, 'a transformers model folder'))
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
    torch_kind = _torch_file_kind(data, head)
    if torch_kind:
      raise CheckpointError(_convert_first(path, torch_kind))
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


# Where the released .npz files are (gs://vit_models/imagenet21k/ViT-B_16.npz, augreg/...).
_RELEASED = re.compile(r'gs://vit_models/[^/]+/([^/]+)\.npz')


def released_file(path: str) -> None:
  """CheckpointError for a path in the released bucket named after a model whose weights are
  timm's, never released there (a family of `configs.families`, as configs/finetune.py names
  its default): before any network access, saying how to convert timm's file."""
  match = _RELEASED.fullmatch(os.fspath(path))
  family = families.family_of(match.group(1)) if match else None
  if family is None:
    return
  name = match.group(1)
  raise CheckpointError(
    f"{path}: no such released file; gs://vit_models holds the paper's and AugReg's ViTs, not "
    f"{name} ({family}): convert timm's weights of it first (python -m vit_jax.export "
    f'--checkpoint=FILE.safetensors --format=npz --output={name}.npz) and pass that .npz'
  )


def refuse_torch_file(path: str) -> None:
  """CheckpointError, saying how to convert it, when the local file `path` (resolved) is a
  timm or transformers checkpoint: before a command asks for --model or reads it as an .npz."""
  path = resolve(path)
  if files.is_remote(path) or os.path.isdir(path):
    return
  try:
    with open(path, 'rb') as f:
      head = f.read(4)
  except OSError:
    return
  kind = _torch_file_kind(path, head)
  if kind:
    raise CheckpointError(_convert_first(path, kind))


def _torch_file_kind(data, head: bytes) -> str:
  """What a PyTorch checkpoint (timm's, transformers') is, by its first bytes and, for a
  zip archive, its members: 'a safetensors file', 'a PyTorch file' (torch.save), or ''."""
  if head != _ZIP_MAGIC:
    try:
      if hasattr(data, 'getvalue'):
        start = data.getvalue()[:9]
      else:
        with open(data, 'rb') as f:
          start = f.read(9)
    except OSError:
      return ''
    # safetensors: an 8-byte little-endian header length, then the JSON header.
    if len(start) == 9 and start[8:9] == b'{' and int.from_bytes(start[:8], 'little') < 1 << 32:
      return 'a safetensors file'
    if start[:1] == b'\x80':  # a pickle: torch.save's legacy format
      return 'a PyTorch file (torch.save)'
    return ''
  try:
    with zipfile.ZipFile(data) as archive:
      names = archive.namelist()
  except (zipfile.BadZipFile, OSError):
    return ''
  finally:
    if hasattr(data, 'seek'):
      data.seek(0)  # np.load reads the buffer from where it is
  if any(name.endswith('data.pkl') for name in names):  # torch.save's zip format
    return 'a PyTorch file (torch.save)'
  return ''


def _convert_first(path: str, kind: str) -> str:
  """The line for a timm or transformers checkpoint where an .npz is read."""
  stem = os.path.splitext(os.path.basename(path.rstrip('/')))[0] or 'converted'
  return (
    f'{path}: {kind}, not an .npz; convert it first: python -m vit_jax.export '
    f'--checkpoint={path} --format=npz --output={stem}.npz (it says which model it recognised, '
    'or pass --model), then pass that .npz'
  )


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


def save_npz(params: Params, path: str, metadata: Optional[Mapping] = None) -> str:
  """Writes `params` in the public layout; returns `path`.

  Local files are written to a temporary name and renamed, so a killed process
  never leaves a truncated file under `path` (a failed write removes its temporary file, the
  next write one that a killed process left). Arrays are stored as their numpy
  dtype; bfloat16 leaves are widened to float32 (numpy cannot read bfloat16
  from `.npz` without pickling). `metadata` (the model's name, the run's class names and
  dataset: `read_metadata`) goes in the archive's comment, where no reader of the public
  layout looks: the file holds the same arrays as one without it.
  """
  path = os.fspath(path)
  flat = {}
  for key, value in flatten(vit_checkpoint.unstack_blocks(params)).items():
    array = np.asarray(value)
    flat[key] = array.astype(np.float32) if array.dtype.name == 'bfloat16' else array
  comment = _comment(metadata) if metadata else b''
  if files.is_remote(path):
    buffer = io.BytesIO()
    np.savez(buffer, **flat)
    _set_comment(buffer, comment)
    with files.open_file(path, 'wb') as f:
      f.write(buffer.getvalue())
    return path
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with files.temporary_beside(path) as tmp:  # removed if the write fails (a full disk)
    with open(tmp, 'w+b') as f:
      np.savez(f, **flat)
    _set_comment(tmp, comment)
    os.replace(tmp, path)
  return path


# The zip format's limit on an archive comment.
_COMMENT_BYTES = 65535
_METADATA_KEY = 'vit_jax'
_COMPRESSED = b'zlib:'


def _comment(metadata: Mapping) -> bytes:
  """`metadata` as an archive comment: ASCII JSON (no byte a zip reader could take for the end
  of the archive), compressed when long; class names left out when even that is too long
  (a head of some 10^5 classes), which `read_metadata` then lacks."""
  import base64
  import zlib

  metadata = {k: v for k, v in metadata.items() if v is not None}
  for attempt in (metadata, {k: v for k, v in metadata.items() if k != 'class_names'}):
    text = json.dumps({_METADATA_KEY: attempt}, ensure_ascii=True, separators=(',', ':'))
    data = text.encode('ascii')
    if len(data) > _COMMENT_BYTES:
      data = _COMPRESSED + base64.b64encode(zlib.compress(data, 9))
    if len(data) <= _COMMENT_BYTES:
      return data
  return b''


def _set_comment(file, comment: bytes) -> None:
  if comment:
    with zipfile.ZipFile(file, 'a') as archive:
      archive.comment = comment


def read_metadata(path) -> dict:
  """What `save_npz` recorded with a local `.npz` (a workdir: its params.npz): {'model': a
  MODEL_CONFIGS name, 'class_names': [...], 'dataset': ...}, each where known; {} for a file
  without it (a released checkpoint), a remote or unreadable one."""
  import base64
  import zlib

  path = os.fspath(path)
  if files.is_remote(path):
    return {}
  if os.path.isdir(path):
    path = workdir.params_path(path.rstrip('/'))
  try:
    with zipfile.ZipFile(path) as archive:
      data = archive.comment
    if data.startswith(_COMPRESSED):
      data = zlib.decompress(base64.b64decode(data[len(_COMPRESSED) :]))
    found = json.loads(data.decode('ascii')).get(_METADATA_KEY) if data else None
  except (OSError, zipfile.BadZipFile, ValueError, zlib.error, AttributeError):
    return {}
  return found if isinstance(found, dict) else {}


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
