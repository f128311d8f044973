"""NVIDIA GPU boxes and clusters by name, as devices the GPU compiler accepts on any machine.

`h100-8` is one box of 8 H100 SXM GPUs, `h100-1` a single GPU, `h100-16` two
boxes of 8 (`h100-64`: 8 boxes); likewise `h200-N`, `a100-N` (A100 SXM 80 GB)
and `a100_40g-N` (A100 SXM 40 GB). With jax[cuda12] installed
(`pip install -e ".[gpu]"`), `describe` returns the GPUs of `jax.experimental.
topologies` built from an XLA `GpuTargetConfig` written here from NVIDIA's
spec sheets: `jax.jit(...).lower(...).compile(compiler_options=COMPILER_OPTIONS)`
then builds real GPU programs for them on a machine without a GPU or a driver.
One process per box describes the devices; the trainer's one process per GPU
(launch/slurm.py) numbers them the same way (GPU i on box i // 8).
"""

import dataclasses
import importlib.util
import re

from vit_jax.core import hardware
from vit_jax.core.errors import UserError

MiB = 2**20

# Without a GPU the compiler cannot time candidate kernels: no autotuning, and
# cuBLAS matmuls instead of Triton ones, as the programs are built for GPUs
# anyway (hardware.GPU_COMPILER_OPTIONS). Kernels may therefore differ from a
# compile on the card, and with them the temporaries.
COMPILER_OPTIONS = {'xla_gpu_autotune_level': 0, 'xla_gpu_enable_triton_gemm': False}

MEMORY_FRACTION = hardware.GPU_MEMORY_FRACTION  # of each GPU, what the programs may use
GPUS_PER_BOX = 8


class GpuError(UserError, ValueError):
  """An unknown GPU or box count, or no GPU compiler; one line."""


@dataclasses.dataclass(frozen=True)
class Gpu:
  """One SXM GPU: NVIDIA's spec-sheet figures and the device properties CUDA reports."""

  name: str  # as in the topology name, 'h100'
  product: str  # CUDA's device name, JAX's device_kind
  compute_capability: tuple
  sms: int
  fp32_lanes_per_sm: int
  clock_ghz: float  # boost
  l2_bytes: int
  shared_per_sm: int  # bytes
  shared_per_block_optin: int  # bytes
  memory_bytes: int  # nvidia-smi's memory.total
  hbm_bytes_per_s: float
  bf16_flops: float  # dense
  tf32_flops: float  # dense: float32 matmuls at JAX's default precision
  nvlink_bytes_per_s: float  # per GPU and direction (half the bidirectional figure)
  network_bytes_per_s: float  # per GPU and direction between boxes (one InfiniBand NIC per GPU)

  def peak_flops(self, dtype: str) -> float:
    return self.bf16_flops if dtype in ('bfloat16', 'float16') else self.tf32_flops

  @property
  def usable_bytes(self) -> int:
    return int(self.memory_bytes * MEMORY_FRACTION)


# H100/H200 SXM: 132 SMs of GH100, 228 KB shared memory per SM, NVLink 4 (900
# GB/s both ways), 8 x 400 Gb/s InfiniBand per DGX/HGX box. A100 SXM: 108 SMs
# of GA100, 164 KB per SM, NVLink 3 (600 GB/s), 8 x 200 Gb/s. Memory is what
# nvidia-smi reports (81,559 / 143,771 / 81,920 / 40,960 MiB); the H200's L2 is
# the 60 MB CUDA reports for it.
GPUS = {
  'h100': Gpu(
    'h100', 'NVIDIA H100 80GB HBM3', (9, 0), 132, 128, 1.98, 50 * MiB, 228 * 1024, 227 * 1024,
    81_559 * MiB, 3.35e12, 989e12, 494.5e12, 450e9, 50e9,
  ),
  'h200': Gpu(
    'h200', 'NVIDIA H200', (9, 0), 132, 128, 1.98, 60 * MiB, 228 * 1024, 227 * 1024,
    143_771 * MiB, 4.8e12, 989e12, 494.5e12, 450e9, 50e9,
  ),
  'a100': Gpu(
    'a100', 'NVIDIA A100-SXM4-80GB', (8, 0), 108, 64, 1.41, 40 * MiB, 164 * 1024, 163 * 1024,
    81_920 * MiB, 2.039e12, 312e12, 156e12, 300e9, 25e9,
  ),
  'a100_40g': Gpu(
    'a100_40g', 'NVIDIA A100-SXM4-40GB', (8, 0), 108, 64, 1.41, 40 * MiB, 164 * 1024, 163 * 1024,
    40_960 * MiB, 1.555e12, 312e12, 156e12, 300e9, 25e9,
  ),
}  # fmt: skip


def target_config(gpu: Gpu, cudnn=(9, 8, 0), cuda=(12, 9, 0)) -> str:
  """XLA's GpuTargetConfig of `gpu`, as a text proto (what the compiler reads of a device).

  `cudnn` and `cuda` are the library versions the program will run with.
  """
  major, minor = gpu.compute_capability
  info = {
    'threads_per_block_limit': 1024,
    'threads_per_warp': 32,
    'shared_memory_per_block': 48 * 1024,
    'shared_memory_per_core': gpu.shared_per_sm,
    'threads_per_core_limit': 2048,
    'core_count': gpu.sms,
    'fpus_per_core': gpu.fp32_lanes_per_sm,
    'block_dim_limit_x': 2**31 - 1,
    'block_dim_limit_y': 65535,
    'block_dim_limit_z': 65535,
    'memory_bandwidth': int(gpu.hbm_bytes_per_s),
    'l2_cache_size': gpu.l2_bytes,
    'clock_rate_ghz': gpu.clock_ghz,
    'device_memory_size': gpu.memory_bytes,
    'shared_memory_per_block_optin': gpu.shared_per_block_optin,
    'registers_per_core_limit': 65536,
    'registers_per_block_limit': 65536,
  }
  lines = ['gpu_device_info {']
  lines += [f'  {key}: {value}' for key, value in info.items()]
  lines += [f'  cuda_compute_capability {{ major: {major} minor: {minor} }}', '}']
  lines += ['platform_name: "CUDA"', _version('dnn_version_info', cudnn)]
  lines += [_version('runtime_version', cuda), f'device_description_str: "{gpu.product}"']
  return '\n'.join(lines) + '\n'


def _version(field, version) -> str:
  major, minor, patch = version
  return f'{field} {{ major: {major} minor: {minor} patch: {patch} }}'


@dataclasses.dataclass(frozen=True)
class Cluster:
  name: str  # as the user wrote it
  gpu: Gpu
  boxes: int
  gpus_per_box: int
  devices: list  # as `jax.experimental.topologies` describes them, one process per box

  @property
  def num_gpus(self) -> int:
    return self.boxes * self.gpus_per_box

  @property
  def topology(self) -> str:
    return f'{self.boxes} x {self.gpus_per_box} {self.gpu.name}'


def is_gpu_name(name: str) -> bool:
  """Whether --topology names GPUs (h100-8) rather than a TPU slice (v3-8, v4:4x4x8)."""
  return not re.match(r'v\d', name.strip().lower())


def parse(name: str) -> tuple:
  """(Gpu, boxes, GPUs per box) from 'h100-16'."""
  match = re.fullmatch(r'([a-z]\d+(?:_\w+)?)-(\d+)', name.strip().lower())
  known = ', '.join(f'{g}-8' for g in GPUS)
  if not match or match.group(1) not in GPUS:
    raise GpuError(
      f'--topology={name}: unknown GPU or slice; use one of {known} (or -1, -2, -4, -16, ...), '
      'or a TPU slice such as v3-8'
    )
  count = int(match.group(2))
  if count in (1, 2, 4, 8):
    return GPUS[match.group(1)], 1, count
  if count < 1 or count % GPUS_PER_BOX:
    raise GpuError(
      f'--topology={name}: N GPUs must be 1, 2, 4 or 8 (one box) or a multiple of '
      f'{GPUS_PER_BOX} (boxes of {GPUS_PER_BOX})'
    )
  return GPUS[match.group(1)], count // GPUS_PER_BOX, GPUS_PER_BOX


def compiler_installed() -> bool:
  """Whether jax[cuda12]'s plugin, which holds the GPU compiler, is installed."""
  try:
    return importlib.util.find_spec('jax_plugins.xla_cuda12') is not None
  except ModuleNotFoundError:  # no jax_plugins package at all
    return False


def describe(name: str) -> Cluster:
  """The GPUs of `name` (needs jax[cuda12], not a GPU)."""
  gpu, boxes, per_box = parse(name)
  if not compiler_installed():
    raise GpuError(
      'the GPU compiler is not installed: pip install -e ".[gpu]" (jax[cuda12], about 3 GB '
      'of CUDA wheels; no GPU or driver needed)'
    )
  from jax.experimental import topologies

  config = target_config(gpu, *_installed_versions())
  try:
    devices = topologies.get_topology_desc(
      platform='cuda', target_config=config, topology=f'1x{boxes}x{per_box}'
    ).devices
  except Exception as e:  # the plugin's own refusal: one line with its reason
    reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise GpuError(f'--topology={name}: the GPU compiler refuses it: {reason}')
  return Cluster(name, gpu, boxes, per_box, list(devices))


def _installed_versions() -> tuple:
  """(cuDNN, CUDA runtime) versions of the installed wheels: the ones a GPU box installs too."""
  try:
    from jax._src.lib import cuda_versions

    cudnn, cuda = cuda_versions.cudnn_get_version(), cuda_versions.cuda_runtime_get_version()
  except Exception:  # an older plugin without the query: the versions jax[cuda12] pins
    return (9, 8, 0), (12, 9, 0)
  return (cudnn // 10000, cudnn // 100 % 100, cudnn % 100), (cuda // 1000, cuda // 10 % 100, 0)
