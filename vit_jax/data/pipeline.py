"""Training and evaluation batches as global `jax.Array`s: the data interface.

    info = pipeline.get_info(config)
    train_it = pipeline.make_train_iterator(config, sharding)          # infinite
    batch = next(train_it)  # {'image': f32 [B, crop, crop, 3] in [-1, 1], 'label': ...}
    state = train_it.get_state()                                              # {'step': 123, ...}
    resumed = pipeline.make_train_iterator(config, sharding, state=state)
    for batch in pipeline.make_eval_iterator(config, sharding):        # + 'mask'

One implementation delivers them for every kind of data (`host.py`: NumPy,
libjpeg-turbo, OpenCV, PIL and threads; no TensorFlow).

Batches cross to the devices as uint8 pixels. With `raw=True` they stay so
({'image': uint8, 'label': int32 [B] or multi-hot [B, K], under Mixup 'mixup':
f32 [B], each example's weight}) for a jitted step that prepares them itself
(`on_device.prepare`: what the trainer, evaluate and few-shot do, one pass
over the batch fused into the step); otherwise the iterator prepares them on
the devices with the same function ([-1, 1] floats, Mixup's soft labels).

Order. The example stream is epoch after epoch of the split, each epoch a
seeded permutation (`order.index_shuffle`, computed per index; TensorFlow's
`index_shuffle`, bit for bit, fixed for 2^k + 1 examples); global step s takes the
stream positions [s*B, (s+1)*B), and process p of P reads only its share
[s*B + p*b, s*B + (p+1)*b), b = B / P. Each example's augmentation is seeded
by (seed, its position). So the global batch
at step s is a pure function of (seed, s), whatever the number of processes:
the iterator's state is the step number, restoring it costs nothing however
late in training, and a run may resume on another number of hosts.

Evaluation reads every example of the split exactly once: each process pads
its part to the same number of batches and marks padding with mask = 0.
"""

import dataclasses
import functools
from typing import Any, Iterator, Optional, Sequence, Tuple

import jax
import numpy as np

from vit_jax.configs import schema
from vit_jax.data import datasets
from vit_jax.data import host
from vit_jax.data import multicrop
from vit_jax.data import naflex
from vit_jax.data import on_device
from vit_jax.data import order
from vit_jax.data import sources
from vit_jax.data.sources import DataError


@dataclasses.dataclass(frozen=True)
class DatasetInfo:
  name: str
  num_classes: int
  num_train: int  # examples in the train split as configured (after slicing)
  num_test: int  # examples in the test split
  multi_label: bool  # True for JFT-style data (sigmoid loss, multi-hot labels)
  class_names: Optional[Sequence[str]]


def get_info(config, pp: Optional['Preprocessing'] = None) -> DatasetInfo:
  """The dataset of `config` (`pp`: its preprocessing, when the caller resolved it)."""
  pp = pp or Preprocessing.of(config)
  train, test = _open(config, pp.split('train')), _open(config, pp.split('test'))
  return DatasetInfo(
    config.dataset,
    train.num_classes,
    train.num_examples,
    test.num_examples,
    train.multi_label,
    train.class_names,
  )


# ---------------------------------------------------------------------------
# Config -> settings.


@dataclasses.dataclass(frozen=True)
class Preprocessing:
  """The data half of a run, resolved once from its config (`Preprocessing.of`) and handed to
  the iterators, as a `ModelSpec` is to the model: the dataset's defaults filled in where the
  config leaves a choice to them, the splits, and the weights' evaluation transform."""

  crop: int
  resize: Optional[int]
  flip: bool
  inception_crop: bool
  area_min: float
  randaug_layers: int
  randaug_magnitude: float
  mixup: float
  train_split: str = 'train'  # split expressions: pp.train / pp.test or the dataset's default
  test_split: str = 'test'
  defaults: str = ''  # where the dataset's defaults come from, and the fields the config set
  naflex_tokens: Tuple[int, ...] = ()  # NaFlex's budgets, for the description
  # Evaluation by the weights' own transform (`configs.timm_weights.Preprocessing`, at `crop`
  # px) instead of the official resize: a checkpoint of a family converted from timm.
  transform: Any = None
  # The train transform in words where the task brings its own (self-distillation's multi-crop,
  # `data.multicrop`); None: the fields above.
  train_line: Optional[str] = None

  @classmethod
  def of(cls, config, transform=None) -> 'Preprocessing':
    """The preprocessing of a run's (or a command's) data config; the data fields' rules
    checked, as the trainer checks them (`program.validate`), for the callers that skip it."""
    if config.get('dataset') is None:
      raise DataError(
        'config.dataset is not set: pass --config.dataset=NAME_OR_DIR (a TFDS name '
        'such as imagenet2012, an image folder, or a directory of JFT-style shards)'
      )
    schema.validate_data(config)
    pp, base = config.pp, datasets.defaults(config.dataset, config.tfds_data_dir)
    pick = lambda value, default: default if value is None else value  # noqa: E731
    chosen = [name for name in ('flip', 'inception_crop', 'area_min') if pp[name] is not None]
    return cls(
      crop=int(pp.crop),
      resize=pp.resize,
      flip=bool(pick(pp.flip, base.flip)),
      inception_crop=bool(pick(pp.inception_crop, base.inception_crop)),
      area_min=float(pick(pp.area_min, base.area_min)),
      randaug_layers=int(pp.randaug_layers),
      randaug_magnitude=float(pp.randaug_magnitude),
      mixup=float(pp.mixup),
      train_split=pp.train or base.train,
      test_split=pp.test or base.test,
      defaults=f'dataset defaults ({base.why})' + (f', set: {", ".join(chosen)}' if chosen else ''),
      naflex_tokens=tuple(config.get('naflex_tokens') or ()),
      transform=None if transform is None else transform.at(int(pp.crop)),
      train_line=(
        multicrop.train_line(config, bool(pick(pp.flip, base.flip)))
        if config.get('task') == 'dino'
        else None
      ),
    )

  def split(self, split: str) -> str:
    """'train' / 'test' -> their split expressions; others as given."""
    return {'train': self.train_split, 'test': self.test_split}.get(split, split)

  def describe(self) -> str:
    """The preprocessing in one line, with where its defaults come from."""
    tokens = self.naflex_tokens
    if tokens:  # NaFlex (data.naflex): the crop keeps its aspect ratio, sized by a token budget
      budgets = (
        f'a budget of {tokens[0]} tokens'
        if len(tokens) == 1
        else (f'a budget drawn from {", ".join(map(str, tokens))} tokens')
      )
      box = (
        f'inception crop (area {self.area_min:g}-1)' if self.inception_crop else 'the whole image'
      )
      crop = f'{box} at its own aspect ratio, resized to {budgets} (NaFlex)'
    elif self.inception_crop:
      crop = f'inception crop (area {self.area_min:g}-1) to {self.crop} px'
    else:
      crop = f'resize to {self.crop} px'
    train = [crop, 'horizontal flip' if self.flip else 'no flip']
    if self.randaug_layers:
      train.append(f'RandAugment {self.randaug_layers}x{self.randaug_magnitude:g}')
    if self.mixup:
      train.append(f'Mixup {self.mixup:g}')
    if self.train_line:
      train = [self.train_line]
    evaluation = (
      f'resize to {self.resize}, centre crop {self.crop} px'
      if self.resize
      else f'resize to {self.crop} px'
    )
    if self.transform is not None:
      evaluation = self.transform.line()
    return (
      f'preprocessing: train {", ".join(train)}; eval {evaluation}. From: {self.defaults}; '
      'change with --config.pp.flip, .area_min, .inception_crop (docs/data.md)'
    )


def split_source(config, split: str, pp: Optional[Preprocessing] = None) -> sources.Source:
  """One split's examples (their count, classes, kind of labels) without opening the others:
  evaluation needs no train split."""
  return _open(config, (pp or Preprocessing.of(config)).split(split))


def _open(config, expression: str) -> sources.Source:
  return datasets.open_split(
    config.dataset,
    expression,
    config.tfds_data_dir,
    config.tfds_manual_dir,
    config.corrupt_images,
    config.get('allow_missing_classes', False),
  )


def _local_batch(batch: int, what: str, sharding, process_count: int) -> int:
  if batch % process_count:
    raise DataError(
      f'{what}={batch} is not divisible by the {process_count} processes; '
      f'use a multiple of {process_count}'
    )
  if sharding is not None:
    try:
      sharding.shard_shape((batch,))
    except ValueError:
      raise DataError(
        f'{what}={batch} does not split evenly over the devices of the batch '
        f'axes of mesh {dict(sharding.mesh.shape)}; use a multiple of their '
        'product'
      ) from None
  return batch // process_count


def _train_batches(config, source, pp, local_batch, step, model_spec):
  """Process-local NumPy train batches from `step` on: images, or NaFlex's packed patches of
  `model_spec`'s size at its token budgets."""
  where = dict(
    local_batch=local_batch,
    start_step=step,
    keys=order.keys(int(config.seed)),
    process_index=jax.process_index(),
    process_count=jax.process_count(),
    num_threads=config.get('input_threads', 0),
  )
  if model_spec is not None and model_spec.naflex_tokens:  # each image at its aspect ratio
    return naflex.TrainBatches(source, pp, model_spec.naflex_tokens, model_spec.patch_size, **where)
  if config.get('task') == 'dino':  # self-distillation: global and local crops, block masks
    settings = multicrop.Settings.of(config, model_spec.patch_size, pp.flip)
    multicrop.check(settings, source.num_examples, int(config.batch), source.name)
    return multicrop.TrainBatches(source, settings, **where)
  return host.TrainBatches(source, pp, **where)


# ---------------------------------------------------------------------------
# Host -> device.


def _to_device(batch, sharding):
  if sharding is None:
    return batch
  return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in batch.items()}


@functools.lru_cache(maxsize=16)
def _prepare_fn(num_classes: int, on_host: bool):
  """`on_device.prepare`, jitted: on the batch's devices, or with host (NumPy) batches in and
  out (`sharding=None`: the iterators then deliver NumPy arrays)."""
  fn = jax.jit(functools.partial(on_device.prepare, num_classes=num_classes))
  return (lambda batch: jax.device_get(fn(batch))) if on_host else fn


class TrainIterator:
  """Infinite iterator of global train batches with a restorable position.

  `get_state()` is {'step': batches handed out so far, ...}; pass it back as
  `make_train_iterator(..., state=...)` to continue with exactly the next batch.
  """

  def __init__(self, batches, sharding, step, prefetch, fingerprint, prepare=None):
    # Process-local NumPy batches from `step` on, `prefetch` of them on their way to the devices.
    on_devices = (_to_device(batch, sharding) for batch in batches)
    self._batches = host.ahead_of(on_devices, max(0, int(prefetch)))
    self._step = step  # batches handed to the caller
    self._fingerprint = fingerprint
    self._prepare = prepare  # None: batches as they cross to the devices (raw)

  def __iter__(self):
    return self

  def __next__(self):
    batch = next(self._batches)
    self._step += 1
    return batch if self._prepare is None else self._prepare(batch)

  def get_state(self) -> dict:
    return {'step': self._step, **self._fingerprint}


def make_train_iterator(
  config, sharding, *, state=None, raw=False, model_spec=None, pp=None
) -> TrainIterator:
  """Global train batches of `config.batch` (see module docstring); `raw`: uint8, for a step
  that prepares them (`on_device.prepare`); `model_spec`: the run's model
  (`configs.model_spec.ModelSpec`), whose NaFlex token budgets pack patches instead; `pp`:
  the run's `Preprocessing` (None: resolved from `config`)."""
  pp = pp or Preprocessing.of(config)
  source = _open(config, pp.split('train'))
  local_batch = _local_batch(config.batch, 'batch', sharding, jax.process_count())
  if source.num_examples < 1:
    raise DataError(f'{source.name}: the train split is empty; check pp.train')
  if pp.mixup > 0 and local_batch % 2:
    raise DataError(f'mixup pairs examples: the per-process batch ({local_batch}) must be even')
  fingerprint = {
    'seed': int(config.seed),
    'batch': int(config.batch),
    'dataset': str(config.dataset),
  }
  step = 0
  if state:
    for key, value in fingerprint.items():
      if key in state and state[key] != value:
        raise DataError(
          f'iterator state has {key}={state[key]!r} but the config gives '
          f'{value!r}; restore with the same config or pass '
          f"state={{'step': {state.get('step', 0)}}} to start there anyway"
        )
    step = int(state['step'])
  batches = _train_batches(config, source, pp, local_batch, step, model_spec)
  prepare = None if raw else _prepare_fn(source.num_classes, sharding is None)
  return TrainIterator(batches, sharding, step, config.prefetch, fingerprint, prepare)


@functools.lru_cache(maxsize=8)
def _cached_host_eval(source, pp, local_batch, process_index, process_count, threads):
  """A memo for eval passes whose uint8 images fit `eval_cache_mb` (see below)."""
  return list(_host_eval(source, pp, local_batch, process_index, process_count, threads))


def _host_eval(source, pp, local_batch, process_index, process_count, threads):
  positions = functools.partial(
    order.eval_positions, source.num_examples, local_batch, process_index, process_count
  )
  return host.eval_batches(source, pp, positions_fn=positions, num_threads=threads)


def _eval_batches(config, source, pp, local_batch):
  """NumPy eval batches {'image' uint8, 'label', 'mask'} of one pass."""
  p, n_proc = jax.process_index(), jax.process_count()
  threads = int(config.get('input_threads', 0))
  total = order.eval_steps(source.num_examples, local_batch, n_proc) * local_batch
  if total * pp.crop * pp.crop * 3 <= config.eval_cache_mb * 2**20:
    batches = _cached_host_eval(source, pp, local_batch, p, n_proc, threads)
  else:
    batches = _host_eval(source, pp, local_batch, p, n_proc, threads)
  for batch in batches:
    mask = batch['mask']
    if source.mask_empty_labels:
      mask = mask * (batch['label'].sum(axis=-1) > 0).astype(np.float32)
    yield {'image': batch['image'], 'label': batch['label'], 'mask': mask}


def make_eval_iterator(config, sharding, split='test', *, raw=False, pp=None) -> Iterator[dict]:
  """One pass over `split` ('test', 'train' or a split expression), every example once;
  `raw`: uint8 images, for a step that prepares them (`on_device.prepare`); `pp`: the
  `Preprocessing` (with the weights' own evaluation transform, where a checkpoint has one;
  None: resolved from `config`, the official resize)."""
  pp = pp or Preprocessing.of(config)
  source = _open(config, pp.split(split))
  prepare = None if raw else _prepare_fn(source.num_classes, sharding is None)
  local_batch = _local_batch(config.batch_eval, 'batch_eval', sharding, jax.process_count())
  batches = _eval_batches(config, source, pp, local_batch)
  for batch in host.ahead_of((_to_device(b, sharding) for b in batches), config.prefetch):
    yield batch if prepare is None else prepare(batch)
