"""The analysis CLI: figures and analysis.json from a checkpoint, on real model attention."""

import json

from conftest import TESTING_SIZE
from conftest import command_error
from conftest import param_shapes
from conftest import random_like
from conftest import run_command
from conftest import tiny_workdir
import jax
import numpy as np
from PIL import Image
import pytest

from vit_jax import analyze
from vit_jax import checkpoint
from vit_jax import models
from vit_jax.configs import architectures
from vit_jax.configs.model_spec import Architecture
from vit_jax.configs.model_spec import ModelSpec
from vit_jax.configs.model_spec import naflex_of
from vit_jax.data.readers import builtin
from vit_jax.evaluation import analysis
from vit_jax.evaluation import classify
from vit_jax.evaluation import figures
from vit_jax.evaluation import loader
from vit_jax.models import mpp


def small_config(**overrides):
  config = architectures.MODEL_CONFIGS['testing']
  config.transformer.num_layers = 1
  config.update(overrides)
  return config


def random_checkpoint(path, config, size, module=None, num_classes=10):
  # Large query/key weights give peaked, position-dependent attention.
  params = random_like(param_shapes(config, num_classes, size, module), scale=0.5)
  return checkpoint.save_npz(params, path), params


def image_dir(tmp_path, n=2):
  folder = tmp_path / 'images'
  folder.mkdir()
  rng = np.random.default_rng(1)
  for i in range(n):
    Image.fromarray(rng.integers(0, 256, (40, 50, 3), dtype=np.uint8)).save(folder / f'{i}.png')
  return folder


def test_analyze_writes_figures_and_the_numbers(tmp_path, capsys):
  path, params = random_checkpoint(tmp_path / 'ckpt.npz', small_config(), size=64)
  folder = image_dir(tmp_path)
  out = tmp_path / 'out'
  assert (
    analyze.main(
      [
        f'--checkpoint={path}',
        '--model=testing',
        f'--images={folder}',
        f'--output={out}',
        '--num_components=6',
      ]
    )
    == 0
  )
  assert 'wrote attention_distance.png' in capsys.readouterr().out
  for name in (
    'attention_distance.png',
    'attention_rollout.png',
    'posemb_similarity.png',
    'embedding_filters.png',
  ):
    with Image.open(out / name) as figure:
      assert figure.format == 'PNG' and min(figure.size) >= 150, name
  result = json.loads((out / 'analysis.json').read_text())
  assert result['image_size'] == 64 and result['patch_grid'] == [4, 4]
  assert result['images'] == [str(folder / '0.png'), str(folder / '1.png')]

  # Numbers: recompute from the checkpoint with the model directly.
  model = models.VisionTransformer(num_classes=10, **small_config())
  images = np.stack([classify.read_image(f, 64) for f in result['images']])
  _, state = model.apply({'params': params}, images, train=False, mutable=['intermediates'])
  att = np.asarray(
    state['intermediates']['Transformer']['encoderblock_0']['MultiHeadDotProductAttention_1'][
      'attention_weights'
    ][0]
  )
  np.testing.assert_allclose(
    result['mean_attention_distance']['per_layer_head'],
    [analysis.mean_attention_distance(att, (4, 4), 16)],
    atol=2e-5,
  )
  maps = analysis.rollout_maps(analysis.attention_rollout([att]), (4, 4))
  np.testing.assert_allclose(result['attention_rollout']['maps'], maps, atol=2e-6)
  assert np.ptp(maps) > 0.01  # the random model does not attend uniformly

  posemb = params['Transformer']['posembed_input']['pos_embedding'][0, 1:]
  unit = posemb / np.linalg.norm(posemb, axis=1, keepdims=True)
  np.testing.assert_allclose(
    np.reshape(result['posemb_similarity']['values'], (16, 16)), unit @ unit.T, atol=2e-6
  )
  ratio = result['embedding_filters']['explained_variance_ratio']
  assert len(ratio) == 6 and ratio == sorted(ratio, reverse=True) and sum(ratio) < 1
  assert np.shape(result['embedding_filters']['components']) == (6, 16, 16, 3)


@pytest.mark.parametrize('classifier', ['gap', 'map'])
def test_analyze_a_model_without_class_token(classifier):
  config = small_config(classifier=classifier)
  model = models.VisionTransformer(num_classes=None, **config)
  images = np.random.default_rng(0).uniform(-1, 1, (2, 32, 32, 3)).astype(np.float32)
  shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), images, train=False))['params']
  rng = np.random.default_rng(0)
  params = jax.tree.map(lambda s: rng.normal(0, 0.5, s.shape).astype(np.float32), shapes)
  loaded = loader.LoadedModel(model, params, ModelSpec(Architecture.of(config), 32))
  result = figures.compute(loaded, images, num_components=4)
  _, state = model.apply({'params': params}, images, train=False, mutable=['intermediates'])
  att = np.asarray(
    state['intermediates']['Transformer']['encoderblock_0']['MultiHeadDotProductAttention_1'][
      'attention_weights'
    ][0]
  )
  assert att.shape == (2, 2, 4, 4)  # no class token
  a = (att.mean(1) + np.eye(4)) / 2
  if classifier == 'gap':  # the pooled vector averages the tokens
    readout = np.full((2, 4), 1 / 4)
  else:  # the MAP head's probe weighs them by its attention
    probe = state['intermediates']['MAPHead_0']['MultiHeadDotProductAttention_0']
    probe = np.asarray(probe['attention_weights'][0])
    assert probe.shape == (2, 2, 1, 4)
    readout = probe.mean(1)[:, 0]
    assert np.abs(readout - 1 / 4).max() > 0.01  # not the average
  want = np.einsum('bt,bts->bs', readout, a).reshape(2, 2, 2)
  np.testing.assert_allclose(result['rollout'], want, rtol=1e-5)
  assert result['posemb_similarity'].shape == (2, 2, 2, 2)


def test_analyze_a_model_whose_prefix_tokens_have_no_position_embeddings():
  """timm's no_embed_class layout (posemb='patches': DINOv2 with registers, DeiT III): the class
  token and four registers attend, but the position table holds the 2x2 patches' rows alone,
  compared as they are."""
  config = small_config(num_registers=4, posemb='patches')
  model = models.VisionTransformer(num_classes=3, **config)
  images = np.random.default_rng(0).uniform(-1, 1, (2, 32, 32, 3)).astype(np.float32)
  shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), images, train=False))['params']
  rng = np.random.default_rng(0)
  params = jax.tree.map(lambda s: rng.normal(0, 0.5, s.shape).astype(np.float32), shapes)
  posemb = params['Transformer']['posembed_input']['pos_embedding'][0]
  assert posemb.shape[0] == 4  # patches only
  loaded = loader.LoadedModel(model, params, ModelSpec(Architecture.of(config), 32))
  result = figures.compute(loaded, images, num_components=4)
  unit = posemb / np.linalg.norm(posemb, axis=1, keepdims=True)
  np.testing.assert_allclose(
    result['posemb_similarity'].reshape(4, 4), unit @ unit.T, rtol=1e-6, atol=1e-6
  )
  assert result['attention_distance'].shape == (1, 2) and result['rollout'].shape == (2, 2, 2)


def test_analyze_an_mpp_checkpoint(tmp_path):
  """Its pre-training layers are skipped and the backbone analysed."""
  folder = image_dir(tmp_path, n=1)
  path, _ = random_checkpoint(
    tmp_path / 'mpp.npz',
    small_config(),
    size=32,
    module=mpp.MppViT(Architecture.of(small_config())),
  )
  loaded = loader.load_model(path, 'testing')
  assert loaded.model.num_classes is None and 'mask_token' not in loaded.params
  out = tmp_path / 'mpp'
  assert (
    analyze.main(
      [f'--checkpoint={path}', '--model=testing', f'--images={folder}', f'--output={out}']
    )
    == 0
  )
  assert json.loads((out / 'analysis.json').read_text())['patch_grid'] == [2, 2]


def test_analyze_errors(tmp_path, capsys):
  path, _ = random_checkpoint(tmp_path / 'ckpt.npz', small_config(), size=32)
  args = [f'--checkpoint={path}', '--model=ViT-S_16', f'--output={tmp_path}']
  assert command_error(analyze.main, args + ['--images=nope.png'], capsys) == (
    'error: nope.png: no such image file or directory'
  )
  assert 'the model expects (384,)' in command_error(analyze.main, args, capsys)


def test_analyze_digits_uses_the_demo_test_images(tmp_path):
  path, _ = random_checkpoint(tmp_path / 'ckpt.npz', small_config(), size=64)
  out = tmp_path / 'out'
  assert (
    analyze.main(
      [
        f'--checkpoint={path}',
        '--model=testing',
        '--images=digits',
        f'--output={out}',
        '--num_components=2',
      ]
    )
    == 0
  )
  result = json.loads((out / 'analysis.json').read_text())
  _, test = builtin.digits_split_indices()
  labels = builtin.load_digits()[1]
  assert result['images'] == [f'test digit #{i} (a {labels[i]})' for i in test[:4]]
  names, images = figures.test_digits(64)
  assert images.shape == (4, 64, 64, 3) and images.min() >= -1.0 and images.max() <= 1.0
  # Bright strokes on a dark ground, as the training pipeline sees them.
  assert images.min() == -1.0 and images.max() > 0.5


# ---------------------------------------------------------------------------
# Unreadable images, workdirs and NaFlex checkpoints.


def test_analyze_skips_an_unreadable_image_and_titles_the_model(tmp_path, user_files, capsys):
  """As predict, an unreadable image is named and left out (exit 1); the figures and
  analysis.json name the model a workdir records."""
  from vit_jax import analyze

  run = tiny_workdir(tmp_path / 'run', 'digits')
  argv = [f'--checkpoint={run}', f'--images={user_files["png"]},{tmp_path}/text.jpg']
  code, out, err = run_command(analyze.main, argv + [f'--output={tmp_path}/out'], capsys)
  assert code == 1 and out.startswith('wrote attention_distance.png'), err
  assert f'skipped {tmp_path}/text.jpg: not a readable image' in err and 'Traceback' not in err
  summary = json.loads((tmp_path / 'out' / 'analysis.json').read_text())
  assert summary['model'] == 'testing' and summary['images'] == [str(user_files['png'])]


def test_analyze_reads_a_naflex_checkpoint_with_a_plain_vits_attention(tmp_path, capsys):
  """`analyze` reads a NaFlex checkpoint: its blocks sow their attention where the analyses ask,
  the weights of a plain ViT that computes the same (its class token's position row zero, its
  patches' the NaFlex grid)."""
  from vit_jax import analyze
  from vit_jax.evaluation import figures
  from vit_jax.evaluation import loader
  from vit_jax.models import naflex

  config = architectures.MODEL_CONFIGS['testing']
  model = naflex.NaFlexViT(3, naflex_of(Architecture.of(config), (2, 2), 'bilinear'))
  shapes = param_shapes(config, 3, 16, module=model)
  flat = checkpoint.flatten(random_like(shapes, seed=3, scale=0.3))
  path = checkpoint.save_npz(checkpoint.unflatten(flat), tmp_path / 'naflex.npz')
  table = flat['Transformer/posembed_input/pos_embedding']
  plain = dict(flat)
  plain['Transformer/posembed_input/pos_embedding'] = np.concatenate(
    [np.zeros((1, 1, 10), np.float32), table.reshape(1, 4, 10)], axis=1
  )
  images_ = (
    np.random.default_rng(0).uniform(-1, 1, (3, TESTING_SIZE, TESTING_SIZE, 3)).astype(np.float32)
  )
  got = figures.attention_weights(loader.model_from_flat(flat, 'testing', 'naflex'), images_)
  want = figures.attention_weights(loader.model_from_flat(plain, 'testing', 'plain'), images_)
  assert len(got) == len(want) == 1
  np.testing.assert_allclose(got[0], want[0], atol=1e-6)
  argv = [f'--checkpoint={path}', '--model=testing', '--images=digits', f'--output={tmp_path}/a']
  code, out, err = run_command(analyze.main, argv, capsys)
  assert code == 0 and out.startswith('wrote attention_distance.png'), err
  summary = json.loads((tmp_path / 'a' / 'analysis.json').read_text())
  assert np.shape(summary['posemb_similarity']['values']) == (2, 2, 2, 2)
