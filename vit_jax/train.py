"""The official `vit_jax.train` module path: `train_and_evaluate(config, workdir)`.

The loop lives in `vit_jax.training.loop`, the step functions in
`vit_jax.training.steps`; this module only names them where users of the
original code look. `train_and_evaluate` takes the official configs
(`configs.official`) as `python -m vit_jax.main` does. `make_update_fn` is the
official one's contract on a jit over whole batches (no pmap, no per-device
batch axis).
"""

from vit_jax.configs import official
from vit_jax.core import console
from vit_jax.training import loop
from vit_jax.training.steps import TrainState  # noqa: F401
from vit_jax.training.steps import init_state  # noqa: F401
from vit_jax.training.steps import jit_eval_step  # noqa: F401
from vit_jax.training.steps import jit_train_step  # noqa: F401
from vit_jax.training.steps import make_task  # noqa: F401
from vit_jax.training.steps import make_update_fn  # noqa: F401
from vit_jax.training.steps import train_step  # noqa: F401


def train_and_evaluate(config, workdir: str) -> dict:
  """Trains and evaluates `config` (ours or an official one) in `workdir`; the summary."""
  console.leave_out_an_absent_tpu()
  return loop.train_and_evaluate(official.translate(config), workdir)
