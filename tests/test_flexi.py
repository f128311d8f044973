"""FlexiViT: a checkpoint at another patch size (PI-resize) and a random patch size per step.

The PI-resized kernel is checked against timm's `resample_patch_embed` (an
independent implementation: it builds the resize matrix by resizing basis
images with torch and inverts it whole, in float32) and by its defining
property; loading at another patch size against the model applied to
hand-resized parameters and, through the timm export, against timm itself.
"""

import functools
import json
import os

from conftest import assert_close
from conftest import param_shapes
from conftest import random_like
from conftest import relative_error
from conftest import small_vit_config
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vit_jax import checkpoint
from vit_jax import models
from vit_jax.configs import architectures
from vit_jax.configs.model_spec import Architecture
from vit_jax.evaluation import loader
from vit_jax.interop import export
from vit_jax.models import flexi
from vit_jax.models import vit_checkpoint
from vit_jax.training import program

try:
  import timm
  import torch
except ImportError:
  timm = None
needs_timm = pytest.mark.skipif(timm is None, reason='timm is not installed (README: Set-up)')

# Max |ours - theirs| / max |theirs|, as the export tests (tests/test_export.py).
BOUND = 1e-5


# Our resize names -> timm's (interpolation, antialias) of the same resize.
TIMM_RESIZE = {
  'bilinear': ('bilinear', False),
  'bilinear_antialias': ('bilinear', True),
  'bicubic_antialias': ('bicubic', True),
}


@needs_timm
@pytest.mark.parametrize('resize', ['bilinear', 'bicubic_antialias'])
@pytest.mark.parametrize('old, new', [(16, 8), (16, 24), (16, 32), (4, 2), (4, 8), (14, 16)])
def test_pi_resize_is_timms_resample_patch_embed(old, new, resize):
  """FlexiViT's bilinear, and timm's default (bicubic, antialiased)."""
  from timm.layers.patch_embed import resample_patch_embed

  kernel = np.random.default_rng(0).normal(size=(old, old, 3, 8)).astype(np.float32)
  ours = vit_checkpoint.resize_patch_embedding(kernel, (new, new), resize)
  torch_kernel = torch.from_numpy(np.ascontiguousarray(kernel.transpose(3, 2, 0, 1)))
  interpolation, antialias = TIMM_RESIZE[resize]
  theirs = resample_patch_embed(torch_kernel, [new, new], interpolation, antialias)
  theirs = theirs.numpy().transpose(2, 3, 1, 0)
  assert ours.shape == theirs.shape == (new, new, 3, 8) and ours.dtype == np.float32
  # timm inverts in float32: measured 1e-7 to 2e-6 of the largest weight.
  assert_close(relative_error(ours, theirs), BOUND, 'PI-resized kernel against timm')


@needs_timm
@pytest.mark.parametrize('resize', sorted(TIMM_RESIZE))
@pytest.mark.parametrize('old, new', [(14, 24), (14, 9), (4, 2), (2, 7)])
def test_posemb_resizes_are_timms_resample_abs_pos_embed(old, new, resize):
  """Position tables resized as timm's `resample_abs_pos_embed` (torch's interpolate) does,
  larger and smaller, the class token's row kept; its default is bicubic_antialias."""
  from timm.layers.pos_embed import resample_abs_pos_embed

  posemb = np.random.default_rng(1).normal(size=(1, 1 + old * old, 8)).astype(np.float32)
  ours = vit_checkpoint.resize_posemb(posemb, 1 + new * new, 1, resize)
  interpolation, antialias = TIMM_RESIZE[resize]
  theirs = resample_abs_pos_embed(
    torch.from_numpy(posemb),
    [new, new],
    num_prefix_tokens=1,
    interpolation=interpolation,
    antialias=antialias,
  ).numpy()
  assert_close(relative_error(ours, theirs), BOUND, f'{resize} position table against timm')


def _timm_at_patch_8(config, state):
  """timm's model of `config` at patch 8 holding `state`, two images, and its logits on them."""
  from vit_jax.interop import timm as interop_timm

  config.patches.size = (8, 8)
  model = interop_timm.build_model(Architecture.of(config), 5, 32)
  model.load_state_dict(state, strict=True)
  images = np.random.default_rng(2).uniform(-1, 1, (2, 32, 32, 3)).astype(np.float32)
  with torch.no_grad():
    theirs = model(torch.from_numpy(images.transpose(0, 3, 1, 2).copy())).numpy()
  return model, images, theirs


@needs_timm
def test_timms_default_resizes_load_at_another_patch_size_both_ways(tmp_path):
  """A patch-16 checkpoint at patch 8: timm resizing its own state_dict with its defaults
  (`resample_patch_embed` and `resample_abs_pos_embed`: bicubic, antialiased) and ours loading
  it with --resample=bicubic_antialias give the same logits, and our export at patch 8 loads
  into timm with them; the default resizes (FlexiViT's bilinear, the official zoom) give
  another model (logits 1.5e-2 to 2.5e-1 apart from timm's)."""
  import safetensors.torch
  from timm.layers.patch_embed import resample_patch_embed
  from timm.layers.pos_embed import resample_abs_pos_embed

  from vit_jax.interop import timm as interop_timm

  config, flat, path = _checkpoint(tmp_path)
  state = {k: torch.from_numpy(v) for k, v in interop_timm.to_timm(flat).items()}
  state['patch_embed.proj.weight'] = resample_patch_embed(state['patch_embed.proj.weight'], [8, 8])
  state['pos_embed'] = resample_abs_pos_embed(state['pos_embed'], [4, 4], num_prefix_tokens=1)
  model, images, theirs = _timm_at_patch_8(config, state)
  loaded = loader.load_model(path, 'testing', patch_size=8, resample='bicubic_antialias')
  ours = loaded.model.apply({'params': loaded.params}, images, train=False)
  assert_close(relative_error(ours, theirs), BOUND, 'logits against timm at patch 8')
  default = loader.load_model(path, 'testing', patch_size=8)
  logits = default.model.apply({'params': default.params}, images, train=False)
  assert relative_error(logits, theirs) > 100 * BOUND
  out = str(tmp_path / 'p8.safetensors')
  export.export(str(path), 'timm', out, 'testing', patch_size=8, resample='bicubic_antialias')
  model.load_state_dict(safetensors.torch.load_file(out), strict=True)
  with torch.no_grad():
    again = model(torch.from_numpy(images.transpose(0, 3, 1, 2).copy())).numpy()
  assert_close(relative_error(again, theirs), BOUND, 'logits of the export in timm')


def test_a_patch_resized_up_gives_the_old_token_exactly():
  """PI-resize's definition: <x, w> = <B x, w'> for every patch x when B (the bilinear
  upsampling of a patch) has full column rank; float64, so to 1e-12."""
  rng = np.random.default_rng(1)
  kernel, patches = rng.normal(size=(4, 4, 3, 5)), rng.normal(size=(7, 4, 4, 3))
  for new in (6, 8, 13):
    resize = vit_checkpoint.bilinear_matrix(4, new)
    big = np.einsum('ah,bw,nhwc->nabc', resize, resize, patches)
    wide = vit_checkpoint.resize_patch_embedding(kernel, (new, new))
    want = np.einsum('nhwc,hwcd->nd', patches, kernel)
    np.testing.assert_allclose(np.einsum('nhwc,hwcd->nd', big, wide), want, rtol=1e-12)
  assert vit_checkpoint.resize_patch_embedding(kernel, (4, 4)) == pytest.approx(kernel, abs=1e-12)


def _checkpoint(tmp_path, size=32, seed=0):
  """A random checkpoint of the registered `testing` ViT (width 10, 16 px patches)."""
  config = architectures.MODEL_CONFIGS['testing']
  params = random_like(param_shapes(config, 5, size), seed=seed, scale=0.2)
  path = checkpoint.save_npz(params, tmp_path / 'model.npz')
  return config, checkpoint.flatten(params), path


def test_a_checkpoint_loads_at_another_patch_size(tmp_path):
  """The loaded model is the checkpoint's with a PI-resized kernel and its position
  embeddings zoomed to the new grid, at the checkpoint's resolution; its own patch size
  is read from the kernel, so the file of a run at another patch size loads too."""
  config, flat, path = _checkpoint(tmp_path)
  for patch in (4, 8):
    loaded = loader.load_model(path, 'testing', patch_size=patch)
    assert (loaded.spec.image_size, loaded.spec.grid, loaded.spec.stride) == (
      32,
      32 // patch,
      patch,
    )
    got = checkpoint.flatten(loaded.params)
    want = vit_checkpoint.resize_patch_embedding(flat['embedding/kernel'], (patch, patch))
    np.testing.assert_array_equal(got['embedding/kernel'], want)
    posemb = vit_checkpoint.resize_posemb(
      flat['Transformer/posembed_input/pos_embedding'], 1 + (32 // patch) ** 2, 1
    )
    np.testing.assert_array_equal(got['Transformer/posembed_input/pos_embedding'], posemb)
    for key in set(flat) - {'embedding/kernel', 'Transformer/posembed_input/pos_embedding'}:
      np.testing.assert_array_equal(got[key], flat[key])
    again = checkpoint.save_npz(loaded.params, tmp_path / f'p{patch}.npz')
    assert loader.load_model(again, 'testing').spec.stride == patch
  with pytest.raises(loader.InputError, match='--patch_size=5: patch size 5 does not tile 32 px'):
    loader.load_model(path, 'testing', patch_size=5)


def test_a_hybrid_refuses_another_patch_size(tmp_path):
  config = small_vit_config('R50+ViT-B_16', hybrid_units=(1, 1, 1))
  path = checkpoint.save_npz(random_like(param_shapes(config, 3, 64)), tmp_path / 'h.npz')
  with pytest.raises(loader.InputError, match='a hybrid embeds ResNet features'):
    loader.model_from_flat(checkpoint.flatten(checkpoint.load(path)), 'R50+ViT-B_16', 'h', 8)


@needs_timm
def test_export_at_another_patch_size_matches_timm(tmp_path):
  """`export --patch_size=8` of a patch-16 checkpoint: timm's model built at patch 8 with
  the exported weights gives our logits at patch 8."""
  import safetensors.torch

  config, _, path = _checkpoint(tmp_path)
  out = str(tmp_path / 'p8.safetensors')
  export.export(str(path), 'timm', out, 'testing', patch_size=8)
  state = safetensors.torch.load_file(out)
  assert tuple(state['patch_embed.proj.weight'].shape) == (10, 3, 8, 8)
  _, images, theirs = _timm_at_patch_8(config, state)
  loaded = loader.load_model(path, 'testing', patch_size=8)
  ours = loaded.model.apply({'params': loaded.params}, images, train=False)
  assert_close(relative_error(ours, theirs), BOUND, 'logits against the peer')


def test_fine_tuning_at_another_patch_size_pi_resizes_the_kernel(tmp_path, capsys):
  config, flat, path = _checkpoint(tmp_path)
  model_config = architectures.MODEL_CONFIGS['testing']
  model_config.patches.size = (4, 4)
  model = models.VisionTransformer(num_classes=3, **model_config)
  init = model.init(jax.random.key(0), jnp.zeros((1, 32, 32, 3)), train=False)['params']
  params = checkpoint.load_pretrained(
    pretrained_path=str(path), init_params=init, model_config=model_config
  )
  assert 'embedding/kernel (16, 16, 3, 10) -> (4, 4, 3, 10) (PI-resize)' in capsys.readouterr().out
  np.testing.assert_array_equal(
    params['embedding']['kernel'],
    vit_checkpoint.resize_patch_embedding(flat['embedding/kernel'], (4, 4)),
  )


def _weighted_sum(logits, batch):
  """A loss whose gradient reaches every logit: sum(logits * batch['weights'])."""
  return jnp.sum(logits * batch['weights'])


@pytest.mark.equivalence
def test_random_patch_grad_is_the_model_at_the_drawn_patch_size():
  """Each call runs at one of the sizes, the parameters resized in the step as
  `at_patch_size` resizes them on the host (float32 matmuls vs float64: 1e-5 of the loss),
  and every size is drawn."""
  config = small_vit_config('ViT-Ti_16', patches={'size': (8, 8)})
  model = models.VisionTransformer(num_classes=4, **config)
  flat = checkpoint.flatten(random_like(param_shapes(config, 4, 32), seed=3, scale=0.2))
  params = checkpoint.unflatten(flat)
  rng = np.random.default_rng(4)
  batch = {
    'image': rng.uniform(-1, 1, (2, 32, 32, 3)).astype(np.float32),
    'weights': rng.normal(size=(2, 4)).astype(np.float32),
  }
  sizes = (4, 8, 16)
  grad_fn = jax.jit(flexi.random_patch_grad(model, sizes, 32, _weighted_sum))
  expected = {}
  for size in sizes:
    at = checkpoint.unflatten(flexi.at_patch_size(flat, size, 32, 1))
    apply = jax.jit(
      functools.partial(
        model.clone(architecture=model.architecture.changed(patch_size=(size, size))).apply,
        train=False,
      )
    )
    expected[size] = float(_weighted_sum(apply({'params': at}, batch['image']), batch))
  seen = set()
  for seed in range(12):
    loss, _ = grad_fn(params, batch, jax.random.key(seed))
    errors = {s: abs(float(loss) - want) / abs(want) for s, want in expected.items()}
    drawn = min(errors, key=errors.get)
    assert_close(errors[drawn], BOUND, f'loss at patch {drawn}')
    seen.add(drawn)
  assert seen == set(sizes)


def test_config_patch_sizes_are_checked_in_one_line():
  config = steps_config(flexi_patch_sizes=(4, 6))
  with pytest.raises(program.ConfigError, match=r'pp.crop=16: patch size 6 does not tile 16 px'):
    program.validate(config, 1)
  config = steps_config(patch_size=8, flexi_patch_sizes=(4, 8))
  assert program.validate(config, 1).patch_size == 8


def steps_config(**overrides):
  from conftest import tiny_run_config

  return tiny_run_config(**overrides)


@pytest.mark.equivalence
def test_gradients_reach_the_underlying_kernel_and_position_embeddings():
  """The gradient of a step drawn at patch 8 of a patch-16 model is the gradient of the
  patch-8 model at the resized parameters, carried back by the transposed resize maps
  (kernel: the PI-resize matrices; position embeddings: the zoom matrices)."""
  config = small_vit_config('ViT-Ti_16')
  model = models.VisionTransformer(num_classes=4, **config)
  params = checkpoint.unflatten(
    checkpoint.flatten(random_like(param_shapes(config, 4, 32), seed=5, scale=0.2))
  )
  rng = np.random.default_rng(6)
  batch = {
    'image': rng.uniform(-1, 1, (2, 32, 32, 3)).astype(np.float32),
    'weights': rng.normal(size=(2, 4)).astype(np.float32),
  }
  grad_fn = jax.jit(flexi.random_patch_grad(model, (8, 16), 32, _weighted_sum))
  small = model.clone(architecture=model.architecture.changed(patch_size=(8, 8)))
  at = checkpoint.unflatten(flexi.at_patch_size(checkpoint.flatten(params), 8, 32, 1))
  apply_small = lambda p: small.apply({'params': p}, batch['image'], train=False)
  want_loss, want = jax.jit(jax.value_and_grad(lambda p: _weighted_sum(apply_small(p), batch)))(at)
  pinv, zoom = vit_checkpoint.pi_resize_matrix(16, 8), vit_checkpoint.zoom_matrix(2, 4)
  kernel = np.einsum('ah,bw,abcd->hwcd', pinv, pinv, want['embedding']['kernel'])
  posemb = want['Transformer']['posembed_input']['pos_embedding']
  grid = np.einsum('ah,bw,abd->hwd', zoom, zoom, posemb[0, 1:].reshape(4, 4, -1))
  for seed in range(8):
    loss, got = grad_fn(params, batch, jax.random.key(seed))
    if abs(float(loss) - float(want_loss)) <= 1e-4 * abs(float(want_loss)):
      break  # a step drawn at patch 8
  else:
    pytest.fail('no draw of patch 8 in 8 steps')
  assert_close(relative_error(got['head']['kernel'], want['head']['kernel']), BOUND, 'head')
  assert_close(relative_error(got['embedding']['kernel'], kernel), BOUND, 'kernel gradient')
  got_posemb = got['Transformer']['posembed_input']['pos_embedding']
  assert_close(relative_error(got_posemb[0, 1:].reshape(2, 2, -1), grid), BOUND, 'posemb grid')
  np.testing.assert_allclose(got_posemb[0, 0], posemb[0, 0], rtol=1e-4, atol=1e-7)


def test_a_run_with_a_random_patch_size_per_step_learns_and_evaluates(tmp_path):
  """The tiny run (`testing`, 16 px patches at 16 px) drawing 8 or 16 px patches per step:
  the loss falls (by 0.1; by 0.27-0.31 here at base_lr 0.1; at 0.3 the mixed sizes are
  unstable, 0.07-0.3), and the saved
  parameters are the model's own (16 px kernel), which then load at each patch size."""
  from conftest import tiny_run_config

  from vit_jax.training import loop

  workdir = str(tmp_path / 'run')
  config = tiny_run_config(
    flexi_patch_sizes=(8, 16), total_steps=48, eval_every=48, progress_every=8, base_lr=0.1
  )
  summary = loop.train_and_evaluate(config, workdir)
  logged = [json.loads(line) for line in open(os.path.join(workdir, 'metrics.jsonl'))]
  losses = [entry['train_loss'] for entry in logged if 'train_loss' in entry]
  assert losses[-1] < losses[0] - 0.1, losses
  assert summary['step'] == 48 and 0.0 <= summary['test_accuracy'] <= 1.0
  flat = checkpoint.flatten(checkpoint.load(workdir))
  assert flat['embedding/kernel'].shape == (16, 16, 3, 10)
  for patch in (4, 8):
    assert loader.load_model(workdir, patch_size=patch).spec.grid == 16 // patch


def test_evaluate_and_predict_take_a_patch_size(tmp_path, capsys):
  """The commands load a 16 px-patch checkpoint at 8 px patches (a 2x2 grid at 16 px)."""
  from vit_jax import evaluate
  from vit_jax import predict

  config = architectures.MODEL_CONFIGS['testing']
  params = random_like(param_shapes(config, 10, 16), seed=7, scale=0.2)
  path = str(checkpoint.save_npz(params, tmp_path / 'model.npz'))
  common = [f'--checkpoint={path}', '--model=testing', '--patch_size=8']
  assert evaluate.main([*common, '--dataset=digits', '--batch=128']) == 0
  result = json.loads(capsys.readouterr().out)
  assert result['examples'] == 359 and 0.0 <= result['top1'] <= 1.0
  from PIL import Image

  Image.fromarray(np.full((16, 16, 3), 128, np.uint8)).save(tmp_path / 'grey.png')
  assert predict.main([*common, '--top_k=2', str(tmp_path / 'grey.png')]) == 0
  assert '1. ' in capsys.readouterr().out
