"""The newer ViT families (`configs.families`: DINOv2, DINOv2 with registers, DeiT III, SigLIP,
CLIP, EVA-02) against timm itself, both ways.

Each family's model is built by `timm.create_model(name, pretrained=False)` at a test size
(width 24, depth 2, 3 heads, a 3x3 patch grid), every parameter drawn anew: imported, our
logits and pre-logits features equal timm's; our random parameters exported, timm's model of
that name loads them strictly and gives ours. timm takes the family's normalised input, ours
the [-1, 1] images every model here takes (the family's mean and std applied in the model).
"""

import functools
import json
import re

from conftest import param_shapes
from conftest import timm_hub_file
from conftest import timm_naflex_logits
import jax
import numpy as np
import pytest

from vit_jax import checkpoint
from vit_jax import models
from vit_jax.configs import ConfigError
from vit_jax.configs import architectures
from vit_jax.configs import common
from vit_jax.configs import families
from vit_jax.configs import model_spec
from vit_jax.configs import timm_weights
from vit_jax.core import sharding
from vit_jax.data import on_device
from vit_jax.data.readers import builtin
from vit_jax.interop import export as export_lib
from vit_jax.interop import timm as interop_timm
from vit_jax.interop import timm_files
from vit_jax.interop import torch_layout
from vit_jax.models import vit
from vit_jax.models import vit_checkpoint
from vit_jax.training import optim
from vit_jax.training import steps

torch = pytest.importorskip('torch')
safetensors = pytest.importorskip('safetensors')
safetensors_torch = pytest.importorskip('safetensors.torch')
try:
  import timm
except ImportError:
  timm = None  # CPU-only machines install it apart (README: Set-up)
needs_timm = pytest.mark.skipif(timm is None, reason='timm is not installed (README: Set-up)')

BOUND = 2e-6  # relative, on logits and on pre-logits features
GRID = 3
SIZES = {'embed_dim': 24, 'depth': 2, 'num_heads': 3}

# One model of each family (and both of EVA-02's layouts in timm, and both GELUs of SigLIP's).
CASES = (
  'vit_base_patch14_dinov2',
  'vit_base_patch14_reg4_dinov2',
  'deit_small_patch16_224',
  'deit3_base_patch16_224',
  'vit_base_patch16_siglip_224',
  'vit_so400m_patch16_siglip_256',  # SigLIP 2's tanh GELU
  'vit_base_patch16_siglip_gap_224',
  'vit_large_patch16_siglip_gap_512',  # the tanh GELU
  'vit_base_patch16_clip_224',
  'vit_base_patch16_clip_quickgelu_224',
  'eva02_tiny_patch14_224',
  'eva02_base_patch14_224',
  'vit_small_patch16_dinov3',
  'vit_base_patch16_dinov3_qkvb',  # the query's and value's biases
  'vit_huge_plus_patch16_dinov3',  # SwiGLU, its gate apart
)


def timm_model(name, seed=0):
  """timm's model `name` at the test size, every parameter random (norm scales and LayerScale
  gammas near 1, so that each part of the model shows in its output)."""
  patch = model_spec.registered(name).patch_size[0]
  model = timm.create_model(
    name, pretrained=False, img_size=GRID * patch, num_classes=5, **SIZES
  ).eval()
  generator = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for key, p in model.named_parameters():
      module = key.rsplit('.', 2)[-2] if key.count('.') else ''
      near_one = key.endswith('gamma') or ('norm' in module and key.endswith('weight'))
      p.copy_(0.1 * torch.randn(p.shape, generator=generator) + near_one)
  return model


def our_config(name, model):
  """The architecture of registry entry `name` at the test size of timm's `model`."""
  fc2 = model.blocks[0].mlp.fc2.weight
  return model_spec.registered(name).changed(
    hidden_size=SIZES['embed_dim'],
    num_layers=SIZES['depth'],
    num_heads=SIZES['num_heads'],
    mlp_dim=int(fc2.shape[1]),
  )


def images(size, n=2, seed=1):
  return np.random.default_rng(seed).uniform(-1, 1, (n, size, size, 3)).astype(np.float32)


def timm_input(x, config):
  """Our [-1, 1] images as the family's timm model takes them: (pixel - mean) / std."""
  mean, std = (np.asarray(v, np.float64) for v in config.input_stats or (0.5, 0.5))
  normalised = (((x.astype(np.float64) + 1) / 2 - mean) / std).astype(np.float32)
  return torch.from_numpy(np.ascontiguousarray(normalised.transpose(0, 3, 1, 2)))


def theirs(model, x, config):
  """(logits, pre-logits features) of timm's model."""
  with torch.no_grad():
    features = model.forward_head(model.forward_features(timm_input(x, config)), pre_logits=True)
    return model.head(features).numpy(), features.numpy()


def ours(config, flat, x):
  """(logits, pre-logits features) of our model."""
  with_head = vit.VisionTransformer(5, config)
  features = vit.VisionTransformer(None, config)
  no_head = {k: v for k, v in flat.items() if not k.startswith('head/')}
  return (
    np.asarray(with_head.apply({'params': checkpoint.unflatten(flat)}, x, train=False)),
    np.asarray(features.apply({'params': checkpoint.unflatten(no_head)}, x, train=False)),
  )


def relative_error(a, b):
  return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def random_flat(config, size, seed=0):
  shapes = checkpoint.flatten(param_shapes(None, 5, size, vit.VisionTransformer(5, config)))
  rng = np.random.default_rng(seed)
  return {
    k: (0.1 * rng.normal(size=v.shape) + k.endswith(('/scale', 'ls1/gamma', 'ls2/gamma'))).astype(
      np.float32
    )
    for k, v in shapes.items()
  }


def test_every_family_model_is_named_as_in_timm():
  if timm is None:
    pytest.skip('timm is not installed (README: Set-up)')
  assert set(families.MODELS) <= set(timm.list_models())
  for name in families.MODELS:
    assert architectures.MODEL_CONFIGS[name].model_name == name


@needs_timm
@pytest.mark.parametrize('name', CASES)
def test_family_imports_from_and_exports_to_timm_with_its_outputs(name):
  model = timm_model(name)
  config = our_config(name, model)
  size = GRID * config.patch_size[0]
  x = images(size)
  # timm -> ours.
  state = {k: v.numpy() for k, v in model.state_dict().items()}
  flat = interop_timm.from_timm(state, our_config(name, model), 'timm state')
  logits, features = theirs(model, x, config)
  assert np.abs(logits).max() > 0.1 and np.abs(features).max() > 0.1
  our_logits, our_features = ours(config, flat, x)
  assert relative_error(our_logits, logits) <= BOUND, 'logits, imported'
  assert relative_error(our_features, features) <= BOUND, 'pre-logits, imported'
  # ours -> timm: timm's own model of the name loads the export strictly.
  flat = random_flat(config, size, seed=2)
  exported = timm.create_model(name, pretrained=False, img_size=size, num_classes=5, **SIZES).eval()
  state = interop_timm.to_timm(flat, config)
  exported.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=True)
  logits, features = theirs(exported, x, config)
  our_logits, our_features = ours(config, flat, x)
  assert relative_error(logits, our_logits) <= BOUND, 'logits, exported'
  assert relative_error(features, our_features) <= BOUND, 'pre-logits, exported'


# The smallest model of each family, and EVA-02's other layout, in the fast tier; the rest
# (seconds of tracing each) are slow.
_COUNTED_FAST = (
  'vit_small_patch14_dinov2',
  'vit_small_patch14_reg4_dinov2',
  'deit3_small_patch16_224',
  'vit_base_patch16_siglip_224',
  'vit_base_patch32_clip_224',
  'eva02_tiny_patch14_224',
  'vit_small_patch16_dinov3',
)


@needs_timm
@pytest.mark.parametrize(
  'name',
  [n if n in _COUNTED_FAST else pytest.param(n, marks=pytest.mark.slow) for n in families.MODELS],
)
def test_each_named_model_has_timms_sizes_and_parameter_count(name):
  """Our registry entry of each timm name against `timm.create_model(name)` on the meta device
  (no memory): width, depth, heads, the MLP's activation, the exact parameter count at its
  resolution, and the name that a file of it is recognised as (`timm_files.model_name`)."""
  theirs = timm.create_model(name, pretrained=False, num_classes=1000, device='meta')
  config = architectures.MODEL_CONFIGS[name]
  arch = model_spec.registered(name)
  naflex = arch.posemb == 'grid'  # NaFlexVit: its table's grid, whatever the image
  size = arch.posemb_grid[0] * arch.patch_size[0] if naflex else theirs.patch_embed.img_size[0]
  t = config.transformer
  assert (config.hidden_size, t.num_layers) == (theirs.embed_dim, len(theirs.blocks))
  assert t.num_heads == theirs.blocks[0].attn.num_heads
  act = getattr(theirs.blocks[0].mlp, 'act', None)
  activation = {'GELUTanh': 'gelu_tanh', 'QuickGELU': 'quick_gelu', 'SiLU': 'swiglu'}.get(
    type(act).__name__, 'gelu' if getattr(act, 'approximate', None) == 'none' else act
  )
  assert activation == model_spec.registered(name).block.mlp
  compute = model_spec.Compute(scan=True)  # one block traced
  scanned = models.build(model_spec.ModelSpec(arch, size), 1000, compute)
  ours = param_shapes(config, 1000, size, module=scanned)
  count = sum(int(np.prod(x.shape)) for x in checkpoint.flatten(ours).values())
  assert count == sum(p.numel() for p in theirs.parameters())
  # A file of it, without our metadata, is recognised by its tensors; where they fit models
  # that differ in what the file does not record (CLIP's two GELUs; the paper's layout of DeiT
  # and SigLIP's mean-pooled models), one line names them.
  plain = name.replace('_quickgelu', '')
  quick = plain.replace('_clip_', '_clip_quickgelu_')
  twins = _TWINS.get(re.sub(r'_\d+$', '', name))
  if {plain, quick} <= set(families.MODELS) and plain != quick:
    twins = {plain, quick}
  if name in _SAME_GRID:
    with pytest.raises(checkpoint.CheckpointError) as e:
      timm_files.model_name(theirs.state_dict(), 'f.safetensors')
    assert str(e.value).startswith(f'f.safetensors: its tensors fit {_SAME_GRID[name]}, whose ')
    return
  if twins is None:
    assert timm_files.model_name(theirs.state_dict(), 'f.safetensors') == name
    return
  with pytest.raises(checkpoint.CheckpointError) as e:
    timm_files.model_name(theirs.state_dict(), 'f.safetensors')
  named = re.findall(r'(?:fit | and )(\S+) \(', str(e.value))
  assert set(named) == {name if t == '*' else t for t in twins}, str(e.value)
  assert str(e.value).endswith(
    'which differ in what the file does not record; pass --model naming the one whose weights '
    'it holds'
  )


# timm's 384 px so400m/14 has the 27x27 grid of its 378 px one: the same tensors.
_SAME_GRID = {
  f'vit_so400m_patch14_siglip{gap}_{res}': (
    f'vit_so400m_patch14_siglip{gap}_378 and vit_so400m_patch14_siglip{gap}_384'
  )
  for gap in ('', '_gap')
  for res in (378, 384)
}
# The files whose tensors fit the paper's models too: their names without the resolution ('*':
# the name itself); CLIP's files fit both GELUs' models where both are registered. (SigLIP 2's
# mean-pooled B/32 computes what ViT-B_32-gap does, tanh GELU and all: it is named.)
_TWINS = {
  'deit_tiny_patch16': {'*', 'ViT-Ti_16'},
  'deit_small_patch16': {'*', 'ViT-S_16'},
  'deit_base_patch16': {'*', 'ViT-B_16'},
  'vit_base_patch16_siglip_gap': {'*', 'ViT-B_16-gap'},
  'vit_large_patch16_siglip_gap': {'*', 'ViT-L_16-gap'},
}


@needs_timm
@pytest.mark.parametrize('name', ['vit_small_patch14_reg4_dinov2', 'eva02_tiny_patch14_224'])
def test_a_timm_file_goes_through_export_and_back_into_timm(tmp_path, name):
  """A `.safetensors` of timm's model (full width, one block, a 2x2 grid) read as a file
  (`export.load`: the name from its tensors, depth and layout from the file), and written by
  `export --format=timm` into a file that `timm.create_model` of the recorded name and
  keywords loads strictly, giving the first model's logits."""
  patch = model_spec.registered(name).patch_size[0]
  size = 2 * patch
  model = timm.create_model(name, pretrained=False, img_size=size, num_classes=5, depth=1).eval()
  generator = torch.Generator().manual_seed(0)
  with torch.no_grad():
    for p in model.parameters():
      p.add_(0.05 * torch.randn(p.shape, generator=generator))
  source = tmp_path / 'timm.safetensors'
  safetensors_torch.save_file({k: v.contiguous() for k, v in model.state_dict().items()}, source)
  x = images(size)
  logits, _ = theirs(model, x, model_spec.registered(name))
  loaded = export_lib.load(str(source)).loaded  # the name from its tensors (timm_files.model_name)
  assert loaded.spec.architecture.name == name
  ours_logits = np.asarray(loaded.model.apply({'params': loaded.params}, x, train=False))
  assert relative_error(ours_logits, logits) <= BOUND
  out = tmp_path / 'back.safetensors'
  notes = export_lib.export(str(source), 'timm', str(out))
  assert any(f"timm.create_model('{name}'" in note for note in notes), notes
  with safetensors.safe_open(str(out), 'pt') as f:
    meta = f.metadata()
  assert meta['timm_model'] == name and json.loads(meta['timm_kwargs'])['depth'] == 1
  again = timm.create_model(meta['timm_model'], **json.loads(meta['timm_kwargs'])).eval()
  again.load_state_dict(safetensors_torch.load_file(str(out)), strict=True)
  back, _ = theirs(again, x, model_spec.registered(name))
  assert relative_error(back, logits) <= BOUND
  # transformers' ViT and our ONNX module are the paper's: refused in one line, nothing written.
  with pytest.raises(torch_layout.ExportError) as e:
    export_lib.export(str(source), 'hf', str(tmp_path / 'hf'))
  assert str(e.value).startswith(f"{name}: the transformers export writes the paper's ViT, not ")
  assert str(e.value).endswith('; use --format=npz or --format=savedmodel, or --format=timm')
  assert not (tmp_path / 'hf').exists()


# One model of each family fine-tuned; EVA-02 as its B (q/k/v apart, the MLP's LayerNorm).
_FINE_TUNED = (
  'vit_base_patch14_dinov2',
  'vit_base_patch14_reg4_dinov2',
  'deit3_base_patch16_224',
  'vit_base_patch16_siglip_224',
  'vit_base_patch16_clip_224',
  'eva02_base_patch14_224',
  'vit_base_patch16_dinov3',
)


@needs_timm
@pytest.mark.parametrize('name', _FINE_TUNED)
def test_a_family_fine_tunes_from_a_timm_model_on_the_digits(name):
  """Fine-tuning as the trainer steps (`steps.train_step`, SGD, layer-wise decay 0.75): the
  backbone imported from timm's model of the name (test size), a fresh zero head of 10
  classes, 30 steps over 4 batches of 32 digits at 3x3 patches. The loss of the last 5 steps
  is under 75% of the first 5's (from ln 10 = 2.30: the head starts at zero)."""
  model = timm_model(name)
  spec_config = our_config(name, model)
  size = GRID * spec_config.patch_size[0]
  flat = interop_timm.from_timm(
    {k: v.numpy() for k, v in model.state_dict().items()}, our_config(name, model), 'timm'
  )
  config = common.get_config()
  config.unlock()
  config.update(
    model=name,
    pp={**config.pp.to_dict(), 'crop': size},
    batch=32,
    total_steps=30,
    warmup_steps=3,
    optimizer='sgd',
    base_lr=0.3,
    decay_type='cosine',
    layer_decay=0.75,
  )
  spec = model_spec.ModelSpec(spec_config, size)
  task = steps.make_task(config, 10, multi_label=False, spec=spec)
  tx, schedule = optim.make_optimizer(config)
  backbone = checkpoint.unflatten({k: v for k, v in flat.items() if not k.startswith('head/')})

  def init(rng):  # a fresh model's state (its zero head), the backbone timm's
    state = steps.init_state(rng, model=task.model, tx=tx, image_size=size, ema=False)
    return state.replace(params={**state.params, **backbone})

  with jax.set_mesh(sharding.make_mesh()):
    state = jax.jit(init)(jax.random.PRNGKey(0))
  step = jax.jit(
    functools.partial(steps.train_step, task=task, tx=tx, schedule=schedule, config=config)
  )
  pixels, labels = builtin.load_digits()
  pixels = np.kron(pixels, np.ones((1, -(-size // 8), -(-size // 8), 1), np.uint8))[:, :size, :size]
  losses = []
  with jax.set_mesh(sharding.make_mesh()):
    for i in range(30):
      idx = np.arange(32 * i, 32 * (i + 1)) % 128  # 4 batches, seen 7 times and a half
      state, metrics = step(state, {'image': pixels[idx], 'label': labels[idx]})
      losses.append(float(metrics['loss']))
  assert np.mean(losses[:5]) == pytest.approx(np.log(10), rel=0.05)
  assert np.mean(losses[-5:]) < 0.75 * np.mean(losses[:5]), losses


@needs_timm
@pytest.mark.parametrize('name', ['vit_base_patch14_reg4_dinov2', 'eva02_tiny_patch14_224'])
def test_a_new_resolution_resizes_as_timm_does_in_the_familys_layout(name):
  """Fine-tuning at 4x4 patches from a 3x3 checkpoint (`vit_checkpoint.adapt`, timm's
  'bicubic_antialias'): the position rows of the patches alone (DINOv2-reg: the prefix has
  none; EVA-02: the class token's row kept) resized as timm's `resample_abs_pos_embed`, and
  the model at the new grid (EVA-02's rotary angles at the new grid, on the same reference)
  gives the logits of timm's model built at that size with those weights."""
  from timm.layers import resample_abs_pos_embed

  model = timm_model(name)
  config = our_config(name, model)
  patch = config.patch_size[0]
  state = {k: v.numpy() for k, v in model.state_dict().items()}
  restored = interop_timm.from_timm(state, our_config(name, model), 'timm state')
  init = random_flat(config, 4 * patch)
  adapted, _ = vit_checkpoint.adapt(restored, init, config, 'bicubic_antialias', 'timm')
  prefix = config.posemb_prefix
  resized = resample_abs_pos_embed(
    model.pos_embed.detach(), (4, 4), (3, 3), num_prefix_tokens=prefix, antialias=True
  ).numpy()
  posemb = adapted['Transformer/posembed_input/pos_embedding']
  np.testing.assert_allclose(posemb, resized, atol=1e-6)
  bigger = timm.create_model(name, pretrained=False, img_size=4 * patch, num_classes=5, **SIZES)
  bigger.load_state_dict(
    {k: torch.from_numpy(v) for k, v in interop_timm.to_timm(adapted, config).items()}, strict=True
  )
  x = images(4 * patch)
  logits, _ = theirs(bigger.eval(), x, config)
  assert relative_error(ours(config, adapted, x)[0], logits) <= BOUND


@needs_timm
def test_the_fine_tune_of_a_family_resizes_its_positions_as_timm_does(tmp_path):
  """The documented fine-tune (`configs/finetune.py:NAME,DATASET`) of a family's checkpoint at
  a new grid: the position rows resized as timm's `resample_abs_pos_embed` (bicubic,
  antialiased: its fine-tunes' default), within 1e-6; the paper's models keep the zoom."""
  from timm.layers import resample_abs_pos_embed

  from vit_jax.configs import recipes

  name = 'vit_base_patch14_reg4_dinov2'
  model = timm_model(name)
  config = our_config(name, model)
  patch = config.patch_size[0]
  state = {k: v.numpy() for k, v in model.state_dict().items()}
  npz = checkpoint.save_npz(
    checkpoint.unflatten(interop_timm.from_timm(state, our_config(name, model), 'timm')),
    tmp_path / 'dinov2.npz',
  )
  run = recipes.finetune(f'{name},cifar10')
  assert recipes.finetune('ViT-B_16,cifar10').posemb_resize == 'zoom'
  params = checkpoint.load_pretrained(
    pretrained_path=npz,
    init_params=checkpoint.unflatten(random_flat(config, 4 * patch)),
    model_config=config,
    posemb_resize=run.posemb_resize,
  )
  resized = resample_abs_pos_embed(
    model.pos_embed.detach(), (4, 4), (3, 3), num_prefix_tokens=0, antialias=True
  ).numpy()
  posemb = checkpoint.flatten(params)['Transformer/posembed_input/pos_embedding']
  np.testing.assert_allclose(posemb, resized, atol=1e-6)


@needs_timm
def test_layer_decay_scales_are_timms_but_the_final_norms():
  """`layer_decay` (0.5, four blocks) scales each parameter of a DINOv2 model as timm's
  `param_groups_layer_decay` scales the learning rate of timm's parameter of that name, except
  the final LayerNorm (`norm`): timm gives it the last block's 0.5, ours the head's 1."""
  from timm.optim._param_groups import param_groups_layer_decay

  name = 'vit_base_patch14_dinov2'
  theirs = timm.create_model(
    name, pretrained=False, img_size=42, num_classes=5, **{**SIZES, 'depth': 4}
  )
  by_param = {id(p): n for n, p in theirs.named_parameters()}
  timm_scale = {
    by_param[id(p)]: group['lr_scale']
    for group in param_groups_layer_decay(theirs, layer_decay=0.5)
    for p in group['params']
  }
  config = our_config(name, theirs).changed(num_layers=4)
  ones = {k: np.ones_like(v) for k, v in random_flat(config, 42).items()}
  scaled, _ = optim.layer_decay(0.5).update(checkpoint.unflatten(ones), None)
  differ = {}
  for key, value in checkpoint.flatten(scaled).items():
    timm_key, _ = interop_timm.timm_name(key)
    ours = float(np.asarray(value).flat[0])
    if ours != timm_scale[timm_key]:
      differ[timm_key] = (ours, timm_scale[timm_key])
  assert differ == {'norm.weight': (1.0, 0.5), 'norm.bias': (1.0, 0.5)}


@needs_timm
@pytest.mark.parametrize('grid, head_dim', [((3, 3), 8), ((4, 6), 64)])
def test_dinov3_rotary_embeddings_are_timms(grid, head_dim):
  """DINOv3's rotary angles (patch centres on [-1, 1] per axis, periods 100 ** (2k / (d / 2)))
  equal timm's `RotaryEmbeddingDinoV3` within 2e-7, and the half-layout rotation of queries
  equals timm's `apply_rot_embed_cat(half=True)` within 1e-6, on a non-square grid too."""
  from timm.layers.pos_embed_sincos import RotaryEmbeddingDinoV3
  from timm.layers.pos_embed_sincos import apply_rot_embed_cat

  from vit_jax.models import rotary

  embed = RotaryEmbeddingDinoV3(dim=head_dim, temperature=100, rotate_half=True)
  theirs = embed.get_embed(list(grid)).numpy()
  sin, cos = rotary.dinov3_tables(grid, head_dim)
  np.testing.assert_allclose(sin, theirs[:, :head_dim], atol=2e-7)
  np.testing.assert_allclose(cos, theirs[:, head_dim:], atol=2e-7)
  q = np.random.default_rng(0).normal(size=(2, 1, len(sin), head_dim)).astype(np.float32)
  rotated = apply_rot_embed_cat(torch.from_numpy(q), torch.from_numpy(theirs), half=True)
  ours = np.asarray(rotary.rotate(q, sin, cos, 'bhnk', half=True))
  np.testing.assert_allclose(ours, rotated.numpy(), atol=1e-6)


@needs_timm
def test_a_checkpoint_without_a_position_table_loads_resizes_and_exports(tmp_path):
  """A DINOv3 file (one block, its hub folder) converted to `.npz`: it loads with no --model
  at its weights' resolution (256 px, no table to say it), at another resolution gives timm's
  logits there (rotary embeddings need no resizing), at patch size 8 (FlexiViT: its kernel
  alone PI-resized), and its timm export loads strictly into `timm.create_model`."""
  from vit_jax.evaluation import loader

  name = 'vit_small_patch16_dinov3'
  torch.manual_seed(0)
  model = timm.create_model(name, pretrained=False, num_classes=5, depth=1).eval()
  source = timm_hub_file(tmp_path, name, 'lvd1689m', model)
  npz = tmp_path / 'dinov3.npz'
  export_lib.export(str(source), 'npz', str(npz))
  loaded = loader.load_model(str(npz))
  assert (loaded.spec.name, loaded.spec.image_size) == (name, 256)
  assert 'Transformer/posembed_input/pos_embedding' not in checkpoint.flatten(loaded.params)
  x = images(64)  # a 4x4 grid: the same weights at another resolution
  logits, _ = theirs(model, x, loaded.spec.architecture)
  run = lambda m, p: np.asarray(jax.jit(lambda p: m.apply({'params': p}, x, train=False))(p))  # noqa: E731
  assert relative_error(run(loaded.model, loaded.params), logits) <= BOUND
  flexi = loader.load_model(str(npz), patch_size=8)
  assert flexi.spec.stride == 8 and flexi.spec.image_size == 256
  assert run(flexi.model, flexi.params).shape == (2, 5)
  out = tmp_path / 'back.safetensors'
  export_lib.export(str(npz), 'timm', str(out))
  with safetensors.safe_open(str(out), 'pt') as f:
    meta = f.metadata()
  again = timm.create_model(meta['timm_model'], **json.loads(meta['timm_kwargs'])).eval()
  again.load_state_dict(safetensors_torch.load_file(str(out)), strict=True)
  back, _ = theirs(again, x, loaded.spec.architecture)
  assert relative_error(back, logits) <= BOUND


def _naflex_batch(patch, seed=1):
  """A packed NaFlex batch of three images of grids 2x3, 4x4 and 1x1 at `patch` px, 20 tokens
  each (padding rows random: they must reach nothing)."""
  from vit_jax.models import naflex

  rng = np.random.default_rng(seed)
  rows = []
  for gh, gw in ((2, 3), (4, 4), (1, 1)):
    image = rng.uniform(-1, 1, (1, gh * patch, gw * patch, 3)).astype(np.float32)
    pixels, r, c, real = (np.asarray(a)[0] for a in naflex.patchify(image, patch))
    pad = 20 - len(pixels)
    noise = rng.normal(size=(pad, pixels.shape[1])).astype(np.float32)
    zeros = np.zeros(pad)
    rows.append(
      naflex.pack(
        *(np.concatenate([a, b])[None] for a, b in ((pixels, noise), (r, zeros))),
        np.concatenate([c, zeros])[None],
        np.concatenate([real, zeros])[None],
      )[0]
    )
  return np.stack(rows)


@needs_timm
@pytest.mark.parametrize(
  'name', ['naflexvit_base_patch16_siglip', 'naflexvit_so400m_patch16_siglip']
)
def test_siglip2_naflex_imports_from_and_exports_to_timm_with_its_outputs(name):
  """SigLIP 2 NaFlex (timm's NaFlexVit of the name: its 2D table resampled bilinearly with
  antialiasing, the MAP head over the real patches) at the test size with 4 px patches and a
  4x4 table, every parameter random, on a packed batch of three grids and padding: imported,
  our logits are timm's within 2e-6; our random parameters exported, timm's model of the name
  loads them strictly and gives ours within 2e-6."""
  from vit_jax.models import naflex

  sizes = dict(SIZES, patch_size=4, pos_embed_grid_size=(4, 4), num_classes=5)
  model = timm.create_model(name, pretrained=False, **sizes).eval()
  generator = torch.Generator().manual_seed(0)
  with torch.no_grad():
    for key, p in model.named_parameters():
      p.copy_(0.1 * torch.randn(p.shape, generator=generator) + key.endswith('norm.weight'))
  arch = model_spec.registered(name).changed(
    hidden_size=SIZES['embed_dim'],
    num_layers=SIZES['depth'],
    num_heads=SIZES['num_heads'],
    mlp_dim=int(model.blocks[0].mlp.fc2.weight.shape[1]),
    patch_size=(4, 4),
    posemb_grid=(4, 4),
  )
  packed = _naflex_batch(4)
  state = {k: v.numpy() for k, v in model.state_dict().items()}
  flat = interop_timm.from_timm_naflex(state, arch, 'timm state', arch.posemb_resample)
  forward = jax.jit(lambda p: naflex.NaFlexViT(5, arch).apply({'params': p}, packed, train=False))
  apply = lambda flat: np.asarray(forward(checkpoint.unflatten(flat)))  # noqa: E731
  theirs = timm_naflex_logits(model, packed)
  assert np.abs(theirs).max() > 0.05
  assert relative_error(apply(flat), theirs) <= BOUND, 'logits, imported'
  flat = {
    k: (0.1 * np.random.default_rng(2).normal(size=v.shape) + k.endswith('/scale')).astype(
      np.float32
    )
    for k, v in flat.items()
  }
  exported = timm.create_model(name, pretrained=False, **sizes).eval()
  state = interop_timm.to_timm_naflex(flat)
  exported.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=True)
  assert relative_error(timm_naflex_logits(exported, packed), apply(flat)) <= BOUND, 'exported'


@needs_timm
def test_a_siglip2_naflex_file_converts_as_it_is(tmp_path):
  """timm's `naflexvit_base_patch16_siglip` file (one block) in its hub folder converts with
  neither --model nor --resample (its name and its resampling are timm's of that name), gives
  timm's logits on a packed batch, and its `.npz` loads with neither."""
  name = 'naflexvit_base_patch16_siglip'
  torch.manual_seed(0)
  model = timm.create_model(name, pretrained=False, num_classes=5, depth=1).eval()
  source = timm_hub_file(tmp_path, name, 'v2_webli', model)
  loaded = export_lib.load(str(source)).loaded
  assert loaded.spec.name == name
  assert loaded.spec.architecture.posemb_resample == 'bilinear_antialias'
  packed = _naflex_batch(16)
  ours = jax.jit(lambda p: loaded.model.apply({'params': p}, packed, train=False))(loaded.params)
  # Its own width (768): float32's orderings reach 3e-6; the export tests' bound.
  assert relative_error(np.asarray(ours), timm_naflex_logits(model, packed)) <= 1e-5
  # Its .npz asks for nothing on loading: the name's resampling is the registry's.
  notes = export_lib.export(str(source), 'npz', str(tmp_path / 'siglip2.npz'))
  assert not any('--resample' in note for note in notes), notes
  from vit_jax.evaluation import loader

  again = loader.load_model(str(tmp_path / 'siglip2.npz'))
  assert again.spec.architecture.posemb_resample == 'bilinear_antialias'


@needs_timm
def test_a_file_of_the_papers_vit_names_the_models_it_may_be():
  """The paper's layout is also DeiT's: a bare file of it names both, and what tells them
  apart, never one model by way of example."""
  vit = timm.create_model('vit_base_patch16_224', pretrained=False, device='meta').state_dict()
  with pytest.raises(checkpoint.CheckpointError) as e:
    timm_files.model_name(vit, 'f.safetensors')
  assert str(e.value) == (
    "f.safetensors: its tensors fit deit_base_patch16_224 (exact GELU, ImageNet's mean and "
    "std) and ViT-B_16 (the paper's: tanh GELU, [-1, 1] pixels), which differ in what the file "
    'does not record; pass --model naming the one whose weights it holds'
  )


def test_a_familys_input_statistics_are_one_pass_over_the_pixels():
  """CLIP's mean and std: the model applies ((x + 1) / 2 - mean) / std to its [-1, 1] input,
  which equals the statistics applied to the pixels in float64 within 2e-6; compiled with the
  devices' uint8 -> [-1, 1] step (`on_device.normalise`), one fusion reads the pixels (the
  two scalings and the patch layout in one pass; no gather, no table)."""
  config = architectures.MODEL_CONFIGS['vit_base_patch16_clip_224']
  mean, std = (np.asarray(s, np.float64) for s in timm_weights.STATISTICS['openai_clip'])
  pixels = np.random.default_rng(0).integers(0, 256, (2, 32, 32, 3), np.uint8)
  x = on_device.normalise(pixels)
  ours = vit.normalise_input(x, model_spec.registered('vit_base_patch16_clip_224').input_stats)
  exact = (pixels / 255.0 - mean) / std
  np.testing.assert_allclose(np.asarray(ours), exact, atol=2e-6 * np.abs(exact).max())
  config.hidden_size = 24
  config.transformer.update(num_layers=1, num_heads=3, mlp_dim=48)
  model = models.VisionTransformer(num_classes=5, **config)
  params = jax.eval_shape(  # shapes suffice to compile
    lambda: model.init(jax.random.key(0), np.zeros((1, 32, 32, 3), np.float32), train=False)
  )
  apply = jax.jit(lambda p, x: model.apply(p, on_device.normalise(x), train=False))
  hlo = apply.lower(params, pixels).compile().as_text()
  assert 'gather' not in hlo
  readers = [c for c in hlo.split('\n\n') if 'u8[2,32,32,3]' in c and c.startswith('%fused')]
  assert len(readers) == 1 and 'multiply(' in readers[0] and 'add(' in readers[0], readers


def test_naflex_and_masked_patch_prediction_refuse_a_familys_options():
  config = common.get_config()
  config.unlock()
  config.update(model='vit_base_patch16_clip_224', naflex_tokens=(64,))
  config.pp.crop = 224
  with pytest.raises(ConfigError) as e:
    model_spec.ModelSpec.of(config)
  assert str(e.value) == (
    'vit_base_patch16_clip_224 sets pre_norm, input_stats, which NaFlex '
    "(naflex_tokens) does not build (its model is the paper's ViT and registers); fine-tune it "
    'as a ViT, or pick a model without them'
  )
  config.update(model='deit3_small_patch16_224', naflex_tokens=(), task='mpp')
  with pytest.raises(ConfigError, match='^deit3_small_patch16_224 sets posemb, input_stats, '):
    model_spec.ModelSpec.of(config)
  # SigLIP 2's NaFlex model trains as NaFlex: its budgets are needed, its table taken as it is.
  config.update(model='naflexvit_base_patch16_siglip', task='classification')
  config.pp.crop = 256
  with pytest.raises(ConfigError) as e:
    model_spec.ModelSpec.of(config)
  assert str(e.value) == (
    'naflexvit_base_patch16_siglip is a NaFlex model (2D position table): set '
    '--config.naflex_tokens, the token budgets it trains at (e.g. 256,576)'
  )
  config.update(naflex_tokens=(64, 256))
  arch = model_spec.ModelSpec.of(config).architecture
  assert (arch.classifier, arch.posemb, arch.posemb_grid) == ('map', 'grid', (16, 16))


@needs_timm
@pytest.mark.slow  # a whole run: 25-30 s on two cores
def test_a_run_fine_tunes_a_timm_file_and_exports_it_back(tmp_path):
  """The whole path, as a user takes it, for EVA-02 Ti (full width, one block, 2x2 patches):
  timm's file -> `export --format=npz` -> a fine-tuning run from it (`pretrained_path`, the
  head re-initialised for the digits' 10 classes, layer_decay 0.75) whose loss falls by 0.2
  -> `export --format=timm` of the run, which `timm.create_model` of the recorded name and
  keywords loads strictly and which gives the run's logits."""
  from conftest import tiny_run_config

  from vit_jax.evaluation import loader
  from vit_jax.training import loop

  name = 'eva02_tiny_patch14_224'
  model = timm.create_model(name, pretrained=False, img_size=28, num_classes=5, depth=1).eval()
  source = tmp_path / 'timm.safetensors'
  safetensors_torch.save_file({k: v.contiguous() for k, v in model.state_dict().items()}, source)
  export_lib.export(str(source), 'npz', str(tmp_path / 'eva.npz'))
  workdir = str(tmp_path / 'run')
  overrides = {'model': name, 'depth': 1, 'pp.crop': 28, 'layer_decay': 0.75}
  overrides.update(total_steps=12, warmup_steps=2, eval_every=12, checkpoint_every=12)
  config = tiny_run_config(pretrained_path=str(tmp_path / 'eva.npz'), **overrides)
  loop.train_and_evaluate(config, workdir)
  # The weights' preprocessing (timm's default tag of the name) goes with the run: recorded
  # beside it and in its params.npz, which predict and evaluate apply.
  weights = timm_weights.default(name).at(28)
  assert loader.load_model(workdir).preprocessing == weights
  assert checkpoint.read_metadata(workdir)['preprocessing'] == json.loads(
    json.dumps(weights.to_json())
  )
  logged = [json.loads(line) for line in open(f'{workdir}/metrics.jsonl')]
  losses = [entry['train_loss'] for entry in logged if 'train_loss' in entry]
  assert losses[-1] < losses[0] - 0.2, losses
  out = tmp_path / 'ft.safetensors'
  export_lib.export(workdir, 'timm', str(out))
  with safetensors.safe_open(str(out), 'pt') as f:
    meta = f.metadata()
  again = timm.create_model(meta['timm_model'], **json.loads(meta['timm_kwargs'])).eval()
  again.load_state_dict(safetensors_torch.load_file(str(out)), strict=True)
  run = loader.load_model(workdir)
  x = images(28)
  logits, _ = theirs(again, x, model_spec.registered(name))
  ours_logits = np.asarray(run.model.apply({'params': run.params}, x, train=False))
  assert ours_logits.shape == (2, 10) and relative_error(ours_logits, logits) <= BOUND
