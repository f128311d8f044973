"""Closed-form FLOPs of a ViT: what a compiler's count is checked against.

2 x the multiply-accumulates of the matmuls (patch embedding, attention
projections and products, MLP, the MAP head, pre-logits, head); a training step costs 3x
the forward pass (paper appendix D.5's convention). Normalisations, softmax,
GELU and the optimizer are left out: they are a few percent of a ViT.
"""

from typing import Optional


def forward_flops_per_image(arch, image_size: int, num_classes: int) -> Optional[float]:
  """Forward FLOPs of one image through `arch` (a `ModelSpec.architecture`); None for hybrids."""
  if arch.resnet is not None:
    return None
  d, t, patch = arch.hidden_size, arch.block, arch.patch_size[0]
  patches = (image_size // patch) ** 2
  tokens = patches + arch.num_prefix_tokens
  per_block = (
    tokens * d * 3 * d  # q, k, v
    + 2 * tokens * tokens * d  # q k^T and the weighted sum of v
    + tokens * d * d  # output projection
    + 2 * tokens * d * t.mlp_dim  # MLP
  )
  macs = patches * patch * patch * 3 * d + arch.num_layers * per_block
  if arch.classifier == 'map':  # the probe's q; k, v of every token; products; out; MLP
    macs += d * d + 2 * tokens * d * d + 2 * tokens * d + d * d + 2 * d * t.mlp_dim
  width = d
  if arch.representation_size:
    macs += d * arch.representation_size
    width = arch.representation_size
  macs += width * num_classes
  return 2.0 * macs


def train_flops_per_image(arch, image_size: int, num_classes: int) -> Optional[float]:
  forward = forward_flops_per_image(arch, image_size, num_classes)
  return None if forward is None else 3.0 * forward


def head_macs_per_vector(width: int, hidden: int, bottleneck: int, layers: int, prototypes: int):
  """Multiply-accumulates of one vector through a DINO head (`models.dino.DinoHead`)."""
  widths = [width] + [hidden] * (layers - 1) + [bottleneck]
  return sum(a * b for a, b in zip(widths[:-1], widths[1:])) + bottleneck * prototypes


def self_distillation_flops_per_image(arch, config) -> Optional[float]:
  """FLOPs of one image's self-distillation step (task='dino', `training.dino`), every crop
  counted as DINOv3 counts its MFU: the student's forward and backward (3x) on the 2 global
  and the local crops, the teacher's forward on the global crops, and the heads: the class
  tokens of every crop and the masked patches' slots (each global crop's largest mask) through
  the DINO head (and iBOT's, when separate). None for hybrids."""
  d, ibot = config.dino, config.ibot
  global_ = forward_flops_per_image(arch, config.pp.crop, 0)
  local = forward_flops_per_image(arch, d.local_crop, 0) if d.local_crops else 0.0
  if global_ is None:
    return None
  backbone = 3 * (2 * global_ + d.local_crops * local) + 2 * global_
  width = arch.hidden_size
  dino_head = head_macs_per_vector(
    width, d.head_hidden, d.head_bottleneck, d.head_layers, d.prototypes
  )
  patch_head = dino_head
  if ibot.separate_head:
    patch_head = head_macs_per_vector(
      width, ibot.head_hidden, ibot.head_bottleneck, ibot.head_layers, ibot.prototypes
    )
  grid = config.pp.crop // arch.patch_size[0]
  slots = 2 * max(int(grid * grid * ibot.mask_ratio[1]), 1) if ibot.weight else 0
  heads = dino_head * (3 * (2 + d.local_crops) + 2) + patch_head * slots * (3 + 1)
  return backbone + 2.0 * heads


def run_flops_per_image(config, arch, num_classes: int) -> Optional[float]:
  """A run's training FLOPs per image: `self_distillation_flops_per_image` for task='dino', else
  `train_flops_per_image` at the run's crop."""
  if config.get('task') == 'dino':
    return self_distillation_flops_per_image(arch, config)
  return train_flops_per_image(arch, config.pp.crop, num_classes)
