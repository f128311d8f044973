"""Beyond the paper's scale: scan over layers, the `model` mesh axis, giant configs, multi-slice.

The multi-device tests run on 8 forced CPU host devices in a subprocess; the
TPU ones compile tiny models for small topologies with libtpu.
"""

import functools
import importlib.util
import textwrap

from conftest import assert_close
from conftest import assert_trees_close
from conftest import child_json
from conftest import errors_from_stats
from conftest import map_head_parameter_count
from conftest import param_shapes
from conftest import random_like
from conftest import small_vit_config
from conftest import tiny_run_config
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from vit_jax import checkpoint
from vit_jax import models
from vit_jax.bench import aot
from vit_jax.bench import hlo
from vit_jax.bench import topology
from vit_jax.configs import ConfigError
from vit_jax.configs import architectures
from vit_jax.configs import demo
from vit_jax.core import sharding
from vit_jax.models import vit_checkpoint
from vit_jax.training import loop
from vit_jax.training import program

# ---------------------------------------------------------------------------
# Scan over layers.


def _images(n=2, size=32, seed=1):
  return np.random.default_rng(seed).normal(size=(n, size, size, 3)).astype(np.float32)


@pytest.mark.slow
@pytest.mark.equivalence
def test_scanned_blocks_compute_what_unrolled_blocks_do():
  """nn.scan over stacked blocks against unrolled blocks (also remat'd): the same float32 ops,
  fused differently, so outputs and gradients agree normwise within 1e-5."""
  images = _images()
  for flags in ({}, {'parallel_block': True, 'qk_norm': True, 'biases': 'no_qkv_or_norm'}):
    config = small_vit_config()
    config.transformer.update(num_layers=3, **flags)
    unrolled = models.VisionTransformer(num_classes=5, **config)
    scanned = models.VisionTransformer(num_classes=5, scan=True, **config)
    params = random_like(param_shapes(config, 5, 32), scale=0.1)
    stacked = vit_checkpoint.stack_blocks(params)
    # The scanned model's own tree is the stacked one: a layer axis in front.
    assert jax.tree.map(np.shape, stacked) == jax.tree.map(
      lambda s: s.shape, param_shapes(config, 5, 32, scanned)
    )
    mlp = stacked['Transformer']['encoderblock']['MlpBlock_3']['Dense_0']['kernel']
    assert mlp.shape == (3, 24, 48)
    # Converting back gives the very arrays.
    jax.tree.map(np.testing.assert_array_equal, vit_checkpoint.unstack_blocks(stacked), params)
    assert_trees_close(
      jax.jit(functools.partial(scanned.apply, train=False))({'params': stacked}, images),
      jax.jit(functools.partial(unrolled.apply, train=False))({'params': params}, images),
      1e-5,
      f'outputs {flags}',
    )

  # Gradients too, rematerialised (the policy only changes what is recomputed).
  def loss(model, p):
    return jnp.sum(model.apply({'params': p}, images, train=False) ** 2)

  remat = models.VisionTransformer(
    num_classes=5, scan=True, remat=True, remat_policy='dots_with_no_batch_dims_saveable', **config
  )
  want = vit_checkpoint.stack_blocks(jax.jit(jax.grad(lambda p: loss(unrolled, p)))(params))
  got = jax.jit(jax.grad(lambda p: loss(remat, p)))(stacked)
  assert_trees_close(got, want, 1e-5, 'gradients')


def test_stacked_params_are_saved_and_loaded_as_encoderblocks(tmp_path):
  config = small_vit_config()
  scanned = models.VisionTransformer(num_classes=5, scan=True, **config)
  like = param_shapes(config, 5, 32, scanned)
  stacked = random_like(like)
  path = checkpoint.save_npz(stacked, tmp_path / 'params.npz')
  with np.load(path) as npz:
    keys = set(npz.files)
  assert 'Transformer/encoderblock_1/MlpBlock_3/Dense_0/kernel' in keys
  assert not any(k.startswith('Transformer/encoderblock/') for k in keys)
  np.testing.assert_array_equal(
    np.load(path)['Transformer/encoderblock_1/MultiHeadDotProductAttention_1/query/kernel'],
    stacked['Transformer']['encoderblock']['MultiHeadDotProductAttention_1']['query']['kernel'][1],
  )
  # Loaded for a scanned model: stacked again, the same arrays.
  jax.tree.map(np.testing.assert_array_equal, checkpoint.load(path, like=like), stacked)
  # Fine-tuning a scanned model from it: the backbone kept, stacked; the head re-initialised.
  init = jax.tree.map(np.zeros_like, stacked)
  tuned = checkpoint.load_pretrained(
    pretrained_path=str(path), init_params=init, model_config=config, verbose=False
  )
  jax.tree.map(np.testing.assert_array_equal, tuned['Transformer'], stacked['Transformer'])
  assert not np.any(tuned['head']['kernel'])


def _tiny_run_config(**overrides):
  """The tests' tiny run (conftest.TINY_RUN), two steps at batch 16."""
  short = dict(total_steps=2, warmup_steps=1, checkpoint_every=2, progress_every=2, eval_every=100)
  return tiny_run_config(**{**short, 'batch': 16, **overrides})


@pytest.mark.slow
def test_a_scanned_run_checkpoints_encoderblocks_and_resumes_either_way(tmp_path):
  workdir = str(tmp_path)
  loop.train_and_evaluate(_tiny_run_config(scan_layers=True), workdir)
  meta = ocp.StandardCheckpointer().metadata(tmp_path / 'checkpoints' / '2' / 'state')
  meta = dict(getattr(meta, 'item_metadata', meta))
  assert 'params/Transformer/encoderblock_0/MlpBlock_3/Dense_0/kernel' in checkpoint.flatten(meta)
  # Optimizer state included: no stacked block anywhere in the file.
  assert "'encoderblock_0'" in str(meta['opt_state']) and "'encoderblock'" not in str(meta)
  # The final params.npz holds the step-2 parameters, as encoderblock_{i}.
  final = checkpoint.load(str(tmp_path / 'params.npz'))
  restored = {}
  for scan in (False, True):
    config = _tiny_run_config(scan_layers=scan, total_steps=3)
    mesh = program.make_mesh(config)
    with jax.set_mesh(mesh):
      run = loop.set_up(config, workdir, mesh, program.validate(config, mesh.size))
      state = loop.restore_or_initialize(run)[0]
      run.manager.close()
    assert int(state.step) == 2
    restored[scan] = jax.tree.map(np.asarray, state)
  # Unrolled, the checkpoint is the run's parameters; scanned, the same stacked.
  jax.tree.map(np.testing.assert_array_equal, restored[False].params, final)
  jax.tree.map(
    np.testing.assert_array_equal,
    restored[True].params,
    vit_checkpoint.stack_blocks(restored[False].params),
  )
  jax.tree.map(
    np.testing.assert_array_equal,
    restored[True].opt_state,
    vit_checkpoint.stack_blocks(restored[False].opt_state),
  )
  # SGD's momentum is in it (not zeros; two steps from a zero head move the head first).
  assert sum(np.count_nonzero(x) for x in jax.tree.leaves(restored[True].opt_state)) > 100


# ---------------------------------------------------------------------------
# The `model` mesh axis (tensor parallelism), on 8 CPU devices.

_TENSOR_PARALLEL = textwrap.dedent("""
  import json
  import jax, jax.numpy as jnp, numpy as np
  from vit_jax import models
  from vit_jax.core import sharding
  from vit_jax.bench import hlo
  from vit_jax.configs import architectures

  def case(parallel_block):
    config = architectures.MODEL_CONFIGS['ViT-Ti_16']
    config.hidden_size = 32
    config.patches.size = (8, 8)
    config.transformer.update(num_layers=2, num_heads=4, mlp_dim=64, parallel_block=parallel_block)
    config.classifier = 'map' if parallel_block else 'token'  # ViT-22B pools with a MAP head
    model = models.VisionTransformer(num_classes=10, attention='explicit', **config)
    rng = np.random.default_rng(0)
    images = rng.normal(size=(8, 16, 16, 3)).astype(np.float32)
    labels = np.arange(8) % 10
    init = jax.jit(lambda key: model.init(key, images[:1], train=False))
    params = init(jax.random.key(0))['params']
    params = jax.tree.map(lambda p: p + 0.05 * rng.normal(size=p.shape).astype(np.float32), params)

    def loss(p, x, y):
      logits = model.apply({'params': p}, x, train=False)
      return -jnp.mean(jnp.sum(jax.nn.one_hot(y, 10) * jax.nn.log_softmax(logits), -1))

    one = jax.jit(jax.value_and_grad(loss), device=jax.devices()[0])(params, images, labels)
    out = {}
    for fsdp, tp, data in ((1, 2, None), (2, 4, 1), (1, 4, None), (1, 2, 2)):
      # The serial block with model=2 (and data=4) and model=4 with fsdp=2; the
      # parallel block with model=4 (and data=2).
      if parallel_block != ((fsdp, tp) == (1, 4)) or (parallel_block and data):
        continue
      try:
        mesh = sharding.make_mesh(fsdp, model=tp, data=data)
      except sharding.MeshError as e:
        out[f'{fsdp},{tp},{data}'] = str(e)
        continue
      with jax.set_mesh(mesh):
        # Every parameter big enough for FSDP here: min_size=0.
        shardings = sharding.tree_shardings(params, mesh, min_size=0)
        batch = sharding.batch_sharding(mesh)
        step = jax.jit(jax.value_and_grad(loss), in_shardings=(shardings, batch, batch))
        placed = jax.device_put(params, shardings)
        compiled = step.lower(placed, images, labels).compile()
        value, grads = compiled(placed, images, labels)
      block, head = placed['Transformer']['encoderblock_0'], placed.get('MAPHead_0')
      shard = lambda a: list(a.addressable_shards[0].data.shape)
      # Reductions over the model axis: groups of devices that differ only in
      # their model coordinate.
      # Groups name partitions, in the order of the mesh's devices; `model` is
      # the innermost axis, so its groups are runs of `tp` neighbours.
      model_groups = np.arange(8).reshape(-1, tp).tolist()
      reductions = []
      for op, line, n in hlo.collective_lines(compiled.as_text()):
        groups = sorted(sorted(g) for g in hlo.replica_groups(line))
        # Those of the encoder blocks (the embedding and head may reshard too).
        if groups == model_groups and 'encoderblock_' in line:
          reductions.append([op, n, line.split('=', 1)[1].split(op)[0].strip()])
      out[f'{fsdp},{tp},{data}'] = {
        'mesh': dict(mesh.shape),
        'loss_error': abs(float(value) - float(one[0])) / abs(float(one[0])),
        # Per gradient: (max |difference|, max |one device's|), for conftest.errors_from_stats.
        'grad_stats': {
          jax.tree_util.keystr(path): [float(np.max(np.abs(np.asarray(a) - np.asarray(b)))),
                                       float(np.max(np.abs(np.asarray(b))))]
          for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(grads),
                                  jax.tree.leaves(one[1]))
        },
        'query': shard(block['MultiHeadDotProductAttention_1']['query']['kernel']),
        'out': shard(block['MultiHeadDotProductAttention_1']['out']['kernel']),
        'dense_0': shard(block['MlpBlock_3']['Dense_0']['kernel']),
        'dense_1': shard(block['MlpBlock_3']['Dense_1']['kernel']),
        'map_head': head and [
          shard(head['MultiHeadDotProductAttention_0']['query']['kernel']),
          shard(head['MlpBlock_0']['Dense_0']['kernel']),
        ],
        'model_reductions': reductions,
      }
    return out

  print(json.dumps({'serial': case(False), 'parallel': case(True)}))
""")


@pytest.mark.slow
@pytest.mark.equivalence
def test_tensor_parallel_matches_one_device_with_one_reduction_per_sublayer():
  """model=2 and model=4 (with fsdp) against one device: the loss agrees normwise within 1e-5
  and the gradients within 3e-5 (3x the other comparisons' 1e-5), as sums split over devices
  and reduced in another order; the gradients' spread reached 3.2e-6 across CPU code
  generations (benchmarks/20261125T1527_equivalence_spread.json)."""
  out = child_json(_TENSOR_PARALLEL, devices=8)
  serial = out['serial']
  for key, (fsdp, tp) in {'1,2,None': (1, 2), '2,4,1': (2, 4)}.items():
    r = serial[key]
    assert r['mesh'] == {'slice': 1, 'data': 8 // (fsdp * tp), 'fsdp': fsdp, 'model': tp}
    assert_close(r['loss_error'], 1e-5, f'{key}: loss')
    assert_close(errors_from_stats(r['grad_stats']), 3e-5, f'{key}: gradients')
    # Width 32, 4 heads of 8, MLP 64: heads and MLP units split over `model`,
    # the width over `fsdp` (every array is FSDP-sized here).
    assert r['query'] == [32 // fsdp, 4 // tp, 8]
    assert r['out'] == [4 // tp, 8, 32 // fsdp]
    assert r['dense_0'] == [32 // fsdp, 64 // tp]
    assert r['dense_1'] == [64 // tp, 32 // fsdp]
    # Per block: one all-reduce of the tokens after attention and one after the
    # MLP going forward, one each for their input gradients going back.
    ops = [op for op, _, _ in r['model_reductions']]
    assert ops == ['all-reduce'] * 8, (key, r['model_reductions'])
    per_device_batch = 8 // (8 // tp)
    assert all(
      shape.startswith(f'f32[{per_device_batch},5,32]') for _, _, shape in r['model_reductions']
    )
  # data=2 x model=2 on 8 devices is a misfit, said in one line.
  assert serial['1,2,2'] == (
    'mesh slice=1 x data=2 x fsdp=1 x model=2 = 4 must equal the number of devices (8); '
    'leave mesh.data unset to use data=4'
  )
  # The ViT-22B block: attention and MLP share one reduction each way. Its MAP
  # head splits heads and MLP units like a block.
  parallel = out['parallel']['1,4,None']
  assert_close(parallel['loss_error'], 1e-5, 'parallel block: loss')
  assert_close(errors_from_stats(parallel['grad_stats']), 3e-5, 'parallel block: gradients')
  assert parallel['map_head'] == [[32, 1, 8], [32, 16]]
  assert [op for op, _, _ in parallel['model_reductions']] == ['all-reduce'] * 4


_FSDP_COLLECTIVES = textwrap.dedent("""
  import json
  import jax, jax.numpy as jnp, numpy as np
  from vit_jax import models
  from vit_jax.core import sharding
  from vit_jax.bench import hlo
  from vit_jax.configs import architectures

  # A giant ViT's settings in miniature: blocks scanned and rematerialised.
  config = architectures.MODEL_CONFIGS['ViT-Ti_16']
  config.hidden_size = 32
  config.patches.size = (4, 4)
  config.transformer.update(num_layers=2, num_heads=4, mlp_dim=128)
  model = models.VisionTransformer(
    num_classes=10, attention='explicit', scan=True, remat=True,
    remat_policy='dots_with_no_batch_dims_saveable', **config)
  images = jax.ShapeDtypeStruct((64, 32, 32, 3), jnp.float32)
  labels = jax.ShapeDtypeStruct((64,), jnp.int32)
  params = jax.eval_shape(
    lambda: model.init(jax.random.key(0), jnp.zeros((1, 32, 32, 3)), train=False))['params']

  def loss(p, x, y):
    logits = model.apply({'params': p}, x, train=False)
    return -jnp.mean(jnp.sum(jax.nn.one_hot(y, 10) * jax.nn.log_softmax(logits), -1))

  mesh = sharding.make_mesh(8)
  with jax.set_mesh(mesh):
    batch = sharding.batch_sharding(mesh)
    shardings = sharding.tree_shardings(params, mesh, min_size=0)  # every array FSDP-sized
    step = jax.jit(jax.grad(loss), in_shardings=(shardings, batch, batch))
    text = step.lower(params, images, labels).compile().as_text()
  print(json.dumps({
    'param_bytes': int(sum(np.prod(p.shape) * 4 for p in jax.tree.leaves(params))),
    'collectives': hlo.collectives(text),
  }))
""")


@pytest.mark.slow
def test_fsdp_alone_gathers_weights_not_activations():
  """fsdp=8, model=1: the gradient step gathers each weight (going forward, and again going
  back: the blocks are rematerialised) and reduces each gradient once. Before activations
  were constrained under FSDP too (`sharding.constrain`), the partitioner followed the weights'
  layout into the activations: here 79x the parameters' bytes in all-gathers and 279x in
  all-reduces, and an all-to-all, and 677 GiB per GPU and step for ViT-g/14 on 16 H100s."""
  out = child_json(_FSDP_COLLECTIVES, devices=8)
  moved = {}
  for row in out['collectives']:
    assert row['group_size'] == 8, row
    moved[row['op']] = moved.get(row['op'], 0) + row['bytes']
  assert set(moved) <= {'all-gather', 'all-reduce', 'reduce-scatter'}, out['collectives']
  assert moved['all-gather'] <= 2 * out['param_bytes'], (moved, out['param_bytes'])
  gradients = moved.get('all-reduce', 0) + moved.get('reduce-scatter', 0)
  assert gradients <= out['param_bytes'] + 64, (moved, out['param_bytes'])  # + the loss


def test_mesh_and_model_misfits_are_one_line():
  with pytest.raises(
    sharding.MeshError, match=r'^mesh.fsdp=1 x mesh.model=2 = 2 must divide the 1 devices'
  ):
    sharding.make_mesh(1, model=2)
  config = _tiny_run_config()
  config.mesh.model = 3  # the testing model: 2 heads, MLP 10
  with pytest.raises(ConfigError) as e:
    program.validate(config, 1)
  assert str(e.value) == (
    'testing: mesh.model=3 must divide num_heads=2 (tensor parallelism splits attention heads '
    'and MLP units); use a divisor of 2'
  )
  with pytest.raises(
    sharding.MeshError, match=r'dimension 1 \(6\) is not divisible by mesh.model=4'
  ):
    sharding.param_spec('encoderblock_0/MlpBlock_3/Dense_0/kernel', (8, 6), 1, 4, 0)


# ---------------------------------------------------------------------------
# The giant ViTs.

# Counted from the shapes (jax.eval_shape), against the published figures:
# Zhai et al. 2022 Table 2 (g, G: 4 significant digits, backbones without a
# head), Dehghani et al. 2023 Table 1 (22B, backbone), PaLI (e: "3.9B", two
# significant digits, with the head it was trained with: big_vision's MAP
# head and the 29,593 JFT-3B classes of configs/proj/scaling_laws/train_vit_g.py).
JFT_3B_CLASSES = 29_593
GIANT_COUNTS = {  # name: (classes, exact count, published)
  'ViT-g_14': (None, 1_011_199_616, 1_011e6),
  'ViT-G_14': (None, 1_842_772_352, 1_843e6),
  'ViT-e_14-map': (JFT_3B_CLASSES, 3_926_402_969, 3.9e9),
  'ViT-22B_14': (None, 21_750_546_432, 21.7e9),
}


def _giant_closed_form(config, num_classes, size=224):
  d, m = config.hidden_size, config.transformer.mlp_dim
  p, t = config.patches.size[0], config.transformer
  k = d // t.num_heads
  bias = t.get('biases', 'all') != 'no_qkv_or_norm'
  norm = d * (1 + bias)
  block = (
    norm * (1 if t.get('parallel_block') else 2)  # LayerNorm_0 (and LayerNorm_2)
    + 3 * d * d
    + 3 * d * bias  # q, k, v
    + 2 * k * (1 + bias) * t.get('qk_norm', False)  # query_norm, key_norm
    + d * d
    + d  # out
    + d * m
    + m
    + m * d
    + d  # MLP
  )
  head = (d + 1) * num_classes if num_classes else 0
  return (
    p * p * 3 * d
    + d
    + (size // p) ** 2 * d
    + t.num_layers * block
    + norm
    + map_head_parameter_count(d, m) * (config.classifier == 'map')
    + head
  )


@pytest.mark.parametrize('name', sorted(GIANT_COUNTS))
def test_giant_parameter_counts_are_exact_and_match_the_papers(name):
  config = architectures.MODEL_CONFIGS[name]
  classes, exact, published = GIANT_COUNTS[name]
  scanned = models.VisionTransformer(num_classes=classes, scan=True, **config)
  n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(param_shapes(config, None, 224, scanned)))
  assert n == exact == _giant_closed_form(config, classes)
  if name == 'ViT-e_14-map':
    # Two significant digits: ours rounds to it; the backbone alone (3.81B) would not.
    backbone = _giant_closed_form(architectures.MODEL_CONFIGS['ViT-e_14'], None)
    assert round(n, -8) == published and round(backbone, -8) != published
  else:
    assert abs(n / published - 1) < 0.005


# ---------------------------------------------------------------------------
# Multi-slice, compiled by the TPU compiler for two v5e 2x2 slices.

needs_libtpu = pytest.mark.skipif(
  importlib.util.find_spec('libtpu') is None, reason='libtpu is not installed'
)


@pytest.mark.slow
@needs_libtpu
def test_two_slices_exchange_only_gradients():
  config = demo.get_config()
  config.update(model='testing', batch=64, batch_eval=64)
  config.pp.crop = 32
  config.mesh.model = 2  # heads 2, MLP 10
  tpu = topology.describe('v5e:2x2', num_slices=2)
  compiled = aot.compile_run(config, tpu)
  mesh = compiled.program.batch_sharding.mesh
  assert dict(mesh.shape) == {'slice': 2, 'data': 2, 'fsdp': 1, 'model': 2}
  # Each slice's devices are one block of the mesh: slice is the outer axis.
  assert [d.slice_index for d in mesh.devices.flat] == [0] * 4 + [1] * 4
  record = aot.analyse(compiled)
  text = compiled.train.as_text()
  # libtpu compiles one slice's program: every collective's replica groups
  # stay within the slice's 4 devices (data and tensor parallelism alike) ...
  groups = [g for _, line, _ in hlo.collective_lines(text) for g in hlo.replica_groups(line)]
  assert groups and all(max(g) < 4 for g in groups)
  # ... and what crosses slices is sent once per step, outside the layers and
  # the backward pass: sums (all-reduces) of the gradients, packed by XLA into
  # TPU tiles, at least the gradient's bytes and at most its tiles' padding more.
  transfers = record['cross_slice']['transfers']
  assert transfers and record['cross_slice']['kinds'] == ['ALL_REDUCE SUM']
  assert all(r['count'] == 1 for r in transfers)
  shards = [
    p.sharding.shard_shape(p.shape)
    for p in jax.tree.leaves(compiled.program.abstract_state().params)
  ]
  grad_bytes = sum(4 * np.prod(s) for s in shards)
  # A TPU tile holds 8 x 128 floats of an array's last two dimensions.
  tiled = sum(
    4 * np.prod((1, *s)[:-2]) * -(-(1, *s)[-2] // 8) * 8 * -(-s[-1] // 128) * 128 for s in shards
  )
  assert grad_bytes <= record['cross_slice']['bytes_per_step'] <= tiled
