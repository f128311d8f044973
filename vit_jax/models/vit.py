"""Vision Transformer (Dosovitskiy et al., ICLR 2021), as a Flax linen module.

Module names are the parameter names of the public `.npz` checkpoints
(`embedding`, `cls`, `Transformer/posembed_input`, `encoderblock_{i}`,
`LayerNorm_0`, `MultiHeadDotProductAttention_1`, `LayerNorm_2`, `MlpBlock_3`,
`encoder_norm`, `pre_logits`, `head`), so the parameter tree is the file format.

A model is built of two values: its `Architecture` (what the parameters are and mean:
`configs.model_spec`) and its `Compute` (how it runs: dtype, attention implementation, FP8,
remat, scan). Every layer computes in the compute dtype (e.g. bfloat16) and keeps float32
parameters; `compute_params` casts them to it once (per training step, or for good for
inference) instead of in every layer on every call. The parts every model of this package
reads its input with are functions here (`normalise_input`, `embed_patches`,
`prepend_tokens`, `Encoder`, `pool`, `head`): NaFlex (`models.naflex`) and masked patch
prediction (`models.mpp`) build on them under the same parameter names.

For analysis, call `apply(..., mutable=['intermediates'])`: each encoder block then sows
its attention weights (`attention_weights`, [B, heads, N, N]) and its output tokens
(`tokens`, [B, N, D]). Without that collection nothing extra is kept.

Beyond the paper, the block's options (`model_spec.Block`): ViT-22B's parallel block, q/k
LayerNorms and missing biases, LayerScale, the MLP's activation or SwiGLU, EVA-02's sub-LN;
and the architecture's: registers, position tables for the patches alone or none, rotary
embeddings, CLIP's pre-norm, normalisation after pooling, big_vision's MAP head. With
`Compute.scan` the blocks run as one `nn.scan` (parameters stacked under
`Transformer/encoderblock`; `vit_checkpoint.unstack_blocks` turns them into
`encoderblock_{i}`). With a `model` mesh axis the activations are constrained so that each
sub-layer needs one reduction (vit_jax.core.sharding.constrain).
"""

import dataclasses
import re
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from vit_jax.configs.model_spec import Architecture
from vit_jax.configs.model_spec import Block
from vit_jax.configs.model_spec import Compute
from vit_jax.core import hardware
from vit_jax.core import sharding
from vit_jax.models import fp8 as fp8_lib
from vit_jax.models import resnet
from vit_jax.models import rotary
from vit_jax.models.attention import MultiHeadDotProductAttention
from vit_jax.models.attention import layer_norm
from vit_jax.models.attention import pads_sequence
from vit_jax.models.attention import resolve_attention
from vit_jax.models.positions import AddPositionEmbs
from vit_jax.models.positions import GridPositionEmbs

Dtype = Any

# The MLP's activation (`Block.mlp`, but for SwiGLU's gate): the original code's tanh
# approximation of GELU, the exact GELU, and OpenAI CLIP's x * sigmoid(1.702 x).
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


class MlpBlock(nn.Module):
  """Transformer MLP: Dense, activation (`mlp`: model_spec.MLPS), Dense.

  SwiGLU (Shazeer 2020; DINOv2's giant, EVA-02): the first Dense is twice as wide, and
  silu(gate) * value of its halves (gate first, timm's `SwiGLUPacked`) goes on; with `norm`
  (EVA-02's sub-LN) a LayerNorm `LayerNorm_0` of that hidden layer comes before the second.
  """

  mlp_dim: int
  dropout_rate: float = 0.0
  mlp: str = 'gelu_tanh'
  norm: bool = False
  norm_eps: float = 1e-6
  compute: Compute = Compute()
  norm_kind: str = 'layer'  # of `norm`: model_spec.NORMS

  @nn.compact
  def __call__(self, x, *, deterministic: bool):
    dtype = jnp.dtype(self.compute.dtype)
    dense = lambda n, name: nn.Dense(
      n,
      dtype=dtype,
      kernel_init=nn.initializers.xavier_uniform(),
      bias_init=nn.initializers.normal(stddev=1e-6),
      dot_general=fp8_lib.dot_general if self.compute.fp8 else None,
      **({'promote_dtype': fp8_lib.promote_dtype} if self.compute.fp8 else {}),
      name=name,
    )
    if self.mlp == 'swiglu':
      gate, value = jnp.split(dense(2 * self.mlp_dim, 'Dense_0')(x), 2, axis=-1)
      y = nn.silu(gate) * value
    else:
      y = recomputed(ACTIVATIONS[self.mlp], self.compute.fp8)(dense(self.mlp_dim, 'Dense_0')(x))
    if self.norm:
      y = layer_norm('LayerNorm_0', dtype, eps=self.norm_eps, kind=self.norm_kind)(y)
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
  mlp: str = 'gelu_tanh'  # of its MLP (model_spec.MLPS)
  norm_eps: float = 1e-6
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x, num_tokens=None):
    """The pooled [B, D] of tokens `x` [B, N, D]; `num_tokens` ([B]): each example's real
    tokens, padding after them (NaFlex), which the probe does not attend to."""
    n, _, d = x.shape
    probe = self.param('probe', nn.initializers.xavier_uniform(), (1, 1, d), jnp.float32)
    probe = jnp.broadcast_to(probe.astype(self.dtype), (n, 1, d))
    # One query: the written-out attention (fused kernels want longer queries).
    compute = Compute(dtype=self.dtype, attention='explicit')
    y = MultiHeadDotProductAttention(
      self.num_heads, compute=compute, name='MultiHeadDotProductAttention_0'
    )(probe, deterministic=True, inputs_kv=x, num_tokens=num_tokens)
    z = layer_norm('LayerNorm_0', self.dtype, eps=self.norm_eps)(y)
    mlp = MlpBlock(self.mlp_dim, mlp=self.mlp, compute=compute, name='MlpBlock_0')
    y = y + mlp(z, deterministic=True)
    return y[:, 0]


def drop_path(module, x, rate: float, deterministic: bool):
  """`x` [B, ...] with whole examples zeroed with probability `rate` (a key of `module`'s
  'dropout' stream), the others scaled by 1 / (1 - rate); as it is when `deterministic`."""
  if deterministic or not rate:
    return x
  keep = jax.random.bernoulli(module.make_rng('dropout'), 1.0 - rate, (x.shape[0],))
  scale = jnp.where(keep, 1.0 / (1.0 - rate), 0.0).astype(x.dtype)
  return x * scale.reshape((-1,) + (1,) * (x.ndim - 1))


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

  block: Block
  compute: Compute = Compute()

  @nn.compact
  def __call__(self, x, deterministic: bool, num_tokens=None, rope=None):
    """`num_tokens` ([batch] int32): each example's real tokens, when padding follows them;
    `rope`: rotary position embeddings (`MultiHeadDotProductAttention`)."""
    b, dtype = self.block, jnp.dtype(self.compute.dtype)
    norm_bias = b.biases != 'no_qkv_or_norm'
    x = sharding.constrain(x, ('batch', None, None))
    y = layer_norm('LayerNorm_0', dtype, norm_bias, b.norm_eps, b.norm)(x)
    attention = MultiHeadDotProductAttention(
      num_heads=b.num_heads,
      dropout_rate=b.attention_dropout_rate,
      qk_norm=b.qk_norm,
      biases=b.biases,
      norm_eps=b.norm_eps,
      norm=b.norm,
      compute=self.compute,
      name='MultiHeadDotProductAttention_1',
    )(y, deterministic=deterministic, num_tokens=num_tokens, rope=rope)
    mlp = MlpBlock(
      b.mlp_dim,
      b.dropout_rate,
      b.mlp,
      b.mlp_norm,
      b.norm_eps,
      self.compute,
      b.norm,
      name='MlpBlock_3',
    )
    scaled = lambda name, y: drop_path(
      self,
      y if b.layer_scale is None else LayerScale(b.layer_scale, name=name)(y),
      b.drop_path_rate,
      deterministic,
    )
    x = x + scaled('ls1', nn.Dropout(b.dropout_rate)(attention, deterministic=deterministic))
    if b.parallel_block:  # the MLP reads the same normalised input as attention
      x = x + scaled('ls2', mlp(y, deterministic=deterministic))
    else:
      x = sharding.constrain(x, ('batch', None, None))
      y = layer_norm('LayerNorm_2', dtype, norm_bias, b.norm_eps, b.norm)(x)
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

  Over a ViT's sequences (prefix tokens, then the patches; the 1D table's rows for all of them,
  or for the patches alone), or over NaFlex's (posemb='grid'): each image's patches in its own
  grid, padded to the batch's length, a learned 2D table resampled to each image's grid, and
  each image's sequence its prefix tokens and its real patches: attention reads no padding.
  The width is the input's; everything else is `architecture`'s.
  """

  architecture: Architecture
  compute: Compute = Compute()

  @nn.compact
  def __call__(self, x, *, train: bool, positions=None, grid=None):
    """[B, N, D] tokens -> [B, N, D]. `positions` (NaFlex): (rows, cols, real) [B, P] of the
    last P tokens, the patches: their grid row and column, and 1 for a real patch. `grid`:
    (rows, columns) of the patches, the last of the tokens (for `rotary`)."""
    a, c, b = self.architecture, self.compute, self.architecture.block
    dtype = jnp.dtype(c.dtype)
    real_tokens = None
    if a.posemb == 'grid':
      posemb = GridPositionEmbs(a.posemb_grid, a.posemb_resample, name='posembed_input')
      x, real_tokens = posemb(x, *positions)
      if c.attention == 'auto':  # the fused kernels take each image's length as it is
        fused = hardware.cudnn_attention_applies(dtype, x.shape[-1] // b.num_heads)
        c = dataclasses.replace(c, attention='cudnn' if fused else 'xla')
    elif a.posemb != 'none':
      posemb = AddPositionEmbs(dtype=dtype, name='posembed_input')
      first = a.num_prefix_tokens - a.posemb_prefix  # the tokens before the table's rows
      x = jnp.concatenate([x[:, :first], posemb(x[:, first:])], 1) if first else posemb(x)
    x = nn.Dropout(b.dropout_rate)(x, deterministic=not train)
    if a.pre_norm:
      x = layer_norm('pre_norm', dtype, eps=b.norm_eps, kind=b.norm)(x)
    num_tokens = x.shape[1]
    implementation = resolve_attention(
      c.attention,
      dtype,
      x.shape[-1] // b.num_heads,
      self.is_mutable_collection('intermediates') or (train and b.attention_dropout_rate > 0),
    )
    padded = pads_sequence(num_tokens, implementation, c.pad_odd)
    if padded:  # a zero token: finite through every block, and never attended to
      x = jnp.pad(x, ((0, 0), (0, 1), (0, 0)))
      if real_tokens is None:
        real_tokens = jnp.full((x.shape[0],), num_tokens, jnp.int32)
    rope = None
    if a.rotary is not None:
      sin, cos = rotary.tables(grid, a.rotary, x.shape[-1] // b.num_heads)
      rope = (*rotary.padded(sin, cos, num_tokens - len(sin), x.shape[1]), rotary.half(a.rotary))
    block_cls = _ScannedBlock if c.scan else Encoder1DBlock
    if c.remat:
      # static_argnums=(2,): `deterministic` is a Python bool, not traced.
      policy = getattr(jax.checkpoint_policies, c.remat_policy)
      block_cls = nn.remat(block_cls, static_argnums=(2,), policy=policy)
    if c.scan:
      # One block's program, run num_layers times; parameters (and sown
      # intermediates) get a leading layer axis, each layer its own init and
      # dropout keys.
      stack = nn.scan(
        block_cls,
        variable_axes={'params': 0, 'intermediates': 0},
        split_rngs={'params': True, 'dropout': True},
        in_axes=nn.broadcast,
        length=a.num_layers,
      )
      x, _ = stack(b, c, name='encoderblock')(x, not train, real_tokens, rope)
    else:
      for i in range(a.num_layers):
        x = block_cls(b, c, name=f'encoderblock_{i}')(x, not train, real_tokens, rope)
    if padded:
      x = sharding.constrain(x[:, :num_tokens], ('batch', None, None))
    if a.final_norm != 'tokens':
      return x
    return layer_norm('encoder_norm', dtype, b.biases != 'no_qkv_or_norm', b.norm_eps, b.norm)(x)


class VisionTransformer(nn.Module):
  """ViT and R+ViT hybrids (paper section 3.1), and the newer families' ViTs.

  Takes NHWC images with values in [-1, 1] and returns float32 logits
  [B, num_classes], or the pooled representation when `num_classes` is None
  (all tokens for the `unpooled` classifiers). `vit_jax.models.VisionTransformer` builds one
  from the official keywords (`VisionTransformer(num_classes=1000,
  **MODEL_CONFIGS['ViT-B_16'])`).
  """

  num_classes: Optional[int]
  architecture: Architecture
  compute: Compute = Compute()
  head_bias_init: float = 0.0  # the head's bias at start: -10 with the sigmoid loss (B.1)

  @nn.compact
  def __call__(self, inputs, *, train: bool):
    a = self.architecture
    dtype = jnp.dtype(self.compute.dtype)
    inputs = normalise_input(inputs, a.input_stats)
    x = embed_patches(inputs, a, dtype)
    grid = (inputs.shape[1] // a.patch_size[0], inputs.shape[2] // a.patch_size[1])
    x = prepend_tokens(self, x, a)
    x = Encoder(a, self.compute, name='Transformer')(x, train=train, grid=grid)
    x = pool(drop_registers(x, a), a, dtype)
    if a.final_norm == 'pooled':
      x = layer_norm('fc_norm', dtype, eps=a.block.norm_eps, kind=a.block.norm)(x)
    return head(x, self.num_classes, a.representation_size, self.head_bias_init, dtype)


def normalise_input(images, input_stats):
  """Images in [-1, 1] -> ((x + 1) / 2 - mean) / std per channel, one multiply-add: a family's
  own input statistics ((mean, std) of pixels in [0, 1], timm's `pretrained_cfg`). Unchanged
  when None (the paper's models take [-1, 1]: mean = std = 0.5)."""
  if input_stats is None:
    return images
  mean, std = (np.asarray(v, np.float64) for v in input_stats)
  scale, offset = (0.5 / std).astype(np.float32), ((0.5 - mean) / std).astype(np.float32)
  return images.astype(jnp.float32) * scale + offset


def embed_patches(images, architecture: Architecture, dtype):
  """Paper 3.1's input, by the calling module's `embedding`: NHWC images -> patch embeddings
  [n, N, hidden_size] in `dtype`, of the hybrid's ResNet features where the architecture has
  one; without the projection's bias under CLIP's pre-norm."""
  a = architecture
  x = images.astype(dtype)
  if a.resnet is not None:
    x = resnet.resnet_stem(x, a.resnet.num_layers, a.resnet.width_factor, dtype)
  embedding = PatchEmbedding(a.hidden_size, a.patch_size, dtype, not a.pre_norm, name='embedding')
  return embedding(x)


def prepend_tokens(module, x, architecture: Architecture):
  """[n, N, D] tokens with the learned ones before them, parameters of `module`: the class token
  `cls` [1, 1, D] for the token classifiers (paper 3.1), then the register tokens `registers`
  [1, R, D] (Darcet et al. 2023; timm's `reg_token`). Registers only give attention somewhere
  to write; `drop_registers` removes them before pooling."""
  n, _, d = x.shape
  prefix = []
  if architecture.has_class_token:
    cls = module.param('cls', nn.initializers.zeros, (1, 1, d), jnp.float32)
    prefix.append(jnp.broadcast_to(cls.astype(x.dtype), (n, 1, d)))
  r = architecture.num_registers
  if r:
    registers = module.param(
      'registers', nn.initializers.normal(stddev=1e-6), (1, r, d), jnp.float32
    )
    prefix.append(jnp.broadcast_to(registers.astype(x.dtype), (n, r, d)))
  return jnp.concatenate([*prefix, x], axis=1) if prefix else x


def drop_registers(x, architecture: Architecture):
  """The encoder's output without the register tokens."""
  if not architecture.num_registers:
    return x
  first = int(architecture.has_class_token)
  return jnp.concatenate([x[:, :first], x[:, first + architecture.num_registers :]], axis=1)


def pool(x, architecture: Architecture, dtype):
  """What the head reads: the class token (paper 3.1), the mean token (of the patches alone
  with 'token_gap'), the MAP head's output, or every token (the unpooled classifiers)."""
  classifier, b = architecture.classifier, architecture.block
  if classifier == 'token':
    return x[:, 0]
  if classifier == 'gap':
    return jnp.mean(x, axis=1)
  if classifier == 'token_gap':
    return jnp.mean(x[:, 1:], axis=1)
  if classifier == 'map':
    return MAPHead(b.num_heads, b.mlp_dim, b.mlp, b.norm_eps, dtype, name='MAPHead_0')(x)
  return x


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
