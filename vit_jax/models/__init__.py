"""Models: the ViT (`vit`), the ResNet of the hybrids (`resnet`), masked patch prediction (`mpp`).

Also the official `vit_jax.models` API: `models.get_model(name, **kw)` and
`models.VisionTransformer(num_classes=..., **MODEL_CONFIGS[name])`.
"""

from vit_jax.configs import architectures as _architectures
from vit_jax.models.resnet import StdConv  # noqa: F401
from vit_jax.models.vit import AddPositionEmbs  # noqa: F401
from vit_jax.models.vit import Encoder  # noqa: F401
from vit_jax.models.vit import Encoder1DBlock  # noqa: F401
from vit_jax.models.vit import MlpBlock  # noqa: F401
from vit_jax.models.vit import MultiHeadDotProductAttention  # noqa: F401
from vit_jax.models.vit import VisionTransformer


def get_model(name, **kw):
  """The official `models.get_model`: `VisionTransformer(**MODEL_CONFIGS[name], **kw)`.

  Mixer and LiT names raise a one-line KeyError saying they are out of scope.
  """
  return VisionTransformer(**_architectures.MODEL_CONFIGS[name], **kw)
