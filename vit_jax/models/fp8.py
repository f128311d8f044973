"""FP8 matrix products with current scaling: `dot_general`, a drop-in for `lax.dot_general`.

Each operand is scaled by its own absolute maximum to the FP8 format's range,
rounded to FP8, and the product is taken of those FP8 values and scaled back
(Micikevicius et al. 2022, "FP8 Formats for Deep Learning"): e4m3 (3 mantissa
bits) for the forward operands, e5m2 (2 bits, more range) for the gradient
that flows back. The scale is computed from the tensor itself at every call
("current scaling"), not from a history of earlier steps ("delayed scaling",
Transformer Engine's first recipe): no state to carry, checkpoint or resume,
and no overflow when a tensor's range jumps (the first steps, a learning-rate
change, a fine-tune's new head).

Which products are FP8 (DINOv3's split, torchao's `ROWWISE_WITH_GW_HP`): a dense
layer y = x W takes three, the forward one and, going back, the input gradient
dx = g W^T and the weight gradient dW = x^T g. The first two are FP8; the weight
gradient is taken in the compute dtype (bf16) of the unrounded x and g. An FP8
GEMM on Hopper reads both operands with the contracted dimension minor, and the
weight gradient contracts over the tokens, which x and g hold major: in FP8 it
needs both transposed, a pass over every activation and gradient (what cost 21%
of ViT-L/16's step on an H200 with all three in FP8). In bf16 cuBLAS reads them
as they are. W alone is needed in both layouts (W^T forward, W for dx): the
kernel that rounds it writes both, a pass the size of the weights.
benchmarks/fp8_recipes.py compares this recipe with all three products in FP8,
compiled for an H100 on this CPU (docs/speed_and_scale.md: FP8 on Hopper GPUs).

On a GPU with FP8 tensor cores (Ada and Hopper: compute capability 8.9 and up)
XLA turns the pattern `convert(f8) * scale` feeding a dot into one cuBLASLt FP8
GEMM with the scales in its epilogue. On other devices the same program computes
the FP8 rounding in the compute dtype and multiplies at that precision: FP8's
numbers, not its speed (`native`).

Inference (`quantise_params`): the kernels are rounded to FP8 once, when the
checkpoint is loaded, and the program takes them as FP8 arrays with their scales
(`Quantised`); only the activations are scaled and rounded per call.
"""

import functools
import math
import re
from typing import Any

import flax
import flax.linen as nn
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


@flax.struct.dataclass
class Quantised:
  """A kernel rounded to e4m3 once (`quantise_kernel`), as an FP8 GEMM reads it: its FP8 values
  transposed so that the dimensions a product contracts (the kernel's first `contracted`, its
  inputs) are minor, held in the kernel's own shape (a reshape, free), with the float32 scale
  and the compute dtype the kernel stands for. Stored so, a program that multiplies by it on
  Hopper transposes nothing (benchmarks/fp8_recipes.py); `dot_general` multiplies by it as it
  is, and what reads it as an array (`jnp.asarray`, `jnp.stack`) gets the kernel dequantised."""

  values: jax.Array
  scale: jax.Array
  contracted: int = flax.struct.field(pytree_node=False, default=1)
  dtype: Any = flax.struct.field(pytree_node=False, default=jnp.bfloat16)

  @property
  def shape(self):
    return self.values.shape

  @property
  def ndim(self):
    return self.values.ndim

  def transposed(self):
    """The FP8 values as [outputs..., inputs...]."""
    c = self.contracted
    return self.values.reshape(self.shape[c:] + self.shape[:c])

  def astype(self, dtype):
    return self.replace(dtype=jnp.dtype(dtype))

  def reshape(self, *shape):
    """The kernel reshaped, its inputs still its leading dimensions: (inputs, -1) and the like."""
    shape = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
    shape = jax.eval_shape(lambda: jnp.zeros(self.shape, jnp.int8).reshape(shape)).shape
    inputs, size, c = math.prod(self.shape[: self.contracted]), 1, 0
    while size < inputs:
      size, c = size * shape[c], c + 1
    if size != inputs:
      raise ValueError(f"{self.shape} -> {shape} splits the kernel's inputs from its outputs")
    values = self.transposed().reshape(shape[c:] + shape[:c]).reshape(shape)
    return self.replace(values=values, contracted=c)

  def __jax_array__(self):
    t = _dequantise(self.transposed(), self.scale, self.dtype)
    outputs = t.ndim - self.contracted
    return jnp.transpose(t, [*range(outputs, t.ndim), *range(outputs)])


def quantise_kernel(kernel, contracted: int = 1, dtype=jnp.bfloat16) -> Quantised:
  """`kernel` rounded to e4m3 (one scale), its first `contracted` dimensions its inputs."""
  q, scale = quantise(jnp.asarray(kernel), FORWARD)
  outputs = list(range(contracted, q.ndim))
  values = jnp.transpose(q, [*outputs, *range(contracted)]).reshape(q.shape)
  return Quantised(values, scale, contracted, jnp.dtype(dtype))


# The kernels the encoder multiplies with `dot_general` when built with fp8=True (vit.py):
# the attention's four projections ([D, heads, head_dim], out: [heads, head_dim, D]) and the
# MLP's two layers of every block.
_FP8_KERNEL = re.compile(
  r'encoderblock(_\d+)?/(MultiHeadDotProductAttention_1/(query|key|value|out)|'
  r'MlpBlock_3/Dense_[01])/kernel$'
)


def quantise_params(params, dtype=jnp.bfloat16):
  """`params` (in `dtype`, `vit.compute_params`) with the kernels of the encoder's FP8 products
  rounded to e4m3 once (`Quantised`), for a model built with fp8=True to run inference on."""

  def convert(path, leaf):
    name = '/'.join(str(getattr(k, 'key', k)) for k in path)
    if not _FP8_KERNEL.search(name):
      return leaf
    return quantise_kernel(leaf, 2 if name.endswith('out/kernel') else 1, dtype)

  return jax.tree_util.tree_map_with_path(convert, params)


def promote_dtype(*args, dtype=None, inexact=True):
  """flax's `promote_dtype` for `nn.Dense(promote_dtype=...)` that leaves a `Quantised` kernel
  quantised (in `dtype`) for `dot_general` to multiply by as it is."""
  arrays = [None if isinstance(a, Quantised) else a for a in args]
  promoted = nn.dtypes.promote_dtype(*arrays, dtype=dtype, inexact=inexact)
  target = next((p.dtype for p in promoted if p is not None), dtype)
  return [a.astype(target) if isinstance(a, Quantised) else p for a, p in zip(args, promoted)]


def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
  """`lax.dot_general` of activations `lhs` and a layer's kernel `rhs` with FP8 products: the
  forward product of both rounded to e4m3 (each with its own scale), the input gradient of the
  gradient rounded to e5m2 and the e4m3 kernel, the weight gradient of the unrounded operands
  in their dtype. The result is in the operands' dtype (`preferred_element_type` when given).
  A `Quantised` rhs (inference) is multiplied as it is."""
  del precision  # FP8 has one
  if isinstance(rhs, Quantised):
    return _quantised_product(lhs, rhs, dimension_numbers, preferred_element_type)
  out_dtype = preferred_element_type or jnp.result_type(lhs, rhs)
  return _fp8_dot(lhs, rhs, dimension_numbers, jnp.dtype(out_dtype))


def _quantised_product(lhs, rhs: Quantised, dimension_numbers, preferred_element_type):
  """The product with a kernel rounded once: only `lhs` is scaled and rounded here."""
  dtype = jnp.result_type(lhs, rhs.dtype)
  out_dtype = preferred_element_type or dtype
  ql, sl = quantise(lhs, FORWARD)
  (lhs_contracting, rhs_contracting), batch = dimension_numbers
  c = rhs.contracted
  if tuple(rhs_contracting) == tuple(range(c)) and batch == ((), ()):  # the kernel's inputs
    kernel = _dequantise(rhs.transposed(), rhs.scale, dtype)
    outputs = kernel.ndim - c
    dimension_numbers = ((lhs_contracting, tuple(range(outputs, kernel.ndim))), batch)
  else:
    kernel = jnp.asarray(rhs)
  return _product(_dequantise(ql, sl, dtype), kernel, dimension_numbers, out_dtype)


def _product(lhs, rhs, dimension_numbers, out_dtype):
  return lax.dot_general(lhs, rhs, dimension_numbers, preferred_element_type=out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _fp8_dot(lhs, rhs, dimension_numbers, out_dtype):
  return _fp8_dot_forward(lhs, rhs, dimension_numbers, out_dtype)[0]


def _fp8_dot_forward(lhs, rhs, dimension_numbers, out_dtype):
  (ql, sl), (qr, sr) = quantise(lhs, FORWARD), quantise(rhs, FORWARD)
  dtype = jnp.result_type(lhs, rhs)
  y = _product(_dequantise(ql, sl, dtype), _dequantise(qr, sr, dtype), dimension_numbers, out_dtype)
  # lhs unrounded for the weight gradient (the activation bf16 training keeps too); the kernel
  # in FP8 for the input gradient.
  return y, (lhs, qr, sr, jnp.zeros((), rhs.dtype))


def _fp8_dot_backward(dimension_numbers, out_dtype, residuals, g):
  lhs, qr, sr, rhs_like = residuals
  dtype = jnp.result_type(lhs, rhs_like)
  lhs = lhs.astype(dtype)
  rhs = _dequantise(qr, sr, dtype)
  qg, sg = quantise(g, BACKWARD)
  _, input_transpose = jax.vjp(lambda a: _product(a, rhs, dimension_numbers, dtype), lhs)
  (d_lhs,) = input_transpose(_dequantise(qg, sg, dtype))
  _, weight_transpose = jax.vjp(lambda b: _product(lhs, b, dimension_numbers, dtype), rhs)
  (d_rhs,) = weight_transpose(g.astype(dtype))
  return d_lhs.astype(residuals[0].dtype), d_rhs.astype(rhs_like.dtype)


_fp8_dot.defvjp(_fp8_dot_forward, _fp8_dot_backward)
