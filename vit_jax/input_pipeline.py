"""The official `vit_jax.input_pipeline` module path; the pipeline is `vit_jax.data.pipeline`."""

from vit_jax.configs.data import add_data_config  # noqa: F401
from vit_jax.configs.data import data_config  # noqa: F401
from vit_jax.data.datasets import register_arrays  # noqa: F401
from vit_jax.data.pipeline import DatasetInfo  # noqa: F401
from vit_jax.data.pipeline import get_info  # noqa: F401
from vit_jax.data.pipeline import make_eval_iterator  # noqa: F401
from vit_jax.data.pipeline import make_train_iterator  # noqa: F401
from vit_jax.data.sources import DataError  # noqa: F401
