"""TPU slices by the names users know, as devices the TPU compiler accepts on any machine.

`v3-8`, `v4-128`, `v5e-256` (Google's names: v2, v3, v4 and v5p count
TensorCores, v5e and v6e count chips) or `v3:4x4`, `v4:4x4x8` (chips per
dimension). With libtpu installed, `describe` returns the slice's devices from
`jax.experimental.topologies`: `jax.jit(...).lower(...).compile()` builds
real TPU programs for them on a CPU-only machine. v4 slices are described as
megacore (one JAX device per chip), as a v4 TPU VM shows them.
"""

import dataclasses
import importlib.util
import math
import os
import re
from typing import Optional

from vit_jax.core.errors import UserError

GiB = 2**30


class TopologyError(UserError, ValueError):
  """An unknown or impossible TPU slice, or no TPU compiler; one line."""


@dataclasses.dataclass(frozen=True)
class Chip:
  """Public spec-sheet figures of one TPU chip (bf16 dense peak)."""

  generation: str
  devices_per_chip: int  # JAX devices per chip on a TPU VM (2 TensorCores on v2/v3)
  hbm_bytes: int  # per chip
  peak_flops: float  # per chip
  # Per chip: the pod's all-reduce bandwidth over its chips (v3, v4, v5e, v6e spec
  # sheets); v5p: half its bidirectional ICI bandwidth, the ratio of v5e and v6e.
  allreduce_bytes_per_s: Optional[float]
  name_counts: str  # what the number in 'v3-8' counts: 'cores' or 'chips'
  dims: int  # 2D or 3D torus

  @property
  def hbm_per_device(self) -> int:
    return self.hbm_bytes // self.devices_per_chip

  @property
  def peak_flops_per_device(self) -> float:
    return self.peak_flops / self.devices_per_chip


CHIPS = {
  'v2': Chip('v2', 2, 16 * GiB, 45e12, None, 'cores', 2),
  'v3': Chip('v3', 2, 32 * GiB, 123e12, 340e12 / 1024, 'cores', 2),
  'v4': Chip('v4', 1, 32 * GiB, 275e12, 1.1e15 / 4096, 'cores', 3),
  'v5e': Chip('v5e', 1, 16 * GiB, 197e12, 51.2e12 / 256, 'chips', 2),
  'v5p': Chip('v5p', 1, 95 * GiB, 459e12, 1200e9 / 2, 'cores', 3),
  'v6e': Chip('v6e', 1, 32 * GiB, 918e12, 102.4e12 / 256, 'chips', 2),
}
_ALIASES = {'v5litepod': 'v5e', 'v6litepod': 'v6e'}


@dataclasses.dataclass(frozen=True)
class Slice:
  name: str  # as the user wrote it
  chip: Chip
  shape: tuple  # chips per dimension
  num_slices: int
  devices: list  # of all slices, as `jax.experimental.topologies` describes them

  @property
  def num_chips(self) -> int:
    return math.prod(self.shape) * self.num_slices

  @property
  def topology(self) -> str:
    return f'{self.chip.generation}:{"x".join(map(str, self.shape))}'

  @property
  def cores(self) -> int:
    """TensorCores, the unit of the paper's TPUv3-core-days."""
    return self.num_chips * (2 if self.chip.generation in ('v2', 'v3', 'v4', 'v5p') else 1)


def parse(name: str) -> tuple:
  """('v3', (4, 4)) from 'v3-32' or 'v3:4x4'."""
  text = name.strip().lower()
  match = re.fullmatch(r'(v\d\w*?)(?:-(\d+)|:(\d+(?:x\d+)*))', text)
  if not match:
    raise TopologyError(
      f'--topology={name}: use a slice name such as v3-8, v4-128, v5e-256, v6e-64, or '
      'GENERATION:AxB[xC] such as v3:4x4, v4:4x4x8'
    )
  generation = _ALIASES.get(match.group(1), match.group(1))
  if generation not in CHIPS:
    raise TopologyError(f'--topology={name}: unknown TPU generation; use one of {", ".join(CHIPS)}')
  chip = CHIPS[generation]
  if match.group(3):
    shape = tuple(int(d) for d in match.group(3).split('x'))
    if len(shape) != chip.dims or min(shape) < 1:
      raise TopologyError(
        f'--topology={name}: {generation} slices have {chip.dims} dimensions, e.g. '
        f'{generation}:{"x".join(["2"] * chip.dims)}'
      )
    return generation, shape
  count = int(match.group(2))
  per_chip = 2 if chip.name_counts == 'cores' else 1
  chips = count // per_chip
  if count % per_chip or chips < 1 or chips & (chips - 1):
    raise TopologyError(
      f'--topology={name}: {generation}-N counts {chip.name_counts}; N must be '
      f'{per_chip} x a power of two (e.g. {generation}-{per_chip * 4})'
    )
  return generation, _shape(chips, chip.dims)


def _shape(chips: int, dims: int) -> tuple:
  """Chips per dimension of a power-of-two slice, as Google's slice names map to them."""
  if dims == 2:
    k = int(math.log2(chips))
    return (2 ** (k // 2), 2 ** (k - k // 2))
  if chips <= 4:  # v4-8 is 2x2x1
    return {1: (1, 1, 1), 2: (2, 1, 1), 4: (2, 2, 1)}[chips]
  shape = [2, 2, 2]  # then 2x2x4, 2x4x4, 4x4x4, 4x4x8, ...
  while math.prod(shape) < chips:
    shape[0] *= 2
    shape.sort()
  return tuple(shape)


def describe(name: str, num_slices: int = 1) -> Slice:
  """The devices of `num_slices` slices of `name` (needs libtpu, not a TPU)."""
  generation, shape = parse(name)
  if importlib.util.find_spec('libtpu') is None:
    raise TopologyError(
      'the TPU compiler is not installed: pip install -e ".[tpu]" (libtpu runs on any Linux '
      'x86-64 machine; no TPU needed)'
    )
  # A TPU VM's running job (or another compile) may hold libtpu's lock; describing
  # a topology uses no device, so several processes may load it at once.
  os.environ.setdefault('ALLOW_MULTIPLE_LIBTPU_LOAD', '1')
  from jax.experimental import topologies

  kwargs = {'num_slices': num_slices} if num_slices > 1 else {}
  if generation == 'v4':
    kwargs['chip_config_name'] = 'megacore'
  if math.prod(shape) == 1:
    kwargs['chips_per_host_bounds'] = (1, 1, 1)
  topology = f'{generation}:{"x".join(map(str, shape))}'
  try:
    devices = topologies.get_topology_desc(platform='tpu', topology_name=topology, **kwargs).devices
  except Exception as e:  # libtpu's own refusal of a shape: one line with its reason
    reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise TopologyError(f'--topology={name} ({topology}): the TPU compiler refuses it: {reason}')
  return Slice(name, CHIPS[generation], shape, num_slices, list(devices))
