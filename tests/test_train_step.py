"""The train step's math: losses, schedules, weight decay, accumulation, NaN guard."""

import functools

from conftest import assert_close
from conftest import assert_trees_close
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from vit_jax.configs import common
from vit_jax.core import sharding
from vit_jax.evaluation import metrics
from vit_jax.training import optim
from vit_jax.training import steps


def small_config(**overrides):
  config = common.get_config()
  config.unlock()
  config.update(
    model='testing',
    pp={**config.pp.to_dict(), 'crop': 16},
    batch=16,
    total_steps=100,
    warmup_steps=10,
    base_lr=1e-3,
    weight_decay=0.1,
  )
  config.update(overrides)
  return config


def init_state(task, tx, ema):
  """The train state at 16 px, made as the trainer makes it: jitted (eager init compiles op
  by op) on the mesh (else the second step's inputs differ in type from the first's)."""
  init = functools.partial(steps.init_state, model=task.model, tx=tx, image_size=16, ema=ema)
  with jax.set_mesh(sharding.make_mesh()):
    return jax.jit(init)(jax.random.PRNGKey(0))


def setup(config, num_classes=5):
  task = steps.make_task(config, num_classes, multi_label=False)
  tx, schedule = optim.make_optimizer(config)
  state = init_state(task, tx, ema=False)
  # Non-zero head so the first step moves everything.
  state = state.replace(
    params={
      **state.params,
      'head': jax.tree.map(lambda x: 0.1 * jnp.ones_like(x), state.params['head']),
    }
  )
  mesh = sharding.make_mesh()
  step = jax.jit(
    functools.partial(steps.train_step, task=task, tx=tx, schedule=schedule, config=config)
  )
  return state, step, mesh


def batch(n=16, seed=0, num_classes=5):
  rng = np.random.default_rng(seed)
  return {
    'image': rng.uniform(-1, 1, (n, 16, 16, 3)).astype(np.float32),
    'label': rng.integers(0, num_classes, n).astype(np.int32),
  }


def test_softmax_cross_entropy_and_label_smoothing():
  logits = jnp.array([[2.0, 0.0, -1.0], [0.5, 0.5, 3.0]])
  labels = jnp.array([0, 2])
  expected = -np.mean([jax.nn.log_softmax(logits[0])[0], jax.nn.log_softmax(logits[1])[2]])
  np.testing.assert_allclose(
    steps.cross_entropy(logits, labels, loss='softmax'), expected, rtol=1e-6
  )
  smooth = steps.cross_entropy(logits, labels, loss='softmax', label_smoothing=0.3)
  targets = np.array([[0.8, 0.1, 0.1], [0.1, 0.1, 0.8]])
  np.testing.assert_allclose(
    smooth, -np.mean(np.sum(targets * jax.nn.log_softmax(logits), -1)), rtol=1e-6
  )


def test_sigmoid_cross_entropy_sums_classes():
  logits = jnp.array([[2.0, -1.0, 0.0]])
  multi_hot = jnp.array([[1.0, 0.0, 1.0]])
  p = 1 / (1 + np.exp(-np.array([2.0, -1.0, 0.0])))
  expected = -(np.log(p[0]) + np.log(1 - p[1]) + np.log(p[2]))
  np.testing.assert_allclose(
    steps.cross_entropy(logits, multi_hot, loss='sigmoid'), expected, rtol=1e-6
  )


@pytest.mark.parametrize('decay_type, end', [('linear', 1e-5), ('cosine', 0.0)])
def test_schedule(decay_type, end):
  config = small_config(decay_type=decay_type)
  schedule = optim.learning_rate_schedule(config)
  np.testing.assert_allclose(schedule(0), 0.0)
  np.testing.assert_allclose(schedule(5), 0.5e-3, rtol=1e-6)
  np.testing.assert_allclose(schedule(10), 1e-3, rtol=1e-6)
  np.testing.assert_allclose(schedule(100), end, atol=1e-9)
  half = (1e-3 + end) / 2  # both decays are halfway to their end halfway through the decay
  np.testing.assert_allclose(schedule(55), half, rtol=1e-5)


@pytest.mark.parametrize('on', ['kernels', 'all'])
def test_weight_decay_applies_to_kernels_only_or_to_all(on):
  config = small_config(grad_norm_clip=0.0, weight_decay_on=on)
  tx, schedule = optim.make_optimizer(config)
  params = {
    'dense': {'kernel': jnp.ones((2, 2)), 'bias': jnp.ones(2)},
    'LayerNorm_0': {'scale': jnp.ones(2)},
    'cls': jnp.ones((1, 1, 2)),
  }
  zero_grads = jax.tree.map(jnp.zeros_like, params)
  state = tx.init(params)
  for _ in range(11):  # to the end of warm-up: lr = 1e-3
    updates, state = tx.update(zero_grads, state, params)
  np.testing.assert_allclose(updates['dense']['kernel'], -1e-3 * 0.1, rtol=1e-5)
  for leaf in (updates['dense']['bias'], updates['LayerNorm_0']['scale'], updates['cls']):
    np.testing.assert_allclose(leaf, -1e-3 * 0.1 if on == 'all' else 0.0, rtol=1e-5)
  assert schedule(10) == pytest.approx(1e-3)


def test_sgd_momentum_matches_optax_reference():
  config = small_config(optimizer='sgd', weight_decay=0.0, grad_norm_clip=0.0, decay_type='cosine')
  tx, schedule = optim.make_optimizer(config)
  reference = optax.sgd(schedule, momentum=0.9)
  params = {'w': jnp.array([1.0, -2.0])}
  s1, s2 = tx.init(params), reference.init(params)
  for i in range(15):
    grads = {'w': jnp.array([0.3, -0.1]) * (i + 1)}
    u1, s1 = tx.update(grads, s1, params)
    u2, s2 = reference.update(grads, s2, params)
    np.testing.assert_allclose(u1['w'], u2['w'], rtol=1e-6)


def test_gradient_clipping_at_global_norm():
  config = small_config(
    optimizer='sgd',
    momentum=0.0,
    weight_decay=0.0,
    grad_norm_clip=1.0,
    warmup_steps=0,
    decay_type='linear',
    base_lr=1.0,
  )
  tx, _ = optim.make_optimizer(config)
  params = {'w': jnp.zeros(2)}
  updates, _ = tx.update({'w': jnp.array([30.0, 40.0])}, tx.init(params), params)
  np.testing.assert_allclose(updates['w'], [-0.6, -0.8], rtol=1e-5)  # norm 50 -> 1


@pytest.mark.slow
@pytest.mark.equivalence
def test_accumulation_matches_one_big_batch():
  """4 micro-batches against one batch of 16, three plain SGD steps: the same sums in another
  order, so loss, gradient norm and parameters agree normwise within 1e-5 (170 float32 ulps,
  over 10x the spread measured across CPUs: benchmarks/20261125T1527_equivalence_spread.json)."""
  data = batch(16)
  results = []
  for accum in (1, 4):
    # Plain SGD: parameter differences are gradient differences (Adam's
    # normalisation would magnify rounding in near-zero gradients).
    state, step, mesh = setup(
      small_config(accum_steps=accum, optimizer='sgd', momentum=0.0, base_lr=0.1)
    )
    with jax.set_mesh(mesh):
      for _ in range(3):
        state, metrics = step(state, data)
    results.append((state.params, float(metrics['loss']), float(metrics['grad_norm'])))
  (p1, l1, g1), (p4, l4, g4) = results
  assert_close({'loss': abs(l4 - l1) / l1, 'grad_norm': abs(g4 - g1) / g1}, 1e-5, 'metrics')
  assert_trees_close(p4, p1, 1e-5, 'parameters')
  leaves1 = jax.tree.leaves(p1)
  # The steps did change the parameters (so equality above is not vacuous).
  state0, _, _ = setup(small_config())
  moved = [float(jnp.max(jnp.abs(a - b))) for a, b in zip(leaves1, jax.tree.leaves(state0.params))]
  assert max(moved) > 1e-4


@pytest.mark.slow
def test_nonfinite_step_changes_nothing():
  state, step, mesh = setup(small_config())
  bad = batch(16)
  bad['image'][3, 0, 0, 0] = np.nan
  with jax.set_mesh(mesh):
    new_state, metrics = step(state, bad)
  assert not bool(metrics['finite'])
  assert int(new_state.num_skipped) == 1 and int(new_state.step) == 1
  for a, b in zip(jax.tree.leaves(new_state.params), jax.tree.leaves(state.params)):
    np.testing.assert_array_equal(a, b)
  with jax.set_mesh(mesh):
    good_state, metrics = step(new_state, batch(16))
  assert bool(metrics['finite']) and int(good_state.num_skipped) == 1


@pytest.mark.slow
def test_ema_tracks_params():
  config = small_config(ema_decay=0.5)
  task = steps.make_task(config, 5, multi_label=False)
  tx, schedule = optim.make_optimizer(config)
  state = init_state(task, tx, ema=True)
  step = jax.jit(
    functools.partial(steps.train_step, task=task, tx=tx, schedule=schedule, config=config)
  )
  with jax.set_mesh(sharding.make_mesh()):
    new_state, _ = step(state, batch(16))
  for e, p0, p1 in zip(
    *(jax.tree.leaves(t) for t in (new_state.ema_params, state.params, new_state.params))
  ):
    np.testing.assert_allclose(e, 0.5 * p0 + 0.5 * p1, rtol=1e-6, atol=1e-7)


def test_fsdp_rule():
  assert sharding.fsdp_spec((768, 3072), 4, 1024) == jax.sharding.PartitionSpec(None, 'fsdp')
  assert sharding.fsdp_spec((768,), 4, 1024) == jax.sharding.PartitionSpec()  # too small
  assert sharding.fsdp_spec((1, 197, 768), 4, 1024) == jax.sharding.PartitionSpec(
    None, None, 'fsdp'
  )
  assert sharding.fsdp_spec((7, 5), 2, 1) == jax.sharding.PartitionSpec()  # nothing divides
  assert sharding.fsdp_spec((768, 3072), 1, 1) == jax.sharding.PartitionSpec()


def test_classification_counts_top1_top5_and_masks():
  logits = jnp.array(
    [
      [5.0, 4.0, 3.0, 2.0, 1.0, 0.0],  # label 0: top-1
      [5.0, 4.0, 3.0, 2.0, 1.0, 0.0],  # label 4: top-5 only
      [5.0, 4.0, 3.0, 2.0, 1.0, 0.0],  # label 5: neither
      [0.0, 0.0, 0.0, 0.0, 0.0, 9.0],
    ]
  )  # padding (mask 0), "correct"
  labels = jnp.array([0, 4, 5, 5])
  mask = jnp.array([1.0, 1.0, 1.0, 0.0])
  counts = metrics.classification_counts(logits, labels, mask, multi_label=False)
  assert {k: float(v) for k, v in counts.items()} == {
    'correct': 1.0,
    'count': 3.0,
    'correct_top5': 2.0,
  }
  multi_hot = jnp.array(
    [
      [0.0, 1.0, 0.0, 0.0, 0.0, 0.0],
      [1.0, 0.0, 0.0, 0.0, 0.0, 1.0],
      [0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
      [0.0, 0.0, 0.0, 0.0, 0.0, 1.0],
    ]
  )
  counts = metrics.classification_counts(logits, multi_hot, mask, multi_label=True)
  assert {k: float(v) for k, v in counts.items()} == {'correct': 1.0, 'count': 3.0}


@pytest.mark.slow
def test_mpp_task_trains_and_counts_corrupted_patches():
  config = small_config(task='mpp', model='ViT-Demo_4', optimizer='adam', base_lr=1e-3)
  task = steps.make_task(config, num_classes=10, multi_label=False)
  tx, schedule = optim.make_optimizer(config)
  state = init_state(task, tx, ema=False)
  assert 'mask_token' in state.params and 'mpp_head' in state.params
  data = {**batch(8), 'mask': np.array([1.0] * 6 + [0.0] * 2, np.float32)}
  counts = jax.jit(task.eval_fn)(state.params, data)
  # Half of the 16 patches of each of the 6 real images are corrupted.
  assert float(counts['count']) == 6 * 8
  step = jax.jit(
    functools.partial(steps.train_step, task=task, tx=tx, schedule=schedule, config=config)
  )
  with jax.set_mesh(sharding.make_mesh()):
    new_state, metrics = step(state, data)
    new_state, metrics = step(new_state, data)  # the first step has learning rate 0
  assert bool(metrics['finite']) and float(metrics['loss']) > 0
  assert not np.allclose(new_state.params['mask_token'], state.params['mask_token'])


# ---------------------------------------------------------------------------
# What crosses to the devices: uint8 pixels, made [-1, 1] (and mixed) inside the step.


def _host_floats(pixels):
  """The host's [-1, 1] floats (`images.to_float`): uint8 / 127.5 - 1 in NumPy's float32."""
  return np.subtract(np.divide(pixels, np.float32(127.5), dtype=np.float32), np.float32(1.0))


def _device_floats(pixels):
  """What `on_device.normalise` computes, in NumPy: (x - 127.5) * (1 / 127.5), one rounding."""
  return np.multiply(
    np.subtract(pixels, np.float32(127.5), dtype=np.float32), np.float32(1 / 127.5)
  )


def _capturing(task, seen):
  """`task` whose loss hands the batch it is given (inside the jitted step) to `seen`."""

  def keep(image, label):
    seen.append((np.asarray(image), np.asarray(label)))

  def loss_fn(params, batch, rng, train):
    jax.debug.callback(keep, batch['image'], batch['label'])
    return task.loss_fn(params, batch, rng, train)

  return task._replace(loss_fn=loss_fn)


@pytest.mark.equivalence  # Mixup: NumPy's float32 mix against XLA's (see below)
@pytest.mark.parametrize('mixup', [0.0, 0.4])
def test_the_device_gets_uint8_and_the_step_the_hosts_floats(mixup):
  from vit_jax.data import pipeline
  from vit_jax.training import program

  config = small_config(batch=32, dataset='digits', input_threads=2)
  config.pp.mixup = mixup
  mesh = sharding.make_mesh()
  built = program.build(config, mesh, num_classes=10, multi_label=False)
  raw = next(pipeline.make_train_iterator(config, built.batch_sharding, raw=True))
  # What crosses: uint8 pixels laid out over the batch axis, as the compiled step expects.
  assert raw['image'].dtype == np.uint8 and raw['image'].sharding == built.batch_sharding
  spec = built.abstract_batch()
  assert {k: (v.shape, v.dtype) for k, v in raw.items()} == {
    k: (v.shape, v.dtype) for k, v in spec.items()
  }
  assert ('mixup' in raw) == (mixup > 0)
  seen = []
  step = steps.jit_train_step(
    task=_capturing(built.task, seen), tx=built.tx, schedule=built.schedule, config=config,
    state_shardings=built.state_shardings, batch_sharding=built.batch_sharding,
  )  # fmt: skip
  with jax.set_mesh(mesh):
    state = jax.jit(built.init, out_shardings=built.state_shardings)(jax.random.PRNGKey(0))
    jax.block_until_ready(step(state, raw))
  (image, label), = seen  # fmt: skip
  pixels, labels = np.asarray(raw['image']), np.asarray(raw['label'])
  want = _device_floats(pixels)
  if not mixup:  # the floats of one rounding of (x - 127.5) * (1 / 127.5): bitwise
    np.testing.assert_array_equal(image.view(np.uint32), want.view(np.uint32))
    np.testing.assert_array_equal(label, labels)
    return
  # Mixup as the host did it: each image with its neighbour, p >= 1/2 for the whole step.
  p = np.asarray(raw['mixup'])
  assert np.all(p == p[0]) and 0.5 <= p[0] < 1
  pair = lambda x: x.reshape(-1, 2, *x.shape[1:])[:, ::-1].reshape(x.shape)  # noqa: E731
  one_hot = np.eye(10, dtype=np.float32)[labels]
  np.testing.assert_array_equal(label, p[0] * one_hot + (np.float32(1) - p[0]) * pair(one_hot))
  # XLA may fuse p * x + (1 - p) * y into a multiply-add: one rounding instead of three,
  # within 2 ulps of values in [-1, 1] (2 * 2^-24 relative to 1).
  mixed = p[0] * want + (np.float32(1) - p[0]) * pair(want)
  assert np.abs(image - mixed).max() <= 2**-23


def test_every_pixel_value_normalises_within_its_bound_of_the_host():
  """The device's (x - 127.5) * (1 / 127.5) is exact up to one rounding, whatever the backend
  fuses: bitwise NumPy's two operations, and within MAX_DIFFERENCE (2^-24) of the host's
  x / 127.5 - 1 (TensorFlow's operations, whose own two roundings make it no more exact)."""
  from vit_jax.data import images
  from vit_jax.data import on_device

  pixels = np.arange(256, dtype=np.uint8).reshape(1, 16, 16, 1)
  got = np.asarray(jax.jit(on_device.normalise)(pixels))
  np.testing.assert_array_equal(got.view(np.uint32), _device_floats(pixels).view(np.uint32))
  host = images.to_float(pixels)
  np.testing.assert_array_equal(host, _host_floats(pixels))
  assert np.abs(got - host).max() == on_device.MAX_DIFFERENCE
  assert np.count_nonzero(got != host) == 174
  exact = (2 * pixels.astype(np.float64) - 255) / 255
  assert np.abs(got - exact).max() < 1.25 * 2**-24  # half an ulp of 1 and a quarter
  assert got.min() == -1.0 and got.max() == 1.0 and got.flat[127] < 0 < got.flat[128]
  floats = np.linspace(-1, 1, 8, dtype=np.float32)
  assert on_device.normalise(floats) is floats  # already the model's input
  with pytest.raises(TypeError, match='uint8 pixels or floats'):
    on_device.normalise(np.zeros(3, np.int32))


@pytest.mark.equivalence
def test_parameters_cast_once_per_step_train_as_the_layers_casting_them():
  """bf16 training casts the float32 parameters to bf16 once, at the top of the loss
  (`vit.compute_params`), instead of in every layer: the layers compute with the
  very same bf16 values, so loss and gradients equal those of the model applied to the
  float32 parameters (normwise within 1e-6: the same operations, fused differently), the
  gradients come back float32, and both stay within bf16's 5% of float32 training."""
  config = small_config(dtype='bfloat16', dropout_rate=0.0, attention_dropout_rate=0.0)
  task = steps.make_task(config, 5, multi_label=False)
  f32_task = steps.make_task(small_config(dropout_rate=0.0, attention_dropout_rate=0.0), 5, False)
  params = jax.tree.map(
    lambda x: x + 0.05 * jnp.sin(jnp.arange(x.size, dtype=jnp.float32)).reshape(x.shape),
    init_state(task, optax.sgd(0.1), ema=False).params,
  )  # every leaf non-zero, the head too
  data, rng = batch(), jax.random.PRNGKey(1)

  def per_layer_casts(p, b, r, train):  # the bf16 model given the float32 parameters
    logits = task.model.apply({'params': p}, b['image'], train=train, rngs={'dropout': r})
    return steps.cross_entropy(logits, b['label'], loss='softmax')

  def grad(loss_fn):
    return jax.jit(jax.value_and_grad(functools.partial(loss_fn, train=True)))(params, data, rng)

  (loss, grads), (loss_layers, grads_layers) = grad(task.loss_fn), grad(per_layer_casts)
  (loss_f32, grads_f32) = grad(f32_task.loss_fn)
  assert {x.dtype for x in jax.tree.leaves(grads)} == {jnp.dtype('float32')}
  assert_close(abs(loss - loss_layers) / loss_layers, 1e-6, 'loss against per-layer casts')
  assert_trees_close(grads, grads_layers, 1e-6, 'gradients against per-layer casts')
  assert_close(abs(loss - loss_f32) / loss_f32, 0.05, 'bf16 loss against float32')
  assert_trees_close(grads, grads_f32, 0.05, 'bf16 gradients against float32')


@pytest.mark.parametrize('scanned', [False, True])
def test_layer_decay_scales_each_depths_step(scanned):
  """layer_decay r over L = 2 blocks: the head's step is the plain one, block 1's r, block 0's
  r^2, the embeddings' r^3 (unrolled blocks, or a scanned stack's leading axis)."""
  config = small_config(grad_norm_clip=0.0, weight_decay=0.0, optimizer='sgd', layer_decay=0.5)
  tx, _ = optim.make_optimizer(config)
  ones = lambda *shape: jnp.ones(shape)  # noqa: E731
  if scanned:
    blocks = {'encoderblock': {'Dense_0': {'kernel': ones(2, 3, 3)}}}
  else:
    blocks = {f'encoderblock_{i}': {'Dense_0': {'kernel': ones(3, 3)}} for i in range(2)}
  params = {
    'embedding': {'kernel': ones(2, 2)},
    'conv_root': {'kernel': ones(2, 2)},  # a hybrid's ResNet: before the blocks too
    'cls': ones(1, 1, 3),
    'Transformer': {'posembed_input': {'pos_embedding': ones(1, 4, 3)}, **blocks},
    'head': {'kernel': ones(3, 5)},
  }
  state = tx.init(params)
  for _ in range(11):  # to the end of warm-up: lr = 1e-3
    updates, state = tx.update(jax.tree.map(jnp.ones_like, params), state, params)
  plain = updates['head']['kernel'][0, 0]
  assert plain < 0
  ratio = lambda x: np.asarray(x / plain)  # noqa: E731
  np.testing.assert_allclose(ratio(updates['embedding']['kernel']), 0.125, rtol=1e-6)
  np.testing.assert_allclose(ratio(updates['cls']), 0.125, rtol=1e-6)
  np.testing.assert_allclose(ratio(updates['conv_root']['kernel']), 0.125, rtol=1e-6)
  posemb = updates['Transformer']['posembed_input']['pos_embedding']
  np.testing.assert_allclose(ratio(posemb), 0.125, rtol=1e-6)
  t = updates['Transformer']
  if scanned:
    per_block = ratio(t['encoderblock']['Dense_0']['kernel'])
    np.testing.assert_allclose(per_block[0], 0.25, rtol=1e-6)
    np.testing.assert_allclose(per_block[1], 0.5, rtol=1e-6)
  else:
    np.testing.assert_allclose(ratio(t['encoderblock_0']['Dense_0']['kernel']), 0.25, rtol=1e-6)
    np.testing.assert_allclose(ratio(t['encoderblock_1']['Dense_0']['kernel']), 0.5, rtol=1e-6)
