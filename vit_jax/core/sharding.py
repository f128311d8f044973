"""The device mesh and how arrays are laid out on it.

The mesh has four axes, outermost first:

- `slice`: TPU slices joined over the data-centre network (multi-slice; 1
  otherwise). The outer part of data parallelism: only gradient reductions
  cross it.
- `data`: replicas of the parameters within a slice.
- `fsdp`: parameters and optimizer state split across devices, gathered per
  layer by XLA (ViT-L and ViT-H use it to fit).
- `model`: tensor (Megatron-style) parallelism inside each encoder block:
  attention heads and the MLP's hidden units split across devices.

Batches are split over `slice`, `data` and `fsdp`. Sharding is declared as
rules, not written into the model: `MODEL_RULES` (parameter path pattern ->
the dimensions split over `model`), then the FSDP rule (an array with at least
`min_size` elements is split along its largest remaining dimension that `fsdp`
divides); everything else is replicated. The model only names the logical
layout of a few activations (`constrain`), which keeps FSDP gathering weights
rather than activations and pins where the reductions of tensor parallelism
happen: one per attention and one per MLP in a serial block, one per block
with `parallel_block`, forward and backward alike.
"""

import math
import re

import jax
from jax.experimental import mesh_utils
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

from vit_jax.core.errors import UserError

AXES = ('slice', 'data', 'fsdp', 'model')
BATCH_AXES = ('slice', 'data', 'fsdp')

# Megatron-style tensor parallelism, by the parameter names of `models.vit`:
# q/k/v by head and the output projection by its input (heads), the MLP's
# first kernel by its output and the second by its input. Specs name the
# trailing dimensions; stacked (scanned) parameters have a layer axis in front.
# The MAP head's attention and MLP split the same way.
_ATTENTION = r'(MultiHeadDotProductAttention_1|MAPHead_0/MultiHeadDotProductAttention_0)'
_MLP = r'(MlpBlock_3|MAPHead_0/MlpBlock_0)'
MODEL_RULES = (
  (_ATTENTION + r'/(query|key|value)/kernel$', (None, 'model', None)),
  (_ATTENTION + r'/(query|key|value)/bias$', ('model', None)),
  (_ATTENTION + r'/out/kernel$', ('model', None, None)),
  (_MLP + r'/Dense_0/kernel$', (None, 'model')),
  (_MLP + r'/Dense_0/bias$', ('model',)),
  (_MLP + r'/Dense_1/kernel$', ('model', None)),
)


class MeshError(UserError, ValueError):
  """A mesh that does not fit the devices or the model; one line saying what divides what."""


def make_mesh(fsdp: int = 1, devices=None, *, model: int = 1, data=None) -> Mesh:
  """A (slice, data, fsdp, model) mesh over all devices of all processes.

  `data` (None: the devices left over) is the data-parallel size within a
  slice; the number of slices is read from the devices (`slice_index`).
  """
  devices = jax.devices() if devices is None else devices
  n = len(devices)
  slices = len({getattr(d, 'slice_index', 0) for d in devices})
  for name, size in (('fsdp', fsdp), ('model', model)):
    if not isinstance(size, int) or size < 1:
      raise MeshError(f'mesh.{name}={size!r} must be a positive integer')
  per_slice = n // slices
  if per_slice % (fsdp * model):
    raise MeshError(
      f'mesh.fsdp={fsdp} x mesh.model={model} = {fsdp * model} must divide the {per_slice} '
      f'devices of each slice ({n} devices, {slices} slice(s))'
    )
  if data is None:
    data = per_slice // (fsdp * model)
  if slices * data * fsdp * model != n:
    raise MeshError(
      f'mesh slice={slices} x data={data} x fsdp={fsdp} x model={model} = '
      f'{slices * data * fsdp * model} must equal the number of devices ({n}); '
      f'leave mesh.data unset to use data={per_slice // (fsdp * model)}'
    )
  shape = (slices, data, fsdp, model)
  if slices > 1:
    # Within a slice the fast interconnect; across slices only the outer axis.
    grid = mesh_utils.create_hybrid_device_mesh(
      (1, data, fsdp, model), (slices, 1, 1, 1), devices=devices
    )
  else:
    try:
      grid = mesh_utils.create_device_mesh(shape, devices=devices)
    except (AssertionError, NotImplementedError, ValueError):
      # Topology-aware placement is only defined for some platforms.
      grid = np.asarray(devices).reshape(shape)
  return Mesh(grid, AXES)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Leading (batch) dimension split over every device but those of `model`."""
  return NamedSharding(mesh, P(BATCH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def model_dims(path: str, shape) -> list:
  """Per dimension of an array at `path`: 'model' where MODEL_RULES split it, else None."""
  dims = [None] * len(shape)
  for pattern, spec in MODEL_RULES:
    if re.search(pattern, path) and len(shape) >= len(spec):
      dims[len(shape) - len(spec) :] = spec
      break
  return dims


def param_spec(path: str, shape, fsdp: int, model: int, min_size: int) -> P:
  """The model rule, then the FSDP rule, for one array."""
  dims = model_dims(path, shape) if model > 1 else [None] * len(shape)
  for d, axis in enumerate(dims):
    if axis and shape[d] % model:
      raise MeshError(
        f'{path} {tuple(shape)}: dimension {d} ({shape[d]}) is not divisible by '
        f'mesh.model={model}; pick a mesh.model that divides the heads and the MLP width'
      )
  if fsdp > 1 and math.prod(shape) >= min_size:
    # Never a scanned stack's layer axis: each layer would live on one device.
    stacked = re.search(r'(^|/)encoderblock/', path) is not None
    free = [d for d in range(int(stacked), len(shape)) if dims[d] is None]
    for d in sorted(free, key=lambda d: -shape[d]):
      if shape[d] % fsdp == 0:
        dims[d] = 'fsdp'
        break
  while dims and dims[-1] is None:
    dims.pop()
  return P(*dims)


def fsdp_spec(shape, fsdp: int, min_size: int) -> P:
  """The FSDP rule for one array shape."""
  return param_spec('', shape, fsdp, 1, min_size)


def _path(key_path) -> str:
  return '/'.join(
    str(getattr(k, 'key', getattr(k, 'name', getattr(k, 'idx', k)))) for k in key_path
  )


def tree_shardings(tree, mesh: Mesh, min_size: int = 2**18):
  """NamedShardings for every leaf of `tree` (arrays or ShapeDtypeStructs), by their paths."""
  fsdp, model = mesh.shape['fsdp'], mesh.shape['model']
  return jax.tree_util.tree_map_with_path(
    lambda path, x: NamedSharding(
      mesh, param_spec(_path(path), np.shape(x), fsdp, model, min_size)
    ),
    tree,
  )


def check_model_fits(num_heads: int, mlp_dim: int, model: int) -> None:
  """MeshError unless `model` divides the heads and the MLP width."""
  for what, size in (('num_heads', num_heads), ('mlp_dim', mlp_dim)):
    if size % model:
      raise MeshError(
        f'mesh.model={model} must divide {what}={size} (tensor parallelism splits '
        f'attention heads and MLP units); use a divisor of {math.gcd(num_heads, mlp_dim)}'
      )


def batch_outermost(x):
  """`x` [batch, ...] stored row-major (batch outermost) in the compiled program, forward and
  backward, where a GPU runs it.

  XLA lays a reduction's operand out with the reduced axis innermost, and the
  sums over the batch in a ViT's gradients (of the position embeddings, the
  class token) are taken from the token activations; unless something pins
  their layout, XLA:GPU then stores every activation of a training step batch
  innermost and transposes it before each matmul (ViT-B/16 on an H100, issue
  33: 34 such arrays in two blocks). The patch embedding's convolution pinned
  it (cuDNN's fixed layout); as a matmul it needs this. XLA's partitioner
  cannot split a layout constraint (it gathers the whole array first), so on a
  mesh of several devices it is applied per device (`shard_map` over the batch);
  outside `jax.set_mesh` only where JAX has one device.
  """
  from jax.experimental import layout

  def pin(y):
    return layout.with_layout_constraint(y, layout.Layout(tuple(range(y.ndim))))

  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return pin(x) if jax.device_count() == 1 else x
  if mesh.size == 1:
    return pin(x)
  if x.shape[0] % math.prod(mesh.shape[axis] for axis in BATCH_AXES):
    return x  # a batch the mesh does not split (model.init's one image): nothing to pin
  return jax.shard_map(pin, in_specs=P(BATCH_AXES), out_specs=P(BATCH_AXES))(x)


def splits_model() -> bool:
  """Whether the mesh being traced under splits parameters over `model` (tensor parallelism)."""
  mesh = jax.sharding.get_abstract_mesh()
  return not mesh.empty and mesh.shape.get('model', 1) > 1


def constrain(x, logical):
  """`x` laid out as `logical` ('batch', 'model' or None per dimension) on a sharded mesh.

  A no-op without a mesh, or where the mesh splits no parameter (`fsdp` and
  `model` both 1): data parallelism needs no activation constraints. FSDP
  does: left free, XLA's partitioner splits the MLPs of the giant ViTs by
  their weights' FSDP layout and all-gathers the activations instead of the
  weights (ViT-g/14 on 16 H100s: 677 GiB per GPU and step against 10 GiB;
  docs/speed_and_scale.md).
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or all(mesh.shape.get(axis, 1) == 1 for axis in ('fsdp', 'model')):
    return x
  spec = P(*[BATCH_AXES if a == 'batch' else a for a in logical])
  return jax.lax.with_sharding_constraint(x, spec)
