"""The typed model description (`configs.model_spec`): every registry entry converts, options
that would contradict each other are refused or cannot be written, the model takes its
architecture and how it runs as two values, and the code reads fields rather than restating
defaults or telling families apart by name."""

import ast
import dataclasses
import importlib.util
import pathlib

import jax
import pytest

import vit_jax
from vit_jax.configs import ConfigError
from vit_jax.configs import architectures
from vit_jax.configs import model_spec
from vit_jax.configs.model_spec import Architecture
from vit_jax.configs.model_spec import Block
from vit_jax.models import naflex
from vit_jax.models import vit

PACKAGE = pathlib.Path(vit_jax.__file__).parent


def test_every_registry_entry_converts_and_round_trips():
  for name in architectures.MODEL_CONFIGS:
    arch = model_spec.registered(name)
    assert arch.name == name
    assert Architecture.of(arch.as_config()) == arch, name


def test_the_model_is_its_architecture_and_how_it_runs():
  fields = lambda cls: [f.name for f in dataclasses.fields(cls) if f.name not in ('parent', 'name')]
  expected = ['num_classes', 'architecture', 'compute', 'head_bias_init']
  assert fields(vit.VisionTransformer) == fields(naflex.NaFlexViT) == expected


@pytest.mark.parametrize(
  'entry, message',
  [
    # What were flags that contradicted each other are one slot each: the old spellings are
    # refused by name, so a registry entry cannot set two of them.
    ({'swiglu': True}, 'unknown option(s) swiglu'),
    ({'activation': 'gelu'}, 'unknown option(s) activation'),
    ({'key_bias': False}, 'unknown option(s) key_bias'),
    ({'qkv_and_norm_biases': False}, 'unknown option(s) qkv_and_norm_biases'),
    ({'mlp': 'relu'}, "mlp='relu': use one of 'gelu_tanh', 'gelu', 'quick_gelu', 'swiglu'"),
    (
      {'biases': 'no_query'},
      "biases='no_query': use one of 'all', 'no_key', 'no_qkv', 'no_qkv_or_norm'",
    ),
  ],
)
def test_a_block_option_has_one_slot(entry, message):
  config = architectures.MODEL_CONFIGS['testing']
  config.transformer.update(entry)
  with pytest.raises(ConfigError) as e:
    Architecture.of(config)
  assert str(e.value).endswith(message)


@pytest.mark.parametrize(
  'changes, message',
  [
    ({'posemb': 'grid'}, "posemb='grid' with posemb_grid=None"),
    ({'posemb_grid': (4, 4)}, "posemb='tokens' with posemb_grid=(4, 4)"),
    ({'posemb_resample': 'bicubic_antialias'}, "posemb='tokens' has none"),
    ({'posemb': 'patches', 'classifier': 'gap'}, "posemb='patches' leaves the prefix tokens"),
    ({'final_norm': 'both'}, "final_norm='both': use one of 'tokens', 'pooled'"),
    ({'classifier': 'cls'}, "classifier='cls': use one of"),
  ],
)
def test_architecture_options_that_cannot_go_together_are_refused(changes, message):
  with pytest.raises(ConfigError, match=message.replace('(', r'\(').replace(')', r'\)')):
    model_spec.registered('testing').changed(**changes)


def test_unknown_entry_keys_are_named():
  config = architectures.MODEL_CONFIGS['testing']
  config.no_embed_class = True
  config.fc_norm = True
  with pytest.raises(ConfigError, match='unknown option.s. fc_norm, no_embed_class$'):
    Architecture.of(config)


def test_block_fields_are_the_configs_block_options():
  assert set(model_spec.BLOCK_OPTIONS) <= {f.name for f in dataclasses.fields(Block)}
  assert model_spec.BIASES == ('all', 'no_key', 'no_qkv', 'no_qkv_or_norm')


def _trees():
  return {p: ast.parse(p.read_text(encoding='utf-8')) for p in PACKAGE.rglob('*.py')}


def test_no_module_reads_an_architecture_option_by_get():
  """Architectures are read by field; a `.get('option', default)` would restate a default the
  declaration holds. Only the official-config translation reads ConfigDicts of that format."""
  options = {f.name for f in dataclasses.fields(Architecture)} | {
    f.name for f in dataclasses.fields(Block)
  }
  options |= {'transformer', 'patches', 'model_name', 'no_embed_class', 'fc_norm', 'swiglu'}
  options -= {'name', 'block'}  # words that other dicts have too
  reads = [
    f'{path.relative_to(PACKAGE)}:{n.lineno}'
    for path, tree in _trees().items()
    if path.name != 'official.py'
    for n in ast.walk(tree)
    if isinstance(n, ast.Call)
    and isinstance(n.func, ast.Attribute)
    and n.func.attr == 'get'
    and n.args
    and isinstance(n.args[0], ast.Constant)
    and n.args[0].value in options
  ]
  assert reads == []


def test_interop_tells_models_apart_by_their_fields_not_their_family():
  """The converters read what a model computes (rotary embeddings: timm's `Eva` layout); a
  family's name is timm's registered name and nothing else."""
  from vit_jax.configs import families

  named = set(families.FAMILIES)
  found = [
    f'{path.name}:{n.lineno}'
    for path, tree in _trees().items()
    if path.parent.name == 'interop'
    for n in ast.walk(tree)
    if (isinstance(n, ast.Constant) and n.value in named)
    or (isinstance(n, ast.Attribute) and n.attr == 'family_of')
  ]
  assert found == []


@pytest.mark.skipif(not importlib.util.find_spec('timm'), reason='timm is not installed')
def test_a_block_option_is_a_field_and_the_layers_that_read_it():
  """RMSNorm for every norm of the encoder (`Block.norm='rms'`, a field of the declaration and
  the norm layer that reads it): no norm biases in the tree, timm's ViT built with its RmsNorm
  gives our logits on the same weights, and the timm export, which writes LayerNorms, refuses
  it in one line."""
  import functools

  import numpy as np
  from timm.layers import RmsNorm
  from timm.models import vision_transformer
  import torch

  from vit_jax import checkpoint
  from vit_jax.interop import timm as interop_timm
  from vit_jax.interop import torch_layout

  arch = model_spec.registered('testing').changed(
    hidden_size=24, num_layers=2, num_heads=3, mlp_dim=48, norm='rms', layer_scale=0.5
  )
  model = vit.VisionTransformer(5, arch)
  x = np.random.default_rng(0).uniform(-1, 1, (2, 32, 32, 3)).astype(np.float32)
  shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), x, train=False))['params']
  rng = np.random.default_rng(1)
  flat = {
    k: (0.1 * rng.normal(size=v.shape) + k.endswith(('/scale', 'gamma'))).astype(np.float32)
    for k, v in checkpoint.flatten(shapes).items()
  }
  assert [k for k in flat if 'norm' in k.lower() and k.endswith('/bias')] == []
  ours = np.asarray(model.apply({'params': checkpoint.unflatten(flat)}, x, train=False))
  theirs_model = vision_transformer.VisionTransformer(
    img_size=32, patch_size=16, embed_dim=24, depth=2, num_heads=3, mlp_ratio=2, num_classes=5,
    init_values=0.5, act_layer='gelu_tanh', norm_layer=functools.partial(RmsNorm, eps=1e-6),
  ).eval()  # fmt: skip
  state = {k: torch.from_numpy(v) for k, v in interop_timm.to_timm(flat, arch).items()}
  theirs_model.load_state_dict(state, strict=True)
  with torch.no_grad():
    theirs = theirs_model(torch.from_numpy(x.transpose(0, 3, 1, 2).copy())).numpy()
  assert np.abs(theirs).max() > 0.05
  assert np.max(np.abs(ours - theirs)) / np.max(np.abs(theirs)) < 1e-5
  with pytest.raises(torch_layout.ExportError, match="writes the paper's ViT, not norm='rms'"):
    torch_layout.check_writes(arch, 'timm', interop_timm.WRITES)


def test_a_compute_option_is_a_field_and_the_layer_that_reads_it():
  """Query-chunked attention (`Compute.attention_chunk`: a config field, the Compute field and
  the attention layer that reads it): the outputs and every gradient of one attention layer at
  ViT-S/16's width over 1,025 tokens (512 px) equal the whole attention's to rounding, and the
  CPU compiler's scratch memory for the gradient (an estimate of its buffer assignment) is at
  most half the whole's: the float32 logits are held one chunk at a time."""
  import jax.numpy as jnp
  import numpy as np

  from vit_jax.configs import common
  from vit_jax.models import attention

  config = common.get_config()
  config.attention_chunk = 64
  assert model_spec.Compute.of(config).attention_chunk == 64
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 1025, 384))

  def gradient(chunk):
    layer = attention.MultiHeadDotProductAttention(
      6, compute=model_spec.Compute(attention='explicit', attention_chunk=chunk)
    )
    params = layer.init(jax.random.PRNGKey(1), x, deterministic=True)
    loss = lambda p, x: jnp.sum(layer.apply(p, x, deterministic=True) ** 2)
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    scratch = step.lower(params, x).compile().memory_analysis().temp_size_in_bytes
    return step(params, x), scratch

  (whole, whole_grads), whole_scratch = gradient(0)
  (chunked, chunked_grads), chunked_scratch = gradient(64)
  np.testing.assert_allclose(chunked, whole, rtol=1e-6)
  for path, a, b in zip(
    jax.tree_util.tree_leaves_with_path(whole_grads),
    jax.tree.leaves(chunked_grads),
    jax.tree.leaves(whole_grads),
  ):
    # The key bias's gradient is zero but for rounding (a constant per query's logits), so
    # every leaf is held to the largest gradient's scale.
    np.testing.assert_allclose(a, b, atol=2e-6 * float(jnp.abs(b).max()) + 1e-3, err_msg=path[0])
  assert chunked_scratch <= 0.5 * whole_scratch, (chunked_scratch, whole_scratch)
