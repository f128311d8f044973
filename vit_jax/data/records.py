"""Random access to records in TFRecord and ArrayRecord files.

TFRecord files have no index, so a reader finds each record's offset by walking
the 12-byte headers of the file once, on first use, and then reads any record
with one positioned read. Only the files a process touches are walked, so a
host of a pod reads the headers of its own share of the shards. ArrayRecord
files carry their own index.

Framing of a TFRecord (the TensorFlow format, `files.tfrecord_frame`): uint64
length, uint32 masked CRC of the length, `length` data bytes, uint32 masked CRC
of the data; all little-endian.
"""

import bisect
import os
import struct
import threading
from typing import List, Sequence, Tuple

import numpy as np

from vit_jax.core import files
from vit_jax.data.sources import DataError

_HEADER = 12
_FOOTER = 4


class TFRecordWriter:
  """Writes records to a new TFRecord file (local or remote)."""

  def __init__(self, path: str):
    self._file = files.open_file(path, 'wb')

  def write(self, data: bytes) -> None:
    self._file.write(files.tfrecord_frame(data))

  def close(self) -> None:
    self._file.close()


def scan_tfrecord(path: str) -> Tuple[np.ndarray, np.ndarray]:
  """(data offsets, data lengths) of every record in a TFRecord file."""
  offsets, lengths = [], []
  if files.is_remote(path):
    # Remote files are read sequentially once: one request instead of one per record.
    with files.open_file(path, 'rb') as f:
      data = f.read()
    size, read_at = len(data), lambda pos, n: data[pos : pos + n]
  else:
    size = os.path.getsize(path)
    f = open(path, 'rb')
    read_at = lambda pos, n: os.pread(f.fileno(), n, pos)
  try:
    pos = 0
    while pos < size:
      header = read_at(pos, _HEADER)
      length = struct.unpack('<Q', header[:8])[0] if len(header) == _HEADER else -1
      if length < 0 or pos + _HEADER + length + _FOOTER > size:
        raise DataError(
          f'{path}: truncated or not a TFRecord file (record {len(offsets)} at '
          f'byte {pos} runs past the end, {size} bytes); re-create the file'
        )
      offsets.append(pos + _HEADER)
      lengths.append(length)
      pos += _HEADER + length + _FOOTER
  finally:
    if not files.is_remote(path):
      f.close()
  return np.array(offsets, np.int64), np.array(lengths, np.int64)


class _FileReader:
  """Records [skip, skip + take) of each file, concatenated, read by global index.

  `files` is a sequence of (path, skip, take); `take` must be the true count
  (from TFDS file instructions or our shard info.json), so no file is opened
  until one of its records is read.
  """

  def __init__(self, files: Sequence[Tuple[str, int, int]]):
    self._files = [(str(p), int(s), int(t)) for p, s, t in files]
    self._ends = np.cumsum([t for _, _, t in self._files]).tolist()
    self._opened = {}
    self._lock = threading.Lock()

  def __len__(self):
    return self._ends[-1] if self._ends else 0

  def _locate(self, i: int) -> Tuple[int, int]:
    if not 0 <= i < len(self):
      raise IndexError(f'record {i} out of range [0, {len(self)})')
    k = bisect.bisect_right(self._ends, i)
    start = self._ends[k - 1] if k else 0
    return k, self._files[k][1] + i - start

  def _file(self, k: int):
    with self._lock:
      if k not in self._opened:
        path, skip, take = self._files[k]
        handle, count = self._open(path)
        if count < skip + take:
          raise DataError(
            f'{path}: has {count} records, expected at least {skip + take}; '
            'the file is truncated or its metadata is stale'
          )
        self._opened[k] = handle
      return self._opened[k]

  def read(self, indices: Sequence[int]) -> List[bytes]:
    out = [None] * len(indices)
    by_file = {}
    for slot, i in enumerate(indices):
      k, r = self._locate(int(i))
      by_file.setdefault(k, []).append((slot, r))
    for k, wanted in by_file.items():
      records = self._read_file(k, [r for _, r in wanted])
      for (slot, _), record in zip(wanted, records):
        out[slot] = record
    return out

  def describe(self, i: int) -> str:
    k, r = self._locate(int(i))
    return f'{self._files[k][0]} record {r}'


class TFRecordReader(_FileReader):
  """TFRecord files: offsets found by one walk over each file's headers."""

  def _open(self, path):
    offsets, lengths = scan_tfrecord(path)
    return (offsets, lengths), len(offsets)

  def _read_file(self, k, rows):
    offsets, lengths = self._file(k)
    path = self._files[k][0]
    if files.is_remote(path):
      records = []
      with files.open_file(path, 'rb') as f:
        for r in rows:
          f.seek(int(offsets[r]))
          records.append(f.read(int(lengths[r])))
      return records
    with open(path, 'rb') as f:
      return [os.pread(f.fileno(), int(lengths[r]), int(offsets[r])) for r in rows]


class ArrayRecordReader(_FileReader):
  """ArrayRecord files: they carry their own index."""

  def _open(self, path):
    from array_record.python import array_record_module

    try:
      reader = array_record_module.ArrayRecordReader(path)
    except (OSError, RuntimeError, ValueError) as e:
      raise DataError(
        f'{path}: not a readable ArrayRecord file ({str(e).splitlines()[0]}); re-create the file'
      ) from None
    return (reader, threading.Lock()), reader.num_records()

  def _read_file(self, k, rows):
    reader, lock = self._file(k)
    with lock:  # one reader per file, shared by the pipeline's threads
      return list(reader.read(rows))


def open_records(files: Sequence[Tuple[str, int, int]], file_format: str):
  """A reader over (path, skip, take) files of 'tfrecord' or 'array_record' format."""
  if file_format == 'tfrecord':
    return TFRecordReader(files)
  if file_format == 'array_record':
    return ArrayRecordReader(files)
  raise DataError(f'record format {file_format!r} is not tfrecord or array_record')
