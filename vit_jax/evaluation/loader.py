"""A checkpoint applied to images or to a dataset: what the command-line tools share.

`load_model` builds the `VisionTransformer` that a `.npz` holds: the head size
and pre-logits width come from the file, the resolution from its position
embeddings. Errors a user can cause raise `checkpoint.CheckpointError` or
`InputError`, each one line; the CLIs print them without a traceback.
"""

import importlib.resources
import json
import math
import os
from typing import Any, List, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from vit_jax import checkpoint
from vit_jax import models
from vit_jax import sharding
from vit_jax.configs import models as model_configs
from vit_jax.evaluation import metrics

IMAGE_EXTENSIONS = ('.jpg', '.jpeg', '.png', '.bmp', '.gif', '.webp', '.tif', '.tiff')
# Layers of masked patch prediction (vit_jax.mpp); the backbone is analysed without them.
_MPP_ONLY = ('mask_token', 'mpp_head/')
# Head sizes of the public checkpoints -> shipped class-name files (vit_jax/data/).
LABEL_FILES = {1000: 'imagenet2012_labels.txt', 21843: 'imagenet21k_labels.txt'}


class InputError(ValueError):
  """A bad command-line input (model name, image, label file); one line."""


class LoadedModel(NamedTuple):
  model: models.VisionTransformer
  params: Any
  config: Any  # the MODEL_CONFIGS entry, with the checkpoint's representation_size
  image_size: int
  grid_size: int  # patches per side
  pixels_per_patch: int  # input pixels per patch step (the backbone stride for hybrids)
  num_prefix_tokens: int


def pixels_per_patch(config) -> int:
  """Input pixels per token step: the patch size, times the ResNet's stride for hybrids."""
  patch = config.patches.size[0]
  if config.get('resnet') is not None:
    # Root conv /2 and max-pool /2, then /2 in every stage after the first
    # (R+ViT-Ti_16 has the root only).
    return patch * 4 * 2 ** max(len(config.resnet.num_layers) - 1, 0)
  return patch


def model_config(model_name: str):
  """A fresh MODEL_CONFIGS entry; InputError naming close matches for a wrong name."""
  try:
    return model_configs.MODEL_CONFIGS[model_name]
  except KeyError as e:
    raise InputError(f'--model: {e.args[0]}') from None


def workdir_summary(path: str) -> dict:
  """A training workdir's `summary.json` ({} for files and unfinished runs)."""
  try:
    with open(os.path.join(path, 'summary.json'), encoding='utf-8') as f:
      return json.load(f)
  except (OSError, ValueError):
    return {}


def resolve_model_name(name: Optional[str], path: str, metadata: Optional[dict] = None) -> str:
  """`name`, else the one the checkpoint records (a workdir's summary.json, file metadata)."""
  path = os.fspath(path)
  name = (
    name
    or (metadata or {}).get('vit_jax_model')
    or (workdir_summary(path).get('model') if os.path.isdir(path) else None)
  )
  if not name:
    raise InputError(
      f'{path}: pass --model (a vit_jax.configs.models.MODEL_CONFIGS name such as '
      'ViT-B_16); only a finished training workdir records its model'
    )
  return name


def load_model(path: str, model_name: Optional[str] = None) -> LoadedModel:
  """The model a checkpoint holds, checked key by key and shape by shape.

  Args:
    path: a `.npz`, or a workdir holding `params.npz`.
    model_name: a `MODEL_CONFIGS` name (`ViT-B_16`, `testing`, ...); None
      for a workdir, whose summary.json names it.
  """
  checkpoint.resolve(path)  # a missing file is named as such, before a missing --model
  model_name = resolve_model_name(model_name, path)
  _ = model_config(model_name)  # a wrong name fails before the file is read
  return model_from_flat(checkpoint.flatten(checkpoint.load(path)), model_name, os.fspath(path))


def model_from_flat(flat: dict, model_name: str, what: str) -> LoadedModel:
  """`load_model` for parameters already in memory ({'a/b/c': array}, public names).

  `what` names their source in errors (a path, or a converted file).
  """
  config = model_config(model_name)
  flat = {k: v for k, v in flat.items() if not k.startswith(_MPP_ONLY)}
  if 'pre_logits/kernel' in flat:
    config.representation_size = int(flat['pre_logits/kernel'].shape[-1])
  num_classes = int(flat['head/kernel'].shape[-1]) if 'head/kernel' in flat else None
  num_prefix = 1 if config.classifier in ('token', 'token_unpooled') else 0

  posemb = flat.get('Transformer/posembed_input/pos_embedding')
  if posemb is None or posemb.ndim != 3:
    raise checkpoint.CheckpointError(
      f'{what}: no Transformer/posembed_input/pos_embedding of '
      'shape [1, tokens, width]; is it a ViT checkpoint?'
    )
  num_patches = posemb.shape[1] - num_prefix
  grid = math.isqrt(max(num_patches, 0))
  if num_patches < 1 or grid * grid != num_patches:
    raise checkpoint.CheckpointError(
      f'{what}: {posemb.shape[1]} position embeddings are not {num_prefix} class token(s) + a '
      f'square patch grid, as {model_name} (classifier={config.classifier}) needs; check --model'
    )
  stride = pixels_per_patch(config)
  image_size = grid * stride

  model = models.VisionTransformer(num_classes=num_classes, **config)
  expected = jax.eval_shape(
    lambda: model.init(jax.random.key(0), jnp.zeros((1, image_size, image_size, 3)), train=False)
  )['params']
  params = checkpoint.unflatten(flat)
  checkpoint.check_tree(params, expected, what=what)
  return LoadedModel(model, params, config, image_size, grid, stride, num_prefix)


# ---------------------------------------------------------------------------
# Images.


def image_files(specs: Sequence[str]) -> List[str]:
  """Files named by `specs`: image files, directories (their images, sorted) or comma lists."""
  files = []
  for spec in specs:
    for item in filter(None, spec.split(',')):
      if os.path.isdir(item):
        found = sorted(
          os.path.join(item, f) for f in os.listdir(item) if f.lower().endswith(IMAGE_EXTENSIONS)
        )
        if not found:
          raise InputError(f'{item}: a directory without images ({", ".join(IMAGE_EXTENSIONS)})')
        files.extend(found)
      elif os.path.exists(item):
        files.append(item)
      else:
        raise InputError(f'{item}: no such image file or directory')
  return files


def read_image(path: str, size: int) -> np.ndarray:
  """[size, size, 3] float32 in [-1, 1]: RGB, resized (bilinear) like the eval pipeline."""
  from PIL import Image

  try:
    with Image.open(path) as image:
      image = image.convert('RGB').resize((size, size), Image.BILINEAR)
  except (OSError, ValueError, Image.DecompressionBombError) as e:
    message = str(e).splitlines()[0] if str(e) else type(e).__name__
    raise InputError(f'{path}: not a readable image ({message}); pass a JPEG or PNG file') from None
  return np.asarray(image, np.float32) / 127.5 - 1.0


def builtin_images() -> List[str]:
  """Photos that ship with installed packages, for runs without --images.

  matplotlib's `grace_hopper.jpg`, and scikit-learn's `china.jpg` and
  `flower.jpg` when scikit-learn is installed.
  """
  import matplotlib

  files = [os.path.join(matplotlib.get_data_path(), 'sample_data', 'grace_hopper.jpg')]
  try:
    import sklearn.datasets

    folder = os.path.join(os.path.dirname(sklearn.datasets.__file__), 'images')
    files += [os.path.join(folder, name) for name in ('china.jpg', 'flower.jpg')]
  except ImportError:
    pass
  return [f for f in files if os.path.exists(f)]


# ---------------------------------------------------------------------------
# Class names.


def class_names(num_classes: int, labels_file: Optional[str] = None) -> List[str]:
  """Names for a head of `num_classes` outputs.

  From `labels_file` (one name per line) if given; else the shipped
  ImageNet-1k (1000) or ImageNet-21k (21843) names; else `class_<i>`.
  """
  if labels_file:
    try:
      with open(labels_file, encoding='utf-8') as f:
        names = [line.rstrip('\n') for line in f if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
      raise InputError(
        f'{labels_file}: cannot read the labels file ({e}); '
        'pass a UTF-8 text file with one class name per line'
      ) from None
    if len(names) != num_classes:
      raise InputError(
        f'{labels_file}: {len(names)} names for a head of {num_classes} classes; '
        "pass one name per class, in the head's order"
      )
    return names
  if num_classes in LABEL_FILES:
    text = (
      importlib.resources.files('vit_jax')
      .joinpath('data', LABEL_FILES[num_classes])
      .read_text(encoding='utf-8')
    )
    return text.splitlines()
  return [f'class_{i}' for i in range(num_classes)]


_PREDICT_BATCH = 16


def predict(loaded: LoadedModel, files: Sequence[str], k: int = 5, *, unreadable=None) -> tuple:
  """(indices [B, k], probabilities [B, k]) for image files: softmax of the logits.

  An unreadable file raises InputError; with a list as `unreadable`, it is
  appended there as (path, reason) instead and left out of the results.
  """
  apply = jax.jit(lambda p, x: loaded.model.apply({'params': p}, x, train=False))
  indices, probs = [], []
  for start in range(0, len(files), _PREDICT_BATCH):
    images = []
    for f in files[start : start + _PREDICT_BATCH]:
      try:
        images.append(read_image(f, loaded.image_size))
      except InputError as e:
        if unreadable is None:
          raise
        unreadable.append((f, str(e)))
    if images:
      i, p = metrics.top_k(apply(loaded.params, np.stack(images)), k)
      indices.append(i)
      probs.append(p)
  if not indices:
    return np.zeros((0, k), np.int32), np.zeros((0, k), np.float32)
  return np.concatenate(indices), np.concatenate(probs)


def evaluate(loaded: LoadedModel, data_config, split: str, batch_sharding) -> dict:
  """{'top1', 'top5' (single-label), 'examples'} of `loaded` on a whole dataset split."""
  from vit_jax.data import pipeline  # TensorFlow: imported when a dataset is read

  info = pipeline.get_info(data_config)
  if loaded.model.num_classes != info.num_classes:
    raise InputError(
      f"{data_config.dataset} has {info.num_classes} classes, the checkpoint's head "
      f'{loaded.model.num_classes}; evaluate a checkpoint fine-tuned on it'
    )
  model, multi_label = loaded.model, info.multi_label

  @jax.jit
  def counts_fn(params, batch):
    logits = model.apply({'params': params}, batch['image'], train=False)
    return metrics.classification_counts(logits, batch['label'], batch['mask'], multi_label)

  params = jax.device_put(loaded.params, sharding.replicated(batch_sharding.mesh))
  result = metrics.accuracy(
    counts_fn, params, pipeline.make_eval_iterator(data_config, batch_sharding, split=split)
  )
  top5 = result.pop('accuracy_top5', None)
  return {
    'top1': result['accuracy'],
    'examples': result['examples'],
    **({'top5': top5} if top5 is not None else {}),
  }
