"""A split as random-access examples: the one abstraction every dataset maps to.

The pipeline (`vit_jax.data.pipeline`) asks a `Source` for examples by index,
so the batch at any step is a pure function of (seed, step) and no reader
keeps hidden position state. Three kinds cover every format:

- arrays in memory or memory-mapped (the built-in digits, `.npz` and `.npy`
  datasets, arrays handed over in Python): `fetch` gathers decoded images;
- files (image folders): `fetch` gathers paths, which the pipeline reads;
- records (TFRecord / ArrayRecord shards, prepared TFDS datasets): `fetch`
  reads serialized records by index and parses each into encoded image bytes
  and a label.
"""

import dataclasses
import re
from typing import Callable, Optional, Sequence

import numpy as np

from vit_jax.core.errors import UserError


class DataError(UserError, ValueError):
  """Bad data or data config; the message is one line naming what and what to do."""


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity: memo keys
class Source:
  """One split; examples are addressed by index in [0, num_examples)."""

  name: str  # for messages, e.g. 'cifar10 train[:98%]' or a folder path
  num_examples: int
  num_classes: int
  multi_label: bool
  class_names: Optional[Sequence[str]]
  # int64 [b] indices -> (items, labels [b] or multi-hot [b, K]). Items are
  # decoded uint8 [b, h, w, 3] if `decoded`, else a list of encoded image bytes
  # or file paths.
  fetch: Callable
  decoded: bool = False
  # index -> a name for error messages (file path, shard and record).
  describe: Callable[[int], str] = str
  mask_empty_labels: bool = False


def class_ids(what: str, labels, num_classes: int) -> np.ndarray:
  """int32 class ids from integer `labels`, checked to lie in [0, num_classes) in their own
  dtype first: a cast before the check would renumber a label (2**32 + 3 becomes 3)."""
  labels = np.asarray(labels)
  if labels.size and not np.issubdtype(labels.dtype, np.integer):
    raise DataError(f'{what}: labels of dtype {labels.dtype}; give integer class ids')
  if labels.size:
    low, high = int(labels.min()), int(labels.max())
    if low < 0 or high >= num_classes:
      bad = low if low < 0 else high
      raise DataError(
        f'{what}: a label {bad:,} outside the {num_classes:,} classes (ids 0..{num_classes - 1}); '
        'give class ids 0..K-1 (renumber them: np.unique(y, return_inverse=True)[1])'
      )
  return labels.astype(np.int32)


def array_source(name, images, labels, num_classes, class_names=None):
  """Decoded uint8 images [N, h, w, 3] (or grey: [N, h, w, 1], [N, h, w]) and int labels [N]
  held in memory or memory-mapped (`vit_jax.data.readers.arrays` checks what users hand over)."""
  labels = class_ids(name, labels, num_classes)
  if images.dtype != np.uint8 or images.ndim not in (3, 4) or len(images) != len(labels):
    raise DataError(
      f'{name}: in-memory images must be uint8 [N, h, w, 3] with N labels, '
      f'got {images.dtype} {images.shape} and {labels.shape}'
    )
  grey = images.ndim == 3 or images.shape[-1] == 1

  def fetch(idx):
    pixels = images[idx]
    if grey:  # RGB a batch at a time: the dataset stays a third of the size
      pixels = np.repeat(pixels.reshape(pixels.shape[:3] + (1,)), 3, axis=-1)
    return pixels, labels[idx]

  return Source(
    name,
    len(images),
    num_classes,
    False,
    class_names,
    fetch=fetch,
    decoded=True,
    describe=lambda i: f'{name}[{i}]',
  )


def file_source(name, paths, labels, num_classes, class_names):
  """Encoded image files with int labels (paths as `vit_jax.core.files` opens them)."""
  labels = class_ids(name, labels, num_classes)
  return Source(
    name,
    len(paths),
    num_classes,
    False,
    class_names,
    fetch=lambda idx: ([paths[i] for i in idx], labels[idx]),
    describe=lambda i: str(paths[i]),
  )


def record_source(
  name, reader, parse, num_classes, class_names=None, multi_label=False, mask_empty_labels=False
):
  """Serialized records read by index from `reader` (see `vit_jax.data.records`);
  `parse` turns one record into (encoded image bytes, label)."""

  def fetch(idx):
    idx = np.asarray(idx).tolist()
    parsed = []
    for i, record in zip(idx, reader.read(idx)):
      try:
        parsed.append(parse(record))
      except DataError as e:  # the record parsed, and `parse` said what is wrong with it
        raise DataError(f'{reader.describe(i)}: {e}') from None
      except (KeyError, IndexError, ValueError) as e:  # not the schema `parse` expects
        raise DataError(
          f'{reader.describe(i)}: not a record of this format ({type(e).__name__}: {e}); '
          're-create the file (shards: python -m vit_jax.jft)'
        ) from None
    return [p[0] for p in parsed], np.stack([p[1] for p in parsed])

  return Source(
    name,
    len(reader),
    num_classes,
    multi_label,
    class_names,
    fetch=fetch,
    describe=reader.describe,
    mask_empty_labels=mask_empty_labels,
  )


# ---------------------------------------------------------------------------
# Split slicing for sources that are not TFDS: 'train', 'train[:98%]', 'test[100:]'.

_SLICE = re.compile(r'^(?P<name>[^\[\]]+)(\[(?P<start>-?\d*%?):(?P<stop>-?\d*%?)\])?$')


def parse_split(split: str):
  """'train[10%:50]' -> ('train', '10%', '50'); bounds are None when absent."""
  match = _SLICE.match(str(split).strip())
  if not match:
    raise DataError(f'split {split!r} is not NAME or NAME[start:stop] (e.g. train[:98%])')
  return match['name'], match['start'] or None, match['stop'] or None


def slice_bounds(start, stop, n):
  """Bounds of a `parse_split` slice over n examples; percents round to nearest (as TFDS)."""

  def bound(value, default):
    if value is None:
      return default
    index = round(float(value[:-1]) * n / 100) if value.endswith('%') else int(value)
    return min(max(index + n if index < 0 else index, 0), n)

  return bound(start, 0), bound(stop, n)


def sliced(source: Source, start: int, stop: int, suffix: str) -> Source:
  """The examples [start, stop) of `source`."""
  if (start, stop) == (0, source.num_examples):
    return source
  return dataclasses.replace(
    source,
    name=f'{source.name}{suffix}',
    num_examples=stop - start,
    fetch=lambda idx: source.fetch(np.asarray(idx) + start),
    describe=lambda i: source.describe(i + start),
  )


def concatenated(sources: Sequence[Source], name: str) -> Source:
  """Sources of the same kind one after another (VTAB's train800 + val200, 'train+validation')."""
  if len(sources) == 1:
    return dataclasses.replace(sources[0], name=name)
  ends = np.cumsum([s.num_examples for s in sources])
  starts = ends - [s.num_examples for s in sources]

  def fetch(idx):
    idx = np.asarray(idx, np.int64)
    which = np.searchsorted(ends, idx, side='right')
    items, labels = [None] * len(idx), [None] * len(idx)
    for k in np.unique(which):
      rows = np.flatnonzero(which == k)
      part_items, part_labels = sources[k].fetch(idx[rows] - starts[k])
      for r, item, label in zip(rows, part_items, part_labels):
        items[r], labels[r] = item, label
    if sources[0].decoded:
      items = np.stack(items)
    return items, np.stack(labels)

  def describe(i):
    k = int(np.searchsorted(ends, i, side='right'))
    return sources[k].describe(i - int(starts[k]))

  return dataclasses.replace(
    sources[0], name=name, num_examples=int(ends[-1]), fetch=fetch, describe=describe
  )
