"""Export and import: timm, transformers, SavedModel, ONNX, against the real libraries.

Weights are random (every leaf non-zero, heads included) in small versions of
the released architectures. Parity = max |ours - theirs| / max |theirs| of the
logits; the bound is 1e-5 wherever the target computes our GELU and epsilons
(measured: 1e-7 to 2e-6).
"""

import json
import os
import subprocess
import sys

from conftest import ROOT
from conftest import assert_close
from conftest import command_error
from conftest import param_shapes
from conftest import random_flat
from conftest import random_images
from conftest import relative_error
from conftest import small_vit_config
from conftest import subprocess_env
from conftest import tiny_run_config
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vit_jax import checkpoint
from vit_jax import export as export_cli
from vit_jax import models
from vit_jax.configs import architectures
from vit_jax.configs.model_spec import Architecture
from vit_jax.configs.model_spec import ModelSpec
from vit_jax.evaluation import classify
from vit_jax.evaluation import loader
from vit_jax.interop import export
from vit_jax.interop import timm as interop_timm
from vit_jax.interop import torch_layout

torch = pytest.importorskip('torch')
try:
  import timm
except ImportError:
  timm = None  # CPU-only machines install it apart (README: Set-up)
needs_timm = pytest.mark.skipif(timm is None, reason='timm is not installed (README: Set-up)')
transformers = pytest.importorskip('transformers')
safetensors = pytest.importorskip('safetensors')
safetensors_torch = pytest.importorskip('safetensors.torch')

BOUND = 1e-5


def ours(config, flat, images):
  num_classes = flat['head/kernel'].shape[-1] if 'head/kernel' in flat else None
  model = models.VisionTransformer(num_classes=num_classes, **config)
  apply = jax.jit(lambda params, x: model.apply({'params': params}, x, train=False))
  return np.asarray(apply(checkpoint.unflatten(flat), images))


def nchw(x):
  return torch.from_numpy(np.ascontiguousarray(x.transpose(0, 3, 1, 2)))


def run(*args):
  return export_cli.main([f'--{k}={v}' for k, v in args])


def assert_flat_equal(a, b):
  assert sorted(a) == sorted(b)
  for key in a:
    assert a[key].dtype == b[key].dtype, key
    np.testing.assert_array_equal(a[key], b[key], err_msg=key)


# ---------------------------------------------------------------------------
# timm.


@needs_timm
def test_every_released_architecture_has_its_timm_name():
  registered = set(timm.list_models('vit_*'))
  for name in interop_timm.TIMM_NAMES:
    config = architectures.MODEL_CONFIGS[name]
    at_384 = interop_timm.TIMM_NAMES[name] in interop_timm.TIMM_384
    sizes = (224, 384) if at_384 else (224,)
    for size in sizes:
      assert interop_timm.registered_name(Architecture.of(config), size) in registered, (name, size)
  # A shrunk model under a released name is not that timm model.
  assert interop_timm.registered_name(Architecture.of(small_vit_config()), 224) is None


# Every structure: ViT, gap, three- and four-stage hybrids, the largest hybrid.
@pytest.mark.parametrize(
  'name', ['ViT-Ti_16', 'ViT-B_16-gap', 'R50+ViT-B_16', 'R26+ViT-B_32', 'R50+ViT-L_32']
)
@needs_timm
def test_timm_names_and_shapes_of_released_architectures(name):
  """Our mapping yields exactly timm.create_model(name).state_dict()'s keys and shapes."""
  config = architectures.MODEL_CONFIGS[name]
  timm_name = interop_timm.registered_name(Architecture.of(config), 224)
  kwargs = interop_timm.create_model_kwargs(Architecture.of(config), 1000, 224)
  theirs = {
    k: tuple(v.shape)
    for k, v in timm.create_model(timm_name, device='meta', **kwargs).state_dict().items()
  }
  model = models.VisionTransformer(num_classes=1000, **config)
  shapes = jax.eval_shape(
    lambda: model.init(jax.random.key(0), jnp.zeros((1, 224, 224, 3)), train=False)
  )['params']
  mapped = {}
  for key, s in checkpoint.flatten(shapes).items():
    name_, chunk = interop_timm.timm_name(key)
    # Zero-stride views: layouts without allocating hundreds of MB.
    shape = torch_layout.to_torch_layout(key, np.broadcast_to(np.float32(0), s.shape)).shape
    if chunk is not None:
      shape = (shape[0] * 3,) + shape[1:]
    mapped[name_] = shape
  assert mapped == theirs


@pytest.mark.parametrize(
  'name,units,classifier,size',
  [
    ('ViT-Ti_16', None, 'token', 32),
    ('ViT-B_16-gap', None, 'gap', 32),
    # big_vision's MAP head: timm's AttentionPoolLatent
    pytest.param('ViT-g_14-map', None, 'map', 28, marks=pytest.mark.slow),
    pytest.param('R50+ViT-B_16', (1, 1, 1), 'token', 64, marks=pytest.mark.slow),
  ],
)
@needs_timm
def test_timm_export_matches_timm_and_its_own_npz_loader(tmp_path, name, units, classifier, size):
  config = small_vit_config(name, hybrid_units=units)
  assert config.classifier == classifier
  flat = random_flat(config, 7, size)
  npz = checkpoint.save_npz(checkpoint.unflatten(flat), tmp_path / 'model.npz')
  out = tmp_path / 'model.safetensors'
  # A shrunk model has no timm name, so --model names its (released) config;
  # export.load checks shapes against it, so go through the API with the config.
  state = interop_timm.to_timm(flat)
  torch_layout.save_safetensors(state, str(out), {})
  exported = safetensors_torch.load_file(str(out))

  model = interop_timm.build_model(Architecture.of(config), 7, size)
  model.load_state_dict(exported, strict=True)
  with torch.no_grad():
    theirs = model(nchw(random_images(size))).numpy()
  assert np.abs(theirs).max() > 0.05  # a non-trivial head
  assert_close(
    relative_error(ours(config, flat, random_images(size)), theirs),
    BOUND,
    'logits against the peer',
  )

  # timm's own reader of the public .npz layout, an independent mapping.
  reference = interop_timm.build_model(Architecture.of(config), 7, size)
  load_npz = timm.models.vision_transformer._load_weights
  load_npz(reference, str(npz))
  for key, value in reference.state_dict().items():
    assert torch.equal(value, exported[key]), key

  assert_flat_equal(
    interop_timm.from_timm(
      {k: v.numpy() for k, v in exported.items()}, Architecture.of(config), str(out)
    ),
    flat,
  )


@pytest.mark.slow
@needs_timm
def test_timm_cli_writes_a_file_timm_create_model_loads_strictly(tmp_path, capsys):
  config = architectures.MODEL_CONFIGS['ViT-Ti_16']
  flat = random_flat(config, 10, 224)
  checkpoint.save_npz(checkpoint.unflatten(flat), tmp_path / 'ti16.npz')
  out = tmp_path / 'ti16.safetensors'
  assert (
    run(
      ('checkpoint', tmp_path / 'ti16.npz'),
      ('model', 'ViT-Ti_16'),
      ('format', 'timm'),
      ('output', out),
    )
    == 0
  )
  assert "timm.create_model('vit_tiny_patch16_224'" in capsys.readouterr().out

  with safetensors.safe_open(str(out), 'np') as f:
    meta = f.metadata()
  assert meta['timm_model'] == 'vit_tiny_patch16_224' and meta['vit_jax_model'] == 'ViT-Ti_16'
  model = timm.create_model(meta['timm_model'], **json.loads(meta['timm_kwargs'])).eval()
  model.load_state_dict(safetensors_torch.load_file(str(out)), strict=True)
  x = random_images(224)
  with torch.no_grad():
    theirs = model(nchw(x)).numpy()
  assert_close(relative_error(ours(config, flat, x), theirs), BOUND, 'logits against the peer')

  # Back: bitwise.
  assert run(('checkpoint', out), ('format', 'npz'), ('output', tmp_path / 'back.npz')) == 0
  assert_flat_equal(checkpoint.flatten(checkpoint.load(tmp_path / 'back.npz')), flat)


@needs_timm
def test_import_a_timm_model_that_timm_initialised(tmp_path):
  """Import direction with weights written by timm itself, as .safetensors and as .pth."""
  config = architectures.MODEL_CONFIGS['testing']
  torch.manual_seed(0)
  model = interop_timm.build_model(Architecture.of(config), 5, 32)
  with torch.no_grad():
    for p in model.parameters():  # timm zero-initialises biases and the head
      p.add_(0.05 * torch.randn_like(p))
  state = {k: v.contiguous() for k, v in model.state_dict().items()}
  safetensors_torch.save_file(state, str(tmp_path / 'timm.safetensors'))
  torch.save(state, tmp_path / 'timm.pth')
  x = random_images(32)
  with torch.no_grad():
    theirs = model(nchw(x)).numpy()
  imported = [
    checkpoint.flatten(export.load(str(tmp_path / name), 'testing').loaded.params)
    for name in ('timm.safetensors', 'timm.pth')
  ]
  assert_flat_equal(*imported)
  assert_close(
    relative_error(ours(config, imported[0], x), theirs), BOUND, 'logits against the peer'
  )


# ---------------------------------------------------------------------------
# transformers.


def write_npz(tmp_path, config, num_classes, size, name='model.npz', seed=0):
  flat = random_flat(config, num_classes, size, seed)
  return flat, checkpoint.save_npz(checkpoint.unflatten(flat), tmp_path / name)


@pytest.mark.slow
def test_hf_folder_loads_with_from_pretrained_and_matches(tmp_path, capsys):
  config = architectures.MODEL_CONFIGS['ViT-Demo_4']
  flat, npz = write_npz(tmp_path, config, 3, 16)
  labels = tmp_path / 'labels.txt'
  labels.write_text('cat\ndog\nbird\n')
  out = tmp_path / 'hf'
  assert (
    run(
      ('checkpoint', npz),
      ('model', 'ViT-Demo_4'),
      ('format', 'hf'),
      ('output', out),
      ('labels', labels),
    )
    == 0
  )
  assert sorted(os.listdir(out)) == ['config.json', 'model.safetensors', 'preprocessor_config.json']
  # The Hub's (transformers 4.x) names, which 5.x converts on load.
  with safetensors.safe_open(str(out / 'model.safetensors'), 'np') as f:
    keys = set(f.keys())
  assert 'vit.encoder.layer.3.attention.attention.query.weight' in keys
  assert 'vit.encoder.layer.0.output.dense.bias' in keys and 'classifier.weight' in keys

  model, info = transformers.ViTForImageClassification.from_pretrained(
    str(out), output_loading_info=True
  )
  assert not info['missing_keys'] and not info['unexpected_keys'] and not info['mismatched_keys']
  assert model.config.id2label == {0: 'cat', 1: 'dog', 2: 'bird'}
  x = random_images(16, n=3)
  with torch.no_grad():
    theirs = model.eval()(pixel_values=nchw(x)).logits.numpy()
  assert np.abs(theirs).max() > 0.05
  assert_close(relative_error(ours(config, flat, x), theirs), BOUND, 'logits against the peer')

  # What save_pretrained writes reads back bitwise, as does our own folder.
  model.save_pretrained(tmp_path / 'resaved')
  for folder in (out, tmp_path / 'resaved'):
    assert (
      run(
        ('checkpoint', folder),
        ('model', 'ViT-Demo_4'),
        ('format', 'npz'),
        ('output', tmp_path / 'back.npz'),
      )
      == 0
    )
    assert_flat_equal(checkpoint.flatten(checkpoint.load(tmp_path / 'back.npz')), flat)


def test_an_exports_files_share_one_mode(tmp_path):
  """Every exported file gets the mode `open` gives a new file here: model.safetensors too
  (safetensors alone writes it 0600, beside an hf folder's 0644 JSON files)."""
  _, npz = write_npz(tmp_path, architectures.MODEL_CONFIGS['testing'], 3, 32)
  (tmp_path / 'probe').write_text('')
  mode = (tmp_path / 'probe').stat().st_mode & 0o777
  for fmt, output in (('hf', 'hf'), ('timm', 'timm.safetensors'), ('npz', 'back.npz')):
    argv = (
      ('checkpoint', npz),
      ('model', 'testing'),
      ('format', fmt),
      ('output', tmp_path / output),
    )
    assert run(*argv) == 0
  written = [p for p in (tmp_path / 'hf').iterdir()] + [tmp_path / 'timm.safetensors']
  assert len(written) == 4
  assert {p.name: p.stat().st_mode & 0o777 for p in written} == {p.name: mode for p in written}
  assert not [p for p in tmp_path.iterdir() if '.mode-' in p.name]


def test_hf_preprocessor_reproduces_our_eval_preprocessing(tmp_path):
  from PIL import Image

  config = architectures.MODEL_CONFIGS['testing']
  _, npz = write_npz(tmp_path, config, 2, 64)
  assert (
    run(('checkpoint', npz), ('model', 'testing'), ('format', 'hf'), ('output', tmp_path / 'hf'))
    == 0
  )
  processor = transformers.AutoImageProcessor.from_pretrained(str(tmp_path / 'hf'))
  for number, path in enumerate(classify.builtin_images()):
    # Images no larger than the checkpoint's 64 px: PIL's bilinear resize (transformers) is
    # tf.image.resize's (ours) within one 8-bit level, as the resize rounds differently.
    # Larger ones differ: PIL antialiases when it shrinks, TensorFlow does not.
    with Image.open(path) as image:
      small = image.convert('RGB').crop((100, 100, 140, 156))
    small.save(tmp_path / f'{number}.png')
    theirs = processor(images=small, return_tensors='np')['pixel_values'][0].transpose(1, 2, 0)
    assert np.abs(theirs - classify.read_image(tmp_path / f'{number}.png', 64)).max() <= (
      1 / 127.5 + 1e-6
    )


def test_hf_pre_logits_become_the_pooler(tmp_path, capsys):
  config = small_vit_config(representation_size=20)
  flat = random_flat(config, 7, 32)
  from vit_jax.interop import hf as interop_hf

  notes = interop_hf.save(flat, Architecture.of(config), 32, str(tmp_path / 'hf'))
  assert any('head dropped' in n for n in notes)
  model = transformers.ViTModel.from_pretrained(str(tmp_path / 'hf')).eval()
  assert model.config.architectures == ['ViTModel'] and model.config.pooler_output_size == 20
  x = random_images(32)
  with torch.no_grad():
    theirs = model(pixel_values=nchw(x)).pooler_output.numpy()
  features = {k: v for k, v in flat.items() if not k.startswith('head/')}
  assert_close(relative_error(ours(config, features, x), theirs), BOUND, 'logits against the peer')


def test_import_a_transformers_model_in_its_own_naming(tmp_path):
  """Weights initialised and named by transformers 5.x itself."""
  config = architectures.MODEL_CONFIGS['testing']
  hf = transformers.ViTForImageClassification(
    transformers.ViTConfig(
      hidden_size=10,
      num_hidden_layers=1,
      num_attention_heads=2,
      intermediate_size=10,
      image_size=32,
      patch_size=16,
      num_labels=4,
      hidden_act='gelu_new',
      layer_norm_eps=1e-6,
    )
  ).eval()
  with torch.no_grad():
    for p in hf.parameters():
      p.add_(0.05 * torch.randn_like(p))
  state = {k: v.contiguous() for k, v in hf.state_dict().items()}
  assert 'vit.layers.0.attention.q_proj.weight' in state  # 5.x names
  safetensors_torch.save_file(state, str(tmp_path / 'hf5.safetensors'), metadata={'format': 'pt'})
  source = export.load(str(tmp_path / 'hf5.safetensors'), 'testing')
  x = random_images(32)
  with torch.no_grad():
    theirs = hf(pixel_values=nchw(x)).logits.numpy()
  flat = checkpoint.flatten(source.loaded.params)
  assert_close(relative_error(ours(config, flat, x), theirs), BOUND, 'logits against the peer')


# ---------------------------------------------------------------------------
# SavedModel and ONNX.


@pytest.mark.slow
def test_savedmodel_matches_in_tensorflow(tmp_path):
  tf = pytest.importorskip('tensorflow')
  config = architectures.MODEL_CONFIGS['ViT-Demo_4']
  flat, npz = write_npz(tmp_path, config, 10, 16)
  assert (
    run(
      ('checkpoint', npz),
      ('model', 'ViT-Demo_4'),
      ('format', 'savedmodel'),
      ('output', tmp_path / 'sm'),
    )
    == 0
  )
  loaded = tf.saved_model.load(str(tmp_path / 'sm'))
  pixels = np.random.default_rng(2).integers(0, 256, (3, 16, 16, 3), dtype=np.uint8)
  x = (pixels / 127.5 - 1).astype(np.float32)
  expected = ours(config, flat, x)
  for n in (1, 3):  # the batch dimension is polymorphic
    logits = loaded.signatures['serving_default'](images=tf.constant(x[:n]))['logits'].numpy()
    assert_close(relative_error(expected[:n], logits), BOUND, 'logits against the peer')
  logits = loaded.signatures['serving_uint8'](images=tf.constant(pixels))['logits'].numpy()
  assert_close(relative_error(expected, logits), BOUND, 'logits against the peer')


@pytest.mark.parametrize(
  'name,units,classifier',
  [
    ('ViT-Ti_16', None, 'gap'),
    ('ViT-Ti_16', None, 'map'),
    pytest.param('R26+ViT-B_32', (1, 1, 1, 1), 'token', marks=pytest.mark.slow),
  ],
)
def test_torch_forward_matches_ours(name, units, classifier):
  """The module ONNX export traces, against our JAX model (the ViT with a class token: below)."""
  from vit_jax.interop import torch_vit

  config = small_vit_config(name, hybrid_units=units, classifier=classifier, representation_size=12)
  flat = random_flat(config, 7, 32)
  model = models.VisionTransformer(num_classes=7, **config)
  loaded = loader.LoadedModel(
    model, checkpoint.unflatten(flat), ModelSpec(Architecture.of(config), 32)
  )
  x = random_images(32)
  with torch.no_grad():
    theirs = torch_vit.build(loaded)(torch.from_numpy(x)).numpy()
  assert_close(relative_error(ours(config, flat, x), theirs), BOUND, 'logits against the peer')


@pytest.mark.slow
def test_onnx_with_pre_logits_matches_in_onnxruntime(tmp_path, monkeypatch):
  # A ViT; the hybrid exports through the same torch module (tested above) at
  # 4x the export time. timm is not needed: import it and fail.
  ort = pytest.importorskip('onnxruntime')
  pytest.importorskip('onnxscript')
  from vit_jax.interop import onnx

  monkeypatch.setitem(sys.modules, 'timm', None)

  config = small_vit_config(representation_size=16)
  flat = random_flat(config, 5, 32)
  loaded = loader.LoadedModel(
    models.VisionTransformer(num_classes=5, **config),
    checkpoint.unflatten(flat),
    ModelSpec(Architecture.of(config), 32),
  )
  onnx.save(loaded, str(tmp_path / 'model.onnx'))
  session = ort.InferenceSession(str(tmp_path / 'model.onnx'))
  assert [i.name for i in session.get_inputs()] == ['images']
  x = random_images(32, n=3)
  expected = ours(config, flat, x)
  for n in (1, 3):  # the batch dimension is dynamic
    (logits,) = session.run(['logits'], {'images': x[:n]})
    assert_close(relative_error(expected[:n], logits), BOUND, 'logits against the peer')


# ---------------------------------------------------------------------------
# Workdirs, errors, the command line.


def test_workdir_needs_no_model_and_names_classes_from_its_dataset(tmp_path, capsys):
  config = architectures.MODEL_CONFIGS['testing']
  write_npz(tmp_path, config, 10, 32, name='params.npz')
  (tmp_path / 'summary.json').write_text(json.dumps({'model': 'testing', 'dataset': 'digits'}))
  assert run(('checkpoint', tmp_path), ('format', 'hf'), ('output', tmp_path / 'hf')) == 0
  hf = json.loads((tmp_path / 'hf' / 'config.json').read_text())
  assert hf['id2label'] == {str(i): str(i) for i in range(10)}


@needs_timm
def test_timm_export_of_pre_logits_is_the_feature_model(tmp_path, capsys):
  config = architectures.MODEL_CONFIGS['testing']
  config.representation_size = 16
  _, npz = write_npz(tmp_path, config, 10, 32)
  assert (
    run(
      ('checkpoint', npz),
      ('model', 'testing'),
      ('format', 'timm'),
      ('output', tmp_path / 't.safetensors'),
    )
    == 0
  )
  assert 'pre_logits and head dropped' in capsys.readouterr().out
  with safetensors.safe_open(str(tmp_path / 't.safetensors'), 'np') as f:
    assert not [k for k in f.keys() if k.startswith('head')]
    assert json.loads(f.metadata()['timm_kwargs'])['num_classes'] == 0


def one_line_error(capsys, *args):
  return command_error(lambda argv: run(*args), None, capsys)


def test_errors_are_one_line(tmp_path, capsys, monkeypatch):
  config = architectures.MODEL_CONFIGS['testing']
  _, npz = write_npz(tmp_path, config, 10, 32)
  out = ('output', tmp_path / 'out')
  assert 'pass --model' in one_line_error(capsys, ('checkpoint', npz), ('format', 'npz'), out)
  assert 'did you mean ViT-B_16' in one_line_error(
    capsys, ('checkpoint', npz), ('model', 'ViT-B_166'), ('format', 'npz'), out
  )
  assert 'check --model' in one_line_error(
    capsys, ('checkpoint', npz), ('model', 'ViT-Ti_16'), ('format', 'npz'), out
  )
  assert 'no such checkpoint' in one_line_error(
    capsys, ('checkpoint', tmp_path / 'nope.npz'), ('model', 'testing'), ('format', 'hf'), out
  )
  bad = tmp_path / 'bad.safetensors'
  bad.write_bytes(b'not a safetensors file')
  assert 'not a readable .safetensors' in one_line_error(
    capsys, ('checkpoint', bad), ('model', 'testing'), ('format', 'npz'), out
  )

  from vit_jax.configs import model_spec
  from vit_jax.interop import hf as interop_hf

  with pytest.raises(torch_layout.ExportError, match='no R\\+ViT hybrid'):
    interop_hf.check_exportable(model_spec.registered('R50+ViT-B_16'))
  with pytest.raises(torch_layout.ExportError, match='class token only'):
    interop_hf.check_exportable(model_spec.registered('ViT-B_16-gap'))
  with pytest.raises(torch_layout.ExportError) as error:
    torch_layout.check_writes(model_spec.registered('ViT-22B_14'), 'timm', interop_timm.WRITES)
  assert str(error.value) == (
    "ViT-22B_14: the timm export writes the paper's ViT, not biases='no_qkv_or_norm', qk_norm, "
    'parallel_block; use --format=npz or --format=savedmodel'
  )

  monkeypatch.setitem(sys.modules, 'torch', None)  # as if torch were not installed
  assert 'pip install torch' in one_line_error(
    capsys, ('checkpoint', npz), ('model', 'testing'), ('format', 'onnx'), out
  )

  assert 'invalid choice' in one_line_error(
    capsys, ('checkpoint', npz), ('model', 'testing'), ('format', 'tflite'), out
  )


@pytest.mark.slow
def test_cli_runs_and_the_package_imports_without_optional_dependencies(tmp_path):
  config = architectures.MODEL_CONFIGS['testing']
  flat, npz = write_npz(tmp_path, config, 10, 32)
  result = subprocess.run(
    [
      sys.executable,
      '-m',
      'vit_jax.export',
      f'--checkpoint={npz}',
      '--model=testing',
      '--format=npz',
      f'--output={tmp_path / "copy.npz"}',
    ],
    capture_output=True,
    text=True,
    cwd=ROOT,
    env=subprocess_env(),
    check=False,
  )
  assert result.returncode == 0, result.stderr
  assert_flat_equal(checkpoint.flatten(checkpoint.load(tmp_path / 'copy.npz')), flat)
  heavy = subprocess.run(
    [
      sys.executable,
      '-c',
      'import sys, vit_jax.export; print(sorted(m for m in ("torch", '
      '"timm", "transformers", "tensorflow", "onnx", "safetensors") if m in sys.modules))',
    ],
    capture_output=True,
    text=True,
    cwd=ROOT,
    env=subprocess_env(),
    check=True,
  )
  assert heavy.stdout.strip() == '[]'


@needs_timm
def test_layer_scale_is_timms_ls1_ls2_and_a_run_and_a_checkpoint_take_it(tmp_path, capsys):
  """`--config.block.layer_scale=V` (CaiT's LayerScale): per block a gamma [D] that starts at V
  on each residual branch, timm's `blocks.N.ls1/ls2.gamma` (`init_values=V`): its logits within
  1e-5 of timm's on the same weights, the state both ways bitwise; a run's model starts at V;
  a checkpoint of it loads by its model name and exports through the CLI (a model option is a
  schema field, a `Block` field and its code, and timm's names)."""
  from vit_jax.training import program
  from vit_jax.training import steps

  config = small_vit_config('ViT-Ti_16')
  config.transformer.layer_scale = 1e-5
  flat = random_flat(config, 7, 32)
  assert flat['Transformer/encoderblock_1/ls2/gamma'].shape == (24,)
  state = interop_timm.to_timm(flat)
  assert state['blocks.1.ls2.gamma'].shape == (24,)
  model = interop_timm.build_model(Architecture.of(config), 7, 32)
  model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=True)
  with torch.no_grad():
    theirs = model(nchw(random_images(32))).numpy()
  assert_close(relative_error(ours(config, flat, random_images(32)), theirs), BOUND, 'logits')
  assert_flat_equal(
    interop_timm.from_timm(state, Architecture.of(small_vit_config('ViT-Ti_16')), 'timm'), flat
  )

  run_config = tiny_run_config(**{'block.layer_scale': 0.1})
  spec = program.validate(run_config, 1)
  init = steps.make_task(run_config, 10, False, spec).model.init(
    jax.random.key(0), np.zeros((1, 16, 16, 3), np.float32), train=False
  )['params']
  np.testing.assert_array_equal(
    init['Transformer']['encoderblock_0']['ls1']['gamma'], np.float32(0.1)
  )
  assert ModelSpec.of(tiny_run_config()).architecture.block.layer_scale is None  # the paper's

  npz = checkpoint.save_npz(init, tmp_path / 'ls.npz')
  loaded = loader.load_model(npz, 'testing')
  assert loaded.spec.architecture.block.layer_scale is not None
  assert (
    run(
      ('checkpoint', npz),
      ('model', 'testing'),
      ('format', 'timm'),
      ('output', tmp_path / 'ls.safetensors'),
    )
    == 0
  )
  assert 'blocks.0.ls1.gamma' in safetensors_torch.load_file(str(tmp_path / 'ls.safetensors'))


# ---------------------------------------------------------------------------
# What an exported .npz records, and timm files where an .npz is read.


def _predicted(argv, capsys):
  """(exit status, stdout lines, stderr lines) of `python -m vit_jax.predict ARGV`."""
  from vit_jax import predict
  from vit_jax.core import cli

  capsys.readouterr()
  code = cli.run(predict.main, argv)
  out, err = capsys.readouterr()
  return code, out.splitlines(), err.splitlines()


def _a_1000_class_run(path, dataset, names=None):
  """A finished workdir of the `testing` model whose 1000-way head always answers class 487;
  `names`: the class names its dataset.json records (None: it records none)."""
  from conftest import random_like

  shapes = param_shapes(architectures.MODEL_CONFIGS['testing'], 1000, 16)
  params = random_like(shapes, scale=0.02)
  params['head']['kernel'] = np.zeros_like(params['head']['kernel'])
  params['head']['bias'] = np.where(np.arange(1000) == 487, 20.0, 0.0).astype(np.float32)
  os.makedirs(path)
  checkpoint.save_npz(params, path / 'params.npz')  # as an older version wrote it: bare
  (path / 'summary.json').write_text(json.dumps({'model': 'testing', 'dataset': dataset}))
  record = {'dataset': dataset, 'path': None, 'num_classes': 1000, 'class_names': names}
  (path / 'dataset.json').write_text(json.dumps(record))
  return str(path)


def test_an_npz_export_carries_its_runs_class_names_and_model_to_predict(tmp_path, capsys):
  """A custom 1000-class run exported to a bare .npz and moved away predicts with its own
  names (not ImageNet's) and needs no --model; a run that knows no names records that it
  has none, and predict says so; a file that records nothing gets ImageNet's, said so."""
  from PIL import Image

  image = str(tmp_path / 'x.png')
  Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(image)
  names = [f'part-{i:04d}' for i in range(1000)]
  run_dir = _a_1000_class_run(tmp_path / 'named', str(tmp_path / 'parts'), names)
  out = tmp_path / 'elsewhere' / 'parts.npz'
  assert run(('checkpoint', run_dir), ('format', 'npz'), ('output', out)) == 0
  said = capsys.readouterr().out
  assert (
    'recorded in the .npz (predict and export read it): model testing, 1000 class names, '
    f'dataset {tmp_path}/parts'
  ) in said
  code, lines, err = _predicted([f'--checkpoint={out}', '--top_k=1', image], capsys)
  assert (code, lines[1], err) == (0, '  1. 100.00%  part-0487  (class 487)', [])

  nameless = _a_1000_class_run(tmp_path / 'nameless', str(tmp_path / 'gone'))
  bare = tmp_path / 'nameless.npz'
  assert run(('checkpoint', nameless), ('format', 'npz'), ('output', bare)) == 0
  assert '; no class names (' in capsys.readouterr().out
  code, lines, err = _predicted([f'--checkpoint={bare}', '--top_k=1', image], capsys)
  assert (code, lines[1]) == (0, '  1. 100.00%  class_487  (class 487)')
  assert err == [
    'python -m vit_jax.predict: classes named class_<i>: the file records no class names (a '
    f'1000-way head trained on {tmp_path}/gone); pass --labels=FILE, one name per line'
  ]

  released = checkpoint.save_npz(checkpoint.load(run_dir), tmp_path / 'released.npz')
  argv = [f'--checkpoint={released}', '--model=testing', '--top_k=1', image]
  code, lines, err = _predicted(argv, capsys)
  assert lines[1].startswith('  1. 100.00%  cellular telephone')
  assert err == [
    "python -m vit_jax.predict: class names: ImageNet-1k's, assumed for a 1000-way head of a "
    'file that records none (a released checkpoint); pass --labels=FILE if it was trained on '
    'other classes'
  ]


@needs_timm
def test_a_timm_file_where_an_npz_is_read_says_to_convert_it_and_the_conversion_names_it(
  tmp_path, capsys
):
  """predict and --config.pretrained_path take an .npz: a timm file (safetensors or
  torch.save) is one line saying how to convert it, before --model is asked for and before a
  run writes anything; the conversion says which model it recognised and records it, so
  predict then needs no --model."""
  from vit_jax.training import loop

  model = timm.create_model('deit3_small_patch16_224', depth=1, img_size=32, num_classes=10)
  state = {k: v.contiguous() for k, v in model.state_dict().items()}
  files = {'safetensors': str(tmp_path / 'deit3.safetensors'), 'pth': str(tmp_path / 'deit3.pth')}
  safetensors_torch.save_file(state, files['safetensors'])
  torch.save(state, files['pth'])
  kinds = {'safetensors': 'a safetensors file', 'pth': 'a PyTorch file (torch.save)'}
  image = str(tmp_path / 'x.png')
  from PIL import Image

  Image.fromarray(np.zeros((32, 32, 3), np.uint8)).save(image)
  from vit_jax import predict

  for kind, path in files.items():
    convert = (
      f'{path}: {kinds[kind]}, not an .npz; convert it first: python -m vit_jax.export '
      f'--checkpoint={path} --format=npz --output=deit3.npz (it says which model it '
      'recognised, or pass --model), then pass that .npz'
    )
    assert command_error(predict.main, [f'--checkpoint={path}', image], capsys) == (
      f'error: {convert}'
    )
    workdir = tmp_path / f'run_{kind}'
    config = tiny_run_config(model='deit3_small_patch16_224', pretrained_path=path)
    with pytest.raises(loop.ConfigError) as e:
      loop.train_and_evaluate(config, str(workdir))
    assert str(e.value) == f'--config.pretrained_path: {convert}'
    assert not workdir.exists()

  npz = tmp_path / 'deit3.npz'
  assert run(('checkpoint', files['safetensors']), ('format', 'npz'), ('output', npz)) == 0
  said = capsys.readouterr().out
  assert f'recognised {files["safetensors"]} as deit3_small_patch16_224 (its tensors' in said
  assert checkpoint.read_metadata(npz)['model'] == 'deit3_small_patch16_224'
  code, lines, _ = _predicted([f'--checkpoint={npz}', '--top_k=1', image], capsys)
  assert code == 0 and lines[0] == image and lines[1].startswith('  1. ')


def test_fine_tuning_a_family_without_a_pretrained_path_says_how_to_convert(tmp_path):
  """configs/finetune.py names gs://vit_models/imagenet21k/MODEL.npz; no such file exists for
  a timm family's model: one line before any network access, nothing written."""
  from vit_jax.configs import ConfigError
  from vit_jax.configs import recipes
  from vit_jax.training import loop

  config = recipes.finetune('deit3_small_patch16_224,digits')
  with pytest.raises(ConfigError) as e:
    loop.train_and_evaluate(config, str(tmp_path / 'run'))
  assert str(e.value) == (
    '--config.pretrained_path: gs://vit_models/imagenet21k/deit3_small_patch16_224.npz: no such '
    "released file; gs://vit_models holds the paper's and AugReg's ViTs, not "
    "deit3_small_patch16_224 (deit3): convert timm's weights of it first (python -m "
    'vit_jax.export --checkpoint=FILE.safetensors --format=npz '
    '--output=deit3_small_patch16_224.npz) and pass that .npz'
  )
  assert not (tmp_path / 'run').exists()
