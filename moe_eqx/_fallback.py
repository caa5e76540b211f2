"""The capped trip, or on overflow the chunked dropless fallback: one loop, one
implementation (the README's "How it works", **Overflow**).

The local tokens are cut into `n` chunks small enough that one chunk's worst case
(`R * c` wire rows, `R * c * min(k, G)` pairs) fits the capped buffers. The layer runs
one loop of the capped round trip over *pieces* of its tokens: one piece holding every
token, or, when the exact predicate says the capped buffers would overflow, the `n`
chunks (the same trip, with the other tokens masked out). Every piece has the shapes
of the capped trip, so no pair is ever dropped and the memory stays that of the capped
path.

Derivatives (`jax.custom_jvp`, the tangent a `custom_linear`, see
`moe_eqx._autodiff`): forward mode differentiates the loop directly, one loop carrying
the value and its tangent (`primal_and_tangent`). Reverse mode runs the pieces before
the last in a loop (none without overflow) and the last one after it, differentiated,
keeping its residuals where they are computed (the expert weights among them are the
inputs, not copies): without overflow that piece is every token, so the step is the
capped trip forward and its pullback backward, as `on_overflow="drop"` runs it. The
backward pulls that piece back, then (on overflow) re-runs the other chunks one at a
time in a second loop, differentiating each; all sum the expert weights' gradients in
place in one float32 accumulator (with weights narrower than float32, made only when
more than one earlier piece follows: without overflow the pulled-back piece's
gradients are the result, in the weights' dtype, and with two chunks the other
piece's are added to them in that dtype), and one piece's residuals are alive at a
time. JAX cannot transpose a loop with a traced
count, so for higher orders the backward and the tangent are differentiated as loops
over `num_chunks` trips that re-run every piece, the pieces past the count skipped
(`moe_eqx._autodiff.fused`); their reverse mode keeps each trip's residuals.
"""

import functools as ft
import math
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.extend.core
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Bool, Float

from ._autodiff import KEPT, fused, primal_and_tangent, symbolic_zeros_to_none
from ._buffers import BufferSizes
from ._checks import check_array
from ._compat import sub_jaxpr
from ._rules import acc_dtype, match_varying, per_token_counts, zeros_in_own_buffer
from ._trip import (
    TripInputs,
    TripSpec,
    TripStats,
    check_trip_inputs,
    expert_parallel_trip,
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
    per-shard batches, e.g. decoding one token per shard), they are raised to hold
    that: `R` wire rows and `R * min(k, G)` pairs (more than the capped buffers, the
    price of never dropping a pair at that batch size, and never more than the worst
    case of the whole batch), and the chunks are single tokens.

    **Arguments:**

    - `tokens`: `T`, tokens per shard.
    - `top_k`, `num_shards`, `local_groups`, `dedup`: as for [`moe_eqx.internal.buffer_sizes`][].
    - `capped`: the capped path's [`moe_eqx.internal.BufferSizes`][].

    **Returns:**

    `(num_chunks, buffers)`: the buffers of every piece (the capped ones, raised
    where one token's worst case needs it).
    """
    pairs_per_token, rows_per_token = per_token_counts(
        top_k=top_k, local_groups=local_groups, dedup=dedup
    )
    rows = max(capped.rows, num_shards * rows_per_token)
    pairs = max(capped.pairs, num_shards * pairs_per_token)
    chunk = min(
        tokens,
        rows // (num_shards * rows_per_token),
        pairs // (num_shards * pairs_per_token),
    )
    num_chunks = math.ceil(tokens / max(chunk, 1)) if tokens else 1
    if (rows, pairs) == (capped.rows, capped.pairs):
        return num_chunks, capped
    buffers = BufferSizes(
        rows=rows,
        pairs=pairs,
        block_rows=max(capped.block_rows, min(rows, tokens * rows_per_token)),
        send_rows=capped.send_rows,
        worst_case=capped.worst_case,
    )
    return num_chunks, buffers


def chunked_dropless(
    inputs: TripInputs,
    spec: TripSpec,
    *,
    overflow: Bool[Array, ""],
    num_chunks: int,
) -> tuple[Float[Array, "tokens d_model"], TripStats]:
    """The capped round trip of every token, or on `overflow` the same trip over
    `num_chunks` chunks of the tokens, one after the other: dropless.

    **Arguments:**

    - `inputs`: this shard's [`moe_eqx.internal.TripInputs`][].
    - `spec`: the [`moe_eqx.internal.TripSpec`][] whose buffers hold one chunk's worst case
        (see [`moe_eqx.internal.fallback_chunking`][]).
    - `overflow`: the exact predicate, identical on all shards: the capped trip of
        every token would drop pairs.
    - `num_chunks`: the chunk count from [`moe_eqx.internal.fallback_chunking`][].

    **Returns:**

    `(y, stats)`: `[T, d_model]`, and the pieces' [`moe_eqx.internal.TripStats`][] summed
    (counted from what each trip did, so a drop inside the fallback would show).
    """
    check_trip_inputs(inputs, spec, where="chunked_dropless")
    check_array("overflow", overflow, shape=(), kind="bool", where="chunked_dropless")
    if not isinstance(num_chunks, int) or num_chunks < 1:
        raise ValueError(
            f"chunked_dropless: `num_chunks` must be an int >= 1, got {num_chunks!r}."
        )
    with jax.named_scope("moe_eqx.fallback"):
        return _dropless(spec, num_chunks, overflow, inputs)


def _pieces(overflow, num_chunks: int):
    return jnp.where(overflow, num_chunks, 1).astype(jnp.int32)


def _per_piece(a, p):
    """`a`, made to depend on the piece `p`: what a trip computes from `a` alone (the
    all-gather exchange's gathered tokens, or of the output's cotangent in the
    backward) is then not hoisted out of the loop by XLA, where it would stay alive
    beside every piece's buffers: one piece at a time is the fallback's memory
    bound."""
    return jax.lax.optimization_barrier((a, p))[0]


def _piece(inputs: TripInputs, p, overflow, num_chunks: int) -> TripInputs:
    """`inputs` with only piece `p`'s tokens valid: every token, or chunk `p`."""
    inputs = eqx.tree_at(lambda i: i.x, inputs, _per_piece(inputs.x, p))
    tokens = inputs.x.shape[0]
    chunk = math.ceil(tokens / num_chunks)
    lo = jnp.where(overflow, p * chunk, 0)
    hi = jnp.where(overflow, (p + 1) * chunk, tokens)
    t = jnp.arange(tokens, dtype=jnp.int32)
    own = (t >= lo) & (t < hi)
    return eqx.tree_at(lambda i: i.valid, inputs, inputs.valid & own[:, None])


def _zero_stats(like) -> TripStats:
    zero = jnp.zeros((), jnp.int32) + jnp.sum(jnp.zeros_like(like, jnp.int32))
    return TripStats(computed_pairs=zero, recv_rows=zero, dropped_pairs=zero)


def _add(a, b):
    return jtu.tree_map(jnp.add, a, b)


def _fold_pieces(body, init, overflow, num_chunks: int, bounded: bool):
    """`body(p, carry)` folded over the pieces: a loop of `1` or `num_chunks` trips
    (a traced count, which JAX can evaluate and differentiate in forward mode only),
    or, `bounded`, always `num_chunks` trips that skip the pieces past the count (a
    static count: every mode). The skip's predicate is identical on all shards, so
    no shard skips a collective another one runs."""
    pieces = _pieces(overflow, num_chunks)
    if not bounded:
        return jax.lax.fori_loop(0, pieces, body, init)
    # The first piece always runs; the others (chunks 1 to n - 1) in one skippable
    # loop, not one skippable trip each: skipped, they cost nothing but zeros.
    carry = body(0, init)
    if num_chunks == 1:
        return carry

    def rest(carry):
        return jax.lax.fori_loop(1, num_chunks, body, carry)

    return jax.lax.cond(pieces > 1, rest, lambda carry: carry, carry)


def _forward_init(inputs: TripInputs):
    # `y` is as wide as the experts' output (`x` may carry a folded bias column).
    shape = (inputs.x.shape[0], inputs.w_down.shape[-1])
    runtime = inputs.dest_group
    # The chunk loop's carry, added to in place: shared zeros would be copied.
    y0 = zeros_in_own_buffer(shape, inputs.x.dtype, runtime, inputs.x)
    return y0, _zero_stats(inputs.valid)


def _forward_body(spec, num_chunks, overflow, inputs):
    """The forward loop's body: piece `p`'s trip added to `(y, stats)`."""

    def body(p, carry):
        y, stats = carry
        y_p, stats_p = expert_parallel_trip(
            _piece(inputs, p, overflow, num_chunks), spec
        )
        return y + y_p.astype(y.dtype), _add(stats, stats_p)

    return body


def _loop(spec, num_chunks, overflow, inputs, bounded=False):
    body = _forward_body(spec, num_chunks, overflow, inputs)
    return _fold_pieces(body, _forward_init(inputs), overflow, num_chunks, bounded)


@ft.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _dropless(spec, num_chunks, overflow, inputs):
    return _loop(spec, num_chunks, overflow, inputs)


class _Want(NamedTuple):
    """Which cotangents the backward computes (the others are zero)."""

    x: bool
    weights: bool
    w_gate_up: bool
    w_down: bool

    @property
    def experts(self) -> bool:
        """Either expert weight (their gradients come from one accumulating pass)."""
        return self.w_gate_up or self.w_down


class _Res(eqx.Module):
    spec: TripSpec = eqx.field(static=True)
    num_chunks: int = eqx.field(static=True)
    want: _Want = eqx.field(static=True)
    overflow: Array | bool
    inputs: TripInputs
    # Reverse mode: the last piece's pullback residuals, kept by the forward, and
    # how they make its pullback.
    saved: tuple | None = None
    layout: Any = eqx.field(static=True, default=None)


def _grad_acc(inputs: TripInputs, own_dtype: bool = False):
    """Zero accumulators of the expert weights' gradients: float32 (`acc_dtype`),
    carried through the backward's loop and summed into in place. `own_dtype` (with
    weights narrower than float32, `_narrow`): plain zeros in the weights' own dtype
    (a piece's weight gradient has that dtype anyway), for the piece the forward
    keeps and the backward pulls back first: XLA folds them away, so that piece's
    gradients come out of their grouped matmuls as they are, and a float32 copy of
    the experts is made only where more than one other piece adds to them (see
    `_backward_saved`)."""
    if own_dtype and _narrow(inputs):
        return tuple(
            _plain_zeros(w.shape, w.dtype, inputs.dest_group)
            for w in (inputs.w_gate_up, inputs.w_down)
        )
    acc = acc_dtype(inputs.w_gate_up.dtype)
    return tuple(
        zeros_in_own_buffer(w.shape, acc, inputs.dest_group)
        for w in (inputs.w_gate_up, inputs.w_down)
    )


def _narrow(inputs: TripInputs) -> bool:
    """Floating-point expert weights narrower than their gradients' accumulator."""
    dtypes = [jnp.dtype(w.dtype) for w in (inputs.w_gate_up, inputs.w_down)]
    return all(jnp.issubdtype(d, jnp.floating) and d != acc_dtype(d) for d in dtypes)


def _plain_zeros(shape, dtype, *like):
    """`jnp.zeros(shape, dtype)` varying as `like`: zeros XLA folds into a sum (unlike
    `zeros_in_own_buffer`'s, for a buffer written in place)."""
    return match_varying(jnp.zeros(shape, dtype), *like)[0]


def _piece_vjp(res: _Res, p, policy=None, own_dtype: bool = False):
    """Piece `p`'s trip and its pullback: `(y, stats, pullback)`, where
    `pullback((dy, acc))` gives the wanted `d_x`, `d_weights` and `acc +
    d_expert_weights` (the accumulator is summed in place by the grouped matmul's
    backward, see `moe_eqx.AbstractGMMBackend.ffn`; the expert weights themselves are
    closed over). With a `jax.checkpoint` `policy`, the trip is differentiated under
    it: the pullback keeps what the policy saves (the layer's named arrays, say) and
    recomputes the rest. `own_dtype`: the accumulators in the weights' dtype (see
    `_grad_acc`)."""
    inputs, want = res.inputs, res.want

    def trip(*diff):
        diff = iter(diff)
        x = next(diff) if want.x else inputs.x
        weights = next(diff) if want.weights else inputs.weights
        grad_acc = next(diff) if want.experts else None
        piece = eqx.tree_at(lambda i: (i.x, i.weights), inputs, (x, weights))
        piece = _piece(piece, p, res.overflow, res.num_chunks)
        if grad_acc is None:
            return expert_parallel_trip(piece, res.spec)
        y, stats, grad_acc = expert_parallel_trip(piece, res.spec, grad_acc)
        return (y, grad_acc), stats

    diff = [inputs.x] if want.x else []
    diff += [inputs.weights] if want.weights else []
    diff += [_grad_acc(inputs, own_dtype)] if want.experts else []
    if policy is not None:
        trip = jax.checkpoint(_without_acc_residual(trip, want.experts), policy=policy)
    out, pullback, stats = jax.vjp(trip, *diff, has_aux=True)
    return (out[0] if want.experts else out), stats, pullback


@jax.custom_jvp
def _fresh_zeros(acc):
    """Zeros like `acc` (the accumulators' primal, zeros too), with the tangent of
    `acc`: a checkpointed trip then needs no residual of them."""
    return jtu.tree_map(jnp.zeros_like, acc)


@_fresh_zeros.defjvp
def _fresh_zeros_jvp(primals, tangents):
    return _fresh_zeros(*primals), tangents[0]


def _without_acc_residual(trip, with_acc: bool):
    """`trip`, its gradient accumulators' primal (zeros, only a route for their
    cotangents) made inside it: recomputing the trip in the backward then needs no
    saved copy of them (as large as the expert weights)."""
    if not with_acc:
        return trip

    def fn(*diff):
        *rest, acc = diff
        return trip(*rest, _fresh_zeros(acc))

    return fn


def _backward_body(res: _Res, dy, own_dtype: bool = False):
    """The backward loop's body: piece `p` re-run, differentiated, and pulled back
    into `grads` (`own_dtype`: its accumulators in the weights' dtype)."""

    def body(p, grads):
        pullback = _piece_vjp(res, p, own_dtype=own_dtype)[2]
        return _pull(pullback, _per_piece(dy, p), grads, res.want)

    return body


def _varying_like(leaves, res: _Res):
    """`leaves` cast to vary over every `shard_map` axis `res`'s arrays vary over:
    the kept residuals have one type whether zero (the reference's) or computed."""
    ref = [a for a in jtu.tree_leaves(res) if eqx.is_array(a)]
    return list(match_varying(*leaves, *ref)[: len(leaves)])


def _res_arrays(res: _Res) -> list:
    return [a for a in jtu.tree_leaves(res.inputs) if eqx.is_array(a)]


class _Broadcast(NamedTuple):
    """A residual that is a scalar broadcast to `shape` (the gradient accumulators'
    zeros a checkpointed trip keeps): carried as the scalar."""

    shape: tuple


class _Saved(NamedTuple):
    """How the last piece's pullback is kept from the forward to the backward (as
    residuals of the `custom_jvp`): its structure, and for each of its residuals the
    index of the input it is (the expert weights, passed on unchanged: read from the
    inputs again, never copied), a `_Broadcast` (kept as its scalar) or `None` (kept;
    `shapes` lists what is kept)."""

    treedef: Any
    inputs_at: tuple
    shapes: tuple

    def carried(self, pullback, res: _Res) -> tuple:
        leaves = jtu.tree_leaves(pullback)
        kept = [
            a[(0,) * a.ndim] if isinstance(i, _Broadcast) else a
            for a, i in zip(leaves, self.inputs_at, strict=True)
            if not isinstance(i, int)
        ]
        return tuple(_varying_like(kept, res))

    def zeros(self, res: _Res) -> tuple:
        """Zeros in place of the kept residuals (the higher orders' reference,
        whose backward re-runs every piece and reads none of them)."""
        zeros = [jnp.zeros(s.shape, s.dtype) for s in self.shapes]
        return tuple(_varying_like(zeros, res))

    def pullback(self, carried, res: _Res):
        arrays, carried = _res_arrays(res), iter(carried)

        def leaf(i):
            if isinstance(i, int):
                return arrays[i]
            if isinstance(i, _Broadcast):
                return jnp.broadcast_to(next(carried), i.shape)
            return next(carried)

        return jtu.tree_unflatten(self.treedef, [leaf(i) for i in self.inputs_at])


def _broadcast_scalar(jaxpr, var) -> bool:
    """`var` is a scalar broadcast (`broadcast_in_dim` of a shape-`()` value)."""
    eqn = next((e for e in jaxpr.eqns if var in e.outvars), None)
    return (
        eqn is not None
        and eqn.primitive.name == "broadcast_in_dim"
        and eqn.invars[0].aval.shape == ()
    )


def _input_index(jaxpr, var):
    """Which input of `jaxpr` the variable `var` is, through calls that pass it on
    unchanged (e.g. the accumulating FFN's `custom_jvp` identity on the weights), or
    `None` when it is computed."""
    while var not in jaxpr.invars:
        eqn = next((e for e in jaxpr.eqns if var in e.outvars), None)
        sub = None if eqn is None else sub_jaxpr(eqn)
        if sub is None:
            return None
        out = sub.outvars[eqn.outvars.index(var)]
        if out not in sub.invars:
            return None
        var = eqn.invars[sub.invars.index(out)]
        if not isinstance(var, jax.extend.core.Var):
            return None
    return jaxpr.invars.index(var)


def _saved_layout(res: _Res, policy=None) -> _Saved:
    """The pullback's layout (traced, not computed), under `policy` if given."""
    arrays = _res_arrays(res)
    found = []

    def trace(*arrays_and_piece):
        *arrays, p = arrays_and_piece
        it = iter(arrays)
        inputs = jtu.tree_map(lambda a: next(it) if eqx.is_array(a) else a, res.inputs)
        piece = _Res(res.spec, res.num_chunks, res.want, res.overflow, inputs)
        leaves, treedef = jtu.tree_flatten(_piece_vjp(piece, p, policy, True)[2])
        found.append(treedef)
        return leaves

    # The piece traced, as the loop's is (a constant one would fold into the
    # residuals).
    closed = jax.make_jaxpr(trace)(*arrays, jnp.zeros((), jnp.int32))
    at, shapes = [], []
    for v in closed.jaxpr.outvars:
        i = _input_index(closed.jaxpr, v)
        if i is not None and i < len(arrays):  # (the piece itself is carried)
            at.append(i)
        elif v.aval.shape and _broadcast_scalar(closed.jaxpr, v):
            at.append(_Broadcast(v.aval.shape))
            shapes.append(jax.ShapeDtypeStruct((), v.aval.dtype))
        else:
            at.append(None)
            shapes.append(jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype))
    return _Saved(found[0], tuple(at), tuple(shapes))


def _loop_saving(res: _Res, policy=None):
    """The pieces (as `_loop`), the earlier ones in a loop and the last one after
    it, differentiated (under a `jax.checkpoint` `policy` if given), keeping its
    pullback's residuals: `((y, stats), residuals)`. Without overflow the last piece
    is every token: the backward then runs the capped trip's pullback once, as
    `on_overflow="drop"` does, with no re-run."""
    inputs, n, overflow = res.inputs, res.num_chunks, res.overflow
    body = _forward_body(res.spec, n, overflow, inputs)
    # The earlier pieces (none without overflow) in a loop, undifferentiated: only
    # the last piece's residuals are kept. That piece runs after the loop, its
    # residuals computed where the backward reads them, not copied into a carry.
    last = _pieces(overflow, n) - 1
    y, stats = jax.lax.fori_loop(0, last, body, _forward_init(inputs))
    y_p, stats_p, pullback = _piece_vjp(res, last, policy, True)
    y, stats = y + y_p.astype(y.dtype), _add(stats, stats_p)
    return (y, stats), res.layout.carried(pullback, res)


def _keep_reference(res: _Res):
    return _primal(res), res.layout.zeros(res)


def _keep(res: _Res, policy=None):
    """Reverse mode's primal: the value, and `res` with the residuals the forward
    loop kept (differentiated, for higher orders, as the primal itself: the kept
    residuals then carry no derivative, and the backward's derivative is that of
    its re-running form, which does not read them).

    Under a `jax.checkpoint` `policy` (see `moe_eqx._autodiff.primal_and_tangent`),
    the last piece's residuals are those the policy saves, named `KEPT` so that the
    checkpoint saves them rather than re-running this loop in the backward: with
    `save_only_these_names("moe_hidden")` the backward keeps that piece's first
    products and recomputes the rest of its trip, with `nothing_saveable` it
    recomputes all of it, as the same policy does on the capped path."""
    spec, n, want, overflow = res.spec, res.num_chunks, res.want, res.overflow
    layout = _saved_layout(res, policy)
    res = _Res(spec, n, want, overflow, res.inputs, None, layout)
    fast = _loop_saving if policy is None else ft.partial(_loop_saving, policy=policy)
    out, saved = fused(fast, _keep_reference, res)
    if policy is not None:
        saved = tuple(checkpoint_name(a, KEPT) for a in saved)
    return out, _Res(spec, n, want, overflow, res.inputs, saved, layout)


def _zero_tangent(p):
    """A zero tangent of `p`: `float0` for integer leaves (a quantized weight's)."""

    def zero(a):
        if jnp.issubdtype(a.dtype, jnp.inexact):
            return jnp.zeros_like(a)
        return np.zeros(a.shape, jax.dtypes.float0)

    return jtu.tree_map(zero, p)


def _jvp_loop(res: _Res, lin, bounded: bool):
    """Forward mode: `((y, stats), t_y)`, the loop differentiated directly, one loop
    carrying the value and its tangent (it keeps no residuals)."""
    i = res.inputs
    primals = (i.x, i.weights, i.w_gate_up, i.w_down)
    tangents = tuple(
        _zero_tangent(p) if t is None else t for p, t in zip(primals, lin, strict=True)
    )

    def y_of(x, weights, w_gate_up, w_down):
        inputs = eqx.tree_at(
            lambda i: (i.x, i.weights, i.w_gate_up, i.w_down),
            res.inputs,
            (x, weights, w_gate_up, w_down),
        )
        return _loop(res.spec, res.num_chunks, res.overflow, inputs, bounded)

    y, t_y, stats = jax.jvp(y_of, primals, tangents, has_aux=True)
    return (y, stats), t_y


def _tangent_loop(res: _Res, lin, bounded: bool):
    return _jvp_loop(res, lin, bounded)[1]


def _tangent(res: _Res, lin):
    fast, reference = (ft.partial(_tangent_loop, bounded=b) for b in (False, True))
    return fused(fast, reference, res, lin)


def _pull(pullback, dy_p, grads, want: _Want):
    """`grads` plus one piece's cotangents."""
    if not want.experts:
        return _add(grads, pullback(dy_p))
    *rows, acc = pullback((dy_p, grads[-1]))  # `acc` already holds the sum
    return (*_add(tuple(grads[:-1]), tuple(rows)), acc)


def _backward_saved(res: _Res, dy, rows):
    """The last piece's pullback from the residuals the forward kept, then the
    earlier pieces (none without overflow) each re-run and differentiated. `rows`:
    the zero input cotangents the loop carries (x's, the routing weights').

    With weights narrower than float32 (`_narrow`) the last piece's weight
    gradients are its pullback's, in the weights' dtype (plain zeros added, which
    XLA folds). Only where earlier pieces follow (overflow, a `cond` on the
    predicate every shard shares) are they widened to the float32 accumulator the
    loop adds each piece's into, and narrowed once after it: without overflow the
    step has no float32 copy of the experts, and no pass over one. With two chunks,
    one earlier piece at most, the two pieces' gradients are summed in one addition
    in the weights' dtype, without the float32 accumulator."""
    want = res.want
    last = _pieces(res.overflow, res.num_chunks) - 1
    pullback = res.layout.pullback(res.saved, res)
    grads = (*rows, _grad_acc(res.inputs, own_dtype=True)) if want.experts else rows
    grads = _pull(pullback, _per_piece(dy, last), grads, want)

    narrow = want.experts and _narrow(res.inputs)
    # Two chunks, one earlier piece at most: its gradients and the last piece's
    # summed in one addition in the weights' dtype, with no float32 copy of the
    # experts (where XLA adds in float32 and rounds, as on TPUs and CPUs, the value
    # the float32 accumulator gives).
    own_dtype = narrow and res.num_chunks == 2
    body = _backward_body(res, dy, own_dtype)
    # Tied to the last piece's gradients: its residuals are gone before the loop.
    grads, last = jax.lax.optimization_barrier((grads, last))
    if not narrow or own_dtype:
        return jax.lax.fori_loop(0, last, body, grads)
    dtypes = [a.dtype for a in grads[-1]]

    def rest(grads):
        *rows, acc = grads
        acc = tuple(a.astype(acc_dtype(a.dtype)) for a in acc)
        *rows, acc = jax.lax.fori_loop(0, last, body, (*rows, acc))
        return (*rows, tuple(a.astype(d) for a, d in zip(acc, dtypes, strict=True)))

    return jax.lax.cond(last > 0, rest, lambda grads: grads, grads)


def _backward(res: _Res, dy, bounded: bool):
    """Each piece re-run and differentiated, one at a time, summing the gradients of
    the tokens' rows and of the routing weights, and the expert weights' gradients
    in place in one float32 accumulator."""
    inputs, want = res.inputs, res.want
    cotangents = ((inputs.x, want.x), (inputs.weights, want.weights))
    # The backward loop's carried input cotangents, added to in place.
    rows = tuple(
        zeros_in_own_buffer(a.shape, a.dtype, inputs.dest_group, a)
        for a, wanted in cotangents
        if wanted
    )
    if res.saved is not None and not bounded:
        grads = _backward_saved(res, dy, rows)
    else:
        grads = (*rows, _grad_acc(inputs)) if want.experts else rows
        body = _backward_body(res, dy)
        grads = _fold_pieces(body, grads, res.overflow, res.num_chunks, bounded)
    grads = iter(grads)
    d_x = next(grads) if want.x else None
    d_weights = next(grads) if want.weights else None
    d_gu = d_dn = None
    if want.experts:
        acc_gu, acc_dn = next(grads)
        d_gu = acc_gu.astype(inputs.w_gate_up.dtype) if want.w_gate_up else None
        d_dn = acc_dn.astype(inputs.w_down.dtype) if want.w_down else None
    return d_x, d_weights, d_gu, d_dn


def _transpose(res: _Res, dy):
    """The backward: `_backward` over the pieces' traced count, differentiated (for
    higher orders) as the same loop over a static count."""
    fast, reference = (ft.partial(_backward, bounded=b) for b in (False, True))
    return fused(fast, reference, res, dy)


def _primal(res: _Res):
    return _dropless(res.spec, res.num_chunks, res.overflow, res.inputs)


def _dropless_jvp(spec, num_chunks, primals, tangents):
    overflow, inputs = primals
    _, t = symbolic_zeros_to_none(tangents)
    lin = (t.x, t.weights, t.w_gate_up, t.w_down)
    want = _Want(*(a is not None for a in lin))
    res = _Res(spec, num_chunks, want, overflow, inputs)
    # `y` is as wide as the experts' output (`x` may carry a folded bias column).
    out_t = jax.ShapeDtypeStruct(
        (inputs.x.shape[0], inputs.w_down.shape[-1]), inputs.x.dtype
    )
    # Forward mode runs one loop for the value and its tangent; reverse mode runs
    # the loop for the value, and `_transpose` for the backward.
    joint = ft.partial(_jvp_loop, bounded=False)
    (y, stats), t_y = primal_and_tangent(
        _primal, joint, _tangent, _transpose, res, lin, out_t, keep=_keep
    )
    t_stats = jtu.tree_map(lambda a: np.zeros(a.shape, jax.dtypes.float0), stats)
    return (y, stats), (t_y, t_stats)


_dropless.defjvp(_dropless_jvp, symbolic_zeros=True)
