"""Register tokens (Darcet et al. 2023): `num_registers` on every ViT, as timm's `reg_tokens`.

Placed after the class token and position-embedded with it (timm's
`reg_token` with `no_embed_class=False`), dropped before the head; checked
against timm itself (export, import of timm-initialised weights), our plain
PyTorch forward (the ONNX path) and NaFlex; exact parameter counts.
"""

import json
import os

from conftest import assert_close
from conftest import param_shapes
from conftest import random_flat
from conftest import random_flat_like
from conftest import random_images
from conftest import relative_error
from conftest import small_arch
from conftest import small_vit_config
from conftest import tiny_run_config
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
from vit_jax.interop import timm as interop_timm
from vit_jax.interop import torch_vit
from vit_jax.models import flexi
from vit_jax.models import naflex
from vit_jax.models import vit_checkpoint
from vit_jax.training import program

torch = pytest.importorskip('torch')
try:
  import timm
except ImportError:
  timm = None
needs_timm = pytest.mark.skipif(timm is None, reason='timm is not installed (README: Set-up)')

BOUND = 1e-5  # max |ours - theirs| / max |theirs| of the logits, as tests/test_export.py


def ours(config, flat, x):
  num_classes = flat['head/kernel'].shape[-1] if 'head/kernel' in flat else None
  model = models.VisionTransformer(num_classes=num_classes, **config)
  return np.asarray(model.apply({'params': checkpoint.unflatten(flat)}, x, train=False))


def test_registers_add_their_embeddings_and_position_rows_only():
  """ViT-B/16 with 4 registers: 86,567,656 + 4 x 768 (the tokens) + 4 x 768 (their position
  embeddings) = 86,573,800; without registers the tree is the released one."""
  config = architectures.MODEL_CONFIGS['ViT-B_16']
  count = lambda c: sum(int(np.prod(v.shape)) for v in jax.tree.leaves(param_shapes(c, 1000, 224)))
  assert count(config) == 86_567_656
  config.num_registers = 4
  shapes = checkpoint.flatten(param_shapes(config, 1000, 224))
  assert count(config) == 86_573_800
  assert shapes['registers'].shape == (1, 4, 768)
  assert shapes['Transformer/posembed_input/pos_embedding'].shape == (1, 1 + 4 + 196, 768)


def test_registers_are_dropped_before_the_head():
  config = small_vit_config('ViT-Ti_16', classifier='token_unpooled', num_registers=3)
  flat = random_flat(config, None, 32)
  tokens = ours(config, flat, random_images(32))
  assert tokens.shape == (2, 1 + 4, 24)  # the class token and the 2x2 patches, no registers


@needs_timm
@pytest.mark.parametrize('classifier', ['token', 'gap', 'map'])
def test_registers_export_to_timms_reg_tokens_and_back(classifier):
  name = {'token': 'ViT-Ti_16', 'gap': 'ViT-S_16-gap', 'map': 'ViT-g_14-map'}[classifier]
  size = 28 if classifier == 'map' else 32
  config = small_vit_config(name, num_registers=2)
  flat = random_flat(config, 7, size)
  state = interop_timm.to_timm(flat)
  assert state['reg_token'].shape == (1, 2, 24)
  model = interop_timm.build_model(Architecture.of(config), 7, size)
  model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=True)
  assert model.num_reg_tokens == 2 and not model.no_embed_class
  x = random_images(size)
  with torch.no_grad():
    theirs = model(torch.from_numpy(x.transpose(0, 3, 1, 2).copy())).numpy()
  assert np.abs(theirs).max() > 0.05
  assert_close(relative_error(ours(config, flat, x), theirs), BOUND, 'logits against the peer')
  back = interop_timm.from_timm(
    state, Architecture.of(small_vit_config(name)), 'timm state'
  )  # reads reg_token
  assert sorted(back) == sorted(flat)
  for key in flat:
    np.testing.assert_array_equal(back[key], flat[key], err_msg=key)


@needs_timm
def test_a_timm_model_with_registers_that_timm_initialised_imports(tmp_path):
  config = architectures.MODEL_CONFIGS['testing']
  # 2 registers: with 4, the 9 position rows would fit a 3x3 grid too (the test below).
  config.num_registers = 2
  torch.manual_seed(0)
  model = interop_timm.build_model(Architecture.of(config), 5, 32)
  with torch.no_grad():
    for p in model.parameters():  # timm zero-initialises biases and the head
      p.add_(0.05 * torch.randn_like(p))
  torch.save({k: v.contiguous() for k, v in model.state_dict().items()}, tmp_path / 'reg.pth')
  loaded = export.load(str(tmp_path / 'reg.pth'), 'testing').loaded
  assert loaded.spec.architecture.num_registers == 2 and loaded.spec.num_prefix_tokens == 3
  x = random_images(32)
  with torch.no_grad():
    theirs = model(torch.from_numpy(x.transpose(0, 3, 1, 2).copy())).numpy()
  logits = loaded.model.apply({'params': loaded.params}, x, train=False)
  assert_close(relative_error(logits, theirs), BOUND, 'logits against the peer')


def _timm_vit(classifier, registers, grid, no_embed_class, seed=0):
  """timm's VisionTransformer at the test width, every parameter drawn anew (LayerNorm
  scales near 1), in one of its two position layouts."""
  model = timm.models.vision_transformer.VisionTransformer(
    img_size=4 * grid,
    patch_size=4,
    embed_dim=24,
    depth=2,
    num_heads=3,
    mlp_ratio=2.0,
    num_classes=5,
    act_layer='gelu_tanh',
    reg_tokens=registers,
    no_embed_class=no_embed_class,
    class_token=classifier == 'token',
    global_pool='token' if classifier == 'token' else 'avg',
    fc_norm=False,
  ).eval()
  generator = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      p.copy_(0.05 * torch.randn(p.shape, generator=generator) + name.endswith('norm.weight'))
  return model, {k: v.numpy() for k, v in model.state_dict().items()}


@needs_timm
@pytest.mark.parametrize('classifier', ['token', 'gap'])
def test_timms_no_embed_class_register_files_import_with_their_logits(tmp_path, classifier):
  """DINOv2-reg and timm's `*_reg*_gap_256` files leave the class token and registers out
  of the position embeddings (`no_embed_class=True`): each imports (their rows zero in ours),
  gives timm's logits, and exports to a timm model that gives them too."""
  model, state = _timm_vit(classifier, 4, 8, no_embed_class=True)
  assert state['pos_embed'].shape == (1, 64, 24)
  name = 'ViT-Ti_16' if classifier == 'token' else 'ViT-S_16-gap'
  config = small_vit_config(name, patches={'size': (4, 4)}, num_registers=4)
  flat = interop_timm.from_timm(state, Architecture.of(config), 'timm state')
  prefix = 4 + (classifier == 'token')
  posemb = flat['Transformer/posembed_input/pos_embedding']
  np.testing.assert_array_equal(posemb[:, :prefix], 0)
  np.testing.assert_array_equal(posemb[:, prefix:], state['pos_embed'])
  x = random_images(32)
  with torch.no_grad():
    theirs = model(torch.from_numpy(x.transpose(0, 3, 1, 2).copy())).numpy()
  assert np.abs(theirs).max() > 0.05
  assert_close(relative_error(ours(config, flat, x), theirs), BOUND, 'logits against timm')
  exported = interop_timm.build_model(Architecture.of(config), 5, 32)
  exported.load_state_dict(
    {k: torch.from_numpy(v) for k, v in interop_timm.to_timm(flat).items()}, strict=True
  )
  with torch.no_grad():
    again = exported(torch.from_numpy(x.transpose(0, 3, 1, 2).copy())).numpy()
  assert_close(relative_error(again, theirs), BOUND, 'logits of the export against timm')


@needs_timm
def test_a_position_count_that_fits_both_layouts_is_refused_naming_them():
  """A class token, 4 registers and 9 position rows: a 3x3 grid in timm's no_embed_class
  layout or 2x2 in the other: refused in one line naming both, never imported with its rows
  mis-assigned."""
  _, state = _timm_vit('token', 4, 3, no_embed_class=True)
  config = small_vit_config('ViT-Ti_16', patches={'size': (4, 4)})
  with pytest.raises(checkpoint.CheckpointError) as e:
    interop_timm.from_timm(state, Architecture.of(config), 'f.safetensors')
  assert str(e.value) == (
    "f.safetensors: its 9 position embeddings fit both of timm's layouts: 3x3 patches with the "
    '5 class/register token(s) unembedded (no_embed_class=True) or 2x2 patches with them '
    "embedded (no_embed_class=False); pass --model naming a model of timm's whose layout is "
    'known (vit_jax.configs.families)'
  )


def test_the_pytorch_forward_of_the_onnx_export_places_registers_as_ours(tmp_path):
  config = architectures.MODEL_CONFIGS['testing']
  config.num_registers = 2
  flat = random_flat(config, 5, 32)
  path = checkpoint.save_npz(checkpoint.unflatten(flat), tmp_path / 'reg.npz')
  loaded = loader.load_model(path, 'testing')
  assert loaded.spec.architecture.num_registers == 2 and loaded.spec.num_prefix_tokens == 3
  x = random_images(32)
  with torch.no_grad():
    theirs = torch_vit.build(loaded)(torch.from_numpy(x)).numpy()
  assert_close(relative_error(ours(config, flat, x), theirs), BOUND, 'logits against the peer')


def test_fine_tuning_and_patch_resizing_keep_the_register_rows(tmp_path, capsys):
  """At another resolution (and another patch size) the class and register rows of the
  position embeddings stay as they are; the patch grid is resized."""
  config = architectures.MODEL_CONFIGS['testing']
  config.num_registers = 2
  flat = random_flat(config, 5, 32)
  path = checkpoint.save_npz(checkpoint.unflatten(flat), tmp_path / 'reg.npz')
  model = models.VisionTransformer(num_classes=3, **config)
  init = model.init(jax.random.key(0), jnp.zeros((1, 64, 64, 3)), train=False)['params']
  params = checkpoint.load_pretrained(
    pretrained_path=str(path), init_params=init, model_config=config
  )
  posemb = flat['Transformer/posembed_input/pos_embedding']
  tuned = params['Transformer']['posembed_input']['pos_embedding']
  assert tuned.shape == (1, 3 + 16, 10)
  np.testing.assert_array_equal(tuned[:, :3], posemb[:, :3])
  np.testing.assert_array_equal(tuned, vit_checkpoint.resize_posemb(posemb, 19, 3))
  at8 = flexi.at_patch_size(flat, 8, 32, 3)
  assert at8['Transformer/posembed_input/pos_embedding'].shape == (1, 3 + 16, 10)
  np.testing.assert_array_equal(
    at8['Transformer/posembed_input/pos_embedding'][:, :3], posemb[:, :3]
  )


@needs_timm
def test_naflex_registers_match_timms_naflexvit():
  config = small_arch(patch_size=(4, 4), num_registers=2, naflex_grid=(4, 4))
  model = naflex.NaFlexViT(5, config)
  flat = random_flat_like(param_shapes(None, None, 16, module=model), seed=0)
  x = random_images(12, n=2)[:, :, :8]  # 12 x 8 px: a 3 x 2 grid of one image per row
  pixels, rows, cols, real = (np.asarray(a) for a in naflex.patchify(x, 4))
  packed = naflex.pack(pixels, rows, cols, real)
  logits = model.apply({'params': checkpoint.unflatten(flat)}, packed, train=False)
  theirs_model = interop_timm.build_naflex_model(config, 5)
  theirs_model.load_state_dict(
    {k: torch.from_numpy(v) for k, v in interop_timm.to_timm_naflex(flat).items()}, strict=True
  )
  with torch.no_grad():
    theirs = theirs_model(
      torch.from_numpy(pixels),
      patch_coord=torch.from_numpy(np.stack([rows, cols], -1).astype(np.int64)),
      patch_valid=torch.from_numpy(real > 0),
    ).numpy()
  assert_close(relative_error(logits, theirs), BOUND, 'logits against the peer')


def test_a_run_with_a_register_learns_and_saves_it(tmp_path):
  """The tiny run with one register: the loss falls (by 0.1) and params.npz holds
  `registers` [1, 1, 10], which the loader reads."""
  from vit_jax.training import loop

  workdir = str(tmp_path / 'run')
  loop.train_and_evaluate(tiny_run_config(num_registers=1), workdir)
  logged = [json.loads(line) for line in open(os.path.join(workdir, 'metrics.jsonl'))]
  losses = [entry['train_loss'] for entry in logged if 'train_loss' in entry]
  assert losses[-1] < losses[0] - 0.1, losses
  assert checkpoint.flatten(checkpoint.load(workdir))['registers'].shape == (1, 1, 10)
  assert loader.load_model(workdir).spec.num_prefix_tokens == 2
  with pytest.raises(program.ConfigError, match='masked patch prediction reads patch tokens'):
    program.validate(tiny_run_config(num_registers=1, task='mpp'), 1)
