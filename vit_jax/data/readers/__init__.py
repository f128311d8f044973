"""Readers: one module per data format, and the one place that picks a dataset's reader.

Each reader module defines a `READER` (`reader.Reader`): its name, which
`config.dataset` spellings are its format (`claims`), the splits and
augmentation that suit its data (`defaults`), and how it opens a split as a
`sources.Source` (`open_split`). `reader_for` asks them in the order of
`READERS`; the first that claims a dataset reads it. A new format is a module
with a `READER` and its entry in `READERS`.
"""

from vit_jax.data.readers import arrays
from vit_jax.data.readers import builtin
from vit_jax.data.readers import folder
from vit_jax.data.readers import reader
from vit_jax.data.readers import shards
from vit_jax.data.readers import tfds

# The order is the precedence: the built-in names; arrays (registered names, .npz
# files, folders of x_*.npy); shard directories (info.json) and `imagenet21k`;
# any other path, an image folder; last any other name, a TFDS dataset or preset
# (`tfds` claims every name).
READERS = (builtin.READER, arrays.READER, shards.READER, folder.READER, tfds.READER)


def reader_for(dataset: str) -> reader.Reader:
  """The reader of `dataset`: the first of `READERS` that claims it."""
  return next(r for r in READERS if r.claims(dataset))
