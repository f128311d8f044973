"""`tf.train.Example` records read and written in plain Python.

JFT-style shards (`vit_jax.jft`) and prepared TFDS datasets store one Example
per record: a map from feature names to a list of bytes, int64s or floats.
The protobuf wire format is small enough to walk by hand, which keeps
TensorFlow (and its 1.5 GB) out of the input pipeline.

    Example   { Features features = 1; }
    Features  { map<string, Feature> feature = 1; }   (entries: key = 1, value = 2)
    Feature   { oneof { BytesList = 1; FloatList = 2; Int64List = 3 } }   (each: repeated value = 1)
"""

import struct
from typing import Dict, List, Union

import numpy as np

Value = Union[List[bytes], np.ndarray]


def _varint(buf: bytes, pos: int):
  value = shift = 0
  while True:
    byte = buf[pos]
    pos += 1
    value |= (byte & 0x7F) << shift
    shift += 7
    if byte < 0x80:
      return value, pos


def _fields(buf: bytes):
  """(field number, wire type, value) of a message: ints for varints, bytes otherwise."""
  pos, end = 0, len(buf)
  while pos < end:
    tag, pos = _varint(buf, pos)
    number, wire = tag >> 3, tag & 7
    if wire == 0:
      value, pos = _varint(buf, pos)
    elif wire == 2:
      size, pos = _varint(buf, pos)
      value, pos = buf[pos : pos + size], pos + size
    elif wire in (1, 5):
      size = 8 if wire == 1 else 4
      value, pos = buf[pos : pos + size], pos + size
    else:
      raise ValueError(f'unsupported protobuf wire type {wire}')
    if pos > end:
      raise ValueError('truncated protobuf message')
    yield number, wire, value


def _ints(items) -> np.ndarray:
  values = []
  for wire, item in items:
    if wire == 0:
      values.append(item)
      continue
    pos = 0  # packed
    while pos < len(item):
      v, pos = _varint(item, pos)
      values.append(v)
  return np.array([v - (1 << 64) if v >> 63 else v for v in values], np.int64)


def _floats(items) -> np.ndarray:
  raw = b''.join(item for _, item in items)  # packed (wire 2) or one per field (wire 5)
  return np.frombuffer(raw, '<f4').astype(np.float32)


def _feature(buf: bytes) -> Value:
  for kind, _, content in _fields(buf):
    items = [(wire, item) for _, wire, item in _fields(content)]
    if kind == 1:
      return [item for _, item in items]
    if kind == 2:
      return _floats(items)
    if kind == 3:
      return _ints(items)
  return []


def parse(serialized: bytes) -> Dict[str, Value]:
  """A serialized Example -> {name: list of bytes | int64 array | float32 array}."""
  features = {}
  for _, _, features_msg in _fields(serialized):  # Example.features
    for _, _, entry in _fields(features_msg):  # Features.feature map entries
      parts = {number: value for number, _, value in _fields(entry)}
      features[parts.get(1, b'').decode()] = _feature(parts.get(2, b''))
  return features


def _encode_varint(value: int) -> bytes:
  value &= (1 << 64) - 1  # negative int64s as ten-byte two's complement
  out = bytearray()
  while True:
    byte, value = value & 0x7F, value >> 7
    out.append(byte | (0x80 if value else 0))
    if not value:
      return bytes(out)


def _message_field(number: int, payload: bytes) -> bytes:
  return _encode_varint(number << 3 | 2) + _encode_varint(len(payload)) + payload


def _encode_feature(values) -> bytes:
  if isinstance(values, (bytes, str)):
    values = [values]
  if isinstance(values, list) and all(isinstance(v, (bytes, str)) for v in values):
    items = b''.join(_message_field(1, v.encode() if isinstance(v, str) else v) for v in values)
    return _message_field(1, items)  # BytesList
  array = np.asarray(values)
  if np.issubdtype(array.dtype, np.floating):
    packed = struct.pack(f'<{array.size}f', *array.ravel().tolist())
    return _message_field(2, _message_field(1, packed))  # FloatList, packed
  packed = b''.join(_encode_varint(int(v)) for v in array.ravel())
  return _message_field(3, _message_field(1, packed))  # Int64List, packed


def serialize(features: dict) -> bytes:
  """{name: bytes | [bytes] | ints | floats} -> a serialized Example."""
  entries = b''.join(
    _message_field(1, _message_field(1, name.encode()) + _message_field(2, _encode_feature(v)))
    for name, v in features.items()
  )
  return _message_field(1, entries)
