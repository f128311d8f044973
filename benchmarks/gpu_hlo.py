r"""What ViT-B/16 and ViT-L/16 launch on an H100, compiled on this CPU.

  python benchmarks/gpu_hlo.py [--gpu=h100-1] [--only=NAME,...]

Compiles the steps that `python -m vit_jax.benchmark` times (bfloat16, Adam;
`bench.gpu_record.compile_benchmark_step`) with the GPU compiler for one GPU
that this machine does not have, and writes `benchmarks/gpu_hlo/<name>_<gpu>.json`
per entry, one record per batch: the kernels a step launches by name (fusions
and cuBLAS/cuDNN calls, `bench.hlo.kernels`), those of one encoder block, the
convolutions, the `pad`s, the parameters cast to bfloat16 inside the program,
cuBLASLt's fused epilogues, and the compiler's estimate of the step's memory
(`memory_estimate_bytes`, which benchmarks/gpu_session.py puts beside the
peak measured on the card). `options_<gpu>.json` compiles ViT-B/16 again with
each candidate XLA option (`CANDIDATES`) against the options the programs
are built with (`hardware.GPU_COMPILER_OPTIONS`).

The compiler runs without the card: no autotuning, so cuBLAS's algorithms and
some fusions may differ from a compile on the GPU; the counts are the program's
structure, not its speed. tests/test_compile_gpu.py compiles the `*_depth2`
entries again and holds them to this record.
"""

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import time
from unittest import mock

os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from vit_jax.bench import gpu_record  # noqa: E402
from vit_jax.bench import gpus  # noqa: E402
from vit_jax.bench.speed import Options  # noqa: E402
from vit_jax.core import hardware  # noqa: E402
from vit_jax.core import sharding  # noqa: E402
from vit_jax.models import vit  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
B16_TRAIN = Options(model='ViT-B_16', mode='train', dtype='bfloat16', optimizer='adam')
B16_INFER = Options(model='ViT-B_16', mode='infer', dtype='bfloat16')
# name: (options, batches). The B/16 batches are those benchmarks/gpu_session.py times.
ENTRIES = {
  'vit_b16_train': (B16_TRAIN, [256, 512]),
  'vit_b16_infer': (B16_INFER, [512, 1024]),
  # At batch 64 XLA merges ViT-L/16's q, k and v matmuls into one (each output under 32 MB).
  'vit_l16_train': (Options(model='ViT-L_16', mode='train', dtype='bfloat16'), [128]),
  # ViT-B/16's block, twice: what the tests compile (a batch at which XLA keeps q, k and v
  # three matmuls, as at the full size; below 32 MB per output it merges them into one).
  'vit_b16_depth2_train': (dataclasses.replace(B16_TRAIN, depth=2), [128]),
  'vit_b16_depth2_infer': (dataclasses.replace(B16_INFER, depth=2), [128]),
}
# Each candidate XLA option against the programs as built, ViT-B/16 at one batch.
CANDIDATES = {
  'triton_gemm_on': {'xla_gpu_enable_triton_gemm': True},
  'cublaslt_off': {'xla_gpu_enable_cublaslt': False},
  'latency_hiding_scheduler_off': {'xla_gpu_enable_latency_hiding_scheduler': False},
}


def _pad_in_every_layer(q, k, v, implementation, num_tokens=None):
  """The attention without the sequence padded once: an odd sequence padded in every layer (q,
  k and v padded, the output sliced), so that cuDNN's backward pass takes it."""
  del num_tokens
  n = q.shape[1]
  if implementation != 'cudnn' or n % 2 == 0:
    return jax.nn.dot_product_attention(q, k, v, implementation=implementation)
  q, k, v = (jnp.pad(t, ((0, 0), (0, 1), (0, 0), (0, 0))) for t in (q, k, v))
  lengths = jnp.full((q.shape[0],), n, jnp.int32)
  y = jax.nn.dot_product_attention(
    q, k, v, query_seq_lengths=lengths, key_value_seq_lengths=lengths, implementation=implementation
  )
  return y[:, :n]


class _ConvolutionEmbedding(nn.Module):
  """The patch embedding as a convolution with stride = kernel = patch, not a matmul."""

  features: int
  patch_size: tuple
  dtype: object
  bias: bool = True

  @nn.compact
  def __call__(self, x):
    p = self.patch_size
    y = nn.Conv(self.features, p, strides=p, padding='VALID', dtype=self.dtype, use_bias=self.bias)(
      x
    )
    return y.reshape(y.shape[0], -1, self.features)


# Each choice of the GPU programs undone on its own: (module, attribute, what replaces it).
ABLATIONS = {
  '1_pad_in_every_layer': [
    (vit, 'pads_sequence', lambda *args, **kwargs: False),
    (vit, 'fused_attention', _pad_in_every_layer),
  ],
  '2_patch_embedding_as_convolution': [(vit, 'PatchEmbedding', _ConvolutionEmbedding)],
  '3_float32_parameters_in_the_program': [(vit, 'compute_params', lambda params, dtype: params)],
  '5_qkv_as_one_einsum': [(sharding, 'splits_model', lambda: True)],
  '5_layout_left_to_xla': [(sharding, 'batch_outermost', lambda x: x)],
  # And the MLP's activation recomputed in the backward pass (`vit.recomputed`) undone: GELU's
  # intermediates kept, the GELU a kernel of its own.
  'gelu_intermediates_kept': [(vit, 'recomputed', lambda activation, fp8=False: activation)],
}
ABLATIONS['all_undone'] = [change for changes in ABLATIONS.values() for change in changes]


def record_ablations(gpu: str, device) -> dict:
  """Kernels and bytes written per block of ViT-B/16 (training at batch 512, inference at
  1024) with each choice of `ABLATIONS` undone, beside the programs as built."""
  out = {**_header(gpu), 'results': {}}
  for opts, batch in ((B16_TRAIN, 512), (B16_INFER, 1024)):
    opts = dataclasses.replace(opts, batch=batch)
    for name, changes in {'as_built': [], **ABLATIONS}.items():
      with contextlib.ExitStack() as stack:
        for module, attribute, value in changes:
          stack.enter_context(mock.patch.object(module, attribute, value))
        row = gpu_record.step_kernels(dataclasses.replace(opts, depth=2), device)
      keep = ('kernels_per_block', 'bytes_written_per_block', 'other_kernels_per_block',
              'other_bytes_written_per_block', 'kernels', 'bytes_written', 'pads', 'convolutions',
              'parameter_casts')  # fmt: skip
      out['results'].setdefault(f'{opts.mode} b{batch}', {})[name] = {
        **{key: row[key] for key in keep},
        'per_block_by_name': row['per_block_by_name'],
      }
      print(opts.mode, name, row['kernels_per_block'], row['bytes_written_per_block'], flush=True)
  return out


def _versions() -> dict:
  return hardware.library_versions(('jax', 'jaxlib', 'jax_cuda12_plugin', 'flax'))


def _header(gpu: str) -> dict:
  return {
    'benchmark': 'benchmarks/gpu_hlo.py',
    'time_utc': datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds'),
    'gpu': gpu,
    'versions': _versions(),
    'compiler_options': {**hardware.GPU_COMPILER_OPTIONS, **gpus.COMPILER_OPTIONS},
    'estimate': 'GPU compiler on a CPU machine, no autotuning: the program as compiled '
    'without the card (kernels per call, memory estimate), not measurements',
  }


def record_entry(name: str, gpu: str, device) -> dict:
  opts, batches = ENTRIES[name]
  rows = []
  for batch in batches:
    start = time.perf_counter()
    row = {
      'batch': batch,
      **gpu_record.step_kernels(dataclasses.replace(opts, batch=batch), device),
    }
    row['compile_seconds'] = round(time.perf_counter() - start, 1)
    print(name, batch, row['kernels'], row['kernels_per_block'], flush=True)
    rows.append(row)
  return {**_header(gpu), 'entry': name, 'options': dataclasses.asdict(opts), 'batches': rows}


def record_candidates(gpu: str, device) -> dict:
  """Kernels per block of ViT-B/16 (training at batch 512, inference at 1024) with each
  candidate option, beside the programs as built."""
  out = {**_header(gpu), 'candidates': CANDIDATES, 'results': {}}
  for opts, batch in ((B16_TRAIN, 512), (B16_INFER, 1024)):
    opts = dataclasses.replace(opts, batch=batch)
    for name, options in {'as_built': {}, **CANDIDATES}.items():
      try:
        row = gpu_record.step_kernels(opts, device, options)
      except Exception as e:  # noqa: BLE001  the compiler's refusal is the result
        row = {'error': str(e).strip().splitlines()[0]}
      out['results'].setdefault(f'{opts.mode} b{batch}', {})[name] = row
      print(opts.mode, name, row.get('kernels_per_block', row.get('error')), flush=True)
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--gpu', default='h100-1')
  parser.add_argument(
    '--only', help=f'comma-separated: {", ".join([*ENTRIES, "options", "ablations"])}'
  )
  args = parser.parse_args()
  names = args.only.split(',') if args.only else [*ENTRIES, 'options', 'ablations']
  device = gpus.describe(args.gpu).devices[0]
  os.makedirs(os.path.join(ROOT, 'benchmarks', 'gpu_hlo'), exist_ok=True)
  for name in names:
    if name == 'options':
      record = record_candidates(args.gpu, device)
    elif name == 'ablations':
      record = record_ablations(args.gpu, device)
    else:
      record = record_entry(name, args.gpu, device)
    path = os.path.join(ROOT, 'benchmarks', 'gpu_hlo', f'{name}_{args.gpu}.json')
    with open(path, 'w', encoding='utf-8') as f:
      json.dump(record, f, indent=1)
    print(f'wrote {path}', flush=True)


if __name__ == '__main__':
  main()
