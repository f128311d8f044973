r"""Convert a checkpoint from the command line: `python -m vit_jax.export` (`interop.export`).

  python -m vit_jax.export --checkpoint=ViT-B_16.npz --model=ViT-B_16 --format=hf --output=vit-hf/
  python -m vit_jax.export --checkpoint=workdirs/demo --format=onnx --output=demo.onnx
  python -m vit_jax.export --checkpoint=vit-hf/ --model=ViT-B_16 --format=npz --output=back.npz

--checkpoint is any of: a public-layout .npz or a training workdir (its
params.npz), a timm state_dict (.safetensors, .pth), a transformers ViT folder
(config.json + model.safetensors). --format is what to write:

  timm        .safetensors named and shaped as timm's VisionTransformer.state_dict()
  hf          folder for transformers' ViTForImageClassification.from_pretrained()
  npz         the public .npz layout (import: fine-tune it with --config.pretrained_path)
  savedmodel  TF SavedModel via jax2tf; signature: float32 [B, H, W, 3] in [-1, 1]
  onnx        ONNX via timm + torch.onnx; input float32 [B, H, W, 3] in [-1, 1]

A folder as --output of a one-file format (timm, npz, onnx) gets the file
inside it: model.safetensors, params.npz, model.onnx. --model (a MODEL_CONFIGS name) may be left out for workdirs (summary.json
names it) and for files this tool wrote. Class names for `hf` come from
--labels, a transformers folder, or as predict gives them (a workdir's
record, its dataset, the ImageNet lists for 1000 / 21843-way heads of a file
or an ImageNet run). The output is written whole or not at all.
"""

import sys
from typing import List, Optional

from vit_jax.core import cli
from vit_jax.core import console


def main(argv: Optional[List[str]] = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  # Before TensorFlow and JAX start (the formats' modules import them).
  console.quiet_libraries(console.verbosity_in(argv))

  from vit_jax.evaluation import loader
  from vit_jax.interop import export

  parser = cli.parser('export', __doc__)
  cli.add_checkpoint_flags(parser, '.npz, workdir, timm .safetensors/.pth, or transformers folder')
  parser.add_argument(
    '--format',
    required=True,
    choices=export.FORMATS,
    metavar='FORMAT',
    help=f'one of {", ".join(export.FORMATS)}',
  )
  parser.add_argument(
    '--output',
    required=True,
    help='file (timm, npz, onnx; a folder: model.safetensors, params.npz, model.onnx in it) or '
    'folder (hf, savedmodel)',
  )
  parser.add_argument('--labels', help="class names for hf, one per line, in the head's order")
  parser.add_argument(
    '--tag',
    help="a timm file's weights, as timm names them (TAG or NAME.TAG, e.g. "
    'vit_large_patch14_clip_224.openai): their preprocessing is recorded with the conversion '
    '(default: what the file, a config.json beside it or its hub folder says)',
  )
  console.add_verbosity_flag(parser)
  args = parser.parse_args(argv)
  with cli.reported():
    output = export.output_path(args.format, args.output)
    with cli.writing(output):
      notes = export.export(
        args.checkpoint,
        args.format,
        output,
        args.model,
        args.labels,
        args.patch_size,
        args.resample,
        args.tag,
      )
    cli.note(parser.prog, loader.unfinished_note(args.checkpoint))
  print(f'wrote {args.format} to {output}')
  for note in notes:
    print(f'  {note}')
  return 0


if __name__ == '__main__':
  sys.exit(cli.run(main))
