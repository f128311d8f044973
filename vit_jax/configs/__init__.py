"""Configs: model architectures (`configs.architectures`), experiment defaults and the paper's recipes.

The experiment files users pass to `--config` live in the repository's
`configs/` folder; they call `recipes` and `common` here.
"""

from vit_jax.core.errors import UserError


class ConfigError(UserError, ValueError):
  """A config that cannot run: a bad recipe argument, an unknown model, values that clash; one line."""


class UnknownModelError(ConfigError, KeyError):
  """A model name that `configs.architectures.MODEL_CONFIGS` does not have (a KeyError, as for a dict)."""
