"""`python -m vit_jax.compile --topology=h100-8`: the trainer's program, compiled by the GPU compiler on this CPU.

Needs the GPU compiler (`pip install -e ".[gpu]"`: jax[cuda12], no GPU or
driver); without it those tests skip, and the names, the refusal message and
the attention padding are still checked. GPU compiles run in child processes
(one for the library-level checks, one per command line), so that loading
the CUDA plugin leaves this session's CPU backend as it is.
"""

import functools
import importlib.util
import json
import re
import textwrap
import types

from conftest import ROOT
from conftest import assert_trees_close
from conftest import child_json
from conftest import run_module
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vit_jax.bench import gpu_record
from vit_jax.bench import gpus
from vit_jax.bench import hlo
from vit_jax.core import hardware
from vit_jax.models import attention
from vit_jax.models import vit

needs_gpu_compiler = pytest.mark.skipif(
  not gpus.compiler_installed(),
  reason='the GPU compiler is not installed (pip install -e ".[gpu]": jax[cuda12])',
)
# The demo ViT (width 128, 4 layers, 4 heads of 32, 4x4 patches) at 32 px: 65
# tokens, in bfloat16, so that 'auto' attention takes cuDNN on an H100.
SMALL = [
  '--config=configs/demo.py',
  '--config.pp.crop=32',
  '--config.batch=64',
  '--config.dtype=bfloat16',
]


@pytest.mark.parametrize(
  'name, gpu, boxes, per_box',
  [
    ('h100-1', 'h100', 1, 1),
    ('h100-8', 'h100', 1, 8),
    ('h100-16', 'h100', 2, 8),
    ('h200-64', 'h200', 8, 8),
    ('a100-4', 'a100', 1, 4),
    ('a100_40g-8', 'a100_40g', 1, 8),
  ],
)
def test_gpu_names_map_to_boxes(name, gpu, boxes, per_box):
  assert gpus.parse(name) == (gpus.GPUS[gpu], boxes, per_box)


def test_bad_gpu_names_are_one_line():
  for name, words in [
    ('h100-12', 'N GPUs must be 1, 2, 4 or 8 .one box. or a multiple of 8'),
    ('b200-8', 'unknown GPU or slice; use one of h100-8, h200-8, a100-8, a100_40g-8'),
    ('h100', 'unknown GPU'),
  ]:
    with pytest.raises(gpus.GpuError, match=words):
      gpus.parse(name)
  assert gpus.is_gpu_name('h100-8') and gpus.is_gpu_name('a100_40g-8')
  assert not gpus.is_gpu_name('v3-8') and not gpus.is_gpu_name('v4:4x4x8')


def test_without_the_gpu_compiler_the_command_says_how_to_install_it(monkeypatch):
  monkeypatch.setattr(importlib.util, 'find_spec', lambda name, *a: None)
  with pytest.raises(gpus.GpuError, match=r'pip install -e "\.\[gpu\]" .*no GPU or driver needed'):
    gpus.describe('h100-8')


def test_the_cards_as_nvidia_specifies_them():
  h100, h200, a100, a100_40g = (gpus.GPUS[n] for n in ('h100', 'h200', 'a100', 'a100_40g'))
  # REFERENCE.md section 8: dense bf16 peaks, memory, HBM and NVLink bandwidth.
  assert [g.bf16_flops for g in (h100, h200, a100, a100_40g)] == [989e12, 989e12, 312e12, 312e12]
  assert (h100.memory_bytes / 2**30, h200.memory_bytes / 2**30) == pytest.approx(
    (79.65, 140.4), 1e-3
  )
  assert (a100.memory_bytes, a100_40g.memory_bytes) == (80 * 2**30, 40 * 2**30)
  assert (h100.hbm_bytes_per_s, h200.hbm_bytes_per_s) == (3.35e12, 4.8e12)
  assert (h100.nvlink_bytes_per_s, a100.nvlink_bytes_per_s) == (900e9 / 2, 600e9 / 2)
  # 8 x 400 Gb/s (H100, H200) and 8 x 200 Gb/s (A100) InfiniBand per box of 8.
  assert (h100.network_bytes_per_s, a100.network_bytes_per_s) == (400e9 / 8, 200e9 / 8)
  config = gpus.target_config(h100, (9, 8, 0), (12, 9, 0))
  for line in ('core_count: 132', 'cuda_compute_capability { major: 9 minor: 0 }'):
    assert line in config
  assert 'device_description_str: "NVIDIA H100 80GB HBM3"' in config


def test_gpu_program_text_gives_groups_boxes_and_bytes():
  """The GPU compiler's forms: async gathers and scatters returning (inputs, outputs), named
  meshes with their own device order, and loops that state their trip count."""
  text = textwrap.dedent("""\
    %body (p: (s32[], bf16[4,2])) -> (s32[], bf16[4,2]) {
      %p = (s32[], bf16[4,2]) parameter(0)
      %y = bf16[4,2]{1,0} get-tuple-element(%p), index=1
      %ag = (bf16[4,2]{1,0}, bf16[4,8]{1,0}) all-gather-start(%y), channel_id=2, replica_groups=mesh['axis_0'=2,'axis_1'=4], device_ids=([4,2]T(1,0)) {'axis_1'}, dimensions={1}, use_global_device_ids=true
      ROOT %t = (s32[], bf16[4,2]) tuple(%i, %y)
    }

    ENTRY %main (x: bf16[32,5,768]) -> bf16[32,5,48] {
      %w = (s32[], bf16[4,2]) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
      %rs = ((bf16[32,5,768]{1,0,2}), bf16[32,5,48]{1,0,2}) reduce-scatter-start(%x), channel_id=1, replica_groups=mesh['axis_0'=1,'axis_1'=1,'axis_2'=16] {'axis_2'}, use_global_device_ids=true, dimensions={2}, to_apply=%add
      ROOT %d = bf16[32,5,48]{1,0,2} reduce-scatter-done(%rs)
    }
    """)
  gather, scatter = hlo.collective_instructions(text)
  # The mesh lists devices 0, 2, 4, 6, 1, 3, 5, 7: groups along its second axis.
  assert gather['groups'] == [[0, 2, 4, 6], [1, 3, 5, 7]]
  assert (gather['count'], gather['bytes']) == (3, 3 * 4 * 8 * 2)  # the gathered array, 3 trips
  assert (scatter['group_size'], scatter['bytes']) == (16, 32 * 5 * 768 * 2)  # the full input
  # 8 GPUs in boxes of 4: each gather group spans 2 boxes with 2 GPUs in each.
  devices = [types.SimpleNamespace(process_index=i // 4) for i in range(8)]
  text_gather_only = text.replace('reduce-scatter-start', 'negate')
  (row,) = gpu_record.place_collectives(text_gather_only, devices)
  assert (row['boxes'], row['link']) == (2, 'InfiniBand')
  assert row['nvlink_bytes'] == 1 / 2 * row['bytes']  # a ring of 2 within the box
  assert row['network_bytes'] == 1 / 2 * row['bytes'] / 2  # its half of the array, across 2 boxes


def test_launch_scripts_give_jax_the_memory_the_compile_command_checks_against():
  spec = importlib.util.spec_from_file_location('launch_common', ROOT / 'launch' / 'common.py')
  common = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(common)
  assert float(common.GPU_ENV['XLA_PYTHON_CLIENT_MEM_FRACTION']) == gpus.MEMORY_FRACTION


@pytest.mark.equivalence
def test_padded_attention_matches_the_unpadded_one():
  """cuDNN's path takes 197 tokens padded to 198 (once, by the encoder) and masks the padding
  (`num_tokens`); run with 'xla' that must not change the real tokens' values or gradients:
  the masked key adds exp(-inf) = 0 to each softmax sum, so they are the same float32 sums in
  another order, normwise within 1e-5."""
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.normal(size=(2, 197, 3, 16)), jnp.float32) for _ in range(3))
  cot = jnp.asarray(rng.normal(size=(2, 197, 3, 16)), jnp.float32)
  pad = lambda t: jnp.pad(t, ((0, 0), (0, 1), (0, 0), (0, 0)))  # noqa: E731

  @functools.partial(jax.jit, static_argnums=0)
  def run(padded):
    def attend(q, k, v):
      if not padded:
        return attention.fused_attention(q, k, v, 'xla')
      return attention.fused_attention(pad(q), pad(k), pad(v), 'xla', num_tokens=197)[:, :197]

    y, pullback = jax.vjp(attend, q, k, v)
    return (y, *pullback(cot))

  padded, plain = run(True), run(False)
  assert_trees_close(padded, plain, 1e-5, 'padded attention')
  assert max(float(jnp.max(jnp.abs(g))) for g in plain[1:]) > 0.1  # gradients are not all zero
  assert vit.pads_sequence(197, 'cudnn') and not vit.pads_sequence(198, 'cudnn')
  assert not vit.pads_sequence(197, 'explicit', pad_odd=True)  # it masks nothing: never padded


def test_gpu_programs_are_built_with_their_xla_options(monkeypatch):
  """Triton's matmuls off on GPUs (`hardware.GPU_COMPILER_OPTIONS`), where the program is built;
  a flag that XLA_FLAGS names is left to it; no options elsewhere."""
  gpu = types.SimpleNamespace(platform='gpu')
  monkeypatch.setenv('XLA_FLAGS', '--xla_gpu_autotune_level=0')
  assert hardware.compiler_options([gpu]) == {'xla_gpu_enable_triton_gemm': False}
  # Over several GPUs, the collectives' buckets and the latency-hiding scheduler too.
  assert hardware.compiler_options([gpu, gpu]) == {
    'xla_gpu_enable_triton_gemm': False,
    **hardware.MULTI_GPU_COMPILER_OPTIONS,
  }
  assert hardware.MULTI_GPU_COMPILER_OPTIONS['xla_gpu_all_reduce_combine_threshold_bytes'] == (
    30 * 2**20
  )
  assert hardware.compiler_options(jax.devices()) == {}  # this CPU
  monkeypatch.setenv('XLA_FLAGS', '--xla_gpu_enable_triton_gemm=true')
  assert hardware.compiler_options([gpu]) == {}


def test_cudnn_is_not_chosen_for_this_cpu():
  assert not hardware.cudnn_attention_applies(jnp.bfloat16, 64)


_CHILD = textwrap.dedent("""
  import functools, json
  import jax, jax.numpy as jnp
  from vit_jax.bench import aot, gpu_record, gpus, hlo
  from vit_jax.configs import demo
  from vit_jax.core import hardware
  from vit_jax.models import vit

  def record(topology, **overrides):
    config = aot.with_overrides(demo.get_config(), {'dtype': 'bfloat16', 'batch': 64, **overrides})
    compiled = aot.compile_run(config, gpus.describe(topology))
    out = gpu_record.analyse(compiled)
    state = compiled.program.abstract_state()
    out['params'] = sum(x.size for x in jax.tree.leaves(state.params))
    out['scalar_bytes'] = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state) if x.size <= 2)
    out['pads'] = hlo.pads(compiled.train.as_text())
    return out

  out = {'cards': {}}
  for name in gpus.GPUS:
    devices = gpus.describe(f'{name}-16').devices
    d = devices[0]
    with jax.set_mesh(jax.sharding.Mesh(devices[:1], ('batch',))):
      choices = [hardware.cudnn_attention_applies(t, h) for t, h in
                 ((jnp.bfloat16, 64), (jnp.float32, 64), (jnp.bfloat16, 12))]
    out['cards'][name] = [len(devices), d.device_kind, d.compute_capability,
                          [x.process_index for x in devices], choices]
  out['small'] = record('h100-1', **{'pp.crop': 32})
  # Training steps with attention='auto' at ViT's sequence lengths: 197 tokens
  # at 224 px, 577 at 384 (ViT-Ti/16: 3 heads of 64; one block).
  tiny = {'model': 'ViT-Ti_16', 'depth': 1, 'batch': 8}
  out['t197'] = record('h100-1', **tiny, **{'pp.crop': 224})
  out['t577'] = record('h100-1', **tiny, **{'pp.crop': 384})
  out['t197_f32'] = record('h100-1', **tiny, **{'pp.crop': 224, 'dtype': 'float32'})
  # One register token: 196 patches + class token + register = 198, even.
  out['t198_register'] = record('h100-1', **tiny, **{'pp.crop': 224, 'num_registers': 1})
  # Without the padding: JAX's own check refuses cuDNN's backward pass.
  vit.pads_sequence = lambda *args, **kwargs: False
  try:
    record('h100-1', **tiny, **{'pp.crop': 224})
    out['unpadded'] = 'compiled'
  except NotImplementedError as e:
    out['unpadded'] = str(e)
  print(json.dumps(out))
""")


@pytest.fixture(scope='module')
def child():
  """The library-level GPU compiles, in one child process."""
  return child_json(_CHILD, timeout=300)


@needs_gpu_compiler
def test_target_configs_describe_the_cards(child):
  for name, product, capability in [
    ('h100', 'NVIDIA H100 80GB HBM3', '9.0'),
    ('h200', 'NVIDIA H200', '9.0'),
    ('a100', 'NVIDIA A100-SXM4-80GB', '8.0'),
    ('a100_40g', 'NVIDIA A100-SXM4-40GB', '8.0'),
  ]:
    count, kind, cc, processes, choices = child['cards'][name]
    assert (count, kind, cc) == (16, product, capability)
    assert processes == [0] * 8 + [1] * 8  # one process per box of 8
    # Under the mesh of these GPUs, 'auto' takes cuDNN for bf16 (not fp32, not head_dim 12).
    assert choices == [True, False, False]


@needs_gpu_compiler
def test_tiny_vit_on_one_h100(child):
  r = child['small']
  assert (r['devices'], r['boxes'], r['fits'], r['collectives']) == (1, 1, True, [])
  # Exactly: fp32 parameters and Adam's two moments, the state's scalars, the
  # batch (64 images of 32x32x3 uint8 and their int32 labels); donated.
  tm = r['train_memory']
  assert tm['argument_bytes'] == 12 * r['params'] + r['scalar_bytes'] + 64 * (32 * 32 * 3 + 4)
  assert tm['alias_bytes'] == 12 * r['params'] + r['scalar_bytes']
  assert r['hbm_bytes_per_device'] <= r['usable_bytes'] == int(0.9 * 81_559 * 2**20)
  # 65 tokens, padded to 66: cuDNN's fused attention forward and backward in each of 4 blocks.
  assert r['attention']['custom_calls'] == {
    '__cudnn$fmhaSoftmax': 4,
    '__cudnn$fmhaSoftmaxBackward': 4,
  }
  assert set(r['matmul_dtypes']) == {'bf16 x bf16 -> bf16'}
  assert r['step_seconds_lower_bound'] == r['closed_form_flops_per_step_per_device'] / 989e12
  assert r['comm_seconds_lower_bound'] == 0.0


@needs_gpu_compiler
@pytest.mark.parametrize('case, tokens', [('t197', 197), ('t577', 577)])
def test_attention_auto_compiles_training_steps_with_cudnn(child, case, tokens):
  r = child[case]
  assert r['image_size'] == {197: 224, 577: 384}[tokens]
  assert r['attention']['kernel'] == 'cuDNN fused attention'
  assert r['attention']['custom_calls'] == {
    '__cudnn$fmhaSoftmax': 1,
    '__cudnn$fmhaSoftmaxBackward': 1,
  }


def _odd_sequence_pads(pads) -> dict:
  """The `pad`s (`hlo.pads`' keys) that lengthen the token axis of a [batch, tokens, width] by
  one: an odd sequence made even for cuDNN (a concatenation can be a pad too, of many)."""
  return {k: n for k, n in pads.items() if re.match(r'\w+\[\d+,\d+,\d+\] 0_0x0_1x0_0$', k)}


@needs_gpu_compiler
def test_one_register_makes_the_sequence_even_and_the_padding_goes(child):
  """197 tokens are padded to 198 once each way for cuDNN's attention; with one register the
  sequence is 198 tokens and the training step has no pad on the token axis at all."""
  assert set(_odd_sequence_pads(child['t197']['pads'])) == {'bf16[8,198,192] 0_0x0_1x0_0'}
  assert _odd_sequence_pads(child['t198_register']['pads']) == {}
  assert child['t198_register']['attention']['custom_calls'] == {
    '__cudnn$fmhaSoftmax': 1,
    '__cudnn$fmhaSoftmaxBackward': 1,
  }


@needs_gpu_compiler
def test_attention_auto_without_half_precision_or_padding(child):
  # float32: no cuDNN; the attention is XLA's matmuls.
  assert child['t197_f32']['attention'] == {
    'kernel': 'XLA (attention written out as matmuls)',
    'custom_calls': {},
  }
  # The bug the padding avoids (jax 0.10.2): an odd sequence's backward is refused.
  assert child['unpadded'] == 'Unsupported sequence length Q 197, KV 197.'


@needs_gpu_compiler
def test_two_boxes_reduce_gradients_over_infiniband(tmp_path):
  path = tmp_path / 'record.json'
  result = run_module('compile', *SMALL, '--topology=h100-16', f'--json={path}')
  assert result.returncode == 0, result.stderr[-3000:]
  r = json.loads(path.read_text())
  assert (r['devices'], r['boxes'], r['gpus_per_box'], r['mesh']['data']) == (16, 2, 8, 16)
  # One gradient all-reduce over all 16 GPUs, so across both boxes: the kernels
  # and embeddings' gradients in bfloat16 (the model computes in it), the 2,304
  # LayerNorm parameters' and the loss in float32.
  params, layer_norms = 546_186, 4 * 2 * 2 * 128 + 2 * 128
  (reduce,) = r['collectives']
  assert (reduce['op'], reduce['group_size'], reduce['boxes'], reduce['link']) == (
    'all-reduce',
    16,
    2,
    'InfiniBand',
  )
  assert reduce['bytes'] == 2 * (params - layer_norms) + 4 * (layer_norms + 1)
  # Per GPU: a ring within the box (2 x 7/8), and its eighth across the 2 boxes.
  assert reduce['nvlink_bytes'] == pytest.approx(2 * 7 / 8 * reduce['bytes'])
  assert reduce['network_bytes'] == pytest.approx(reduce['bytes'] / 8)
  assert r['comm_seconds_lower_bound'] == pytest.approx(
    max(reduce['nvlink_bytes'] / 450e9, reduce['network_bytes'] / 50e9)
  )
  assert r['launch'] == (
    'python launch/slurm.py --nodes=2 --gpus_per_node=8 --config=configs/demo.py --workdir=DIR '
    '-- --config.pp.crop=32 --config.batch=64 --config.dtype=bfloat16'
  )
  assert 'InfiniBand' in result.stdout and 'not measurements' in result.stdout


@needs_gpu_compiler
def test_a_batch_that_does_not_split_over_the_gpus_is_one_line():
  result = run_module('compile', *SMALL[:2], '--config.batch=24', '--topology=h100-16')
  assert result.returncode == 2 and 'Traceback' not in result.stderr
  assert result.stderr.strip().splitlines()[-1] == (
    'error: batch=24 must be a multiple of accum_steps (1) x devices (16) = 16'
  )


def test_an_unknown_gpu_is_one_line():
  result = run_module('compile', *SMALL, '--topology=b200-8')
  assert result.returncode == 2 and 'Traceback' not in result.stderr
  (line,) = result.stderr.strip().splitlines()[-1:]
  assert line.startswith('error: --topology=b200-8: unknown GPU or slice; use one of h100-8')


# ViT-B/16's block, twice, at batch 128 (as in benchmarks/gpu_hlo/vit_b16_depth2_*): the
# steps `vit_jax.benchmark` times, compiled for one H100; and the inference step once more
# with no compile-time options but autotuning off, to see the ones it was built with.
_KERNELS_CHILD = textwrap.dedent("""
  import json, os
  import jax, jax.numpy as jnp
  from vit_jax.core import sharding
  from vit_jax.bench import gpu_record, gpus, hlo, speed

  device = gpus.describe('h100-1').devices[0]
  out = {}
  for mode in ('train', 'infer'):
    opts = speed.Options(model='ViT-B_16', mode=mode, batch=128, dtype='bfloat16', depth=2)
    out[mode] = gpu_record.step_kernels(opts, device)
  # The parameters the inference step stores in bfloat16: the ones training casts.
  _, (params, _) = speed.build_step(opts, abstract=True, device=device)
  out['cast_leaves'] = sum(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))

  def triton_kernels():
    opts = speed.Options(model='ViT-B_16', mode='infer', batch=64, dtype='bfloat16', depth=1)
    with jax.set_mesh(sharding.make_mesh(devices=[device])):
      fn, args = speed.build_step(opts, abstract=True, device=device)
      text = fn.lower(*args).compile(compiler_options={'xla_gpu_autotune_level': 0}).as_text()
    return sum(n for name, n in hlo.kernels(text).items() if name.startswith('gemm_fusion'))

  # FP8 products (--config.fp8, `benchmark --fp8`): ViT-B/16's and ViT-L/16's blocks, training
  # and inference, at a batch at which XLA keeps q, k and v three products (each over 32 MB).
  for model, mode in (('ViT-B_16', 'train'), ('ViT-L_16', 'train'), ('ViT-B_16', 'infer')):
    opts = speed.Options(model=model, mode=mode, batch=128, dtype='bfloat16', depth=2, fp8=True)
    out[f'fp8_{model}_{mode}'] = gpu_record.step_kernels(opts, device)

  out['triton'] = [triton_kernels()]
  os.environ['XLA_FLAGS'] += ' --xla_gpu_enable_triton_gemm=true'  # read as the step is built
  out['triton'].append(triton_kernels())
  print(json.dumps(out))
""")


@pytest.fixture(scope='module')
def kernels():
  return child_json(_KERNELS_CHILD, timeout=600)


def gpu_hlo_record(name):
  return json.loads((ROOT / 'benchmarks' / 'gpu_hlo' / f'{name}_h100-1.json').read_text())


def token_pads(pads, tokens=198):
  """How many `pad`s lengthen the token sequence to `tokens` (`hlo.pads`' keys)."""
  return sum(n for shape, n in pads.items() if re.match(rf'bf16\[\d+,{tokens},\d+\] ', shape))


@needs_gpu_compiler
def test_vit_b16_inference_on_an_h100_is_matmuls_with_fused_epilogues_and_fused_attention(kernels):
  """No convolution (the patch embedding is one matmul), one pad of the token sequence per
  forward pass (197 -> 198 for cuDNN), no parameter cast inside the program (they are stored
  in bfloat16), and per block 13 kernels: the three q, k, v matmuls and the attention output
  and second MLP matmul with their biases in cuBLASLt's epilogue, the first MLP matmul with
  bias and GELU, cuDNN's attention, two LayerNorms (statistics, then normalise) and the
  normalisation's rsqrt per LayerNorm; no more than the committed record."""
  r = kernels['infer']
  assert r['convolutions'] == 0
  assert r['pads'] == {'bf16[128,198,768] 0_0x0_1x0_0': 1}
  assert (r['parameter_casts'], r['other_argument_casts']) == (0, ['images'])
  block = r['per_block_by_name']
  assert (block['__cublas$lt$matmul:BIAS'], block['__cublas$lt$matmul:BIAS_GELU']) == (5, 1)
  assert block['__cudnn$fmhaSoftmax'] == 1 and r['kernels_per_block'] == sum(block.values())
  (record,) = gpu_hlo_record('vit_b16_depth2_infer')['batches']
  assert r['kernels_per_block'] <= record['kernels_per_block'] == 13
  assert r['bytes_written_per_block'] <= record['bytes_written_per_block']


@needs_gpu_compiler
def test_vit_b16_training_on_an_h100_pads_once_casts_once_and_transposes_no_activation(kernels):
  """No convolution; the token sequence padded once (its transpose pads the gradient once, going
  back) and nowhere in a block; each cast parameter cast once per step; the three q, k, v
  matmuls with their biases in cuBLASLt's epilogue, the first MLP matmul with its bias and the
  tanh GELU, its input kept as the epilogue's auxiliary output (`vit.recomputed`: no GELU
  kernel, and no tanh written for the backward pass); no transposes of activations in a block;
  kernels, and the kernels and bytes written outside GEMMs and attention (norms, elementwise
  work, the optimizer: 78 and 0.53 GB per block), per block no more than the committed record."""
  r = kernels['train']
  assert r['convolutions'] == 0
  assert token_pads(r['pads']) == 2 and 'loop_pad_fusion' not in r['per_block_by_name']
  assert r['parameter_casts'] == kernels['cast_leaves'] == 30  # 12 per block, 6 outside
  block = r['per_block_by_name']
  assert block['__cublas$lt$matmul:BIAS'] == 5  # q, k, v, attention out, second MLP matmul
  assert block['__cublas$lt$matmul:BIAS_GELU_AUX'] == 1
  assert not {name for name in block if 'transpose' in name}, block
  (record,) = gpu_hlo_record('vit_b16_depth2_train')['batches']
  for key in ('kernels', 'bytes_written', 'other_kernels', 'other_bytes_written'):
    assert r[f'{key}_per_block'] <= record[f'{key}_per_block'], key


# The encoder block's kernels (q, k, v, out, both MLP layers): one FP8 byte each.
BLOCK_KERNEL_PARAMS = {'ViT-B_16': 4 * 768 * 768 + 2 * 768 * 3072, 'ViT-L_16': 12 * 1024 * 1024}


@needs_gpu_compiler
@pytest.mark.parametrize('model', ['ViT-B_16', 'ViT-L_16'])
def test_fp8_training_transposes_no_activation_in_fp8(kernels, model):
  """--config.fp8 on an H100 (models/fp8.py): per block 12 FP8 cuBLASLt GEMMs, the forward and
  input-gradient products of q, k, v, the attention output and the two MLP layers; their 6
  weight gradients in bf16, as the patch embedding and the head (forward and gradients: 5).
  No activation or gradient is transposed in FP8: what FP8 GEMMs read transposed is the
  kernels, rounded and written in the other layout by the kernel that rounds them or moved
  once (fp8 and cast transposes of `hlo.fp8_transposes`), at most one byte per kernel
  parameter per step whatever the batch (an activation transposed would be tokens x width
  per image: 19 MB per MLP input at this batch)."""
  r = kernels[f'fp8_{model}_train']
  block = r['per_block_by_name']
  gemms = {name: n for name, n in block.items() if 'cublas' in name}
  assert r['fp8_gemms_per_block'] == 12 and sum(gemms.values()) == 18, gemms
  bf16_gemms = sum(n for name, n in r['by_name'].items() if name.startswith('__cublas$lt$matmul:'))
  assert r['fp8_gemms'] == 2 * 12 and bf16_gemms == 2 * 6 + 5
  moved = r['fp8_transposed_bytes_per_block'] + r['cast_transposed_bytes_per_block']
  assert 0 < moved <= BLOCK_KERNEL_PARAMS[model], r
  (record,) = (
    row for name, row in fp8_recipes_record()['results'][model].items()
    if name == 'bf16_weight_gradient'
  )  # fmt: skip
  assert r['other_bytes_written_per_block'] <= record['other_bytes_written_per_block']
  assert r['other_kernels_per_block'] <= record['other_kernels_per_block']


@needs_gpu_compiler
def test_fp8_inference_multiplies_by_kernels_rounded_once(kernels):
  """`benchmark --mode=infer --fp8` (and predict/evaluate --fp8): the kernels come in as FP8
  already, held as FP8 GEMMs read them (fp8.Quantised): per block 6 FP8 GEMMs, the tanh GELU
  in the first MLP layer's epilogue, and nothing rounded or transposed but the activations."""
  r = kernels['fp8_ViT-B_16_infer']
  block = r['per_block_by_name']
  assert r['fp8_gemms_per_block'] == 6 and block['__cublas$lt$matmul$f8:BIAS_GELU'] == 1
  assert r['fp8_transposes'] == r['cast_transposes'] == 0
  assert r['parameter_casts'] == 0


def fp8_recipes_record():
  return json.loads((ROOT / 'benchmarks' / 'fp8' / 'recipes_h100-1.json').read_text())


def test_the_fp8_recipe_is_the_one_its_record_chose():
  """benchmarks/fp8_recipes.py: of the recipes compiled for an H100, models/fp8.py's (the
  weight gradient in bf16, q, k and v three products) transposes no activation in FP8, moves
  the fewest bytes outside GEMMs and attention, and takes the least memory (to 0.1%), for
  ViT-B/16 and ViT-L/16; all three products in FP8 transposed 0.32 GB (B/16) and 0.43 GB (L/16)
  per block at batch 128."""
  for model, results in fp8_recipes_record()['results'].items():
    fp8_recipes = {name: r for name, r in results.items() if name != 'bf16'}
    chosen = fp8_recipes['bf16_weight_gradient']
    moved = lambda r: r['fp8_transposed_bytes_per_block'] + r['cast_transposed_bytes_per_block']  # noqa: E731
    assert moved(chosen) <= BLOCK_KERNEL_PARAMS[model] < 0.1 * moved(fp8_recipes['all_fp8'])
    for name, r in fp8_recipes.items():
      assert chosen['other_bytes_written_per_block'] <= r['other_bytes_written_per_block'], name
      assert chosen['memory_estimate_bytes'] <= 1.001 * r['memory_estimate_bytes'], name
    assert (
      chosen['fp8_gemms_per_block'] == 12 and fp8_recipes['all_fp8']['fp8_gemms_per_block'] == 18
    )
    assert fp8_recipes['bf16_weight_gradient_qkv_merged']['fp8_gemms_per_block'] == 8


@needs_gpu_compiler
def test_gpu_steps_are_built_without_triton_matmuls_unless_xla_flags_asks(kernels):
  assert kernels['triton'][0] == 0 and kernels['triton'][1] > 0


@pytest.mark.parametrize(
  'name, layers', [('vit_b16_train', 12), ('vit_b16_infer', 12), ('vit_l16_train', 24)]
)
def test_the_committed_full_size_gpu_records_hold_the_same_program_properties(name, layers):
  """The full-size records (benchmarks/gpu_hlo.py): no convolution, the token sequence padded
  once per forward pass, no parameter cast in inference and each cast once per training
  step (12 per block, 6 outside), and ViT-B/16's block the same as the tests' two-block
  copy of it."""
  training = name.endswith('train')
  small = gpu_hlo_record(f'vit_b16_depth2_{"train" if training else "infer"}')['batches'][0]
  for row in gpu_hlo_record(name)['batches']:
    assert row['depth'] == layers and row['convolutions'] == 0
    assert token_pads(row['pads']) == (2 if training else 1), row['pads']
    assert row['parameter_casts'] == (12 * layers + 6 if training else 0)
    if name.startswith('vit_b16'):  # the optimizer's last kernels vary by a fraction per block
      whole = lambda counts: {k: round(v) for k, v in counts.items() if round(v)}  # noqa: E731
      assert whole(row['per_block_by_name']) == whole(small['per_block_by_name'])
      assert abs(row['kernels_per_block'] - small['kernels_per_block']) <= 0.5


def test_the_multi_gpu_options_schedule_the_most_gradient_bytes_under_matmuls():
  """hardware.MULTI_GPU_COMPILER_OPTIONS against the other bucket sizes of `python
  benchmarks/gpu_overlap.py` (benchmarks/gpu/overlap.json): ViT-B/16's and ViT-L/16's full
  ImageNet-21k steps compiled for 8 and 16 H100s with each. The project's bucket size (the same
  for all-reduces, all-gathers and reduce-scatters) puts the most gradient bytes under matmuls
  over the four steps (859 MiB: 8 MiB buckets 820, 64 MiB 817) and its share of each step's
  within 5 points of the best candidate's (ViT-L/16 on 16 GPUs: 89% against 8 MiB's 93%;
  ViT-B/16 on 8: 70% against 8 MiB's 39%)."""
  record = json.loads((ROOT / 'benchmarks' / 'gpu' / 'overlap.json').read_text())
  options = hardware.MULTI_GPU_COMPILER_OPTIONS
  (size,) = {
    options[f'xla_gpu_{op}_combine_threshold_bytes']
    for op in ('all_reduce', 'all_gather', 'reduce_scatter')
  }
  chosen = f'{size // 2**20}_mib'
  assert options['xla_gpu_enable_latency_hiding_scheduler']
  cases = [record[m][t] for m in ('ViT-B_16', 'ViT-L_16') for t in ('h100-8', 'h100-16')]
  candidates = {f'{mib}_mib' for mib in record['candidates_mib']}
  assert chosen in candidates and all(set(rows) == candidates for rows in cases)
  hidden = {c: sum(rows[c]['bytes_under_matmuls'] for rows in cases) for c in candidates}
  assert hidden[chosen] == max(hidden.values()), hidden
  for rows in cases:
    best = max(r['share_under_matmuls'] for r in rows.values())
    assert rows[chosen]['share_under_matmuls'] >= best - 0.05, rows
