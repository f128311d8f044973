"""What the paper trains and evaluates on: dataset presets in one table.

A preset names the TFDS dataset, its default train/test splits, the number of
classes, the paper's fine-tuning steps (Appendix B.1.1, Table 4) and the
augmentation that suits it. `config.pp.train` / `config.pp.test` override the
splits; `config.pp.flip` / `inception_crop` / `area_min` override the
augmentation when not None.

VTAB-1k (Zhai et al. 2019) tasks are named `vtab/<task>`; each offers the
protocol's splits `train800`, `val200`, `train800val200` (the 1000 training
examples of the final runs) and `test`. Their "train"/"val" are the task's own
splits from the VTAB definition; train800 / val200 are the first 800 / 200
examples of those.
"""

import dataclasses
from typing import Callable, Mapping, Optional, Sequence, Tuple

import numpy as np

# A named split of a preset: TFDS split expressions, each with an optional
# "first n examples" limit, concatenated in order.
SplitParts = Tuple[Tuple[str, Optional[int]], ...]


@dataclasses.dataclass(frozen=True)
class Preset:
  tfds_name: str
  train: str
  test: str
  num_classes: Optional[int] = None  # None = from the TFDS label feature
  label_key: str = 'label'
  # Builds the label from the parsed example ({feature name: values}, nested
  # names joined by '/'); None = label_key.
  label_fn: Optional[Callable] = None
  multi_label: bool = False
  # Evaluation leaves out examples whose label set is empty (ReaL protocol).
  mask_empty_labels: bool = False
  named_splits: Mapping[str, SplitParts] = dataclasses.field(default_factory=dict)
  flip: bool = True
  inception_crop: bool = True
  area_min: float = 0.05
  manual: bool = False  # needs files in tfds_manual_dir
  manual_files: Sequence[str] = ()


def _real_labels(example, num_classes=1000):
  """ImageNet ReaL (Beyer et al. 2020): the set of correct labels, multi-hot."""
  hot = np.zeros(num_classes, np.float32)
  hot[np.asarray(example['real_label'], np.int64)] = 1.0
  return hot


def _vtab_splits(train, val, test):
  return {
    'train800': ((train, 800),),
    'val200': ((val, 200),),
    'train800val200': ((train, 800), (val, 200)),
    'test': ((test, None),),
    'train': ((train, None),),
    'val': ((val, None),),
  }


def _bucket(value, thresholds):
  """Index of the last threshold below `value` (VTAB's distance bins)."""
  return int(np.sum(np.asarray(thresholds, np.float32) < np.float32(value))) - 1


def _clevr_count(ex):
  return len(ex['objects/size']) - 3


def _clevr_distance(ex):
  depth = np.asarray(ex['objects/pixel_coords'], np.float32).reshape(-1, 3)[:, 2]
  return _bucket(depth.min(), [0.0, 8.0, 8.5, 9.0, 9.5, 10.0, 100.0])


def _kitti_vehicle_distance(ex):
  # Car, Van, Truck are types 0-2; "no vehicle" lands in the last bin.
  is_vehicle = np.asarray(ex['objects/type'], np.int64) < 3
  z = np.asarray(ex['objects/location'], np.float32).reshape(-1, 3)[is_vehicle, 2]
  return _bucket(np.concatenate([z, [1000.0]]).min(), [-100.0, 8.0, 20.0, 999.0])


def _binned(key, original, classes):
  def fn(ex):
    return int(np.float32(ex[key][0]) // np.float32(original / classes))

  return fn


def _vtab(tfds_name, train, val, test, num_classes=None, label_key='label', label_fn=None):
  return Preset(
    tfds_name=tfds_name,
    train='train800val200',
    test='test',
    num_classes=num_classes,
    label_key=label_key,
    label_fn=label_fn,
    named_splits=_vtab_splits(train, val, test),
    # Crops and flips change the answer of the structured tasks
    # (counts, distances, positions, orientations): resize only.
    flip=False,
    inception_crop=False,
  )


_VTAB = {
  # Natural.
  'caltech101': _vtab('caltech101', 'train[:90%]', 'train[90%:]', 'test'),
  'cifar100': _vtab('cifar100', 'train[:90%]', 'train[90%:]', 'test'),
  'dtd': _vtab('dtd', 'train', 'validation', 'test'),
  'oxford_flowers102': _vtab('oxford_flowers102', 'train', 'validation', 'test'),
  'oxford_iiit_pet': _vtab('oxford_iiit_pet', 'train[:80%]', 'train[80%:]', 'test'),
  'sun397': _vtab('sun397/tfds', 'train', 'validation', 'test'),
  'svhn': _vtab('svhn_cropped', 'train[:90%]', 'train[90%:]', 'test'),
  # Specialized.
  'patch_camelyon': _vtab('patch_camelyon', 'train', 'validation', 'test'),
  'eurosat': _vtab('eurosat/rgb', 'train[:60%]', 'train[60%:80%]', 'train[80%:]'),
  'resisc45': _vtab('resisc45', 'train[:60%]', 'train[60%:80%]', 'train[80%:]'),
  'diabetic_retinopathy': _vtab(
    'diabetic_retinopathy_detection/btgraham-300', 'train', 'validation', 'test'
  ),
  # Structured.
  'clevr_count': _vtab(
    'clevr', 'train[:90%]', 'train[90%:]', 'validation', 8, label_fn=_clevr_count
  ),
  'clevr_distance': _vtab(
    'clevr', 'train[:90%]', 'train[90%:]', 'validation', 6, label_fn=_clevr_distance
  ),
  'dmlab': _vtab('dmlab', 'train', 'validation', 'test'),
  'dsprites_location': _vtab(
    'dsprites',
    'train[:80%]',
    'train[80%:90%]',
    'train[90%:]',
    16,
    label_fn=_binned('label_x_position', 32, 16),
  ),
  'dsprites_orientation': _vtab(
    'dsprites',
    'train[:80%]',
    'train[80%:90%]',
    'train[90%:]',
    16,
    label_fn=_binned('label_orientation', 40, 16),
  ),
  'kitti_distance': _vtab(
    'kitti', 'train', 'validation', 'test', 4, label_fn=_kitti_vehicle_distance
  ),
  'smallnorb_azimuth': _vtab(
    'smallnorb', 'train', 'test[:50%]', 'test[50%:]', 18, label_key='label_azimuth'
  ),
  'smallnorb_elevation': _vtab(
    'smallnorb', 'train', 'test[:50%]', 'test[50%:]', 9, label_key='label_elevation'
  ),
}

VTAB_TASKS = tuple(_VTAB)

_IMAGENET_TARS = ('ILSVRC2012_img_train.tar', 'ILSVRC2012_img_val.tar')

# Datasets that ship inside the package (scikit-learn's UCI digits): no download, no preset.
BUILTIN = ('digits',)

PRESETS = {
  'imagenet2012': Preset(
    'imagenet2012', 'train[:99%]', 'validation', 1000, manual=True, manual_files=_IMAGENET_TARS
  ),
  # ReaL labels of the ImageNet validation images; evaluation only.
  'imagenet2012_real': Preset(
    'imagenet2012_real',
    'validation',
    'validation',
    1000,
    label_fn=_real_labels,
    multi_label=True,
    mask_empty_labels=True,
    manual=True,
    manual_files=_IMAGENET_TARS[1:],
  ),
  'cifar10': Preset('cifar10', 'train[:98%]', 'test', 10),
  'cifar100': Preset('cifar100', 'train[:98%]', 'test', 100),
  'oxford_iiit_pet': Preset('oxford_iiit_pet', 'train', 'test', 37),
  'oxford_flowers102': Preset('oxford_flowers102', 'train+validation', 'test', 102),
  **{f'vtab/{name}': preset for name, preset in _VTAB.items()},
}
