"""Numerical parity with an independent implementation: Hugging Face ViT in PyTorch.

Random weights (every leaf non-zero, the head included) are written in the
public .npz layout, read by `checkpoint.load` and mapped by hand onto
`transformers.ViTForImageClassification`; logits must agree to 1e-4 relative.
"""

from conftest import assert_close
from conftest import relative_error
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vit_jax import checkpoint
from vit_jax import models
from vit_jax.configs import architectures

torch = pytest.importorskip('torch')  # installed apart on CPU machines (README: Set-up)
transformers = pytest.importorskip('transformers')


def hf_config(config, num_classes, image_size):
  patch = config.patches.size[0]
  return transformers.ViTConfig(
    hidden_size=config.hidden_size,
    num_hidden_layers=config.transformer.num_layers,
    num_attention_heads=config.transformer.num_heads,
    intermediate_size=config.transformer.mlp_dim,
    image_size=image_size,
    patch_size=patch,
    num_labels=num_classes,
    layer_norm_eps=1e-6,
    hidden_act='gelu_pytorch_tanh',
  )  # the original uses the tanh approximation of GELU


def hf_state_dict(flat, config, prefix='vit.'):
  """Maps a flat public-layout checkpoint onto transformers' ViT names."""
  d = config.hidden_size
  sd = {
    'embeddings.cls_token': flat['cls'],
    'embeddings.position_embeddings': flat['Transformer/posembed_input/pos_embedding'],
    'embeddings.patch_embeddings.projection.weight': flat['embedding/kernel'].transpose(3, 2, 0, 1),
    'embeddings.patch_embeddings.projection.bias': flat['embedding/bias'],
    'layernorm.weight': flat['Transformer/encoder_norm/scale'],
    'layernorm.bias': flat['Transformer/encoder_norm/bias'],
  }
  for i in range(config.transformer.num_layers):
    block, hf = f'Transformer/encoderblock_{i}/', f'layers.{i}.'
    attn = block + 'MultiHeadDotProductAttention_1/'
    for ours, theirs in [('query', 'q_proj'), ('key', 'k_proj'), ('value', 'v_proj')]:
      sd[f'{hf}attention.{theirs}.weight'] = flat[f'{attn}{ours}/kernel'].reshape(d, d).T
      sd[f'{hf}attention.{theirs}.bias'] = flat[f'{attn}{ours}/bias'].reshape(d)
    sd[f'{hf}attention.o_proj.weight'] = flat[attn + 'out/kernel'].reshape(d, d).T
    sd[f'{hf}attention.o_proj.bias'] = flat[attn + 'out/bias']
    for ours, theirs in [('LayerNorm_0', 'layernorm_before'), ('LayerNorm_2', 'layernorm_after')]:
      sd[f'{hf}{theirs}.weight'] = flat[f'{block}{ours}/scale']
      sd[f'{hf}{theirs}.bias'] = flat[f'{block}{ours}/bias']
    for ours, theirs in [('Dense_0', 'fc1'), ('Dense_1', 'fc2')]:
      sd[f'{hf}mlp.{theirs}.weight'] = flat[f'{block}MlpBlock_3/{ours}/kernel'].T
      sd[f'{hf}mlp.{theirs}.bias'] = flat[f'{block}MlpBlock_3/{ours}/bias']
  sd = {prefix + k: v for k, v in sd.items()}
  if 'pre_logits/kernel' in flat:
    sd[prefix + 'pooler.dense.weight'] = flat['pre_logits/kernel'].T
    sd[prefix + 'pooler.dense.bias'] = flat['pre_logits/bias']
  return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in sd.items()}


def random_npz(tmp_path, config, num_classes, size, seed=0):
  model = models.VisionTransformer(num_classes=num_classes, **config)
  shapes = jax.eval_shape(
    lambda: model.init(jax.random.key(0), jnp.zeros((1, size, size, 3)), train=False)
  )['params']
  rng = np.random.default_rng(seed)
  params = jax.tree.map(lambda s: (0.05 * rng.normal(size=s.shape)).astype(np.float32), shapes)
  # LayerNorm scales near 1 keep activations in a realistic range.
  flat = {k: v + 1.0 if k.endswith('/scale') else v for k, v in checkpoint.flatten(params).items()}
  return model, checkpoint.save_npz(checkpoint.unflatten(flat), tmp_path / 'model.npz')


@pytest.mark.slow
def test_vit_ti16_224_matches_transformers(tmp_path):
  config = architectures.MODEL_CONFIGS['ViT-Ti_16']
  model, path = random_npz(tmp_path, config, num_classes=10, size=224)
  params = checkpoint.load(path)
  images = np.random.default_rng(1).uniform(-1, 1, (3, 224, 224, 3)).astype(np.float32)
  ours = np.asarray(model.apply({'params': params}, images, train=False))

  hf = transformers.ViTForImageClassification(hf_config(config, 10, 224)).eval()
  flat = checkpoint.flatten(params)
  sd = hf_state_dict(flat, config)
  sd['classifier.weight'] = torch.from_numpy(flat['head/kernel'].T.copy())
  sd['classifier.bias'] = torch.from_numpy(flat['head/bias'])
  hf.load_state_dict(sd, strict=True)
  with torch.no_grad():
    theirs = hf(pixel_values=torch.from_numpy(images.transpose(0, 3, 1, 2))).logits.numpy()
  assert np.abs(theirs).max() > 0.1  # a non-trivial head
  assert_close(relative_error(ours, theirs), 1e-4, 'logits against the peer')


@pytest.mark.slow
def test_pre_logits_match_transformers_pooler(tmp_path):
  """The pre-logits layer (Dense + tanh on the class token) is HF's ViT pooler."""
  config = architectures.MODEL_CONFIGS['ViT-S_32']
  config.update(representation_size=config.hidden_size)
  config.transformer.num_layers = 2
  model, path = random_npz(tmp_path, config, num_classes=None, size=96, seed=2)
  params = checkpoint.load(path)
  images = np.random.default_rng(3).uniform(-1, 1, (2, 96, 96, 3)).astype(np.float32)
  ours = np.asarray(model.apply({'params': params}, images, train=False))

  hf = transformers.ViTModel(hf_config(config, 1, 96), add_pooling_layer=True).eval()
  hf.load_state_dict(hf_state_dict(checkpoint.flatten(params), config, prefix=''), strict=True)
  with torch.no_grad():
    theirs = hf(pixel_values=torch.from_numpy(images.transpose(0, 3, 1, 2))).pooler_output.numpy()
  assert_close(relative_error(ours, theirs), 1e-4, 'logits against the peer')
