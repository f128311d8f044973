"""Images per second of a ViT step, against timm and against the machine's peak.

`run` times the real train or inference step (`Options` says which) and, on
request, timm's in the same process; `record_path` and `summary` name and
print the record. `python -m vit_jax.benchmark` is the command line.
"""

import dataclasses
import datetime
import os
import re
import statistics
import sys
import time
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from vit_jax.bench import flops
from vit_jax.bench import memory
from vit_jax.bench import profile
from vit_jax.bench import timm_peer
from vit_jax.configs import common
from vit_jax.configs import model_spec
from vit_jax.configs.model_spec import ModelSpec
from vit_jax.core import hardware
from vit_jax.core import sharding
from vit_jax.core.errors import UserError
from vit_jax.models import fp8
from vit_jax.models import vit
from vit_jax.models.attention import ATTENTION
from vit_jax.training import program
from vit_jax.training import steps


@dataclasses.dataclass(frozen=True)
class Options:
  model: str = 'ViT-B_16'
  mode: str = 'infer'  # 'infer' or 'train'
  batch: int = 8
  resolution: int = 224
  dtype: str = 'float32'  # compute dtype: 'float32' or 'bfloat16'
  accum_steps: int = 1
  remat: bool = False
  optimizer: str = 'adam'  # 'adam' (pre-training) or 'sgd' (fine-tuning)
  optim_dtype: str = 'float32'  # Adam's first moment / SGD's momentum: 'float32' or 'bfloat16'
  attention: str = 'auto'  # see ATTENTION
  fp8: bool = False  # the encoder's dense layers as FP8 products (vit_jax.models.fp8)
  num_classes: int = 1000
  warmup: int = 2  # untimed steps per side
  steps: int = 3  # timed steps per side and repeat
  repeats: int = 3  # ours, timm, ours, timm, ...
  compare: Optional[str] = None  # 'timm'
  timm_compile: Optional[bool] = None  # default: on CUDA only
  threads: Optional[int] = None  # torch threads; default: the cores XLA uses
  profile: Optional[str] = None  # a directory: trace `steps` more steps of ours (bench.profile)
  depth: Optional[int] = None  # encoder blocks (default: the model's); kernels per block, gpu_hlo


class BenchmarkError(UserError, ValueError):
  """Options that cannot run; one line saying what to change."""


def validate(opts: Options) -> None:
  if opts.mode not in ('infer', 'train'):
    raise BenchmarkError(f"--mode={opts.mode}: use 'infer' or 'train'")
  for flag in ('dtype', 'optim_dtype'):
    if getattr(opts, flag) not in ('float32', 'bfloat16'):
      raise BenchmarkError(f"--{flag}={getattr(opts, flag)}: use 'float32' or 'bfloat16'")
  if opts.batch < 1 or opts.batch % opts.accum_steps:
    raise BenchmarkError(
      f'--batch={opts.batch} must be a positive multiple of --accum_steps={opts.accum_steps}'
    )
  if opts.accum_steps > 1 and opts.mode != 'train':
    raise BenchmarkError('--accum_steps applies to --mode=train only')
  if min(opts.steps, opts.repeats) < 1 or opts.warmup < 0:
    raise BenchmarkError('--steps and --repeats must be >= 1, --warmup >= 0')
  if opts.compare not in (None, 'timm'):
    raise BenchmarkError(f"--compare={opts.compare}: only 'timm' is supported")
  if opts.attention not in ATTENTION:
    raise BenchmarkError(f'--attention={opts.attention}: use one of {", ".join(ATTENTION)}')
  if opts.attention == 'cudnn' and (opts.dtype != 'bfloat16' or jax.default_backend() != 'gpu'):
    raise BenchmarkError("--attention=cudnn needs a CUDA GPU and --dtype=bfloat16; use 'auto'")
  if opts.compare == 'timm' and opts.optimizer != 'adam':
    # timm's step is Adam on the whole batch; accumulation and remat change only
    # how ours does the same work (remat: more of it), so those stay comparable.
    raise BenchmarkError(
      '--compare=timm times Adam in timm: drop --optimizer=sgd to compare like with like'
    )
  try:
    arch = model_spec.registered(opts.model)
  except KeyError as e:  # its message names close matches
    raise BenchmarkError(e.args[0]) from None
  patch = arch.patch_size[0]
  if arch.resnet is None and opts.resolution % patch:
    raise BenchmarkError(
      f'--resolution={opts.resolution} must be a multiple of the patch size {patch} of {opts.model}'
    )


def train_config(opts: Options):
  """The experiment config of a train step: common defaults, no dropout."""
  config = common.get_config()
  config.update(
    model=opts.model,
    dtype=opts.dtype,
    remat=opts.remat,
    attention=opts.attention,
    fp8=opts.fp8,
    batch=opts.batch,
    accum_steps=opts.accum_steps,
    optimizer=opts.optimizer,
    optim_dtype=opts.optim_dtype,
    total_steps=10**6,
    warmup_steps=1,
    dropout_rate=0.0,
    attention_dropout_rate=0.0,
    depth=opts.depth,
  )
  config.pp.crop = opts.resolution
  return config


def build_step(opts: Options, abstract: bool = False, device=None):
  """(jitted function, its arguments) for one step of `opts`.

  `abstract`: the arguments are shapes only (`jax.ShapeDtypeStruct`), enough to
  lower and compile without allocating parameters or optimizer state.
  `device`: where the step runs (default: this machine's first device); a GPU
  this machine lacks (`bench.gpus.describe`) with `abstract`, lowered under
  `jax.set_mesh` of it, gives the program the GPU would run (benchmarks/gpu_hlo.py).
  """
  device = device or jax.devices()[0]
  config = train_config(opts)
  spec = ModelSpec.of(config)
  model = steps.make_task(config, opts.num_classes, False, spec).model
  shape = (opts.batch, opts.resolution, opts.resolution, 3)
  # Training takes what the trainer passes (uint8 pixels, made [-1, 1] inside the step),
  # inference the model's own input, as timm's does.
  dtype = jnp.float32 if opts.mode == 'infer' else jnp.uint8
  if abstract:
    data = {
      'image': jax.ShapeDtypeStruct(shape, dtype),
      'label': jax.ShapeDtypeStruct((opts.batch,), jnp.int32),
    }
  else:
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, shape, dtype=np.uint8)
    data = {
      'image': pixels if dtype == jnp.uint8 else (pixels / 127.5 - 1).astype(np.float32),
      'label': rng.integers(0, opts.num_classes, opts.batch).astype(np.int32),
    }
  if opts.mode == 'infer':
    # Inference keeps its parameters in the compute dtype (vit.compute_params): no casts in the step.
    def init():
      params = model.init(jax.random.PRNGKey(0), jnp.zeros((1,) + shape[1:]), train=False)
      params = vit.compute_params(params['params'], opts.dtype)
      # FP8: the kernels rounded once, as `predict --fp8` loads them (fp8.quantise_params).
      return fp8.quantise_params(params, opts.dtype) if opts.fp8 else params

    on_device = jax.sharding.SingleDeviceSharding(device)
    init = jax.jit(init, out_shardings=on_device)
    fn = jax.jit(
      lambda params, images: model.apply({'params': params}, images, train=False),
      compiler_options=hardware.compiler_options([device]),
    )
    if abstract:
      struct = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=on_device)
      return fn, (jax.tree.map(struct, jax.eval_shape(init)), struct(data['image']))
    return fn, (init(), jax.device_put(data['image'], device))
  mesh = sharding.make_mesh(devices=[device])
  built = program.build(config, mesh, opts.num_classes, False, spec)
  if abstract:
    return built.train_step, (built.abstract_state(), data)
  state = jax.jit(built.init, out_shardings=built.state_shardings)(jax.random.PRNGKey(0))
  return built.train_step, (state, jax.device_put(data, built.batch_sharding))


def xla_flops_per_image(opts: Options) -> float:
  """Model FLOPs per image from XLA's cost analysis of the step as written.

  Counted on a one-micro-batch step without remat: XLA counts a loop body
  once, and recomputation is not model work.
  """
  micro = dataclasses.replace(
    opts, batch=opts.batch // opts.accum_steps, accum_steps=1, remat=False
  )
  fn, args = build_step(micro, abstract=True)
  analysis = fn.lower(*args).cost_analysis()
  if isinstance(analysis, (list, tuple)):
    analysis = analysis[0] if analysis else {}
  return float((analysis or {}).get('flops', 0.0)) / micro.batch


def analytic_flops_per_image(opts: Options) -> Optional[float]:
  """The closed form (`bench.flops`) for the benchmarked step; None for hybrids."""
  spec = ModelSpec.of(train_config(opts))
  forward = flops.forward_flops_per_image(spec.architecture, opts.resolution, opts.num_classes)
  return None if forward is None else forward * (3 if opts.mode == 'train' else 1)


class JaxRunner:
  """One synchronised step of ours per call; the train state threads through calls."""

  def __init__(self, fn, args, mode):
    self._fn, self._args, self._mode = fn, args, mode

  def __call__(self):
    if self._mode == 'infer':
      self._fn(*self._args).block_until_ready()
      return
    state, metrics = self._fn(*self._args)
    jax.block_until_ready((state, metrics))
    self._args = (state, self._args[1])


def interleave(runners: dict, opts: Options) -> dict:
  """Step times per runner, warmed up, then timed in turns: A x steps, B x steps, A ..."""
  times = {name: [] for name in runners}
  for run in runners.values():
    for _ in range(opts.warmup):
      run()
  for _ in range(opts.repeats):
    for name, run in runners.items():
      for _ in range(opts.steps):
        start = time.perf_counter()
        run()
        times[name].append(time.perf_counter() - start)
  return times


def measure_peaks(opts: Options, compare: bool) -> dict:
  """Large-matmul rates measured now (jnp, and torch when comparing): context for the record."""
  on_cpu = jax.default_backend() == 'cpu'
  n = 2048 if on_cpu else 8192
  peaks = {
    'matmul_size': n,
    'dtype': opts.dtype,
    'jax_matmul_flops': hardware.measure_matmul_flops(n, jnp.dtype(opts.dtype)),
  }
  if compare:
    peaks['torch_matmul_flops'] = timm_peer.matmul_flops(n, opts.dtype)
  return peaks


def _side(times, flops_per_image, peak, batch) -> dict:
  step = statistics.median(times)
  rate = batch / step
  out = {'img_per_sec': rate, 'step_time_s': step, 'step_times_s': times}
  if flops_per_image:
    out['achieved_flops'] = flops_per_image * rate
    if peak:
      out['mfu'] = out['achieved_flops'] / peak
  return out


def _settled_peaks(opts: Options, compare: bool, before: dict) -> dict:
  """The matmul peaks measured again after the run (the better of each kept), and the
  peak MFU divides by: the stable one (spec sheet or the recorded best of this CPU),
  which a busy machine cannot lower."""
  peaks, again = dict(before), measure_peaks(opts, compare)
  for key in ('jax_matmul_flops', 'torch_matmul_flops'):
    if key in peaks:
      peaks[key] = max(peaks[key], again[key])
  measured = max(peaks['jax_matmul_flops'], peaks.get('torch_matmul_flops', 0.0))
  peaks['peak_flops'], peaks['peak_source'] = hardware.stable_peak(jnp.dtype(opts.dtype), measured)
  return peaks


def _timm_step(opts: Options):
  """(timm's step, its description) for `--compare=timm`."""
  cores = hardware.machine_info()['cpu_cores']
  return timm_peer.make_step(
    ModelSpec.of(train_config(opts)).architecture,
    mode=opts.mode,
    batch=opts.batch,
    resolution=opts.resolution,
    dtype=opts.dtype,
    num_classes=opts.num_classes,
    compile_model=opts.timm_compile,
    threads=opts.threads or (cores if jax.default_backend() == 'cpu' else None),
  )


def _flops(opts: Options) -> dict:
  """FLOPs per image, XLA's and the closed form's, and which one MFU counts: XLA's where it
  gives them, else the closed form (JAX 0.11.2's GPU compiler counted none: the H200
  lease of 2026-11-26)."""
  flops = {'xla': xla_flops_per_image(opts), 'analytic': analytic_flops_per_image(opts)}
  flops['mfu_counts'] = 'xla' if flops['xla'] else 'analytic'
  return flops


def run(opts: Options) -> dict:
  """Runs the benchmark of `opts`; returns the record (also what `--json` writes)."""
  validate(opts)
  compare = opts.compare == 'timm'
  timm_step, timm_setup = _timm_step(opts) if compare else (None, None)
  peaks = measure_peaks(opts, compare)

  fn, args = build_step(opts)
  start = time.perf_counter()
  compiled = fn.lower(*args).compile()
  compile_s = time.perf_counter() - start
  ours = JaxRunner(compiled, args, opts.mode)
  runners = {'vit_jax': ours}
  if compare:
    start = time.perf_counter()
    timm_step()
    timm_setup['first_step_s'] = time.perf_counter() - start
    runners['timm'] = timm_step
  times = interleave(runners, opts)
  traced = profile.trace(opts.profile, ours, opts.steps) if opts.profile else None
  peaks = _settled_peaks(opts, compare, peaks)
  peak = peaks['peak_flops']

  flops = _flops(opts)
  counted = flops[flops['mfu_counts']]
  record = {
    'benchmark': 'vit_jax.benchmark',
    'time_utc': datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds'),
    'command': 'python -m vit_jax.benchmark ' + ' '.join(sys.argv[1:]),
    'options': dataclasses.asdict(opts),
    'machine': hardware.machine_info(),
    'peak': peaks,
    'flops_per_image': flops,
    'vit_jax': {
      **_side(times['vit_jax'], counted, peak, opts.batch),
      'compile_s': compile_s,
      **memory.compiled_memory(compiled),
    },
  }
  if traced:
    record['profile'] = traced
  if compare:
    record['timm'] = {
      **_side(times['timm'], counted, peak, opts.batch),
      'setup': timm_setup,
    }
    record['ratio_vs_timm'] = record['vit_jax']['img_per_sec'] / record['timm']['img_per_sec']
  return record


def record_path(record: dict, directory: str) -> str:
  """<directory>/<UTC time>_<platform>_<model>_<mode>_b<batch>[_r<res>][_<dtype>].json."""
  o = record['options']
  stamp = re.sub(r'[-:]', '', record['time_utc'][:16])
  search = record['benchmark'].endswith('--find_max_batch')
  parts = [stamp, record['machine']['platform'], o['model'], o['mode']]
  if not search:
    parts.append(f'b{o["batch"]}')
  if o['resolution'] != 224:
    parts.append(f'r{o["resolution"]}')
  if o['dtype'] != 'float32':
    parts.append(o['dtype'])
  if o.get('fp8'):
    parts.append('fp8')
  if search:
    parts.append('maxbatch')
  return os.path.join(directory, '_'.join(parts) + '.json')


def summary(record: dict) -> str:
  o, ours = record['options'], record['vit_jax']
  m = record['machine']
  lines = [
    f'{o["model"]} {o["mode"]} batch {o["batch"]} at {o["resolution"]} px, {o["dtype"]}'
    f'{" with fp8 products" if o.get("fp8") else ""}, '
    f'{m["device_kind"]} ({m["cpu"]}, {m["cpu_cores"]} cores, load '
    f'{m["load_average_1min"] or 0:.1f})'
  ]
  peak = record['peak']
  stable = f'{peak["peak_flops"] / 1e9:.1f} GFLOP/s' if peak['peak_flops'] else 'unknown'
  lines.append(
    'peak %s (%s); matmul %d now: jnp %.1f GFLOP/s%s'
    % (
      stable,
      peak['peak_source'],
      peak['matmul_size'],
      peak['jax_matmul_flops'] / 1e9,
      f', torch {peak["torch_matmul_flops"] / 1e9:.1f}' if 'torch_matmul_flops' in peak else '',
    )
  )
  flops = record['flops_per_image']
  lines.append(
    'FLOPs/image: XLA %.4g G%s%s'
    % (
      flops['xla'] / 1e9,
      f', analytic {flops["analytic"] / 1e9:.4g} G' if flops['analytic'] else '',
      ' (MFU counts the analytic)' if flops.get('mfu_counts') == 'analytic' else '',
    )
  )
  for name in ('vit_jax', 'timm'):
    if name in record:
      side = record[name]
      lines.append(
        f'{name:8s} {side["img_per_sec"]:8.2f} img/s  step {side["step_time_s"]:.4f} s'
        + (f'  MFU {side["mfu"]:.3f}' if 'mfu' in side else '')
      )
  lines.append(
    f'compile {ours["compile_s"]:.1f} s, memory {ours["memory_bytes"] / 2**30:.2f} GiB '
    f'({ours["memory_source"]})'
  )
  if 'ratio_vs_timm' in record:
    lines.append(f'vit_jax / timm = {record["ratio_vs_timm"]:.3f}')
  return '\n'.join(lines)
