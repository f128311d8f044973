"""The run directory (workdir): its files (`layout`), one run at a time (`lock`), failed
writes as one line (`storage`) and what a run logs as it goes (`run_log`).

The names callers use are here, so that `workdir.params_path(...)` reads as what it is.
"""

from vit_jax.workdir.layout import *  # noqa: F403
from vit_jax.workdir.lock import Lock as Lock
from vit_jax.workdir.lock import acquire as acquire
from vit_jax.workdir.storage import storage_errors as storage_errors
from vit_jax.workdir.storage import storage_failure as storage_failure
