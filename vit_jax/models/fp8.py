"""FP8 matrix products with current scaling: `dot_general`, a drop-in for `lax.dot_general`.

Each operand is scaled by its own absolute maximum to the FP8 format's range,
rounded to FP8, and the product is taken of those FP8 values and scaled back
(Micikevicius et al. 2022, "FP8 Formats for Deep Learning"): e4m3 (3 mantissa
bits) for the forward operands, e5m2 (2 bits, more range) for the gradient
that flows back. The scale is computed from the tensor itself at every call
("current scaling"), not from a history of earlier steps ("delayed scaling",
Transformer Engine's first recipe): no state to carry, checkpoint or resume,
and no overflow when a tensor's range jumps (the first steps, a learning-rate
change, a fine-tune's new head); it costs a max-reduction over each operand
before it is rounded (docs/speed_and_scale.md: FP8 has what it costs on an H200).

On a GPU with FP8 tensor cores (Ada and Hopper: compute capability 8.9 and up)
XLA turns the pattern `convert(f8) * scale` feeding a dot into one cuBLASLt FP8
GEMM with the scales in its epilogue, forward and both backward products. On
other devices the same program computes the FP8 rounding in the compute dtype
and multiplies at that precision: FP8's numbers, not its speed (`native`).
"""

import functools

import jax
from jax import lax
import jax.numpy as jnp

FORWARD = jnp.float8_e4m3fn  # largest finite 448
BACKWARD = jnp.float8_e5m2  # largest finite 57,344


def native(device) -> bool:
  """Whether `device` multiplies FP8 on its tensor cores: a CUDA GPU of compute capability
  8.9 or later (a GPU this machine lacks, compiled for by name: an H100 or H200)."""
  if device.platform != 'gpu':
    return False
  if not hasattr(device, 'compute_capability'):
    return device.device_kind.startswith(('NVIDIA H100', 'NVIDIA H200'))
  try:
    return float(device.compute_capability) >= 8.9
  except ValueError:  # e.g. ROCm's gfx names
    return False


def quantise(x, fp8_dtype):
  """(x / scale rounded to `fp8_dtype`, scale): scale = amax(|x|) / the format's largest
  finite value (1 where x is all zeros), in float32."""
  amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
  largest = float(jnp.finfo(fp8_dtype).max)
  scale = jnp.where(amax > 0, amax / largest, 1.0)
  # Rounding |x| / scale <= largest cannot overflow: no clipping needed.
  return (x.astype(jnp.float32) / scale).astype(fp8_dtype), scale


def _dequantise(q, scale, dtype):
  return q.astype(dtype) * scale.astype(dtype)


def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
  """`lax.dot_general` of `lhs` and `rhs` rounded to e4m3 (each with its own scale); the
  gradient is rounded to e5m2 before the two backward products. The result is in the
  operands' dtype (`preferred_element_type` when given)."""
  del precision  # FP8 has one
  out_dtype = preferred_element_type or jnp.result_type(lhs, rhs)
  return _fp8_dot(lhs, rhs, dimension_numbers, jnp.dtype(out_dtype))


def _product(lhs, rhs, dimension_numbers, out_dtype):
  return lax.dot_general(lhs, rhs, dimension_numbers, preferred_element_type=out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _fp8_dot(lhs, rhs, dimension_numbers, out_dtype):
  return _fp8_dot_forward(lhs, rhs, dimension_numbers, out_dtype)[0]


def _fp8_dot_forward(lhs, rhs, dimension_numbers, out_dtype):
  (ql, sl), (qr, sr) = quantise(lhs, FORWARD), quantise(rhs, FORWARD)
  dtype = jnp.result_type(lhs, rhs)
  y = _product(_dequantise(ql, sl, dtype), _dequantise(qr, sr, dtype), dimension_numbers, out_dtype)
  # The FP8 operands are kept for the backward pass: half the bytes of bf16 residuals.
  return y, (ql, sl, qr, sr, jnp.zeros((), lhs.dtype), jnp.zeros((), rhs.dtype))


def _fp8_dot_backward(dimension_numbers, out_dtype, residuals, g):
  ql, sl, qr, sr, lhs_like, rhs_like = residuals
  dtype = jnp.result_type(lhs_like, rhs_like)
  qg, sg = quantise(g, BACKWARD)
  lhs, rhs = _dequantise(ql, sl, dtype), _dequantise(qr, sr, dtype)
  _, transpose = jax.vjp(lambda a, b: _product(a, b, dimension_numbers, dtype), lhs, rhs)
  d_lhs, d_rhs = transpose(_dequantise(qg, sg, dtype))
  return d_lhs.astype(lhs_like.dtype), d_rhs.astype(rhs_like.dtype)


_fp8_dot.defvjp(_fp8_dot_forward, _fp8_dot_backward)
