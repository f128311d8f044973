"""Image folders: DIR/<split>/<class>/<image>, classes numbered in sorted order.

Images are the files whose names end as a format `vit_jax.data.images.decode`
reads (`images.extensions()`: JPEG, PNG, WebP, TIFF, BMP, GIF and PIL's other
formats, any case; a name without an extension, by its first bytes), wherever they
lie in a class folder: images in its
sub-folders are that class's images. What tools leave in a dataset -- notebook
checkpoints, macOS archive metadata, version-control and editor folders,
dot-files (`is_tool_entry`) -- is neither a split, a class nor an image; it is
left out, and so are files of other kinds, and one warning per split names
what was left out. Grayscale and RGBA become RGB when decoded. Every file is
checked once when the folder is opened, so a corrupt or truncated image never
reaches training: by default it is left out, counted and named in the log;
with `corrupt_images='fail'` the first one stops the run with its name.
Checking is cheap for JPEGs (PIL decodes at 1/8 scale, which still reads
every entropy-coded byte) and a full PIL decode for the other formats, run in
a thread pool.

The reader claims every path that no reader before it claimed; a path that is
no local folder is refused there.
"""

import concurrent.futures
import difflib
import functools
import logging
import os
from typing import List, Optional, Sequence, Tuple

import numpy as np

from vit_jax.core import files
from vit_jax.data import images
from vit_jax.data import sources
from vit_jax.data.readers import reader
from vit_jax.data.sources import DataError

_MAX_NAMED = 20  # corrupt files named in the log line; the count is always exact
_TOO_LARGE = 'too large to decode'  # an image over PIL's decompression-bomb limit
_SIZE_SAMPLE = 32  # train images whose size is read to choose the defaults
# Folders and files that tools make beside data; any name starting with a dot is one too
# (.ipynb_checkpoints, .git, .svn, .hg, .idea, .vscode, .DS_Store, ._* AppleDouble files).
_TOOL_NAMES = frozenset(
  ('__MACOSX', '__pycache__', 'Thumbs.db', 'desktop.ini', '$RECYCLE.BIN', 'lost+found')
)
IMAGE_KINDS = 'JPEG, PNG, WebP, TIFF, BMP, GIF or another format PIL reads'


def is_tool_entry(name: str) -> bool:
  """Whether a file or folder name is one a tool made (see `_TOOL_NAMES`), not data."""
  return os.fsdecode(name).startswith('.') or os.fsdecode(name) in _TOOL_NAMES


def is_image_name(name: str) -> bool:
  return os.fsdecode(name).lower().endswith(images.extensions())


# How the formats start (their magic numbers): a file without an extension is an image when its
# first bytes say so, as predict reads any file it is given.
_MAGIC = (
  b'\xff\xd8\xff',
  b'\x89PNG\r\n\x1a\n',
  b'GIF87a',
  b'GIF89a',
  b'BM',
  b'II*\x00',
  b'MM\x00*',
)


def is_image_file(folder: str, name: str) -> bool:
  """An image by its name (`is_image_name`), or, for a name without an extension, by its
  first bytes (JPEG, PNG, GIF, BMP, TIFF, WebP)."""
  if is_image_name(name):
    return True
  if '.' in os.fsdecode(name):
    return False
  try:
    with open(os.path.join(folder, name), 'rb') as f:
      head = f.read(12)
  except OSError:
    return False
  return head.startswith(_MAGIC) or (head[:4] == b'RIFF' and head[8:12] == b'WEBP')


def subfolders(path: str) -> List[str]:
  """Sorted names of the folders in `path` that hold data (tools' folders left out)."""
  return sorted(
    d for d in os.listdir(path) if not is_tool_entry(d) and os.path.isdir(os.path.join(path, d))
  )


def walk(folder: str):
  """`os.walk` of `folder` (top-down) that follows symlinked folders, as it follows symlinked
  files and class folders: a link to a folder of images is that folder. Each real folder is
  read once; a link back up the tree would otherwise loop."""
  seen = set()
  for top, dirs, names in os.walk(folder, followlinks=True):
    real = os.path.realpath(top)
    if real in seen:
      dirs[:] = []
      continue
    seen.add(real)
    yield top, dirs, names


def images_under(folder: str) -> Tuple[List[str], List[str], List[str]]:
  """(images, tools' entries, other files) under `folder`, at any depth (symlinked folders
  followed, `walk`), as sorted paths relative to it; nothing inside a tool's folder is looked
  at."""
  found, tools, others = [], [], []
  for top, dirs, names in walk(folder):
    where = os.path.relpath(top, folder)
    relative = lambda name: name if where == '.' else os.path.join(where, name)
    tools += [relative(d) for d in dirs if is_tool_entry(d)]
    dirs[:] = sorted(d for d in dirs if not is_tool_entry(d))
    for name in names:
      kind = tools if is_tool_entry(name) else found if is_image_file(top, name) else others
      kind.append(relative(name))
  return sorted(found), sorted(tools), sorted(others)


def left_out_line(where: str, tools: Sequence[str], others: Sequence[str]) -> str:
  """One line naming what a listing of `where` left out; '' when nothing."""
  parts = []
  for paths, what in ((tools, "tools' folders and files"), (others, 'files that are not images')):
    if paths:
      more = f', ... ({len(paths)} in all)' if len(paths) > 5 else ''
      parts.append(f'{what} ({", ".join(os.fsdecode(p) for p in paths[:5])}{more})')
  if not parts:
    return ''
  return f'{where}: left out {" and ".join(parts)}; images are {IMAGE_KINDS}'


@functools.lru_cache(maxsize=None)
def warn_once(line: str) -> None:
  """Logs `line` the first time this process says it (a split is listed more than once)."""
  if line:
    logging.warning('%s', line)


def class_names(root: str) -> List[str]:
  """Sorted class folder names over the splits of `root` (train, test, ...)."""
  names = set()
  for split in subfolders(root):
    names.update(subfolders(os.path.join(root, split)))
  return sorted(names)


def check_same_classes(root: str) -> None:
  """Refuses a class folder that only some splits have: a typo (`Circle` / `circle`) or a class
  without training images, which the head would learn nothing of and the accuracy would count."""
  by_split = {split: set(subfolders(os.path.join(root, split))) for split in subfolders(root)}
  every = set().union(*by_split.values()) if by_split else set()
  for split, names in sorted(by_split.items(), key=lambda item: item[0] != 'train'):
    missing = sorted(every - names)
    if missing:
      name = missing[0]
      where = ', '.join(s for s, n in by_split.items() if name in n)
      close = difflib.get_close_matches(name, sorted(names), n=1, cutoff=0.6) + [
        n for n in names if n.lower() == name.lower()
      ]
      hint = f' (is it {close[-1]!r} there?)' if close else ''
      raise DataError(
        f'{root}: class folder {name!r} is in {where} but not in {split}{hint}; give every '
        'split the same class folders, or set --config.allow_missing_classes=True'
      )


def check_image(path: str) -> Optional[str]:
  """None if `path` decodes, else a short reason."""
  try:
    from PIL import Image

    with Image.open(path) as image:
      if image.format == 'JPEG':
        image.draft('RGB', (max(1, image.width // 8), max(1, image.height // 8)))
      image.load()
  except Image.DecompressionBombError as e:
    return f'{_TOO_LARGE}: {images.too_large_reason(e)}'
  except Exception as e:
    # Any failure means "not an image we can decode"; keep its first line.
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
  return None


def list_split(
  root: str, split: str, classes: Sequence[str], corrupt_images: str, threads: int = 8
) -> Tuple[List[str], List[int]]:
  """(paths, labels) of the valid images of DIR/split, sorted by class then file name."""
  if corrupt_images not in ('skip', 'fail'):  # an argument of this function, as the config's
    raise DataError(f"corrupt_images={corrupt_images!r}: use 'skip' or 'fail'")
  split_dir = os.path.join(root, split)
  if not os.path.isdir(split_dir):
    have = subfolders(root)
    raise DataError(
      f'{root}: no split folder {split!r} (has {", ".join(have) or "none"}); '
      f'expected {root}/{split}/<class>/<image>'
    )
  warn_once(left_out_line(root, *_loose_entries(root)))  # beside the splits
  paths, labels = labelled_images(split_dir, classes)
  if not paths:
    raise DataError(
      f'{split_dir}: no class folders with images; expected {split_dir}/<class>/<image>'
    )

  with concurrent.futures.ThreadPoolExecutor(threads) as pool:
    problems = list(pool.map(check_image, paths))
  bad = [(p, why) for p, why in zip(paths, problems) if why]
  if bad and corrupt_images == 'fail':
    path, why = bad[0]
    what = (
      f'an image {why}' if why.startswith(_TOO_LARGE) else f'corrupt or truncated image ({why})'
    )
    raise DataError(
      f"{path}: {what}; replace or delete it, or set corrupt_images='skip' to leave such files out"
    )
  if bad:
    large = [p for p, why in bad if why.startswith(_TOO_LARGE)]
    corrupt = [p for p, why in bad if not why.startswith(_TOO_LARGE)]
    for which, what in ((corrupt, 'corrupt image(s)'), (large, f'image(s) {_TOO_LARGE}')):
      if which:
        names = ', '.join(which[:_MAX_NAMED]) + (' ...' if len(which) > _MAX_NAMED else '')
        logging.warning(
          '%s: skipped %d %s of %d: %s', split_dir, len(which), what, len(paths), names
        )
    before = set(labels)
    keep = [i for i, why in enumerate(problems) if not why]
    paths, labels = [paths[i] for i in keep], [labels[i] for i in keep]
    for label in sorted(before - set(labels)):
      raise DataError(
        f'{os.path.join(split_dir, classes[label])}: every image is corrupt; '
        'replace them or remove the folder'
      )
  return paths, labels


def labelled_images(parent: str, classes: Sequence[str]) -> Tuple[List[str], List[int]]:
  """(paths, labels) of every image in the class folders `classes` of `parent` (a split of an
  image folder, or the folder `vit_jax.jft` converts), by class; what is left out said once."""
  paths, labels = [], []
  tools, others = _loose_entries(parent)  # beside the class folders
  for label, name in enumerate(classes):
    class_dir = os.path.join(parent, name)
    if not os.path.isdir(class_dir):
      continue  # a class may be absent from a split (e.g. no test images)
    found, tool_entries, other_files = images_under(class_dir)
    tools += [os.path.join(name, p) for p in tool_entries]
    others += [os.path.join(name, p) for p in other_files]
    if not found:
      raise DataError(
        f'{class_dir}: empty class folder (no {IMAGE_KINDS} files); add images or remove the folder'
      )
    paths += [os.path.join(class_dir, f) for f in found]
    labels += [label] * len(found)
  warn_once(left_out_line(parent, sorted(tools), sorted(others)))
  return paths, labels


def _loose_entries(folder: str) -> Tuple[List[str], List[str]]:
  """(tools' entries, files) directly in `folder`: what is neither a split nor a class there."""
  names = sorted(os.listdir(folder))
  tools = [n for n in names if is_tool_entry(n)]
  files = [n for n in names if n not in tools and not os.path.isdir(os.path.join(folder, n))]
  return tools, files


def _image_side(dataset: str) -> Optional[int]:
  """Median shorter side (px) of up to _SIZE_SAMPLE train images, from their headers."""
  from PIL import Image

  split = os.path.join(os.path.expanduser(dataset), 'train')
  if not os.path.isdir(split):
    return None
  paths = []
  for name in subfolders(split):
    class_dir = os.path.join(split, name)
    paths += [os.path.join(class_dir, f) for f in images_under(class_dir)[0]]
  step = max(1, len(paths) // _SIZE_SAMPLE)
  sides = []
  for path in paths[::step][:_SIZE_SAMPLE]:
    try:
      with Image.open(path) as image:
        sides.append(min(image.size))
    except (OSError, ValueError, Image.DecompressionBombError):
      continue  # corrupt and huge files are reported when the split is opened
  return int(np.median(sides)) if sides else None


def _claims(dataset: str) -> bool:
  if not reader.names_a_path(dataset):
    return False
  if files.is_remote(dataset):
    raise DataError(
      f'{dataset}: no info.json there; datasets in object stores are shard directories '
      '(python -m vit_jax.jft --folder DIR --out gs://...); image folders must be local'
    )
  if not os.path.isdir(os.path.expanduser(dataset)):
    raise DataError(
      f'{dataset}: no such folder; pass an existing image folder or shard '
      'directory, or a dataset name (digits, cifar10, imagenet2012, ...)'
    )
  return True


def unlabelled_dir(root: str, split: str) -> Optional[str]:
  """The folder of `split`'s images when the folder `root` holds them without class folders:
  DIR/<split>/<image> (a split of loose images), or DIR/<image> with no split folders (every
  image the train split); None for the class layout."""
  split_dir = os.path.join(root, split)
  if os.path.isdir(split_dir):
    if subfolders(split_dir):
      return None
    return split_dir if any(is_image_file(split_dir, n) for n in os.listdir(split_dir)) else None
  if subfolders(root):
    return None
  return root if any(is_image_file(root, n) for n in os.listdir(root)) else None


def _unlabelled(root: str, split: str, name: str, options: reader.Options) -> sources.Source:
  """A split of images without class folders (self-supervised data): labels all 0 of no
  classes; a root of loose images is its train split, its other splits empty."""
  folder = unlabelled_dir(root, name)
  if folder is None or folder == root and name != 'train':
    paths = []
  else:
    found, tools, others = images_under(folder)
    warn_once(left_out_line(folder, tools, others))
    paths = [os.path.join(folder, f) for f in found]
    paths = _checked(folder, paths, options.corrupt_images)
  where = root if folder == root else os.path.join(root, name)
  labels = np.zeros(len(paths), np.int32)  # read by no one: the split has no classes
  return sources.Source(
    where,
    len(paths),
    0,
    False,
    [],
    fetch=lambda idx: ([paths[i] for i in idx], labels[idx]),
    describe=lambda i: str(paths[i]),
  )


def _checked(folder: str, paths: List[str], corrupt_images: str, threads: int = 8) -> List[str]:
  """`paths` less the images that do not decode (or the first one as a DataError with 'fail')."""
  with concurrent.futures.ThreadPoolExecutor(threads) as pool:
    problems = list(pool.map(check_image, paths))
  bad = [(p, why) for p, why in zip(paths, problems) if why]
  if bad and corrupt_images == 'fail':
    path, why = bad[0]
    raise DataError(
      f'{path}: corrupt or truncated image ({why}); replace or delete it, or set '
      "corrupt_images='skip' to leave such files out"
    )
  if bad:
    logging.warning('%s: skipped %d corrupt image(s) of %d', folder, len(bad), len(paths))
  return [p for p, why in zip(paths, problems) if not why]


def _open_split(dataset: str, split: str, options: reader.Options) -> sources.Source:
  root = os.path.expanduser(dataset)
  name, start, stop = sources.parse_split(split)
  if unlabelled_dir(root, name) is not None or (name != 'train' and unlabelled_dir(root, 'train')):
    return reader.sliced(_unlabelled(root, split, name, options), start, stop)
  classes = class_names(root)
  if len(classes) == 1:
    # One class: every prediction is right, and training "reaches 100%".
    raise DataError(
      f'{root}: only one class folder ({classes[0]}); classification needs at least two: '
      f'add {root}/train/<another class>/ with images'
    )
  paths, labels = list_split(root, name, classes, options.corrupt_images)
  if not options.allow_missing_classes:
    check_same_classes(root)
  source = sources.file_source(os.path.join(root, name), paths, labels, len(classes), classes)
  return reader.sliced(source, start, stop)


READER = reader.Reader(
  'folder',
  claims=_claims,
  defaults=lambda dataset, options: reader.for_image_side(_image_side(dataset)),
  open_split=_open_split,
)
