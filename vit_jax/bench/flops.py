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
