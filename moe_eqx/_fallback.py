"""Chunked dropless fallback, an explicit `custom_vjp` (the README's "How it works",
**Overflow**).

The local tokens are split into `n` chunks small enough that one chunk's worst case
(`R * c` wire rows, `R * c * min(k, G)` pairs) fits the capped buffers, and the chunks run
in a loop, so no pair is ever dropped and peak memory stays that of the capped path
(within one `[T, d_model]` buffer when the layer is compiled with both, see
`capped_or_fallback`). The forward keeps only its inputs as residuals; the backward
re-runs one chunk at a time and accumulates the expert-weight gradients in the loop
carry, in place (the GMM backward adds into the carry; an unrolled loop would keep
every chunk's weight gradient alive at once).
"""

import functools as ft
import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from ._dispatch import WireRows
from ._overflow import BufferSizes, buffer_sizes
from ._rules import acc_dtype, match_varying, per_token_counts
from ._trip import (
    TripInputs,
    TripSpec,
    TripStats,
    expert_parallel_trip,
    trip_wire_rows,
)


def fallback_chunking(
    *,
    tokens: int,
    top_k: int,
    num_shards: int,
    local_groups: int,
    dedup: bool,
    capped: BufferSizes,
) -> tuple[int, BufferSizes]:
    """The smallest chunk count whose per-chunk worst case fits the capped buffers.

    When the capped buffers cannot hold even one token from every shard (small
    per-shard batches, e.g. decoding one token per shard), the chunks are single
    tokens with the smallest buffers that hold their worst case: `R` wire rows and
    `R * min(k, G)` pairs. That is more than the capped buffers (it is the price of
    never dropping a pair at that batch size), and never more than the worst case of
    the whole batch.

    **Arguments:**

    - `tokens`: `T`, tokens per shard.
    - `top_k`, `num_shards`, `local_groups`, `dedup`: as for [`moe_eqx.buffer_sizes`][].
    - `capped`: the capped path's [`moe_eqx.BufferSizes`][].

    **Returns:**

    `(num_chunks, chunk_buffers)`; `chunk_buffers` are worst-case buffers for one chunk,
    no larger than the capped ones unless a single token's worst case exceeds them.
    """
    per_token_pairs, per_token_rows = per_token_counts(
        top_k=top_k, local_groups=local_groups, dedup=dedup
    )
    chunk = min(
        tokens,
        capped.rows // (num_shards * per_token_rows),
        capped.pairs // (num_shards * per_token_pairs),
    )
    chunk = max(chunk, 1)
    num_chunks = max(math.ceil(tokens / chunk), 1)
    chunk = max(math.ceil(tokens / num_chunks), 1)  # same chunk count, least padding
    bufs = buffer_sizes(
        tokens=chunk,
        top_k=top_k,
        num_shards=num_shards,
        local_groups=local_groups,
        dedup=dedup,
        buffer_factor=None,
    )
    return num_chunks, bufs


def _window(i, chunk: int, tokens: int):
    """Chunk `i`'s rows: `chunk` rows from `start` (the last chunk is moved back to end
    at `tokens`, so that no chunk needs padding), and which of them it owns (rows of the
    previous chunk it overlaps are not its own: they send nothing and keep what that
    chunk wrote)."""
    start = jnp.minimum(i * chunk, tokens - chunk)
    own = start + jnp.arange(chunk, dtype=jnp.int32) >= i * chunk
    return start, own


def _take(a: Array, start, chunk: int) -> Array:
    return jax.lax.dynamic_slice_in_dim(a, start, chunk)


def _put(a: Array, rows: Array, start, own) -> Array:
    """Writes the owned `rows` of one chunk into `a` (in place in the loop carry)."""
    own = own.reshape(own.shape + (1,) * (rows.ndim - 1))
    rows = jnp.where(own, rows.astype(a.dtype), _take(a, start, rows.shape[0]))
    return jax.lax.dynamic_update_slice_in_dim(a, rows, start, 0)


def _chunk(inputs: TripInputs, i, num_chunks: int, upcast: bool = False):
    """Chunk `i` of `inputs` (its weights tied to it, see `_per_chunk`), and where it
    sits: `(chunk_inputs, start, own)`. With `upcast`, the chunk's activations are
    cast to the weights' dtype instead of the weights to theirs."""
    tokens = inputs.x.shape[0]
    chunk = math.ceil(tokens / num_chunks)
    start, own = _window(i, chunk, tokens)
    x = _take(inputs.x, start, chunk)
    wide = inputs.w_gate_up.dtype
    if upcast and jnp.finfo(wide).bits > jnp.finfo(x.dtype).bits:
        x = x.astype(wide)
    w_gate_up, w_down = _per_chunk(inputs.w_gate_up, inputs.w_down, x)
    chunk_inputs = TripInputs(
        x=x,
        weights=_take(inputs.weights, start, chunk),
        dest_shard=_take(inputs.dest_shard, start, chunk),
        dest_group=_take(inputs.dest_group, start, chunk),
        valid=_take(inputs.valid, start, chunk) & own[:, None],
        w_gate_up=w_gate_up,
        w_down=w_down,
    )
    return chunk_inputs, start, own


def _per_chunk(w_gate_up, w_down, x_chunk):
    """The weights, tied to the chunk so that XLA does not hoist their cast to the
    activation dtype out of the loop: hoisted, the cast is a whole low-precision copy
    of the weights held across the loop, where the capped path fuses it into each
    product (measured: +1 MiB, 2.4%, with bf16 activations)."""

    if w_gate_up.dtype == x_chunk.dtype and w_down.dtype == x_chunk.dtype:
        return w_gate_up, w_down  # no cast to hoist (and a barrier's output is a copy)
    w_gate_up, w_down, _ = jax.lax.optimization_barrier((w_gate_up, w_down, x_chunk))
    return w_gate_up, w_down


def _forward_loop(
    trips, y, stats: TripStats, inputs: TripInputs, spec, num_chunks, upcast=False
):
    """Runs chunks `0 .. trips - 1` (all of them, or none: `trips` may be traced),
    writing their outputs into `y` and summing their stats into `stats`."""

    def body(i, carry):
        y, total = carry
        chunk, start, own = _chunk(inputs, i, num_chunks, upcast)
        y_c, stats_c = expert_parallel_trip(chunk, spec)
        return _put(y, y_c, start, own), jax.tree.map(jnp.add, total, stats_c)

    return jax.lax.fori_loop(0, trips, body, (y, stats))


def _backward_loop(trips, acc, d_x, d_weights, inputs: TripInputs, dy, spec, n):
    """The backward of chunks `0 .. trips - 1`: re-runs each chunk's forward, writes its
    rows of `d_x` and `d_weights`, and sums its expert-weight gradients into `acc`.

    The GMM backward sums each chunk's weight gradient straight into the carry (the
    accumulators' cotangents): a `carry + chunk_grad` would hold a second weight-gradient
    buffer, which is more than the capped path when the weights outweigh the
    activations."""

    def body(i, carry):
        acc, d_x, d_weights = carry
        chunk, start, own = _chunk(inputs, i, n)

        def f(x, weights, acc_gu, acc_dn):
            c = eqx.tree_at(lambda c: (c.x, c.weights), chunk, (x, weights))
            return expert_parallel_trip(c, spec, grad_acc=(acc_gu, acc_dn))[0]

        _, vjp = jax.vjp(f, chunk.x, chunk.weights, *acc)
        dx_c, dw_c, acc_gu, acc_dn = vjp(_take(dy, start, chunk.x.shape[0]))
        d_x = _put(d_x, dx_c, start, own)
        d_weights = _put(d_weights, dw_c, start, own)
        return (acc_gu, acc_dn), d_x, d_weights

    return jax.lax.fori_loop(0, trips, body, (acc, d_x, d_weights))


def _zero_stats(like) -> TripStats:
    # Derived from an input, so that the carry has its varying-axes type in shard_map.
    zero = jnp.sum(jnp.zeros_like(like, jnp.int32))
    return TripStats(computed_pairs=zero, recv_rows=zero, dropped_pairs=zero)


def _grad_acc(w_gate_up, w_down, init=None):
    """Weight-gradient accumulators in the GMMs' own accumulation dtype: zeros, or
    `init`."""
    acc = acc_dtype(w_gate_up.dtype)
    if init is None:
        init = (jnp.zeros(w_gate_up.shape, acc), jnp.zeros(w_down.shape, acc))
    return tuple(match_varying(*(a.astype(acc) for a in init), w_gate_up, w_down)[:2])


def _zeros_like_varying(a, like):
    return match_varying(jnp.zeros_like(a), like)[0]


@ft.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def chunked_dropless(
    inputs: TripInputs, spec: TripSpec, num_chunks: int
) -> tuple[Float[Array, "tokens d_model"], TripStats]:
    """The dropless expert-parallel layer over `num_chunks` chunks of the local tokens.

    **Arguments:**

    - `inputs`: this shard's [`moe_eqx.TripInputs`][], as for
        [`moe_eqx.expert_parallel_trip`][].
    - `spec`: the [`moe_eqx.TripSpec`][] holding the per-chunk (worst-case) buffers
        from [`moe_eqx.fallback_chunking`][].
    - `num_chunks`: the chunk count from [`moe_eqx.fallback_chunking`][].

    **Returns:**

    `(y, stats)`: `[T, d_model]` with every pair processed, and the chunks'
    [`moe_eqx.TripStats`][] summed, so that a drop inside the chunked path would show.
    """
    y = _zeros_like_varying(inputs.x, inputs.x)
    stats = _zero_stats(inputs.valid)
    return _forward_loop(num_chunks, y, stats, inputs, spec, num_chunks)


def _fwd(inputs, spec, num_chunks):
    return chunked_dropless(inputs, spec, num_chunks), inputs


def _bwd(spec, num_chunks, inputs, cotangents):
    dy, _ = cotangents  # the integer stats have no cotangent
    acc, d_x, d_weights = _backward_loop(
        num_chunks,
        _grad_acc(inputs.w_gate_up, inputs.w_down),
        _zeros_like_varying(inputs.x, dy),
        _zeros_like_varying(inputs.weights, dy),
        inputs,
        dy,
        spec,
        num_chunks,
    )
    return (_input_cotangents(inputs, d_x, d_weights, acc),)


def _input_cotangents(inputs: TripInputs, d_x, d_weights, acc) -> TripInputs:
    """`inputs`' cotangents: those of the integer and boolean fields are None (zero)."""
    return eqx.tree_at(
        lambda i: (
            i.x,
            i.weights,
            i.dest_shard,
            i.dest_group,
            i.valid,
            i.w_gate_up,
            i.w_down,
        ),
        inputs,
        (
            d_x,
            d_weights,
            None,
            None,
            None,
            acc[0].astype(inputs.w_gate_up.dtype),
            acc[1].astype(inputs.w_down.dtype),
        ),
    )


chunked_dropless.defvjp(_fwd, _bwd)


def capped_or_fallback(
    overflow: Bool[Array, ""],
    inputs: TripInputs,
    wire: WireRows,
    wire_counts: Int[Array, "shards shards"],
    *,
    capped: TripSpec,
    fallback: TripSpec,
    num_chunks: int,
) -> tuple[Float[Array, "tokens d_model"], TripStats]:
    """The capped trip of `wire`, or on `overflow` the chunked dropless fallback: at the
    capped trip's own speed and memory when it does not overflow.

    Why not `lax.cond(overflow, fallback, capped)`: under autodiff a cond returns the
    union of both branches' residuals, and rematerialising the capped branch instead
    (`jax.checkpoint`, the previous design) re-runs its forward, exchange included, in
    the backward: measured 1.08-1.4x the capped-only forward+backward step when the
    fallback never runs. Here there is no conditional: both paths always run, and the
    overflow flag sets how much work each does. The fallback is a loop over its chunks
    whose trip count is `2 * num_chunks` (half-size chunks, `FORWARD_SPLIT` and
    `BACKWARD_SPLIT`) on overflow and 0 otherwise. The capped trip's
    exchange counts are zeroed on overflow: it then sends nothing and computes nothing,
    and its output and gradients are zero without any masking.

    One `custom_vjp` orders the work so that the big buffers of the two paths never
    coexist. Forward: the chunks run first, before the capped trip's residuals exist
    (an optimization barrier keeps them there); only their `[T, d_model]` output is
    held across the capped trip. Backward: the capped pullback first (its residuals
    are then gone), then the chunks, re-running their forward and summing their
    weight gradients onto the capped ones.

    **Arguments:**

    - `overflow`: the exact predicate, identical on all shards.
    - `inputs`: this shard's [`moe_eqx.TripInputs`][].
    - `wire`, `wire_counts`: `inputs`' wire rows and their all-gathered `[R, R]` counts,
        for the capped trip.
    - `capped`: the capped trip's [`moe_eqx.TripSpec`][].
    - `fallback`, `num_chunks`: one chunk's spec and the chunk count, from
        [`moe_eqx.fallback_chunking`][].

    **Returns:**

    `(y, stats)` of the path that counts: the fallback's on overflow, else the capped
    trip's.
    """
    return _capped_or_fallback(
        capped, fallback, num_chunks, overflow, inputs, wire, wire_counts
    )


# Chunks per base chunk (`fallback_chunking`'s, sized to the capped buffers) in the
# forward and in the backward. Forward+backward peak (temp + output per device, the
# input differentiated too) against the capped-only step: see `_cof_fwd`; base-size
# forward chunks measured 1.069x at d_model=128, d_ff=512, EP4 (1.0085x halved). With
# bfloat16 weights the backward's float32 weight-gradient accumulators sit next to a
# chunk: base-size backward chunks measured +3.6 MiB (1.025x) at d_model=256,
# d_ff=512, 8192 tokens, EP8; halved, +1.6 MiB (1.011x); quartered, no lower.
FORWARD_SPLIT = 2
BACKWARD_SPLIT = 2


def _finer_chunking(
    inputs: TripInputs, fallback: TripSpec, num_chunks: int, split: int
) -> tuple[TripSpec, int]:
    """`split` times as many chunks as the base `num_chunks` (at most one per token),
    with their own worst-case buffers."""
    tokens = inputs.x.shape[0]
    n = min(tokens, split * num_chunks)
    buffers = buffer_sizes(
        tokens=math.ceil(tokens / n),
        top_k=inputs.weights.shape[1],
        num_shards=fallback.num_shards,
        local_groups=fallback.local_groups,
        dedup=fallback.dedup,
        buffer_factor=None,
    )
    return eqx.tree_at(lambda s: s.buffers, fallback, buffers), n


def _trips(overflow, num_chunks: int):
    return jnp.where(overflow, num_chunks, 0)


def _capped_counts(counts, overflow):
    """The capped trip's exchange counts: none on overflow (it then moves nothing)."""
    return jnp.where(overflow, jnp.zeros_like(counts), counts)


def _select(overflow, on_overflow, otherwise):
    return jax.tree.map(lambda a, b: jnp.where(overflow, a, b), on_overflow, otherwise)


@ft.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _capped_or_fallback(capped, fallback, n, overflow, inputs, wire, counts):
    # Without autodiff nothing is held: the capped trip, then the base chunks writing
    # over its (zero) output in place.
    y, stats = trip_wire_rows(inputs, wire, _capped_counts(counts, overflow), capped)
    stats = jax.tree.map(lambda a: jnp.where(overflow, 0, a), stats)
    return _forward_loop(_trips(overflow, n), y, stats, inputs, fallback, n)


def _cof_fwd(capped, fallback, n, overflow, inputs, wire, counts):
    # The chunks first, while nothing big is held; the barrier keeps XLA from moving
    # them next to the capped trip's residuals. Measured forward+backward peak against
    # the capped-only step: + one [T, d_model] (the chunks' output), e.g. 1.0085x at
    # d_model=128, d_ff=512, EP4 and 1.0068x at d_model=256, 8192 tokens, EP8, where
    # 4x finer chunks after the capped trip measured 1.032x and 1.0066x. They compute
    # in the weights' dtype: a cast of the weights to bfloat16 activations in every
    # chunk measured +40 KiB at the memory test's shape, where the weights dominate.
    fine, fine_n = _finer_chunking(inputs, fallback, n, FORWARD_SPLIT)
    chunked = _forward_loop(
        _trips(overflow, fine_n),
        _zeros_like_varying(inputs.x, inputs.x),
        _zero_stats(inputs.valid),
        inputs,
        fine,
        fine_n,
        upcast=True,
    )
    chunked, x = jax.lax.optimization_barrier((chunked, inputs.x))
    capped_counts = _capped_counts(counts, overflow)

    def trip(x, wire_weights, w_gate_up, w_down):
        trip_inputs = eqx.tree_at(
            lambda i: (i.x, i.w_gate_up, i.w_down), inputs, (x, w_gate_up, w_down)
        )
        rows = eqx.tree_at(lambda w: w.weights, wire, wire_weights)
        return trip_wire_rows(trip_inputs, rows, capped_counts, capped)

    y, pullback, stats = jax.vjp(
        trip, x, wire.weights, inputs.w_gate_up, inputs.w_down, has_aux=True
    )
    out = _select(overflow, chunked, (y, stats))
    return out, (overflow, inputs, wire, pullback)


def _cof_bwd(capped, fallback, n, res, cotangents):
    overflow, inputs, wire, pullback = res
    dy, _ = cotangents  # the integer stats have no cotangent
    # Zero on overflow: the capped trip moved nothing.
    d_x, d_wire_weights, d_gu, d_dn = pullback(dy)
    # The fallback's chunks start after the capped pullback (whose buffers are then
    # gone). On overflow every row of `d_x` is written by a chunk.
    fine, fine_n = _finer_chunking(inputs, fallback, n, BACKWARD_SPLIT)
    acc, d_x, d_weights = _backward_loop(
        _trips(overflow, fine_n),
        _grad_acc(inputs.w_gate_up, inputs.w_down, (d_gu, d_dn)),
        d_x,
        _zeros_like_varying(inputs.weights, dy),
        inputs,
        dy,
        fine,
        fine_n,
    )
    # Only the routing weights the wire rows carry have a cotangent.
    d_wire = eqx.tree_at(
        lambda w: (w.token, w.groups, w.weights, w.send_counts, w.send_pairs),
        wire,
        (None, None, d_wire_weights, None, None),
    )
    return None, _input_cotangents(inputs, d_x, d_weights, acc), d_wire, None


_capped_or_fallback.defvjp(_cof_fwd, _cof_bwd)
