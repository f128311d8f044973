r"""Where the CPU time goes: attention implementations and one encoder block, ours vs torch.

  python benchmarks/attention_cpu.py

1. The attention layer (projections included) of ViT-B/16 at batch 8 (12
   heads, 197 tokens, head_dim 64), forward: ours with
   `jax.nn.dot_product_attention` (attention='xla') and written out head-major
   (attention='explicit', the default on CPU), and timm's `Attention`, which
   calls torch's `scaled_dot_product_attention`.
2. One encoder block of ViT-S/16 at batch 16, forward and forward+backward:
   `vit.Encoder1DBlock` against timm's `Block` (tanh GELU, eps 1e-6).
Milliseconds, median of 8 synchronised calls; torch on as many threads as cores.
"""

import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from vit_jax.configs.model_spec import Block
from vit_jax.configs.model_spec import Compute
from vit_jax.models import attention as attention_lib
from vit_jax.models import vit


def median_ms(fn, repeats=8):
  fn()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return 1e3 * float(np.median(times))


def attention_op():
  batch, tokens, heads, head_dim = 8, 197, 12, 64
  x = jax.random.normal(jax.random.key(0), (batch, tokens, heads * head_dim))
  results = {}
  for attention in ('xla', 'explicit'):
    module = attention_lib.MultiHeadDotProductAttention(heads, compute=Compute(attention=attention))
    params = module.init(jax.random.key(1), x, deterministic=True)
    fn = jax.jit(lambda p, x, m=module: m.apply(p, x, deterministic=True))
    results[f'vit_jax attention={attention}'] = median_ms(
      lambda fn=fn, params=params: fn(params, x).block_until_ready()
    )
  from timm.models import vision_transformer
  import torch

  theirs = vision_transformer.Attention(heads * head_dim, heads, qkv_bias=True)
  tx = torch.randn(batch, tokens, heads * head_dim)

  def torch_forward():
    with torch.inference_mode():
      theirs(tx)

  results['timm Attention (SDPA)'] = median_ms(torch_forward)
  return results


def encoder_block():
  from timm.models import vision_transformer
  import torch

  batch, tokens, width, heads = 16, 197, 384, 6
  x = jax.random.normal(jax.random.key(0), (batch, tokens, width))
  block = vit.Encoder1DBlock(Block(mlp_dim=4 * width, num_heads=heads))
  params = block.init(jax.random.key(1), x, True)
  forward = jax.jit(lambda p, x: block.apply(p, x, True))
  backward = jax.jit(jax.grad(lambda p, x: jnp.sum(block.apply(p, x, True) ** 2), (0, 1)))
  theirs = vision_transformer.Block(
    width,
    heads,
    mlp_ratio=4,
    qkv_bias=True,
    act_layer=functools.partial(torch.nn.GELU, approximate='tanh'),
    norm_layer=functools.partial(torch.nn.LayerNorm, eps=1e-6),
  )
  tx = torch.randn(batch, tokens, width, requires_grad=True)

  def torch_forward():
    with torch.inference_mode():
      theirs(tx)

  def torch_backward():
    (theirs(tx) ** 2).sum().backward()

  return {
    'vit_jax forward': median_ms(lambda: forward(params, x).block_until_ready()),
    'timm forward': median_ms(torch_forward),
    'vit_jax forward+backward': median_ms(lambda: jax.block_until_ready(backward(params, x))),
    'timm forward+backward': median_ms(torch_backward),
  }


def main():
  import torch

  torch.set_num_threads(len(os.sched_getaffinity(0)))
  print('attention layer, ViT-B/16 dims, batch 8, forward (ms):')
  for name, ms in attention_op().items():
    print(f'  {name:36s} {ms:7.1f}')
  print('encoder block, ViT-S/16 dims, batch 16 (ms):')
  for name, ms in encoder_block().items():
    print(f'  {name:36s} {ms:7.1f}')


if __name__ == '__main__':
  main()
