"""A timm file's own weights: their preprocessing (timm's `pretrained_cfg` of `name.tag`),
recorded at conversion and applied as timm's evaluation transform; and every file named for
what it is (a family we do not convert, a --model its place or tensors contradict).

timm is the reference: its registry (`timm.list_pretrained`, `get_pretrained_cfg`: data in the
package, nothing downloaded), its eval transform (`timm.data.create_transform`) and its models
built with `pretrained=False` one block deep, every parameter random.
"""

import json
import os

from conftest import command_error
from conftest import data_config
from conftest import save_timm_file
from conftest import timm_hub_file
import numpy as np
import pytest

from vit_jax import checkpoint
from vit_jax import evaluate
from vit_jax import export as export_cli
from vit_jax import predict
from vit_jax.configs import families
from vit_jax.configs import timm_weights
from vit_jax.data import pipeline
from vit_jax.evaluation import classify
from vit_jax.evaluation import loader
from vit_jax.interop import export as export_lib
from vit_jax.interop import timm as interop_timm
from vit_jax.interop import timm_files

torch = pytest.importorskip('torch')
timm = pytest.importorskip('timm')
safetensors_torch = pytest.importorskip('safetensors.torch')
from PIL import Image  # noqa: E402

SIZES = {'depth': 1}  # timm's width (a file's width is its name's), one block


def _timm_names():
  """timm's names of the supported families and of the paper's models that have weights."""
  ours = set(timm_weights.WEIGHTS) | set(timm_weights.PAPER_WEIGHTS)
  return sorted({n.split('.')[0] for n in timm.list_pretrained()} & ours)


def test_every_tag_of_the_supported_families_has_timms_preprocessing():
  """Every `name.tag` timm registers for the families' names (and the paper's timm names):
  the recorded mean, std, interpolation, crop_pct, crop mode, input size and head equal its
  `pretrained_cfg`, the first tag is timm's default, and no name of a family lacks its tags."""
  from timm.models import get_pretrained_cfg

  assert set(families.MODELS) <= set(timm_weights.WEIGHTS)
  checked = 0
  for name in _timm_names():
    tags = timm_weights.tags(name)
    assert {n.split('.', 1)[1] for n in timm.list_pretrained(f'{name}.*')} <= set(tags), name
    assert get_pretrained_cfg(name).tag == tags[0], name
    for tag in tags:
      cfg = get_pretrained_cfg(f'{name}.{tag}')
      ours = timm_weights.preprocessing(name, tag)
      assert (ours.mean, ours.std) == (tuple(cfg.mean), tuple(cfg.std)), f'{name}.{tag}'
      assert ours.interpolation == cfg.interpolation and ours.crop_pct == cfg.crop_pct
      assert ours.crop_mode == cfg.crop_mode and ours.size == cfg.input_size[-1]
      assert timm_weights.head_classes(name, tag) == cfg.num_classes, f'{name}.{tag}'
      assert cfg.test_input_size is None and cfg.test_crop_pct is None
      checked += 1
  assert checked == 273


def _timm_model(name, tag, num_classes, seed=0):
  """timm's `name.tag` one block deep (its own width and resolution), every parameter random."""
  model = timm.create_model(
    f'{name}.{tag}', pretrained=False, num_classes=num_classes, **SIZES
  ).eval()
  generator = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for key, p in model.named_parameters():
      near_one = key.endswith('gamma') or ('norm' in key and key.endswith('weight'))
      p.copy_(0.3 * torch.randn(p.shape, generator=generator) + near_one)
  return model


def _photo(path, width=300, height=200):
  """A 3:2 JPEG with structure at every scale (gradients, a disc, noise)."""
  rng = np.random.default_rng(0)
  y, x = np.mgrid[0:height, 0:width] / max(width, height)
  disc = ((x - 0.6) ** 2 + (y - 0.3) ** 2 < 0.05).astype(np.float64)
  pixels = np.stack([x, y, disc], -1) * 200 + rng.uniform(0, 55, (height, width, 3))
  Image.fromarray(pixels.astype(np.uint8)).save(path, quality=95)
  return str(path)


@pytest.mark.parametrize(
  'name, tag',
  [
    ('vit_large_patch14_clip_224', 'laion2b_ft_in12k_in1k'),  # 0.5 / 0.5, crop_pct 1
    ('deit_small_patch16_224', 'fb_in1k'),  # ImageNet's, crop_pct 0.9
  ],
)
def test_predict_gives_timms_top5_on_a_non_square_photo(tmp_path, capsys, name, tag):
  """A timm file in its hub folder, converted to `.npz` (the line of its preprocessing said at
  conversion and at prediction, and recorded), then predicted on a 3:2 photo: the top 5 are
  timm's, and the logits those of timm's model fed by timm's own eval transform within 1e-4."""
  from timm.data import create_transform
  from timm.data import resolve_data_config

  model = _timm_model(name, tag, 1000)
  source = timm_hub_file(tmp_path, name, tag, model)
  npz = str(tmp_path / 'converted.npz')
  assert export_cli.main([f'--checkpoint={source}', '--format=npz', f'--output={npz}']) == 0
  line = timm_weights.preprocessing(name, tag).line()
  assert line.startswith(f'preprocessing of {name}.{tag}: resize the shorter side to ')
  assert f'  {line}' in capsys.readouterr().out.splitlines()
  recorded = timm_weights.Preprocessing.from_json(checkpoint.read_metadata(npz)['preprocessing'])
  assert recorded == timm_weights.preprocessing(name, tag)

  photo = _photo(tmp_path / 'photo.jpg')
  transform = create_transform(**resolve_data_config({}, model=model))
  with torch.no_grad():
    theirs = model(transform(Image.open(photo).convert('RGB'))[None]).numpy()[0]
  assert predict.main([f'--checkpoint={npz}', photo]) == 0
  out, err = capsys.readouterr()
  assert err.splitlines() == [f'python -m vit_jax.predict: {line}']
  top5 = [int(row.rsplit('(class ', 1)[1].rstrip(')')) for row in out.splitlines()[1:6]]
  assert top5 == list(np.argsort(-theirs)[:5])
  loaded = loader.load_model(npz)
  pixels = classify.read_pixels(photo, loaded.spec.image_size, loaded.preprocessing)
  from vit_jax.data import on_device

  ours = np.asarray(
    loaded.model.apply({'params': loaded.params}, on_device.normalise(pixels[None]), train=False)
  )[0]
  assert np.max(np.abs(ours - theirs)) <= 1e-4 * np.max(np.abs(theirs))


def test_a_file_whose_tags_differ_names_them_and_the_flag_that_settles_it(tmp_path, capsys):
  """A bare `vit_large_patch14_clip_224` file with a 1000-class head may hold four of timm's
  weights, two with OpenAI CLIP's statistics and two with 0.5: one line names both groups and
  --tag; --tag=NAME.TAG records that tag's."""
  name = 'vit_large_patch14_clip_224'
  source = save_timm_file(_timm_model(name, 'openai_ft_in1k', 1000), tmp_path / 'clip.safetensors')
  npz = str(tmp_path / 'clip.npz')
  args = [f'--checkpoint={source}', f'--model={name}', '--format=npz', f'--output={npz}']
  assert command_error(export_cli.main, args, capsys) == (
    f"error: {source}: timm's weights of {name} with a 1000-class head differ in preprocessing "
    '(laion2b_ft_in12k_in1k, laion2b_ft_in1k: mean (0.5, 0.5, 0.5), std (0.5, 0.5, 0.5), '
    'crop_pct 1; openai_ft_in12k_in1k, openai_ft_in1k: mean (0.481455, 0.457827, 0.408211), '
    'std (0.26863, 0.261303, 0.275777), crop_pct 1); pass --tag naming its weights (e.g. '
    f'--tag={name}.laion2b_ft_in12k_in1k)'
  )
  assert not os.path.exists(npz)
  assert export_cli.main(args + [f'--tag={name}.openai_ft_in1k']) == 0
  recorded = loader.load_model(npz).preprocessing
  assert recorded == timm_weights.preprocessing(name, 'openai_ft_in1k')
  assert recorded.mean == timm_weights.STATISTICS['openai_clip'][0]


def test_a_timm_config_beside_the_file_is_its_preprocessing(tmp_path):
  """timm's `push_to_hub` writes the weights' `pretrained_cfg` into a config.json beside them:
  that file's statistics and crop are the ones recorded, over the table's."""
  name = 'deit_small_patch16_224'
  model = _timm_model(name, 'fb_in1k', 10)
  source = save_timm_file(model, tmp_path / 'mine' / 'model.safetensors')
  cfg = {'tag': 'fb_in1k', 'mean': [0.4, 0.4, 0.4], 'std': [0.2, 0.2, 0.2], 'crop_pct': 0.8}
  cfg.update(input_size=[3, 224, 224], interpolation='bilinear')
  with open(tmp_path / 'mine' / 'config.json', 'w') as f:
    json.dump({'architecture': name, 'num_classes': 10, 'pretrained_cfg': cfg}, f)
  loaded = export_lib.load(source).loaded
  assert loaded.spec.name == name
  p = loaded.preprocessing
  assert (p.mean, p.std, p.crop_pct, p.interpolation) == ((0.4,) * 3, (0.2,) * 3, 0.8, 'bilinear')
  assert loaded.spec.architecture.input_stats == ((0.4,) * 3, (0.2,) * 3)


def test_evaluation_batches_are_timms_eval_pixels(tmp_path):
  """The evaluation pipeline (predict, evaluate, few-shot, a run's evaluation) of a family's
  checkpoint reads an image folder of non-square JPEGs into exactly timm's pixels: the eval
  transform of the weights before its ToTensor, bitwise."""
  from timm.data import create_transform

  for label, (w, h) in enumerate([(300, 200), (120, 260), (64, 64)]):
    folder = tmp_path / 'data' / 'train' / f'c{label}'
    folder.mkdir(parents=True)
    _photo(folder / 'a.jpg', w, h)
  for split in ('test',):
    os.symlink(tmp_path / 'data' / 'train', tmp_path / 'data' / split)
  p = timm_weights.preprocessing('deit_small_patch16_224', 'fb_in1k').at(48)
  config = data_config(tmp_path / 'data', batch_eval=3, **{'pp.crop': 48})
  batch = next(
    iter(
      pipeline.make_eval_iterator(config, None, raw=True, pp=pipeline.Preprocessing.of(config, p))
    )
  )
  transform = create_transform(48, crop_pct=p.crop_pct, interpolation=p.interpolation)
  resize_crop = transform.transforms[:2]  # Resize, CenterCrop; then ToTensor, Normalize
  for image, label in zip(np.asarray(batch['image']), np.asarray(batch['label'])):
    with Image.open(tmp_path / 'data' / 'train' / f'c{label}' / 'a.jpg') as photo:
      theirs = photo.convert('RGB')
      for t in resize_crop:
        theirs = t(theirs)
    np.testing.assert_array_equal(image, np.asarray(theirs))


def test_evaluate_refuses_an_official_resize_for_a_familys_checkpoint(tmp_path, capsys):
  name = 'deit_small_patch16_224'
  source = timm_hub_file(tmp_path, name, 'fb_in1k', _timm_model(name, 'fb_in1k', 10))
  npz = str(tmp_path / 'deit.npz')
  assert export_cli.main([f'--checkpoint={source}', '--format=npz', f'--output={npz}']) == 0
  args = [f'--checkpoint={npz}', '--dataset=digits', '--resize=256']
  assert command_error(evaluate.main, args, capsys).startswith(
    "error: --resize=256: the checkpoint evaluates by its weights' own transform (preprocessing of "
    'deit_small_patch16_224.fb_in1k: resize the shorter side to 248 px (bicubic, crop_pct 0.9)'
  )


# ---------------------------------------------------------------------------
# Every file named for what it is.


@pytest.mark.parametrize(
  'name, title, depth',
  [
    ('beit_base_patch16_224', 'BEiT', {'depth': 1}),
    ('swin_tiny_patch4_window7_224', 'Swin Transformer', {'depths': (1, 1, 1, 1)}),
  ],
)
def test_a_file_of_a_family_we_do_not_have_is_named_and_refused(
  tmp_path, capsys, name, title, depth
):
  """Bare, it is named by its tensors; under --model=ViT-B_16 too (never 'pass --model')."""
  model = timm.create_model(name, pretrained=False, num_classes=10, **depth).eval()
  source = save_timm_file(model, tmp_path / 'f.safetensors')
  args = [f'--checkpoint={source}', '--format=npz', f'--output={tmp_path / "x.npz"}']
  expected = (
    f'error: {source}: its tensors are those of {title}, a family vit_jax does not convert (its '
    "models: the paper's and vit_jax.configs.families); it cannot be imported"
  )
  assert command_error(export_cli.main, args, capsys) == expected
  assert command_error(export_cli.main, args + ['--model=ViT-B_16'], capsys) == expected
  assert not (tmp_path / 'x.npz').exists()


def test_a_hub_file_of_a_family_we_do_not_have_is_named_by_its_folder(tmp_path, capsys):
  model = timm.create_model('beit_base_patch16_224', pretrained=False, depth=1).eval()
  source = timm_hub_file(tmp_path, 'beit_base_patch16_224', 'in22k_ft_in22k_in1k', model)
  args = [f'--checkpoint={source}', '--format=npz', f'--output={tmp_path / "x.npz"}']
  assert command_error(export_cli.main, args, capsys) == (
    f'error: {source}: its folder models--timm--beit_base_patch16_224.in22k_ft_in22k_in1k '
    "(timm's hub download) names timm's beit_base_patch16_224 (BEiT), a family vit_jax does "
    "not convert (its models: the paper's and vit_jax.configs.families); it cannot be imported"
  )


@pytest.mark.parametrize(
  'name, tag, model_name',
  [
    ('vit_base_patch16_siglip_gap_224', 'webli', 'ViT-B_16-gap'),  # exact GELU, not tanh
    ('deit_small_patch16_224', 'fb_in1k', 'ViT-S_16'),  # ImageNet's statistics, exact GELU
  ],
)
def test_a_model_that_would_change_the_files_activation_or_input_is_refused(
  tmp_path, capsys, name, tag, model_name
):
  """A file that its hub folder (or its file name) shows to be timm's `name`, under the paper's
  model of the same tensors (which would feed it [-1, 1] pixels through the tanh GELU): one
  line; without --model it converts as `name`, and within 2e-6 of timm's model."""
  model = _timm_model(name, tag, 0 if 'siglip' in name else 1000)
  for source, by in (
    (
      timm_hub_file(tmp_path, name, tag, model),
      f"its folder models--timm--{name}.{tag} (timm's hub download)",
    ),
    (save_timm_file(model, tmp_path / f'{name}.safetensors'), f'its name {name}'),
  ):
    args = [f'--checkpoint={source}', '--format=npz', f'--output={tmp_path / "x.npz"}']
    assert command_error(export_cli.main, args + [f'--model={model_name}'], capsys) == (
      f"error: --model={model_name}: {by} names timm's {name}; leave --model out (or "
      'rename the file, if that name is not what it holds)'
    )
    assert not (tmp_path / 'x.npz').exists()
  loaded = export_lib.load(source).loaded
  assert loaded.spec.name == name
  x = np.random.default_rng(0).uniform(
    -1, 1, (2, loaded.spec.image_size, loaded.spec.image_size, 3)
  )
  x = x.astype(np.float32)
  p = loaded.preprocessing
  normalised = ((x + 1) / 2 - np.asarray(p.mean)) / np.asarray(p.std)
  with torch.no_grad():
    theirs = model(torch.from_numpy(normalised.transpose(0, 3, 1, 2).astype(np.float32))).numpy()
  ours = np.asarray(loaded.model.apply({'params': loaded.params}, x, train=False))
  assert np.max(np.abs(ours - theirs)) <= 2e-6 * np.max(np.abs(theirs))


def test_a_model_the_tensors_contradict_is_refused(tmp_path, capsys):
  """A bare DeiT III file (LayerScale, the patches' positions alone) under the paper's
  ViT-B_16, which would load its LayerScale but run the tanh GELU on [-1, 1] pixels."""
  model = timm.create_model('deit3_base_patch16_224', pretrained=False, depth=1).eval()
  source = save_timm_file(model, tmp_path / 'f.safetensors')
  args = [f'--checkpoint={source}', '--model=ViT-B_16', '--format=npz']
  assert command_error(export_cli.main, args + [f'--output={tmp_path / "x.npz"}'], capsys) == (
    f'error: --model=ViT-B_16: the tensors of {source} show the layout of deit3_base_patch16_224 '
    'and deit3_base_patch16_384, not of ViT-B_16; leave --model out'
  )


def test_the_papers_timm_weights_of_other_statistics_are_refused(tmp_path, capsys):
  """timm's `vit_base_patch16_224.mae` has the paper's tensors and MAE's ImageNet statistics."""
  model = timm.create_model('vit_base_patch16_224', pretrained=False, num_classes=0, depth=1)
  source = timm_hub_file(tmp_path, 'vit_base_patch16_224', 'mae', model)
  args = [f'--checkpoint={source}', '--format=npz', f'--output={tmp_path / "x.npz"}']
  assert command_error(export_cli.main, args, capsys) == (
    f"error: {source}: its folder models--timm--vit_base_patch16_224.mae (timm's hub download) says "
    "it holds timm's vit_base_patch16_224.mae, weights that take other input statistics (mean "
    "(0.485, 0.456, 0.406)) than the paper's ViT-B_16 ([-1, 1] pixels); vit_jax does not "
    'convert them'
  )
  # The paper's own weights of the name convert as ViT-B_16, fed as the paper's.
  source = timm_hub_file(tmp_path, 'vit_base_patch16_224', 'augreg2_in21k_ft_in1k', model)
  loaded = export_lib.load(source).loaded
  assert loaded.spec.name == 'ViT-B_16' and loaded.preprocessing is None
  assert interop_timm.TIMM_NAMES['ViT-B_16'] == 'vit_base_patch16'
  assert timm_files.our_name('vit_base_patch16_384') == 'ViT-B_16'
