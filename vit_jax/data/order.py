"""Which example each step reads, and each example's random numbers: NumPy only.

The example stream is epoch after epoch of the split, each epoch a seeded
permutation computed per index (nothing of size N is stored; small splits
cache a table): `index_shuffle` is the cycle-walking Simon cipher of
TensorFlow's `RandomIndexShuffle` op, reimplemented here (tests compare the two
bit for bit) and used by both pipelines, with one fix: TensorFlow's block is a
bit short when the split has 2^k + 1 examples. `example_uniforms` gives each stream position its own random numbers,
a hash of (key, position, draw), so an example's augmentation does not depend
on which process or thread prepares it.
"""

import functools
import math

import numpy as np

_U64 = np.uint64
_Z = 0x7369F885192C0EF5  # the Simon key schedule's constant sequence
_C = 0xFFFFFFFC


def _rotl(x, r, w, mask):
  return ((x << _U64(r)) | (x >> _U64(w - r))) & mask


def _rotr(x, r, w, mask):
  return ((x >> _U64(r)) | (x << _U64(w - r))) & mask


def _round_keys(key, rounds, w, mask):
  keys = [_U64(int(k) & int(mask)) for k in key]
  z = _Z & int(mask)
  for i in range(3, rounds):
    k = _U64(_C & int(mask)) ^ _U64(z & 1) ^ keys[i - 3]
    k ^= _rotr(keys[i - 1], 3, w, mask) ^ _rotr(keys[i - 1], 4, w, mask)
    keys.append(k & mask)
    z >>= 1
  return keys


def _encrypt(value, keys, w, mask):
  f = lambda x: (_rotl(x, 1, w, mask) & _rotl(x, 8, w, mask)) ^ _rotl(x, 2, w, mask)
  left, right = (value >> _U64(w)) & mask, value & mask
  for k1, k2 in zip(keys[::2], keys[1::2]):
    left = left ^ f(right) ^ k1
    right = right ^ f(left) ^ k2
  return (left << _U64(w)) | right


_TABLE_BITS = 20  # blocks up to this size are encrypted once, as a lookup table


def _block_bits(max_index: int) -> int:
  # Bits for the values 0..max_index. TensorFlow takes ceil(log2(max_index)), one
  # too few when max_index is a power of two (n = 2^k + 1 examples): index n - 1
  # then lands on index 0's position. Elsewhere the two agree.
  block = math.ceil(math.log2(max_index + 1))
  return min(64, max(16, block + block % 2))


@functools.lru_cache(maxsize=4)
def _cipher_table(key, block: int, rounds: int) -> np.ndarray:
  w = block // 2
  mask = _U64((1 << w) - 1)
  return _encrypt(
    np.arange(1 << block, dtype=np.uint64), _round_keys(key, rounds, w, mask), w, mask
  )


def index_shuffle(index, key, max_index: int, rounds: int = 4) -> np.ndarray:
  """Positions of `index` (int [n]) in a permutation of [0, max_index] keyed by 3 uint32s."""
  index = np.asarray(index, np.uint64)
  if max_index == 0:
    return np.zeros_like(index, dtype=np.int64)
  block = _block_bits(max_index)
  w = block // 2
  mask = _U64((1 << w) - 1)
  if block <= _TABLE_BITS:
    # Small splits walk long cycles (up to 2^16 / n steps): a table makes each a lookup.
    table = _cipher_table(tuple(int(k) for k in key), block, rounds)
    encrypt = lambda v: table[v]
  else:
    keys = _round_keys(key, rounds, w, mask)
    encrypt = lambda v: _encrypt(v, keys, w, mask)
  out = encrypt(index)
  pending = np.flatnonzero(out > _U64(max_index))
  while pending.size:  # cycle walking: re-encrypt until inside [0, max_index]
    out[pending] = encrypt(out[pending])
    pending = pending[out[pending] > _U64(max_index)]
  return out.astype(np.int64)


@functools.lru_cache(maxsize=2)
def _epoch_permutation(key, num_examples):
  return index_shuffle(np.arange(num_examples), key, num_examples - 1)


def train_indices(step, *, global_batch, local_batch, offset, num_examples, order_key):
  """(stream positions, example indices) int64 [b] of one process's share of a step."""
  positions = int(step) * global_batch + offset + np.arange(local_batch, dtype=np.int64)
  epoch, within = positions // num_examples, positions % num_examples
  indices = np.empty_like(positions)
  for e in np.unique(epoch):  # a batch spans at most a few epochs
    rows = epoch == e
    key = (int(order_key) & 0xFFFFFFFF, int(e) & 0xFFFFFFFF, 0)
    if num_examples <= 1 << 16:  # small split: one cycle walk for the epoch, then lookups
      indices[rows] = _epoch_permutation(key, num_examples)[within[rows]]
    else:
      indices[rows] = index_shuffle(within[rows], key, num_examples - 1)
  return positions, indices


def keys(seed: int):
  """Independent int64 keys for example order, augmentation and mixup."""
  words = np.random.SeedSequence([int(seed)]).generate_state(3, np.uint64)
  return [int(w >> np.uint64(1)) for w in words]


def process_part(n: int, process_index: int, process_count: int):
  """(start, size) of the examples [p*n//P, (p+1)*n//P) that process p reads."""
  start = n * process_index // process_count
  return start, n * (process_index + 1) // process_count - start


def eval_steps(n: int, local_batch: int, process_count: int) -> int:
  """Batches per evaluation pass; every process runs the same number."""
  return max(1, math.ceil(math.ceil(n / process_count) / local_batch))


def eval_positions(n: int, local_batch: int, process_index: int, process_count: int):
  """(indices, mask) of each eval batch of one process: its part, padded with mask 0."""
  part_start, part_size = process_part(n, process_index, process_count)
  for step in range(eval_steps(n, local_batch, process_count)):
    pos = step * local_batch + np.arange(local_batch, dtype=np.int64)
    idx = np.clip(part_start + np.minimum(pos, part_size - 1), 0, n - 1)
    yield idx, (pos < part_size).astype(np.float32)


def _mix64(z):
  """SplitMix64's finaliser: a bijective 64-bit hash."""
  z = (z ^ (z >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
  z = (z ^ (z >> _U64(27))) * _U64(0x94D049BB133111EB)
  return z ^ (z >> _U64(31))


def example_uniforms(key: int, positions, n: int) -> np.ndarray:
  """float64 [b, n] uniforms in [0, 1), a pure function of (key, position, draw)."""
  positions = np.asarray(positions, np.uint64).reshape(-1, 1)
  with np.errstate(over='ignore'):
    counter = positions * _U64(n) + np.arange(n, dtype=np.uint64)
    z = _mix64(_mix64(counter ^ _mix64(np.full(1, key, np.uint64))))
  return (z >> _U64(11)).astype(np.float64) * 2.0**-53
