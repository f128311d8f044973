"""Masked patch prediction: colour targets, corruption statistics, loss, checkpoint hand-off."""

import math

from conftest import assert_trees_close
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from vit_jax import checkpoint
from vit_jax import models
from vit_jax.configs import architectures
from vit_jax.configs.model_spec import Architecture
from vit_jax.models import mpp


def tiled(colours, patch=4):
  """An image whose patches (row-major over a grid) are filled with `colours`."""
  colours = np.asarray(colours, np.float32)  # [gh, gw, 3]
  return np.repeat(np.repeat(colours, patch, axis=0), patch, axis=1)[None]


def test_colour_targets_of_hand_made_patches():
  image = tiled([[[-1, -1, -1], [1, 1, 1], [1, -1, -1]], [[-1, 1, -1], [-1, -1, 1], [0, 0, 0]]])
  # black, white, red = 7*64, green = 7*8, blue = 7, mid-grey = 4*64 + 4*8 + 4
  np.testing.assert_array_equal(mpp.colour_targets(image, (4, 4)), [[0, 511, 448, 56, 7, 292]])
  # Level boundaries: level k holds means in [-1 + k/4, -1 + (k+1)/4).
  edges = tiled([[[-0.25, -0.2500001, 0.75], [0.9999, -0.75, -0.7500001]]])
  np.testing.assert_array_equal(
    mpp.colour_targets(edges, (4, 4)), [[3 * 64 + 2 * 8 + 7, 7 * 64 + 1 * 8 + 0]]
  )


def test_colour_targets_use_the_patch_mean():
  rng = np.random.default_rng(0)
  image = rng.uniform(-1, 1, size=(2, 8, 12, 3)).astype(np.float32)
  expected = np.zeros((2, 6), np.int64)
  for b in range(2):
    for i in range(2):
      for j in range(3):
        mean = image[b, 4 * i : 4 * i + 4, 4 * j : 4 * j + 4].mean(axis=(0, 1))
        r, g, bl = (min(int((m + 1) / 2 * 8), 7) for m in mean)
        expected[b, 3 * i + j] = r * 64 + g * 8 + bl
  np.testing.assert_array_equal(mpp.colour_targets(image, (4, 4)), expected)
  with pytest.raises(ValueError, match='do not tile into 5x5 RGB patches'):
    mpp.colour_targets(image, (5, 5))


def within(count, n, p, sigmas=5.0):
  """`count` is a plausible Binomial(n, p) draw: within `sigmas` standard deviations."""
  return abs(count - n * p) <= sigmas * math.sqrt(n * p * (1 - p))


def test_corruption_proportions():
  batch, patches = 256, 196
  c = mpp.sample_corruption(jax.random.key(0), batch, patches)
  corrupted, masked, replaced = (np.asarray(a) for a in (c.corrupted, c.masked, c.replaced))
  # Exactly half of every image.
  np.testing.assert_array_equal(corrupted.sum(axis=1), np.full(batch, 98))
  assert not (masked & ~corrupted).any() and not (replaced & ~corrupted).any()
  assert not (masked & replaced).any()
  n = int(corrupted.sum())
  assert within(masked.sum(), n, 0.8)
  assert within(replaced.sum(), n, 0.1)
  assert within((corrupted & ~masked & ~replaced).sum(), n, 0.1)
  # Every position is equally likely to be corrupted (each is Binomial(batch, 1/2)).
  per_position = corrupted.sum(axis=0)
  assert all(within(k, batch, 0.5, sigmas=4.5) for k in per_position)
  # Replacements come from another position of the same image, uniformly.
  source = np.asarray(c.source)
  assert (source != np.arange(patches)).all()
  assert source.min() == 0 and source.max() == patches - 1
  offsets = (source - np.arange(patches)) % patches
  counts = np.bincount(offsets.ravel(), minlength=patches)[1:]
  assert all(within(k, batch * patches, 1 / (patches - 1)) for k in counts)


def test_apply_corruption_replaces_exactly_the_chosen_positions():
  x = jnp.arange(2 * 4 * 3, dtype=jnp.float32).reshape(2, 4, 3)
  token = jnp.full((1, 1, 3), -7.0)
  c = mpp.Corruption(
    corrupted=jnp.array([[1, 1, 1, 0], [0, 1, 0, 1]], bool),
    masked=jnp.array([[1, 0, 0, 0], [0, 0, 0, 1]], bool),
    replaced=jnp.array([[0, 1, 0, 0], [0, 1, 0, 0]], bool),
    source=jnp.array([[1, 3, 0, 0], [1, 2, 3, 0]], jnp.int32),
  )
  out = np.asarray(mpp.apply_corruption(x, c, token))
  expected = np.asarray(x).copy()
  expected[0, 0] = -7.0
  expected[0, 1] = x[0, 3]
  expected[1, 3] = -7.0
  expected[1, 1] = x[1, 2]
  np.testing.assert_array_equal(out, expected)


def test_loss_counts_corrupted_positions_only():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(3, 8, mpp.NUM_COLOURS)).astype(np.float32)
  targets = rng.integers(0, mpp.NUM_COLOURS, size=(3, 8))
  weights = rng.random((3, 8)) < 0.5
  loss, metrics = mpp.masked_cross_entropy(logits, targets, weights)
  changed = logits.copy()
  changed[~weights] = rng.normal(size=changed[~weights].shape) * 10
  np.testing.assert_array_equal(mpp.masked_cross_entropy(changed, targets, weights)[0], loss)
  changed[weights] += rng.normal(size=changed[weights].shape)
  assert mpp.masked_cross_entropy(changed, targets, weights)[0] != loss
  # Independent reference: mean negative log-likelihood over the chosen positions.
  log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  nll = -np.take_along_axis(log_probs, targets[..., None], -1)[..., 0]
  assert float(loss) == pytest.approx(nll[weights].mean(), rel=1e-5)
  assert float(metrics['accuracy']) == pytest.approx((logits.argmax(-1) == targets)[weights].mean())
  assert int(metrics['num_corrupted']) == weights.sum()
  # Uniform logits: log(512).
  uniform = mpp.masked_cross_entropy(np.zeros_like(logits), targets, weights)[0]
  assert float(uniform) == pytest.approx(math.log(512), rel=1e-6)


def tiny_config():
  config = architectures.MODEL_CONFIGS['testing']
  config.patches.size = (8, 8)
  config.transformer.update(num_layers=2, num_heads=2, mlp_dim=64)
  config.hidden_size = 32
  return config


@pytest.mark.slow
def test_mpp_learns_to_fill_in_patches_from_their_context():
  """Images of one colour each: a corrupted patch's colour is its neighbours'."""
  model = mpp.MppViT(Architecture.of(tiny_config()))
  rng = np.random.default_rng(0)
  colours = rng.uniform(-1, 1, size=(32, 1, 1, 3)).astype(np.float32)
  images = jnp.asarray(np.broadcast_to(colours, (32, 32, 32, 3)))  # 16 patches each
  init = jax.jit(lambda key: model.init(key, images[:1], train=False))
  params = init(jax.random.key(0))['params']
  tx = optax.adam(3e-3)
  opt_state = tx.init(params)

  @jax.jit
  def step(params, opt_state, rng):
    grads, metrics = jax.grad(mpp.loss_fn, has_aux=True)(
      params, images, rng, model=model, train=True
    )
    updates, opt_state = tx.update(grads, opt_state)
    return optax.apply_updates(params, updates), opt_state, metrics

  evaluate = jax.jit(lambda params, rng: mpp.loss_fn(params, images, rng, model=model, train=False))
  first = evaluate(params, jax.random.key(1))[1]
  assert float(first['loss']) > 5.0  # chance is log(512) = 6.2
  for i in range(100):
    params, opt_state, _ = step(params, opt_state, jax.random.key(100 + i))
  last = evaluate(params, jax.random.key(2))[1]
  assert float(last['loss']) < 0.5  # measured 0.05
  assert float(last['accuracy']) > 0.9  # 80% of the targets were behind the mask token
  assert int(last['num_corrupted']) == 32 * 8


@pytest.mark.slow
@pytest.mark.equivalence
def test_mpp_checkpoint_fine_tunes_as_a_classifier(tmp_path, capsys):
  config = tiny_config()
  mpp_model = mpp.MppViT(Architecture.of(config))
  images = jax.random.uniform(jax.random.key(0), (2, 32, 32, 3), minval=-1, maxval=1)
  mpp_params = mpp_model.init(jax.random.key(1), images, train=False)['params']
  assert set(mpp_params) == {'embedding', 'cls', 'Transformer', 'mask_token', 'mpp_head'}
  path = checkpoint.save_npz(mpp_params, tmp_path / 'mpp.npz')

  model = models.VisionTransformer(num_classes=10, **config)
  init = model.init(jax.random.key(2), images, train=False)['params']
  params = checkpoint.load_pretrained(pretrained_path=path, init_params=init, model_config=config)
  checkpoint.check_tree(params, init)
  table = capsys.readouterr().out
  assert 'dropped         mask_token (1, 1, 32)' in table
  assert 'dropped         mpp_head/kernel (32, 512)' in table
  assert 're-initialised  head/kernel (32, 10)' in table

  # The classifier's encoder computes what the MPP encoder computed, uncorrupted.
  _, mpp_state = mpp_model.apply(
    {'params': mpp_params}, images, train=False, mutable=['intermediates']
  )
  _, vit_state = model.apply({'params': params}, images, train=False, mutable=['intermediates'])
  last = lambda s: s['intermediates']['Transformer']['encoderblock_1']['tokens'][0]  # noqa: E731
  # The same float32 ops in two modules: normwise within 1e-5.
  assert_trees_close(last(vit_state), last(mpp_state), 1e-5, 'encoder tokens')


def test_mpp_backbone_is_the_vits_parameter_for_parameter():
  """One front half (patches, class token, encoder): the same names, shapes and initial values
  as the classifier's, so an MPP checkpoint is a ViT backbone as it stands."""
  config = tiny_config()
  images = jnp.zeros((1, 32, 32, 3))
  ours = mpp.MppViT(Architecture.of(config)).init(jax.random.key(3), images, train=False)['params']
  vit = models.VisionTransformer(num_classes=None, **config)
  theirs = vit.init(jax.random.key(3), images, train=False)['params']
  assert set(theirs) == {'embedding', 'cls', 'Transformer'}
  jax.tree.map(np.testing.assert_array_equal, {k: ours[k] for k in theirs}, theirs)


def test_mpp_refuses_hybrids():
  config = architectures.MODEL_CONFIGS['R50+ViT-B_16']
  with pytest.raises(ValueError, match='masked patch prediction works on plain ViTs'):
    mpp.MppViT(Architecture.of(config)).init(
      jax.random.key(0), jnp.zeros((1, 32, 32, 3)), train=False
    )
