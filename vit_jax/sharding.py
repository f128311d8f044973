"""The device mesh and how arrays are laid out on it.

The mesh has two axes: `data` (replicas of the parameters) and `fsdp`
(parameters and optimizer state split across devices, gathered per layer by
XLA). Batches are split over both axes. With `fsdp=1` (the default) this is
plain data parallelism; ViT-L and ViT-H use `fsdp` > 1 to fit.

Sharding is a rule, not written into the model: an array with at least
`min_size` elements is split along its largest dimension that the `fsdp` axis
divides; everything else is replicated.
"""

import math

import jax
from jax.experimental import mesh_utils
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

BATCH_AXES = ('data', 'fsdp')


def make_mesh(fsdp: int = 1, devices=None) -> Mesh:
  """A (data, fsdp) mesh over all devices of all processes."""
  devices = jax.devices() if devices is None else devices
  if fsdp < 1 or len(devices) % fsdp:
    raise ValueError(f'mesh.fsdp={fsdp} must divide the number of devices ({len(devices)})')
  shape = (len(devices) // fsdp, fsdp)
  try:
    grid = mesh_utils.create_device_mesh(shape, devices=devices)
  except (AssertionError, NotImplementedError, ValueError):
    # Topology-aware placement is only defined for some platforms.
    grid = np.asarray(devices).reshape(shape)
  return Mesh(grid, ('data', 'fsdp'))


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Leading (batch) dimension split over every device."""
  return NamedSharding(mesh, P(BATCH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def fsdp_spec(shape, fsdp: int, min_size: int) -> P:
  """The FSDP rule for one array shape."""
  if fsdp == 1 or math.prod(shape) < min_size:
    return P()
  for dim in sorted(range(len(shape)), key=lambda d: -shape[d]):
    if shape[dim] % fsdp == 0:
      return P(*[None] * dim, 'fsdp')
  return P()


def tree_shardings(tree, mesh: Mesh, min_size: int = 2**18):
  """NamedShardings for every leaf of `tree` (arrays or ShapeDtypeStructs)."""
  fsdp = mesh.shape['fsdp']
  return jax.tree.map(lambda x: NamedSharding(mesh, fsdp_spec(np.shape(x), fsdp, min_size)), tree)
