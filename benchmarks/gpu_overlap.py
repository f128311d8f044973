r"""How much of a multi-GPU step's gradient traffic the compiled schedule runs under matmuls, for
each candidate size of XLA's collective buckets: what core/hardware.MULTI_GPU_COMPILER_OPTIONS
is chosen by.

  python benchmarks/gpu_overlap.py [--models=ViT-B_16,ViT-L_16] [--topologies=h100-8,h100-16]

Compiles the ImageNet-21k pre-training step of each model at its full depth (the recipe's
batch, bf16, Adam; `python -m vit_jax.compile --fit --json`: ViT-L/16 on 8 GPUs accumulates
2 micro-batches to fit) on one and two boxes of 8 H100s, once
per candidate: XLA's combine thresholds of the all-reduces, all-gathers and reduce-scatters
set to 8, 30 (XLA's own default) and 64 MiB through XLA_FLAGS, with the latency-hiding
scheduler on. Its `overlap` field counts the asynchronous collectives of the scheduled program
and the bytes of those with a cuBLAS/cuDNN kernel between their start and done
(bench/gpu_record.overlap). The figures are the GPU compiler's schedule on a CPU machine, not
a timing: whether a transfer is hidden on a card also depends on it taking less time than the
matmuls beside it. Writes benchmarks/gpu/overlap.json; tests/test_compile_gpu.py holds the
project's options to the candidate with the largest share in every case.
"""

import argparse
import datetime
import json
import os
import sys

import step_cost  # benchmarks/step_cost.py: the compile command's record

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, 'benchmarks', 'gpu', 'overlap.json')
CANDIDATES_MIB = (8, 30, 64)
MODELS = {
  'ViT-B_16': 'configs/vit_b16.py:imagenet21k',
  'ViT-L_16': 'configs/vit_l16.py:imagenet21k',
}


def xla_flags(mib: int) -> str:
  size = mib * 2**20
  return ' '.join(
    f'--xla_gpu_{op}_combine_threshold_bytes={size}'
    for op in ('all_reduce', 'all_gather', 'reduce_scatter')
  )


def compile_overlap(config: str, topology: str, flags: str) -> dict:
  args = [f'--config={config}', f'--topology={topology}', '--fit']
  env = dict(os.environ, XLA_FLAGS=f'{os.environ.get("XLA_FLAGS", "")} {flags}'.strip())
  record = step_cost.compile_record(args, env=env)
  o = record['overlap']
  return {
    'command': ' '.join(['python -m vit_jax.compile', *args]),
    'xla_flags': flags,
    'batch': record['batch'],
    'accum_steps': record['accum_steps'],
    **o,
    'share_under_matmuls': o['bytes_under_matmuls'] / max(o['bytes'], 1),
    'comm_seconds_lower_bound': record['comm_seconds_lower_bound'],
    'compute_seconds_at_peak': record['compute_seconds_at_peak'],
    'versions': record['made']['versions'],
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--models', default=','.join(MODELS))
  parser.add_argument('--topologies', default='h100-8,h100-16')
  args = parser.parse_args()
  out = json.load(open(OUT, encoding='utf-8')) if os.path.exists(OUT) else {}
  out.update(
    made={
      'by': 'python benchmarks/gpu_overlap.py ' + ' '.join(sys.argv[1:]),
      'date': datetime.date.today().isoformat(),
    },
    estimate='the GPU compiler schedule on a CPU machine (no GPU), not a timing',
    candidates_mib=list(CANDIDATES_MIB),
  )
  for model in args.models.split(','):
    for topology in args.topologies.split(','):
      rows = {}
      for mib in CANDIDATES_MIB:
        rows[f'{mib}_mib'] = r = compile_overlap(MODELS[model], topology, xla_flags(mib))
        print(
          f'{model} {topology} {mib} MiB: {r["async_collectives"]} async collectives, '
          f'{r["bytes"] / 2**20:,.0f} MiB, {r["share_under_matmuls"]:.0%} under matmuls',
          flush=True,
        )
      out.setdefault(model, {})[topology] = rows
      with open(OUT, 'w', encoding='utf-8') as f:
        json.dump(out, f, indent=1)
  print('wrote', OUT)


if __name__ == '__main__':
  main()
