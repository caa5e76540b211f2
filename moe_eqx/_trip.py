"""One expert-parallel round trip on one shard, the capped path (the documentation's
"How it works"): dedup dispatch -> exchange -> expand to pairs -> expert GMM -> combine
per wire row -> exchange back -> sum per token. With an exchange that gathers tokens
(`exchange="allgather"`): all-gather the tokens -> keep this shard's pairs -> expand to
pairs -> expert GMM -> combine per gathered token -> reduce-scatter. Runs inside
`shard_map`.
"""

import functools as ft

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from ._activation import SWIGLU, AbstractActivation
from ._autodiff import custom_linear, symbolic_zeros_to_none
from ._buffers import BufferSizes
from ._checks import check_array
from ._combine import combine, weight_inputs
from ._dispatch import WireRows, dedup_rows, expand_rows
from ._exchange import (
    AbstractExchange,
    ExchangePlan,
    make_exchange,
    make_exchange_plan,
)
from ._experts import expert_ffn
from ._gmm import AbstractGMMBackend, GradAcc
from ._permute import sum_rows
from ._quant import QuantizedWeight
from ._rules import acc_dtype, count_at_or_below
from ._tensor import pooled


class TripSpec(eqx.Module):
    """Static settings of a round trip.

    **Fields:**

    - `num_shards`: `R`, the size of the expert-parallel mesh axis.
    - `local_groups`: `G = L + S`, the groups of this shard's grouped matmul (its `L`
        home experts, then its `S` slots). Not [`moe_eqx.MoEConfig`][]`.num_groups`
        (routing groups).
    - `buffers`: the [`moe_eqx.internal.BufferSizes`][] of the trip.
    - `dedup`: one wire row per (token, shard) or one per pair (a row exchange
        only: the all-gather exchange gathers each token once).
    - `exchange`: `"dense"`, `"ragged"`, `"allgather"` or an exchange instance
        (resolved: see
        `moe_eqx.internal.exchange_name` for the config's `"auto"`).
    - `gmm_backend`: a GMM backend name or instance, as in [`moe_eqx.MoEConfig`][].
    - `axis_name`: the expert-parallel mesh axis.
    - `activation`: the experts' [`moe_eqx.AbstractActivation`][].
    - `weight_on_input`: the routing weight scales the expert's input (Llama-4),
        not its output.
    - `tensor_axis`: the mesh axis the experts' `d_ff` is split over
        (`MoEConfig.tensor_axis`; `activation` is then a `TensorSplit`), or `None`.
    """

    num_shards: int = eqx.field(static=True)
    local_groups: int = eqx.field(static=True)
    buffers: BufferSizes
    dedup: bool = eqx.field(static=True)
    exchange: str | AbstractExchange = eqx.field(static=True)
    gmm_backend: str | AbstractGMMBackend = eqx.field(static=True)
    axis_name: str = eqx.field(static=True)
    activation: AbstractActivation = eqx.field(static=True, default=SWIGLU)
    weight_on_input: bool = eqx.field(static=True, default=False)
    tensor_axis: str | None = eqx.field(static=True, default=None)


class TripStats(eqx.Module):
    """What one round trip really did on one shard, counted from the data it moved
    (summed over chunks by the fallback). None of it is derived from a plan.

    **Fields:**

    - `computed_pairs`: pairs this shard's grouped matmul processed (its group sizes
        after expanding the received rows).
    - `recv_rows`: wire rows this shard received that carry at least one pair (with
        the all-gather exchange: gathered tokens with at least one pair here).
    - `dropped_pairs`: pairs of this shard's tokens not sent because their receiver
        was full, plus pairs this shard received but could not fit in its pair buffer.
    """

    computed_pairs: Int[Array, ""]
    recv_rows: Int[Array, ""]
    dropped_pairs: Int[Array, ""]


class TripInputs(eqx.Module):
    """What one shard feeds a round trip: its tokens, where each of their pairs goes,
    and its local expert weights.

    **Fields:**

    - `x`: `[T, d_in]` this shard's tokens (`d_in = d_model`, or one more column of
        ones when the experts' biases are folded into their weights).
    - `weights`: `[T, k]` routing weights.
    - `dest_shard`, `dest_group`: `[T, k]` physical destination (shard, local group) of
        each pair.
    - `valid`: `[T, k]` pairs to process (the others are not sent).
    - `w_gate_up`, `w_down`: this shard's local expert weights, `G = L + S` groups (home
        experts, then slots).
    """

    x: Float[Array, "tokens d_in"]
    weights: Float[Array, "tokens k"]
    dest_shard: Int[Array, "tokens k"]
    dest_group: Int[Array, "tokens k"]
    valid: Bool[Array, "tokens k"]
    w_gate_up: Float[Array, "groups d_in two_d_ff"] | QuantizedWeight
    w_down: Float[Array, "groups d_ff d_model"] | QuantizedWeight


def check_trip_inputs(inputs: TripInputs, spec: TripSpec, *, where: str) -> None:
    """`inputs` fit one another and `spec`, else a `TypeError` or `ValueError` naming
    the field (checked at trace time, whether or not runtime type checking is on)."""
    if not isinstance(inputs, TripInputs) or not isinstance(spec, TripSpec):
        raise TypeError(
            f"{where}: `inputs` must be `TripInputs` and `spec` a `TripSpec`, got "
            f"{type(inputs).__name__} and {type(spec).__name__}."
        )
    check_array("inputs.x", inputs.x, ndim=2, kind="float", where=where)
    tokens = inputs.x.shape[0]
    k = inputs.weights.shape[-1] if inputs.weights.ndim == 2 else None
    for name, kind in (
        ("weights", "float"),
        ("dest_shard", "int"),
        ("dest_group", "int"),
        ("valid", "bool"),
    ):
        a = getattr(inputs, name)
        check_array(f"inputs.{name}", a, shape=(tokens, k), kind=kind, where=where)
    groups = (spec.local_groups, inputs.x.shape[1], None)
    check_array("inputs.w_gate_up", inputs.w_gate_up, shape=groups, where=where)
    shape = (spec.local_groups, None, None)
    check_array("inputs.w_down", inputs.w_down, shape=shape, where=where)


def expert_parallel_trip(
    inputs: TripInputs, spec: TripSpec, grad_acc: GradAcc | None = None
):
    """Sends each token to the shards holding its experts and brings the results back.

    **Arguments:**

    - `inputs`: this shard's [`moe_eqx.internal.TripInputs`][].
    - `spec`: static [`moe_eqx.internal.TripSpec`][].
    - `grad_acc`: optional weight-gradient accumulators, passed through (see
        `moe_eqx.AbstractGMMBackend.ffn`).

    **Returns:**

    `(y, stats)`: `[T, d_model]` and this shard's [`moe_eqx.internal.TripStats`][]; with
    `grad_acc`, `(y, stats, grad_acc)`. Pairs that do not fit the buffers contribute
    zero and are counted in `stats.dropped_pairs`.
    """
    bufs = spec.buffers
    exchange = make_exchange(
        spec.exchange, axis_name=spec.axis_name, block_rows=bufs.block_rows
    )
    # The one place the two kinds of exchange part ways.
    trip = _gather_trip if exchange.gathers_tokens else _row_trip
    y, stats, grad_acc = trip(inputs, spec, exchange, grad_acc)
    return (y, stats) if grad_acc is None else (y, stats, grad_acc)


def _row_trip(inputs: TripInputs, spec: TripSpec, exchange, grad_acc):
    """The round trip of an exchange that moves wire rows
    ([`moe_eqx.AbstractRowExchange`][]): dedup dispatch, exchange, the receiver's
    pairs, the return trip. Returns `(y, stats, grad_acc)`."""
    bufs = spec.buffers
    wire = dedup_rows(
        inputs.dest_shard,
        inputs.dest_group,
        inputs.weights,
        inputs.valid,
        num_shards=spec.num_shards,
        dedup=spec.dedup,
    )
    counts = jax.lax.all_gather(wire.send_counts, spec.axis_name)  # [R, R]
    shard = jax.lax.axis_index(spec.axis_name).astype(jnp.int32)
    plan = make_exchange_plan(counts, bufs.rows, shard)
    recv_x, recv_groups, recv_weights = send_rows(inputs.x, wire, plan, exchange, bufs)
    # `recv_x` is the exchange's unpacked layout: B rows or more.
    y_rows, computed, dropped_at_receiver, grad_acc = _compute_pairs(
        recv_x, recv_groups, recv_weights, inputs, spec, grad_acc
    )
    y = return_rows(y_rows, wire, plan, exchange, bufs)
    stats = TripStats(
        computed_pairs=computed.astype(jnp.int32),
        recv_rows=jnp.sum(jnp.any(recv_groups >= 0, axis=1)).astype(jnp.int32),
        dropped_pairs=(
            _unsent_pairs(wire, plan, bufs.send_rows) + dropped_at_receiver
        ).astype(jnp.int32),
    )
    return y, stats, grad_acc


def _compute_pairs(recv_x, recv_groups, recv_weights, inputs, spec, grad_acc):
    """The receiver's work, whichever exchange delivered its rows: expand the rows'
    `(group, weight)` entries (group -1: none) to pairs grouped by local group, at
    most `spec.buffers.pairs` of them, run the experts and sum each row's pairs.
    Returns `(y_rows, computed, dropped, grad_acc)`: the pairs computed and dropped.

    With `spec.tensor_axis`, the rows of every device of the tensor axis are pooled
    (`moe_eqx._tensor.pooled`), each device computing all of them with its hidden
    units in a buffer as many times larger; the counts are then those of this
    device's own rows, so that the stats count each pair once."""
    if spec.tensor_axis is None:
        y_rows, pairs, dropped, grad_acc = _pairs_of_rows(
            recv_x, recv_groups, recv_weights, inputs, spec, grad_acc, 1
        )
        return y_rows, jnp.sum(pairs.group_sizes), dropped, grad_acc
    axis = spec.tensor_axis
    size = jax.lax.axis_size(axis)
    num_rows = recv_x.shape[0]

    def compute(x, groups, weights):
        y, pairs, _, acc = _pairs_of_rows(
            x, groups, weights, inputs, spec, grad_acc, size
        )
        # This device's own rows' pairs that were computed.
        own = jax.lax.axis_index(axis) * num_rows
        slot = jnp.arange(pairs.row.shape[0], dtype=jnp.int32)
        kept = (slot < jnp.sum(pairs.group_sizes)) & (
            pairs.row // num_rows == own // num_rows
        )
        return y, jnp.sum(kept), acc

    y_rows, computed, grad_acc = pooled(
        compute, axis, recv_x, recv_groups, recv_weights
    )
    valid = jnp.sum(recv_groups >= 0)
    return y_rows, computed, valid - computed, grad_acc


def _pairs_of_rows(recv_x, recv_groups, recv_weights, inputs, spec, grad_acc, pool):
    """`_compute_pairs` on one set of rows, with `pool` times the pair buffer.
    Returns `(y_rows, pairs, dropped, grad_acc)`."""
    num_rows = recv_x.shape[0]
    pairs, dropped = expand_rows(
        recv_groups,
        recv_weights,
        jnp.asarray(num_rows, jnp.int32),
        local_groups=spec.local_groups,
        capacity=spec.buffers.pairs * pool,
    )
    # Gathers both ways where the candidate slots are dense (`_sort_pairs`).
    expert_in = pairs.rows_of(recv_x)
    if spec.weight_on_input:
        expert_in, pairs = weight_inputs(expert_in, pairs)
    expert_out = expert_ffn(
        expert_in,
        inputs.w_gate_up,
        inputs.w_down,
        pairs.group_sizes,
        backend=spec.gmm_backend,
        grad_acc=grad_acc,
        activation=spec.activation,
    )
    if grad_acc is not None:
        expert_out, grad_acc = expert_out
    return combine(expert_out, pairs, num_rows), pairs, dropped, grad_acc


def _gather_trip(inputs: TripInputs, spec: TripSpec, exchange, grad_acc):
    """The round trip of an exchange that gathers tokens
    ([`moe_eqx.AllGatherExchange`][]): every shard receives all `R * T` tokens of its
    group with their pairs' destinations, keeps the pairs of its own groups, computes
    them, and one reduce-scatter sums each token's outputs on its own shard.
    Returns `(y, stats, grad_acc)`."""
    groups = spec.local_groups
    # One int per pair: its physical destination `shard * G + group`, -1 for none.
    dest = jnp.where(
        inputs.valid, inputs.dest_shard * groups + inputs.dest_group, -1
    ).astype(jnp.int32)
    with jax.named_scope("moe_eqx.exchange"):
        g_x, g_weights, g_dest = _gather_tokens(
            exchange, inputs.x, inputs.weights, dest
        )
    shard = jax.lax.axis_index(spec.axis_name).astype(jnp.int32)
    mine = (g_dest >= shard * groups) & (g_dest < (shard + 1) * groups)
    g_groups = jnp.where(mine, g_dest - shard * groups, -1)
    g_weights = jnp.where(mine, g_weights, jnp.zeros((), g_weights.dtype))
    y_rows, computed, dropped, grad_acc = _compute_pairs(
        g_x, g_groups, g_weights, inputs, spec, grad_acc
    )
    with jax.named_scope("moe_eqx.exchange"):
        # Summed in float32, as the row exchanges sum a token's returned rows.
        acc = acc_dtype(y_rows.dtype)
        y = exchange.scatter(y_rows.astype(acc)).astype(y_rows.dtype)
    stats = TripStats(
        computed_pairs=computed.astype(jnp.int32),
        recv_rows=jnp.sum(jnp.any(mine, axis=1)).astype(jnp.int32),
        dropped_pairs=dropped.astype(jnp.int32),
    )
    return y, stats, grad_acc


@ft.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _gather_tokens(exchange, x, weights, dest):
    # The activations and the pairs' metadata in one collective: the same bits.
    packed = exchange.gather(_pack(x, (weights, dest)))
    return _unpack(packed, x.shape[1], (weights, dest), x.dtype)


def _gather_tokens_jvp(exchange, primals, tangents):
    x, weights, dest = primals
    t_x, t_weights, _ = symbolic_zeros_to_none(tangents)
    out = _gather_tokens(exchange, x, weights, dest)
    # The tangents travel through the gather itself, a linear collective that JAX
    # transposes to the reduce-scatter (and back, for higher orders).
    t_out = [
        jnp.zeros(o.shape, o.dtype) if t is None else exchange.gather(t)
        for o, t in zip(out[:2], (t_x, t_weights), strict=True)
    ]
    return out, (*t_out, np.zeros(out[2].shape, jax.dtypes.float0))


_gather_tokens.defjvp(_gather_tokens_jvp, symbolic_zeros=True)


_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def _as_units(a: Array, size: int) -> Array:
    """`[N, c]` of any dtype as `[N, c']` unsigned integers of `size` bytes (the same
    bits; `c * itemsize` must be a multiple of `size`, or `size` of `itemsize`)."""
    unit = _UINT[size]
    itemsize = a.dtype.itemsize
    if itemsize == size:
        return jax.lax.bitcast_convert_type(a, unit)
    if itemsize > size:  # [N, c] -> [N, c, itemsize / size] -> [N, c * ...]
        return jax.lax.bitcast_convert_type(a, unit).reshape(a.shape[0], -1)
    ratio = size // itemsize
    return jax.lax.bitcast_convert_type(a.reshape(a.shape[0], -1, ratio), unit)


def _from_units(u: Array, dtype, columns: int) -> Array:
    """Inverse of `_as_units`: `[N, columns]` of `dtype`."""
    size, itemsize = u.dtype.itemsize, jnp.dtype(dtype).itemsize
    if itemsize == size:
        return jax.lax.bitcast_convert_type(u, dtype)
    if itemsize > size:
        return jax.lax.bitcast_convert_type(u.reshape(u.shape[0], columns, -1), dtype)
    return jax.lax.bitcast_convert_type(u, dtype).reshape(u.shape[0], columns)


def _pack(rows: Array, extras: tuple[Array, ...]) -> Array:
    """`rows [N, d]` and the `extras` (`[N, c]` each) as one `[N, d + e]` array, for
    one collective. Of `rows.dtype` when every extra has it (a concatenation);
    otherwise unsigned integers as wide as `rows.dtype`: the same bits (moving
    integers never changes them, where floats could be canonicalised), the extras
    padded to whole units."""
    if all(e.dtype == rows.dtype for e in extras):
        # A bitcast to integers would be one more copy of the rows on XLA:CPU.
        return jnp.concatenate([rows, *extras], axis=1)
    size = rows.dtype.itemsize
    parts = [_as_units(rows, size)]
    for e in extras:
        if (e.shape[1] * e.dtype.itemsize) % size:
            pad = -(e.shape[1] * e.dtype.itemsize) % size
            e = _as_units(e, 1)
            e = jnp.pad(e, ((0, 0), (0, pad)))
            parts.append(_as_units(e, size) if size > 1 else e)
        else:
            parts.append(_as_units(e, size))
    return jnp.concatenate(parts, axis=1)


def _unpack(packed: Array, d: int, like: tuple, dtype) -> tuple:
    """Inverse of `_pack`: `(rows, *extras)`, the `d` rows' columns of `dtype` and
    the extras shaped `[N, c]` like `like`."""
    if packed.dtype == dtype and all(jnp.dtype(s.dtype) == dtype for s in like):
        ends = np.cumsum([d, *(s.shape[1] for s in like)])
        return tuple(jnp.split(packed, ends[:-1], axis=1))
    size = packed.dtype.itemsize
    out, offset = [_from_units(packed[:, :d], dtype, d)], d
    for s in like:
        nbytes = s.shape[1] * jnp.dtype(s.dtype).itemsize
        units = -(-nbytes // size)
        part = packed[:, offset : offset + units]
        if nbytes % size:
            part = _as_units(part, 1)[:, :nbytes]
        out.append(_from_units(part, s.dtype, s.shape[1]))
        offset += units
    return tuple(out)


class _Route(eqx.Module):
    """What both trips of one exchange need besides the rows: the backend, its plan,
    the sender's rows (`token`, `order`, `inverse`) and the buffer sizes; for the
    dispatch trip's tangent, which of `(x, weights)` it carries and the shapes of
    what it receives."""

    exchange: AbstractExchange = eqx.field(static=True)
    plan: ExchangePlan
    wire: WireRows
    bufs: BufferSizes = eqx.field(static=True)
    want: tuple[bool, bool] = eqx.field(static=True, default=(True, True))
    received: tuple = eqx.field(static=True, default=())

    def move(self, rows, extras: tuple, dispatch: bool):
        """`rows` (`[N, d]`, or `None`) and `extras` (`[N, c]` each) through one
        collective: the dispatch trip, or the return trip. Returns `(rows, *extras)`
        on the other side (`rows` `None` if it was)."""
        base, rest = (rows, extras) if rows is not None else (extras[0], extras[1:])
        packed = _pack(base, rest) if rest else base
        if dispatch:
            moved = self.exchange.dispatch_unpacked(packed, self.plan, self.bufs.rows)
        else:
            # The return trip (the dispatch's transpose) hands the cotangents to the
            # collective as they are: a scatter-add's or a fused sum of gathers'
            # output (see `moe_eqx.internal.expand_rows`), or their packing, a
            # concatenation that XLA:CPU writes once and slices for the collective.
            # Copying it first (`materialised=False`) cost more step time than the
            # slices cost compile time (docs/measured.md).
            moved = self.exchange.combine_unpacked(
                packed, self.plan, self.bufs.send_rows, materialised=True
            )
        if not rest:
            parts = (moved,)
        else:
            parts = _unpack(moved, base.shape[1], rest, base.dtype)
        return parts if rows is not None else (None, *parts)


def _send(route: _Route, lin):
    """The dispatch trip of `(x, weights)`, linear in both (`None`: zero): each wire
    row's token activation and routing weights, in the exchange's unpacked receive
    layout."""
    x, weights = lin
    rows = None if x is None else x[route.wire.token]  # rows past the real ones stay
    recv_x, *recv_w = route.move(rows, () if weights is None else (weights,), True)
    zeros = [jnp.zeros(s.shape, s.dtype) for s in route.received]
    return zeros[0] if recv_x is None else recv_x, recv_w[0] if recv_w else zeros[1]


def _send_t(route: _Route, ct):
    """Its transpose: the rows go back (the return trip), each token summing its
    rows (gathers by `wire.token_rows`, not a scatter-add)."""
    ct_x, ct_weights = ct
    want_x, want_weights = route.want
    rows, *d_weights = route.move(
        ct_x if want_x else None, (ct_weights,) if want_weights else (), False
    )
    d_x = None
    if want_x:
        wire = route.wire
        d_x = _sum_token_rows(rows, wire).astype(ct_x.dtype)
    return d_x, d_weights[0] if want_weights else None


@ft.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _send_rows(exchange, bufs, plan, wire, x, weights, groups):
    packed = _pack(x[wire.token], (weights, groups))
    recv = exchange.dispatch_unpacked(packed, plan, bufs.rows)
    return _unpack(recv, x.shape[1], (weights, groups), x.dtype)


def _send_rows_jvp(exchange, bufs, primals, tangents):
    plan, wire, x, weights, groups = primals
    *_, t_x, t_weights, _ = symbolic_zeros_to_none(tangents)
    out = _send_rows(exchange, bufs, plan, wire, x, weights, groups)
    want = (t_x is not None, t_weights is not None)
    received = tuple(jax.ShapeDtypeStruct(o.shape, o.dtype) for o in out[:2])
    route = _Route(exchange, plan, wire, bufs, want, received)
    t_x, t_w = custom_linear(_send, _send_t, route, (t_x, t_weights), out[:2])
    return out, (t_x, t_w, np.zeros(out[2].shape, jax.dtypes.float0))


_send_rows.defjvp(_send_rows_jvp, symbolic_zeros=True)


def send_rows(
    x: Float[Array, "tokens d_model"],
    wire: WireRows,
    plan: ExchangePlan,
    exchange: AbstractExchange,
    bufs: BufferSizes,
) -> tuple[
    Float[Array, "recv_rows d_model"],
    Int[Array, "recv_rows width"],
    Float[Array, "recv_rows width"],
]:
    """The dispatch trip: each wire row's token activation and its `(group, weight)`
    entries, in the exchange's unpacked receive layout (`[B, ...]` or more rows: the
    trip needs each row's content, not its position), all in one collective. Returns
    `(x, groups, weights)`; rows that did not arrive have group -1 and weight 0: what
    is computed is counted from what really arrived, not from the plan. Its transpose
    is the return trip."""
    with jax.named_scope("moe_eqx.exchange"):
        # Groups go shifted by one, so a row that never arrived (zeros) has none.
        recv_x, recv_w, recv_g = _send_rows(
            exchange, bufs, plan, wire, x, wire.weights, wire.groups + 1
        )
    return recv_x, recv_g - 1, recv_w


def _return(route: _Route, y_rows):
    """The return trip of the receiver's rows, each token summing its rows."""
    # The receiver's combine (a scatter-add, or a fused sum of gathers: see
    # `moe_eqx.internal.expand_rows`) writes its output once: it goes to the
    # collective without a copy.
    back = route.exchange.combine_unpacked(
        y_rows, route.plan, route.bufs.send_rows, materialised=True
    )
    return _sum_token_rows(back, route.wire).astype(y_rows.dtype)


def _sum_token_rows(rows, wire: WireRows):
    """Each token's sum of its wire rows (float32), `w` gathers by `token_rows`."""
    # A token may have fewer rows than `w` (entries `N`): gathers with bounds.
    return sum_rows(rows, wire.order, wire.token_rows, wire.num_tokens, full=False)


def _return_t(route: _Route, ct_y):
    rows = ct_y[route.wire.token]
    return route.exchange.dispatch_unpacked(rows, route.plan, route.bufs.rows)


def return_rows(
    y_rows: Float[Array, "recv_rows d_model"],
    wire: WireRows,
    plan: ExchangePlan,
    exchange: AbstractExchange,
    bufs: BufferSizes,
) -> Float[Array, "tokens d_model"]:
    """The return trip: each received row goes back to its sender, which sums a
    token's rows (rows never sent are zero). Its transpose is the dispatch trip."""
    with jax.named_scope("moe_eqx.exchange"):
        route = _Route(exchange, plan, wire, bufs)
        out = jax.ShapeDtypeStruct((wire.num_tokens, y_rows.shape[1]), y_rows.dtype)
        return custom_linear(_return, _return_t, route, y_rows, out)


def _unsent_pairs(wire: WireRows, plan: ExchangePlan, send_rows: int) -> Int[Array, ""]:
    """Pairs of this shard's rows not sent because their receiver is full (only
    possible when overflow is allowed): counted on the sender, which knows how many
    pairs each row carries."""
    num_shards = plan.sizes.shape[0]
    row = jnp.arange(send_rows, dtype=jnp.int32)
    starts = plan.send_offsets[plan.shard]
    row_dest = jnp.clip(count_at_or_below(starts, row) - 1, 0, num_shards - 1)
    is_real = row < jnp.sum(wire.send_counts)
    unsent = is_real & (row - starts[row_dest] >= plan.sizes[plan.shard, row_dest])
    return jnp.sum(jnp.where(unsent, wire.num_pairs, 0))
