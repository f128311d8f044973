"""The record of a run compiled for NVIDIA GPUs: memory, attention kernel, collectives, a roofline bound.

The GPU compiler reports memory (`memory_analysis`) but no FLOPs and no time
(`cost_analysis()` is None on GPU). So FLOPs come from the closed form
(`bench.flops`), and the step time is a roofline **lower bound**: the FLOPs at
the card's dense peak, or the collectives' bytes at NVLink and InfiniBand
bandwidth, whichever is longer. Nothing here is a measurement.

What the program launches is read from it too (`kernel_counts`, per encoder
block `step_kernels`; benchmarks/gpu_hlo.py records them): its
kernels, the bytes they write, pads, convolutions, parameter casts.

Collectives are read from the compiled program and placed on the links they
use: a replica group within one box moves over NVLink; one spanning boxes
crosses InfiniBand (NCCL's network transport). The traffic per GPU assumes the
hierarchical algorithm, the least any algorithm must send: within each box a
ring over its g GPUs, and between b boxes a ring over each GPU's 1/g share,
one NIC per GPU (NVIDIA's DGX/HGX boxes have 8).
"""

import dataclasses

import jax

from vit_jax.bench import aot
from vit_jax.bench import flops as flops_lib
from vit_jax.bench import gpus
from vit_jax.bench import hlo
from vit_jax.bench import memory
from vit_jax.bench import speed
from vit_jax.configs.model_spec import ModelSpec
from vit_jax.core import sharding


def place_collectives(text: str, mesh_devices) -> list:
  """Collectives per (op, group size, boxes spanned): bytes over NVLink and between boxes, per GPU.

  `mesh_devices` are the program's devices in mesh order (what replica groups
  number); a device's box is its process (one process per box).
  """
  rows = {}
  for c in hlo.collective_instructions(text):
    groups = c['groups'] or [list(range(len(mesh_devices)))]
    boxes = max(len({mesh_devices[i].process_index for i in group}) for group in groups)
    n = c['group_size']
    per_box = max(n // boxes, 1)
    if boxes > 1:
      nvlink = hlo.ring_factor(c['op'], per_box) * c['bytes']
      network = hlo.ring_factor(c['op'], boxes) * c['bytes'] / per_box
    else:
      nvlink, network = hlo.ring_factor(c['op'], n) * c['bytes'], 0.0
    key = (c['op'], n, boxes)
    row = rows.setdefault(
      key,
      {
        'op': c['op'],
        'group_size': n,
        'boxes': boxes,
        'link': 'InfiniBand' if boxes > 1 else 'NVLink',
        'count': 0,
        'bytes': 0,
        'nvlink_bytes': 0.0,
        'network_bytes': 0.0,
      },
    )
    row['count'] += c['count']
    row['bytes'] += c['bytes']
    row['nvlink_bytes'] += nvlink
    row['network_bytes'] += network
  return sorted(rows.values(), key=lambda r: (r['op'], r['group_size'], r['boxes']))


def attention_kernel(text: str) -> dict:
  """Which attention the program runs: cuDNN's fused kernels (with their counts) or XLA's ops."""
  fused = {k: v for k, v in hlo.custom_calls(text).items() if 'fmha' in k}
  name = 'cuDNN fused attention' if fused else 'XLA (attention written out as matmuls)'
  return {'kernel': name, 'custom_calls': fused}


def roofline(flops: float, collectives: list, gpu: gpus.Gpu, dtype: str) -> dict:
  """Lower bounds on a step's time: compute at peak, NVLink and network traffic at bandwidth."""
  peak = gpu.peak_flops(dtype)
  nvlink = sum(r['nvlink_bytes'] for r in collectives)
  network = sum(r['network_bytes'] for r in collectives)
  compute_s = flops / peak if flops else None
  comm_s = max(nvlink / gpu.nvlink_bytes_per_s, network / gpu.network_bytes_per_s)
  bound = max(compute_s or 0.0, comm_s) or None
  return {
    'peak_flops_per_device': peak,
    'compute_seconds_at_peak': compute_s,
    'nvlink_bytes_per_step_per_device': nvlink,
    'network_bytes_per_step_per_device': network,
    'comm_seconds_lower_bound': comm_s,
    'step_seconds_lower_bound': bound,
    # The share of the step left to compute if nothing overlapped with it.
    'mfu_if_not_overlapped': compute_s / (compute_s + comm_s) if compute_s else None,
  }


def overlap(text: str) -> dict:
  """How much of the step's collective traffic the schedule runs under matmuls (`hlo.
  async_collectives`): all of it is hidden on the card only if the matmuls take longer."""
  pairs = hlo.async_collectives(text)
  return {
    'async_collectives': len(pairs),
    'bytes': sum(p['bytes'] for p in pairs),
    'bytes_under_matmuls': sum(p['bytes'] for p in pairs if p['matmuls_between']),
  }


def analyse(c: aot.Compiled) -> dict:
  """The record of one config compiled for GPUs (`aot.compile_run` on a `gpus.Cluster`)."""
  config, cluster = c.config, c.tpu
  gpu, devices = cluster.gpu, len(cluster.devices)
  text = c.train.as_text()
  mesh = c.program.batch_sharding.mesh
  collectives = place_collectives(text, list(mesh.devices.flat))
  arch = c.program.spec.architecture
  per_image = flops_lib.run_flops_per_image(config, arch, c.program.num_classes)
  flops = per_image * config.batch / devices if per_image else None
  train_memory, eval_memory = aot.memory(c.train), aot.memory(c.eval)
  needed = max(train_memory['total_bytes'], eval_memory['total_bytes'])
  bounds = roofline(flops, collectives, gpu, config.dtype)
  seconds = bounds['step_seconds_lower_bound']
  record = {
    'topology': cluster.name,
    'topology_shape': cluster.topology,
    'gpu': gpu.product,
    'boxes': cluster.boxes,
    'gpus_per_box': cluster.gpus_per_box,
    'devices': devices,
    'mesh': dict(mesh.shape),
    'model': config.model,
    'batch': config.batch,
    'accum_steps': config.accum_steps,
    'remat': bool(config.remat),
    'remat_policy': config.remat_policy if config.remat else None,
    'scan_layers': bool(config.scan_layers),
    'dtype': config.dtype,
    'image_size': config.pp.crop,
    'num_classes': c.program.num_classes,
    'fits': needed <= gpu.usable_bytes,
    'hbm_bytes_per_device': needed,
    'hbm_capacity_bytes': gpu.memory_bytes,
    'usable_bytes': gpu.usable_bytes,
    'memory_fraction': gpus.MEMORY_FRACTION,
    'train_memory': train_memory,
    'eval_memory': eval_memory,
    'attention': attention_kernel(text),
    'closed_form_flops_per_step_per_device': flops,
    **bounds,
    'img_per_sec_upper_bound': config.batch / seconds if seconds else None,
    'collectives': collectives,
    'overlap': overlap(text),
    'matmul_dtypes': hlo.matmul_dtypes(text),
    'total_steps': config.total_steps,
    'gpu_hours_lower_bound': config.total_steps * seconds * devices / 3600 if seconds else None,
    'compile_seconds': c.compile_seconds,
    'compiler_options': gpus.COMPILER_OPTIONS,
    'estimate': 'GPU compiler (XLA, jax[cuda12]) on a CPU machine, kernels chosen without '
    'autotuning; memory is its estimate, the step time a roofline lower bound (closed-form '
    'FLOPs at the dense peak, collectives at NVLink/InfiniBand bandwidth), img/s an upper '
    'bound; not measurements',
  }
  return record


def kernel_counts(text: str) -> dict:
  """What a compiled GPU program launches per call: its kernels by name
  (`hlo.kernels`) and the bytes they write, the convolutions (XLA's or cuDNN's), the `pad`s
  inside any kernel by shape (`hlo.pads`), the
  arguments cast to a narrower float type in the program (`hlo.parameter_converts`; the
  parameters among them are named `...params[...]`), and cuBLASLt's fused epilogues."""
  kernels, ops = hlo.kernels(text), hlo.op_counts(text)
  casts = hlo.parameter_converts(text)
  transposes = hlo.fp8_transposes(text)
  return {
    'kernels': sum(kernels.values()),
    'bytes_written': hlo.kernel_bytes(text),
    # What the kernels between the matmuls and the attention write: norms, elementwise work,
    # reductions, layout copies, the optimizer (`hlo.kernel_kind` 'other').
    'other_kernels': sum(n for name, n in kernels.items() if hlo.kernel_kind(name) == 'other'),
    'other_bytes_written': hlo.kernel_bytes(text, kinds=('other',)),
    'fp8_gemms': sum(n for name, n in kernels.items() if name.startswith('__cublas$lt$matmul$f8')),
    'fp8_transposes': transposes['fp8']['count'],
    'fp8_transposed_bytes': transposes['fp8']['bytes'],
    'cast_transposes': transposes['cast']['count'],
    'cast_transposed_bytes': transposes['cast']['bytes'],
    'by_name': dict(sorted(kernels.items())),
    'convolutions': ops.get('convolution', 0)
    + sum(n for name, n in kernels.items() if name.startswith('__cudnn$conv')),
    'pads': hlo.pads(text),
    'parameter_casts': sum(n for name, n in casts.items() if 'params[' in name),
    'other_argument_casts': sorted(name for name in casts if 'params[' not in name),
    'cublaslt_epilogues': {
      name.split(':', 1)[1]: n
      for name, n in sorted(kernels.items())
      if name.startswith('__cublas$lt')
    },
  }


def compile_benchmark_step(opts, device, options=None):
  """The step `python -m vit_jax.benchmark` times for `opts` (`bench.speed.Options`), compiled for
  `device`, a GPU this machine may lack (`gpus.describe(...).devices[0]`), with the compiler
  options of a compile without the card (`gpus.COMPILER_OPTIONS`) and `options` over them."""
  with jax.set_mesh(sharding.make_mesh(devices=[device])):
    fn, args = speed.build_step(opts, abstract=True, device=device)
    return fn.lower(*args).compile(compiler_options={**gpus.COMPILER_OPTIONS, **(options or {})})


def step_kernels(opts, device, options=None) -> dict:
  """`kernel_counts` of the benchmark's step for `opts` on `device`, of its whole program and
  per encoder block (the whole program less its one-block copy, over the other blocks), and
  the compiler's estimate of its memory (`bench.memory.estimate_bytes`, what the benchmark's
  record on the card calls `memory_estimate_bytes`)."""
  depth = opts.depth or ModelSpec.of(speed.train_config(opts)).architecture.num_layers
  whole = compile_benchmark_step(dataclasses.replace(opts, depth=depth), device, options)
  one = compile_benchmark_step(dataclasses.replace(opts, depth=1), device, options)
  counts, first = kernel_counts(whole.as_text()), kernel_counts(one.as_text())
  names = sorted(set(counts['by_name']) | set(first['by_name']))
  per_block = {n: counts['by_name'].get(n, 0) - first['by_name'].get(n, 0) for n in names}
  blocks = max(depth - 1, 1)
  totals = ('kernels', 'bytes_written', 'other_kernels', 'other_bytes_written', 'fp8_gemms',
            'fp8_transposes', 'fp8_transposed_bytes', 'cast_transposes', 'cast_transposed_bytes')  # fmt: skip
  return {
    'depth': depth,
    **counts,
    **{f'{key}_per_block': (counts[key] - first[key]) / blocks for key in totals},
    'per_block_by_name': {n: v / blocks for n, v in per_block.items() if v},
    'memory_estimate_bytes': memory.estimate_bytes(whole),
  }


def launch_command(cluster: gpus.Cluster, argv, overrides: dict) -> str:
  """How to run what was compiled: launch/gpu_box.py for one box, launch/slurm.py for several.

  `argv` is the compile command's; its `--config` and `--config.FIELD=VALUE`
  carry over, with the fitting `overrides` in place of the same fields. Both
  scripts give JAX the memory share this record was measured against.
  """
  config = [a for a in argv if a.startswith('--config=')]
  keys = {f'--config.{k}' for k in overrides}
  given = [a for a in argv if a.startswith('--config.') and a.split('=', 1)[0] not in keys]
  extra = [*given, *(f'--config.{k}={v}' for k, v in overrides.items())]
  if cluster.boxes == 1:
    script = ['python', 'launch/gpu_box.py']
  else:
    script = ['python', 'launch/slurm.py', f'--nodes={cluster.boxes}']
    script.append(f'--gpus_per_node={cluster.gpus_per_box}')
  return ' '.join([*script, *config, '--workdir=DIR', *(['--', *extra] if extra else [])])


def describe(record: dict) -> str:
  """The record as the compile command prints it."""
  r, gib = record, lambda b: f'{b / 2**30:.2f} GiB'
  tm, attention = r['train_memory'], r['attention']
  mesh = ' '.join(f'{k}={v}' for k, v in r['mesh'].items())
  kernels = ', '.join(sorted(attention['custom_calls']))
  lines = [
    f'{r["model"]} on {r["topology"]} ({r["topology_shape"]}, {r["gpu"]}; mesh {mesh}): batch '
    f'{r["batch"]} (accum {r["accum_steps"]}{", remat" if r["remat"] else ""}), {r["dtype"]}, '
    f'{r["image_size"]} px',
    f'  memory per GPU   {gib(r["hbm_bytes_per_device"])} of {gib(r["usable_bytes"])} usable '
    f'({r["memory_fraction"]:.0%} of {gib(r["hbm_capacity_bytes"])}): arguments '
    f'{gib(tm["argument_bytes"])}, temporaries {gib(tm["temp_bytes"])}, aliased (donated) '
    f'{gib(tm["alias_bytes"])}',
    f'  attention        {attention["kernel"]}' + (f' ({kernels})' if kernels else ''),
  ]
  if r['closed_form_flops_per_step_per_device']:
    lines.append(
      f'  compute          {r["closed_form_flops_per_step_per_device"]:.4g} FLOPs per GPU and '
      f'step (closed form): >= {r["compute_seconds_at_peak"]:.4g} s at the '
      f'{r["peak_flops_per_device"] / 1e12:.0f} TFLOP/s dense peak'
    )
  for c in r['collectives']:
    lines.append(
      f'  {c["op"]:16s} x{c["count"]} over {c["group_size"]} GPUs in {c["boxes"]} box(es) '
      f'({c["link"]}): {c["bytes"] / 2**20:,.1f} MiB per step; per GPU '
      f'{c["nvlink_bytes"] / 2**20:,.1f} MiB over NVLink, {c["network_bytes"] / 2**20:,.1f} MiB '
      'between boxes'
    )
  lines.append(f'  communication    >= {r["comm_seconds_lower_bound"]:.4g} s per step')
  o = r.get('overlap')
  if o and o['async_collectives']:
    lines.append(
      f'  overlap          {o["bytes_under_matmuls"] / max(o["bytes"], 1):.0%} of the '
      f"{o['async_collectives']} asynchronous collectives' bytes scheduled under matmuls"
    )
  if r['step_seconds_lower_bound']:
    lines.append(
      f'  step time        >= {r["step_seconds_lower_bound"]:.4g} s (roofline); <= '
      f'{r["img_per_sec_upper_bound"]:,.0f} img/s; the run ({r["total_steps"]:,} steps) >= '
      f'{r["gpu_hours_lower_bound"]:,.0f} GPU-hours'
    )
  dtypes = ', '.join(f'{k}: {v}' for k, v in sorted(r['matmul_dtypes'].items()))
  lines.append(f'  matmuls          {dtypes}')
  lines.append('  (GPU compiler estimates and roofline bounds on a CPU machine, not measurements)')
  return '\n'.join(lines)
