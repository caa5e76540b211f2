"""The whole layer lowered for accelerators, on this CPU-only machine: a primitive with
no lowering on a platform fails here, not on a user's GPU or TPU.

Only `jax.jit(f).trace(...).lower(lowering_platforms=(platform,))` runs: nothing is
compiled or executed for the accelerator, and no GPU, CUDA plugin or libtpu is needed.
The expert-parallel cases use the 8 simulated CPU devices of the test session as their
mesh: a `shard_map` over a CPU mesh lowers for another platform as it is (the lowered
module says `mhlo.num_partitions = 8`). What a lowering check cannot catch: anything
XLA only rejects when compiling (e.g. XLA:CPU has no `ragged-all-to-all` and says so
at compile time, while its lowering succeeds for every platform).

What each platform's users get: the layer is called with `platform=` (what `"auto"`
resolves for), and the exchange is `"ragged"`, named explicitly (at these small shapes
`"auto"` picks `allgather`: `tests/test_exchange_auto.py` lowers that choice):

- `cuda`: the ragged exchange (`lax.ragged_all_to_all`, a `@ragged_all_to_all` custom
    call) with the `mosaic_gpu` GMM (Hopper, bfloat16 activations; `@mosaic_gpu*`
    custom calls; named explicitly, since "auto" needs a Hopper device to pick it) and
    with the `tiled` GMM (what "auto" picks on other GPUs, float32).
- `tpu`: the ragged exchange with the `pallas_tpu` GMM (its decode kernel for few
    rows, the library's own grouped kernels for more: `tpu_custom_call`s only).

The all-gather exchange (`exchange="allgather"`) is lowered for each of these too.

The assertions count collectives and custom calls in `lowered.as_text()`, so that a
silently different path (the dense exchange, another GMM, a missing fallback) fails.
"""

import functools as ft
import re
from collections import Counter

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import pytest
from helpers import loss_fn, mesh as cpu_mesh
from jax.sharding import PartitionSpec as P

import moe_eqx as me

pytestmark = pytest.mark.lowering_only

NUM_SHARDS = 8
TOKENS = 128  # 16 per shard
AXIS = "expert"


# ---------------------------------------------------------------------------------
# What this jax can lower, probed once per platform (skip, with the error, otherwise).


@ft.cache
def _platform_error(platform: str) -> str | None:
    """Why this jax cannot lower the layer's primitives for `platform`, or None."""
    mesh = jax.make_mesh(
        (2,),
        ("i",),
        devices=jax.devices("cpu")[:2],
        axis_types=(jax.sharding.AxisType.Auto,),
    )

    def body(x, w, sizes):
        ones = jnp.ones((2,), jnp.int32)
        offsets = jnp.arange(2, dtype=jnp.int32)
        x = jax.lax.ragged_all_to_all(
            x, jnp.zeros_like(x), offsets, ones, offsets, ones, axis_name="i"
        )
        x = jax.lax.all_to_all(x, "i", 0, 0, tiled=True)
        x = x + jax.lax.all_gather(x, "i", tiled=True)[: x.shape[0]]
        return jax.lax.ragged_dot(x, w, sizes)

    f = jax.shard_map(
        body, mesh=mesh, in_specs=(P("i"), P(), P()), out_specs=P("i"), check_vma=False
    )
    args = (
        jnp.ones((4, 8), jnp.float32),
        jnp.ones((2, 8, 8), jnp.float32),
        jnp.ones((2,), jnp.int32),
    )
    try:
        jax.jit(jax.grad(lambda *a: jnp.sum(f(*a)), argnums=(0, 1))).trace(*args).lower(
            lowering_platforms=(platform,)
        )
    except Exception as e:  # any failure: "cannot lower here"
        return f"{type(e).__name__}: {e}".splitlines()[0][:300]
    return None


def _require_platform(platform: str) -> None:
    error = _platform_error(platform)
    if error is not None:
        pytest.skip(f"jax {jax.__version__} cannot lower for {platform!r}: {error}")


@ft.cache
def _mosaic_error() -> str | None:
    """Why the Mosaic GPU ragged-dot kernel cannot be lowered for cuda here, or None."""
    try:
        from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu
    except Exception as e:
        return f"cannot import the Mosaic GPU kernels: {type(e).__name__}: {e}"
    lhs = jnp.ones((128, 64), jnp.bfloat16)
    rhs = jnp.ones((2, 64, 64), jnp.bfloat16)
    sizes = jnp.full((2,), 64, jnp.int32)
    kernel = ft.partial(
        ragged_dot_mgpu.ragged_dot,
        block_m=64,
        block_n=64,
        block_k=64,
        max_concurrent_steps=2,
        grid_block_n=1,
    )
    try:
        jax.jit(lambda a, b, s: kernel(a, b, group_sizes=s)).trace(
            lhs, rhs, sizes
        ).lower(lowering_platforms=("cuda",))
    except Exception as e:
        return f"{type(e).__name__}: {e}".splitlines()[0][:300]
    return None


class _DeviceWithSMs:
    # H100/H200 SXM: 132 streaming multiprocessors.
    core_count = 132


class _JaxWithAGPU:
    """`jax`, except that `devices()` is one GPU-like device with `core_count`."""

    def __getattr__(self, name):
        return getattr(jax, name)

    @staticmethod
    def devices(*args, **kwargs):
        return [_DeviceWithSMs()]


@pytest.fixture
def mosaic_lowerable(monkeypatch):
    """Skips without the Mosaic GPU kernels. jax's `d_rhs` kernel
    (`transposed_ragged_dot_mgpu.transposed_ragged_dot`, jax 0.10) sizes its grid with
    `jax.devices()[0].core_count` while tracing, which a CPU device does not have
    (`AttributeError`): with no GPU present, that module alone sees a device with 132
    SMs. The lowered kernel is the same apart from its grid size."""
    error = _mosaic_error()
    if error is not None:
        pytest.skip(f"the Mosaic GPU kernels cannot be lowered for cuda: {error}")
    from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu

    if not hasattr(jax.devices()[0], "core_count") and hasattr(
        transposed_ragged_dot_mgpu, "jax"
    ):
        monkeypatch.setattr(transposed_ragged_dot_mgpu, "jax", _JaxWithAGPU())


# ---------------------------------------------------------------------------------
# Lowering and reading the lowered module.


def _lower(layer, x, mesh, platform: str, *, backward: bool, call=None):
    """Lowers the layer's forward (`y`) or the value and gradient of a scalar loss of
    `y` with respect to the layer's floating-point arrays and `x`."""
    if call is None:
        call = lambda l, x: l(x, mesh=mesh, platform=platform)  # noqa: E731

    def forward(args):
        layer, x = args
        y, _ = call(layer, x)
        return y

    def loss(args):
        return loss_fn(forward(args).astype(jnp.float32))

    fn = eqx.filter_value_and_grad(loss) if backward else forward
    arrays, static = eqx.partition((layer, x), eqx.is_array)
    traced = jax.jit(lambda a: fn(eqx.combine(a, static))).trace(arrays)
    return traced.lower(lowering_platforms=(platform,))


_COLLECTIVES = (
    "all_to_all",
    "all_gather",
    "all_reduce",
    "reduce_scatter",
    "collective_permute",
)
_OPS = re.compile(
    rf"stablehlo\.({'|'.join(_COLLECTIVES)})\b"
    r"|custom_call @(\w+)"
    r"|\"?chlo\.(ragged_dot)\b"
)
# Custom calls that carry no computation of their own (sharding annotations).
_SHARDING_CALLS = {"Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape"}


def _ops(text: str) -> Counter:
    """Collectives (`all_to_all`, ...), custom call targets (`ragged_all_to_all`,
    `mosaic_gpu_v2`, ...) and `ragged_dot`s in a lowered module's text."""
    return Counter(next(g for g in m.groups() if g) for m in _OPS.finditer(text))


def _collectives(ops: Counter) -> int:
    return sum(ops[n] for n in (*_COLLECTIVES, "ragged_all_to_all"))


def _custom_calls(ops: Counter) -> set[str]:
    return set(ops) - {*_COLLECTIVES, "ragged_dot"} - _SHARDING_CALLS


def _mosaic_calls(ops: Counter) -> int:
    return sum(n for name, n in ops.items() if name.startswith("mosaic_gpu"))


# (platform, gmm_backend, activation dtype): what a user of that platform runs.
_PATHS = [
    pytest.param("cuda", "mosaic_gpu", jnp.bfloat16, id="cuda-mosaic_gpu"),
    pytest.param("cuda", "auto", jnp.float32, id="cuda-auto(tiled)"),
    pytest.param("tpu", "auto", jnp.float32, id="tpu-auto(pallas_tpu)"),
]

# The expert-parallel configurations. Each is checked against "drop" (tokens out and
# back, at least two ragged all-to-alls): the dropless fallback adds the exact overflow
# decision, identical on every shard, and duplication the slot plan and the slot
# weights' fetch, so both have more collectives in their module than "drop" (counted
# in the text, where a loop body's ops appear once, not per iteration).
_CONFIGS = {
    "drop": dict(on_overflow="drop"),
    "fallback": dict(on_overflow="fallback"),
    "slots": dict(on_overflow="drop", num_slots=1),
    "token_chunks": dict(on_overflow="fallback", token_chunks=2),
}


def _layer(gmm_backend: str, dtype, **overrides):
    cfg = me.MoEConfig(
        d_model=64,
        d_ff=128,
        num_experts=16,
        top_k=2,
        gmm_backend=gmm_backend,
        axis_name=AXIS,
        **{"exchange": "ragged", **overrides},
    )
    layer = me.MoELayer(cfg, key=jr.key(0))
    x = jr.normal(jr.key(1), (TOKENS, cfg.d_model), jnp.float32).astype(dtype)
    return layer, x


def _check_gmm(
    ops: Counter, gmm_backend: str, backward: bool, platform: str, many: bool = False
) -> None:
    """`many`: the products have more rows than the TPU decode kernel takes."""
    if gmm_backend == "auto":
        gmm_backend = "pallas_tpu" if platform == "tpu" else "tiled"
    # No custom call but the exchange's and the Mosaic kernels' (e.g. no new kernel
    # in the tiled or ragged_dot path, which would need its own lowering check).
    allowed = {"ragged_all_to_all"}
    if gmm_backend == "mosaic_gpu":
        allowed |= {c for c in ops if c.startswith("mosaic_gpu")}
    if gmm_backend == "pallas_tpu":
        allowed |= {"tpu_custom_call"}
    assert _custom_calls(ops) <= allowed, ops
    # Two grouped matmuls per expert FFN; the backward adds d_lhs and d_rhs of each.
    least = 6 if backward else 2
    if gmm_backend == "pallas_tpu":
        if many:  # the own grouped kernels: every product a Pallas kernel
            assert ops["tpu_custom_call"] >= least and ops["ragged_dot"] == 0, ops
        else:  # the decode kernel forward, `ragged_dot` for its derivatives
            assert ops["ragged_dot"] + ops["tpu_custom_call"] >= least, ops
    elif gmm_backend == "mosaic_gpu":
        assert _mosaic_calls(ops) >= least, ops
        assert ops["ragged_dot"] == 0, ops
    elif gmm_backend == "ragged_dot":
        assert ops["ragged_dot"] >= least, ops
        assert _mosaic_calls(ops) == 0, ops
    else:  # tiled: plain XLA ops, neither of the others
        assert ops["ragged_dot"] == 0 and _mosaic_calls(ops) == 0, ops


def _float_weight_tensors(text: str, groups: int, cfg) -> list[str]:
    """The 16-bit float tensors shaped like the experts' weights of `groups` groups
    (`[groups, d_model, 2 d_ff]`, `[groups, d_ff, d_model]`) in a module's text."""
    shapes = (
        (groups, cfg.d_model, 2 * cfg.d_ff),
        (groups, cfg.d_ff, cfg.d_model),
    )
    pattern = "|".join("x".join(map(str, shape)) for shape in shapes)
    return re.findall(rf"tensor<(?:{pattern})x(?:bf16|f16)>", text)


def _prepare(platform, gmm_backend, request):
    _require_platform(platform)
    if gmm_backend == "mosaic_gpu":
        request.getfixturevalue("mosaic_lowerable")


# ---------------------------------------------------------------------------------
# The layer, lowered.


@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "fwd+bwd"])
@pytest.mark.parametrize(("platform", "gmm_backend", "dtype"), _PATHS)
def test_one_device_lowers(platform, gmm_backend, dtype, backward, request):
    _prepare(platform, gmm_backend, request)
    layer, x = _layer(gmm_backend, dtype)
    lowered = _lower(layer, x, None, platform, backward=backward)
    ops = _ops(lowered.as_text())
    # One device: all 128 tokens' 256 pairs in one call of the products.
    _check_gmm(ops, gmm_backend, backward, platform, many=True)
    collectives = ("all_to_all", "all_gather", "ragged_all_to_all", "all_reduce")
    assert not any(ops[c] for c in collectives), ops


@ft.cache
def _expert_parallel_ops(platform, gmm_backend, dtype, config, backward) -> Counter:
    """The ops of the layer lowered over 8 devices (cached: "drop" is the baseline
    of the other configurations)."""
    layer, x = _layer(gmm_backend, dtype, **_CONFIGS[config])
    lowered = _lower(layer, x, cpu_mesh(NUM_SHARDS), platform, backward=backward)
    text = lowered.as_text()
    assert f"mhlo.num_partitions = {NUM_SHARDS}" in text
    return _ops(text)


@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "fwd+bwd"])
@pytest.mark.parametrize("config", list(_CONFIGS))
@pytest.mark.parametrize(("platform", "gmm_backend", "dtype"), _PATHS)
def test_expert_parallel_lowers(
    platform, gmm_backend, dtype, config, backward, request
):
    _prepare(platform, gmm_backend, request)
    ops = _expert_parallel_ops(platform, gmm_backend, dtype, config, backward)
    _check_gmm(ops, gmm_backend, backward, platform)
    assert ops["all_to_all"] == 0, ops  # not the dense exchange
    assert ops["all_gather"] >= 1, ops  # the per-expert counts of all shards
    # Each exchange's transpose is a ragged all-to-all too.
    assert ops["ragged_all_to_all"] >= (4 if backward else 2), ops
    if config != "drop":
        drop = _expert_parallel_ops(platform, gmm_backend, dtype, "drop", backward)
        assert _collectives(ops) > _collectives(drop), (ops, drop)


@pytest.mark.parametrize("config", ["drop", "fallback"])
@pytest.mark.parametrize(("platform", "gmm_backend", "dtype"), _PATHS)
def test_allgather_exchange_lowers(platform, gmm_backend, dtype, config, request):
    """`exchange="allgather"`, forward and backward: tokens all-gathered and outputs
    reduce-scattered (the gather's transpose is a reduce-scatter, and back), no
    all-to-all of either kind."""
    _prepare(platform, gmm_backend, request)
    layer, x = _layer(gmm_backend, dtype, exchange="allgather", **_CONFIGS[config])
    lowered = _lower(layer, x, cpu_mesh(NUM_SHARDS), platform, backward=True)
    ops = _ops(lowered.as_text())
    _check_gmm(ops, gmm_backend, True, platform)
    assert ops["all_to_all"] == 0 and ops["ragged_all_to_all"] == 0, ops
    # The counts and the tokens gathered; the outputs reduce-scattered, and in the
    # backward the tokens' gather transposed to a reduce-scatter of their gradient
    # (a module's text holds each distinct call once).
    assert ops["all_gather"] >= 2 and ops["reduce_scatter"] >= 2, ops


@pytest.mark.parametrize(("platform", "gmm_backend", "dtype"), _PATHS)
def test_experts_split_over_data_lower(platform, gmm_backend, dtype, request):
    """Experts split over a data axis too (`fsdp_axes`, 2 x 4 mesh), forward and
    backward: the experts' gather and the gradients' reduce-scatter lower for the
    platform."""
    _prepare(platform, gmm_backend, request)
    layer, x = _layer(gmm_backend, dtype, fsdp_axes=("data",))
    mesh = jax.make_mesh(
        (2, 4),
        ("data", AXIS),
        devices=jax.devices("cpu")[:8],
        axis_types=(jax.sharding.AxisType.Auto,) * 2,
    )
    text = _lower(layer, x, mesh, platform, backward=True).as_text()
    ops = _ops(text)
    _check_gmm(ops, gmm_backend, True, platform)
    assert ops["ragged_all_to_all"] >= 4, ops
    assert ops["reduce_scatter"] >= 2, ops  # d w_gate_up, d w_down
    assert ops["all_gather"] >= 3, ops  # w_gate_up, w_down, the counts


@pytest.mark.parametrize(("platform", "gmm_backend", "dtype"), _PATHS)
def test_tensor_parallel_lowers(platform, gmm_backend, dtype, request):
    """Experts' `d_ff` split over a tensor axis (2 x 4, expert x tensor), forward and
    backward: the rows' all-gather and the outputs' reduce-scatter over the tensor
    axis, and the first product's regrouping (collective permutes), lower for the
    platform."""
    _prepare(platform, gmm_backend, request)
    layer, x = _layer(gmm_backend, dtype, tensor_axis="tensor", shared_d_ff=64)
    mesh = jax.make_mesh(
        (2, 4),
        (AXIS, "tensor"),
        devices=jax.devices("cpu")[:8],
        axis_types=(jax.sharding.AxisType.Auto,) * 2,
    )
    text = _lower(layer, x, mesh, platform, backward=True).as_text()
    ops = _ops(text)
    _check_gmm(ops, gmm_backend, True, platform)
    assert ops["ragged_all_to_all"] >= 4, ops
    assert ops["collective_permute"] >= 2, ops
    assert ops["reduce_scatter"] >= 2 and ops["all_gather"] >= 3, ops


# ---------------------------------------------------------------------------------
# The platform argument.


def test_platform_is_checked():
    layer, x = _layer("auto", jnp.float32)
    with pytest.raises(ValueError, match="platform"):
        layer(x, platform="metal")


def test_expert_parallel_shard_platform_argument():
    """Inside a user's own `shard_map`, `platform=` reaches the exchange as the
    layer's call does (the ragged exchange accepted for a GPU, with no check against
    the CPU the program is traced on)."""
    _require_platform("cuda")
    layer, x = _layer("tiled", jnp.float32)
    mesh = jax.make_mesh(
        (NUM_SHARDS,),
        (AXIS,),
        devices=jax.devices("cpu")[:NUM_SHARDS],
        axis_types=(jax.sharding.AxisType.Auto,),
    )
    call = jax.shard_map(
        lambda layer, x: me.expert_parallel_shard(layer, x, platform="cuda"),
        mesh=mesh,
        in_specs=(me.shard_specs(layer), P(AXIS)),
        out_specs=(P(AXIS), P()),
        check_vma=False,
    )
    lowered = _lower(layer, x, None, "cuda", backward=False, call=call)
    ops = _ops(lowered.as_text())
    assert ops["ragged_all_to_all"] >= 2 and ops["all_to_all"] == 0, ops


# ---------------------------------------------------------------------------------
# Quantized experts, lowered.


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "mxfp4", "int8"])
@pytest.mark.parametrize(("platform", "gmm_backend", "dtype"), _PATHS)
def test_quantized_experts_lower(platform, gmm_backend, dtype, fmt, request):
    """A layer with quantized experts, EP8 with a slot (the slot exchange moves the
    quantized bytes and scales), forward and backward: the same GMM path as a float
    layer's (no new custom call), the weights dequantized in the Mosaic kernels (FP8,
    int8), per expert (MXFP4 on Mosaic's fallback) or before `ragged_dot`, and no
    weight gradient (two products fewer than a float layer's backward)."""
    _prepare(platform, gmm_backend, request)
    layer, x = _layer(gmm_backend, dtype, **_CONFIGS["slots"])
    layer = me.quantize_experts(layer, fmt)
    lowered = _lower(layer, x, cpu_mesh(NUM_SHARDS), platform, backward=True)
    ops = _ops(lowered.as_text())
    # MXFP4 goes to Mosaic's fallback, `tiled`.
    mxfp4_on_mosaic = fmt == "mxfp4" and gmm_backend == "mosaic_gpu"
    _check_gmm(ops, "tiled" if mxfp4_on_mosaic else gmm_backend, False, platform)
    float_ops = _expert_parallel_ops(platform, gmm_backend, dtype, "slots", True)
    assert ops["ragged_all_to_all"] >= 4, ops
    if gmm_backend == "mosaic_gpu":
        # FP8 and int8 weights go into the kernels quantized (dequantized tile by
        # tile there); MXFP4 goes to the fallback (`tiled`, one expert at a time).
        # Neither holds a bfloat16 copy of a shard's groups (2 home experts, 1 slot).
        if not mxfp4_on_mosaic:
            assert 4 <= _mosaic_calls(ops) < _mosaic_calls(float_ops), (ops, float_ops)
        copies = _float_weight_tensors(lowered.as_text(), groups=3, cfg=layer.config)
        assert not copies, copies
    elif platform == "tpu":
        assert 4 <= ops["ragged_dot"] < float_ops["ragged_dot"], (ops, float_ops)
