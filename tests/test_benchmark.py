"""The benchmark tool on a tiny model: fields, positive numbers, MFU in (0, 1), FLOP counts."""

import dataclasses
import glob
import gzip
import json
import os

from conftest import command_error
import jax
import pytest

from vit_jax import benchmark
from vit_jax.bench import memory
from vit_jax.bench import profile
from vit_jax.bench import speed
from vit_jax.core import hardware


@pytest.fixture(autouse=True)
def peak_record(tmp_path, monkeypatch):
  """Recorded CPU peaks go to a fresh cache, not the user's ~/.cache."""
  monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path / 'cache'))


def tiny(**overrides):
  kwargs = dict(model='testing', batch=4, resolution=32, warmup=1, steps=2, repeats=2)
  kwargs.update(overrides)
  return speed.Options(**kwargs)


def check_side(side, batch):
  assert side['img_per_sec'] > 0 and side['step_time_s'] > 0
  assert side['img_per_sec'] == pytest.approx(batch / side['step_time_s'])
  assert all(t > 0 for t in side['step_times_s'])
  assert 0 < side['mfu'] < 1
  assert side['achieved_flops'] > 0


@pytest.mark.slow
def test_infer_record_fields_and_numbers():
  record = speed.run(tiny(mode='infer'))
  check_side(record['vit_jax'], 4)
  ours = record['vit_jax']
  assert len(ours['step_times_s']) == 4  # steps x repeats
  assert ours['compile_s'] > 0 and ours['memory_bytes'] > 0
  assert ours['memory_source'] == 'XLA estimate'  # CPU: no device allocator statistics
  assert record['peak']['jax_matmul_flops'] > 1e9
  assert record['peak']['peak_flops'] == record['peak']['jax_matmul_flops']  # a fresh record
  assert record['peak']['peak_source'].startswith('recorded: fastest float32 matmul')
  assert record['flops_per_image']['mfu_counts'] == 'xla'  # the CPU compiler counts them
  machine = record['machine']
  assert machine['cpu_cores'] >= 1 and machine['versions']['jax'] == jax.__version__
  assert 'xla_flags' in machine and machine['platform'] == 'cpu'
  assert 'timm' not in record and 'ratio_vs_timm' not in record
  json.dumps(record)  # the record is plain JSON


@pytest.mark.slow
def test_train_with_accumulation_against_timm():
  pytest.importorskip('timm')
  # One torch thread: OpenMP's spinning threads make tiny steps erratic on a busy machine.
  record = speed.run(tiny(mode='train', batch=4, accum_steps=2, compare='timm', threads=1))
  check_side(record['vit_jax'], 4)
  check_side(record['timm'], 4)
  assert record['ratio_vs_timm'] == pytest.approx(
    record['vit_jax']['img_per_sec'] / record['timm']['img_per_sec']
  )
  assert record['peak']['torch_matmul_flops'] > 1e9
  assert record['timm']['setup']['optimizer'].startswith('torch.optim.Adam')
  assert record['timm']['setup']['threads'] == 1
  # Accumulation does not change the work per image: the count is the micro-step's.
  single = speed.xla_flops_per_image(tiny(mode='train', batch=2))
  assert record['flops_per_image']['xla'] == pytest.approx(single, rel=1e-6)


@pytest.mark.slow
def test_mfu_divides_by_a_peak_that_a_busy_machine_cannot_lower(monkeypatch):
  recorded, source = hardware.stable_peak()  # measured on a machine as it is now, and recorded
  assert source.startswith('recorded') and os.path.exists(hardware.peak_record_path())
  # A busy machine: the matmul now runs at a millionth of its speed.
  monkeypatch.setattr(hardware, 'measure_matmul_flops', lambda *args, **kwargs: 1e5)
  busy = speed.run(tiny(mode='infer'))
  assert busy['peak']['jax_matmul_flops'] == 1e5
  assert busy['peak']['peak_flops'] == recorded
  assert 0 < busy['vit_jax']['mfu'] <= 1
  assert 'MFU 0.' in speed.summary(busy) and 'recorded' in speed.summary(busy)
  # The trainer's MFU uses the same record.
  assert hardware.stable_peak()[0] == recorded


@pytest.mark.slow
def test_mfu_counts_the_closed_form_where_xla_counts_nothing(monkeypatch):
  # JAX 0.11.2's GPU compiler gave no FLOP count (the H200 lease of 2026-11-26).
  monkeypatch.setattr(speed, 'xla_flops_per_image', lambda opts: 0.0)
  record = speed.run(tiny(mode='infer'))
  flops, ours = record['flops_per_image'], record['vit_jax']
  assert flops['xla'] == 0.0 and flops['mfu_counts'] == 'analytic'
  assert ours['achieved_flops'] == pytest.approx(flops['analytic'] * ours['img_per_sec'])
  assert ours['mfu'] == pytest.approx(ours['achieved_flops'] / record['peak']['peak_flops'])


@pytest.mark.slow
@pytest.mark.parametrize('mode,factor', [('infer', 1), ('train', 3)])
def test_flops_match_the_closed_form_for_vit_b16(mode, factor):
  # Paper numbers (REFERENCE 7): ViT-B/16 at 224 costs 17.6 GMACs per image forward.
  opts = speed.Options(model='ViT-B_16', mode=mode, batch=2)
  analytic = speed.analytic_flops_per_image(opts)
  assert analytic == pytest.approx(factor * 2 * 17.6e9, rel=0.005)
  xla = speed.xla_flops_per_image(opts)
  # XLA also counts the elementwise work (softmax, GELU, LayerNorm, Adam): a few %.
  assert analytic < xla < 1.04 * analytic


def test_optim_dtype_sets_the_first_moment_of_the_benchmarked_step():
  def moment_dtypes(optim_dtype):
    _, (state, _) = speed.build_step(tiny(mode='train', optim_dtype=optim_dtype), abstract=True)
    leaves = jax.tree_util.tree_leaves_with_path(state)
    params = sum(1 for path, _ in leaves if 'params' in jax.tree_util.keystr(path[:1]))
    mu = [x.dtype.name for path, x in leaves if '.mu' in jax.tree_util.keystr(path)]
    return params, mu

  params, mu = moment_dtypes('float32')
  assert len(mu) == params and set(mu) == {'float32'}
  params, mu = moment_dtypes('bfloat16')
  assert len(mu) == params and set(mu) == {'bfloat16'}


def test_device_time_sums_each_line_of_the_trace(tmp_path):
  def meta(kind, name, pid, tid=None):
    return {'ph': 'M', 'name': kind, 'pid': pid, **({'tid': tid} if tid is not None else {}),
            'args': {'name': name}}  # fmt: skip

  def kernel(name, dur, pid=2, tid=7):
    return {'ph': 'X', 'name': name, 'pid': pid, 'tid': tid, 'ts': 0, 'dur': dur}

  events = [
    meta('process_name', '/host:CPU', 1),
    meta('process_name', '/device:GPU:0', 2),
    meta('thread_name', 'Stream #7', 2, 7),
    meta('thread_name', 'XLA Ops', 2, 8),
    kernel('gemm', 30.0), kernel('gemm', 30.0), kernel('fusion.1', 40.0),
    kernel('dot.3', 100.0, tid=8),
    kernel('python step', 500.0, pid=1, tid=1),  # the host's: not device time
  ]  # fmt: skip
  path = tmp_path / 'vm.trace.json.gz'
  with gzip.open(path, 'wt', encoding='utf-8') as f:
    json.dump({'traceEvents': events}, f)
  summary = profile.device_time(str(path))
  assert summary['lines_us'] == {'/device:GPU:0 Stream #7': 100.0, '/device:GPU:0 XLA Ops': 100.0}
  top = {(k['line'], k['name']): (k['us'], k['count'], k['share']) for k in summary['top']}
  assert top == {
    ('/device:GPU:0 Stream #7', 'gemm'): (60.0, 2, 0.6),
    ('/device:GPU:0 Stream #7', 'fusion.1'): (40.0, 1, 0.4),
    ('/device:GPU:0 XLA Ops', 'dot.3'): (100.0, 1, 1.0),
  }


@pytest.mark.slow
def test_profile_traces_the_steps_of_ours(tmp_path):
  record = speed.run(tiny(mode='infer', profile=str(tmp_path / 'trace')))
  traced = record['profile']
  assert traced['steps'] == 2 and os.path.isfile(traced['trace'])
  assert traced['trace'].startswith(str(tmp_path / 'trace'))
  assert isinstance(traced['lines_us'], dict)  # a CPU has no device lines to sum
  json.dumps(record)


def test_largest_search_is_exact_and_cheap():
  for answer in (0, 1, 7, 64, 1000):
    probes = []

    def fits(b, answer=answer, probes=probes):
      probes.append(b)
      return b <= answer

    assert memory._largest(fits, 40, limit=4096) == answer
    assert len(probes) <= 2 * 12 + 2
  probes = []
  assert memory._largest(lambda b: probes.append(b) or b <= 64, 64, 4096) == 64
  assert len(probes) == 2  # a right guess costs two probes


@pytest.mark.slow
def test_find_max_batch_on_cpu_meets_the_budget():
  opts = tiny(mode='infer', batch=1)
  fn, args = speed.build_step(dataclasses.replace(opts, batch=6), abstract=True)
  budget = memory.estimate_bytes(fn.lower(*args).compile())  # batch 6 fits
  record = memory.find_max_batch(opts, speed.build_step, speed.JaxRunner, budget_bytes=budget)
  micro = record['max_micro_batch']
  assert micro >= 6 and record['max_batch'] == micro
  sizes = {p['micro_batch']: p['estimate_bytes'] for p in record['probes']}
  assert sizes[micro] <= budget < sizes[micro + 1]
  assert record['method'] == 'XLA CPU-compiled estimate'
  assert 'largest batch per device' in memory.describe(record)


@pytest.mark.slow
def test_cli_writes_a_record_where_asked(tmp_path, monkeypatch):
  path = tmp_path / 'run.json'
  assert (
    benchmark.main(
      [
        '--model=testing',
        '--batch=2',
        '--resolution=32',
        '--steps=1',
        '--repeats=1',
        f'--json={path}',
      ]
    )
    == 0
  )
  record = json.loads(path.read_text())
  assert record['options']['batch'] == 2 and record['vit_jax']['img_per_sec'] > 0
  assert record['command'].startswith('python -m vit_jax.benchmark')
  name = os.path.basename(speed.record_path(record, 'anywhere'))
  assert name.endswith('_cpu_testing_infer_b2_r32.json')
  # Without --json the record goes to the workdir, never into the repository.
  monkeypatch.chdir(tmp_path)
  args = ['--model=testing', '--batch=2', '--resolution=32', '--steps=1', '--repeats=1']
  assert benchmark.main(args) == 0
  assert (
    len(glob.glob(str(tmp_path / 'workdirs' / 'benchmark' / '*_cpu_testing_infer_b2_r32.json')))
    == 1
  )
  assert benchmark.main(args + [f'--workdir={tmp_path / "mine"}']) == 0
  assert len(glob.glob(str(tmp_path / 'mine' / '*.json'))) == 1


def test_cli_rejects_bad_options_in_one_line(capsys):
  main = benchmark.main
  err = command_error(main, ['--model=testing', '--resolution=30', '--no_record'], capsys)
  assert 'multiple of the patch size 16' in err
  # Suggests the close name.
  assert 'ViT-B_16' in command_error(main, ['--model=ViT-B16', '--no_record'], capsys)
  command_error(
    main, ['--model=testing', '--mode=infer', '--accum_steps=2', '--batch=4', '--no_record'], capsys
  )
  assert 'like with like' in command_error(
    main,
    ['--model=testing', '--mode=train', '--optimizer=sgd', '--compare=timm', '--no_record'],
    capsys,
  )
  err = command_error(main, ['--model=testing', '--attention=cudnn', '--no_record'], capsys)
  assert 'needs a CUDA GPU' in err
