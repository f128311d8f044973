r"""What ViT-B/16 and ViT-L/16 launch on an H100, compiled on this CPU: the record issue 33 holds.

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
each candidate XLA option of issue 33 item 4 against the options the programs
are built with (`hardware.GPU_COMPILER_OPTIONS`).

The compiler runs without the card: no autotuning, so cuBLAS's algorithms and
some fusions may differ from a compile on the GPU; the counts are the program's
structure, not its speed. tests/test_compile_gpu.py compiles the `*_depth2`
entries again and holds them to this record.
"""

import argparse
import datetime
import json
import os
import time

os.environ.setdefault('JAX_PLATFORMS', 'cpu')

from vit_jax import hardware  # noqa: E402
from vit_jax.bench import gpu_record  # noqa: E402
from vit_jax.bench import gpus  # noqa: E402
from vit_jax.bench.speed import Options  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
B16_TRAIN = Options(model='ViT-B_16', mode='train', dtype='bfloat16', optimizer='adam')
B16_INFER = Options(model='ViT-B_16', mode='infer', dtype='bfloat16')
# name: (options, batches). The B/16 batches are those benchmarks/gpu_session.py times.
ENTRIES = {
  'vit_b16_train': (B16_TRAIN, [256, 512]),
  'vit_b16_infer': (B16_INFER, [512, 1024]),
  'vit_l16_train': (Options(model='ViT-L_16', mode='train', dtype='bfloat16'), [64, 128]),
  # ViT-B/16's block, twice: what the tests compile (a batch at which XLA keeps q, k and v
  # three matmuls, as at the full size; below 32 MB per output it merges them into one).
  'vit_b16_depth2_train': (Options(**{**vars(B16_TRAIN), 'depth': 2}), [128]),
  'vit_b16_depth2_infer': (Options(**{**vars(B16_INFER), 'depth': 2}), [128]),
}
# Issue 33 item 4: each XLA option against the programs as built, ViT-B/16 at one batch.
CANDIDATES = {
  'triton_gemm_on': {'xla_gpu_enable_triton_gemm': True},
  'cublaslt_off': {'xla_gpu_enable_cublaslt': False},
  'latency_hiding_scheduler_off': {'xla_gpu_enable_latency_hiding_scheduler': False},
}


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
    row = {'batch': batch, **gpu_record.step_kernels(Options(**{**vars(opts), 'batch': batch}), device)}
    row['compile_seconds'] = round(time.perf_counter() - start, 1)
    print(name, batch, row['kernels'], row['kernels_per_block'], flush=True)
    rows.append(row)
  return {**_header(gpu), 'entry': name, 'options': vars(opts), 'batches': rows}


def record_candidates(gpu: str, device) -> dict:
  """Kernels per block of ViT-B/16 (training at batch 512, inference at 1024) with each
  candidate option, beside the programs as built."""
  out = {**_header(gpu), 'candidates': CANDIDATES, 'results': {}}
  for opts, batch in ((B16_TRAIN, 512), (B16_INFER, 1024)):
    opts = Options(**{**vars(opts), 'batch': batch})
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
  parser.add_argument('--only', help=f'comma-separated: {", ".join([*ENTRIES, "options"])}')
  args = parser.parse_args()
  names = args.only.split(',') if args.only else [*ENTRIES, 'options']
  device = gpus.describe(args.gpu).devices[0]
  os.makedirs(os.path.join(ROOT, 'benchmarks', 'gpu_hlo'), exist_ok=True)
  for name in names:
    if name == 'options':
      record = record_candidates(args.gpu, device)
    else:
      record = record_entry(name, args.gpu, device)
    path = os.path.join(ROOT, 'benchmarks', 'gpu_hlo', f'{name}_{args.gpu}.json')
    with open(path, 'w', encoding='utf-8') as f:
      json.dump(record, f, indent=1)
    print(f'wrote {path}', flush=True)


if __name__ == '__main__':
  main()
