"""Memory of a benchmarked step, and the largest batch per device that fits.

On an accelerator the search is real: each candidate batch is compiled and
run, and running out of memory means it does not fit. On a CPU nothing runs
out, so the search compares XLA's own estimate of the compiled step
(arguments + outputs + temporaries - donated buffers) with a budget, e.g. the
80 GB of an H100: a CPU-compiled estimate, not a GPU measurement (GPU
kernels, fusions and workspaces differ). XLA:CPU does not realise the savings
of `--remat` (ViT-B/16, batch 32: 7.08 GiB of temporaries with and without),
so on a CPU the estimate is that of a step without remat, an upper bound.
"""

import dataclasses
import datetime
import gc

import jax

from vit_jax.core import hardware


def estimate_bytes(compiled) -> int:
  """XLA's peak estimate for one call of `compiled`."""
  m = compiled.memory_analysis()
  return int(
    m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
  )


def compiled_memory(compiled) -> dict:
  """The step's memory: the device's measured peak where it has one, else XLA's estimate."""
  out = {'memory_estimate_bytes': estimate_bytes(compiled)}
  stats = jax.devices()[0].memory_stats() or {}
  if 'peak_bytes_in_use' in stats:
    # The process's peak: the step's, unless the peak matmul probe was larger.
    out.update(memory_bytes=int(stats['peak_bytes_in_use']), memory_source='device peak (process)')
  else:
    out.update(memory_bytes=out['memory_estimate_bytes'], memory_source='XLA estimate')
  return out


def _largest(fits, guess: int, limit: int) -> int:
  """The largest b in [1, limit] with fits(b), assuming fits is monotone; 0 if none.

  Gallops from `guess` (1, 2, 4, ... away) to bracket the answer, then bisects,
  so a good guess costs two or three probes.
  """
  guess = min(max(guess, 1), limit)
  if fits(guess):
    lo, step = guess, 1
    while lo < limit:
      b = min(lo + step, limit)
      if not fits(b):
        hi = b
        break
      lo, step = b, step * 2
    else:
      return lo
  else:
    hi, step = guess, 1
    while True:
      b = hi - step
      if b < 1:
        lo = 0
        break
      if fits(b):
        lo = b
        break
      hi, step = b, step * 2
  while hi - lo > 1:
    mid = (lo + hi) // 2
    if fits(mid):
      lo = mid
    else:
      hi = mid
  return lo


def find_max_batch(
  opts, build_step, make_runner, budget_bytes: float, limit: int = 1 << 14
) -> dict:
  """The largest micro-batch per device of `opts` (global batch = it x accum_steps).

  `build_step(opts, abstract=...)` -> (jitted fn, args) and `make_runner(compiled,
  args, mode)` -> a function running one synchronised step (`vit_jax.benchmark`).
  """
  real = jax.default_backend() != 'cpu'
  probes = []

  def options(micro):
    return dataclasses.replace(opts, batch=micro * opts.accum_steps)

  def estimate(micro):
    fn, args = build_step(options(micro), abstract=True)
    return estimate_bytes(fn.lower(*args).compile())

  def fits(micro):
    if not real:
      used = estimate(micro)
      probes.append({'micro_batch': micro, 'estimate_bytes': used})
      return used <= budget_bytes
    try:
      fn, args = build_step(options(micro))
      runner = make_runner(fn.lower(*args).compile(), args, opts.mode)
      runner()
      runner()
      ok = True
    except jax.errors.JaxRuntimeError as e:
      if not hardware.is_out_of_memory(e):
        raise
      ok = False
    finally:
      fn = args = runner = None
      gc.collect()
      jax.clear_caches()
    probes.append({'micro_batch': micro, 'fits': ok})
    return ok

  # Memory is close to linear in the batch: two estimates give the first guess.
  small, large = estimate(4), estimate(8)
  per_image = max((large - small) / 4, 1.0)
  available = _device_bytes(budget_bytes) if real else budget_bytes
  guess = 4 + int((available - small) / per_image)
  micro = _largest(fits, guess, limit)
  return {
    'benchmark': 'vit_jax.benchmark --find_max_batch',
    'time_utc': datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds'),
    'options': dataclasses.asdict(opts),
    'machine': hardware.machine_info(),
    'method': 'compiled and run on the device' if real else 'XLA CPU-compiled estimate',
    'budget_bytes': None if real else budget_bytes,
    'max_micro_batch': micro,
    'max_batch': micro * opts.accum_steps,
    'estimate_bytes_per_image': per_image,
    'probes': probes,
  }


def _device_bytes(default: float) -> float:
  stats = jax.devices()[0].memory_stats() or {}
  return float(stats.get('bytes_limit', default))


def describe(record: dict) -> str:
  o = record['options']
  line = (
    f'{o["model"]} {o["mode"]} at {o["resolution"]} px, {o["dtype"]}, remat={o["remat"]}, '
    f'{o["optimizer"]}: largest batch per device {record["max_micro_batch"]}'
  )
  if o['accum_steps'] > 1:
    line += f' (x {o["accum_steps"]} accumulation steps = {record["max_batch"]})'
  if record['budget_bytes']:
    line += f' within {record["budget_bytes"] / 2**30:.1f} GiB'
  method = record['method']
  if o['remat'] and record['budget_bytes']:
    method += '; XLA:CPU ignores remat, so this is the estimate without it'
  return f'{line} [{method}]'
