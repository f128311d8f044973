"""JFT-style multi-label shards: the schema, a reader, and a converter CLI.

A shard directory holds `info.json` and record files (TFRecord by default, or
ArrayRecord). Each record is a serialized `tf.train.Example` with

  image/encoded  bytes      the image file as it was (JPEG, PNG, GIF or BMP)
  image/labels   int64 list label ids in [0, num_classes), one or more
  image/id       bytes      where the image came from (path or CSV line)

and `info.json` is

  {"format": "vit_jax.shards/1", "file_format": "tfrecord",
   "num_classes": K, "class_names": [...] or null,
   "splits": {"train": [{"file": "train-00000-of-00004.tfrecord",
                         "num_examples": 250}, ...], ...}}

Labels become multi-hot [K] for the sigmoid loss (paper 4.1: JFT is
multi-label). Write shards from an image folder or a CSV of
`path,label_id;label_id;...`:

  python -m vit_jax.jft --folder DIR/train --out SHARDS --split train
  python -m vit_jax.jft --csv labels.csv --num_classes 18291 --out SHARDS

The converter checks every image (`vit_jax.data.readers.folder.check_image`) and leaves
corrupt ones out (named in the log) or, with --corrupt_images=fail, stops.
"""

import logging
import os
import sys

from vit_jax.core import cli
from vit_jax.core import console


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  # Before TensorFlow starts (the shard writer imports it).
  console.quiet_libraries(console.verbosity_in(argv))

  from vit_jax import workdir
  from vit_jax.data.readers import shards

  parser = _parser(shards.FORMATS)
  args = parser.parse_args(argv)
  missing = [
    name
    for name, given in (('--folder or --csv', args.folder or args.csv), ('--out', args.out))
    if not given
  ]
  if missing:
    parser.error(f'the following arguments are required: {", ".join(missing)}')
  # Warnings (corrupt images skipped) on stderr; the result is a line on stdout.
  logging.basicConfig(level=logging.WARNING, format='%(message)s')
  if args.folder and not os.path.isdir(args.folder):
    cli.fail(f'{args.folder}: no such folder; pass one laid out as DIR/<class>/<image>')
  if args.csv and not os.path.isfile(args.csv):
    cli.fail(f'{args.csv}: no such file; pass a CSV of lines "path,label_id;label_id;..."')
  if os.path.exists(args.out) and not os.path.isdir(args.out):
    cli.fail(f'--out {args.out} is a file; pass a folder for info.json and the shards')
  with cli.reported():
    workdir.check_output(args.out, '--out', folder=True)
  with cli.reported(), cli.writing(args.out):
    examples, names, num_classes = _examples(args)
    info = shards.write_shards(
      examples,
      args.out,
      args.split,
      num_classes=num_classes,
      class_names=names,
      num_shards=args.shards,
      file_format=args.format,
      corrupt_images=args.corrupt_images,
      seed=args.seed,
    )
  written = info['splits'][args.split]
  count = sum(s['num_examples'] for s in written)
  print(
    f'wrote {count} examples of split {args.split} ({num_classes} classes) in {len(written)} '
    f'shards to {args.out}; {len(examples) - count} corrupt images skipped'
  )
  return 0


def _parser(formats):
  """The command line; `formats`: `shards.FORMATS`, imported once the libraries are quiet."""
  parser = cli.parser('jft', __doc__, whole_doc=False)
  # Required, but checked after parsing: argparse names the group only once --out is given.
  group = parser.add_mutually_exclusive_group()
  group.add_argument('--folder', help='DIR/<class>/<image>: one label per image')
  group.add_argument('--csv', help='lines "path,label_id;label_id;..."')
  parser.add_argument('--out', help='shard directory to write (info.json + shards), required')
  parser.add_argument('--split', default='train', help='split name to write (default train)')
  parser.add_argument('--num_classes', type=int, help='CSV: number of classes (default max id + 1)')
  parser.add_argument('--class_names', help='CSV: text file with one class name per line')
  parser.add_argument('--shards', type=cli.positive_int, default=16, help='number of shard files')
  parser.add_argument('--format', default='tfrecord', choices=sorted(formats))
  parser.add_argument('--corrupt_images', default='skip', choices=['skip', 'fail'])
  parser.add_argument('--seed', type=int, default=0, help='seed of the example order')
  console.add_verbosity_flag(parser)
  return parser


def _examples(args):
  """(examples [(path, [label ids])], class names or None, number of classes) of --folder or
  --csv; class names as text (`files.text`) whatever the file system's encoding."""
  from vit_jax.core import files
  from vit_jax.data.readers import shards
  from vit_jax.data.sources import DataError

  if args.folder:
    examples, names = shards.examples_from_folder(args.folder)
    return examples, [files.text(name) for name in names], len(names)
  examples = shards.examples_from_csv(args.csv)
  names = None
  if args.class_names:
    try:
      with open(args.class_names, encoding='utf-8') as f:
        names = [line.strip() for line in f if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
      raise DataError(
        f'{args.class_names}: cannot read the class names ({e}); pass a UTF-8 text file with '
        'one name per line'
      ) from None
  num_classes = args.num_classes or (len(names) if names else 1 + max(max(l) for _, l in examples))
  return examples, names, num_classes


if __name__ == '__main__':
  sys.exit(cli.run(main))
