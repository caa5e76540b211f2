import gc
import glob
import os

# Must happen before jax is imported anywhere in the test session.
os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
# Default to the CPU only where there is no accelerator: on a GPU (or TPU) machine the
# GPU tests then run, while every other test still runs on the 8 CPU devices (see the
# `_cpu_unless_gpu_test` fixture and `helpers.mesh`).
HAS_ACCELERATOR = bool(glob.glob("/dev/nvidia[0-9]*") or glob.glob("/dev/accel[0-9]*"))
if not HAS_ACCELERATOR:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.random as jr  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(autouse=True)
def _cpu_unless_gpu_test(request):
    """Tests not marked `gpu` run on the CPU devices, as in CI, even where the default
    backend is an accelerator."""
    if jax.default_backend() == "cpu" or request.node.get_closest_marker("gpu"):
        yield
        return
    with jax.default_device(jax.devices("cpu")[0]):
        yield


@pytest.fixture(autouse=True)
def lost_pairs_seen(monkeypatch, request):
    """`lost_pairs` enforced in every test: each `MoEStats` the layer builds reports
    its `lost_pairs` to the host (a `jax.debug.callback`, which never stops the
    program: a check raised inside an 8-device program would abort it), and a test
    during which any was not 0 fails with `moe_eqx.LostPairsError`. A test that
    loses pairs on purpose asserts on this list (the non-zero counts seen) and
    clears it. Tests marked `lowering_only` run nothing (they lower for platforms
    that have no host callbacks) and are left alone."""
    if request.node.get_closest_marker("lowering_only"):
        yield []
        return
    import moe_eqx._layer as layer
    import moe_eqx._shard as shard

    lost = []
    original = shard.routed_stats

    def record(value):
        value = int(value)
        if value:
            lost.append(value)

    def routed_stats(**kwargs):
        stats = original(**kwargs)
        jax.debug.callback(record, stats.lost_pairs)
        return stats

    monkeypatch.setattr(shard, "routed_stats", routed_stats)
    monkeypatch.setattr(layer, "routed_stats", routed_stats)
    yield lost
    if lost:
        import moe_eqx as me

        raise me.LostPairsError(f"lost_pairs was {lost} during this test")


@pytest.fixture
def getkey():
    """Returns a function that hands out fresh, deterministic PRNG keys."""
    key = jr.key(0)

    def _getkey():
        nonlocal key
        key, sub = jr.split(key)
        return sub

    return _getkey


@pytest.fixture
def key():
    return jr.key(1234)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """A persistent compilation cache shared by the demo subprocesses of a module."""
    path = tmp_path_factory.getbasetemp() / "moe_eqx_jax_cache"
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Drops every compiled program after each test module. Each XLA:CPU executable of
    an 8-device program holds its code in many memory mappings; kept for the whole
    session they reached the kernel's limit (vm.max_map_count, 65530: measured 63,568
    after test_real_models) and the next compilation crashed with a segfault. Cleared
    per module, the count stays under ~15,000."""
    yield
    jax.clear_caches()
    gc.collect()
