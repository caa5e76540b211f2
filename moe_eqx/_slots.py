"""Slot weights of duplicated experts, a linear map with its own transpose
([`moe_eqx.internal.custom_linear`][]).

Forward: each home shard exports the copies of its experts that the plan put in other
shards' slots, at most `C` of them (`max_exports`, the plan's out-degree bound); one
exchange delivers each shard exactly its `S` slot experts.

- `exchange="ragged"` (GPU/TPU): one `lax.ragged_all_to_all` from a `[C, ...]` export
  buffer into an `[S, ...]` receive buffer: only owned copies travel, and a device
  holds `O(S + C)` expert-sized arrays.
- `exchange="dense"` (every platform, the CPU path): one `lax.all_to_all` of
  `[R, min(S, C), ...]` blocks, since a block must hold what one home shard may send
  one receiver (at most `S` slots there, at most `C` copies in all). That is
  `O(R min(S, C))`, as the dense token exchange keeps `[R, block_rows]` blocks.

Backward, `backward=`:

- `"all_gather"`: the slot gradients `[S, ...]` are all-gathered (`[R, S, ...]`) and each
  home shard scatter-adds the ones it owns: one collective, `R*S` expert-sized arrays.
- `"home"`: the reverse exchange: each slot gradient travels only to its home shard,
  which receives `[C, ...]` (ragged) or `[R, min(S, C), ...]` blocks (dense) and
  scatter-adds them.
- `"auto"`: the one with fewer expert-sized temporaries per device
  (`slot_backward_copies`).

No global `[E, ...]` weight or gradient is ever built or psum-ed, and at `R = 1` no
collective runs. The offsets of both ragged trips come from `slot_routes`, a pure
function of the slot table that the tests check against `emulate_ragged_all_to_all`.
"""

import functools as ft
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import Array, Bool, Int, PyTree, Shaped

from ._autodiff import custom_linear
from ._exchange._base import SLOT_EXCHANGES
from ._planner import most_exports
from ._rules import all_to_all, div, exclusive_cumsum, rem

SLOT_BACKWARDS = ("auto", "all_gather", "home")

# A module-level name, so that tests can run the ragged path on CPU (where XLA has no
# lowering of the collective) through an emulation of its documented semantics.
_ragged_all_to_all = jax.lax.ragged_all_to_all


def max_exports_bound(num_shards: int, num_local: int, num_slots: int) -> int:
    """The most copies one home shard can export under any plan
    (`_planner.most_exports`), at least 1 (a static buffer size)."""
    return max(1, most_exports(num_shards, num_local, num_slots))


class SlotRoutes(eqx.Module):
    """Where every slot copy comes from and travels, for both exchanges and both trips.

    Identical on all shards (a function of the slot table only). The copies a home
    shard `h` exports are ordered by (destination shard, slot); only the first
    `max_exports` of them are delivered.

    **Fields:**

    - `owner`: `[R, S]` home shard of each slot's expert (`-1`: empty slot).
    - `local`: `[R, S]` the expert's index among its home shard's `L` experts.
    - `export_rank`: `[R, S]` position of the copy in its owner's export buffer.
    - `block_pos`: `[R, S]` position among the slots of the same shard with the same
        owner (the row in the dense exchange's block).
    - `recv_pos`: `[R, S]` position in the shard's ragged receive buffer, which holds
        the copies grouped by owner (`S`, out of range, for an undelivered slot).
    - `sizes`: `[R, R]` copies home shard `h` (row) delivers to shard `d` (column).
    - `delivered`: `[R, S]` the slot is filled and its copy within the bound.
    """

    owner: Int[Array, "shards slots"]
    local: Int[Array, "shards slots"]
    export_rank: Int[Array, "shards slots"]
    block_pos: Int[Array, "shards slots"]
    recv_pos: Int[Array, "shards slots"]
    sizes: Int[Array, "shards shards"]
    delivered: Bool[Array, "shards slots"]

    @property
    def send_offsets(self) -> Int[Array, "shards shards"]:
        """`[h, d]` where `d`'s copies start in `h`'s export buffer."""
        return exclusive_cumsum(self.sizes, axis=1)

    @property
    def recv_offsets(self) -> Int[Array, "shards shards"]:
        """`[h, d]` where `h`'s copies start in `d`'s receive buffer."""
        return exclusive_cumsum(self.sizes, axis=0)


def slot_routes(
    slot_expert: Int[Array, "shards slots"], num_local: int, max_exports: int
) -> SlotRoutes:
    """The routes of every slot copy (pure index arithmetic, `O(R^2 S)` integers).

    **Arguments:**

    - `slot_expert`: `[R, S]` the plan's slot table (`-1`: empty).
    - `num_local`: `L`, home experts per shard.
    - `max_exports`: `C`, copies a home shard may export; later ones are undelivered.

    **Returns:**

    A `SlotRoutes`.
    """
    num_shards, num_slots = slot_expert.shape
    slot_expert = slot_expert.astype(jnp.int32)
    filled = slot_expert >= 0
    owner = jnp.where(filled, div(slot_expert, num_local), -1)
    local = jnp.where(filled, rem(slot_expert, num_local), 0)
    onehot = (owner[..., None] == jnp.arange(num_shards)[None, None, :]).astype(
        jnp.int32
    )  # [d, s, h]
    flat = onehot.reshape(num_shards * num_slots, num_shards)
    rank = jnp.take_along_axis(
        exclusive_cumsum(flat, axis=0), jnp.maximum(owner, 0).reshape(-1, 1), axis=1
    ).reshape(num_shards, num_slots)
    pos = jnp.take_along_axis(
        exclusive_cumsum(onehot, axis=1), jnp.maximum(owner, 0)[..., None], axis=2
    )[..., 0]
    delivered = filled & (rank < max_exports)
    # Copies past the bound are the last ones of their owner, in (destination, slot)
    # order: cutting them off keeps every delivered block contiguous.
    sizes = jnp.sum(jnp.where(delivered[..., None], onehot, 0), axis=1).T  # [h, d]
    recv_start = exclusive_cumsum(sizes, axis=0)  # [h, d]
    recv_pos = recv_start[jnp.maximum(owner, 0), jnp.arange(num_shards)[:, None]] + pos
    return SlotRoutes(
        owner=owner,
        local=local,
        export_rank=jnp.where(filled, rank, 0),
        block_pos=jnp.where(filled, pos, 0),
        recv_pos=jnp.where(delivered, recv_pos, num_slots),
        sizes=sizes,
        delivered=delivered,
    )


RaggedArgs = tuple[Int[Array, " shards"], ...]


def ragged_slot_args(
    routes: SlotRoutes, shard: Int[Array, ""] | int
) -> tuple[RaggedArgs, RaggedArgs]:
    """`shard`'s `(input_offsets, send_sizes, output_offsets, recv_sizes)` of the
    forward trip (`[C]` export buffer -> `[S]` receive buffer grouped by owner) and of
    the `"home"` backward trip (the reverse)."""
    sizes, send_off, recv_off = routes.sizes, routes.send_offsets, routes.recv_offsets
    forward = (send_off[shard], sizes[shard], recv_off[shard], sizes[:, shard])
    backward = (recv_off[:, shard], sizes[:, shard], send_off[:, shard], sizes[shard])
    return forward, backward


def export_slots(
    routes: SlotRoutes, shard: Int[Array, ""] | int, max_exports: int
) -> Int[Array, " exports"]:
    """`[C]` the flat slot index (`d * S + s`) of each copy `shard` exports, in its
    export order; `-1` past the copies it really exports."""
    num_shards, num_slots = routes.owner.shape
    mine = (routes.owner == shard) & routes.delivered
    where = jnp.where(mine, routes.export_rank, max_exports).reshape(-1)
    return (
        jnp.full((max_exports,), -1, jnp.int32)
        .at[where]
        .set(jnp.arange(num_shards * num_slots, dtype=jnp.int32), mode="drop")
    )


def _block_slots(routes: SlotRoutes, shard, block: int) -> Int[Array, "shards block"]:
    """`[d, j]`: the slot of shard `d` that holds `shard`'s `j`-th copy for `d` (-1)."""
    num_shards, num_slots = routes.owner.shape
    mine = (routes.owner == shard) & routes.delivered
    rows = jnp.broadcast_to(jnp.arange(num_shards)[:, None], mine.shape)
    cols = jnp.where(mine, routes.block_pos, block)
    slots = jnp.broadcast_to(jnp.arange(num_slots, dtype=jnp.int32), mine.shape)
    return (
        jnp.full((num_shards, block), -1, jnp.int32)
        .at[rows, cols]
        .set(slots, mode="drop")
    )


def _take(x, idx, *, fill=0):
    """`x[idx]` along axis 0; out-of-range indices (`-1` or `len(x)`) give `fill`."""
    idx = jnp.where(idx < 0, x.shape[0], idx)
    return jnp.take(x, idx, axis=0, mode="fill", fill_value=fill)


def _scatter_home(num_local, idx, values, shape, dtype):
    """`[L, ...]` home gradient: `values` added at `idx` (out-of-range dropped)."""
    idx = jnp.where(idx < 0, num_local, idx).reshape(-1)
    values = values.reshape(-1, *shape[1:]).astype(dtype)
    return jnp.zeros(shape, dtype).at[idx].add(values, mode="drop")


def _undelivered(slots, routes, shard):
    """NaN in the slots a bound-violating plan left undelivered: never silently a wrong
    expert (the layer's planner makes such a plan impossible)."""
    if not jnp.issubdtype(slots.dtype, jnp.inexact):
        return slots
    lost = (routes.owner[shard] >= 0) & ~routes.delivered[shard]
    lost = lost.reshape(lost.shape + (1,) * (slots.ndim - 1))
    return jnp.where(lost, jnp.asarray(jnp.nan, slots.dtype), slots)


def _forward(w_home, routes, shard, num_local, axis_name, max_exports, exchange):
    num_shards, num_slots = routes.owner.shape
    if exchange == "ragged":
        exports = export_slots(routes, shard, max_exports)
        send = _take(w_home, _take(routes.local.reshape(-1), exports, fill=-1))
        out = jnp.zeros((num_slots, *w_home.shape[1:]), w_home.dtype)
        args = ragged_slot_args(routes, shard)[0]
        recv = _ragged_all_to_all(send, out, *args, axis_name=axis_name)
        slots = _take(recv, routes.recv_pos[shard])
    else:
        block = min(num_slots, max_exports)
        which = _block_slots(routes, shard, block)  # [d, j] -> slot of d
        local = jnp.take_along_axis(routes.local, jnp.maximum(which, 0), axis=1)
        send = _take(w_home, jnp.where(which >= 0, local, -1))  # [R, block, ...]
        recv = all_to_all(send, axis_name)
        flat = recv.reshape(num_shards * block, *recv.shape[2:])
        idx = routes.owner[shard] * block + routes.block_pos[shard]
        slots = _take(flat, jnp.where(routes.delivered[shard], idx, -1))
    return _undelivered(slots, routes, shard)


def _backward_home(g_slots, routes, shard, num_local, axis_name, max_exports, exchange):
    num_shards, num_slots = routes.owner.shape
    if exchange == "ragged":
        # Group my slot gradients by owner (the forward's receive layout) ...
        send = (
            jnp.zeros_like(g_slots).at[routes.recv_pos[shard]].set(g_slots, mode="drop")
        )
        out = jnp.zeros((max_exports, *g_slots.shape[1:]), g_slots.dtype)
        args = ragged_slot_args(routes, shard)[1]
        recv = _ragged_all_to_all(send, out, *args, axis_name=axis_name)
        # ... and each home shard receives them in its export order.
        exports = export_slots(routes, shard, max_exports)
        return recv, _take(routes.local.reshape(-1), exports, fill=-1)
    block = min(num_slots, max_exports)
    # [h, j] -> this shard's slot holding h's j-th copy (the forward's receive view).
    rows = jnp.where(routes.delivered[shard], routes.owner[shard], num_shards)
    which = (
        jnp.full((num_shards, block), -1, jnp.int32)
        .at[rows, routes.block_pos[shard]]
        .set(jnp.arange(num_slots, dtype=jnp.int32), mode="drop")
    )
    recv = all_to_all(_take(g_slots, which), axis_name)
    mine = _block_slots(routes, shard, block)  # [d, j] -> slot of d holding our copy
    local = jnp.take_along_axis(routes.local, jnp.maximum(mine, 0), axis=1)
    return recv, jnp.where(mine >= 0, local, -1)


class _SlotRes(NamedTuple):
    routes: SlotRoutes
    shard: Array
    num_local: int
    axis_name: str
    max_exports: int
    backward: str
    exchange: str
    with_home: bool  # the result is `[L + S, ...]`: the home weights, then the slots


def _slots_of(res: _SlotRes, w_home):
    return jtu.tree_map(ft.partial(_slots_of_one, res), w_home)


def _slots_of_one(res: _SlotRes, w_home):
    slots = _forward(
        w_home,
        res.routes,
        res.shard,
        res.num_local,
        res.axis_name,
        res.max_exports,
        res.exchange,
    )
    return jnp.concatenate([w_home, slots]) if res.with_home else slots


def _slots_of_t(res: _SlotRes, ct):
    """The home gradients: each home shard sums the slot gradients of its experts
    (and, `with_home`, its own), in float32."""
    return jtu.tree_map(ft.partial(_slots_of_t_one, res), ct)


def _slots_of_t_one(res: _SlotRes, ct):
    g_slots = ct[res.num_local :] if res.with_home else ct
    routes, shard = res.routes, res.shard
    if res.backward == "all_gather":
        g_all = jax.lax.all_gather(g_slots, res.axis_name)  # [R, S, ...]
        keep = (routes.owner == shard) & routes.delivered
        idx = jnp.where(keep, routes.local, -1)
    else:
        g_all, idx = _backward_home(
            g_slots,
            routes,
            shard,
            res.num_local,
            res.axis_name,
            res.max_exports,
            res.exchange,
        )
    shape = (res.num_local, *ct.shape[1:])
    g_home = _scatter_home(res.num_local, idx, g_all, shape, jnp.float32)
    if res.with_home:
        g_home = g_home + ct[: res.num_local].astype(jnp.float32)
    return g_home.astype(ct.dtype)


def _slot_weights(
    w_home,
    slot_expert,
    num_local,
    axis_name,
    max_exports,
    backward,
    exchange,
    with_home,
):
    res = _SlotRes(
        routes=slot_routes(slot_expert, num_local, max_exports),
        shard=jax.lax.axis_index(axis_name).astype(jnp.int32),
        num_local=num_local,
        axis_name=axis_name,
        max_exports=max_exports,
        backward=backward,
        exchange=exchange,
        with_home=with_home,
    )
    groups = slot_expert.shape[1] + (num_local if with_home else 0)
    out = jtu.tree_map(
        lambda w: jax.ShapeDtypeStruct((groups, *w.shape[1:]), w.dtype), w_home
    )
    return custom_linear(_slots_of, _slots_of_t, res, w_home, out)


def slot_backward_copies(
    backward: str,
    *,
    num_shards: int,
    num_slots: int,
    max_exports: int,
    exchange: str,
) -> int:
    """Expert-sized buffers per device of one backward mode's exchange (send plus
    receive), which `"auto"` compares.

    `"all_gather"`: the `[R, S, ...]` gathered gradients (counted twice with the
    dense exchange: compiled on CPU, `R S` at `S = 1` and `2 R S` from `S = 2`, where
    XLA keeps a second copy of the gathered block). `"home"`:
    `S + C` with the ragged exchange (`[S]` grouped send, `[C]` receive),
    `2 R min(S, C)` with the dense one (two `[R, min(S, C)]` block arrays). Both add
    the `[S]` cotangent and the `[L]` home gradient, which any backward has. The
    counts are checked against compiled memory analysis in `benchmarks/slots.py`.
    """
    if backward == "all_gather":
        return num_shards * num_slots * (2 if exchange == "dense" else 1)
    if backward != "home":
        raise ValueError(f"`backward` must be one of {SLOT_BACKWARDS[1:]}.")
    if exchange == "ragged":
        return num_slots + max_exports
    return 2 * num_shards * min(num_slots, max_exports)


def choose_slot_backward(
    backward: str, *, num_shards: int, num_slots: int, max_exports: int, exchange: str
) -> str:
    """`backward`, with `"auto"` resolved to the mode with fewer expert-sized buffers
    (ties: `"all_gather"`, one plain collective)."""
    if backward != "auto":
        return backward
    sizes = dict(num_shards=num_shards, num_slots=num_slots, max_exports=max_exports)
    home = slot_backward_copies("home", exchange=exchange, **sizes)
    gather = slot_backward_copies("all_gather", exchange=exchange, **sizes)
    return "home" if home < gather else "all_gather"


def _check_args(slot_expert, num_local, max_exports, backward, exchange):
    if not isinstance(num_local, int) or isinstance(num_local, bool) or num_local < 1:
        raise ValueError(f"`num_local` must be a positive integer, got {num_local!r}.")
    if slot_expert.ndim != 2:
        raise ValueError(
            f"`slot_expert` must be [shards, slots], got {slot_expert.shape}."
        )
    if max_exports is not None and (
        not isinstance(max_exports, int)
        or isinstance(max_exports, bool)
        or max_exports < 1
    ):
        raise ValueError(
            f"`max_exports` must be a positive integer or None, got {max_exports!r}."
        )
    if backward not in SLOT_BACKWARDS:
        raise ValueError(
            f"`backward` must be one of {SLOT_BACKWARDS}, got {backward!r}."
        )
    if exchange not in SLOT_EXCHANGES:
        raise ValueError(
            f"`exchange` must be one of {SLOT_EXCHANGES}, got {exchange!r}."
        )


def check_slot_exports(
    slot_expert: Int[Array, "shards slots"] | np.ndarray,
    num_local: int,
    max_exports: int,
) -> None:
    """Raises a `ValueError` if a (concrete) slot table has some home shard export more
    than `max_exports` copies."""
    table = np.asarray(slot_expert)
    owners = table[table >= 0] // num_local
    exports = np.bincount(owners, minlength=table.shape[0])
    if exports.size and exports.max() > max_exports:
        worst = int(exports.argmax())
        raise ValueError(
            f"The slot table makes home shard {worst} export {int(exports.max())} "
            f"copies, more than `max_exports={max_exports}`: plan it with "
            f"`plan_duplication(..., max_exports={max_exports})`."
        )


def gather_slot_weights(
    w_home: PyTree[Shaped[Array, "local_experts ..."]],
    slot_expert: Int[Array, "shards slots"],
    num_local: int,
    axis_name: str,
    *,
    max_exports: int | None = None,
    backward: str = "auto",
    exchange: str = "dense",
    with_home: bool = False,
) -> PyTree[Shaped[Array, "groups ..."]]:
    """Fetches the weights of this shard's slot experts from their home shards.

    Called inside `shard_map` over `axis_name`. Memory and wire bytes per device are
    `O(S + C)` expert weights with the ragged exchange (see the module docstring).

    **Arguments:**

    - `w_home`: `[L, ...]` this shard's home expert weights, or a PyTree of such
        arrays (e.g. `(w_gate_up, w_down)`): one set of routes and one custom
        derivative serve them all, and each array has its own exchange.
    - `slot_expert`: `[R, S]` the plan's slot table (identical on all shards; -1
        empty), e.g. `plan_duplication(..., max_exports=C).slot_expert`.
    - `num_local`: `L`.
    - `axis_name`: the expert-parallel axis.
    - `max_exports`: `C` (static), the most copies of one home shard's experts in the
        table; `None` allows any plan (`C = (R - 1) min(S, L)`). A concrete table that
        breaks the bound raises a `ValueError`; inside `jit` the copies past it come
        back as NaN, never as another expert's weights.
    - `backward`: `"all_gather"`, `"home"` or `"auto"` (see the module docstring).
    - `exchange`: `"ragged"` (GPU/TPU: `lax.ragged_all_to_all`) or `"dense"` (every
        platform: `lax.all_to_all` of `[R, min(S, C), ...]` blocks).
    - `with_home`: return `w_home` followed by the slots, `[L + S, ...]` (the local
        groups of the shard's grouped matmul): the backward then sums the home and
        the slot gradients of each expert in float32, rounding once.

    **Returns:**

    `[S, ...]` the weights of `slot_expert[shard]` (zeros for empty slots), or
    `[L + S, ...]` with `with_home`; for a PyTree, a PyTree of these.
    """
    _check_args(slot_expert, num_local, max_exports, backward, exchange)
    num_shards, num_slots = slot_expert.shape
    bound = max_exports_bound(num_shards, num_local, num_slots)
    max_exports = bound if max_exports is None else min(max_exports, bound)
    if not isinstance(slot_expert, jax.core.Tracer):
        check_slot_exports(slot_expert, num_local, max_exports)
    if num_shards == 1:
        # One shard: the weights are all here, no collective (a plan never puts a
        # home expert in a slot, so a table from the planner is all empty).
        idx = jnp.where(slot_expert[0] >= 0, slot_expert[0], -1)

        def one(w):
            slots = _take(w, idx)
            return jnp.concatenate([w, slots]) if with_home else slots

        return jtu.tree_map(one, w_home)
    mode = choose_slot_backward(
        backward,
        num_shards=num_shards,
        num_slots=num_slots,
        max_exports=max_exports,
        exchange=exchange,
    )
    with jax.named_scope("moe_eqx.slot_weights"):
        return _slot_weights(
            w_home,
            slot_expert,
            num_local,
            axis_name,
            max_exports,
            mode,
            exchange,
            with_home,
        )
