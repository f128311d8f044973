"""A split as random-access examples: the one abstraction every dataset maps to.

The pipeline (`vit_jax.input_pipeline`) asks a `Source` for examples by index,
so the batch at any step is a pure function of (seed, step) and no reader
keeps hidden position state. Three kinds cover every format:

- arrays in memory (the built-in digits): `read` gathers decoded images;
- files on disk (image folders): `read` gathers paths, `parse` reads a file;
- records (TFRecord / ArrayRecord shards, TFDS): `read` fetches serialized
  records by index, `parse` deserialises one into an encoded image and label.
"""

import dataclasses
import re
from typing import Callable, Optional, Sequence

import numpy as np


class DataError(ValueError):
  """Bad data or data config; the message is one line naming what and what to do."""


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity: memo keys
class Source:
  """One split; examples are addressed by index in [0, num_examples)."""

  name: str  # for messages, e.g. 'cifar10 train[:98%]' or a folder path
  num_examples: int
  num_classes: int
  multi_label: bool
  class_names: Optional[Sequence[str]]
  # int64 [b] indices -> dict of [b] tensors (TF graph). For `decoded` sources
  # it holds 'image' uint8 [b, h, w, 3] and 'label'; otherwise what `parse` takes.
  read: Callable
  # One element of `read`'s output -> {'image': encoded bytes, 'label': ...}.
  parse: Optional[Callable] = None
  decoded: bool = False
  # index -> a name for error messages (file path, shard and record).
  describe: Callable[[int], str] = str
  mask_empty_labels: bool = False
  # The same without TensorFlow, for the host pipeline (`vit_jax.data.host`):
  # int64 [b] indices -> (decoded uint8 [b, h, w, 3] if `decoded`, else a list of
  # encoded bytes or file paths; labels [b] or multi-hot [b, K]). None: tf.data only.
  fetch: Optional[Callable] = None


def array_source(name, images, labels, num_classes, class_names=None):
  """Decoded uint8 images [N, h, w, 3] and int labels [N] held in memory."""
  images = np.asarray(images, np.uint8)
  labels = np.asarray(labels, np.int32)
  if images.ndim != 4 or images.shape[-1] != 3 or len(images) != len(labels):
    raise DataError(
      f'{name}: in-memory images must be [N, h, w, 3] with N labels, '
      f'got {images.shape} and {labels.shape}'
    )

  def read(idx):
    import tensorflow as tf

    return {'image': tf.gather(images, idx), 'label': tf.gather(labels, idx)}

  return Source(
    name,
    len(images),
    num_classes,
    False,
    class_names,
    read,
    decoded=True,
    describe=lambda i: f'{name}[{i}]',
    fetch=lambda idx: (images[idx], labels[idx]),
  )


def file_source(name, paths, labels, num_classes, class_names):
  """Encoded image files with int labels (paths as `vit_jax.files` opens them)."""
  path_bytes = np.asarray(paths, dtype=object).astype(bytes)
  labels = np.asarray(labels, np.int32)

  def read(idx):
    import tensorflow as tf

    return {'path': tf.gather(path_bytes, idx), 'label': tf.gather(labels, idx)}

  def parse(example):
    import tensorflow as tf

    return {'image': tf.io.read_file(example['path']), 'label': example['label']}

  return Source(
    name,
    len(paths),
    num_classes,
    False,
    class_names,
    read,
    parse,
    describe=lambda i: str(paths[i]),
    fetch=lambda idx: ([paths[i] for i in idx], labels[idx]),
  )


def record_source(
  name,
  reader,
  parse_record,
  num_classes,
  class_names=None,
  multi_label=False,
  mask_empty_labels=False,
  parse_host=None,
):
  """Serialized records read by index from `reader` (see `vit_jax.records`).

  `parse_record` deserialises one record in TensorFlow; `parse_host`, if given,
  does it in Python (record bytes -> (encoded image, label)) for the host pipeline.
  """

  def fetch_records(idx):
    return np.array(reader.read(idx.tolist()), dtype=object)

  def read(idx):
    import tensorflow as tf

    records = tf.numpy_function(fetch_records, [idx], tf.string, stateful=False)
    return {'record': tf.ensure_shape(records, idx.shape)}

  def parse(example):
    return parse_record(example['record'])

  def fetch(idx):
    idx = np.asarray(idx).tolist()
    parsed = []
    for i, record in zip(idx, reader.read(idx)):
      try:
        parsed.append(parse_host(record))
      except (KeyError, IndexError, ValueError) as e:  # not the schema parse_host expects
        raise DataError(
          f'{reader.describe(i)}: not a record of this format ({type(e).__name__}: {e}); '
          're-create the shards (python -m vit_jax.jft)'
        ) from None
    return [p[0] for p in parsed], np.stack([p[1] for p in parsed])

  return Source(
    name,
    len(reader),
    num_classes,
    multi_label,
    class_names,
    read,
    parse,
    describe=reader.describe,
    mask_empty_labels=mask_empty_labels,
    fetch=fetch if parse_host else None,
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
  fetch = source.fetch
  return dataclasses.replace(
    source,
    name=f'{source.name}{suffix}',
    num_examples=stop - start,
    read=lambda idx: source.read(idx + start),
    describe=lambda i: source.describe(i + start),
    fetch=None if fetch is None else lambda idx: fetch(np.asarray(idx) + start),
  )


def concatenated(sources: Sequence[Source], name: str) -> Source:
  """Sources of the same kind one after another (VTAB's train800 + val200)."""
  import tensorflow as tf

  if len(sources) == 1:
    return dataclasses.replace(sources[0], name=name)
  first = sources[0]
  ends = np.cumsum([s.num_examples for s in sources])
  starts = np.concatenate([[0], ends[:-1]])
  ends_t = tf.constant(ends, tf.int64)
  starts_t = tf.constant(starts, tf.int64)

  def read(idx):
    which = tf.searchsorted(ends_t, idx, side='right')
    outputs = [
      s.read(tf.clip_by_value(idx - starts_t[k], 0, s.num_examples - 1))
      for k, s in enumerate(sources)
    ]
    return tf.nest.map_structure(lambda *parts: _select(which, parts), *outputs)

  def describe(i):
    k = int(np.searchsorted(ends, i, side='right'))
    return sources[k].describe(i - int(starts[k]))

  return dataclasses.replace(
    first, name=name, num_examples=int(ends[-1]), read=read, describe=describe, fetch=None
  )


def _select(which, parts):
  import tensorflow as tf

  result = parts[0]
  for k, part in enumerate(parts[1:], start=1):
    mask = tf.reshape(tf.equal(which, k), [-1] + [1] * (len(part.shape) - 1))
    result = tf.where(mask, part, result)
  return result
