"""Multi-head self-attention (paper eq. 2) with the parameter layout of the public files, and
the three ways it is computed.

How attention is computed (`Compute.attention`, `schema.allowed('attention')`), when its
weights are neither captured nor dropped out (those two need the weights, so they always take
the written-out path): 'explicit' writes out the math head-major ([batch, heads, tokens,
head_dim]) and normalises after the weighted sum (N x head_dim divisions instead of N x N);
'xla' and 'cudnn' are the implementations of `jax.nn.dot_product_attention`. 'auto' takes
cuDNN's fused (flash) attention where it applies (CUDA GPUs of compute capability >= 8.0,
half precision, head_dim a multiple of 8 up to 128) on the device the program is traced for
(`hardware.target_device`; an odd token count padded once, `pads_sequence`) and 'explicit'
elsewhere, where XLA's implementation fills its layout with transposes and copies
(docs/speed_and_scale.md: CPU). 'explicit' takes `Compute.attention_chunk` queries at a time
where that is set (`chunked_attention`: the memory of a long sequence without a fused kernel).
"""

import math
from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from vit_jax.configs import schema
from vit_jax.configs.model_spec import Compute
from vit_jax.core import hardware
from vit_jax.core import sharding
from vit_jax.models import fp8 as fp8_lib
from vit_jax.models import rotary

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


def explicit_attention(q, k, v, dtype, keep=None, num_tokens=None):
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


def chunked_attention(q, k, v, dtype, num_tokens=None, chunk=0):
  """`explicit_attention` `chunk` queries at a time (0: all at once), each chunk's logits
  recomputed in the backward pass: the float32 logits held at once shrink from [batch, tokens,
  heads, tokens] to [batch, chunk, heads, tokens], what caps a long sequence's memory where no
  fused kernel runs (TPUs, CPUs: a high-resolution fine-tune). Every query row is the same
  computation, so the outputs are those of the whole (to rounding by the matmuls' tiling)."""
  b, h, n, d = q.shape
  if not chunk or chunk >= n:
    return explicit_attention(q, k, v, dtype, None, num_tokens)
  count = -(-n // chunk)
  q = jnp.pad(q, ((0, 0), (0, 0), (0, count * chunk - n), (0, 0)))
  chunks = jnp.moveaxis(q.reshape(b, h, count, chunk, d), 2, 0)
  one = jax.checkpoint(lambda qc: explicit_attention(qc, k, v, dtype, None, num_tokens))
  y = jnp.moveaxis(jax.lax.map(one, chunks), 0, 2).reshape(b, h, count * chunk, d)
  return y[:, :, :n]


def flat_init(init, num_in_dims):
  """Initialises a multi-axis kernel as the 2D matrix it multiplies as."""

  def init_fn(key, shape, dtype=jnp.float32):
    fan_in = math.prod(shape[:num_in_dims])
    return init(key, (fan_in, math.prod(shape[num_in_dims:])), dtype).reshape(shape)

  return init_fn


class _Projection(nn.Module):
  """One attention projection's parameters, under the checkpoint's names."""

  kernel_shape: tuple
  bias_shape: Optional[tuple]  # None: no bias (ViT-22B's q/k/v, EVA-02's keys)
  num_in_dims: int

  @nn.compact
  def __call__(self):
    init = flat_init(nn.initializers.xavier_uniform(), self.num_in_dims)
    kernel = self.param('kernel', init, self.kernel_shape, jnp.float32)
    if self.bias_shape is None:
      return kernel, None
    bias = self.param('bias', nn.initializers.zeros, self.bias_shape, jnp.float32)
    return kernel, bias


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


def layer_norm(name, dtype, use_bias=True, eps=1e-6, kind='layer'):
  """A normalisation layer named as the checkpoints name it (the original code's epsilon:
  1e-6): LayerNorm, or RMSNorm where `kind` is 'rms' (`model_spec.NORMS`; its one parameter is
  `scale`, as LayerNorm's first)."""
  if kind == 'rms':
    return nn.RMSNorm(epsilon=eps, dtype=dtype, name=name)
  return nn.LayerNorm(epsilon=eps, dtype=dtype, use_bias=use_bias, name=name)


class MultiHeadDotProductAttention(nn.Module):
  """Multi-head self-attention with the parameter layout of the public files.

  Parameters: `{query,key,value}/kernel` [D, heads, head_dim] and `/bias`
  [heads, head_dim] (`biases`: model_spec.BIASES); `out/kernel` [heads, head_dim, D] and
  `out/bias` [D]; with `qk_norm`, `{query,key}_norm/scale` [head_dim] (and `/bias`).
  """

  num_heads: int
  dropout_rate: float = 0.0
  qk_norm: bool = False  # ViT-22B: LayerNorm of q and k, for stable logits at scale
  biases: str = 'all'  # model_spec.BIASES
  norm_eps: float = 1e-6  # of the q/k LayerNorms
  norm: str = 'layer'  # of the q/k norms: model_spec.NORMS
  compute: Compute = Compute()

  @nn.compact
  def __call__(self, x, *, deterministic: bool, inputs_kv=None, num_tokens=None, rope=None):
    """Self-attention over `x`, or (`inputs_kv` given) queries from `x` attending over `inputs_kv`.

    `num_tokens`: the real tokens of each example ([batch] int32) when padding follows them
    (`pads_sequence`, NaFlex's budgets); attention reads no padding. `rope`: (sin, cos) of
    rotary position embeddings (`models.rotary.padded`) that rotate the queries and keys, and
    whether their channel pairs are halves (`models.rotary.half`).
    """
    c = self.compute
    dtype = jnp.dtype(c.dtype)
    d = x.shape[-1]
    if d % self.num_heads:
      raise ValueError(f'hidden size {d} is not divisible by num_heads={self.num_heads}')
    head_dim = d // self.num_heads
    biased = {
      'query': self.biases in ('all', 'no_key'),
      'key': self.biases == 'all',
      'value': self.biases in ('all', 'no_key'),
    }
    qkv_params = [
      _Projection(
        (d, self.num_heads, head_dim), (self.num_heads, head_dim) if biased[n] else None, 1, name=n
      )()
      for n in ('query', 'key', 'value')
    ]
    out_kernel, out_bias = _Projection((self.num_heads, head_dim, d), (d,), 2, name='out')()
    norm_bias = self.biases != 'no_qkv_or_norm'
    norms = [
      layer_norm(f'{n}_norm', dtype, norm_bias, self.norm_eps, self.norm)
      if self.qk_norm
      else (lambda y: y)
      for n in ('query', 'key')
    ] + [lambda y: y]
    if rope is not None:  # the queries and keys rotated by their patches' positions
      sin, cos, half = rope
      norms = [
        lambda y, layout, norm=norm: rotary.rotate(norm(y), sin, cos, layout, half)
        for norm in norms[:2]
      ] + [lambda y, layout: y]
    else:
      norms = [lambda y, layout, norm=norm: norm(y) for norm in norms]

    dot = fp8_lib.dot_general if c.fp8 else jax.lax.dot_general
    project = lambda layout: _project_qkv(x, inputs_kv, qkv_params, norms, layout, dtype, dot)

    need_weights = self.is_mutable_collection('intermediates')
    use_dropout = not deterministic and self.dropout_rate > 0.0
    implementation = resolve_attention(c.attention, dtype, head_dim, need_weights or use_dropout)
    out_kernel, out_bias = out_kernel.astype(dtype), out_bias.astype(dtype)

    if implementation in ('xla', 'cudnn'):
      q, k, v = project('bnhk')
      y = fused_attention(q, k, v, implementation, num_tokens)
      if c.fp8:  # the FP8 product as it is, with a kernel rounded once (fp8.Quantised)
        return dot(y, out_kernel, (((2, 3), (0, 1)), ((), ()))) + out_bias
      return jnp.einsum('bnhk,hkd->bnd', y, out_kernel, _dot_general=dot) + out_bias

    keep = None
    if need_weights or use_dropout:

      def keep(weights):
        self.sow('intermediates', 'attention_weights', weights)
        return nn.Dropout(self.dropout_rate)(weights, deterministic=deterministic)

    if keep is None:
      y = chunked_attention(*project('bhnk'), dtype, num_tokens, c.attention_chunk)
    else:
      y = explicit_attention(*project('bhnk'), dtype, keep, num_tokens)
    return jnp.einsum('bhnk,hkd->bnd', y, out_kernel, _dot_general=dot) + out_bias
