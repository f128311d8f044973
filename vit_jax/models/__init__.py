"""Models: the ViT (`vit`), the ResNet of the hybrids (`resnet`), masked patch prediction (`mpp`).

Also the official `vit_jax.models` API:
`models.VisionTransformer(num_classes=..., **MODEL_CONFIGS[name])`.
"""

from vit_jax.models.resnet import StdConv  # noqa: F401
from vit_jax.models.vit import AddPositionEmbs  # noqa: F401
from vit_jax.models.vit import Encoder  # noqa: F401
from vit_jax.models.vit import Encoder1DBlock  # noqa: F401
from vit_jax.models.vit import MlpBlock  # noqa: F401
from vit_jax.models.vit import MultiHeadDotProductAttention  # noqa: F401
from vit_jax.models.vit import VisionTransformer  # noqa: F401
