"""Every public stage checks its inputs with runtime type checking off (as a user's
program runs: the test suite turns jaxtyping's hook on), giving a `ValueError` or
`TypeError` that names the argument: wrong shapes, dtypes, inconsistent sizes, and
concrete values out of range. Each case is also what the stage did wrong before:
`layer.experts` with the wrong number of group sizes ran silently, `me.gmm` with group
sizes summing past the rows too, and others failed deep inside with an unpacking or
reshape error."""

import equinox as eqx
import jax.numpy as jnp
import jax.random as jr
import jaxtyping
import numpy as np
import pytest

import moe_eqx as me
import moe_eqx.internal as mi

E, K, H, F = 8, 2, 16, 24


@pytest.fixture(autouse=True)
def no_type_checks(monkeypatch):
    monkeypatch.setattr(jaxtyping.config, "jaxtyping_disable", True)


@pytest.fixture(scope="module")
def layer():
    cfg = me.MoEConfig(d_model=H, d_ff=F, num_experts=E, top_k=K, shared_d_ff=8)
    return me.MoELayer(cfg, key=jr.key(0))


def _x(n=12, d=H, dtype=jnp.float32):
    return jr.normal(jr.key(1), (n, d)).astype(dtype)


def _raises(error, match, fn, *args, **kwargs):
    with pytest.raises(error, match=match):
        fn(*args, **kwargs)


def test_router(layer):
    r = layer.router
    _raises(
        ValueError, r"Router: `x` must have shape \(_, 16\), got \(12, 8\)", r, _x(d=8)
    )
    _raises(
        ValueError, r"Router: `x` must have shape \(_, 16\), got \(16,\)", r, _x()[0]
    )
    _raises(
        TypeError, r"Router: `x` must be floating-point", r, jnp.ones((4, H), jnp.int32)
    )
    _raises(
        ValueError,
        r"Router: `valid` must have shape \(12,\)",
        r,
        _x(),
        jnp.ones(5, bool),
    )
    _raises(TypeError, r"Router: `valid` must be boolean", r, _x(), jnp.ones(12))
    ids = jnp.zeros((12, 3), jnp.int32)
    _raises(
        ValueError,
        r"`experts` \(forced expert ids\) must have shape",
        r,
        _x(),
        experts=ids,
    )


def test_experts(layer):
    ex = layer.experts
    sizes = jnp.full((E,), 1, jnp.int32)
    _raises(
        ValueError,
        r"Experts: `group_sizes` must have shape \(8,\), got \(4,\)",
        ex,
        _x(),
        sizes[:4],
    )
    _raises(
        ValueError,
        r"Experts: `group_sizes` sums to 16, more than the 12 rows",
        ex,
        _x(),
        sizes * 2,
    )
    _raises(
        ValueError,
        r"Experts: `group_sizes` must be non-negative",
        ex,
        _x(),
        sizes.at[0].set(-1),
    )
    _raises(
        TypeError,
        r"Experts: `group_sizes` must be integer",
        ex,
        _x(),
        sizes.astype(jnp.float32),
    )
    _raises(ValueError, r"Experts: `x` must have shape \(_, 16\)", ex, _x(d=4), sizes)
    # Traced sizes are checked for their shape only (their values are not known).
    eqx.filter_jit(lambda ex, x, s: ex(x, s))(ex, _x(), sizes)


def test_shared_experts(layer):
    s = layer.shared_experts
    _raises(ValueError, r"SharedExperts: `x` must have shape \(_, 16\)", s, _x(d=4))
    _raises(
        TypeError,
        r"SharedExperts: `x` must be floating-point",
        s,
        jnp.ones((3, H), jnp.int32),
    )
    # Scored shared experts must split the hidden units evenly.
    units = s.w_down.shape[0]
    _raises(
        ValueError,
        rf"SharedExperts: `weights` score {units + 1} shared experts, which must "
        rf"divide the {units} hidden units",
        s,
        _x(),
        jnp.ones((_x().shape[0], units + 1)),
    )


def test_gmm():
    lhs, rhs = _x(), jnp.ones((4, H, 5))
    sizes = jnp.asarray([3, 3, 3, 3], jnp.int32)
    _raises(
        ValueError,
        r"gmm: `group_sizes` sums to 24, more than the 12 rows",
        me.gmm,
        lhs,
        rhs,
        sizes * 2,
    )
    _raises(
        ValueError,
        r"gmm: `rhs` must have shape \(3 axes\)|gmm: `rhs` must have",
        me.gmm,
        lhs,
        rhs[0],
        sizes,
    )
    _raises(ValueError, r"gmm: `lhs` must have", me.gmm, lhs[0], rhs, sizes)
    _raises(
        TypeError,
        r"gmm: `group_sizes` must be integer",
        me.gmm,
        lhs,
        rhs,
        sizes.astype(jnp.float32),
    )


def test_sort_by_expert_and_combine():
    experts = jnp.asarray([[0, 1], [2, 3], [1, 0]], jnp.int32)
    weights = jnp.full((3, 2), 0.5)
    _raises(
        ValueError,
        r"sort_by_expert: `experts` must have shape \(2 axes\)|must have",
        me.sort_by_expert,
        experts[0],
        weights,
        E,
    )
    _raises(
        ValueError,
        r"sort_by_expert: `weights` must have shape \(3, 2\)",
        me.sort_by_expert,
        experts,
        weights[:2],
        E,
    )
    _raises(
        TypeError,
        r"sort_by_expert: `experts` must be integer",
        me.sort_by_expert,
        weights,
        weights,
        E,
    )
    pairs = me.sort_by_expert(experts, weights, E)
    out = jnp.ones((6, H))
    _raises(
        ValueError,
        r"combine: `pairs.weight` must have shape \(5,\)",
        me.combine,
        out[:5],
        pairs,
        3,
    )
    _raises(
        ValueError,
        r"combine: `pairs.inverse` has 6 entries, not a multiple of `num_rows` \(4\)",
        me.combine,
        out,
        pairs,
        4,
    )
    np.testing.assert_allclose(me.combine(out, pairs, 3), jnp.ones((3, H)))


def test_overflow_predicate_and_planner():
    buffers = mi.buffer_sizes(
        tokens=4, top_k=2, num_shards=2, local_groups=2, dedup=True, buffer_factor=1.0
    )
    wire = jnp.ones((2, 2), jnp.int32)
    _raises(
        ValueError,
        r"overflow_predicate: `wire_counts` must have shape \(2, 2\)",
        me.overflow_predicate,
        wire[:1].repeat(2, 0)[:, :1],
        wire,
        buffers,
    )
    _raises(
        ValueError,
        r"overflow_predicate: `pair_counts` must have shape \(2, _\)",
        me.overflow_predicate,
        wire,
        jnp.ones((3, 2), jnp.int32),
        buffers,
    )
    _raises(
        TypeError,
        r"overflow_predicate: `buffers` must be a `BufferSizes`",
        me.overflow_predicate,
        wire,
        wire,
        4,
    )
    _raises(
        ValueError,
        r"plan_duplication: `counts` must have",
        me.plan_duplication,
        jnp.ones((8,), jnp.int32),
        num_slots=1,
    )
    _raises(
        TypeError,
        r"plan_duplication: `counts` must be integer",
        me.plan_duplication,
        jnp.ones((2, 8)),
        num_slots=1,
    )


def test_chunked_dropless():
    spec = mi.TripSpec(
        num_shards=1, local_groups=2,
        buffers=mi.buffer_sizes(tokens=4, top_k=2, num_shards=1, local_groups=2, dedup=True, buffer_factor=None),
        dedup=True, exchange="dense", gmm_backend=me.TiledGMM(), axis_name="expert",
    )  # fmt: skip
    ones = jnp.ones((4, 2))
    inputs = mi.TripInputs(
        x=jnp.ones((4, H)), weights=ones, dest_shard=jnp.zeros((4, 2), jnp.int32),
        dest_group=jnp.zeros((4, 2), jnp.int32), valid=jnp.ones((4, 2), bool),
        w_gate_up=jnp.ones((2, H, 2 * F)), w_down=jnp.ones((2, F, H)),
    )  # fmt: skip
    no = jnp.asarray(False)
    bad = inputs.__class__(**{**vars(inputs), "weights": ones[:3]})
    _raises(
        ValueError,
        r"chunked_dropless: `inputs.weights` must have shape \(4, 2\)",
        me.chunked_dropless,
        bad,
        spec,
        overflow=no,
        num_chunks=1,
    )
    bad = inputs.__class__(**{**vars(inputs), "w_gate_up": jnp.ones((3, H, 2 * F))})
    _raises(
        ValueError,
        r"chunked_dropless: `inputs.w_gate_up` must have shape \(2, 16, _\)",
        me.chunked_dropless,
        bad,
        spec,
        overflow=no,
        num_chunks=1,
    )
    _raises(
        ValueError,
        r"chunked_dropless: `overflow` must have shape \(\)",
        me.chunked_dropless,
        inputs,
        spec,
        overflow=jnp.zeros(2, bool),
        num_chunks=1,
    )
    _raises(
        ValueError,
        r"chunked_dropless: `num_chunks` must be an int >= 1",
        me.chunked_dropless,
        inputs,
        spec,
        overflow=no,
        num_chunks=0,
    )


def test_integer_settings_share_one_check():
    """Every integer setting goes through `_checks.check_int`: bools, floats and
    out-of-range values are refused by name, NumPy integers accepted."""
    from moe_eqx._checks import check_int

    check_int(np.int64(3), "n")
    check_int(None, "n", optional=True)
    check_int(0, "n", minimum=0)
    for bad, kw, want in [
        (True, {}, "`n` must be a positive integer, got True"),
        (2.0, {}, "`n` must be a positive integer"),
        (0, {}, "`n` must be a positive integer"),
        (-1, {"minimum": 0}, "`n` must be an integer >= 0"),
        (5, {"maximum": 4}, r"`n` must be an integer in \[1, 4\]"),
        (None, {}, "got None"),
        (0, {"optional": True}, "positive integer or None"),
    ]:
        with pytest.raises(ValueError, match=want):
            check_int(bad, "n", **kw)
    # Through the stages that hold such settings.
    for build, want in [
        (lambda: me.MoEConfig(d_model=8, d_ff=8, num_experts=4, top_k=True), "top_k"),
        (
            lambda: me.MoEConfig(
                d_model=8, d_ff=8, num_experts=4, top_k=1, num_groups=2, top_groups=3
            ),
            "top_groups",
        ),
        (
            lambda: me.MoEConfig(
                d_model=8, d_ff=8, num_experts=4, top_k=1, num_slots=-1
            ),
            "num_slots",
        ),
        (
            lambda: me.MoEConfig(
                d_model=8, d_ff=8, num_experts=4, top_k=1, token_chunks=0
            ),
            "token_chunks",
        ),
    ]:
        with pytest.raises(ValueError, match=want):
            build()
