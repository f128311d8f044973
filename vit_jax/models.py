"""Public model API: `models.VisionTransformer(num_classes=..., **MODEL_CONFIGS[name])`."""

from vit_jax.models_resnet import StdConv  # noqa: F401
from vit_jax.models_vit import AddPositionEmbs  # noqa: F401
from vit_jax.models_vit import Encoder  # noqa: F401
from vit_jax.models_vit import Encoder1DBlock  # noqa: F401
from vit_jax.models_vit import MlpBlock  # noqa: F401
from vit_jax.models_vit import MultiHeadDotProductAttention  # noqa: F401
from vit_jax.models_vit import VisionTransformer  # noqa: F401
