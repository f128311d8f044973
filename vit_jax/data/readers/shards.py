"""JFT-style multi-label shards: the schema, a reader and a writer.

A shard directory holds `info.json` (classes, splits and their files) and
TFRecord or ArrayRecord files of `tf.train.Example`s (`image/encoded`,
`image/labels` as a list of ints, `image/id`). `python -m vit_jax.jft` converts a
folder or a CSV into one.

The reader claims paths of shard directories and `imagenet21k`: the shards
`python -m vit_jax.prepare imagenet21k` writes in <tfds_data_dir>/imagenet21k.
"""

import concurrent.futures
import json
import logging
import os
from typing import List, Optional, Sequence, Tuple

import numpy as np

from vit_jax.core import files
from vit_jax.data import example_proto
from vit_jax.data import records
from vit_jax.data import sources
from vit_jax.data.readers import folder
from vit_jax.data.readers import reader
from vit_jax.data.readers import tfds
from vit_jax.data.sources import DataError

FORMAT = 'vit_jax.shards/1'
FORMATS = {'tfrecord': 'tfrecord', 'array_record': 'array_record'}


def is_shard_dir(path: str) -> bool:
  return files.exists(os.path.join(path, 'info.json'))


def read_info(root: str) -> dict:
  path = os.path.join(root, 'info.json')
  try:
    with files.open_file(path) as f:
      info = json.load(f)
  except (OSError, ValueError) as e:
    raise DataError(f'{path}: unreadable shard info ({e}); re-run python -m vit_jax.jft') from None
  if info.get('format') != FORMAT:
    raise DataError(
      f'{path}: format {info.get("format")!r} is not {FORMAT!r}; re-run python -m vit_jax.jft'
    )
  return info


def parse_example(serialized: bytes, num_classes: int):
  """A shard record -> (encoded image bytes, multi-hot float32 [K])."""
  features = example_proto.parse(serialized)
  hot = np.zeros(num_classes, np.float32)
  ids = np.asarray(features.get('image/labels', []), np.int64)
  if ids.size and (ids.min() < 0 or ids.max() >= num_classes):  # dropped, it would be unlearnt
    bad = int(ids.min() if ids.min() < 0 else ids.max())
    raise DataError(
      f'image/labels: a label {bad} outside the {num_classes} classes of info.json; '
      're-create the shards (python -m vit_jax.jft)'
    )
  hot[ids] = 1.0
  return features['image/encoded'][0], hot


def open_split(root: str, split: str) -> sources.Source:
  """The Source of split NAME or NAME[start:stop] of a shard directory."""
  info = read_info(root)
  name, start, stop = sources.parse_split(split)
  if name not in info['splits']:
    raise DataError(
      f'{root}: no split {name!r} in info.json (has '
      f'{", ".join(sorted(info["splits"]))}); pass one of those'
    )
  paths = [(os.path.join(root, f['file']), 0, f['num_examples']) for f in info['splits'][name]]
  for path, _, _ in paths:
    if not files.exists(path):
      raise DataError(f'{path}: shard listed in info.json is missing; re-run python -m vit_jax.jft')
  k = int(info['num_classes'])
  source = sources.record_source(
    f'{root} {name}',
    records.open_records(paths, info.get('file_format', 'tfrecord')),
    lambda r: parse_example(r, k),
    k,
    class_names=info.get('class_names'),
    multi_label=True,
  )
  return reader.sliced(source, start, stop)


def _claims(dataset: str) -> bool:
  # A local folder named imagenet21k is that folder, as any other path.
  if reader.names_a_path(dataset):
    return is_shard_dir(os.path.expanduser(dataset))
  return dataset == 'imagenet21k'


def _open_dataset_split(dataset: str, split: str, options: reader.Options) -> sources.Source:
  if dataset != 'imagenet21k':
    return open_split(os.path.expanduser(dataset), split)
  root = os.path.join(tfds.data_dir(options.tfds_data_dir), 'imagenet21k')
  if not is_shard_dir(root):
    manual = options.tfds_manual_dir or '<tfds_manual_dir>'
    raise DataError(
      f'imagenet21k: no converted shards in {root}; convert the extracted '
      f'release with python -m vit_jax.jft --folder {manual} --out {root} '
      '(docs/data.md: ImageNet-21k)'
    )
  return open_split(root, split)


READER = reader.Reader(
  'shards',
  claims=_claims,
  defaults=lambda dataset, options: reader.Defaults(),
  open_split=_open_dataset_split,
)


# ---------------------------------------------------------------------------
# Converter.


def examples_from_folder(root: str) -> Tuple[List[Tuple[str, List[int]]], List[str]]:
  """ROOT/<class>/<image> -> ([(path, [label])], class names)."""
  names = folder.subfolders(root)
  if not names:
    raise DataError(f'{root}: no class folders; expected {root}/<class>/<image>')
  paths, labels = folder.labelled_images(root, names)
  examples = [(path, [label]) for path, label in zip(paths, labels)]
  return examples, names


def examples_from_csv(path: str) -> List[Tuple[str, List[int]]]:
  """Lines `image_path,id;id;...`; relative paths are relative to the CSV's folder."""
  base = os.path.dirname(os.path.abspath(path))
  examples = []
  with open(path, 'rb') as f:  # paths as bytes, decoded as the file system's names are
    data = f.read()
  if b'\0' in data:
    raise DataError(f'{path}: not text (a NUL byte); pass a CSV of lines "path,label_id;..."')
  for number, line in enumerate(data.splitlines(), start=1):
    line = os.fsdecode(line.strip())
    if not line:
      continue
    image, _, labels = line.rpartition(',')
    try:
      ids = [int(x) for x in labels.split(';') if x.strip()]
    except ValueError:
      ids = []
    if not image or not ids or min(ids) < 0:
      raise DataError(
        f'{path}:{number}: expected "path,label_id;label_id;..." with ids >= 0, got {line[:80]!r}'
      )
    examples.append((os.path.join(base, image), ids))
  if not examples:
    raise DataError(f'{path}: no examples; expected lines "path,label_id;label_id;..."')
  return examples


def _serialize(data: bytes, labels: Sequence[int], key: str) -> bytes:
  """A shard record: the Example (image/encoded, image/labels, image/id).

  The id is the key's bytes as the file system gives them (`os.fsencode`): a file name
  that is not UTF-8 text keeps its exact bytes."""
  return example_proto.serialize(
    {
      'image/encoded': data,
      'image/labels': np.asarray(labels, np.int64),
      'image/id': os.fsencode(key),
    }
  )


def _writer(path: str, file_format: str):
  if file_format == 'array_record':
    from array_record.python import array_record_module

    return array_record_module.ArrayRecordWriter(path, 'group_size:1')
  return records.TFRecordWriter(path)


def write_shards(
  examples,
  out: str,
  split: str,
  *,
  num_classes: int,
  class_names: Optional[Sequence[str]] = None,
  num_shards: int = 1,
  file_format: str = 'tfrecord',
  corrupt_images: str = 'skip',
  seed: int = 0,
) -> dict:
  """Writes `examples` [(path, [label ids])] as split `split` of shard dir `out`.

  Examples are shuffled (seeded) so each shard and each host's share mixes
  classes. Returns the updated info dict (also written to out/info.json).
  """
  if corrupt_images not in ('skip', 'fail'):
    raise DataError(f"corrupt_images={corrupt_images!r}: use 'skip' or 'fail'")
  info = _info_to_extend(out, examples, num_classes, class_names, file_format)
  good, bad = _decodable(examples, corrupt_images)
  order = np.random.default_rng(seed).permutation(len(good))
  num_shards = max(1, min(num_shards, len(good)))
  written = []
  for shard, part in enumerate(np.array_split(order, num_shards)):
    name = f'{split}-{shard:05d}-of-{num_shards:05d}.{FORMATS[file_format]}'
    writer = _writer(os.path.join(out, name), file_format)
    for i in part:
      path, labels = good[i]
      with open(path, 'rb') as f:
        writer.write(_serialize(f.read(), labels, path))
    writer.close()
    written.append({'file': name, 'num_examples': int(len(part))})
  info['splits'][split] = written
  try:
    text = json.dumps(info, indent=1, ensure_ascii=False).encode('utf-8')
  except UnicodeEncodeError:  # a class name that is not UTF-8 text: \u escapes, lossless
    text = json.dumps(info, indent=1).encode()
  with open(os.path.join(out, 'info.json'), 'wb') as f:
    f.write(text)
  logging.info(
    '%s: wrote %d examples of split %s in %d shards (%d corrupt skipped)',
    out,
    len(good),
    split,
    num_shards,
    len(bad),
  )
  return info


def _info_to_extend(out, examples, num_classes, class_names, file_format) -> dict:
  """The info.json of shard dir `out` (made if new) that a split of `examples` goes into."""
  if file_format not in FORMATS:
    raise DataError(f'file format {file_format!r}: use tfrecord or array_record')
  too_big = [(p, l) for p, l in examples if max(l) >= num_classes]
  if too_big:
    raise DataError(
      f'{too_big[0][0]}: label {max(too_big[0][1])} >= num_classes={num_classes}; '
      'raise --num_classes'
    )
  os.makedirs(out, exist_ok=True)
  if not is_shard_dir(out):
    return {
      'format': FORMAT,
      'file_format': file_format,
      'num_classes': num_classes,
      'class_names': list(class_names) if class_names else None,
      'splits': {},
    }
  info = read_info(out)
  if (
    info['num_classes'] != num_classes
    or info['file_format'] != file_format
    or (class_names and info['class_names'] and list(class_names) != info['class_names'])
  ):
    raise DataError(f'{out}: holds shards with other classes or format; write to a new folder')
  return info


def _decodable(examples, corrupt_images):
  """(examples whose image decodes, [(path, why)] of the others); 'fail' stops at the first."""
  with concurrent.futures.ThreadPoolExecutor(8) as pool:
    problems = list(pool.map(folder.check_image, [p for p, _ in examples]))
  bad = [(p, why) for (p, _), why in zip(examples, problems) if why]
  if bad and corrupt_images == 'fail':
    raise DataError(
      f'{bad[0][0]}: corrupt or truncated image ({bad[0][1]}); replace or delete '
      'it, or pass --corrupt_images=skip'
    )
  if bad:
    logging.warning('skipped %d corrupt image(s): %s', len(bad), ', '.join(p for p, _ in bad[:20]))
  return [e for e, why in zip(examples, problems) if not why], bad
