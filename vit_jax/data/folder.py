"""Image folders: DIR/<split>/<class>/<image>, classes numbered in sorted order.

Images are .jpg/.jpeg/.png/.bmp/.gif (any case); grayscale and RGBA become RGB
when decoded. Every file is checked once when the folder is opened, so a
corrupt or truncated image never reaches training: by default it is left out,
counted and named in the log; with `corrupt_images='fail'` the first one stops
the run with its name. Checking is cheap for JPEGs (PIL decodes at 1/8 scale,
which still reads every entropy-coded byte) and a full PIL decode for the
other formats, run in a thread pool.
"""

import concurrent.futures
import difflib
import logging
import os
from typing import List, Optional, Sequence, Tuple

from vit_jax.data.sources import DataError

EXTENSIONS = ('.jpg', '.jpeg', '.png', '.bmp', '.gif')
_MAX_NAMED = 20  # corrupt files named in the log line; the count is always exact


def is_image_folder(path: str) -> bool:
  return os.path.isdir(path) and not os.path.exists(os.path.join(path, 'info.json'))


def class_names(root: str) -> List[str]:
  """Sorted class folder names over the splits of `root` (train, test, ...)."""
  names = set()
  for split in sorted(os.listdir(root)):
    split_dir = os.path.join(root, split)
    if os.path.isdir(split_dir):
      names.update(d for d in os.listdir(split_dir) if os.path.isdir(os.path.join(split_dir, d)))
  return sorted(names)


def check_same_classes(root: str) -> None:
  """Refuses a class folder that only some splits have: a typo (`Circle` / `circle`) or a class
  without training images, which the head would learn nothing of and the accuracy would count."""
  by_split = {}
  for split in sorted(os.listdir(root)):
    split_dir = os.path.join(root, split)
    if os.path.isdir(split_dir):
      by_split[split] = {
        d for d in os.listdir(split_dir) if os.path.isdir(os.path.join(split_dir, d))
      }
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
  except Exception as e:
    # Any failure means "not an image we can decode"; keep its first line.
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
  return None


def list_split(
  root: str, split: str, classes: Sequence[str], corrupt_images: str, threads: int = 8
) -> Tuple[List[str], List[int]]:
  """(paths, labels) of the valid images of DIR/split, sorted by class then file name."""
  if corrupt_images not in ('skip', 'fail'):
    raise DataError(f"corrupt_images={corrupt_images!r}: use 'skip' or 'fail'")
  split_dir = os.path.join(root, split)
  if not os.path.isdir(split_dir):
    have = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
    raise DataError(
      f'{root}: no split folder {split!r} (has {", ".join(have) or "none"}); '
      f'expected {root}/{split}/<class>/<image>'
    )
  paths, labels = [], []
  for label, name in enumerate(classes):
    class_dir = os.path.join(split_dir, name)
    if not os.path.isdir(class_dir):
      continue  # a class may be absent from a split (e.g. no test images)
    files = sorted(f for f in os.listdir(class_dir) if f.lower().endswith(EXTENSIONS))
    if not files:
      raise DataError(
        f'{class_dir}: empty class folder (no {", ".join(EXTENSIONS)} files); '
        'add images or remove the folder'
      )
    paths += [os.path.join(class_dir, f) for f in files]
    labels += [label] * len(files)
  if not paths:
    raise DataError(
      f'{split_dir}: no class folders with images; expected {split_dir}/<class>/<image>'
    )

  with concurrent.futures.ThreadPoolExecutor(threads) as pool:
    problems = list(pool.map(check_image, paths))
  bad = [(p, why) for p, why in zip(paths, problems) if why]
  if bad and corrupt_images == 'fail':
    path, why = bad[0]
    raise DataError(
      f'{path}: corrupt or truncated image ({why}); replace or delete it, '
      "or set corrupt_images='skip' to leave such files out"
    )
  if bad:
    names = ', '.join(p for p, _ in bad[:_MAX_NAMED]) + (' ...' if len(bad) > _MAX_NAMED else '')
    logging.warning(
      '%s: skipped %d corrupt image(s) of %d: %s', split_dir, len(bad), len(paths), names
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
