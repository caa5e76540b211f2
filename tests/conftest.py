import gc
import glob
import os

# Must happen before jax is imported anywhere in the test session.
os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
# Compilation dominates the suite's time, and most of XLA:CPU's compile time on these
# small programs goes to the LLVM backend's optimisation (threefry's unrolled rounds
# alone take seconds). The tests check what programs compute, not how fast the code
# runs; the HLO they compile is the same at every backend level.
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
# Default to the CPU only where there is no accelerator: on a GPU (or TPU) machine the
# GPU tests then run, while every other test still runs on the 8 CPU devices (see the
# `_cpu_unless_gpu_test` fixture and `helpers.mesh`).
HAS_ACCELERATOR = bool(glob.glob("/dev/nvidia[0-9]*") or glob.glob("/dev/accel[0-9]*"))


def _jaxlib_version() -> tuple[int, ...]:
    from importlib.metadata import version

    return tuple(int(p) for p in version("jaxlib").split(".")[:2] if p.isdigit())


# XLA:CPU's older emitters compile the same HLO faster than its fusion emitters
# (docs/measured.md, "Compile time"). They emit some ops (a scatter) otherwise, so a
# test that inspects a compiled program (its HLO, its memory) compiles it with XLA's
# own default emitters, as users do: `helpers.compile_as_users`. The flag exists in
# jaxlib 0.10 and is gone in 0.12, where an unknown flag aborts; an accelerator's
# machine keeps XLA's defaults.
if (
    not HAS_ACCELERATOR
    and _jaxlib_version() < (0, 11)
    and "xla_cpu_use_fusion_emitters" not in os.environ["XLA_FLAGS"]
):
    os.environ["XLA_FLAGS"] += " --xla_cpu_use_fusion_emitters=false"
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
    """Tests not marked `gpu` or `tpu` run on the CPU devices, as in CI, even where
    the default backend is an accelerator."""
    accelerator = request.node.get_closest_marker(
        "gpu"
    ) or request.node.get_closest_marker("tpu")
    if jax.default_backend() == "cpu" or accelerator:
        yield
        return
    with jax.default_device(jax.devices("cpu")[0]):
        yield


# `lost_pairs` enforced in every test. Every `MoEStats` the layer builds reports its
# `lost_pairs` to the host (a `jax.debug.callback`, which never stops the program: a
# check raised inside an 8-device program would abort it). The report goes to one
# session-wide list, not to a list of the test that traced the program: compiled
# programs outlive tests (jit caches are cleared per module), and a later test that
# runs one must be the test a loss in it is charged to. Installed once, before any
# test traces anything, so that no program is traced without it.
import moe_eqx._layer as _layer_module  # noqa: E402
import moe_eqx._stats as _stats_module  # noqa: E402

_LOST_PAIRS: list[int] = []  # non-zero `lost_pairs` reported since the last check
# Off from a `lowering_only` test until the next other test; the caches are cleared
# at each switch.
_report_lost_pairs_enabled = True
_routed_stats = _stats_module.routed_stats


def _report_lost_pairs(value):
    value = int(value)
    if value:
        _LOST_PAIRS.append(value)


def _routed_stats_reporting(**kwargs):
    stats = _routed_stats(**kwargs)
    if _report_lost_pairs_enabled:
        jax.debug.callback(_report_lost_pairs, stats.lost_pairs)
    return stats


_stats_module.routed_stats = _routed_stats_reporting
_layer_module.routed_stats = _routed_stats_reporting


def _take_lost_pairs() -> list[int]:
    jax.effects_barrier()  # every callback of the programs run so far has reported
    lost = list(_LOST_PAIRS)
    _LOST_PAIRS.clear()
    return lost


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Tests marked `lowering_only` lower for platforms that have no host callbacks,
    so what they trace carries no `lost_pairs` report. The caches are cleared between
    such a test and any other (before either's fixtures), so that neither runs or
    lowers a program the other traced."""
    global _report_lost_pairs_enabled
    report = item.get_closest_marker("lowering_only") is None
    if report != _report_lost_pairs_enabled:
        jax.clear_caches()
        _report_lost_pairs_enabled = report


@pytest.fixture(autouse=True)
def lost_pairs_seen(request):
    """The non-zero `lost_pairs` reported while this test ran (by whichever program,
    compiled in this test or before it); the test fails with `moe_eqx.LostPairsError`
    if any is left at its end. A test that loses pairs on purpose asserts on this list
    and clears it. `lowering_only` tests run nothing and are not checked."""
    yield _LOST_PAIRS
    if request.node.get_closest_marker("lowering_only"):
        return
    lost = _take_lost_pairs()
    if lost:
        import moe_eqx as me

        raise me.LostPairsError(f"lost_pairs was {lost} during this test")


@pytest.fixture(autouse=True, scope="session")
def _no_lost_pairs_after_the_last_test():
    """A loss reported outside any test (a module fixture's teardown) fails too."""
    yield
    lost = _take_lost_pairs()
    if lost:
        import moe_eqx as me

        raise me.LostPairsError(f"lost_pairs was {lost} after the last test")


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


@pytest.fixture
def mxfp4_transposed(monkeypatch):
    """Makes the TPU kernels read MXFP4 weights in their transposed orientation,
    `[G, K / 2, N]` (as where a TPU lays the stored bytes out with `N` minor-most),
    in place of this platform's layout. Yields the list of shapes asked about,
    which a test checks is not empty (the orientation was chosen). JAX's caches
    are cleared before and after, so that no trace of either orientation is
    reused by the other."""
    from moe_eqx._gmm import quantized_tpu

    asked = []

    def transposed(shape, dtype):
        asked.append(tuple(shape))
        return True

    jax.clear_caches()
    monkeypatch.setattr(quantized_tpu, "stores_transposed", transposed)
    yield asked
    jax.clear_caches()
