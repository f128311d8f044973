"""A run's train step compiled ahead of time for a TPU slice: memory, FLOPs, time, collectives, cost.

`compile_run` builds the program the trainer runs (`training.program.build`:
the same steps, mesh, shardings, batch shapes and donation) on the devices of
a TPU slice described by libtpu, and has the real TPU compiler compile it on
this machine. `analyse` reads what the compiler reports. Everything here is
the compiler's estimate, not a measurement: `optimal_seconds` is its lower
bound on a step's time, so img/s and MFU derived from it are upper bounds.
The same `compile_run` compiles for NVIDIA GPUs (`gpus.Cluster`) with the GPU
compiler; their record is `gpu_record.analyse`.
"""

import dataclasses
import math
import re
import time
from typing import Optional

import jax

from vit_jax.bench import flops as flops_lib
from vit_jax.bench import gpus
from vit_jax.bench import hlo
from vit_jax.bench import topology
from vit_jax.core import hardware
from vit_jax.data import pipeline
from vit_jax.data import presets
from vit_jax.training import program

GiB = 2**30
# Classes of datasets the compile command knows without reading them.
_KNOWN_CLASSES = {'imagenet21k': (21_843, False), 'jft': (18_291, True)}


class DoesNotFit(Exception):
  """The compiler ran out of device memory; `needed` and `available` in bytes when it said."""

  def __init__(self, message: str, needed: Optional[float], available: Optional[float]):
    super().__init__(message)
    self.needed, self.available = needed, available


@dataclasses.dataclass
class Compiled:
  config: object
  tpu: topology.Slice  # or gpus.Cluster
  program: program.Program
  train: object  # the compiled train step
  eval: object  # the compiled eval step
  compile_seconds: float
  # The step's time estimate when the compiler gives none for the accumulation
  # loop or the scanned blocks: a one-micro-batch step's estimate (scanned:
  # extrapolated in depth), times the number of micro-batches.
  micro_step_seconds: Optional[float] = None
  micro_step_flops: Optional[float] = None  # scanned models: extrapolated in depth


def dataset_classes(config) -> tuple:
  """(num_classes, multi_label) of `config.dataset`, read from data only as a last resort.

  The paper's JFT recipe leaves the dataset to the user (a placeholder): it is
  taken as JFT-300M, 18,291 classes, multi-label.
  """
  name = config.dataset
  if name is None or name == 'jft':
    return _KNOWN_CLASSES['jft']
  if name in _KNOWN_CLASSES:
    return _KNOWN_CLASSES[name]
  if name in presets.BUILTIN:
    return 10, False
  preset = presets.PRESETS.get(name)
  if preset is not None and preset.num_classes:
    return preset.num_classes, preset.multi_label
  info = pipeline.get_info(config)
  return info.num_classes, info.multi_label


def _memory_numbers(text: str):
  """(needed, available) bytes from the compiler's out-of-memory message, when it gives them."""
  units = {'K': 2**10, 'M': 2**20, 'G': 2**30, 'T': 2**40}

  def value(number, unit):
    return float(number) * units.get(unit, 1)

  used = re.search(r'Used ([\d.]+)([KMGT])? of ([\d.]+)([KMGT])? hbm', text)
  if used:
    return value(*used.group(1, 2)), value(*used.group(3, 4))
  temps = re.search(r'\(([\d.]+)([KMGT])\) exceeds? available HBM \(([\d.]+)([KMGT])\)', text)
  if temps:
    return value(*temps.group(1, 2)), value(*temps.group(3, 4))
  return None, None


def compile_run(config, tpu) -> Compiled:
  """The trainer's train and eval steps for `config`, compiled for `tpu`; DoesNotFit if too big.

  `tpu` is a TPU slice (`topology.Slice`) or GPUs (`gpus.Cluster`). The TPU
  compiler itself refuses a program that does not fit; a GPU program is
  measured against the memory JAX's allocator gets on the card.
  """
  mesh = program.make_mesh(config, devices=tpu.devices)
  spec = program.validate(config, mesh.size)
  num_classes, multi_label = dataset_classes(config)
  on_gpu = isinstance(tpu, gpus.Cluster)
  options = gpus.COMPILER_OPTIONS if on_gpu else None
  start = time.perf_counter()
  with jax.set_mesh(mesh):
    built = program.build(config, mesh, num_classes, multi_label, spec)
    try:
      train = built.train_step.lower(built.abstract_state(), built.abstract_batch())
      train = train.compile(compiler_options=options)
      params = built.abstract_state().params
      evaluate = built.eval_step.lower(params, built.abstract_batch(train=False))
      evaluate = evaluate.compile(compiler_options=options)
    except jax.errors.JaxRuntimeError as e:
      if not hardware.is_out_of_memory(e):
        raise
      needed, available = _memory_numbers(str(e))
      raise DoesNotFit(str(e).strip().splitlines()[0], needed, available) from None
  seconds = time.perf_counter() - start
  if on_gpu:
    _check_gpu_memory(tpu, train, evaluate)
    return Compiled(config, tpu, built, train, evaluate, seconds)
  micro = None
  if config.scan_layers:
    layers = spec.architecture.num_layers
    micro = _depth_extrapolation(config, layers, mesh, num_classes, multi_label)
  elif config.accum_steps > 1 and _cost(train).get('optimal_seconds', -1.0) <= 0:
    one = with_overrides(config, {'batch': config.batch // config.accum_steps, 'accum_steps': 1})
    cost = _cost(_compile_train(one, mesh, num_classes, multi_label))
    if cost.get('optimal_seconds', -1.0) > 0:
      micro = (cost['optimal_seconds'], None)
  return Compiled(
    config,
    tpu,
    built,
    train,
    evaluate,
    seconds,
    micro[0] if micro else None,
    micro[1] if micro else None,
  )


def _check_gpu_memory(cluster, *steps_compiled) -> None:
  """DoesNotFit when a step needs more than JAX's allocator gets on the card."""
  needed = max(memory(c)['total_bytes'] for c in steps_compiled)
  available = cluster.gpu.usable_bytes
  if needed > available:
    raise DoesNotFit(f'needs {needed} bytes per GPU of {available}', needed, available)


def _compile_train(config, mesh, num_classes, multi_label):
  with jax.set_mesh(mesh):
    built = program.build(config, mesh, num_classes, multi_label)
    return built.train_step.lower(built.abstract_state(), built.abstract_batch()).compile()


def _depth_extrapolation(config, layers, mesh, num_classes, multi_label):
  """(seconds, FLOPs) of one micro-batch step of a scanned model of `layers` blocks, from
  unrolled depths 1 and 2.

  The compiler estimates no time for a loop and counts a loop body's FLOPs
  once, and the blocks of a scanned model are one loop. Its blocks are
  identical, so the unrolled program's figures grow linearly in depth: the
  depth-1 step plus (depth - 1) times the second block's increment.
  """
  figures = []
  for depth in (1, 2):
    overrides = {
      'batch': config.batch // config.accum_steps,
      'accum_steps': 1,
      'scan_layers': False,
      'depth': depth,
    }
    cost = _cost(_compile_train(with_overrides(config, overrides), mesh, num_classes, multi_label))
    figures.append((float(cost.get('optimal_seconds', -1.0)), float(cost.get('flops', 0.0))))
  (s1, f1), (s2, f2) = figures
  seconds = s1 + (layers - 1) * (s2 - s1) if s1 > 0 and s2 > 0 else None
  return seconds, f1 + (layers - 1) * (f2 - f1)


def _cost(compiled_step) -> dict:
  cost = compiled_step.cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else {}
  return cost or {}


def memory(compiled_step) -> dict:
  """What XLA reports of a compiled step's memory per device, and the total it implies."""
  m = compiled_step.memory_analysis()
  out = {
    'argument_bytes': int(m.argument_size_in_bytes),
    'output_bytes': int(m.output_size_in_bytes),
    'alias_bytes': int(m.alias_size_in_bytes),
    'temp_bytes': int(m.temp_size_in_bytes),
    'code_bytes': int(m.generated_code_size_in_bytes),
  }
  # Donated state: outputs that alias arguments take no memory of their own.
  out['total_bytes'] = (
    out['argument_bytes']
    + out['output_bytes']
    - out['alias_bytes']
    + out['temp_bytes']
    + out['code_bytes']
  )
  return out


def _step_estimates(c: Compiled) -> tuple:
  """(FLOPs, seconds or None) of one optimizer step per device, from the compiler's cost."""
  cost = _cost(c.train)
  trips = c.config.accum_steps
  if c.micro_step_flops:
    step_flops = c.micro_step_flops * trips
  else:
    # XLA counts a loop body once: scale by the accumulation loop's trip count
    # (the optimizer update outside the loop is then counted `trips` times, a
    # fraction of a percent of a ViT step).
    step_flops = float(cost.get('flops', 0.0)) * trips
  seconds = float(cost.get('optimal_seconds', -1.0))
  if c.micro_step_seconds:
    seconds = c.micro_step_seconds * trips
  elif seconds <= 0:
    seconds = None
  elif trips > 1:
    seconds = seconds * trips
  return step_flops, seconds


def _cross_slice(text: str) -> dict:
  """Multi-slice: what crosses the data-centre network (DCN) between slices."""
  transfers = hlo.cross_slice_transfers(text)
  return {
    'transfers': transfers,
    'bytes_per_step': sum(r['bytes'] for r in transfers),
    'kinds': sorted({f'{r["kind"]} {r["reduction"] or ""}'.strip() for r in transfers}),
  }


def _what_was_compiled(c: Compiled) -> dict:
  """The topology, mesh and config fields of a compiled config's record."""
  config, tpu = c.config, c.tpu
  return {
    'topology': tpu.name,
    'topology_shape': tpu.topology,
    'num_slices': tpu.num_slices,
    'chips': tpu.num_chips,
    'devices': len(tpu.devices),
    'mesh': dict(c.program.batch_sharding.mesh.shape),
    'model': config.model,
    'batch': config.batch,
    'accum_steps': config.accum_steps,
    'remat': bool(config.remat),
    'remat_policy': config.remat_policy if config.remat else None,
    'scan_layers': bool(config.scan_layers),
    'dtype': config.dtype,
    'image_size': config.pp.crop,
    'num_classes': c.program.num_classes,
  }


def analyse(c: Compiled) -> dict:
  """The record of one compiled config: memory, FLOPs, time, collectives, cost."""
  config, tpu, chip = c.config, c.tpu, c.tpu.chip
  devices = len(tpu.devices)
  text = c.train.as_text()
  step_flops, seconds = _step_estimates(c)
  arch = c.program.spec.architecture
  per_image = flops_lib.run_flops_per_image(config, arch, c.program.num_classes)
  model_flops = per_image * config.batch / devices if per_image else None
  train_memory, eval_memory = memory(c.train), memory(c.eval)
  hbm = max(train_memory['total_bytes'], eval_memory['total_bytes'])
  peak = chip.peak_flops_per_device
  collectives = hlo.collectives(text)
  moved = sum(r['moved_bytes'] for r in collectives)
  bandwidth = (
    chip.allreduce_bytes_per_s / chip.devices_per_chip if chip.allreduce_bytes_per_s else None
  )
  comm_seconds = moved / bandwidth if bandwidth else None
  bound = max([s for s in (seconds, comm_seconds) if s] or [0.0]) or None
  record = {
    **_what_was_compiled(c),
    'fits': hbm <= chip.hbm_per_device,
    'hbm_bytes_per_device': hbm,
    'hbm_capacity_bytes': chip.hbm_per_device,
    'train_memory': train_memory,
    'eval_memory': eval_memory,
    'flops_per_step_per_device': step_flops,
    'closed_form_flops_per_step_per_device': model_flops,
    'flops_vs_closed_form': step_flops / model_flops if model_flops else None,
    'accumulation_loop_trips': config.accum_steps,
    'step_seconds_estimate': seconds,
    'img_per_sec_estimate': config.batch / seconds if seconds else None,
    'mfu_upper_bound': model_flops / (seconds * peak) if seconds and model_flops else None,
    'peak_flops_per_device': peak,
    'collectives': collectives,
    'collective_bytes_per_step_per_device': moved,
    'comm_seconds_lower_bound': comm_seconds,
    'matmul_dtypes': hlo.matmul_dtypes(text),
    'time_by_op': hlo.time_by_op(text),
    'total_steps': config.total_steps,
    'compile_seconds': c.compile_seconds,
    'estimate': 'TPU compiler estimates on a CPU machine (libtpu), not measurements; '
    'step time is a lower bound, img/s and MFU upper bounds',
  }
  if tpu.num_slices > 1:
    record['cross_slice'] = _cross_slice(text)
  if bound:
    days = config.total_steps * bound / 86400
    record['chip_days'] = days * tpu.num_chips
    record['core_days'] = days * tpu.cores
  return record


def fit_message(error: DoesNotFit, config, tpu) -> str:
  """One line: by how much it does not fit, and what to try."""
  amount = ''
  if error.needed and error.available:
    amount = (
      f' (needs {error.needed / GiB:.2f} GiB per device, has {error.available / GiB:.2f} GiB)'
    )
  tries = [f'--config.accum_steps={2 * config.accum_steps}', '--config.remat=True']
  if config.get('task') == 'dino':  # its losses take the whole batch at once
    tries = tries[1:]
  if len(tpu.devices) >= 2 * config.mesh.fsdp:  # FSDP needs devices to shard over
    tries.append(f'--config.mesh.fsdp={2 * config.mesh.fsdp}')
  return (
    f'{config.model} at batch {config.batch} does not fit {tpu.name}{amount}; run with --fit, '
    f'or try {", ".join(tries[:-1])} or {tries[-1]}'
  )


def candidates(config, devices: int, error: Optional[DoesNotFit] = None):
  """Overrides to try, smallest change first: accumulation, remat, FSDP, then combinations.

  With the compiler's figures, accumulation starts at the factor that would
  bring the temporaries under the capacity.
  """
  micro_limit = config.batch // devices  # examples per device and micro-batch
  first = 2
  if error and error.needed and error.available:
    first = 2 ** max(1, math.ceil(math.log2(error.needed / error.available)))
  accums = [a for a in (2**k for k in range(1, 12)) if a >= first and a <= micro_limit]
  accums = [
    a * config.accum_steps for a in accums if config.batch % (a * config.accum_steps * devices) == 0
  ]
  if config.get('task') == 'dino':  # self-distillation's losses take the whole batch at once
    accums = []
  fsdps = [
    f
    for f in (2**k for k in range(1, 12))
    if f * config.mesh.fsdp <= devices and devices % (f * config.mesh.fsdp) == 0
  ]
  out = [{'accum_steps': a} for a in accums[:2]]
  if not config.remat:
    out.append({'remat': True})
  out += [{'mesh.fsdp': f * config.mesh.fsdp} for f in fsdps[:2]]
  if not config.remat:
    out += [{'remat': True, 'accum_steps': a} for a in accums[:3]]
  out += [
    {'accum_steps': a, 'mesh.fsdp': fsdps[-1] * config.mesh.fsdp} for a in accums[:2] if fsdps
  ]
  return out


def with_overrides(config, overrides: dict):
  config = config.copy_and_resolve_references()
  for key, value in overrides.items():
    target = config
    *parents, last = key.split('.')
    for part in parents:
      target = target[part]
    target[last] = value
  return config
