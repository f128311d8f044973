"""The public .npz layout: load/save, key variants, fine-tuning adaptation, errors."""

from conftest import TESTING_SIZE
from conftest import current_flax_names
from conftest import param_shapes
from conftest import random_like
from conftest import small_vit_config
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.ndimage

from vit_jax import checkpoint
from vit_jax import models
from vit_jax.configs import architectures
from vit_jax.models import vit_checkpoint


def random_params(config, num_classes, size, seed=0):
  return random_like(param_shapes(config, num_classes, size), seed)


def write_npz(path, flat):
  np.savez(path, **flat)
  return str(path)


def assert_trees_equal(a, b):
  fa, fb = checkpoint.flatten(a), checkpoint.flatten(b)
  assert sorted(fa) == sorted(fb)
  for key in fa:
    assert np.asarray(fa[key]).dtype == np.asarray(fb[key]).dtype, key
    np.testing.assert_array_equal(fa[key], fb[key], err_msg=key)


def test_save_load_round_trip_is_bitwise(tmp_path):
  params = random_params(small_vit_config(representation_size=24), 10, 32)
  path = checkpoint.save_npz(params, tmp_path / 'model.npz')
  assert_trees_equal(checkpoint.load(path), params)
  # The file is a plain numpy archive with '/'-joined keys.
  with np.load(path, allow_pickle=False) as f:
    assert 'Transformer/encoderblock_1/MlpBlock_3/Dense_0/kernel' in f.files


def test_save_npz_accepts_jax_arrays_and_a_workdir(tmp_path):
  params = jax.tree.map(jnp.asarray, random_params(small_vit_config(), 3, 32))
  checkpoint.save_npz(params, tmp_path / 'params.npz')
  assert_trees_equal(checkpoint.load(tmp_path), jax.tree.map(np.asarray, params))


@pytest.mark.parametrize('prefix', ['', 'params/', 'opt/target/'])
def test_newer_numbering_and_prefixes(tmp_path, prefix):
  params = random_params(small_vit_config(), 5, 32)
  flat = current_flax_names(checkpoint.flatten(params))
  assert 'Transformer/encoderblock_0/MlpBlock_0/Dense_1/bias' in flat
  path = write_npz(tmp_path / 'new.npz', {prefix + k: v for k, v in flat.items()})
  assert_trees_equal(checkpoint.load(path), params)


def test_scanned_blocks_are_unstacked(tmp_path):
  params = random_params(small_vit_config(), 5, 32)
  flat = current_flax_names(checkpoint.flatten(params))
  stacked = {k: v for k, v in flat.items() if not k.startswith('Transformer/encoderblock_')}
  for key in [k for k in flat if k.startswith('Transformer/encoderblock_0/')]:
    rest = key[len('Transformer/encoderblock_0/') :]
    stacked['Transformer/encoderblock/' + rest] = np.stack(
      [flat[f'Transformer/encoderblock_{i}/{rest}'] for i in range(2)]
    )
  assert_trees_equal(checkpoint.load(write_npz(tmp_path / 'scan.npz', stacked)), params)


def test_big_vision_root_posemb_gives_the_same_model(tmp_path):
  """big_vision adds position embeddings before the class token is prepended."""
  config = small_vit_config()
  params = random_params(config, 5, 32)
  flat = checkpoint.flatten(params)
  flat['Transformer/posembed_input/pos_embedding'][:, 0] = 0.0
  bv = dict(flat)
  bv['pos_embedding'] = bv.pop('Transformer/posembed_input/pos_embedding')[:, 1:]
  loaded = checkpoint.load(
    write_npz(tmp_path / 'bv.npz', {'params/' + k: v for k, v in bv.items()})
  )
  assert_trees_equal(loaded, checkpoint.unflatten(flat))


@pytest.mark.slow
def test_old_groupnorm_shapes(tmp_path):
  config = architectures.MODEL_CONFIGS['R26+ViT-B_32']
  config.hidden_size = 16
  config.transformer.update(num_layers=1, num_heads=2, mlp_dim=8)
  params = random_params(config, 3, 64)
  flat = checkpoint.flatten(params)
  old = {k: v.reshape(1, 1, 1, -1) if '/gn' in '/' + k else v for k, v in flat.items()}
  assert old['gn_root/scale'].shape == (1, 1, 1, 64)
  assert_trees_equal(checkpoint.load(write_npz(tmp_path / 'old.npz', old)), params)


def test_load_checks_against_model_naming_first_mismatch(tmp_path):
  params = random_params(small_vit_config(), 10, 32)
  path = checkpoint.save_npz(params, tmp_path / 'a.npz')
  expected = random_params(small_vit_config(), 10, 64)  # another resolution
  with pytest.raises(checkpoint.CheckpointError) as e:
    checkpoint.load(path, like=expected)
  message = str(e.value)
  assert '\n' not in message
  assert 'Transformer/posembed_input/pos_embedding has shape (1, 5, 24)' in message
  assert '(1, 17, 24)' in message

  other = random_params(small_vit_config(representation_size=24), 10, 32)
  with pytest.raises(checkpoint.CheckpointError, match='lacks pre_logits/bias'):
    checkpoint.load(path, like=other)


def test_truncated_and_missing_files(tmp_path):
  path = checkpoint.save_npz(random_params(small_vit_config(), 10, 32), tmp_path / 'a.npz')
  data = open(path, 'rb').read()
  truncated = tmp_path / 'truncated.npz'
  truncated.write_bytes(data[: len(data) // 2])
  with pytest.raises(checkpoint.CheckpointError, match='truncated.npz: not a readable .npz') as e:
    checkpoint.load(truncated)
  assert '\n' not in str(e.value)
  with pytest.raises(checkpoint.CheckpointError, match='no such checkpoint'):
    checkpoint.load(tmp_path / 'missing.npz')
  (tmp_path / 'empty_workdir').mkdir()
  with pytest.raises(checkpoint.CheckpointError, match='without params.npz'):
    checkpoint.load(tmp_path / 'empty_workdir')


def test_pickled_npz_is_refused(tmp_path):
  """Refused as what it is, not as "may be truncated, download it again"."""
  path = tmp_path / 'pickle.npz'
  np.savez(path, obj=np.array([{'a': 1}], dtype=object))
  with pytest.raises(checkpoint.CheckpointError) as e:
    checkpoint.load(path)
  assert str(e.value) == (
    f"{path}: 'obj' is an array of Python objects (a pickle), not numbers; it is not loaded, "
    'since unpickling can run any code. Pass a checkpoint of numeric arrays (numpy.savez of '
    'the parameters)'
  )


def test_a_file_that_is_not_an_npz_is_named_so(tmp_path):
  # numpy reads such a file as a pickle and suggests allow_pickle=True, an unsafe load.
  for name, data in (('notes.npz', b'just some text\n'), ('empty.npz', b'')):
    (tmp_path / name).write_bytes(data)
    with pytest.raises(checkpoint.CheckpointError, match='not an .npz checkpoint') as e:
      checkpoint.load(tmp_path / name)
    assert 'pickle' not in str(e.value) and '\n' not in str(e.value)


def _torch_bilinear(grid, size):
  """Independent reference: torch's bilinear, half-pixel centres, no antialias."""
  torch = pytest.importorskip('torch')  # installed apart on CPU machines (README: Set-up)
  t = torch.from_numpy(grid).permute(2, 0, 1)[None]
  out = torch.nn.functional.interpolate(
    t, size=(size, size), mode='bilinear', align_corners=False, antialias=False
  )
  return out[0].permute(1, 2, 0).numpy()


def _official_interpolate(posemb, num_tokens, has_class_token):
  """The official `interpolate_posembed`'s arithmetic: scipy.ndimage.zoom, order 1."""
  n = int(has_class_token)
  token, grid = posemb[:, :n], posemb[0, n:]
  old, new = int(np.sqrt(len(grid))), int(np.sqrt(num_tokens - n))
  grid = scipy.ndimage.zoom(grid.reshape(old, old, -1), (new / old, new / old, 1), order=1)
  return np.concatenate([token, grid.reshape(1, new * new, -1)], axis=1)


@pytest.mark.parametrize('class_token', [True, False], ids=['token', 'gap'])
@pytest.mark.parametrize('patch', [16, 14])
@pytest.mark.parametrize('resolution', [384, 512])
def test_posemb_resize_equals_scipy_zoom(resolution, patch, class_token):
  old, new = 224 // patch, resolution // patch  # 14 -> 24, 32; 16 -> 27, 36
  posemb = np.random.default_rng(patch).normal(size=(1, class_token + old * old, 32))
  posemb = posemb.astype(np.float32)
  num_tokens = class_token + new * new
  expected = _official_interpolate(posemb, num_tokens, class_token)
  ours = vit_checkpoint.resize_posemb(posemb, num_tokens, int(class_token))
  assert ours.shape == expected.shape == (1, num_tokens, 32) and ours.dtype == np.float32
  np.testing.assert_allclose(ours, expected, rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(
    checkpoint.interpolate_posembed(posemb, num_tokens, class_token), ours
  )
  # Half-pixel bilinear is another function: it moves the corner embeddings.
  other = vit_checkpoint.resize_posemb(posemb, num_tokens, int(class_token), 'bilinear')
  assert np.abs(other - expected).max() > 0.1


def test_posemb_resize_bilinear_option_equals_torch():
  posemb = np.random.default_rng(0).normal(size=(1, 1 + 14 * 14, 8)).astype(np.float32)
  ours = vit_checkpoint.resize_posemb(posemb, 1 + 24 * 24, 1, method='bilinear')
  expected = _torch_bilinear(posemb[0, 1:].reshape(14, 14, 8), 24).reshape(1, 576, 8)
  np.testing.assert_allclose(ours[:, 1:], expected, rtol=1e-5, atol=1e-6)
  with pytest.raises(checkpoint.CheckpointError, match="posemb_resize='cubic': use one of zoom"):
    vit_checkpoint.resize_posemb(posemb, 1 + 24 * 24, 1, method='cubic')


@pytest.mark.slow
def test_load_pretrained_224_to_384(tmp_path, capsys):
  # Pre-trained at 224 with a pre-logits layer and 21843 classes (an i21k file).
  pre_config = architectures.MODEL_CONFIGS['ViT-B_16']
  pre_config.update(hidden_size=24, representation_size=24)
  pre_config.transformer.update(num_layers=1, num_heads=2, mlp_dim=8)
  pretrained = random_params(pre_config, 21843, 224)
  path = checkpoint.save_npz(pretrained, tmp_path / 'i21k.npz')

  config = architectures.MODEL_CONFIGS['ViT-B_16']
  config.update(hidden_size=24)
  config.transformer.update(num_layers=1, num_heads=2, mlp_dim=8)
  model = models.VisionTransformer(num_classes=10, **config)
  init = model.init(jax.random.key(0), jnp.zeros((1, 384, 384, 3)), train=False)['params']
  params = checkpoint.load_pretrained(pretrained_path=path, init_params=init, model_config=config)

  checkpoint.check_tree(params, init)
  np.testing.assert_array_equal(params['head']['kernel'], np.zeros((24, 10)))
  assert 'pre_logits' not in params
  np.testing.assert_array_equal(params['embedding']['kernel'], pretrained['embedding']['kernel'])
  old = pretrained['Transformer']['posembed_input']['pos_embedding']
  new = params['Transformer']['posembed_input']['pos_embedding']
  assert new.shape == (1, 577, 24)
  np.testing.assert_array_equal(new[:, 0], old[:, 0])  # class-token row kept
  np.testing.assert_allclose(new, _official_interpolate(old, 577, True), rtol=1e-6, atol=1e-6)

  table = capsys.readouterr().out
  assert 'resized' in table and '(1, 197, 24) -> (1, 577, 24) (zoom)' in table
  assert 'dropped         pre_logits/kernel (24, 24)' in table
  assert 're-initialised  head/kernel (24, 10)' in table
  # The adapted model runs at the new resolution.
  logits = model.apply({'params': params}, jnp.zeros((1, 384, 384, 3)), train=False)
  assert logits.shape == (1, 10)


@pytest.mark.slow
def test_load_pretrained_gap_model_resizes_whole_grid(tmp_path):
  config = small_vit_config(classifier='gap')
  path = checkpoint.save_npz(random_params(config, 5, 32), tmp_path / 'gap.npz')
  model = models.VisionTransformer(num_classes=3, **config)
  init = model.init(jax.random.key(0), jnp.zeros((1, 48, 48, 3)), train=False)['params']
  params = checkpoint.load_pretrained(
    pretrained_path=path, init_params=init, model_config=config, verbose=False
  )
  old = checkpoint.load(path)['Transformer']['posembed_input']['pos_embedding']
  new = params['Transformer']['posembed_input']['pos_embedding']
  np.testing.assert_allclose(new, _official_interpolate(old, 9, False), rtol=1e-6, atol=1e-6)
  bilinear = checkpoint.load_pretrained(
    pretrained_path=path,
    init_params=init,
    model_config=config,
    verbose=False,
    posemb_resize='bilinear',
  )['Transformer']['posembed_input']['pos_embedding']
  expected = _torch_bilinear(old[0].reshape(2, 2, 24), 3).reshape(1, 9, 24)
  np.testing.assert_allclose(bilinear, expected, rtol=1e-5, atol=1e-6)


def test_load_pretrained_keeps_pre_logits_when_the_model_has_them(tmp_path):
  config = small_vit_config(representation_size=24)
  pretrained = random_params(config, 5, 32)
  path = checkpoint.save_npz(pretrained, tmp_path / 'p.npz')
  init = random_params(config, 7, 32, seed=3)
  params = checkpoint.load_pretrained(
    pretrained_path=path, init_params=init, model_config=config, verbose=False
  )
  np.testing.assert_array_equal(params['pre_logits']['kernel'], pretrained['pre_logits']['kernel'])
  np.testing.assert_array_equal(params['head']['kernel'], init['head']['kernel'])


def test_load_pretrained_errors(tmp_path):
  path = checkpoint.save_npz(random_params(small_vit_config(), 5, 32), tmp_path / 'ti.npz')
  wrong_width = small_vit_config(hidden_size=48)
  init = random_params(wrong_width, 5, 32)
  with pytest.raises(
    checkpoint.CheckpointError,
    match=r'ti.npz: Transformer/encoder_norm/bias has shape \(24,\), the model '
    r'expects \(48,\)',
  ):
    checkpoint.load_pretrained(pretrained_path=path, init_params=init, model_config=wrong_width)
  deeper = small_vit_config()
  deeper.transformer.num_layers = 3
  with pytest.raises(checkpoint.CheckpointError, match='lacks Transformer/encoderblock_2/'):
    checkpoint.load_pretrained(
      pretrained_path=path, init_params=random_params(deeper, 5, 32), model_config=deeper
    )
  with pytest.raises(checkpoint.CheckpointError, match='only square grids'):
    vit_checkpoint.resize_posemb(np.zeros((1, 1 + 12, 4)), 1 + 16, 1)


# ---------------------------------------------------------------------------
# Register tokens added or dropped when fine-tuning from a checkpoint.


@pytest.mark.parametrize('before, after', [(0, 2), (2, 0), (1, 3)])
def test_registers_added_or_dropped_on_a_checkpoint_keep_the_rest(before, after, tmp_path, capsys):
  """`--config.pretrained_path=RUN --config.num_registers=N` on a run with another number of
  registers: registers the checkpoint lacks start as a fresh model's (token and position row),
  those the model lacks are dropped, every other row and parameter is loaded, and the table says
  so."""
  config = architectures.MODEL_CONFIGS['testing']
  config.num_registers = before
  pretrained = random_like(param_shapes(config, 5, TESTING_SIZE), seed=1)
  path = checkpoint.save_npz(pretrained, tmp_path / 'run.npz')
  config.num_registers = after
  init = random_like(param_shapes(config, 3, 2 * TESTING_SIZE), seed=2)  # at 64 px: a 4x4 grid
  params = checkpoint.load_pretrained(
    pretrained_path=str(path), init_params=init, model_config=config
  )
  posemb = params['Transformer']['posembed_input']['pos_embedding']
  old = pretrained['Transformer']['posembed_input']['pos_embedding']
  fresh = init['Transformer']['posembed_input']['pos_embedding']
  kept = min(before, after)
  assert posemb.shape == (1, 1 + after + 16, 10)
  np.testing.assert_array_equal(posemb[:, : 1 + kept], old[:, : 1 + kept])
  np.testing.assert_array_equal(posemb[:, 1 + kept : 1 + after], fresh[:, 1 + kept : 1 + after])
  np.testing.assert_array_equal(
    posemb[:, 1 + after :],
    vit_checkpoint.resize_posemb(old[:, [0, *range(1 + before, 5 + before)]], 17, 1)[:, 1:],
  )
  if after:
    if kept:
      np.testing.assert_array_equal(
        params['registers'][:, :kept], pretrained['registers'][:, :kept]
      )
    np.testing.assert_array_equal(params['registers'][:, kept:], init['registers'][:, kept:])
  else:
    assert 'registers' not in params
  for key, value in checkpoint.flatten(pretrained).items():
    if not key.startswith(('head/', 'registers', 'Transformer/posembed_input')):
      np.testing.assert_array_equal(checkpoint.flatten(params)[key], value, err_msg=key)
  table = capsys.readouterr().out
  if after > before:
    assert (
      f're-initialised  registers (1, {after}, 10): {after - kept} new register token(s) and '
      f"their position rows, as a fresh model's ({kept} kept)"
    ) in table, table
  else:
    assert f'dropped         registers (1, {before}, 10): {before} register token(s)' in table
