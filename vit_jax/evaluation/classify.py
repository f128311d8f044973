"""A loaded checkpoint applied to image files or to a whole dataset split: predict's engine.

`predict` gives the top-k classes of image files (`python -m vit_jax.predict`),
`evaluate` the exact top-1 and top-5 accuracy over a split (`python -m
vit_jax.evaluate`, with ImageNet's ReaL labels in `evaluate_checkpoint`).
Images are read as the evaluation pipeline reads them: RGB, a bilinear resize
to the checkpoint's resolution, uint8 pixels made [-1, 1] on the device; a family's
checkpoint by its weights' own transform (timm's: `LoadedModel.preprocessing`).
"""

import contextlib
import importlib.resources
import logging
import os
from typing import List, NamedTuple, Optional, Sequence

import jax
import numpy as np

from vit_jax.configs.data import data_config
from vit_jax.core import hardware
from vit_jax.core import sharding
from vit_jax.data import on_device
from vit_jax.data.sources import DataError
from vit_jax.evaluation import metrics
from vit_jax.evaluation.loader import InputError
from vit_jax.evaluation.loader import LoadedModel

# Head sizes of the public checkpoints -> shipped class-name files (vit_jax/data/).
LABEL_FILES = {1000: 'imagenet2012_labels.txt', 21843: 'imagenet21k_labels.txt'}


def image_files(specs: Sequence[str]) -> List[str]:
  """Files named by `specs`: image files, directories or comma lists. A directory gives its
  images at any depth (a dataset folder's, in its class folders), sorted, as training reads
  them (`data.readers.folder.images_under`: tools' folders left out, and said)."""
  from vit_jax.data.readers import folder

  files = []
  for spec in specs:
    for item in filter(None, spec.split(',')):
      if os.path.isdir(item):
        found, tools, others = folder.images_under(item)
        if not found:
          raise InputError(f'{item}: a directory without images ({folder.IMAGE_KINDS})')
        folder.warn_once(folder.left_out_line(item, tools, others))
        files.extend(os.path.join(item, f) for f in found)
      elif os.path.exists(item):
        files.append(item)
      else:
        raise InputError(f'{item}: no such image file or directory')
  return files


def read_image(path: str, size: int, transform=None) -> np.ndarray:
  """[size, size, 3] float32 in [-1, 1]: the evaluation pipeline's pixels for the same file, scaled on the host."""
  from vit_jax.data import images

  return images.to_float(read_pixels(path, size, transform))


def read_pixels(path: str, size: int, transform=None) -> np.ndarray:
  """`read_image` as uint8 pixels [size, size, 3], before the [-1, 1] scaling.

  `vit_jax.data.images` decodes (every PIL mode as training reads it: 16-bit
  grey by its high byte, alpha dropped, CMYK converted, EXIF orientation not
  applied, as TensorFlow) and resizes as `tf.image.resize`; with `transform` (a family's
  weights' `configs.timm_weights.Preprocessing`) it reads and resizes as timm evaluates them.
  """
  from vit_jax.data import images

  try:
    with open(path, 'rb') as f:
      data = f.read()
    if not data:
      raise InputError(f'{path}: an empty file, not an image; pass a JPEG or PNG file')
    if transform is not None:
      pixels = images.timm_eval_image(data, transform.at(size))
    else:
      pixels = images.eval_image(data, size)
  except OSError as e:
    raise InputError(
      f'{path}: cannot read it ({e.strerror or e}); pass a JPEG or PNG file'
    ) from None
  except images.TooLarge as e:
    raise InputError(f'{path}: an image too large to decode ({e}); pass a smaller copy') from None
  except images.BadImage as e:
    raise InputError(
      f'{path}: not a readable image ({e}); pass an image file (JPEG, PNG, ...) that opens'
    ) from None
  return pixels


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


def class_names(
  num_classes: int, labels_file: Optional[str] = None, checkpoint: Optional[str] = None
) -> List[str]:
  """Names for a head of `num_classes` outputs.

  From `labels_file` (one name per line) if given; else, for a training
  workdir `checkpoint`, the class names its run recorded (dataset.json), or
  the names of its dataset (an image folder's class folders, a TFDS dataset's
  labels) when that opens here and has as many; else the shipped ImageNet-1k
  (1000) or ImageNet-21k (21843) names, for a file or a run on ImageNet;
  else `class_<i>` (`class_names_and_why` says why).
  """
  return class_names_and_why(num_classes, labels_file, checkpoint)[0]


def _imagenet_names(num_classes: int) -> List[str]:
  return (
    importlib.resources.files('vit_jax')
    .joinpath('data', LABEL_FILES[num_classes])
    .read_text(encoding='utf-8')
    .splitlines()
  )


class ClassNames(NamedTuple):
  """A head's class names and where they come from."""

  names: List[str]
  why: str  # '' or why the names are `class_<i>`, and what to do
  note: str  # '' or a remark beside names that were assumed (ImageNet's, for a bare file)
  source: str  # 'labels', 'run' (dataset.json), 'file' (its record), 'dataset', 'imagenet', ''


def class_names_and_why(
  num_classes: int, labels_file: Optional[str] = None, checkpoint: Optional[str] = None
) -> tuple:
  """(`class_names`, '' or a line saying why the names are `class_<i>` and what to do)."""
  found = class_names_of(num_classes, labels_file, checkpoint)
  return found.names, found.why


def class_names_of(
  num_classes: int, labels_file: Optional[str] = None, checkpoint: Optional[str] = None
) -> ClassNames:
  """`class_names` with where they come from: --labels, the run's record (a workdir's
  dataset.json, or what an .npz this package wrote records, `checkpoint.read_metadata`), its
  dataset, ImageNet's for a 1000- or 21843-way head of a file that records none (said in
  `note`) or of an ImageNet run, else `class_<i>` (`why`)."""
  from vit_jax import checkpoint as checkpoint_lib
  from vit_jax import workdir

  if labels_file:
    return ClassNames(_labels_file(labels_file, num_classes), '', '', 'labels')
  why = []
  run = workdir.is_workdir(checkpoint or '')
  if run:
    recorded, source = workdir.read_dataset(checkpoint) or {}, 'run'
  else:
    recorded, source = (checkpoint_lib.read_metadata(checkpoint) if checkpoint else {}), 'file'
  names = recorded.get('class_names')
  if names is None and run:
    names, source = dataset_class_names(checkpoint, why), 'dataset'
  if names is not None and len(names) == num_classes:
    return ClassNames(list(names), '', '', source)
  dataset = workdir.recorded(checkpoint, 'dataset') if run else recorded.get('dataset')
  if num_classes in LABEL_FILES and (not dataset or _is_imagenet(dataset)):
    note = ''
    if not run and not recorded:
      which = 'ImageNet-1k' if num_classes == 1000 else 'ImageNet-21k'
      note = (
        f"class names: {which}'s, assumed for a {num_classes}-way head of a file that records "
        'none (a released checkpoint); pass --labels=FILE if it was trained on other classes'
      )
    return ClassNames(_imagenet_names(num_classes), '', note, 'imagenet')
  if names is not None:
    why.append(f'its dataset has {len(names)} classes, the head {num_classes}')
  reason = why[0] if why else f'a {num_classes}-way head, not an ImageNet one (1000 or 21843)'
  if not why and num_classes in LABEL_FILES:
    reason = f'a {num_classes}-way head trained on {dataset}, not ImageNet'
  if not why and not run and recorded and not names:
    reason = f'the file records no class names (a {num_classes}-way head trained on {dataset})'
  return ClassNames(
    [f'class_{i}' for i in range(num_classes)],
    f'classes named class_<i>: {reason}; pass --labels=FILE, one name per line',
    '',
    '',
  )


def _is_imagenet(dataset: str) -> bool:
  """Whether a recorded dataset is ImageNet's (a TFDS name, not a folder someone named so)."""
  from vit_jax.data.readers import reader

  return str(dataset).startswith('imagenet') and not reader.names_a_path(str(dataset))


def _labels_file(path: str, num_classes: int) -> List[str]:
  try:
    with open(path, encoding='utf-8') as f:
      names = [line.rstrip('\n') for line in f if line.strip()]
  except (OSError, UnicodeDecodeError) as e:
    raise InputError(
      f'{path}: cannot read the labels file ({e}); '
      'pass a UTF-8 text file with one class name per line'
    ) from None
  if len(names) != num_classes:
    raise InputError(
      f'{path}: {len(names)} names for a head of {num_classes} classes; '
      "pass one name per class, in the head's order"
    )
  return names


def dataset_class_names(path: str, why: Optional[list] = None) -> Optional[List[str]]:
  """Class names of the dataset a workdir was trained on, if it can be opened here; else None,
  and the reason appended to `why` (when given)."""
  from vit_jax import workdir

  dataset = workdir.recorded(path, 'dataset')
  if not dataset:
    return None
  from vit_jax.data import pipeline

  config = data_config()
  config.dataset = dataset
  try:
    # What the scan of a training folder logs (images left out, corrupt) is about training,
    # not the images a command is given.
    with _warnings_hidden():
      names = pipeline.split_source(config, 'train').class_names
  except (DataError, OSError) as e:
    if why is not None:
      why.append(f'its dataset {dataset} does not open here ({e})')
    return None
  if not names and why is not None:
    why.append(f'its dataset {dataset} names no classes')
  return list(names) if names else None


@contextlib.contextmanager
def _warnings_hidden():
  logger = logging.getLogger()
  level = logger.level
  logger.setLevel(logging.ERROR)
  try:
    yield
  finally:
    logger.setLevel(level)


_PREDICT_BATCH = 16


def predict(loaded: LoadedModel, files: Sequence[str], k: int = 5, *, unreadable=None) -> tuple:
  """(indices [B, k], probabilities [B, k]) for image files: softmax of the logits.

  An unreadable file raises InputError; with a list as `unreadable`, it is
  appended there as (path, reason) instead and left out of the results.
  """
  model = loaded.model
  apply = jax.jit(
    lambda p, x: model.apply({'params': p}, on_device.normalise(x), train=False),
    compiler_options=hardware.compiler_options(jax.devices()),
  )
  indices, probs = [], []
  for start in range(0, len(files), _PREDICT_BATCH):
    images = []
    for f in files[start : start + _PREDICT_BATCH]:
      try:
        images.append(read_pixels(f, loaded.spec.image_size, loaded.preprocessing))
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


def evaluate(loaded: LoadedModel, data_config, split: str, batch_sharding, source=None) -> dict:
  """{'top1', 'top5' (single-label), 'examples'} of `loaded` on a whole dataset split (`source`:
  that split, where the caller opened it)."""
  from vit_jax.data import pipeline  # TensorFlow: imported when a dataset is read

  transform = loaded.preprocessing
  pp = pipeline.Preprocessing.of(data_config, transform)
  source = source or pipeline.split_source(data_config, split, pp)
  if transform is not None and data_config.pp.resize:
    raise InputError(
      f"--resize={data_config.pp.resize}: the checkpoint evaluates by its weights' own "
      f'transform ({transform.line()}); leave --resize out'
    )
  if loaded.model.num_classes != source.num_classes:
    raise InputError(
      f"{data_config.dataset} has {source.num_classes} classes, the checkpoint's head "
      f'{loaded.model.num_classes}; evaluate a checkpoint fine-tuned on it'
    )
  model, multi_label = loaded.model, source.multi_label

  def counts_fn(params, batch):
    logits = model.apply({'params': params}, on_device.normalise(batch['image']), train=False)
    return metrics.classification_counts(logits, batch['label'], batch['mask'], multi_label)

  options = hardware.compiler_options(batch_sharding.mesh.devices.flat)
  counts_fn = jax.jit(counts_fn, compiler_options=options)

  params = jax.device_put(loaded.params, sharding.replicated(batch_sharding.mesh))
  batches = pipeline.make_eval_iterator(data_config, batch_sharding, split=split, raw=True, pp=pp)
  result = metrics.accuracy(counts_fn, params, batches)
  top5 = result.pop('accuracy_top5', None)
  return {
    'top1': result['accuracy'],
    'examples': result['examples'],
    **({'top5': top5} if top5 is not None else {}),
  }


def evaluate_checkpoint(
  loaded: LoadedModel, data_config, split: str, *, warn=print, source=None
) -> dict:
  """`evaluate` on one device mesh, with ImageNet's ReaL labels (Beyer et al. 2020) when
  `imagenet2012_real` is prepared in the same data directory; `warn` says why they are not.
  `source`: the split, where the caller opened it (`pipeline.split_source`)."""
  batch_sharding = sharding.batch_sharding(sharding.make_mesh())
  result = evaluate(loaded, data_config, split, batch_sharding, source)
  if data_config.dataset == 'imagenet2012':
    real = data_config()
    real.update(data_config.to_dict())
    real.dataset = 'imagenet2012_real'
    try:
      result['real_top1'] = evaluate(loaded, real, 'test', batch_sharding)['top1']
    except DataError as e:
      warn(f'ReaL labels not evaluated: {e}')
  return result
