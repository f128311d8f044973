r"""Which FP8 recipe: the products each takes in FP8 and the passes they cost, compiled for an H100.

  python benchmarks/fp8_recipes.py [--gpu=h100-1]

Compiles the training step `python -m vit_jax.benchmark --mode=train --fp8` times
(`bench.gpu_record.step_kernels`: Adam, bf16) of ViT-B/16 and ViT-L/16, two
blocks deep at batch 128, with the GPU compiler on this CPU, once per recipe,
and writes `benchmarks/fp8/recipes_<gpu>.json`: per encoder block the FP8 GEMMs,
the FP8 arrays transposed (read in FP8 and written again in the other layout,
`bench.hlo.fp8_transposes` 'fp8') or rounded and written transposed in one kernel
('cast'), the kernels that are neither GEMM nor attention and the bytes they
write, and the compiler's estimate of the step's memory. The recipes:

- bf16: no FP8, the reference;
- all_fp8_qkv_merged: forward, input-gradient and weight-gradient products in FP8,
  q, k and v one product of their kernels side by side (one scale);
- all_fp8: the three products in FP8, q, k and v three products;
- bf16_weight_gradient_qkv_merged: the weight gradient in bf16, q, k, v merged;
- bf16_weight_gradient_gelu_kept: models/fp8.py, with GELU's intermediates kept for
  the backward pass (`vit.recomputed` undone);
- bf16_weight_gradient: models/fp8.py as it is (`--config.fp8=True`).

At batch 128 each of q, k and v is over 32 MB: XLA keeps them three products
(below that it merges products that share an input). No autotuning without the
card: the counts are the program's structure, not its speed.
"""

import argparse
import contextlib
import datetime
import functools
import json
import os
from unittest import mock

os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import jax  # noqa: E402
from jax import lax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from vit_jax.bench import gpu_record  # noqa: E402
from vit_jax.bench import gpus  # noqa: E402
from vit_jax.bench.speed import Options  # noqa: E402
from vit_jax.core import hardware  # noqa: E402
from vit_jax.core import sharding  # noqa: E402
from vit_jax.models import fp8  # noqa: E402
from vit_jax.models import vit  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = {'ViT-B_16': 2, 'ViT-L_16': 2}  # depth compiled
BATCH = 128
KEYS = (
  'fp8_gemms',
  'fp8_transposes',
  'fp8_transposed_bytes',
  'cast_transposes',
  'cast_transposed_bytes',
  'other_kernels',
  'other_bytes_written',
  'kernels',
  'bytes_written',
)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _all_fp8(lhs, rhs, dimension_numbers, out_dtype):
  return _all_fp8_forward(lhs, rhs, dimension_numbers, out_dtype)[0]


def _all_fp8_forward(lhs, rhs, dimension_numbers, out_dtype):
  (ql, sl), (qr, sr) = fp8.quantise(lhs, fp8.FORWARD), fp8.quantise(rhs, fp8.FORWARD)
  dtype = jnp.result_type(lhs, rhs)
  deq = lambda q, s: q.astype(dtype) * s.astype(dtype)  # noqa: E731
  y = lax.dot_general(deq(ql, sl), deq(qr, sr), dimension_numbers, preferred_element_type=out_dtype)
  return y, (ql, sl, qr, sr, jnp.zeros((), dtype))


def _all_fp8_backward(dimension_numbers, out_dtype, residuals, g):
  ql, sl, qr, sr, like = residuals
  qg, sg = fp8.quantise(g, fp8.BACKWARD)
  deq = lambda q, s: q.astype(like.dtype) * s.astype(like.dtype)  # noqa: E731
  product = lambda a, b: lax.dot_general(a, b, dimension_numbers, preferred_element_type=like.dtype)  # noqa: E731
  _, transpose = jax.vjp(product, deq(ql, sl), deq(qr, sr))
  return transpose(deq(qg, sg))


_all_fp8.defvjp(_all_fp8_forward, _all_fp8_backward)


def all_fp8_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
  """The three products of a dense layer in FP8 (the backward ones of the rounded operands)."""
  del precision
  out_dtype = jnp.dtype(preferred_element_type or jnp.result_type(lhs, rhs))
  return _all_fp8(lhs, rhs, dimension_numbers, out_dtype)


def merged_qkv(original):
  """`vit._project_qkv` with q, k and v of self-attention one FP8 product of their kernels side
  by side (one scale), split after it."""

  def project(x, inputs_kv, params, norms, layout, dtype, dot):
    if inputs_kv is not None or layout != 'bnhk' or dot is lax.dot_general:
      return original(x, inputs_kv, params, norms, layout, dtype, dot)
    b, n, d = x.shape
    kernels = [kernel.astype(dtype) for kernel, _ in params]
    y = dot(
      x, jnp.concatenate([k.reshape(d, -1) for k in kernels], axis=1), (((2,), (0,)), ((), ()))
    )
    out = []
    for part, kernel, (_, bias), norm in zip(jnp.split(y, 3, axis=-1), kernels, params, norms):
      part = part.reshape(b, n, *kernel.shape[1:])
      part = part if bias is None else part + bias.astype(dtype)
      out.append(sharding.constrain(norm(part, layout), ('batch', None, 'model', None)))
    return out

  return project


def _changes(recipe: str) -> list:
  """(module, attribute, replacement) of a recipe, applied over the code as it is."""
  merged = (vit, '_project_qkv', merged_qkv(vit._project_qkv))
  return {
    'bf16': [],
    'all_fp8_qkv_merged': [(fp8, 'dot_general', all_fp8_dot_general), merged],
    'all_fp8': [(fp8, 'dot_general', all_fp8_dot_general)],
    'bf16_weight_gradient_qkv_merged': [merged],
    'bf16_weight_gradient_gelu_kept': [
      (vit, 'recomputed', lambda activation, fp8=False: activation)
    ],
    'bf16_weight_gradient': [],
  }[recipe]


RECIPES = (
  'bf16',
  'all_fp8_qkv_merged',
  'all_fp8',
  'bf16_weight_gradient_qkv_merged',
  'bf16_weight_gradient_gelu_kept',
  'bf16_weight_gradient',
)


def record(gpu: str) -> dict:
  device = gpus.describe(gpu).devices[0]
  out = {
    'benchmark': 'python benchmarks/fp8_recipes.py',
    'time_utc': datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds'),
    'gpu': gpu,
    'versions': hardware.library_versions(('jax', 'jaxlib', 'jax_cuda12_plugin', 'flax')),
    'compiler_options': {**hardware.GPU_COMPILER_OPTIONS, **gpus.COMPILER_OPTIONS},
    'batch': BATCH,
    'estimate': 'GPU compiler on a CPU machine, no autotuning: the program as compiled '
    'without the card, per encoder block (the program less its one-block copy); not '
    'measurements',
    'results': {},
  }
  for model, depth in MODELS.items():
    for recipe in RECIPES:
      opts = Options(
        model=model, mode='train', batch=BATCH, dtype='bfloat16', depth=depth, fp8=recipe != 'bf16'
      )
      with contextlib.ExitStack() as stack:
        for module, attribute, value in _changes(recipe):
          stack.enter_context(mock.patch.object(module, attribute, value))
        row = gpu_record.step_kernels(opts, device)
      result = {f'{key}_per_block': row[f'{key}_per_block'] for key in KEYS}
      result['memory_estimate_bytes'] = row['memory_estimate_bytes']
      out['results'].setdefault(model, {})[recipe] = result
      print(model, recipe, json.dumps({k: round(v) for k, v in result.items()}), flush=True)
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--gpu', default='h100-1')
  args = parser.parse_args()
  result = record(args.gpu)
  path = os.path.join(ROOT, 'benchmarks', 'fp8', f'recipes_{args.gpu}.json')
  with open(path, 'w', encoding='utf-8') as f:
    json.dump(result, f, indent=1)
  print(f'wrote {path}', flush=True)


if __name__ == '__main__':
  main()
