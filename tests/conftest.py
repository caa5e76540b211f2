import os

# Must happen before jax is imported anywhere in the test session.
os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.random as jr  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture
def getkey():
    """Returns a function that hands out fresh, deterministic PRNG keys."""
    key = jr.PRNGKey(0)

    def _getkey():
        nonlocal key
        key, sub = jr.split(key)
        return sub

    return _getkey


@pytest.fixture
def key():
    return jr.PRNGKey(1234)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """A persistent compilation cache shared by the demo subprocesses of a module."""
    path = tmp_path_factory.getbasetemp() / "moe_eqx_jax_cache"
    path.mkdir(exist_ok=True)
    return path
