"""The machine: peak rates (for MFU), XLA options for GPUs, out-of-memory errors, versions.

MFU divides by a peak that does not move with the machine's load, so it
stays at most 1: for accelerators the vendor's dense bf16 figure (spec sheet);
for CPUs, which have no such figure we can read, the fastest large matmul
ever measured on this machine, recorded in a small file and only ever raised
(`stable_peak`). A CPU peak re-measured on a busy machine would be too low.
"""

import importlib.metadata
import json
import os
import platform
import re
import time
from typing import Optional

import jax
import jax.numpy as jnp

# Dense bfloat16 peak FLOP/s per device (vendor figures, no sparsity).
_PEAK_BF16 = {
  'TPU v3': 123e12,
  'TPU v4': 275e12,
  'TPU v5 lite': 197e12,
  'TPU v5e': 197e12,
  'TPU v5p': 459e12,
  'TPU v6 lite': 918e12,
  'NVIDIA H100': 989e12,
  'NVIDIA H200': 989e12,
  'NVIDIA A100': 312e12,
}


def peak_flops(device=None):
  """The device's dense bf16 peak, or None when it is not in the table."""
  kind = (device or jax.devices()[0]).device_kind
  for name, flops in _PEAK_BF16.items():
    if kind.startswith(name):
      return flops
  return None


def measure_matmul_flops(n: int = 2048, dtype=jnp.float32, repeats: int = 5) -> float:
  """FLOP/s of a large square matmul on the default device: a measured peak."""
  a = jnp.ones((n, n), dtype)
  f = jax.jit(lambda x: x @ x)
  f(a).block_until_ready()
  best = float('inf')
  for _ in range(repeats):
    start = time.perf_counter()
    f(a).block_until_ready()
    best = min(best, time.perf_counter() - start)
  return 2 * n**3 / best


def peak_record_path() -> str:
  """Where measured CPU peaks are recorded: $XDG_CACHE_HOME (or ~/.cache)/vit_jax/."""
  base = os.environ.get('XDG_CACHE_HOME') or os.path.join(os.path.expanduser('~'), '.cache')
  return os.path.join(base, 'vit_jax', 'peak_flops.json')


def _peak_key(dtype) -> str:
  cpu, flags = _cpu_model_and_flags()
  cores = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()
  devices = jax.local_device_count()  # forced host devices split the cores
  return f'{cpu} | {cores} cores / {devices} devices | {" ".join(flags)} | {jnp.dtype(dtype).name}'


def recorded_cpu_peak(measured: float, dtype=jnp.float32) -> float:
  """The largest of `measured` and the peak recorded for this CPU; records the larger."""
  path, key = peak_record_path(), _peak_key(dtype)
  try:
    with open(path, encoding='utf-8') as f:
      records = json.load(f)
  except (OSError, ValueError):
    records = {}
  best = max(float(measured), float(records.get(key, 0.0)))
  if best > float(records.get(key, 0.0)):
    records[key] = best
    try:
      os.makedirs(os.path.dirname(path), exist_ok=True)
      with open(f'{path}.tmp-{os.getpid()}', 'w', encoding='utf-8') as f:
        json.dump(records, f, indent=1, sort_keys=True)
      os.replace(f'{path}.tmp-{os.getpid()}', path)
    except OSError:
      pass  # a read-only home: this run still uses the best value it knows
  return best


def stable_peak(dtype=jnp.float32, measured: Optional[float] = None):
  """(peak FLOP/s per device, where it comes from), or (None, why) for unknown accelerators.

  `measured`: a matmul rate just measured on this CPU (default: measure one).
  """
  device = jax.devices()[0]
  vendor = peak_flops(device)
  if vendor:
    return vendor, f'spec sheet: {device.device_kind} dense bfloat16'
  if device.platform != 'cpu':
    return None, f'no spec-sheet peak for {device.device_kind}; set --config.peak_flops'
  if measured is None:
    measured = measure_matmul_flops(dtype=dtype) / max(1, jax.local_device_count())
  peak = recorded_cpu_peak(measured, dtype)
  return (
    peak,
    f'recorded: fastest {jnp.dtype(dtype).name} matmul measured on this CPU ({peak_record_path()})',
  )


# CPU features that decide which matmul kernels can run (AVX-512 and AMX for bf16).
_CPU_FLAGS = ('avx2', 'fma', 'avx512f', 'avx512_bf16', 'amx_tile', 'amx_bf16')


def _cpu_model_and_flags():
  try:
    with open('/proc/cpuinfo', encoding='utf-8') as f:
      text = f.read()
  except OSError:
    return platform.processor() or 'unknown', []
  model = next(
    (line.split(':', 1)[1].strip() for line in text.splitlines() if line.startswith('model name')),
    'unknown',
  )
  flags_line = next((line for line in text.splitlines() if line.startswith('flags')), '')
  present = set(flags_line.split(':', 1)[-1].split())
  return model, [f for f in _CPU_FLAGS if f in present]


def library_versions(names=('jax', 'jaxlib', 'flax', 'optax', 'numpy', 'torch', 'timm')) -> dict:
  """Installed versions, read from package metadata (nothing is imported)."""
  versions = {}
  for name in names:
    try:
      versions[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      versions[name] = None
  return versions


def host_memory() -> Optional[int]:
  """This machine's physical memory in bytes (None where the OS does not say)."""
  try:
    return os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')
  except (AttributeError, ValueError, OSError):
    return None


def machine_info() -> dict:
  """What a benchmark number depends on: CPU, cores, devices, libraries, XLA flags."""
  cpu, cpu_flags = _cpu_model_and_flags()
  device = jax.devices()[0]
  return {
    'cpu': cpu,
    'cpu_flags': cpu_flags,
    'cpu_cores': len(os.sched_getaffinity(0))
    if hasattr(os, 'sched_getaffinity')
    else os.cpu_count(),
    'platform': device.platform,
    'device_kind': device.device_kind,
    'device_count': jax.device_count(),
    'python': platform.python_version(),
    'versions': library_versions(),
    'xla_flags': os.environ.get('XLA_FLAGS', ''),
    # Other work on the machine skews timings: record how busy it was.
    'load_average_1min': os.getloadavg()[0] if hasattr(os, 'getloadavg') else None,
  }


# XLA options of the programs built for NVIDIA GPUs (train, eval, benchmark and
# inference steps). Triton's matmuls off: with them on, XLA turns each matmul
# into a Triton fusion before it matches cuBLASLt's epilogues, so a matmul that
# the autotuner then gives to cuBLAS keeps its bias, GELU and residual add as
# kernels of their own (ViT-B/16 inference on an H100: GELU 11.3%, adds 6.3% of
# the time). Compiled for an H100 (benchmarks/gpu_hlo.py), ViT-B/16 then has no
# GELU or bias kernel left. Timed on an H200 (ViT-B/16 training, bf16, batch 512;
# `python benchmarks/gpu_session.py`, records in benchmarks/gpu_measured/h200_20261127/,
# the README's table): 3,993 img/s with these options, 3,841 with Triton's
# matmuls on. MaxText's and JAX-Toolbox's GPU flags set it too; the
# latency-hiding scheduler they also set compiles to the same program (it is on
# by default).
GPU_COMPILER_OPTIONS = {'xla_gpu_enable_triton_gemm': False}

# And where a program spans several GPUs: the latency-hiding scheduler, which starts each
# collective early and runs the compute that does not need it between its start and done, and
# the collectives combined into buckets of at most 30 MiB (XLA's own default, set here so that
# the choice is ours). Of buckets of 8, 30 and 64 MiB, 30 MiB puts the most gradient bytes
# under matmuls in the compiled schedules of the full-depth ImageNet-21k steps (`python
# benchmarks/gpu_overlap.py`, benchmarks/gpu/overlap.json; tests/test_compile_gpu.py holds
# it): ViT-B/16 on 8 H100s 70% of its 197 MiB (8 MiB: 39%, 64 MiB: 62%), on 16 H100s 84%
# (84%, 68%); ViT-L/16 on 16 H100s 89% of its 623 MiB (93%, 90%); on 8, where it accumulates 2
# micro-batches to fit, none with any size: its gradients are reduced after the last one.
MULTI_GPU_COMPILER_OPTIONS = {
  'xla_gpu_enable_latency_hiding_scheduler': True,
  'xla_gpu_all_reduce_combine_threshold_bytes': 30 * 2**20,
  'xla_gpu_all_gather_combine_threshold_bytes': 30 * 2**20,
  'xla_gpu_reduce_scatter_combine_threshold_bytes': 30 * 2**20,
}

# The share of a GPU's memory JAX's allocator takes when the run sets
# XLA_PYTHON_CLIENT_MEM_FRACTION to it (`python -m vit_jax.main` and the launch
# scripts do; JAX's default is 0.75). The rest is the CUDA context, cuDNN/cuBLAS
# handles and NCCL's buffers, which XLA does not see; `bench.gpus` sizes runs by it.
GPU_MEMORY_FRACTION = 0.9


def compiler_options(devices) -> dict:
  """The XLA options for a program on `devices`: GPU_COMPILER_OPTIONS on GPUs, with
  MULTI_GPU_COMPILER_OPTIONS on more than one, less any flag that XLA_FLAGS sets (a user's
  choice, or a benchmark's A/B run, wins); {} elsewhere."""
  devices = list(devices)
  if not devices or devices[0].platform != 'gpu':
    return {}
  options = {**GPU_COMPILER_OPTIONS, **(MULTI_GPU_COMPILER_OPTIONS if len(devices) > 1 else {})}
  given = set(re.findall(r'--(\w+)', os.environ.get('XLA_FLAGS', '')))
  return {key: value for key, value in options.items() if key not in given}


def is_out_of_memory(error: Exception) -> bool:
  """Whether a JAX runtime or compile error says device memory ran out."""
  text = str(error)
  return 'RESOURCE_EXHAUSTED' in text or 'out of memory' in text.lower()


# ---------------------------------------------------------------------------
# The device a program is traced for, and the kernels it can use there.


# GPUs that a program may be compiled for on a machine without them
# (`python -m vit_jax.compile --topology=h100-8`): CUDA, compute capability >= 8.0.
# Their device kinds are as CUDA names them (vit_jax.bench.gpus).
_CUDA_SM80_KINDS = ('NVIDIA A100', 'NVIDIA H100', 'NVIDIA H200')


def target_device():
  """The device a program is being traced for.

  Under `jax.set_mesh` (the trainer, and the compile command) the mesh's
  devices, which may be GPUs this machine does not have; otherwise this
  machine's first device.
  """
  local = jax.devices()[0]
  # None outside a mesh (and in JAX versions whose abstract meshes carry no device).
  target = getattr(jax.sharding.get_abstract_mesh(), 'abstract_device', None)
  if target is None or target.device_kind == local.device_kind:
    return local
  return target


def cudnn_attention_applies(dtype, head_dim: int, device=None) -> bool:
  """Whether cuDNN's fused attention can run on `device`: CUDA, sm80+, half precision.

  `device` defaults to `target_device()`, so that a program compiled here for a
  GPU makes the choice the trainer makes on that GPU.
  """
  device = device or target_device()
  if jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16) or device.platform != 'gpu':
    return False
  if not (head_dim % 8 == 0 and head_dim <= 128):
    return False
  if not hasattr(device, 'compute_capability'):  # a GPU this machine lacks: known by name
    return device.device_kind.startswith(_CUDA_SM80_KINDS)
  if 'cuda' not in getattr(device.client, 'platform_version', '').lower():
    return False  # e.g. ROCm
  try:
    return float(device.compute_capability) >= 8.0
  except ValueError:
    return False
