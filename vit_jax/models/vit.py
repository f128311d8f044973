"""Vision Transformer (Dosovitskiy et al., ICLR 2021), as a Flax linen module.

Module names are the parameter names of the public `.npz` checkpoints
(`embedding`, `cls`, `Transformer/posembed_input`, `encoderblock_{i}`,
`LayerNorm_0`, `MultiHeadDotProductAttention_1`, `LayerNorm_2`, `MlpBlock_3`,
`encoder_norm`, `pre_logits`, `head`), so the parameter tree is the file format.

Every layer computes in `dtype` (e.g. bfloat16) and keeps float32 parameters;
`compute_params` casts them to `dtype` once (per training step, or for good
for inference) instead of in every layer on every call.
For analysis, call `apply(..., mutable=['intermediates'])`: each encoder block
then sows its attention weights (`attention_weights`, [B, heads, N, N]) and its
output tokens (`tokens`, [B, N, D]). Without that collection nothing extra is
kept; how attention is computed is the `attention` attribute (see ATTENTION).

Beyond the paper (the giant ViTs of Zhai et al. 2022 and Dehghani et al. 2023):
`transformer.parallel_block` (attention and MLP read one LayerNorm and add to
the residual together), `transformer.qk_norm` (LayerNorm of queries and keys
per head) and `transformer.qkv_and_norm_biases=False` (no biases in the q/k/v
projections and the LayerNorms) work at any size, and `classifier='map'`
pools with big_vision's multi-head attention pooling (`MAPHead`), the head
those papers train with. `scan=True` runs the blocks
as one `nn.scan`: a single block is compiled whatever the depth, and the
parameters are stacked under `Transformer/encoderblock` with a leading layer
axis (`vit_checkpoint.unstack_blocks` turns them into `encoderblock_{i}`).
What a block computes with is one `BlockConfig`, built by `encoder` from the
model's config and handed down the encoder to every block.
With a `model` mesh axis the activations are constrained so that each
sub-layer needs one reduction (vit_jax.core.sharding.constrain).
"""

import dataclasses
import math
import re
from typing import Any, Callable, Mapping, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from vit_jax.configs import model_spec
from vit_jax.configs import schema
from vit_jax.core import hardware
from vit_jax.core import sharding
from vit_jax.models import fp8 as fp8_lib
from vit_jax.models import resample
from vit_jax.models import resnet
from vit_jax.models import rotary

Dtype = Any

CLASSIFIERS = ('token', 'gap', 'map', 'unpooled', 'token_unpooled', 'token_gap')

# How attention is computed when its weights are neither captured nor dropped
# out (those two need the weights, so they always take the written-out path).
# 'explicit' writes out the math head-major ([batch, heads, tokens, head_dim])
# and normalises after the weighted sum (N x head_dim divisions instead of
# N x N); 'xla' and 'cudnn' are the implementations of
# `jax.nn.dot_product_attention`. 'auto' takes cuDNN's fused (flash) attention
# where it applies (CUDA GPUs of compute capability >= 8.0, half precision,
# head_dim a multiple of 8 up to 128) on the device the program is traced for
# (`hardware.target_device`; an odd token count padded once, `pads_sequence`) and 'explicit'
# elsewhere, where XLA's implementation fills its layout with transposes and
# copies (docs/speed_and_scale.md: CPU).
ATTENTION = schema.allowed('attention')


def resolve_attention(attention: str, dtype, head_dim: int, weights_needed: bool) -> str:
  """The implementation that `attention` (see ATTENTION) runs with: 'explicit' wherever the
  weights themselves are needed (captured, or dropped out), 'auto' as cuDNN where it applies."""
  if attention not in ATTENTION:  # a caller of the model; a run's config passed the schema
    raise ValueError(f'attention={attention!r}; use one of {ATTENTION}')
  if weights_needed:
    return 'explicit'
  if attention == 'auto':
    return 'cudnn' if hardware.cudnn_attention_applies(dtype, head_dim) else 'explicit'
  return attention


def pads_sequence(num_tokens: int, implementation: str, pad_odd: Optional[bool] = None) -> bool:
  """Whether the encoder appends one padding token to a sequence of `num_tokens`.

  cuDNN's backward pass is refused at an odd number of tokens (JAX's check in
  `jax/_src/cudnn/fused_attention_stablehlo.py` takes its placeholder bias for
  a bias), and ViT has odd counts: 197 tokens at 224 px, 577 at 384. So an odd
  sequence is padded to even once, before the first block, and every block's
  attention hides the padding token from every query (`fused_attention`'s
  `num_tokens`); it is dropped after the last block (padding in every layer
  instead would pad q, k, v and slice the output in every one). `pad_odd`
  (default: for cuDNN only) lets the tests run the padded path with 'xla'; the
  written-out attention has no use for it, so never pads.
  """
  if pad_odd is None:
    pad_odd = implementation == 'cudnn'
  return bool(pad_odd and num_tokens % 2 and implementation in ('xla', 'cudnn'))


def fused_attention(q, k, v, implementation: str, num_tokens=None):
  """`jax.nn.dot_product_attention` of [batch, tokens, heads, head_dim] inputs.

  `num_tokens`: the real tokens, when the sequence ends in padding (`pads_sequence`, NaFlex's
  budgets): one count, or one per example ([batch] int32); the padding is masked as a key and
  its own output rows are meaningless.
  """
  if num_tokens is None or isinstance(num_tokens, int) and num_tokens == q.shape[1]:
    return jax.nn.dot_product_attention(q, k, v, implementation=implementation)
  lengths = jnp.broadcast_to(jnp.asarray(num_tokens, jnp.int32), (q.shape[0],))
  return jax.nn.dot_product_attention(
    q,
    k,
    v,
    query_seq_lengths=lengths,
    key_value_seq_lengths=lengths,
    implementation=implementation,
  )


def _layer_norm(name, dtype, use_bias=True, eps=1e-6):
  # Original code: LayerNorm epsilon 1e-6 everywhere (CLIP's towers: 1e-5, `norm_eps`).
  return nn.LayerNorm(epsilon=eps, dtype=dtype, use_bias=use_bias, name=name)


# The MLP's activation (`BlockConfig.activation`): the original code's tanh approximation of
# GELU, the exact GELU (timm's default, with which DINOv2, DeiT III, SigLIP and CLIP run
# there), and OpenAI CLIP's x * sigmoid(1.702 x).
ACTIVATIONS = {
  'gelu_tanh': nn.gelu,
  'gelu': lambda x: nn.gelu(x, approximate=False),
  'quick_gelu': lambda x: x * nn.sigmoid(1.702 * x),
}


def recomputed(activation, fp8: bool = False):
  """On a GPU, `activation` whose backward pass recomputes it from its input (the first MLP
  matmul's output, kept anyway) instead of keeping its intermediates: GELU's tanh is 2 bytes
  per hidden unit written and read again per block. XLA then computes the tanh GELU in that
  matmul's cuBLASLt epilogue with its input as the auxiliary output (BIAS_GELU_AUX), no kernel
  of its own (benchmarks/gpu_hlo.py: ablations); the optimization barrier in the backward pass
  keeps XLA from keeping the forward pass's intermediates instead. Under FP8 a barrier keeps a
  trained GELU out of the FP8 GEMM's epilogue, whose auxiliary output XLA's GPU backend (jax
  0.10.2) refuses to emit; inference, not differentiated, has it there. Elsewhere `activation`
  as it is: on a TPU v3 recomputing GELU costs more than the bytes it saves (+2.4% on a
  one-block ViT-L/16 step, libtpu's estimate)."""
  if hardware.target_device().platform != 'gpu':
    return activation

  @jax.custom_vjp
  def again(x):
    return activation(x)

  def forward(x):
    return activation(jax.lax.optimization_barrier(x) if fp8 else x), x

  def backward(x, g):
    x, g = jax.lax.optimization_barrier((x, g))  # recomputed once the gradient is there
    return jax.vjp(activation, x)[1](g)

  again.defvjp(forward, backward)
  return again


def _flat_init(init, num_in_dims):
  """Initialises a multi-axis kernel as the 2D matrix it multiplies as."""

  def init_fn(key, shape, dtype=jnp.float32):
    fan_in = math.prod(shape[:num_in_dims])
    return init(key, (fan_in, math.prod(shape[num_in_dims:])), dtype).reshape(shape)

  return init_fn


class AddPositionEmbs(nn.Module):
  """Learned 1D position embeddings (paper 3.1), added to the token sequence: to every token,
  or to all but the first `skip` (timm's `no_embed_class`: the class token and registers
  without position embeddings, as DINOv2-reg and DeiT III)."""

  posemb_init: Callable = nn.initializers.normal(stddev=0.02)
  dtype: Dtype = jnp.float32
  skip: int = 0

  @nn.compact
  def __call__(self, x):
    shape = (1, x.shape[1] - self.skip, x.shape[2])
    pe = self.param('pos_embedding', self.posemb_init, shape, jnp.float32)
    if self.skip:
      return jnp.concatenate([x[:, : self.skip], x[:, self.skip :] + pe.astype(self.dtype)], 1)
    return x + pe.astype(self.dtype)


def _axis(index, size, length):
  """Bilinear sources (lower, upper, weight of upper) of `index` on an axis of `size`
  entries, read from a table axis of `length` (half-pixel centres, edges clamped)."""
  src = jnp.maximum((index + 0.5) * (length / size) - 0.5, 0.0)
  lower = jnp.minimum(jnp.floor(src), length - 1)
  upper = jnp.minimum(lower + 1, length - 1)
  return lower.astype(jnp.int32), upper.astype(jnp.int32), src - lower


def resample_grid(table, rows, cols, real):
  """[B, N, D]: each patch's position embedding from `table` [1, gh, gw, D].

  A patch at (row, col) of an image whose grid is (h, w) (one more than its
  real patches' largest row and column) reads the table bilinearly at
  ((row + 0.5) * gh / h - 0.5, likewise columns), edges clamped, without
  antialiasing: what resizing the table to (h, w) gives it (torch's
  `interpolate(mode='bilinear', align_corners=False)`), for any mix of grids.
  """
  _, gh, gw, _ = table.shape
  height = jnp.max(jnp.where(real > 0, rows, 0), axis=1, keepdims=True) + 1
  width = jnp.max(jnp.where(real > 0, cols, 0), axis=1, keepdims=True) + 1
  y0, y1, fy = _axis(rows, height, gh)
  x0, x1, fx = _axis(cols, width, gw)
  t = table[0]
  fx, fy = fx[..., None], fy[..., None]
  top = t[y0, x0] * (1 - fx) + t[y0, x1] * fx
  bottom = t[y1, x0] * (1 - fx) + t[y1, x1] * fx
  return top * (1 - fy) + bottom * fy


# How NaFlex's table is resampled to an image's grid: bilinear without antialiasing
# (`resample_grid`, big_vision's), or torch's antialiased filters (`resample.resample_table`;
# timm NaFlexVit's default is bicubic). No checkpoint records which a model was trained with.
NAFLEX_RESAMPLE = schema.allowed('naflex_resample')


class GridPositionEmbs(nn.Module):
  """NaFlex's learned 2D position embeddings `pos_embedding` [1, gh, gw, D], resampled to each
  image's grid (see NAFLEX_RESAMPLE) and added to its patches, the last of its tokens."""

  grid: tuple
  resample: str = 'bilinear'  # see NAFLEX_RESAMPLE

  @nn.compact
  def __call__(self, x, rows, cols, real):
    """(x with the patches' embeddings added, each image's real tokens [B]): the prefix tokens
    and the real patches, which come first in every image's row."""
    shape = (1, *self.grid, x.shape[-1])
    table = self.param('pos_embedding', nn.initializers.normal(stddev=0.02), shape, jnp.float32)
    first = x.shape[1] - rows.shape[1]  # the prefix tokens have no position embedding
    if self.resample == 'bilinear':
      positions = resample_grid(table, rows, cols, real)
    elif self.resample in NAFLEX_RESAMPLE:
      positions = resample.resample_table(table, rows, cols, real, self.resample)
    else:
      raise ValueError(f'posemb_resample={self.resample!r}; use one of {NAFLEX_RESAMPLE}')
    patches = x[:, first:] + positions.astype(x.dtype)
    real_tokens = (first + jnp.sum(real, axis=1)).astype(jnp.int32)
    return jnp.concatenate([x[:, :first], patches], axis=1), real_tokens


class _Projection(nn.Module):
  """One attention projection's parameters, under the checkpoint's names."""

  kernel_shape: tuple
  bias_shape: Optional[tuple]  # None: no bias (ViT-22B's q/k/v)
  num_in_dims: int

  @nn.compact
  def __call__(self):
    init = _flat_init(nn.initializers.xavier_uniform(), self.num_in_dims)
    kernel = self.param('kernel', init, self.kernel_shape, jnp.float32)
    if self.bias_shape is None:
      return kernel, jnp.zeros((), jnp.float32)
    bias = self.param('bias', nn.initializers.zeros, self.bias_shape, jnp.float32)
    return kernel, bias


def _explicit_attention(q, k, v, dtype, keep=None, num_tokens=None):
  """softmax(q k^T / sqrt(head_dim)) v over [batch, heads, tokens, head_dim] arrays, the
  logits and softmax in float32 for range. `keep(weights)` (recording them, dropout) makes
  the weights explicit; without it the softmax's division comes after the product.
  `num_tokens` ([batch]): each example's real keys; the padding after them takes no weight."""
  q = q * jnp.asarray(q.shape[-1] ** -0.5, dtype)
  if num_tokens is not None:
    real = jnp.arange(k.shape[2]) < jnp.reshape(num_tokens, (-1, 1))
  if keep is not None:
    logits = jnp.einsum('bhqk,bhsk->bhqs', q, k, preferred_element_type=jnp.float32)
    if num_tokens is not None:
      logits = jnp.where(real[:, None, None, :], logits, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(logits, axis=-1).astype(dtype)
    if num_tokens is not None:  # a padding query's row: none, not a softmax over real keys
      weights = jnp.where(real[:, None, :, None], weights, 0)
    weights = keep(weights)
    return jnp.einsum('bhqs,bhsk->bhqk', weights, v)
  # softmax(l) @ v == (exp(l - max) @ v) / sum(exp(l - max)). The product is rounded to
  # `dtype` (accumulated in float32 by the hardware) so that its gradient, and with it
  # both backward matmuls, are in `dtype` too. The logits are laid out [batch, query, head,
  # key], as a TPU's matmul writes them from q and k in [batch, head, tokens, head_dim]: laid
  # out [batch, head, query, key] they cost a copy of the float32 logits, 5.1% of ViT-L/16's
  # step on a v3, and one of their gradient (`time_by_op` of benchmarks/tpu's records).
  logits = jnp.einsum('bhqk,bhsk->bqhs', q, k, preferred_element_type=jnp.float32)
  if num_tokens is not None:
    logits = jnp.where(real[:, None, None, :], logits, jnp.finfo(jnp.float32).min)
  e = jnp.exp(logits - jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True)))
  y = jnp.einsum('bqhs,bhsk->bhqk', e.astype(dtype), v)
  total = jnp.swapaxes(jnp.sum(e, axis=-1, keepdims=True), 1, 2)
  return (y.astype(jnp.float32) / total).astype(dtype)


def _project_qkv(x, inputs_kv, params, norms, layout: str, dtype, dot):
  """q, k and v of `x` (k and v of `inputs_kv` when given) in `layout` ('bnhk' or 'bhnk'), each
  with its bias (`params`: (kernel, bias or None) of q, k, v) and q, k normalised (`norms`:
  each a function of the projection and `layout`);
  `dot` is the products' `dot_general` (`lax.dot_general`, or FP8's).

  Straight into the layout the attention reads: XLA needs no transposes between
  the projections and the attention (docs/speed_and_scale.md). Self-attention in
  the fused attention's layout without tensor parallelism takes three matmuls,
  each writing [batch, tokens, heads, head_dim] with its bias in its epilogue
  (cuBLASLt on a GPU); one einsum over the stacked kernels would write
  [3, batch, ...] through a transpose and add each bias in a kernel of its own.
  Otherwise it is that one einsum:
  under tensor parallelism its backward pass sums the three input gradients
  before its one all-reduce instead of reducing each.
  """
  kernels = [kernel.astype(dtype) for kernel, _ in params]
  biases = [None if bias is None else bias.astype(dtype) for _, bias in params]
  if inputs_kv is None and layout == 'bnhk' and not sharding.splits_model():
    b, n, d = x.shape
    # Under FP8 too: three products, as in bf16 (models/fp8.py: FP8 on Hopper GPUs).
    ys = [dot(x, kernel.reshape(d, -1), (((2,), (0,)), ((), ()))) for kernel in kernels]
    qkv = []
    for y, kernel, bias in zip(ys, kernels, biases):
      y = y if bias is None else y + bias.reshape(-1)
      qkv.append(y.reshape(b, n, *kernel.shape[1:]))
    biases = [None] * 3
  elif inputs_kv is None:
    qkv = jnp.einsum(f'bnd,tdhk->t{layout}', x, jnp.stack(kernels), _dot_general=dot)
  else:
    kv = jnp.einsum(
      f'bnd,tdhk->t{layout}', inputs_kv.astype(dtype), jnp.stack(kernels[1:]), _dot_general=dot
    )
    qkv = [jnp.einsum(f'bnd,dhk->{layout}', x, kernels[0], _dot_general=dot), *kv]
  heads = ('batch', None, 'model', None) if layout == 'bnhk' else ('batch', 'model', None, None)
  out = []
  for y, bias, norm in zip(qkv, biases, norms):
    if bias is not None:
      y = y + (bias if layout == 'bnhk' else bias[:, None])
    out.append(sharding.constrain(norm(y, layout), heads))
  return out


class MultiHeadDotProductAttention(nn.Module):
  """Multi-head self-attention with the parameter layout of the public files.

  Parameters: `{query,key,value}/kernel` [D, heads, head_dim] and `/bias`
  [heads, head_dim]; `out/kernel` [heads, head_dim, D] and `out/bias` [D];
  with `qk_norm`, `{query,key}_norm/scale` [head_dim] (and `/bias`).
  """

  num_heads: int
  dropout_rate: float = 0.0
  dtype: Dtype = jnp.float32
  attention: str = 'auto'
  qk_norm: bool = False  # ViT-22B: LayerNorm of q and k, for stable logits at scale
  qkv_bias: bool = True
  norm_bias: bool = True  # of the q/k LayerNorms
  fp8: bool = False  # the four projections as FP8 products (vit_jax.models.fp8)
  norm_eps: float = 1e-6  # of the q/k LayerNorms
  key_bias: bool = True  # False: the keys' projection without bias (EVA-02), q and v with

  @nn.compact
  def __call__(self, x, *, deterministic: bool, inputs_kv=None, num_tokens=None, rope=None):
    """Self-attention over `x`, or (`inputs_kv` given) queries from `x` attending over `inputs_kv`.

    `num_tokens`: the real tokens of each example ([batch] int32) when padding follows them
    (`pads_sequence`, NaFlex's budgets); attention reads no padding. `rope`: (sin, cos) of
    rotary position embeddings (`models.rotary.padded`) that rotate the queries and keys.
    """
    d = x.shape[-1]
    if d % self.num_heads:
      raise ValueError(f'hidden size {d} is not divisible by num_heads={self.num_heads}')
    head_dim = d // self.num_heads
    bias_shape = (self.num_heads, head_dim) if self.qkv_bias else None
    biased = {'query': True, 'key': self.key_bias, 'value': True}
    qkv_params = [
      _Projection((d, self.num_heads, head_dim), bias_shape if biased[n] else None, 1, name=n)()
      for n in ('query', 'key', 'value')
    ]
    out_kernel, out_bias = _Projection((self.num_heads, head_dim, d), (d,), 2, name='out')()
    norms = [
      _layer_norm(f'{n}_norm', self.dtype, self.norm_bias, self.norm_eps)
      if self.qk_norm
      else (lambda y: y)
      for n in ('query', 'key')
    ] + [lambda y: y]
    if rope is not None:  # the queries and keys rotated by their patches' positions
      sin, cos = rope
      norms = [
        lambda y, layout, norm=norm: rotary.rotate(norm(y), sin, cos, layout) for norm in norms[:2]
      ] + [lambda y, layout: y]
    else:
      norms = [lambda y, layout, norm=norm: norm(y) for norm in norms]

    qkv_params = [
      (k, b if self.qkv_bias and biased[n] else None)
      for (k, b), n in zip(qkv_params, ('query', 'key', 'value'))
    ]
    dot = fp8_lib.dot_general if self.fp8 else jax.lax.dot_general
    project = lambda layout: _project_qkv(x, inputs_kv, qkv_params, norms, layout, self.dtype, dot)

    need_weights = self.is_mutable_collection('intermediates')
    use_dropout = not deterministic and self.dropout_rate > 0.0
    implementation = resolve_attention(
      self.attention, self.dtype, head_dim, need_weights or use_dropout
    )
    out_kernel, out_bias = out_kernel.astype(self.dtype), out_bias.astype(self.dtype)

    if implementation in ('xla', 'cudnn'):
      q, k, v = project('bnhk')
      y = fused_attention(q, k, v, implementation, num_tokens)
      if self.fp8:  # the FP8 product as it is, with a kernel rounded once (fp8.Quantised)
        return dot(y, out_kernel, (((2, 3), (0, 1)), ((), ()))) + out_bias
      return jnp.einsum('bnhk,hkd->bnd', y, out_kernel, _dot_general=dot) + out_bias

    keep = None
    if need_weights or use_dropout:

      def keep(weights):
        self.sow('intermediates', 'attention_weights', weights)
        return nn.Dropout(self.dropout_rate)(weights, deterministic=deterministic)

    y = _explicit_attention(*project('bhnk'), self.dtype, keep, num_tokens)
    return jnp.einsum('bhnk,hkd->bnd', y, out_kernel, _dot_general=dot) + out_bias


class MlpBlock(nn.Module):
  """Transformer MLP: Dense, GELU (tanh approximation, as the original; see ACTIVATIONS), Dense.

  With `swiglu` (Shazeer 2020; DINOv2's giant, EVA-02): the first Dense is twice as wide,
  silu(gate) * value of its halves (gate first, timm's `SwiGLUPacked`) goes on; with `norm`
  (EVA-02's sub-LN) a LayerNorm `LayerNorm_0` of that hidden layer comes before the second.
  """

  mlp_dim: int
  dropout_rate: float = 0.0
  dtype: Dtype = jnp.float32
  fp8: bool = False  # both layers as FP8 products (vit_jax.models.fp8)
  activation: str = 'gelu_tanh'  # see ACTIVATIONS
  swiglu: bool = False
  norm: bool = False
  norm_eps: float = 1e-6

  @nn.compact
  def __call__(self, x, *, deterministic: bool):
    dense = lambda n, name: nn.Dense(
      n,
      dtype=self.dtype,
      kernel_init=nn.initializers.xavier_uniform(),
      bias_init=nn.initializers.normal(stddev=1e-6),
      dot_general=fp8_lib.dot_general if self.fp8 else None,
      **({'promote_dtype': fp8_lib.promote_dtype} if self.fp8 else {}),
      name=name,
    )
    if self.swiglu:
      gate, value = jnp.split(dense(2 * self.mlp_dim, 'Dense_0')(x), 2, axis=-1)
      y = nn.silu(gate) * value
    else:
      y = recomputed(ACTIVATIONS[self.activation], self.fp8)(dense(self.mlp_dim, 'Dense_0')(x))
    if self.norm:
      y = _layer_norm('LayerNorm_0', self.dtype, eps=self.norm_eps)(y)
    y = sharding.constrain(y, ('batch', None, 'model'))
    y = nn.Dropout(self.dropout_rate)(y, deterministic=deterministic)
    y = dense(x.shape[-1], 'Dense_1')(y)
    return nn.Dropout(self.dropout_rate)(y, deterministic=deterministic)


class MAPHead(nn.Module):
  """Multi-head attention pooling (big_vision's `pool_type='map'`).

  A learned probe token attends over all output tokens; a LayerNorm and an MLP
  with a residual follow, and the probe's vector is the representation.
  Parameter names are big_vision's (`MAPHead_0/probe` [1, 1, D],
  `MultiHeadDotProductAttention_0/{query,key,value,out}`, `LayerNorm_0`,
  `MlpBlock_0/Dense_{0,1}`), which timm also reads.
  """

  num_heads: int
  mlp_dim: int
  dtype: Dtype = jnp.float32
  activation: str = 'gelu_tanh'  # of its MLP (ACTIVATIONS)
  norm_eps: float = 1e-6

  @nn.compact
  def __call__(self, x):
    n, _, d = x.shape
    probe = self.param('probe', nn.initializers.xavier_uniform(), (1, 1, d), jnp.float32)
    probe = jnp.broadcast_to(probe.astype(self.dtype), (n, 1, d))
    # One query: the written-out attention (fused kernels want longer queries).
    y = MultiHeadDotProductAttention(
      self.num_heads, dtype=self.dtype, attention='explicit', name='MultiHeadDotProductAttention_0'
    )(probe, deterministic=True, inputs_kv=x)
    z = _layer_norm('LayerNorm_0', self.dtype, eps=self.norm_eps)(y)
    mlp = MlpBlock(self.mlp_dim, dtype=self.dtype, activation=self.activation, name='MlpBlock_0')
    y = y + mlp(z, deterministic=True)
    return y[:, 0]


@dataclasses.dataclass(frozen=True)
class BlockConfig:
  """What every encoder block computes with: a model config's `transformer` entry (less
  `num_layers`) and the model's `dtype` and `attention`. An option of the blocks is a field
  here and the code that reads it; `encoder` builds this once per model."""

  mlp_dim: int
  num_heads: int
  dropout_rate: float = 0.1
  attention_dropout_rate: float = 0.1
  dtype: Dtype = jnp.float32
  attention: str = 'auto'  # see ATTENTION
  parallel_block: bool = False  # see Encoder1DBlock
  qk_norm: bool = False  # ViT-22B: LayerNorm of q and k per head
  qkv_and_norm_biases: bool = True  # False: ViT-22B's q/k/v projections and LayerNorms
  layer_scale: Optional[float] = None  # LayerScale's initial gamma; None: none (the paper's)
  activation: str = 'gelu_tanh'  # the MLP's (ACTIVATIONS)
  swiglu: bool = False  # the MLP gated: silu(gate) * value (MlpBlock)
  mlp_norm: bool = False  # EVA-02: a LayerNorm inside the MLP, before its second Dense
  norm_eps: float = 1e-6  # every LayerNorm's epsilon (CLIP: 1e-5)
  key_bias: bool = True  # False: no bias in the keys' projection (EVA-02; with rotary
  # embeddings a key bias is rotated per position, so it changes the scores)
  fp8: bool = False  # the dense layers (q/k/v/out, MLP) as FP8 products (models/fp8.py)


def block_options_of(names) -> dict:
  """The `BlockConfig` options (`model_spec.BLOCK_OPTIONS`) that the parameter names of one
  encoder block ('LayerNorm_0/scale', ...) show: what a checkpoint holds."""
  return {
    'parallel_block': 'LayerNorm_2/scale' not in names,
    'qk_norm': 'MultiHeadDotProductAttention_1/query_norm/scale' in names,
    'qkv_and_norm_biases': 'LayerNorm_0/bias' in names,
    'layer_scale': 1.0 if 'ls1/gamma' in names else None,  # the value only initialises
    'mlp_norm': 'MlpBlock_3/LayerNorm_0/scale' in names,
    'key_bias': 'MultiHeadDotProductAttention_1/key/bias' in names
    or 'MultiHeadDotProductAttention_1/query/bias' not in names,
  }


class LayerScale(nn.Module):
  """CaiT's LayerScale (Touvron et al. 2021): a residual branch scaled per channel by a learned
  `gamma` [D] that starts at `init` (timm's `ls1`, `ls2`)."""

  init: float

  @nn.compact
  def __call__(self, x):
    gamma = self.param('gamma', nn.initializers.constant(self.init), (x.shape[-1],), jnp.float32)
    return x * gamma.astype(x.dtype)


class Encoder1DBlock(nn.Module):
  """Pre-LN encoder block (paper eq. 2-3): x + MSA(LN(x)), then x + MLP(LN(x)).

  With `parallel_block` (ViT-22B): x + MSA(LN(x)) + MLP(LN(x)), one LayerNorm,
  so under tensor parallelism the two sub-layers share one reduction. With
  `layer_scale` each branch is scaled by its `LayerScale` (`ls1`, `ls2`) before
  it is added.
  """

  config: BlockConfig

  @nn.compact
  def __call__(self, x, deterministic: bool, num_tokens=None, rope=None):
    """`num_tokens` ([batch] int32): each example's real tokens, when padding follows them;
    `rope`: rotary position embeddings (`MultiHeadDotProductAttention`)."""
    c = self.config
    bias = c.qkv_and_norm_biases
    x = sharding.constrain(x, ('batch', None, None))
    y = _layer_norm('LayerNorm_0', c.dtype, bias, c.norm_eps)(x)
    attention = MultiHeadDotProductAttention(
      num_heads=c.num_heads,
      dropout_rate=c.attention_dropout_rate,
      dtype=c.dtype,
      attention=c.attention,
      qk_norm=c.qk_norm,
      qkv_bias=bias,
      norm_bias=bias,
      fp8=c.fp8,
      norm_eps=c.norm_eps,
      key_bias=c.key_bias,
      name='MultiHeadDotProductAttention_1',
    )(y, deterministic=deterministic, num_tokens=num_tokens, rope=rope)
    mlp = MlpBlock(
      c.mlp_dim,
      c.dropout_rate,
      c.dtype,
      c.fp8,
      c.activation,
      c.swiglu,
      c.mlp_norm,
      c.norm_eps,
      name='MlpBlock_3',
    )
    scaled = lambda name, y: y if c.layer_scale is None else LayerScale(c.layer_scale, name=name)(y)
    x = x + scaled('ls1', nn.Dropout(c.dropout_rate)(attention, deterministic=deterministic))
    if c.parallel_block:  # the MLP reads the same normalised input as attention
      x = x + scaled('ls2', mlp(y, deterministic=deterministic))
    else:
      x = sharding.constrain(x, ('batch', None, None))
      y = _layer_norm('LayerNorm_2', c.dtype, bias, c.norm_eps)(x)
      x = x + scaled('ls2', mlp(y, deterministic=deterministic))
    x = sharding.constrain(x, ('batch', None, None))
    self.sow('intermediates', 'tokens', x)
    return x


class _ScannedBlock(Encoder1DBlock):
  """An encoder block as the body of `nn.scan`: (carry, broadcast inputs) -> (carry, None)."""

  @nn.compact
  def __call__(self, x, deterministic: bool, num_tokens=None, rope=None):
    return super().__call__(x, deterministic, num_tokens, rope), None


class Encoder(nn.Module):
  """Position embeddings, the stack of encoder blocks, and the final LayerNorm.

  Over a ViT's sequences (prefix tokens, then the patches; one learned position embedding per
  token), or over NaFlex's (`posemb_grid`): each image's patches in its own grid, padded to
  the batch's length, a learned 2D table resampled to each image's grid, and each image's
  sequence its prefix tokens and its real patches: attention reads no padding.
  """

  num_layers: int
  block: BlockConfig
  remat: bool = False
  remat_policy: str = 'nothing_saveable'  # a jax.checkpoint_policies name (configs.schema)
  scan: bool = False
  pad_odd: Optional[bool] = None  # see pads_sequence; None: where attention runs on cuDNN
  posemb_grid: Optional[Tuple[int, int]] = None  # NaFlex: the 2D table's (rows, columns)
  posemb_resample: str = 'bilinear'  # NaFlex: how the table meets each grid (NAFLEX_RESAMPLE)
  unembedded: int = 0  # leading tokens without position embeddings (timm's no_embed_class)
  pre_norm: bool = False  # CLIP: a LayerNorm `pre_norm` of the embedded tokens before the blocks
  final_norm: bool = True  # False: the model normalises after pooling instead (`fc_norm`)
  rotary: Optional[Tuple[int, int]] = None  # EVA-02: rotary embeddings on this reference grid

  @nn.compact
  def __call__(self, x, *, train: bool, positions=None, grid=None):
    """[B, N, D] tokens -> [B, N, D]. `positions` (NaFlex): (rows, cols, real) [B, P] of the
    last P tokens, the patches: their grid row and column, and 1 for a real patch. `grid`:
    (rows, columns) of the patches, the last of the tokens (for `rotary`)."""
    c = self.block
    if positions is None:
      posemb = AddPositionEmbs(dtype=c.dtype, skip=self.unembedded, name='posembed_input')
      x, real_tokens = posemb(x), None
    else:
      x, real_tokens = GridPositionEmbs(
        self.posemb_grid, self.posemb_resample, name='posembed_input'
      )(x, *positions)
      if c.attention == 'auto':  # the fused kernels take each image's length as it is
        fused = hardware.cudnn_attention_applies(c.dtype, x.shape[-1] // c.num_heads)
        c = dataclasses.replace(c, attention='cudnn' if fused else 'xla')
    x = nn.Dropout(c.dropout_rate)(x, deterministic=not train)
    if self.pre_norm:
      x = _layer_norm('pre_norm', c.dtype, eps=c.norm_eps)(x)
    num_tokens = x.shape[1]
    implementation = resolve_attention(
      c.attention,
      c.dtype,
      x.shape[-1] // c.num_heads,
      self.is_mutable_collection('intermediates') or (train and c.attention_dropout_rate > 0),
    )
    padded = pads_sequence(num_tokens, implementation, self.pad_odd)
    if padded:  # a zero token: finite through every block, and never attended to
      x = jnp.pad(x, ((0, 0), (0, 1), (0, 0)))
      if real_tokens is None:
        real_tokens = jnp.full((x.shape[0],), num_tokens, jnp.int32)
    rope = None
    if self.rotary is not None:
      sin, cos = rotary.tables(grid, self.rotary, x.shape[-1] // c.num_heads)
      rope = rotary.padded(sin, cos, num_tokens - len(sin), x.shape[1])
    block_cls = _ScannedBlock if self.scan else Encoder1DBlock
    if self.remat:
      # static_argnums=(2,): `deterministic` is a Python bool, not traced.
      policy = getattr(jax.checkpoint_policies, self.remat_policy)
      block_cls = nn.remat(block_cls, static_argnums=(2,), policy=policy)
    if self.scan:
      # One block's program, run num_layers times; parameters (and sown
      # intermediates) get a leading layer axis, each layer its own init and
      # dropout keys.
      stack = nn.scan(
        block_cls,
        variable_axes={'params': 0, 'intermediates': 0},
        split_rngs={'params': True, 'dropout': True},
        in_axes=nn.broadcast,
        length=self.num_layers,
      )
      x, _ = stack(c, name='encoderblock')(x, not train, real_tokens, rope)
    else:
      for i in range(self.num_layers):
        x = block_cls(c, name=f'encoderblock_{i}')(x, not train, real_tokens, rope)
    if padded:
      x = sharding.constrain(x[:, :num_tokens], ('batch', None, None))
    if not self.final_norm:
      return x
    return _layer_norm('encoder_norm', c.dtype, c.qkv_and_norm_biases, c.norm_eps)(x)


def encoder(model, posemb_grid=None) -> Encoder:
  """The `Transformer` of `model` (a VisionTransformer, MppViT or NaFlexViT): its `transformer`
  entry, and its attributes of the encoder's options (dtype, attention, fp8, remat,
  remat_policy, scan, pad_odd, no_embed_class, pre_norm, fc_norm, rotary); NaFlex's 2D table
  of `posemb_grid` positions."""
  block = {k: v for k, v in model.transformer.items() if k != 'num_layers'}
  unembedded = 0
  if getattr(model, 'no_embed_class', False):
    unembedded = model_spec.prefix_tokens(model.classifier, model.num_registers)
  rotary_grid = getattr(model, 'rotary', None)
  return Encoder(
    model.transformer['num_layers'],
    BlockConfig(dtype=model.dtype, attention=model.attention, fp8=model.fp8, **block),
    remat=model.remat,
    remat_policy=model.remat_policy,
    scan=model.scan,
    pad_odd=getattr(model, 'pad_odd', None),
    posemb_grid=None if posemb_grid is None else tuple(posemb_grid),
    posemb_resample=getattr(model, 'posemb_resample', 'bilinear'),
    unembedded=unembedded,
    pre_norm=getattr(model, 'pre_norm', False),
    final_norm=not getattr(model, 'fc_norm', False),
    rotary=None if rotary_grid is None else tuple(rotary_grid),
    name='Transformer',
  )


class VisionTransformer(nn.Module):
  """ViT and R+ViT hybrids (paper section 3.1).

  Takes NHWC images with values in [-1, 1] and returns float32 logits
  [B, num_classes], or the pooled representation when `num_classes` is None
  (all tokens for the `unpooled` classifiers).

  Attributes mirror the entries of `vit_jax.configs.architectures.MODEL_CONFIGS`, so
  `VisionTransformer(num_classes=1000, **MODEL_CONFIGS['ViT-B_16'])` works. Beyond the paper,
  for the families that timm holds (`configs.families`): `no_embed_class` (the class token and
  registers without position embeddings), `pre_norm` (CLIP: a LayerNorm before the blocks and
  no patch-embedding bias), `fc_norm` (the LayerNorm after pooling instead of on every token),
  `rotary` (EVA-02's rotary embeddings, `models.rotary`), the classifier 'token_gap' (a class
  token in the sequence, the mean of the patches pooled), and `input_mean`/`input_std`: the
  channel statistics (of pixels in [0, 1]) a family normalises its input with, applied to
  the [-1, 1] images every model takes as one multiply-add per channel.
  """

  num_classes: Optional[int]
  patches: Mapping[str, Any]
  transformer: Mapping[str, Any]
  hidden_size: int
  resnet: Optional[Mapping[str, Any]] = None
  representation_size: Optional[int] = None
  classifier: str = 'token'
  head_bias_init: float = 0.0
  model_name: Optional[str] = None
  dtype: Dtype = jnp.float32
  remat: bool = False
  remat_policy: str = 'nothing_saveable'  # a jax.checkpoint_policies name (configs.schema)
  scan: bool = False  # the blocks as one nn.scan, parameters stacked
  attention: str = 'auto'  # see ATTENTION
  num_registers: int = 0  # register tokens (Darcet et al. 2023): `prepend_tokens`
  pad_odd: Optional[bool] = None  # see pads_sequence; None: where attention runs on cuDNN
  fp8: bool = False  # the encoder's dense layers as FP8 products (vit_jax.models.fp8)
  no_embed_class: bool = False
  pre_norm: bool = False
  fc_norm: bool = False
  rotary: Optional[Tuple[int, int]] = None
  input_mean: Optional[Tuple[float, ...]] = None
  input_std: Optional[Tuple[float, ...]] = None

  @nn.compact
  def __call__(self, inputs, *, train: bool):
    if self.classifier not in CLASSIFIERS:
      raise ValueError(f'classifier={self.classifier!r}; use one of {CLASSIFIERS}')
    inputs = normalise_input(inputs, self.input_mean, self.input_std)
    x = embed_patches(
      inputs, self.patches, self.hidden_size, self.resnet, self.dtype, bias=not self.pre_norm
    )
    ph, pw = self.patches['size']
    grid = (inputs.shape[1] // ph, inputs.shape[2] // pw)
    x = prepend_tokens(self, x, self.classifier, self.num_registers)
    x = encoder(self)(x, train=train, grid=grid)

    x = _drop_registers(x, self.num_registers, self.classifier)
    x = _pool(x, self.classifier, self.transformer, self.dtype)
    if self.fc_norm:
      eps = self.transformer.get('norm_eps', 1e-6)
      x = _layer_norm('fc_norm', self.dtype, eps=eps)(x)
    return head(x, self.num_classes, self.representation_size, self.head_bias_init, self.dtype)


def normalise_input(images, mean, std):
  """Images in [-1, 1] -> ((x + 1) / 2 - mean) / std per channel, one multiply-add: a family's
  own input statistics (timm's `pretrained_cfg` mean and std of pixels in [0, 1]). Unchanged
  when neither is given (the paper's models take [-1, 1]: mean = std = 0.5)."""
  if mean is None and std is None:
    return images
  mean = np.asarray(0.5 if mean is None else mean, np.float64)
  std = np.asarray(0.5 if std is None else std, np.float64)
  scale, offset = (0.5 / std).astype(np.float32), ((0.5 - mean) / std).astype(np.float32)
  return images.astype(jnp.float32) * scale + offset


def embed_patches(images, patches, hidden_size: int, resnet_config, dtype, bias: bool = True):
  """Paper 3.1's input, by the calling module's `embedding`: NHWC images -> patch embeddings
  [n, N, hidden_size] in `dtype`, of the hybrid's ResNet features where `resnet_config` is set;
  without the projection's bias where `bias` is False (CLIP)."""
  x = images.astype(dtype)
  if resnet_config is not None:
    x = resnet.resnet_stem(x, resnet_config['num_layers'], resnet_config['width_factor'], dtype)
  return PatchEmbedding(hidden_size, tuple(patches['size']), dtype, bias, name='embedding')(x)


def prepend_tokens(module, x, classifier: str, num_registers: int = 0):
  """[n, N, D] tokens with the learned ones before them, parameters of `module`: the class token
  `cls` [1, 1, D] for the token classifiers (paper 3.1), then `num_registers` register tokens
  `registers` [1, R, D] (Darcet et al. 2023), position-embedded like the patches: timm's
  `reg_token` with `no_embed_class=False`, so weights convert both ways. Registers only give
  attention somewhere to write; `_drop_registers` removes them before pooling."""
  n, _, d = x.shape
  prefix = []
  if model_spec.has_class_token(classifier):
    cls = module.param('cls', nn.initializers.zeros, (1, 1, d), jnp.float32)
    prefix.append(jnp.broadcast_to(cls.astype(x.dtype), (n, 1, d)))
  if num_registers:
    shape = (1, num_registers, d)
    registers = module.param('registers', nn.initializers.normal(stddev=1e-6), shape, jnp.float32)
    prefix.append(jnp.broadcast_to(registers.astype(x.dtype), (n, num_registers, d)))
  return jnp.concatenate([*prefix, x], axis=1) if prefix else x


def head(x, num_classes, representation_size, head_bias_init, dtype):
  """The pooled features -> float32 logits, inside the calling module: the pre-logits MLP
  where `representation_size` is set (paper 3.1: the pre-training head has one hidden layer),
  then the zero-initialised head (3.2; bias -10 for sigmoid pre-training), or the features
  themselves where `num_classes` is None."""
  if representation_size is not None:
    x = nn.tanh(nn.Dense(representation_size, dtype=dtype, name='pre_logits')(x))
  if num_classes is None:
    return x.astype(jnp.float32)
  x = nn.Dense(
    num_classes,
    dtype=dtype,
    kernel_init=nn.initializers.zeros,
    bias_init=nn.initializers.constant(head_bias_init),
    name='head',
  )(x)
  return x.astype(jnp.float32)


class PatchEmbedding(nn.Module):
  """Paper 3.1: the image as non-overlapping patches, each flattened and linearly projected.

  [n, H, W, C] -> [n, (H/ph) (W/pw), features], tokens in row-major order. The
  parameters are those of the original stride-p convolution (`kernel`
  [ph, pw, C, features] with nn.Conv's initialiser, `bias` [features]), so
  checkpoints and initial values are unchanged; edges that are not a multiple
  of the patch are dropped, as its VALID padding did. Computed as a reshape and
  one matmul: a GPU runs the convolution as cuDNN's implicit GEMM with an indexed
  gather and a padding kernel.
  """

  features: int
  patch_size: tuple  # (ph, pw)
  dtype: Dtype = jnp.float32
  use_bias: bool = True

  @nn.compact
  def __call__(self, x):
    """Images [n, H, W, C], or patches already flattened in that order [n, N, ph * pw * C]."""
    ph, pw = self.patch_size
    c = x.shape[-1] if x.ndim == 4 else x.shape[-1] // (ph * pw)
    shape = (ph, pw, c, self.features)
    kernel = self.param('kernel', nn.initializers.lecun_normal(), shape, jnp.float32)
    bias = (
      self.param('bias', nn.initializers.zeros, (self.features,), jnp.float32)
      if (self.use_bias)
      else jnp.zeros((), jnp.float32)
    )
    if x.ndim == 4:
      n, h, w, _ = x.shape
      gh, gw = h // ph, w // pw
      x = x[:, : gh * ph, : gw * pw].reshape(n, gh, ph, gw, pw, c)
      x = x.transpose(0, 1, 3, 2, 4, 5).reshape(n, gh * gw, ph * pw * c)
    x = x.astype(self.dtype)
    x = sharding.constrain(x, ('batch', None, None))
    kernel = kernel.reshape(ph * pw * c, self.features).astype(self.dtype)
    x = sharding.constrain(x @ kernel + bias.astype(self.dtype), ('batch', None, None))
    return sharding.batch_outermost(x) if hardware.target_device().platform == 'gpu' else x


# Parameters that the model computes with in float32 whatever its dtype, named
# by their module (the names are the checkpoint format): LayerNorm's and
# GroupNorm's scales and biases (their statistics are float32) and the hybrid
# stem's convolution kernels (weight-standardised in float32, resnet.StdConv).
_FLOAT32_MODULES = re.compile(r'LayerNorm_\d+|\w+_norm|gn\w*|conv\w*')


def compute_params(params, dtype):
  """`params` as the model computes with them in `dtype`: each parameter that it would cast to
  `dtype` wherever it is used (kernels, biases, embeddings, the class token) cast once here,
  the float32 ones (`_FLOAT32_MODULES`) left as they are. The model then computes exactly as
  with float32 parameters, without a cast per layer and call. Training casts inside the loss
  (gradients stay float32); inference stores the parameters so."""
  dtype = jnp.dtype(dtype)

  def cast(path, x):
    module = getattr(path[-2], 'key', '') if len(path) > 1 else ''
    if dtype == x.dtype or not jnp.issubdtype(x.dtype, jnp.floating):
      return x
    return x if _FLOAT32_MODULES.fullmatch(str(module)) else x.astype(dtype)

  return jax.tree_util.tree_map_with_path(cast, params)


def _drop_registers(x, num_registers: int, classifier: str):
  if not num_registers:
    return x
  first = int(model_spec.has_class_token(classifier))
  return jnp.concatenate([x[:, :first], x[:, first + num_registers :]], axis=1)


def _pool(x, classifier: str, transformer, dtype):
  """What the head reads: the class token (paper 3.1), the mean token (of the patches alone
  with 'token_gap'), the MAP head's output, or every token (the unpooled classifiers)."""
  if classifier == 'token':
    return x[:, 0]
  if classifier == 'gap':
    return jnp.mean(x, axis=1)
  if classifier == 'token_gap':
    return jnp.mean(x[:, 1:], axis=1)
  if classifier == 'map':
    return MAPHead(
      transformer['num_heads'],
      transformer['mlp_dim'],
      dtype,
      transformer.get('activation', 'gelu_tanh'),
      transformer.get('norm_eps', 1e-6),
      name='MAPHead_0',
    )(x)
  return x
