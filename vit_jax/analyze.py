"""Figures and numbers of the paper's analyses of a checkpoint: `python -m vit_jax.analyze`.

Figure 7 and Appendix D.7-D.8, computed by `vit_jax.evaluation.figures`.

  python -m vit_jax.analyze --checkpoint=ViT-B_16.npz --model=ViT-B_16 \
      [--images=a.jpg,b.png or a directory] --output=analysis/

writes to --output:
  attention_distance.png   mean attention distance per head vs depth (Figure 7 right)
  attention_rollout.png    rollout maps over the input images (D.8, Figure 6)
  posemb_similarity.png    position-embedding cosine similarity (Figure 7 centre)
  embedding_filters.png    principal components of the patch filters (Figure 7 left)
  analysis.json            the numbers behind every figure

The resolution is read from the checkpoint's position embeddings. Without
--images the attention analyses use photos shipped with matplotlib and
scikit-learn (`evaluation.classify.builtin_images`). Images are read as
predict reads them; unreadable ones are named on stderr and left out (exit
status 1, as predict; when none is readable, one `error:` line).
"""

import os
import sys
from typing import List, Optional

from vit_jax.core import cli
from vit_jax.core import console


def main(argv: Optional[List[str]] = None) -> int:
  parser = cli.parser('analyze', __doc__)
  cli.add_checkpoint_flags(parser)
  parser.add_argument(
    '--images',
    nargs='*',
    default=[],
    help='image files and/or directories (comma-separated or repeated), or '
    '"digits": test images of the built-in digits (the demo model)',
  )
  parser.add_argument('--output', required=True, help='directory for the PNGs and analysis.json')
  parser.add_argument(
    '--num_components',
    type=cli.positive_int,
    default=28,
    help='principal components of the embedding filters to show',
  )
  console.add_verbosity_flag(parser)
  args = parser.parse_args(argv)
  console.quiet_libraries(args.verbosity)

  from vit_jax import workdir
  from vit_jax.evaluation import classify
  from vit_jax.evaluation import figures
  from vit_jax.evaluation import loader

  with cli.reported():
    digits = args.images == ['digits']
    if not digits:
      paths = classify.image_files(args.images) if args.images else classify.builtin_images()
      if not paths:
        raise loader.InputError('no images: pass --images=FILES or a directory')
    if os.path.exists(args.output) and not os.path.isdir(args.output):
      raise loader.InputError(f'--output {args.output} is a file; pass a folder for the figures')
    workdir.check_output(args.output, '--output', folder=True)
    loaded = loader.load_from_flags(args, parser.prog)
    unreadable = []
    if digits:
      paths, images = figures.test_digits(loaded.spec.image_size)
    else:
      paths, images = _readable(paths, loaded.spec.image_size, unreadable)
    result = figures.compute(loaded, images, args.num_components)
    with cli.writing(args.output):
      written = figures.write_outputs(result, loaded, images, paths, args)
  print(f'wrote {", ".join(written)} to {args.output}')
  for path, reason in unreadable:
    print(f'{parser.prog}: skipped {reason}', file=sys.stderr)
  return 1 if unreadable else 0


def _readable(paths, size, unreadable):
  """(readable paths, their pixels); the others appended to `unreadable` as (path, reason), an
  InputError when none is readable."""
  import numpy as np

  from vit_jax.evaluation import classify
  from vit_jax.evaluation import loader

  kept, pixels = [], []
  for path in paths:
    try:
      pixels.append(classify.read_image(path, size))
      kept.append(path)
    except loader.InputError as e:
      unreadable.append((path, str(e)))
  if not kept:
    more = f' (and {len(paths) - 1} more unreadable images)' if len(paths) > 1 else ''
    raise loader.InputError(unreadable[0][1] + more)
  return kept, np.stack(pixels)


if __name__ == '__main__':
  sys.exit(cli.run(main))
