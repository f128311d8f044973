"""The official module path `vit_jax.configs.models`: the registry lives in `configs.architectures`.

Official code and configs import it by this name (`from vit_jax.configs
import models as models_config`, `models.get_b16_config()`); everything it
had is here under the same names.
"""

from vit_jax.configs.architectures import *  # noqa: F403
from vit_jax.configs.architectures import AUGREG_CONFIGS  # noqa: F401
from vit_jax.configs.architectures import GIANTS  # noqa: F401
from vit_jax.configs.architectures import MODEL_CONFIGS  # noqa: F401
