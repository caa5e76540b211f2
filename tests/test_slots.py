"""Slot weights of duplicated experts: the plan is applied in the layer (replicas get
tokens) with the math unchanged, `gather_slot_weights` is exact in both exchanges and
both backward modes, the ragged offsets match the collective's semantics, and the
out-degree bound `max_exports` holds."""

import re

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from helpers import assert_matches_oracle, auto_mesh, make_layer, mesh, tokens
from jax.sharding import PartitionSpec as P

import moe_eqx as me
import moe_eqx.internal as mi
from moe_eqx import _slots
from moe_eqx._exchange.emulator import emulate_ragged_all_to_all
from moe_eqx._slots import (
    choose_slot_backward,
    export_slots,
    ragged_slot_args,
    slot_backward_copies,
    slot_routes,
)


@pytest.mark.parametrize("routing", ["zipf", "one_expert", "one_shard", "uniform"])
@pytest.mark.parametrize("num_shards", [2, 4, 8])
def test_duplication_matches_oracle_and_balances(getkey, num_shards, routing):
    layer = make_layer(
        getkey(),
        mesh_size=num_shards,
        bias_kind=routing,
        num_slots=2,
        top_k=2,
        buffer_factor=None,
    )
    x = tokens(getkey(), 128)
    stats = assert_matches_oracle(layer, x, mesh(num_shards))
    assert int(jnp.sum(stats.recv_pairs)) == 128 * 2
    assert float(stats.max_over_mean) <= float(stats.max_over_mean_before) + 1e-6
    if routing in ("one_expert", "one_shard"):
        # The plan really diverts pairs away from the hot shard.
        assert float(stats.max_over_mean) < float(stats.max_over_mean_before) - 0.2


def test_duplication_with_fallback_and_dedup_off(getkey):
    layer = make_layer(
        getkey(),
        mesh_size=4,
        bias_kind="one_shard",
        num_slots=1,
        buffer_factor=0.8,
        dedup=False,
    )
    x = tokens(getkey(), 128)
    stats = assert_matches_oracle(layer, x, mesh(4))
    assert bool(stats.fallback_used)


@pytest.mark.parametrize(
    "slot_backward,max_slot_exports,num_slots",
    [
        ("all_gather", None, 2),
        ("home", 1, 3),
        ("auto", 2, 1),
    ],
)
def test_layer_slot_backward_modes_match_oracle(
    getkey, slot_backward, max_slot_exports, num_slots
):
    # One hot shard: it exports as many copies as the bound allows.
    layer = make_layer(
        getkey(),
        mesh_size=4,
        bias_kind="one_shard",
        num_slots=num_slots,
        buffer_factor=None,
        slot_backward=slot_backward,
        max_slot_exports=max_slot_exports,
    )
    x = tokens(getkey(), 64)
    stats = assert_matches_oracle(layer, x, mesh(4))
    assert float(stats.max_over_mean) < float(stats.max_over_mean_before) - 0.2


class _RaggedSlotsExchange(me.DenseExchange):
    """A user's exchange: the dense token exchange, the ragged slot-weight one."""

    slot_exchange = "ragged"


@pytest.mark.parametrize("ragged_slots", [False, True])
def test_the_exchange_chooses_the_slot_collective(getkey, monkeypatch, ragged_slots):
    calls = []

    def spy(*args, **kwargs):
        calls.append(1)
        return _emulated_ragged_all_to_all(*args, **kwargs)

    monkeypatch.setattr(_slots, "_ragged_all_to_all", spy)
    kind = _RaggedSlotsExchange if ragged_slots else me.DenseExchange
    layer = make_layer(
        getkey(),
        mesh_size=4,
        bias_kind="one_shard",
        num_slots=2,
        buffer_factor=None,
        slot_backward="home",
        exchange=kind(axis_name="expert"),
    )
    stats = assert_matches_oracle(layer, tokens(getkey(), 64), mesh(4))
    assert float(stats.max_over_mean) < float(stats.max_over_mean_before) - 0.2
    # Traced forward and with its backward's trip home (at least two calls): ragged
    # exactly when the exchange says so.
    assert (len(calls) >= 2) if ragged_slots else not calls


def test_bad_slot_exchange_is_an_error():
    class Bad(me.DenseExchange):
        slot_exchange = "allgather"

    with pytest.raises(ValueError, match="`slot_exchange` 'allgather'"):
        me.MoEConfig(
            d_model=8, d_ff=8, num_experts=8, top_k=2, exchange=Bad(axis_name="expert")
        )


# --- gather_slot_weights against a direct computation --------------------------------


def _emulated_ragged_all_to_all(
    operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name
):
    """`lax.ragged_all_to_all`'s documented semantics from all-gathers (XLA:CPU has no
    lowering of the collective). A size mismatch or an out-of-bounds slice gives NaN."""
    ops = jax.lax.all_gather(operand, axis_name)
    sizes = jax.lax.all_gather(send_sizes, axis_name)  # [source, destination]
    starts = jax.lax.all_gather(input_offsets, axis_name)
    outs = jax.lax.all_gather(output_offsets, axis_name)
    me_ = jax.lax.axis_index(axis_name)
    rows = jnp.arange(output.shape[0])
    bad = jnp.zeros((), bool)
    for s in range(ops.shape[0]):
        start, size, src = outs[s, me_], sizes[s, me_], starts[s, me_]
        bad |= size != recv_sizes[s]
        bad |= (size > 0) & (
            (src < 0) | (src + size > operand.shape[0]) | (start + size > len(rows))
        )
        hit = (rows >= start) & (rows < start + size)
        value = ops[s][jnp.clip(src + rows - start, 0, operand.shape[0] - 1)]
        output = jnp.where(hit.reshape(-1, *[1] * (output.ndim - 1)), value, output)
    return jnp.where(bad, jnp.nan, output)


@pytest.fixture
def ragged_on_cpu(monkeypatch):
    monkeypatch.setattr(_slots, "_ragged_all_to_all", _emulated_ragged_all_to_all)


def _slot_fn(num_shards, num_local, **kwargs):
    m = auto_mesh(num_shards)

    def body(w_home, slot_expert):
        out = mi.gather_slot_weights(w_home, slot_expert, num_local, "expert", **kwargs)
        return jax.tree.map(lambda o: o[None], out)

    return jax.jit(
        jax.shard_map(
            body,
            mesh=m,
            in_specs=(P("expert"), P()),
            out_specs=P("expert"),
            check_vma=False,
        )
    )


def _direct(w, slot_expert):
    filled = (slot_expert >= 0).reshape(slot_expert.shape + (1,) * (w.ndim - 1))
    return jnp.where(filled, w[jnp.maximum(slot_expert, 0)], 0.0)


def _random_table(rng, num_shards, num_local, num_slots, max_exports):
    """A slot table as the planner makes them: distinct foreign experts per shard,
    empty slots last, no home shard exporting more than `max_exports` copies."""
    exports = np.zeros(num_shards, int)
    table = np.full((num_shards, num_slots), -1, np.int32)
    for d in rng.permutation(num_shards):
        want, chosen = rng.integers(0, num_slots + 1), []
        for e in rng.permutation(num_shards * num_local):
            home = e // num_local
            if len(chosen) < want and home != d and exports[home] < max_exports:
                exports[home] += 1
                chosen.append(e)
        table[d, : len(chosen)] = chosen
    return table


def _exports(table, num_local):
    table = np.asarray(table)
    return np.bincount(table[table >= 0] // num_local, minlength=table.shape[0])


# (R, L, table); the bound C used is the table's largest export count (tight).
_TABLES = {
    "mixed": (4, 2, [[2, 7], [0, -1], [0, 1], [-1, 3]]),
    "slots_gt_local": (4, 1, [[1, 2, 3], [0, 2, -1], [0, 1, 3], [-1, -1, -1]]),
    "bound_1": (4, 2, [[2, 7], [0, -1], [-1, -1], [5, -1]]),
    "all_empty": (4, 2, [[-1, -1]] * 4),
    "one_home_exports_all": (8, 1, [[-1]] + [[0]] * 7),
    "random_r8": (8, 2, _random_table(np.random.default_rng(0), 8, 2, 2, 99)),
    "random_r8_bound_2": (8, 1, _random_table(np.random.default_rng(1), 8, 1, 3, 2)),
}


@pytest.mark.parametrize("exchange", ["dense", "ragged"])
@pytest.mark.parametrize("backward", ["all_gather", "home"])
@pytest.mark.parametrize(
    "case,bounded",
    [(case, True) for case in sorted(_TABLES)]
    + [("mixed", False), ("random_r8", False)],
)
def test_gather_slot_weights_values_and_grads(
    getkey, ragged_on_cpu, case, bounded, backward, exchange
):
    r, local, table = _TABLES[case]
    table = jnp.asarray(table, jnp.int32)
    # The tight bound: the most copies any home shard exports (None: no bound).
    bound = max(1, int(_exports(table, local).max())) if bounded else None
    w = jr.normal(getkey(), (r * local, 3, 5))
    ct = jr.normal(getkey(), (r, table.shape[1], 3, 5))
    f = _slot_fn(r, local, max_exports=bound, backward=backward, exchange=exchange)

    @jax.jit
    def value_and_grad(w):
        out, vjp = jax.vjp(lambda w: f(w, table), w)
        return out, vjp(ct)[0]

    out, g = value_and_grad(w)  # out: [R, S, 3, 5]
    np.testing.assert_array_equal(out, _direct(w, table))
    want = jax.grad(lambda w: jnp.sum(_direct(w, table) * ct))(w)
    np.testing.assert_allclose(g, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backward", ["all_gather", "home"])
def test_gather_slot_weights_finite_differences(getkey, backward):
    r, local, table = _TABLES["mixed"]
    table = jnp.asarray(table, jnp.int32)
    w = jr.normal(getkey(), (r * local, 3, 5))
    f = _slot_fn(r, local, backward=backward)
    ct = jr.normal(getkey(), (r, 2, 3, 5))
    g = jax.grad(lambda w: jnp.sum(f(w, table) * ct))(w)
    d = jr.normal(getkey(), w.shape)
    eps = 1e-3
    fd = (jnp.sum(f(w + eps * d, table) * ct) - jnp.sum(f(w - eps * d, table) * ct)) / (
        2 * eps
    )
    np.testing.assert_allclose(fd, jnp.sum(g * d), rtol=1e-3)


@pytest.mark.parametrize("exchange", ["dense", "ragged"])
@pytest.mark.parametrize("backward", ["all_gather", "home"])
@pytest.mark.parametrize("case", ["mixed", "one_home_exports_all", "one_shard"])
def test_gather_slot_weights_of_a_pytree(
    getkey, ragged_on_cpu, case, backward, exchange
):
    """A tuple of weights (different shapes and dtypes, as `w_gate_up` and `w_down`)
    goes through one call: each leaf as if gathered alone, with its home weights in
    front, and each leaf's gradient its own (the leaves are never mixed)."""
    r, local, table = _TABLES[case] if case != "one_shard" else (1, 3, [[1, -1]])
    table = jnp.asarray(table, jnp.int32)
    ws = (
        jr.normal(getkey(), (r * local, 3, 5)),
        jr.normal(getkey(), (r * local, 4)).astype(jnp.bfloat16),
    )
    kwargs = dict(backward=backward, exchange=exchange, with_home=True)
    f = _slot_fn(r, local, **kwargs)
    groups = local + table.shape[1]
    cts = (
        jr.normal(getkey(), (r, groups, 3, 5)),
        jr.normal(getkey(), (r, groups, 4)).astype(jnp.bfloat16),
    )

    def direct(w):
        home = w.reshape(r, local, *w.shape[1:])
        return jnp.concatenate([home, _direct(w, table).astype(w.dtype)], axis=1)

    def loss(fn, ws):
        out = fn(ws)
        return sum(
            jnp.sum(o.astype(jnp.float32) * c.astype(jnp.float32))
            for o, c in zip(out, cts)
        )

    out = f(ws, table)
    for o, w in zip(out, ws, strict=True):
        assert o.dtype == w.dtype
        np.testing.assert_array_equal(o, direct(w))
    got = jax.grad(lambda ws: loss(lambda v: f(v, table), ws))(ws)
    want = jax.grad(lambda ws: loss(lambda v: tuple(map(direct, v)), ws))(ws)
    for g, w_ in zip(got, want, strict=True):
        assert g.dtype == w_.dtype
        tol = 1e-6 if g.dtype == jnp.float32 else 1e-2  # bfloat16: one rounding
        np.testing.assert_allclose(
            g.astype(jnp.float32), w_.astype(jnp.float32), rtol=tol, atol=tol
        )


def test_gather_slot_weights_one_shard_has_no_collective(getkey):
    w = jr.normal(getkey(), (4, 3))
    table = jnp.array([[2, -1]], jnp.int32)
    f = _slot_fn(1, 4, backward="home")
    np.testing.assert_array_equal(f(w, table)[0], _direct(w, table[0]))
    hlo = jax.jit(jax.grad(lambda w: jnp.sum(f(w, table)))).lower(w).as_text()
    for op in ("all-gather", "all-to-all", "all-reduce", "collective-permute"):
        assert op not in hlo.replace("_", "-")


# --- ragged offsets against the collective's semantics --------------------------------


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("r,local,s", [(2, 3, 2), (4, 1, 3), (8, 2, 2), (8, 4, 1)])
def test_ragged_slot_offsets_match_emulator(seed, r, local, s):
    rng = np.random.default_rng(seed)
    bound = 1 + seed % 3
    table = _random_table(rng, r, local, s, bound)
    routes = slot_routes(jnp.asarray(table), local, bound)
    w = rng.normal(size=(r * local, 3)).astype(np.float32)
    flat_local = np.asarray(routes.local).reshape(-1)

    # Forward: each home shard's [C] export buffer -> each shard's [S] buffer.
    operands, args = [], []
    for h in range(r):
        exports = np.asarray(export_slots(routes, h, bound))
        buf = np.zeros((bound, 3), np.float32)
        for j, f in enumerate(exports):
            if f >= 0:
                buf[j] = w[h * local + flat_local[f]]
        operands.append(buf)
        args.append([np.asarray(a) for a in ragged_slot_args(routes, h)[0]])
    recv = emulate_ragged_all_to_all(
        operands,
        [np.zeros((s, 3), np.float32) for _ in range(r)],
        *[[a[j] for a in args] for j in range(4)],
    )
    recv_pos = np.asarray(routes.recv_pos)
    for d in range(r):
        for slot in range(s):
            e = table[d, slot]
            if e >= 0:
                np.testing.assert_array_equal(recv[d][recv_pos[d, slot]], w[e])
            else:
                assert recv_pos[d, slot] == s  # out of range: reads zeros
        assert sorted(recv_pos[d][table[d] >= 0]) == list(range((table[d] >= 0).sum()))

    # Backward "home": each slot gradient to its home shard, in its export order.
    g = rng.normal(size=(r, s, 3)).astype(np.float32)
    operands, args = [], []
    for d in range(r):
        buf = np.zeros((s, 3), np.float32)
        for slot in range(s):
            if table[d, slot] >= 0:
                buf[recv_pos[d, slot]] = g[d, slot]
        operands.append(buf)
        args.append([np.asarray(a) for a in ragged_slot_args(routes, d)[1]])
    back = emulate_ragged_all_to_all(
        operands,
        [np.zeros((bound, 3), np.float32) for _ in range(r)],
        *[[a[j] for a in args] for j in range(4)],
    )
    seen = 0
    for h in range(r):
        for j, f in enumerate(np.asarray(export_slots(routes, h, bound))):
            if f >= 0:
                assert table.reshape(-1)[f] // local == h
                np.testing.assert_array_equal(back[h][j], g.reshape(-1, 3)[f])
                seen += 1
    assert seen == (table >= 0).sum()  # every slot gradient reached its home


# --- the out-degree bound ------------------------------------------------------------


def test_bound_violation_raises_on_a_concrete_table(getkey):
    w = jr.normal(getkey(), (2, 3))
    table = jnp.array([[1], [0], [0], [0]], jnp.int32)  # shard 0 exports 3 copies
    with pytest.raises(ValueError, match="home shard 0 export 3 copies"):
        mi.gather_slot_weights(w, table, 1, "expert", max_exports=2)


@pytest.mark.parametrize("exchange", ["dense", "ragged"])
def test_bound_violation_inside_jit_gives_nan_never_another_expert(
    getkey, ragged_on_cpu, exchange
):
    table = jnp.array([[1], [0], [0], [0]], jnp.int32)
    w = jr.normal(getkey(), (4, 3))
    out = _slot_fn(4, 1, max_exports=2, exchange=exchange)(w, table)
    np.testing.assert_array_equal(out[:3], _direct(w, table)[:3])
    # Shard 0's third copy (in destination order) is past the bound.
    assert bool(jnp.all(jnp.isnan(out[3])))


@pytest.mark.parametrize("bound", [1, 2, 3])
@pytest.mark.parametrize("routing", ["one_shard", "one_expert", "zipf"])
def test_planner_respects_the_export_bound(bound, routing):
    r, local, s = 8, 4, 2
    rng = np.random.default_rng(bound)
    if routing == "one_shard":
        weights = np.r_[np.ones(local), np.zeros((r - 1) * local)]
    elif routing == "one_expert":
        weights = np.r_[1.0, np.zeros(r * local - 1)]
    else:
        weights = 1.0 / np.arange(1, r * local + 1) ** 1.2
    counts = rng.multinomial(1000, weights / weights.sum(), size=r).astype(np.int32)
    plan = me.plan_duplication(jnp.asarray(counts), num_slots=s, max_exports=bound)
    table = np.asarray(plan.slot_expert)
    assert _exports(table, local).max() <= bound
    assert (table >= 0).any()  # the bound did not just switch duplication off
    np.testing.assert_array_equal(
        np.asarray(plan.expert_shard_pairs).sum(axis=1), counts.sum(axis=0)
    )


# --- backward modes: collectives and the `auto` choice --------------------------------


@pytest.mark.parametrize("backward", ["all_gather", "home"])
def test_backward_collectives(getkey, backward):
    r, local, table = _TABLES["mixed"]
    table = jnp.asarray(table, jnp.int32)
    w = jr.normal(getkey(), (r * local, 3, 5))
    f = _slot_fn(r, local, backward=backward)
    loss = jax.value_and_grad(lambda w: jnp.sum(f(w, table)))
    hlo = jax.jit(loss).lower(w).as_text().replace("_", "-")
    # Never a psum (all-reduce) of expert-sized tensors; the home mode sends each slot
    # gradient to its home by an all-to-all and gathers nothing.
    assert "all-reduce" not in hlo
    assert ("all-gather" in hlo) == (backward == "all_gather")
    assert hlo.count("all-to-all") == (1 if backward == "all_gather" else 2)


@pytest.mark.parametrize("backward", ["all_gather", "home"])
def test_ragged_buffers_are_exports_and_slots(backward):
    """The real ragged path, lowered for a GPU (XLA:CPU cannot compile it): forward
    `[C] -> [S]`, and with `home` the reverse trip `[S] -> [C]`; nothing `[R, S]`
    sized travels, unless the all-gather backward was asked for."""
    r, local, s, c = 8, 2, 2, 3
    f = jax.shard_map(
        lambda w, t: mi.gather_slot_weights(
            w, t, local, "expert", max_exports=c, backward=backward, exchange="ragged"
        )[None],
        mesh=auto_mesh(r),
        in_specs=(P("expert"), P()),
        out_specs=P("expert"),
        check_vma=False,
    )
    loss = jax.value_and_grad(lambda w, t: jnp.sum(jnp.square(f(w, t))))
    args = (
        jax.ShapeDtypeStruct((r * local, 64, 32), jnp.float32),
        jax.ShapeDtypeStruct((r, s), jnp.int32),
    )
    text = jax.jit(loss).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    calls = re.findall(
        r"@ragged_all_to_all\(.*: \((tensor<[^>]*>), (tensor<[^>]*>),.*-> (tensor<[^>]*>)",
        text,
    )
    forward = ("tensor<3x64x32xf32>", "tensor<2x64x32xf32>", "tensor<2x64x32xf32>")
    home = ("tensor<2x64x32xf32>", "tensor<3x64x32xf32>", "tensor<3x64x32xf32>")
    assert sorted(calls) == sorted([forward] + ([home] if backward == "home" else []))
    assert ("stablehlo.all_gather" in text) == (backward == "all_gather")
    assert "all_reduce" not in text
    assert "all_to_all" not in text.replace("ragged_all_to_all", "")


def test_auto_backward_picks_fewer_buffers():
    # Ragged: S + C against R*S.
    kw = dict(num_slots=2, exchange="ragged")
    assert choose_slot_backward("auto", num_shards=64, max_exports=4, **kw) == "home"
    assert choose_slot_backward("auto", num_shards=2, max_exports=4, **kw) == (
        "all_gather"
    )
    # Dense: 2 R min(S, C) against 2 R S (measured on CPU), home only when C < S.
    kw = dict(num_shards=8, exchange="dense")
    assert choose_slot_backward("auto", num_slots=2, max_exports=1, **kw) == "home"
    assert choose_slot_backward("auto", num_slots=2, max_exports=2, **kw) == (
        "all_gather"
    )
    assert choose_slot_backward("home", num_slots=2, max_exports=2, **kw) == "home"
    assert slot_backward_copies(
        "home", num_shards=8, num_slots=2, max_exports=3, exchange="ragged"
    ) == (2 + 3)


def test_bad_arguments(getkey):
    w = jr.normal(getkey(), (2, 3))
    table = jnp.zeros((4, 1), jnp.int32)
    for kwargs, match in [
        (dict(backward="psum"), "`backward`"),
        (dict(exchange="auto"), "`exchange`"),
        (dict(max_exports=0), "`max_exports`"),
    ]:
        with pytest.raises(ValueError, match=match):
            mi.gather_slot_weights(w, table, 2, "expert", **kwargs)
    # A runtime type-check error under the test suite's jaxtyping hook.
    with pytest.raises((ValueError, TypeError), match="slot_expert"):
        mi.gather_slot_weights(w, table[0], 2, "expert")
    base = dict(d_model=8, d_ff=8, num_experts=4, top_k=1)
    with pytest.raises(ValueError, match="`slot_backward`"):
        me.MoEConfig(**base, slot_backward="psum")
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="`max_slot_exports`"):
            me.MoEConfig(**base, max_slot_exports=bad)
    assert me.MoEConfig(**base, max_slot_exports=np.int64(3)).max_slot_exports == 3
