"""`python -m vit_jax.compile`: the trainer's program, compiled by the real TPU compiler on this CPU.

Needs libtpu (`pip install -e ".[tpu]"`, part of `[test]`); without it the
TPU tests skip and only the refusal message is checked.
"""

import importlib.util
import json
import textwrap

from conftest import child_json
from conftest import param_shapes
from conftest import run_module
from conftest import said
import jax
import jax.numpy as jnp
import pytest

from vit_jax import models
from vit_jax.bench import aot
from vit_jax.bench import flops
from vit_jax.bench import hlo
from vit_jax.bench import topology
from vit_jax.configs import demo
from vit_jax.configs import models as model_configs
from vit_jax.configs.model_spec import Architecture
from vit_jax.training import loop

needs_libtpu = pytest.mark.skipif(
  importlib.util.find_spec('libtpu') is None, reason='libtpu is not installed'
)
# A small ViT (width 128, 4 layers, 4x4 patches) at 16 px (17 tokens): the TPU compiler takes
# 21 s for it on this CPU, 44 s at 32 px.
SIZE = 16
SMALL = ['--config=configs/demo.py', f'--config.pp.crop={SIZE}', '--config.batch=64']


@pytest.mark.parametrize(
  'name, generation, shape',
  [
    ('v3-8', 'v3', (2, 2)),
    ('v3-256', 'v3', (8, 16)),
    ('v2-8', 'v2', (2, 2)),
    ('v4-8', 'v4', (2, 2, 1)),
    ('v4-128', 'v4', (4, 4, 4)),
    ('v5p-512', 'v5p', (4, 8, 8)),
    ('v5e-1', 'v5e', (1, 1)),
    ('v5e-8', 'v5e', (2, 4)),
    ('v5e-256', 'v5e', (16, 16)),
    ('v6e-64', 'v6e', (8, 8)),
    ('v3:4x4', 'v3', (4, 4)),
    ('v4:4x4x8', 'v4', (4, 4, 8)),
  ],
)
def test_slice_names_map_to_chip_grids(name, generation, shape):
  assert topology.parse(name) == (generation, shape)


def test_bad_slice_names_are_one_line():
  for name, words in [
    ('v3-6', 'N must be 2 x a power of two'),
    ('v9-8', 'unknown TPU generation'),
    ('v4:4x4', '3 dimensions'),
    ('tpu', 'use a slice name'),
  ]:
    with pytest.raises(topology.TopologyError, match=words):
      topology.parse(name)


def test_hlo_reading_counts_loop_bodies_and_collective_bytes():
  text = textwrap.dedent("""\
    %cond (p: (s32[], f32[8])) -> pred[] {
      %p = (s32[], f32[8]) parameter(0)
      %i = s32[] get-tuple-element(%p), index=0
      %n = s32[] constant(4)
      ROOT %lt = pred[] compare(%i, %n), direction=LT
    }

    %body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
      %p = (s32[], f32[8]) parameter(0)
      %x = f32[8]{0} get-tuple-element(%p), index=1
      %ar = f32[8]{0} all-reduce(%x), replica_groups={{0,1},{2,3}}, to_apply=%add
      %a = bf16[8,16]{1,0} parameter(1)
      %b = bf16[16,4]{1,0} parameter(2)
      %d = f32[8,4]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
      ROOT %t = (s32[], f32[8]) tuple(%i, %ar)
    }

    ENTRY %main (x: f32[8]) -> f32[8] {
      %w = (s32[], f32[8]) while(%init), condition=%cond, body=%body
      %g = f32[4,8]{1,0} all-gather(%y), replica_groups=[2,4]<=[8], dimensions={0}
      ROOT %r = f32[8] reduce-scatter(%z), replica_groups=mesh['a'=2,'b'=4] {'b'}, dimensions={0}
    }
    """)
  assert hlo.loop_trip_counts(text) == [4]
  rows = {r['op']: r for r in hlo.collectives(text)}
  # The all-reduce runs once per loop iteration: 4 x 32 bytes over pairs.
  assert rows['all-reduce'] == {
    'op': 'all-reduce',
    'group_size': 2,
    'count': 4,
    'bytes': 128,
    'moved_bytes': 128.0,
  }
  assert (rows['all-gather']['bytes'], rows['all-gather']['group_size']) == (128, 4)
  # A reduce-scatter's input is its output times the group: 32 x 4.
  assert (rows['reduce-scatter']['bytes'], rows['reduce-scatter']['moved_bytes']) == (128, 96.0)
  assert hlo.matmul_dtypes(text) == {'bf16 x bf16 -> f32': 4}


def test_time_by_op_reads_each_kernels_cycles_and_counts_loops():
  """`hlo.time_by_op`: the TPU compiler's cycle estimate of each kernel (its backend config),
  loops by their trip counts, matmul kernels (a fusion computing a convolution) apart, the
  others grouped by the JAX operation they came from, encoder blocks unnumbered."""
  cycles = lambda n: f'backend_config={{"window_config":{{"estimated_cycles":"{n}"}}}}'  # noqa: E731
  text = textwrap.dedent(f"""\
    %cond (p: (s32[])) -> pred[] {{
      %p = (s32[]) parameter(0)
      %i = s32[] get-tuple-element(%p), index=0
      %n = s32[] constant(3)
      ROOT %lt = pred[] compare(%i, %n), direction=LT
    }}

    %fused_matmul (a: bf16[8,16], b: bf16[16,4]) -> bf16[8,4] {{
      %a = bf16[8,16]{{1,0}} parameter(0)
      %b = bf16[16,4]{{1,0}} parameter(1)
      ROOT %c = bf16[8,4]{{1,0}} convolution(%a, %b), dim_labels=bf_io->bf
    }}

    %fused_norm (x: f32[8]) -> f32[8] {{
      %x = f32[8]{{0}} parameter(0)
      ROOT %m = f32[8]{{0}} multiply(%x, %x)
    }}

    %body (p: (s32[])) -> (s32[]) {{
      %p = (s32[]) parameter(0)
      %f = bf16[8,4]{{1,0}} fusion(%a, %b), kind=kOutput, calls=%fused_matmul, metadata={{op_name="jit(step)/encoderblock_0/dot_general"}}, {cycles(100)}
      %g = f32[8]{{0}} fusion(%x), kind=kLoop, calls=%fused_norm, metadata={{op_name="jit(step)/encoderblock_1/LayerNorm_0/mul"}}, {cycles(20)}
      ROOT %t = (s32[]) tuple(%i)
    }}

    ENTRY %main (x: f32[8]) -> f32[8] {{
      %w = (s32[]) while(%init), condition=%cond, body=%body
      %h = f32[8]{{0}} fusion(%x), kind=kLoop, calls=%fused_norm, metadata={{op_name="jit(step)/encoderblock_2/LayerNorm_0/mul"}}, {cycles(40)}
      %c = f32[8]{{0}} copy(%x), metadata={{op_name="jit(step)/head/dot_general"}}, {cycles(100)}
      ROOT %r = f32[8] add(%h, %c)
    }}
    """)
  got = hlo.time_by_op(text)
  # The loop runs 3 times: 300 cycles of matmul and 60 + 40 of the LayerNorm; the copy 100.
  assert got['total_cycles'] == 300 + 60 + 40 + 100
  assert got['matmul_share'] == 300 / 500
  assert got['top_other'] == [
    {'op': 'encoderblock_*/LayerNorm_0/mul (fusion)', 'share': 100 / 500},
    {'op': 'head/dot_general (copy)', 'share': 100 / 500},
  ]
  assert hlo.time_by_op(text.replace('estimated_cycles', 'cycles')) == {}


def test_closed_form_flops_of_vit_b16():
  # 2 x 17.6 G multiply-accumulates forward at 224 px (REFERENCE.md section 7).
  arch = model_configs.MODEL_CONFIGS['ViT-B_16']
  assert flops.forward_flops_per_image(Architecture.of(arch), 224, 1000) == pytest.approx(
    2 * 17.6e9, rel=0.01
  )


def test_closed_form_flops_of_the_map_head():
  # The MAP head's share of XLA's count (a map model minus its gap twin) against
  # the closed form's; XLA adds the head's softmax, LayerNorm and GELU.
  def both(classifier):
    arch = model_configs.MODEL_CONFIGS['testing']
    arch.update(classifier=classifier, hidden_size=64, patches={'size': (4, 4)})
    arch.transformer.update(num_heads=4, mlp_dim=256)
    model = models.VisionTransformer(num_classes=10, **arch)
    images = jax.ShapeDtypeStruct((1, 32, 32, 3), jnp.float32)
    params = param_shapes(arch, 10, 32)
    forward = jax.jit(lambda p, x: model.apply({'params': p}, x, train=False))
    xla = forward.lower(params, images).compile().cost_analysis()['flops']
    return xla, flops.forward_flops_per_image(Architecture.of(arch), 32, 10)

  (xla_map, closed_map), (xla_gap, closed_gap) = both('map'), both('gap')
  head = closed_map - closed_gap
  assert head == 2 * (64 * 64 + 2 * 64 * 64 * 64 + 2 * 64 * 64 + 64 * 64 + 2 * 64 * 256)
  assert head < xla_map - xla_gap < 1.03 * head


_SAME_PROGRAM = textwrap.dedent("""
  import json, sys, tempfile
  import jax
  from vit_jax.core import sharding
  from vit_jax.bench import aot
  from vit_jax.configs import demo
  from vit_jax.data import pipeline
  from vit_jax.training import loop, program

  config = demo.get_config()
  # A tiny model; peak_flops given, so the set-up measures no matmul rate.
  config.update(model='testing', batch=64, accum_steps=2, tensorboard=False, peak_flops=1.0)
  config.mesh.fsdp = 2
  mesh = sharding.make_mesh(config.mesh.fsdp)
  with jax.set_mesh(mesh):
    # As the trainer does: real state, a real batch from the input pipeline.
    run = loop.set_up(config, tempfile.mkdtemp(), mesh, program.validate(config, mesh.size))
    state = loop.restore_or_initialize(run)[0]
    batch = next(pipeline.make_train_iterator(config, run.program.batch_sharding, raw=True))
    eval_batch = next(pipeline.make_eval_iterator(config, run.program.batch_sharding, raw=True))
    trainer_train = run.program.train_step.lower(state, batch)
    trainer_eval = run.program.eval_step.lower(state.params, eval_batch)
    # As the compile command does: abstract inputs only.
    built = program.build(config, mesh, *aot.dataset_classes(config))
    aot_train = built.train_step.lower(built.abstract_state(), built.abstract_batch())
    aot_eval = built.eval_step.lower(built.abstract_state().params, built.abstract_batch(False))
    memory = trainer_train.compile().memory_analysis()
  params = sum(x.size for x in jax.tree.leaves(state.params))
  scalars = sum(x.nbytes for x in jax.tree.leaves(state) if x.size <= 2)
  print(json.dumps({
    'train_same': trainer_train.as_text() == aot_train.as_text(),
    'eval_same': trainer_eval.as_text() == aot_eval.as_text(),
    'argument_bytes': int(memory.argument_size_in_bytes),
    'params': int(params), 'scalars': int(scalars),
    'batch_bytes': int(sum(x.nbytes for x in batch.values())),
  }))
""")


@pytest.mark.slow
def test_trainer_and_compile_command_lower_identical_programs():
  """Same config both ways on 8 CPU devices: identical HLO text, train and eval steps."""
  out = child_json(_SAME_PROGRAM, devices=8, timeout=300)
  assert out['train_same'] and out['eval_same']
  # Per device, exactly: fp32 parameters and Adam's two moments (no leaf of this
  # small model reaches FSDP's size threshold), the scalars of the state, and
  # this device's eighth of the batch.
  assert out['argument_bytes'] == 3 * 4 * out['params'] + out['scalars'] + out['batch_bytes'] // 8


@pytest.mark.slow
@needs_libtpu
def test_compile_command_reports_flops_memory_and_collectives(tmp_path):
  path = tmp_path / 'record.json'
  result = run_module('compile', *SMALL, '--topology=v5e:2x2', f'--json={path}')
  assert result.returncode == 0, result.stderr[-3000:]
  record = json.loads(path.read_text())
  assert record['fits'] and record['devices'] == 4
  assert 0.95 <= record['flops_vs_closed_form'] <= 1.25
  # Arguments: at least fp32 parameters + two Adam moments + a quarter of the
  # batch (uint8 pixels, int32 labels); TPU tiling pads some small dimensions.
  arch = model_configs.MODEL_CONFIGS['ViT-Demo_4']
  logical = 12 * _param_count(arch, SIZE, 10) + 64 // 4 * (SIZE * SIZE * 3 + 4)
  assert logical <= record['train_memory']['argument_bytes'] <= 1.2 * logical
  # Data parallel: one gradient all-reduce over the 4 chips, sized like the gradients.
  (reduce,) = [c for c in record['collectives'] if c['group_size'] == 4]
  assert reduce['op'] == 'all-reduce' and reduce['bytes'] >= 2 * _param_count(arch, SIZE, 10)
  assert record['step_seconds_estimate'] > 0 and 0 < record['mfu_upper_bound'] < 1
  assert record['chip_days'] == pytest.approx(
    record['total_steps'] * record['step_seconds_estimate'] * 4 / 86400, rel=1e-3
  )
  assert 'v5e:2x2' in result.stdout and 'not measurements' in result.stdout
  # Where the time goes, by the compiler's estimate of each kernel: the matmuls and the rest.
  by_op = record['time_by_op']
  # (this tiny model's matmuls are small: 0.19 of the step by libtpu 0.0.42's estimate)
  assert 0.1 < by_op['matmul_share'] < 1 and len(by_op['top_other']) == 6
  assert f'time by op       matmuls {100 * by_op["matmul_share"]:.1f}%' in result.stdout
  # libtpu's start-up (no TPU host here: no metadata server) says nothing either.
  assert said(result.stderr) == [], result.stderr[-3000:]


@pytest.mark.slow
@needs_libtpu
def test_a_config_that_does_not_fit_is_one_line(tmp_path):
  result = run_module('compile', *SMALL, '--topology=v5e-1', '--config.batch=262144')
  assert result.returncode == 2
  (line,) = result.stderr.strip().splitlines()[-1:]
  assert line.startswith('error: ViT-Demo_4 at batch 262144 does not fit v5e-1 (needs ')
  assert '--fit' in line and '--config.accum_steps=2' in line
  assert 'Traceback' not in result.stderr


@needs_libtpu
def test_a_batch_that_does_not_split_over_the_slice_is_one_line():
  config = demo.get_config()
  config.update(batch=64)
  with pytest.raises(loop.ConfigError, match=r'batch=64 must be a multiple of .* = 128'):
    aot.compile_run(config, topology.describe('v3-128'))


def test_without_libtpu_the_command_says_how_to_install_it(monkeypatch):
  monkeypatch.setattr(importlib.util, 'find_spec', lambda name, *a: None)
  with pytest.raises(topology.TopologyError, match=r'pip install -e "\.\[tpu\]"'):
    topology.describe('v3-8')


def _param_count(arch, size, num_classes):
  return sum(int(x.size) for x in jax.tree.leaves(param_shapes(arch, num_classes, size)))
