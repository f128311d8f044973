"""Prepares a dataset once, before training: `python -m vit_jax.prepare NAME ...`.

  python -m vit_jax.prepare cifar10 --data_dir DIR                  # downloads (needs network)
  python -m vit_jax.prepare imagenet2012 --data_dir DIR --manual_dir TARS
  python -m vit_jax.prepare imagenet21k --data_dir DIR --manual_dir EXTRACTED

TFDS datasets are written as ArrayRecord (random access, what the pipeline
reads fastest); TFRecord preparations are read too. ImageNet-21k is not in
TFDS: its extracted release (one folder of JPEGs per synset) becomes JFT-style
shards in DIR/imagenet21k.
"""

import sys

from vit_jax.core import cli
from vit_jax.core import console


def main(argv=None):
  parser = cli.parser('prepare', __doc__, whole_doc=False)
  parser.add_argument('name', help='TFDS name or preset (imagenet2012, cifar10, vtab/dtd, ...)')
  parser.add_argument('--data_dir', help='TFDS data_dir (config.tfds_data_dir)')
  parser.add_argument('--manual_dir', help='manual downloads (config.tfds_manual_dir)')
  parser.add_argument('--file_format', default='array_record', choices=['array_record', 'tfrecord'])
  console.add_verbosity_flag(parser)
  args = parser.parse_args(argv)
  console.quiet_libraries(args.verbosity)

  from vit_jax.data.prepare import prepare

  with cli.reported():
    where = prepare(args.name, args.data_dir, args.manual_dir, args.file_format)
  print(f'{args.name} is prepared in {where}')


if __name__ == '__main__':
  sys.exit(cli.run(main))
