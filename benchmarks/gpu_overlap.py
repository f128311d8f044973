r"""How much of a multi-GPU step's gradient traffic the compiled schedule runs under matmuls,
with the project's XLA options (core/hardware.MULTI_GPU_COMPILER_OPTIONS) and with XLA's own
combine thresholds, for ViT-B/16's ImageNet-21k step on one and two boxes of 8 H100s.

  python benchmarks/gpu_overlap.py [--topologies=h100-8,h100-16] [--depth=12]

Each run is `python -m vit_jax.compile --json`; its `overlap` field counts the asynchronous
collectives of the scheduled program and the bytes of those with a cuBLAS/cuDNN kernel between
their start and done (bench/gpu_record.overlap). The figures are the GPU compiler's schedule on
a CPU machine, not a timing: whether the transfer is hidden on a card also depends on it
taking less time than the matmuls beside it. Writes benchmarks/gpu/overlap_vit_b16.json.
"""

import argparse
import datetime
import json
import os
import sys

import step_cost  # benchmarks/step_cost.py: the compile command's record

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, 'benchmarks', 'gpu', 'overlap_vit_b16.json')
# XLA's defaults for what MULTI_GPU_COMPILER_OPTIONS sets (XLA_FLAGS wins over the project's).
XLA_DEFAULTS = (
  '--xla_gpu_all_reduce_combine_threshold_bytes=31457280 '
  '--xla_gpu_all_gather_combine_threshold_bytes=31457280 '
  '--xla_gpu_reduce_scatter_combine_threshold_bytes=31457280'
)


def compile_overlap(topology: str, depth: int, xla_flags: str) -> dict:
  args = [
    '--config=configs/vit_b16.py:imagenet21k',
    f'--topology={topology}',
    f'--config.depth={depth}',
  ]
  env = dict(os.environ, XLA_FLAGS=f'{os.environ.get("XLA_FLAGS", "")} {xla_flags}'.strip())
  record = step_cost.compile_record(args, env=env)
  o = record['overlap']
  return {
    'command': ' '.join(['python -m vit_jax.compile', *args]),
    'xla_flags': xla_flags,
    **o,
    'share_under_matmuls': o['bytes_under_matmuls'] / max(o['bytes'], 1),
    'comm_seconds_lower_bound': record['comm_seconds_lower_bound'],
    'compute_seconds_at_peak': record['compute_seconds_at_peak'],
    'versions': record['made']['versions'],
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--topologies', default='h100-8,h100-16')
  parser.add_argument('--depth', type=int, default=12)
  args = parser.parse_args()
  out = {
    'made': {
      'by': 'python benchmarks/gpu_overlap.py ' + ' '.join(sys.argv[1:]),
      'date': datetime.date.today().isoformat(),
    },
    'estimate': 'the GPU compiler schedule on a CPU machine (no GPU), not a timing',
  }
  for topology in args.topologies.split(','):
    out[topology] = {
      'xla_defaults': compile_overlap(topology, args.depth, XLA_DEFAULTS),
      'project_options': compile_overlap(topology, args.depth, ''),
    }
    for name, r in out[topology].items():
      print(
        f'{topology} {name}: {r["async_collectives"]} async collectives, '
        f'{r["bytes"] / 2**20:,.0f} MiB, {r["share_under_matmuls"]:.0%} under matmuls'
      )
  with open(OUT, 'w', encoding='utf-8') as f:
    json.dump(out, f, indent=1)
  print('wrote', OUT)


if __name__ == '__main__':
  main()
