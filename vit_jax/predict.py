"""Top-5 classes of images under a checkpoint.

  python -m vit_jax.predict --checkpoint=ViT-B_16.npz --model=ViT-B_16 cat.jpg dog.png
  python -m vit_jax.predict --checkpoint=workdirs/demo photos/     # the workdir names its model
  python -m vit_jax.predict --checkpoint=exported.npz photos/      # so does an .npz we wrote

Images are read as the evaluation pipeline reads them (`vit_jax.data.images`:
every PIL mode decoded as in training, EXIF orientation not applied), resized
to the checkpoint's resolution (read from its position embeddings) and scaled
to [-1, 1]; a checkpoint of a family converted from timm by its weights' own transform
(timm's, which it records: said on stderr in one line). A workdir whose run has not finished (stopped, preempted) is read
from its newest checkpoint. Class names: `--labels=FILE`, else those a
workdir's run recorded (dataset.json) or an `.npz` records (a run's params.npz
and `python -m vit_jax.export --format=npz` write them), or the class folders
(or labels) of a run's dataset, else ImageNet-1k for 1000-way heads,
ImageNet-21k for 21843-way heads (both ship in `vit_jax/data/`) of an ImageNet
run or a file that records none (said on stderr), else `class_<i>`.
Probabilities are the softmax of the logits. Unreadable images are named on stderr and left out; the exit
status is then 1 (when none is readable, the one `error:` line of `vit_jax.core.cli`).
"""

import sys
from typing import List, Optional

from vit_jax.core import cli
from vit_jax.core import console


def main(argv: Optional[List[str]] = None) -> int:
  parser = cli.parser('predict', __doc__)
  cli.add_checkpoint_flags(parser)
  parser.add_argument(
    '--fp8',
    action='store_true',
    help="bfloat16 with the encoder's dense layers as FP8 products, the kernels rounded to FP8 "
    'once as the checkpoint loads (FP8 tensor cores on Hopper/Ada GPUs, emulated elsewhere)',
  )
  parser.add_argument('--labels', help="class names, one per line, in the head's order")
  parser.add_argument('--top_k', type=cli.positive_int, default=5)
  parser.add_argument('images', nargs='+', help='image files or directories')
  console.add_verbosity_flag(parser)
  args = parser.parse_args(argv)
  console.quiet_libraries(args.verbosity)

  from vit_jax import checkpoint
  from vit_jax.evaluation import classify
  from vit_jax.evaluation import loader

  unreadable = []
  with cli.reported():
    files = classify.image_files(args.images)
    loaded = loader.load_from_flags(args, parser.prog)
    if loaded.model.num_classes is None:
      raise checkpoint.CheckpointError(
        f'{args.checkpoint}: no head/kernel, so it cannot classify; '
        'pass a checkpoint with a classification head'
      )
    if loaded.preprocessing is not None:
      cli.note(parser.prog, loaded.preprocessing.line())
    names, why, note, _ = classify.class_names_of(
      loaded.model.num_classes, args.labels, args.checkpoint
    )
    indices, probs = classify.predict(loaded, files, args.top_k, unreadable=unreadable)
    if len(unreadable) == len(files):
      more = f' (and {len(files) - 1} more unreadable images)' if len(files) > 1 else ''
      raise loader.InputError(unreadable[0][1] + more)
  bad = {path for path, _ in unreadable}
  for f, idx, prob in zip([f for f in files if f not in bad], indices, probs):
    print(cli.one_line(f))
    for rank, (i, p) in enumerate(zip(idx, prob), 1):
      print(f'  {rank}. {100 * p:6.2f}%  {cli.one_line(names[i])}  (class {i})')
  cli.note(parser.prog, why or note)
  for _, reason in unreadable:
    print(f'{parser.prog}: skipped {reason}', file=sys.stderr)
  if unreadable:
    print(
      f'{parser.prog}: {len(unreadable)} of {len(files)} image(s) unreadable, '
      f'{len(files) - len(unreadable)} predicted',
      file=sys.stderr,
    )
    return 1
  return 0


if __name__ == '__main__':
  sys.exit(cli.run(main))
