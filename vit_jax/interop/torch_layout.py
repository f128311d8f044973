"""What the PyTorch formats share: tensor layouts, name tables, safetensors files.

Our parameters (public `.npz` names, Flax layouts) and a PyTorch state_dict
hold the same numbers in different layouts:

| ours | PyTorch |
|---|---|
| conv kernel [kh, kw, in, out] | weight [out, in, kh, kw] |
| Dense kernel [in, out] | weight [out, in] |
| query/key/value kernel [D, heads, head_dim] | weight [heads * head_dim, D] |
| attention out kernel [heads, head_dim, D] | weight [D, heads * head_dim] |
| query/key/value bias [heads, head_dim] | bias [heads * head_dim] |

Every conversion is a transpose or a reshape, so a round trip is bitwise.
A format module (`interop_timm`, `interop_hf`) supplies only a name function:
our key -> (its key, (chunk, chunks) of a fused q/k/v or k/v, or None).
"""

import dataclasses
import importlib
import math
import os
import re
from typing import Callable, Dict, Mapping, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from vit_jax import checkpoint
from vit_jax import models
from vit_jax.configs.model_spec import ModelSpec
from vit_jax.core.errors import UserError
from vit_jax.models import vit_checkpoint

NameFn = Callable[[str], Tuple[Optional[str], Optional[Tuple[int, int]]]]


class ExportError(UserError, ValueError):
  """A model that a format cannot hold, or a missing optional package; one line."""


# How to install what PyPI serves badly to CPU-only machines (README: Set-up):
# its Linux torch is a multi-GB CUDA build, and its torchvision, which timm
# imports, pins such a torch.
_INSTALL = {
  'torch': 'pip install torch --index-url https://download.pytorch.org/whl/cpu '
  '(CPU build; plain `pip install torch` is the multi-GB CUDA build on Linux)',
  'timm': 'pip install --no-deps torchvision==0.15.2 timm (README: Set-up)',
}


def require(module: str, pip_name: Optional[str] = None):
  """Imports an optional dependency, or says how to install it."""
  try:
    return importlib.import_module(module)
  except ImportError:
    name = pip_name or module
    how = _INSTALL.get(name, f'pip install {name}, or pip install -e ".[export]"')
    raise ExportError(f'this needs {name}: {how}') from None


def rename(key: str, rules) -> Optional[str]:
  """Applies the first matching (pattern, replacement) rule; None when none matches.

  The leaf follows PyTorch: `kernel` and `scale` become `weight`.
  """
  for pattern, replacement in rules:
    if re.match(pattern, key):
      name = re.sub(pattern, replacement, key)
      return re.sub(r'\.(kernel|scale)$', '.weight', name)
  return None


# Architecture fields beyond the paper's ViT that a format may or may not write (the block's
# are every `Block` field but its sizes and dropout).
_OPTIONS = ('posemb', 'rotary', 'pre_norm', 'final_norm', 'input_stats')
_SIZES = ('mlp_dim', 'num_heads', 'dropout_rate', 'attention_dropout_rate')
_ABSENT = object()


def beyond_paper(arch) -> dict:
  """{option: value} of what `arch` computes otherwise than the paper's ViT: its block's
  options and its architecture's (`_OPTIONS`) that differ from their defaults."""
  block = {
    f.name: getattr(arch.block, f.name)
    for f in dataclasses.fields(arch.block)
    if f.name not in _SIZES and getattr(arch.block, f.name) != f.default
  }
  return block | {
    f.name: getattr(arch, f.name)
    for f in dataclasses.fields(arch)
    if f.name in _OPTIONS and getattr(arch, f.name) != f.default
  }


def check_writes(arch, fmt: str, writes: Tuple[str, ...] = (), reference=None) -> None:
  """ExportError unless the format writes every choice of `arch` beyond the paper's
  (`beyond_paper`): those named in `writes`, and those `reference` (the architecture that the
  format's own name for the model builds) has too."""
  known = beyond_paper(reference) if reference is not None else {}
  flags = [
    option if value is True else f'{option}={value!r}'
    for option, value in beyond_paper(arch).items()
    if option not in writes and known.get(option, _ABSENT) != value
  ]
  if flags:
    raise ExportError(
      f"{arch.name}: the {fmt} export writes the paper's ViT, not {', '.join(flags)}; use "
      '--format=npz or --format=savedmodel'
      + (', or --format=timm' if fmt != 'timm' and reference is None else '')
    )


# ---------------------------------------------------------------------------
# Layouts.


def _kind(key: str, ndim: int) -> str:
  if key.endswith('/kernel'):
    if ndim == 4:
      return 'conv'
    if ndim == 3:
      return 'attn_out' if key.endswith('/out/kernel') else 'attn_in'
    return 'dense'
  return 'plain'


def to_torch_layout(key: str, x: np.ndarray) -> np.ndarray:
  """One of our arrays in PyTorch's layout."""
  x = np.asarray(x)
  kind = _kind(key, x.ndim)
  if kind == 'conv':
    return x.transpose(3, 2, 0, 1)
  if kind == 'attn_in':
    return x.reshape(x.shape[0], -1).T
  if kind == 'attn_out':
    return x.reshape(-1, x.shape[-1]).T
  if kind == 'dense':
    return x.T
  # q/k/v biases [heads, head_dim] flatten; other vectors, `cls` and the
  # position embeddings have the same shape in both.
  return x.reshape(-1) if key.endswith(('/bias', '/scale')) else x


def from_torch_layout(key: str, x: np.ndarray, shape: tuple) -> Optional[np.ndarray]:
  """Inverse of `to_torch_layout` onto our `shape`; None when the shapes do not fit."""
  kind = _kind(key, len(shape))
  fits = x.size == math.prod(shape)
  if kind == 'conv':
    fits = fits and x.ndim == 4 and x.transpose(2, 3, 1, 0).shape == shape
    x = x.transpose(2, 3, 1, 0) if fits else x
  elif kind == 'dense':
    fits = fits and x.ndim == 2 and x.T.shape == shape
    x = x.T
  elif kind == 'attn_in':
    fits = fits and x.ndim == 2 and x.shape[1] == shape[0]
    x = x.T
  elif kind == 'attn_out':
    fits = fits and x.ndim == 2 and x.shape[0] == shape[-1]
    x = x.T
  return x.reshape(shape) if fits else None


def to_torch_state(flat: Mapping[str, np.ndarray], name_fn: NameFn) -> Dict[str, np.ndarray]:
  """Our flat parameters -> a state_dict of contiguous float32 numpy arrays."""
  out, chunks = {}, {}
  for key, value in flat.items():
    name, chunk = name_fn(key)
    if name is None:
      raise ExportError(f'{key} has no counterpart in this format')
    x = to_torch_layout(key, value)
    if chunk is None:
      out[name] = x
    else:
      index, count = chunk
      chunks.setdefault(name, [None] * count)[index] = x
  for name, parts in chunks.items():
    out[name] = np.concatenate(parts, axis=0)
  return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()}


def from_torch_state(
  state: Mapping[str, np.ndarray], expected: Mapping[str, tuple], name_fn: NameFn, what: str
) -> Dict[str, np.ndarray]:
  """A state_dict -> our flat parameters of the `expected` {key: shape}.

  Raises CheckpointError naming the first tensor that is missing, left over,
  or of the wrong size.
  """
  out, used = {}, set()
  for key, shape in expected.items():
    name, chunk = name_fn(key)
    if name not in state:
      raise checkpoint.CheckpointError(
        f'{what} lacks {name}, which {key} {tuple(shape)} needs; check --model'
      )
    x = np.asarray(state[name])
    used.add(name)
    if chunk is not None:
      index, count = chunk
      if x.shape[0] % count:
        raise checkpoint.CheckpointError(
          f'{what}: {name} {x.shape} is not {count} stacked projections (q/k/v or k/v)'
        )
      x = np.split(x, count, axis=0)[index]
    converted = from_torch_layout(key, x, tuple(shape))
    if converted is None:
      raise checkpoint.CheckpointError(
        f'{what}: {name} has shape {tuple(np.shape(state[name]))}, {key} needs {tuple(shape)}; '
        'check --model'
      )
    out[key] = np.ascontiguousarray(converted)
  extra = sorted(set(state) - used)
  if extra:
    raise checkpoint.CheckpointError(
      f'{what} has {extra[0]} {tuple(np.shape(state[extra[0]]))} that the model lacks; '
      'is it a checkpoint of another architecture? check --model'
    )
  return out


# ---------------------------------------------------------------------------
# Shapes our model expects for a foreign checkpoint.


def expected_shapes(arch, num_classes: Optional[int], num_tokens, what: str) -> dict:
  """{key: shape} of the ViT of architecture `arch` with a head of `num_classes` and
  `num_tokens` position embeddings (None for a model without a table: posemb='none')."""
  grid = 2 if arch.posemb == 'none' else vit_checkpoint.square_grid(num_tokens, arch, what)
  spec = ModelSpec(arch, grid * arch.stride)
  model = models.build(spec, num_classes)
  shapes = jax.eval_shape(
    lambda: model.init(
      jax.random.key(0), jnp.zeros((1, spec.image_size, spec.image_size, 3)), train=False
    )
  )['params']
  return {k: tuple(v.shape) for k, v in checkpoint.flatten(shapes).items()}


# ---------------------------------------------------------------------------
# Files.


def save_safetensors(state: Mapping[str, np.ndarray], path: str, metadata: Mapping[str, str]):
  """Writes a .safetensors file; `format: pt` tells transformers the layout is PyTorch's."""
  safetensors_numpy = require('safetensors.numpy', 'safetensors')
  safetensors_numpy.save_file(dict(state), path, metadata={'format': 'pt', **metadata})
  # safetensors creates its file readable by its owner alone (0600); give it the mode every
  # other file of an export gets, that of a file `open` creates (0644 under umask 022).
  probe = f'{path}.mode-{os.getpid()}'
  open(probe, 'wb').close()
  try:
    os.chmod(path, os.stat(probe).st_mode & 0o777)
  finally:
    os.remove(probe)
  return path


def load_safetensors(path: str) -> Tuple[Dict[str, np.ndarray], Dict[str, str]]:
  """(tensors as float32 numpy arrays, metadata); bfloat16 files go through torch."""
  safetensors = require('safetensors')
  try:
    try:
      with safetensors.safe_open(path, 'np') as f:
        metadata = dict(f.metadata() or {})
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    except TypeError:
      # numpy has no bfloat16: read with torch and widen.
      torch = require('torch')
      with safetensors.safe_open(path, 'pt') as f:
        metadata = dict(f.metadata() or {})
        tensors = {k: f.get_tensor(k).to(torch.float32).numpy() for k in f.keys()}
  except ExportError:
    raise
  except Exception as e:
    # SafetensorError is not importable under a stable name.
    raise checkpoint.CheckpointError(
      f'{path}: not a readable .safetensors file ({str(e).splitlines()[0]})'
    ) from None
  return {k: _float32(v) for k, v in tensors.items()}, metadata


def load_torch_file(path: str) -> Dict[str, np.ndarray]:
  """A PyTorch `.pth` / `.bin` state_dict (tensors only, never pickled code)."""
  torch = require('torch')
  try:
    state = torch.load(path, map_location='cpu', weights_only=True)
  except Exception as e:
    raise checkpoint.CheckpointError(
      f'{path}: not a readable PyTorch state_dict ({type(e).__name__}); save it as .safetensors'
    ) from None
  for key in ('state_dict', 'model'):
    if isinstance(state, dict) and isinstance(state.get(key), dict):
      state = state[key]
  return {k: _float32(v.to(torch.float32).numpy()) for k, v in state.items() if hasattr(v, 'numpy')}


def _float32(x: np.ndarray) -> np.ndarray:
  return x.astype(np.float32) if np.issubdtype(x.dtype, np.floating) else x
