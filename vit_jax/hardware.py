"""Peak arithmetic rates of accelerators, for model FLOPs utilisation (MFU)."""

import time

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
