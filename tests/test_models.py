"""Model structure and numerics: exact parameter counts, dtype, intermediates."""

import re

from conftest import assert_close
from conftest import assert_trees_close
from conftest import map_head_parameter_count
from conftest import random_like
from conftest import small_vit_config
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vit_jax import checkpoint
from vit_jax import models
from vit_jax.configs import architectures
from vit_jax.configs import families
from vit_jax.configs import models as official_models
from vit_jax.models import resnet
from vit_jax.models import vit

# ../shared/REFERENCE.md section 1: 1000 classes, 224 px, no pre-logits.
REFERENCE_PARAM_COUNTS = {
  'ViT-Ti_16': 5_717_416,
  'ViT-S_16': 22_050_664,
  'ViT-S_32': 22_878_952,
  'ViT-B_8': 86_576_872,
  'ViT-B_16': 86_567_656,
  'ViT-B_32': 88_224_232,
  'ViT-L_16': 304_326_632,
  'ViT-L_32': 306_535_400,
  'ViT-H_14': 632_045_800,
  'R50+ViT-B_16': 98_659_112,
  'R26+ViT-B_32': 101_383_976,
  'R50+ViT-L_32': 328_994_856,
  'ViT-B_16-gap': 86_566_120,
}

# The official vit_jax's models_test.py MODEL_SIZES for its other ViT and
# hybrid names (1000 classes, 224 px); its Mixer and LiT names are out of scope.
OFFICIAL_PARAM_COUNTS = {
  **{k: v for k, v in REFERENCE_PARAM_COUNTS.items() if not k.endswith('-gap')},
  'R+ViT-Ti_16': 6_337_704,
  'R26+ViT-S_32': 36_431_912,
  'ViT-B_16-gap-norep': 86_566_120,
  'ViT-B_32-gap-norep': 88_222_696,
  'ViT-S_16-gap-norep': 22_049_896,
  'ViT-S_32-gap-norep': 22_878_184,
  'testing': 21_390,
  'testing-unpooled': 21_370,
}

# transformer.dropout_rate of the official model configs (0.0 elsewhere).
OFFICIAL_DROPOUT = {
  'ViT-L_16': 0.1,
  'ViT-H_14': 0.1,
  'R50+ViT-B_16': 0.1,
  'R50+ViT-L_32': 0.1,
  'testing': 0.1,
  'testing-unpooled': 0.1,
}


def param_shapes(name, num_classes=1000, size=224, **overrides):
  config = architectures.MODEL_CONFIGS[name]
  config.update(overrides)
  model = models.VisionTransformer(num_classes=num_classes, **config)
  images = jnp.zeros((1, size, size, 3))
  return jax.eval_shape(lambda: model.init(jax.random.key(0), images, train=False))['params']


def count(tree):
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


def test_registry_lists_every_public_and_official_name():
  missing = {*REFERENCE_PARAM_COUNTS, *OFFICIAL_PARAM_COUNTS} - set(architectures.MODEL_CONFIGS)
  assert not missing


def closed_form_count(config, num_classes=1000, size=224):
  """Parameters of a plain ViT, counted from its shapes by hand."""
  d, m = config.hidden_size, config.transformer.mlp_dim
  p = config.patches.size[0]
  tokens = (size // p) ** 2 + (config.classifier in ('token', 'token_unpooled'))
  block = 2 * 2 * d + (4 * d * d + 4 * d) + (d * m + m + m * d + d)
  return (
    (p * p * 3 * d + d)
    + map_head_parameter_count(d, m) * (config.classifier == 'map')
    + (d if tokens > (size // p) ** 2 else 0)
    + tokens * d
    + config.transformer.num_layers * block
    + 2 * d
    + (d * num_classes + num_classes)
  )


# The giant ViTs (configs.architectures.GIANTS) are counted in test_scale.py, scanned. The
# fast tier counts one model of each kind; the full-size rest are slow (seconds of tracing each).
_COUNTED_FAST = (
  'testing',
  'testing-map',
  'testing-unpooled',
  'ViT-Demo_4',
  'ViT-Ti_16',
  'ViT-B_16',
)


@pytest.mark.parametrize(
  'name',
  [
    n if n in _COUNTED_FAST else pytest.param(n, marks=pytest.mark.slow)
    for n in sorted(architectures.MODEL_CONFIGS)
    if n.removesuffix('-map') not in architectures.GIANTS
    and n not in families.MODELS  # counted against timm in test_families.py
  ],
)
def test_exact_parameter_count(name):
  n = count(param_shapes(name))
  if name in REFERENCE_PARAM_COUNTS:
    assert n == REFERENCE_PARAM_COUNTS[name]
  if name in OFFICIAL_PARAM_COUNTS:
    # Built as the official models_test builds it: get_model(name, num_classes=1000).
    model = models.get_model(name, num_classes=1000)
    init = lambda: model.init(jax.random.key(0), jnp.zeros((1, 224, 224, 3)), train=False)  # noqa: E731
    assert count(jax.eval_shape(init)['params']) == n == OFFICIAL_PARAM_COUNTS[name]
  config = architectures.MODEL_CONFIGS[name]
  if config.get('resnet') is None:
    assert n == closed_form_count(config)
  assert config.model_name == name
  base = name.replace('-gap-norep', '').replace('-gap', '')
  assert config.transformer.dropout_rate == OFFICIAL_DROPOUT.get(base, 0.0)
  assert config.transformer.attention_dropout_rate == 0.0


def test_official_config_functions_are_views_of_the_registry():
  getters = {
    'testing': 'testing',
    'testing_unpooled': 'testing-unpooled',
    'ti16': 'ViT-Ti_16',
    's16': 'ViT-S_16',
    'b16': 'ViT-B_16',
    'l16': 'ViT-L_16',
    'h14': 'ViT-H_14',
    's16_gap_norep': 'ViT-S_16-gap-norep',
    'b16_gap_norep': 'ViT-B_16-gap-norep',
    'b8': 'ViT-B_8',
    's32': 'ViT-S_32',
    'b32': 'ViT-B_32',
    'l32': 'ViT-L_32',
    's32_gap_norep': 'ViT-S_32-gap-norep',
    'b32_gap_norep': 'ViT-B_32-gap-norep',
    'r_ti16': 'R+ViT-Ti_16',
    'r50_b16': 'R50+ViT-B_16',
    'r26_b32': 'R26+ViT-B_32',
    'r26_s32': 'R26+ViT-S_32',
    'r50_l32': 'R50+ViT-L_32',
  }
  assert set(getters.values()) == set(OFFICIAL_PARAM_COUNTS)
  for short, name in getters.items():
    config = getattr(official_models, f'get_{short}_config')()
    assert config.to_dict() == architectures.MODEL_CONFIGS[name].to_dict(), short
  # The official AugReg names: file-name prefixes of the AugReg checkpoints.
  assert set(architectures.AUGREG_CONFIGS) == {
    'testing-unpooled',
    'Ti_16',
    'S_16',
    'B_16',
    'L_16',
    'S_16-gap-norep',
    'B_16-gap-norep',
    'B_8',
    'S_32',
    'B_32',
    'S_32-gap-norep',
    'B_32-gap-norep',
    'R_Ti_16',
    'R26_B_32',
    'R26_S_32',
    'R50_L_32',
  }
  assert architectures.AUGREG_CONFIGS['R_Ti_16'].model_name == 'R+ViT-Ti_16'


@pytest.mark.parametrize('name', ['Mixer-B_16', 'LiT-B16B'])
def test_mixer_and_lit_are_refused_in_one_line(name):
  message = f'{name}: MLP-Mixer and LiT models are not part of this package'
  assert name not in architectures.MODEL_CONFIGS
  with pytest.raises(KeyError, match=message):
    models.get_model(name, num_classes=1000)
  getter = {'Mixer-B_16': 'get_mixer_b16_config', 'LiT-B16B': 'get_lit_b16b_config'}[name]
  with pytest.raises(KeyError, match=message) as error:
    getattr(official_models, getter)()
  assert '\n' not in error.value.args[0]


def test_unpooled_outputs_logits_per_patch_as_the_official_model():
  model = models.get_model('testing-unpooled', num_classes=1000)
  images = jnp.ones((2, 224, 224, 3))
  params = jax.eval_shape(lambda: model.init(jax.random.key(0), images, train=False))
  outputs = jax.eval_shape(lambda p: model.apply(p, images, train=False), params)
  assert outputs.shape == (2, 196, 1000)


def test_registry_returns_independent_copies():
  config = architectures.MODEL_CONFIGS['ViT-B_16']
  config.transformer.num_layers = 3
  assert architectures.MODEL_CONFIGS['ViT-B_16'].transformer.num_layers == 12


def test_unknown_model_suggests_names():
  with pytest.raises(KeyError, match='did you mean ViT-B_16'):
    architectures.MODEL_CONFIGS['ViT-B16']


def test_hybrid_parameter_names_are_the_checkpoint_layout():
  keys = checkpoint.flatten(param_shapes('R50+ViT-B_16'))
  assert keys['conv_root/kernel'].shape == (7, 7, 3, 64)
  assert keys['gn_root/scale'].shape == (64,)
  assert keys['block3/unit9/conv3/kernel'].shape == (1, 1, 256, 1024)
  assert keys['block1/unit1/gn_proj/bias'].shape == (256,)
  assert keys['embedding/kernel'].shape == (1, 1, 1024, 768)
  # Total stride 16: a 14x14 feature map at 224 px, plus the class token.
  assert keys['Transformer/posembed_input/pos_embedding'].shape == (1, 197, 768)


def test_vit_b16_checkpoint_layout():
  keys = checkpoint.flatten(param_shapes('ViT-B_16', representation_size=768, num_classes=21843))
  block = 'Transformer/encoderblock_11/'
  expected = {
    'cls': (1, 1, 768),
    'embedding/kernel': (16, 16, 3, 768),
    'Transformer/posembed_input/pos_embedding': (1, 197, 768),
    block + 'LayerNorm_0/scale': (768,),
    block + 'MultiHeadDotProductAttention_1/query/kernel': (768, 12, 64),
    block + 'MultiHeadDotProductAttention_1/value/bias': (12, 64),
    block + 'MultiHeadDotProductAttention_1/out/kernel': (12, 64, 768),
    block + 'LayerNorm_2/bias': (768,),
    block + 'MlpBlock_3/Dense_0/kernel': (768, 3072),
    block + 'MlpBlock_3/Dense_1/kernel': (3072, 768),
    'Transformer/encoder_norm/scale': (768,),
    'pre_logits/kernel': (768, 768),
    'head/kernel': (768, 21843),
  }
  for key, shape in expected.items():
    assert keys[key].shape == shape, key
  # cls, embedding (2), posemb, 12 blocks of 16 arrays, encoder_norm, pre_logits, head (2 each).
  assert len(keys) == 1 + 2 + 1 + 12 * 16 + 2 + 2 + 2


def _tiny(**overrides):
  config = architectures.MODEL_CONFIGS['testing']
  config.update(hidden_size=32, patches={'size': (4, 4)})
  config.transformer.update(num_layers=2, num_heads=4, mlp_dim=64)
  config.update(overrides)
  return config


def _random_params(model, images, seed=0):
  """Initialised params with every leaf randomised (zeros hide layout bugs)."""
  # Only the shapes are needed (every leaf is replaced): no eager init.
  # Drawn by numpy: a JAX draw per leaf shape would compile a kernel per shape.
  shapes = jax.eval_shape(lambda: model.init(jax.random.key(seed), images, train=False))['params']
  return random_like(shapes, seed + 1, scale=0.1)


def test_head_is_zero_initialised_with_bias_init():
  model = models.VisionTransformer(num_classes=5, head_bias_init=-10.0, **_tiny())
  init = jax.jit(lambda key: model.init(key, jnp.zeros((1, 16, 16, 3)), train=False))
  params = init(jax.random.key(0))['params']
  np.testing.assert_array_equal(params['head']['kernel'], 0)
  np.testing.assert_array_equal(params['head']['bias'], -10)
  np.testing.assert_array_equal(params['cls'], 0)


@pytest.mark.parametrize(
  'classifier, shape',
  [
    ('token', (2, 32)),
    ('gap', (2, 32)),
    ('unpooled', (2, 16, 32)),
    ('token_unpooled', (2, 17, 32)),
  ],
)
def test_classifier_outputs(classifier, shape):
  model = models.VisionTransformer(num_classes=None, **_tiny(classifier=classifier))
  images = jax.random.uniform(jax.random.key(1), (2, 16, 16, 3), minval=-1, maxval=1)
  params = _random_params(model, images)
  features = model.apply({'params': params}, images, train=False)
  assert features.shape == shape
  tokens = model.apply({'params': params}, images, train=False, mutable=['intermediates'])[1][
    'intermediates'
  ]
  if classifier == 'gap':
    # Mean over the final (normalised) tokens; recompute it from the last block.
    last = tokens['Transformer']['encoderblock_1']['tokens'][0]
    norm = params['Transformer']['encoder_norm']
    mu, var = last.mean(-1, keepdims=True), last.var(-1, keepdims=True)
    normed = (last - mu) / jnp.sqrt(var + 1e-6) * norm['scale'] + norm['bias']
    np.testing.assert_allclose(features, normed.mean(1), rtol=1e-5, atol=1e-5)


@pytest.mark.equivalence
@pytest.mark.parametrize('attention', ['explicit', 'xla'])
def test_attention_weights_and_fast_path_agree(attention):
  """The forward with and without recording attention weights: logits agree normwise within
  1e-5 (the same float32 ops, fused differently)."""
  model = models.VisionTransformer(num_classes=7, attention=attention, **_tiny())
  images = jax.random.uniform(jax.random.key(2), (2, 16, 16, 3), minval=-1, maxval=1)
  params = _random_params(model, images)
  fast = model.apply({'params': params}, images, train=False)
  slow, state = model.apply({'params': params}, images, train=False, mutable=['intermediates'])
  assert_trees_close(fast, slow, 1e-5, 'logits')
  block = state['intermediates']['Transformer']['encoderblock_0']
  weights = block['MultiHeadDotProductAttention_1']['attention_weights'][0]
  assert weights.shape == (2, 4, 17, 17)
  np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=1e-5)
  assert block['tokens'][0].shape == (2, 17, 32)


@pytest.mark.slow
@pytest.mark.equivalence
def test_attention_implementations_agree_in_values_and_gradients():
  """'explicit' (head-major, normalised after the weighted sum) against
  jax.nn.dot_product_attention's XLA implementation: the same softmax attention in another
  order of float32 operations, so loss and gradients agree normwise within 1e-5."""
  images = jax.random.uniform(jax.random.key(4), (3, 16, 16, 3), minval=-1, maxval=1)
  labels = jnp.array([1, 4, 6])
  results = []
  for attention in ('explicit', 'xla'):
    model = models.VisionTransformer(num_classes=7, attention=attention, **_tiny())
    params = _random_params(model, images)

    def loss(p, model=model):
      logits = model.apply({'params': p}, images, train=False)
      return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], 1))

    results.append(jax.jit(jax.value_and_grad(loss))(params))
  (value_a, grads_a), (value_b, grads_b) = results
  assert_close(abs(value_a - value_b) / value_b, 1e-5, 'loss')
  # The key bias's gradient is 0 in exact arithmetic (softmax ignores a shift):
  # rounding noise, measured against the largest gradient (conftest.tree_errors).
  assert_trees_close(grads_a, grads_b, 1e-5, 'gradients')
  with pytest.raises(ValueError, match='attention='):
    models.VisionTransformer(num_classes=7, attention='flash', **_tiny()).init(
      jax.random.key(0), images, train=False
    )


@pytest.mark.slow
@pytest.mark.equivalence
def test_bfloat16_compute_float32_params():
  """bf16 compute against float32: logits within 5% of their largest magnitude. bf16 keeps
  8 significant bits (rounding 2^-9 = 0.2% per op), compounded over two blocks' matmuls,
  softmax and norms; a float32 op left in bf16 or vice versa is caught by the dtype check."""
  config = _tiny()
  images = jax.random.uniform(jax.random.key(3), (2, 16, 16, 3), minval=-1, maxval=1)
  f32 = models.VisionTransformer(num_classes=7, **config)
  bf16 = models.VisionTransformer(num_classes=7, dtype=jnp.bfloat16, **config)
  params = _random_params(f32, images)
  init_bf16 = bf16.init(jax.random.key(0), images, train=False)['params']
  assert {x.dtype for x in jax.tree.leaves(init_bf16)} == {jnp.dtype('float32')}

  logits, state = bf16.apply(
    {'params': params}, images, train=False, capture_intermediates=True, mutable=['intermediates']
  )
  assert logits.dtype == jnp.float32
  # Every layer's output (Dense, Conv, LayerNorm, attention, blocks) is bf16;
  # the attention's projection holders return their float32 parameters.
  layer_dtypes = {
    path: x[0].dtype
    for path, x in checkpoint.flatten(state['intermediates']).items()
    if path.endswith('__call__')
    and path != '__call__'
    and not path.endswith(('query/__call__', 'key/__call__', 'value/__call__', 'out/__call__'))
  }
  assert len(layer_dtypes) > 20
  assert set(layer_dtypes.values()) == {jnp.dtype('bfloat16')}, layer_dtypes
  reference = f32.apply({'params': params}, images, train=False)
  assert_trees_close(logits, reference, 0.05, 'bf16 logits')


@pytest.mark.slow
@pytest.mark.equivalence
def test_remat_gives_same_values_and_gradients():
  """Recomputing the blocks in the backward pass: the same float32 ops, fused differently, so
  loss and gradients agree normwise within 1e-5."""
  config = _tiny(transformer={**_tiny().transformer, 'dropout_rate': 0.1})
  images = jax.random.uniform(jax.random.key(4), (2, 16, 16, 3), minval=-1, maxval=1)
  plain = models.VisionTransformer(num_classes=3, **config)
  remat = models.VisionTransformer(num_classes=3, remat=True, **config)
  params = _random_params(plain, images)

  def loss(model, p):
    out = model.apply({'params': p}, images, train=True, rngs={'dropout': jax.random.key(5)})
    return jnp.sum(out**2)

  v1, g1 = jax.jit(jax.value_and_grad(lambda p: loss(plain, p)))(params)
  v2, g2 = jax.jit(jax.value_and_grad(lambda p: loss(remat, p)))(params)
  assert_close(abs(v2 - v1) / v1, 1e-5, 'loss')
  assert_trees_close(g2, g1, 1e-5, 'gradients')


@pytest.mark.slow
def test_dropout_is_active_only_in_training():
  config = _tiny(
    transformer={**_tiny().transformer, 'dropout_rate': 0.5, 'attention_dropout_rate': 0.5}
  )
  model = models.VisionTransformer(num_classes=3, **config)
  images = jax.random.uniform(jax.random.key(6), (2, 16, 16, 3), minval=-1, maxval=1)
  params = _random_params(model, images)
  run = lambda seed: model.apply(
    {'params': params},
    images,
    train=True,  # noqa: E731
    rngs={'dropout': jax.random.key(seed)},
  )
  assert not np.allclose(run(0), run(1))
  np.testing.assert_array_equal(
    model.apply({'params': params}, images, train=False),
    model.apply({'params': params}, images, train=False),
  )


@pytest.mark.slow
def test_hybrid_forward():
  config = architectures.MODEL_CONFIGS['R26+ViT-B_32']
  config.hidden_size = 32
  config.transformer.update(num_layers=1, num_heads=2, mlp_dim=16)
  model = models.VisionTransformer(num_classes=4, **config)
  images = jax.random.uniform(jax.random.key(7), (1, 64, 64, 3), minval=-1, maxval=1)
  params = _random_params(model, images)
  # Four stages: stride 32, so a 2x2 feature map and 4 + 1 tokens.
  assert params['Transformer']['posembed_input']['pos_embedding'].shape == (1, 5, 32)
  logits = jax.jit(lambda p, x: model.apply({'params': p}, x, train=False))(params, images)
  assert logits.shape == (1, 4) and bool(jnp.all(jnp.isfinite(logits)))


# ---------------------------------------------------------------------------
# The hybrids' BiT stem against a numpy transcription of the official code
# (models_resnet.py and the root block in models_vit.py), float64.


def _np_standardize(w, eps):
  """Official `weight_standardize`: (w - mean) / (std + eps) over kh, kw, in."""
  w = w - w.mean(axis=(0, 1, 2))
  return w / (w.std(axis=(0, 1, 2)) + eps)


def _np_standardize_var(w, eps):
  """The formula this package used before: (w - mean) / sqrt(var + eps)."""
  w = w - w.mean(axis=(0, 1, 2))
  return w / np.sqrt(w.var(axis=(0, 1, 2)) + eps)


def _np_same_pad(x, k, s, value=0.0):
  h, w = x.shape[1:3]
  oh, ow = -(-h // s), -(-w // s)
  ph, pw = max((oh - 1) * s + k - h, 0), max((ow - 1) * s + k - w, 0)
  pad = ((0, 0), (ph // 2, ph - ph // 2), (pw // 2, pw - pw // 2), (0, 0))
  return np.pad(x, pad, constant_values=value), oh, ow


def _np_conv(x, w, s):
  """SAME convolution, NHWC x HWIO, as a sum of strided matrix products."""
  k = w.shape[0]
  x, oh, ow = _np_same_pad(x, k, s)
  return sum(
    x[:, i : i + s * oh : s, j : j + s * ow : s] @ w[i, j] for i in range(k) for j in range(k)
  )


def _np_group_norm(x, p, groups=32, eps=1e-6):
  n, h, w, c = x.shape
  g = x.reshape(n, h, w, groups, c // groups)
  g = (g - g.mean(axis=(1, 2, 4), keepdims=True)) / np.sqrt(
    g.var(axis=(1, 2, 4), keepdims=True) + eps
  )
  return g.reshape(x.shape) * p['scale'] + p['bias']


def _np_max_pool(x, k=3, s=2):
  x, oh, ow = _np_same_pad(x, k, s, value=-np.inf)
  return np.max(
    [x[:, i : i + s * oh : s, j : j + s * ow : s] for i in range(k) for j in range(k)], axis=0
  )


def _np_bit_stem(params, x, standardize):
  """Root (7x7/2 StdConv, GN, ReLU, 3x3/2 max-pool), then the units of `block1`."""
  relu = lambda v: np.maximum(v, 0)
  conv = lambda v, p, s: _np_conv(v, standardize(p['kernel'], 1e-5), s)
  x = _np_max_pool(relu(_np_group_norm(conv(x, params['conv_root'], 2), params['gn_root'])))
  for name in sorted(params['block1']):
    unit = params['block1'][name]
    residual = x
    if 'conv_proj' in unit:
      residual = _np_group_norm(conv(x, unit['conv_proj'], 1), unit['gn_proj'])
    y = relu(_np_group_norm(conv(x, unit['conv1'], 1), unit['gn1']))
    y = relu(_np_group_norm(conv(y, unit['conv2'], 1), unit['gn2']))
    y = _np_group_norm(conv(y, unit['conv3'], 1), unit['gn3'])
    x = relu(residual + y)
  return x


class _Stem(nn.Module):
  units: tuple

  @nn.compact
  def __call__(self, x):
    return resnet.resnet_stem(x, self.units, 0.5, jnp.float32)


@pytest.mark.slow
def test_bit_stem_matches_the_official_formula_in_numpy():
  stem = _Stem(units=(2,))
  images = np.random.default_rng(0).uniform(-1, 1, (2, 24, 24, 3)).astype(np.float32)
  shapes = jax.eval_shape(lambda: stem.init(jax.random.key(0), images))['params']
  rng = np.random.default_rng(1)

  def leaf(path, s):
    name = path[-1].key
    if name == 'kernel':
      # Each output channel at its own scale, 1e-3 to 1e-1: where eps = 1e-5
      # matters (trained kernels are small) and GroupNorm cannot hide it.
      scale = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), s.shape[-1]))
      return (rng.normal(size=s.shape) * scale).astype(np.float32)
    return (rng.normal(size=s.shape) * 0.5 + (name == 'scale')).astype(np.float32)

  params = jax.tree_util.tree_map_with_path(leaf, shapes)
  ours = np.asarray(stem.apply({'params': params}, images))
  params64 = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  official = _np_bit_stem(params64, images.astype(np.float64), _np_standardize)
  assert ours.shape == official.shape == (2, 6, 6, 128)
  relative = lambda a, b: float(np.linalg.norm(a - b) / np.linalg.norm(b))
  assert relative(ours, official) < 1e-5
  # The test tells the formulas apart: sqrt(var + eps) is 10% away here.
  variance_form = _np_bit_stem(params64, images.astype(np.float64), _np_standardize_var)
  assert relative(variance_form, official) > 0.05


def test_patch_embedding_is_the_strided_convolution():
  """The patch embedding as a reshape and one matmul against the original convolution with stride =
  kernel = patch, `lax.conv_general_dilated`: the same parameters with the same initial values for a
  key (nn.Conv's), and the same tokens for a 35x37 image in 4x5 patches (8x7 of them; the last 3
  rows and 2 columns dropped, as VALID padding drops them). float32 sums of the same 60 products in
  another order: normwise within 1e-5."""
  images = jax.random.uniform(jax.random.key(0), (2, 35, 37, 3), minval=-1, maxval=1)
  embedding = vit.PatchEmbedding(24, (4, 5))
  convolution = nn.Conv(24, (4, 5), strides=(4, 5), padding='VALID')
  init = embedding.init(jax.random.key(1), images)['params']
  conv_init = convolution.init(jax.random.key(1), images)['params']
  assert jax.tree.map(jnp.shape, init) == {'kernel': (4, 5, 3, 24), 'bias': (24,)}
  for name in ('kernel', 'bias'):
    np.testing.assert_array_equal(init[name], conv_init[name])  # bitwise: same initialiser

  params = random_like(init, seed=2)
  params = jax.tree.map(jnp.asarray, params)
  tokens = embedding.apply({'params': params}, images)
  reference = jax.lax.conv_general_dilated(
    images, params['kernel'], (4, 5), 'VALID', dimension_numbers=('NHWC', 'HWIO', 'NHWC')
  )
  reference = (reference + params['bias']).reshape(2, 8 * 7, 24)
  assert tokens.shape == (2, 56, 24)
  assert_trees_close(tokens, reference, 1e-5, 'patch tokens')


def _padded_and_plain(classifier, size):
  """The same ViT with attention='xla', an odd sequence padded once (pad_odd) and not."""
  config = _tiny(classifier=classifier)
  return [
    models.VisionTransformer(num_classes=7, attention='xla', pad_odd=pad, **config)
    for pad in (True, False)
  ], jax.random.uniform(jax.random.key(5), (2, size, size, 3), minval=-1, maxval=1)


@pytest.mark.equivalence
@pytest.mark.parametrize(
  'classifier, size', [('token', 16), ('gap', 12), ('map', 12), ('unpooled', 12)]
)
def test_sequence_padded_once_gives_the_unpadded_values_and_gradients(classifier, size):
  """An odd sequence (17 tokens with the class token at 16 px, 9 patches at 12 px) padded to
  even once before the blocks, the padding masked in every attention and dropped before the
  pooling, against no padding: the masked key adds exp(-inf) = 0 to each softmax
  sum, so values and gradients are the same float32 sums in another order, normwise within
  1e-5. Only one `pad` in the whole forward pass."""
  (padded, plain), images = _padded_and_plain(classifier, size)
  params = _random_params(plain, images)
  cotangent = jax.random.normal(
    jax.random.key(6), plain.apply({'params': params}, images, train=False).shape
  )

  def value_and_grad(model):
    loss = lambda p: jnp.sum(model.apply({'params': p}, images, train=False) * cotangent)  # noqa: E731
    return jax.jit(jax.value_and_grad(loss))(params)

  results = [value_and_grad(model) for model in (padded, plain)]
  (value_a, grads_a), (value_b, grads_b) = results
  assert_close(abs(value_a - value_b) / abs(value_b), 1e-5, 'loss')
  assert_trees_close(grads_a, grads_b, 1e-5, 'gradients')
  jaxprs = [str(jax.make_jaxpr(lambda p, m=m: m.apply({'params': p}, images, train=False))(params))
            for m in (padded, plain)]  # fmt: skip
  assert [j.count(' pad[') for j in jaxprs] == [1, 0]


def test_padding_leaves_the_sown_intermediates_as_they_were():
  """Capturing attention weights takes the written-out attention, which pads nothing: the
  sown tokens and weights keep the real sequence length (17 at 16 px)."""
  (padded, _), images = _padded_and_plain('token', 16)
  params = _random_params(padded, images)
  _, state = padded.apply({'params': params}, images, train=False, mutable=['intermediates'])
  block = state['intermediates']['Transformer']['encoderblock_0']
  assert block['tokens'][0].shape == (2, 17, 32)
  weights = block['MultiHeadDotProductAttention_1']['attention_weights'][0]
  assert weights.shape == (2, 4, 17, 17)


def test_compute_params_casts_what_the_model_casts_and_keeps_the_rest_float32():
  """`vit.compute_params` casts once what the layers would cast on every call (kernels,
  biases, embeddings, class token, MAP probe) and leaves what they compute with in float32:
  LayerNorm and GroupNorm scales and biases (q/k norms too), the hybrid stem's
  weight-standardised kernels."""
  config = small_vit_config('R50+ViT-B_16', hybrid_units=(1,), classifier='map')
  config.transformer.qk_norm = True
  model = models.VisionTransformer(num_classes=5, **config)
  images = jnp.zeros((1, 32, 32, 3))
  shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), images, train=False))['params']
  cast = jax.eval_shape(lambda p: vit.compute_params(p, jnp.bfloat16), shapes)
  kept = {path for path, x in checkpoint.flatten(cast).items() if x.dtype == jnp.float32}
  assert {p for p in checkpoint.flatten(cast) if p.endswith(('/scale',))} <= kept
  assert kept == {
    p for p in checkpoint.flatten(shapes)
    if re.search(r'(LayerNorm_\d|_norm|gn\w*)/(scale|bias)$|conv\w*/kernel$', p)
  }  # fmt: skip
  assert {'embedding/kernel', 'MAPHead_0/probe', 'head/bias'} <= (
    set(checkpoint.flatten(cast)) - kept
  )
  same = jax.eval_shape(lambda p: vit.compute_params(p, jnp.float32), shapes)
  assert jax.tree.leaves(jax.tree.map(lambda a, b: a.dtype == b.dtype, same, shapes)) == [
    True
  ] * len(jax.tree.leaves(shapes))
