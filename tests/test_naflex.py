"""NaFlex: images at their own aspect ratio up to a token budget (models/naflex.py, data/naflex.py).

The model is checked against timm's NaFlexVit (an independent implementation:
per-image interpolation of the position table with torch, an additive
attention mask) on batches that mix grids and padding, and against itself on
each image alone; the host batches against a resize and patchify written out;
a run on the digits at mixed budgets trains and evaluates at three resolutions.
"""

import functools
import json
import os

from conftest import assert_close
from conftest import param_shapes
from conftest import random_flat_like
from conftest import relative_error
from conftest import small_arch
from conftest import timm_naflex_logits
from conftest import tiny_run_config
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vit_jax import checkpoint
from vit_jax.configs import model_spec
from vit_jax.configs.data import data_config
from vit_jax.configs.model_spec import Architecture
from vit_jax.configs.model_spec import Compute
from vit_jax.configs.model_spec import ModelSpec
from vit_jax.data import images
from vit_jax.data import naflex as naflex_data
from vit_jax.data import order
from vit_jax.data import pipeline
from vit_jax.data import spec
from vit_jax.evaluation import classify
from vit_jax.evaluation import loader
from vit_jax.interop import export
from vit_jax.interop import timm as interop_timm
from vit_jax.interop import torch_layout
from vit_jax.models import naflex
from vit_jax.models import vit
from vit_jax.models import vit_checkpoint

try:
  import timm
  import torch
except ImportError:
  timm = None
needs_timm = pytest.mark.skipif(timm is None, reason='timm is not installed (README: Set-up)')

# Max |ours - theirs| / max |theirs| of the logits, as the export tests (tests/test_export.py).
BOUND = 1e-5
PATCH = 4
GRIDS = ((2, 3), (4, 4), (5, 2), (1, 1))  # (rows, columns) of the images of one batch
LENGTH = 20  # the batch's token budget: the largest grid, 16 patches, plus padding


def model_and_params(classifier, seed=0):
  config = small_arch(patch_size=(PATCH, PATCH), classifier=classifier, naflex_grid=(4, 4))
  model = naflex.NaFlexViT(5, config)
  shapes = jax.eval_shape(
    lambda: model.init(jax.random.key(0), jnp.zeros((1, 16, 16, 3)), train=False)
  )['params']
  rng = np.random.default_rng(seed)
  # LayerNorm scales near 1 keep activations in a realistic range; every leaf non-zero.
  flat = {
    k: (0.05 * rng.normal(size=v.shape) + k.endswith('/scale')).astype(np.float32)
    for k, v in checkpoint.flatten(shapes).items()
  }
  return config, model, flat


def packed_batch(seed=1):
  """(packed [4, LENGTH, P*P*3 + 3], the images alone) for GRIDS, padding rows random."""
  rng = np.random.default_rng(seed)
  alone, rows = [], []
  for gh, gw in GRIDS:
    image = rng.uniform(-1, 1, (1, gh * PATCH, gw * PATCH, 3)).astype(np.float32)
    pixels, r, c, real = (np.asarray(a)[0] for a in naflex.patchify(image, PATCH))
    # Padding that is not zero: it must not reach the real tokens.
    pad = LENGTH - len(pixels)
    noise = rng.normal(size=(pad, pixels.shape[1])).astype(np.float32)
    zeros = np.zeros(pad)
    rows.append(
      naflex.pack(
        np.concatenate([pixels, noise])[None],
        np.concatenate([r, zeros])[None],
        np.concatenate([c, zeros])[None],
        np.concatenate([real, zeros])[None],
      )[0]
    )
    alone.append(image)
  return np.stack(rows), alone


@pytest.mark.equivalence
@pytest.mark.parametrize('classifier', ['token', 'gap'])
def test_a_packed_batch_gives_each_image_its_own_logits(classifier):
  """Padding, and the other images' grids, change nothing: an image in a packed batch has
  the logits of that image alone (the image path: one full grid). The same math in
  another order (padding in the reductions): normwise within 1e-5, 80x float32 epsilon."""
  _, model, flat = model_and_params(classifier)
  params = checkpoint.unflatten(flat)
  packed, alone = packed_batch()
  apply = jax.jit(functools.partial(model.apply, train=False))
  logits = apply({'params': params}, packed)
  for i, image in enumerate(alone):
    want = apply({'params': params}, image)[0]
    assert_close(relative_error(logits[i], want), BOUND, f'logits of image {i}')


@needs_timm
@pytest.mark.parametrize('classifier', ['token', 'gap'])
def test_naflex_matches_timms_naflexvit_and_converts_both_ways(tmp_path, classifier):
  config, model, flat = model_and_params(classifier)
  packed, _ = packed_batch()
  ours = model.apply({'params': checkpoint.unflatten(flat)}, packed, train=False)
  state = interop_timm.to_timm_naflex(flat)
  theirs_model = interop_timm.build_naflex_model(config, 5)
  theirs_model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=True)
  coords = torch.from_numpy(packed[..., -3:-1].astype(np.int64))
  with torch.no_grad():
    theirs = theirs_model(
      torch.from_numpy(packed[..., :-3]),
      patch_coord=coords,
      patch_valid=torch.from_numpy(packed[..., -1] > 0),
    ).numpy()
  assert np.abs(theirs).max() > 0.05  # a non-trivial head
  assert_close(relative_error(ours, theirs), BOUND, 'logits against the peer')
  back = interop_timm.from_timm_naflex(state, config, 'timm state', 'bilinear')
  assert sorted(back) == sorted(flat)
  for key in flat:
    np.testing.assert_array_equal(back[key], flat[key], err_msg=key)


def _randomised(module, seed=0):
  """`module` (a torch model) with every parameter drawn anew: normal(0, 0.05), LayerNorm
  scales near 1, so that no parameter's role hides behind its initial value."""
  generator = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in module.named_parameters():
      p.copy_(0.05 * torch.randn(p.shape, generator=generator) + name.endswith('norm.weight'))
  return module


def _timm_naflexvit(classifier, **kwargs):
  """timm's NaFlexVit at the test size (tanh GELU, the LayerNorm before pooling as ours)."""
  from timm.models import naflexvit

  return _randomised(
    naflexvit.NaFlexVit(
      num_classes=5,
      patch_size=PATCH,
      embed_dim=24,
      depth=2,
      num_heads=3,
      mlp_ratio=2.0,
      class_token=classifier == 'token',
      global_pool=classifier if classifier == 'token' else 'avg',
      fc_norm=False,
      act_layer='gelu_tanh',
      pos_embed_grid_size=(4, 4),
      **kwargs,
    )
  ).eval()


@needs_timm
def test_a_conv_projection_naflexvit_imports_with_timms_logits():
  """timm's NaFlexVit with `embed_proj_type='conv'` holds its patch kernel as a Conv2d
  [D, C, P, P]: imported, it gives timm's logits on the same images, at the table's grid and
  at another (each patch's rows and columns in timm's order, not swapped)."""
  theirs = _timm_naflexvit(
    'token', embed_proj_type='conv', pos_embed_interp_mode='bilinear', pos_embed_antialias=False
  )
  state = {k: v.numpy() for k, v in theirs.state_dict().items()}
  assert state['embeds.proj.weight'].shape == (24, 3, PATCH, PATCH)
  config = small_arch(patch_size=(PATCH, PATCH))
  flat = interop_timm.from_timm_naflex(state, config, 'timm state', 'bilinear')
  model = naflex.NaFlexViT(5, model_spec.naflex_of(config, (4, 4), 'bilinear'))
  rng = np.random.default_rng(3)
  for rows, cols in ((4, 4), (3, 6)):
    images = rng.uniform(-1, 1, (2, rows * PATCH, cols * PATCH, 3)).astype(np.float32)
    ours = model.apply({'params': checkpoint.unflatten(flat)}, images, train=False)
    with torch.no_grad():
      want = theirs(torch.from_numpy(images.transpose(0, 3, 1, 2).copy())).numpy()
    assert np.abs(want).max() > 0.05  # a non-trivial head
    assert_close(relative_error(ours, want), BOUND, f'logits at a {rows}x{cols} grid')


@needs_timm
@pytest.mark.parametrize('resample', ['bicubic_antialias', 'bilinear_antialias'])
def test_naflex_resamples_its_table_as_timms_antialiased_modes(resample):
  """timm NaFlexVit's default resampling of the position table (bicubic, antialiased) and
  its antialiased bilinear, each on a packed batch of grids below, at and above the table's
  4x4: the logits of ours with `posemb_resample` set so (bilinear: the test above); the file
  records none, so importing one asks for it (read as bilinear, such a file's logits are
  4.5e-2 to 7.0e-2 off)."""
  mode, antialias = interop_timm.NAFLEX_RESAMPLE[resample]
  theirs = _timm_naflexvit(
    'gap', embed_proj_type='linear', pos_embed_interp_mode=mode, pos_embed_antialias=antialias
  )
  state = {k: v.numpy() for k, v in theirs.state_dict().items()}
  packed, _ = packed_batch()
  want = timm_naflex_logits(theirs, packed)
  config = small_arch(patch_size=(PATCH, PATCH), classifier='gap')
  with pytest.raises(torch_layout.ExportError, match='does not record how its position table'):
    interop_timm.from_timm_naflex(state, config, 'f', None)
  flat = interop_timm.from_timm_naflex(state, config, 'timm state', resample)
  params = {'params': checkpoint.unflatten(flat)}
  resampled = model_spec.naflex_of(config, (4, 4), resample)
  ours = naflex.NaFlexViT(5, resampled).apply(params, packed, train=False)
  assert_close(relative_error(ours, want), BOUND, f'logits against timm ({resample})')
  # The mode matters on these grids: bilinear is 100x the bound off.
  bilinear = model_spec.naflex_of(config, (4, 4), 'bilinear')
  other = naflex.NaFlexViT(5, bilinear).apply(params, packed, train=False)
  assert relative_error(other, want) > 100 * BOUND
  # And our export to timm says the mode: it loads back as it was.
  assert interop_timm.build_naflex_model(bilinear, 5).embeds.pos_embed_interp_mode == 'bilinear'
  assert interop_timm.build_naflex_model(resampled, 5).embeds.pos_embed_interp_mode == mode


# (height, width, budget) -> (rows, columns): timm's `get_image_size_for_seq` at patch 16
# (timm 1.0.31), the grids a timm NaFlex loader resizes those images to.
TIMM_GRIDS = {
  (480, 640, 256): (14, 18),
  (300, 1000, 49): (4, 12),
  (224, 224, 196): (14, 14),
  (1000, 300, 49): (12, 4),
  (375, 500, 576): (21, 27),
  (720, 1280, 1024): (24, 42),
  (37, 1111, 64): (2, 32),
  (640, 427, 729): (33, 22),
  (1, 50, 16): (1, 16),
  (100, 99, 9): (3, 3),
}


def test_grids_are_timms_for_the_same_budget():
  """The grid of each image and budget is the one timm's NaFlex pipeline picks (not both sides
  rounded down: 14x18 = 252 tokens for 480x640 at 256, not 13x18 = 234)."""
  for (height, width, budget), want in TIMM_GRIDS.items():
    assert naflex_data.grid_for(height, width, budget) == want, (height, width, budget)
  if timm is None:
    return
  from timm.data.naflex_transforms import get_image_size_for_seq

  rng = np.random.default_rng(0)
  sizes = list(TIMM_GRIDS) + [
    (int(h), int(w), int(b))
    for h, w, b in zip(
      rng.integers(8, 2000, 300), rng.integers(8, 2000, 300), rng.choice([49, 196, 256, 729], 300)
    )
  ]
  for height, width, budget in sizes:
    _, (h, w) = get_image_size_for_seq((height, width), 16, budget)
    assert naflex_data.grid_for(height, width, budget) == (h // 16, w // 16), (height, width)


def test_grids_keep_the_aspect_ratio_within_the_budget():
  for height, width in ((8, 8), (6, 8), (7, 5), (3, 30), (100, 1)):
    for budget in (1, 4, 9, 16, 64):
      rows, cols = naflex_data.grid_for(height, width, budget)
      assert 1 <= rows * cols <= budget, (height, width, budget)
      if min(rows, cols) > 1 and rows < budget and cols < budget:
        # Each side rounded up from the exact scale: the ratio within one patch.
        assert abs(rows / cols - height / width) <= height / width * (
          1 / (rows - 1) + 1 / (cols - 1)
        )
  assert naflex_data.grid_for(8, 8, 16) == (4, 4) and naflex_data.grid_for(6, 8, 16) == (3, 4)


def test_a_packed_image_is_its_resize_cut_into_patches_in_row_order():
  image = np.random.default_rng(2).integers(0, 256, (7, 5, 3), np.uint8)
  packed = naflex_data.pack_image(image, PATCH, 9, 12)
  rows, cols = naflex_data.grid_for(7, 5, 9)
  resized = images.to_float(images.resize_exact(image, rows * PATCH, cols * PATCH))
  for k in range(rows * cols):
    r, c = divmod(k, cols)
    block = resized[r * PATCH : (r + 1) * PATCH, c * PATCH : (c + 1) * PATCH]
    np.testing.assert_array_equal(packed[k, :-3], block.reshape(-1))
    np.testing.assert_array_equal(packed[k, -3:], [r, c, 1])
  np.testing.assert_array_equal(packed[rows * cols :], 0)


def test_train_batches_are_fixed_shape_mixed_budgets_and_a_function_of_seed_and_step():
  config = tiny_run_config(model='ViT-Demo_4', naflex_tokens=(4, 9, 16), batch=64)
  source = pipeline.split_source(config, 'train')
  pp = pipeline.Preprocessing.of(config)

  def batch(step):
    it = naflex_data.TrainBatches(
      source, pp, (4, 9, 16), PATCH, local_batch=64, start_step=step, keys=order.keys(0)
    )
    return next(it)

  first = batch(3)
  assert first['image'].shape == (64, 16, PATCH * PATCH * 3 + 3) and first['label'].shape == (64,)
  real = first['image'][..., -1].sum(axis=1)
  assert {int(n) for n in real} - {1, 2, 3, 4, 6, 9, 12, 16} == set() and len(set(real)) >= 3
  again = batch(3)
  np.testing.assert_array_equal(first['image'], again['image'])
  assert not np.array_equal(first['image'], batch(4)['image'])
  model = ModelSpec.of(config)
  shape = spec.batch_spec(config, 10, False, train=True, model_spec=model)['image'].shape
  assert shape == (config.batch, 16, PATCH * PATCH * 3 + 3)


def test_a_naflex_run_trains_at_mixed_budgets_and_evaluates_at_three_resolutions(tmp_path):
  """One layer of the demo model, 48 steps at budgets of 4, 9 and 16 patches: the loss
  falls by 0.1 (measured 0.23), and the run's parameters evaluate on all 359 test digits
  at 8, 16 and 24 px (its position grid resampled), and export to timm and back."""
  from vit_jax.training import loop

  workdir = str(tmp_path / 'run')
  config = tiny_run_config(
    model='ViT-Demo_4',
    depth=1,
    naflex_tokens=(4, 9, 16),
    total_steps=48,
    eval_every=48,
    progress_every=8,
    optimizer='adam',
    base_lr=1e-3,
    dropout_rate=0.0,
  )
  loop.train_and_evaluate(config, workdir)
  logged = [json.loads(line) for line in open(os.path.join(workdir, 'metrics.jsonl'))]
  losses = [entry['train_loss'] for entry in logged if 'train_loss' in entry]
  assert losses[-1] < losses[0] - 0.1, losses
  loaded = loader.load_model(workdir)
  assert isinstance(loaded.model, naflex.NaFlexViT) and loaded.spec.architecture.posemb_grid == (
    4,
    4,
  )
  for crop in (8, 16, 24):
    data = data_config()
    data.update(dataset='digits', batch_eval=128)
    data.pp.crop = loader.check_resolution(loaded, crop)
    numbers = classify.evaluate_checkpoint(loaded, data, 'test')
    assert numbers['examples'] == 359 and 0.0 <= numbers['top1'] <= 1.0, (crop, numbers)
  with pytest.raises(loader.InputError, match='use a multiple of the patch size 4'):
    loader.check_resolution(loaded, 10)
  if timm is not None:
    out = str(tmp_path / 'naflex.safetensors')
    export.export(workdir, 'timm', out)
    back = checkpoint.flatten(export.load(out, 'ViT-Demo_4').loaded.params)
    for key, value in checkpoint.flatten(loaded.params).items():
      np.testing.assert_array_equal(back[key], value, err_msg=key)


@pytest.mark.equivalence
def test_naflex_runs_on_the_vits_encoder_with_its_options():
  """NaFlex's blocks are `vit.Encoder`'s over each image's real tokens, so it takes the
  encoder's options: the written-out attention masks the padding as XLA's kernel
  does (the same math in another order, within 1e-5) and records weights that give it none;
  scanned and rematerialised blocks give the unrolled ones' logits; a run may set ViT-22B's
  block options and attention dropout."""
  from vit_jax.models import vit_checkpoint
  from vit_jax.training import program
  from vit_jax.training import steps

  _, model, flat = model_and_params('gap')
  params = checkpoint.unflatten(flat)
  packed, _ = packed_batch()

  def logits(module, tree):
    return jax.jit(functools.partial(module.apply, train=False))({'params': tree}, packed)

  fused = logits(model.clone(compute=Compute(attention='xla')), params)
  explicit = logits(model.clone(compute=Compute(attention='explicit')), params)
  assert_close(relative_error(explicit, fused), BOUND, 'written-out attention')
  remat = logits(model.clone(compute=Compute(remat=True)), params)
  assert_close(relative_error(remat, fused), BOUND, 'rematerialised blocks')
  stacked = vit_checkpoint.stack_blocks(params)
  scanned = logits(model.clone(compute=Compute(scan=True)), stacked)
  assert_close(relative_error(scanned, fused), BOUND, 'scan')
  _, state = model.apply({'params': params}, packed, train=False, mutable=['intermediates'])
  block = state['intermediates']['Transformer']['encoderblock_0']
  weights = np.asarray(block['MultiHeadDotProductAttention_1']['attention_weights'][0])
  real = packed[..., -1].sum(axis=1).astype(int)  # 'gap': no prefix tokens
  for i, n in enumerate(real):
    assert np.all(weights[i, :, :, n:] == 0) and np.allclose(weights[i, :, :n, :n].sum(-1), 1)

  config = tiny_run_config(
    model='ViT-Demo_4',
    naflex_tokens=(4, 9), attention_dropout_rate=0.1, scan_layers=True, remat=True,
    **{'block.qk_norm': True, 'block.parallel_block': True},
  )  # fmt: skip
  spec = program.validate(config, 1)
  task = steps.make_task(config, 10, False, spec)
  images = jnp.asarray(packed_batch()[0][:, :9])
  batch = {'image': images, 'label': jnp.arange(4)}
  init = task.model.init(jax.random.key(0), images, train=False)['params']
  head = jax.random.normal(jax.random.key(1), init['head']['kernel'].shape)  # not zero: a loss
  init = {**init, 'head': {**init['head'], 'kernel': head}}
  loss = jax.jit(task.loss_fn, static_argnums=3)
  losses = [loss(init, batch, jax.random.key(k), True) for k in (0, 1)]
  assert np.isfinite(losses).all() and losses[0] != losses[1]  # attention dropout draws


def test_naflex_fine_tunes_from_a_plain_vits_checkpoint(tmp_path):
  """A plain ViT's 1D table (class token row, then a 4x4 grid) becomes NaFlex's 2D table: the
  patch rows as they are at the same grid, resized by posemb_resize at another (the 1D 'zoom'
  resize of the same grid, laid out in 2D), the class token row dropped; the rest kept."""
  from conftest import param_shapes
  from conftest import random_like

  config = small_arch(patch_size=(PATCH, PATCH))
  plain = random_like(param_shapes(None, 5, 16, vit.VisionTransformer(5, config)), seed=3)
  path = checkpoint.save_npz(plain, tmp_path / 'plain.npz')
  table = np.asarray(plain['Transformer']['posembed_input']['pos_embedding'])
  for grid in ((4, 4), (2, 2)):
    model = naflex.NaFlexViT(5, model_spec.naflex_of(config, grid, 'bilinear'))
    init = jax.eval_shape(
      lambda: model.init(jax.random.key(0), jnp.zeros((1, 16, 16, 3)), train=False)
    )['params']
    init = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), init)
    got = checkpoint.flatten(
      checkpoint.load_pretrained(
        pretrained_path=str(path), init_params=init, model_config=config, verbose=False
      )
    )
    posemb = got['Transformer/posembed_input/pos_embedding']
    side = grid[0]
    want = vit_checkpoint.resize_posemb(table, 1 + side * side, 1, 'zoom')[0, 1:]
    np.testing.assert_allclose(posemb.reshape(side * side, -1), want, rtol=1e-6, atol=1e-7)
    if grid == (4, 4):
      np.testing.assert_array_equal(posemb.reshape(16, -1), table[0, 1:])
    for key, value in checkpoint.flatten(plain).items():
      if not key.startswith(('Transformer/posembed_input', 'head/')):
        np.testing.assert_array_equal(got[key], value, err_msg=key)


@needs_timm
def test_the_timm_exports_loading_recipe_rebuilds_a_run_with_registers(tmp_path):
  """The line `--format=timm` prints for a NaFlex ViT, run as printed, gives timm's NaFlexVit
  with the file's two registers (which the model name's registry entry lacks) and our logits."""
  from vit_jax.configs import architectures

  config = architectures.MODEL_CONFIGS['testing']
  config.update(patches={'size': (PATCH, PATCH)}, num_registers=2)
  model = naflex.NaFlexViT(5, model_spec.naflex_of(Architecture.of(config), (4, 4), 'bilinear'))
  flat = random_flat_like(param_shapes(None, None, 16, module=model), seed=4, scale=0.3)
  path = checkpoint.save_npz(checkpoint.unflatten(flat), tmp_path / 'naflex.npz')
  out = str(tmp_path / 'naflex.safetensors')
  notes = export.export(path, 'timm', out, 'testing')
  [recipe] = [n for n in notes if n.startswith('load: ')]
  call = recipe[len('load: ') :].split(' (timm NaFlexVit')[0]
  import vit_jax.interop.export  # noqa: F401  the recipe names it from the package

  theirs_model = eval(call, {'vit_jax': __import__('vit_jax')})
  packed, _ = packed_batch()
  ours = model.apply({'params': checkpoint.unflatten(flat)}, packed, train=False)
  theirs = timm_naflex_logits(theirs_model, packed)
  assert np.abs(theirs).max() > 0.05
  assert_close(relative_error(ours, theirs), BOUND, 'logits of the rebuilt model')


# ---------------------------------------------------------------------------
# What a NaFlex run says: its memory advice and its preprocessing.


def test_out_of_memory_under_naflex_names_the_token_budget():
  """Out of memory under NaFlex names the token budget (`--config.naflex_tokens`) beside
  accum_steps and batch."""
  from conftest import tiny_run_config
  import jax

  from vit_jax.training import loop

  config = tiny_run_config(naflex_tokens=(4, 100_000))
  with pytest.raises(loop.TrainingError) as e:
    with loop._out_of_memory_advice(config):
      raise jax.errors.JaxRuntimeError('RESOURCE_EXHAUSTED: Out of memory allocating 9 GB')
  assert str(e.value) == (
    'out of device memory at batch 32 per step of up to 100,000 tokens an image: lower the '
    'largest budget in --config.naflex_tokens (now (4, 100000)), raise --config.accum_steps '
    '(now 1), or lower --config.batch'
  )


def test_a_naflex_runs_preprocessing_line_says_its_budgets():
  """A NaFlex run's preprocessing line says its token budgets, not a square crop to pp.crop."""
  from conftest import tiny_run_config

  config = tiny_run_config(model='ViT-Demo_4', naflex_tokens=(4, 9, 16))
  line = pipeline.Preprocessing.of(config).describe()
  assert line.startswith(
    'preprocessing: train inception crop (area 0.5-1) at its own aspect ratio, resized to a '
    'budget drawn from 4, 9, 16 tokens (NaFlex), no flip; eval resize to 16 px.'
  ), line
