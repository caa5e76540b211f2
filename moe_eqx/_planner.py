"""Dynamic duplication of hot experts into spare slots, and token diversion.

Every step, from the all-gathered `[R, E]` routing counts, `plan_duplication` chooses
which experts fill each shard's `S` spare slots and how many of each expert's pairs each
replica processes (its quota). `assign_destinations` then sends every pair of a shard to
a physical destination (shard, local group) so that each replica receives exactly its
quota. Both are pure, jit-able, deterministic integer computations with static shapes,
identical on every shard because their input is.
"""

import math
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int

from ._checks import check_array
from ._rules import local_experts

__all__ = [
    "DuplicationPlan",
    "assign_destinations",
    "default_max_exports",
    "plan_duplication",
    "slot_pair_counts",
]


class DuplicationPlan(eqx.Module):
    """Which experts fill the spare slots, and how pairs are split among replicas.

    Expert `e` has its home copy on shard `e // L` (local group `e % L`) and possibly
    slot copies elsewhere.

    **Fields:**

    - `slot_expert`: `[R, S]` int32, the expert held by slot `s` of shard `r`, `-1` if
        the slot is empty. A shard holds at most one copy of an expert and never its
        own home experts; empty slots come last.
    - `expert_shard_pairs`: `[E, R]` int32, how many pairs of expert `e` shard `r`
        processes. Non-zero only where a copy of `e` lives; row `e` sums to the number
        of pairs routed to `e`.
    """

    slot_expert: Int[Array, "shards slots"]
    expert_shard_pairs: Int[Array, "experts shards"]

    @property
    def shard_load(self) -> Int[Array, " shards"]:
        """`[R]` pairs each shard processes (home experts and slots)."""
        return self.expert_shard_pairs.sum(axis=0)


# Candidate levels per round, all filled at once. The first round tries these levels
# (fractions of the mean load above the lowest possible level, ceil(mean)), since most
# plans land at or just above the mean; later rounds split the bracket evenly until
# it is exact.
# fmt: off
_FIRST_FRACTIONS = (
    0.0, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02,
    0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 4.0, 8.0,
)
# fmt: on
_LEVELS = len(_FIRST_FRACTIONS)
# Donors a remainder may be passed through before a receiver's next slot copy (a
# chain of small donors): each pass costs the passing donor one of its
# `max_exports` copies and loads the last donor of the chain.
_CHAIN_HOPS = 2
_INT32_MAX = 2**31 - 1
# Pairs are counted in int32: the total, a level plus a donor's excess, and the
# fill's scores (`_INT32_MAX - pairs`, above every pair count) stay below 2**31
# while the total number of pairs stays below this.
_PAIRS_LIMIT = 2**30
# `assign_destinations` sorts one int32 key (expert, then the pair's index, in the
# low bits) when its largest value, `E * 2**bits`, is at most this, else the experts
# with their indices (a stable two-operand sort).
_SORT_KEY_LIMIT = 2**31
# The most compares per pair and step of `assign_destinations`' search.
_SEARCH_WIDTH = 16

# Compile time: XLA:CPU compiles each kernel (a fusion, a reduction, a gather, ...)
# on its own, at a cost that grows with its operations whatever the array sizes.
# So the planner keeps its state in one array (a step is one gather, one reduction
# over the experts, one over the levels and one update), writes columns with
# selects against constant masks (a concatenate of more than 8 parts is not
# fused), ranks shards and experts by counting compares (no sort and cumsum for
# the sums of the hottest experts) and runs all rounds of the level search in one
# loop.


def most_exports(num_shards: int, num_local: int, num_slots: int) -> int:
    """The most slot copies one home shard can export under any plan: each of the
    other `R - 1` shards holds at most `min(S, L)` of its experts (never its own home
    experts, never two copies of one expert)."""
    return max(num_shards - 1, 0) * min(num_slots, num_local)


def default_max_exports(num_shards: int, num_local: int, num_slots: int) -> int:
    """The default bound `C` on the slot copies of one home shard's experts.

    `2 S + 4 ceil(sqrt(R))`, but never more than `(R - 1) min(S, L)` (the most any
    plan can make: every other shard holds at most `min(S, L)` copies of one shard's
    experts), and `0` without slots or without another shard.

    Why: a home shard `X` times as loaded as the mean needs at least `X - 1` copies
    to come down to the mean (a copy takes at most a shard's mean load). Zipf(1.2-1.5)
    routing whose hot experts share home shards has `X` = 15-18 at EP32 and 21-25 at
    EP64, and the planner then makes up to 21 and 28 copies of that shard's experts
    (E=256, k=8, S=2, five seeds): within this bound (28 and 36), so the balance is
    the unbounded one. With the hot experts spread over shards a shard sends at most
    10. The bound grows like `sqrt(R)` (as that skew does), so the slot weights one
    shard sends per step stay far below the `R S` slots at large `R`. A load that puts
    most pairs on one home shard needs more copies (the rotating hotspot of
    `benchmarks/planner.py` needs 31 at EP32, S=2: max/mean 1.10 at this bound, 1.000
    with `max_exports >= 36`); pass a larger `max_exports` for such loads.

    **Arguments:**

    - `num_shards`: `R`.
    - `num_local`: `L = E / R`.
    - `num_slots`: `S`.

    **Returns:**

    The bound, an `int >= 0`.
    """
    for name, value in (
        ("num_shards", num_shards),
        ("num_local", num_local),
        ("num_slots", num_slots),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"`{name}` must be an integer >= 0, got {value!r}.")
    most = most_exports(num_shards, num_local, num_slots)
    if most == 0:
        return 0
    ceil_sqrt = math.isqrt(num_shards - 1) + 1
    return min(most, 2 * num_slots + 4 * ceil_sqrt)


class _Loads(NamedTuple):
    """What the plan depends on, independent of the level."""

    by_shard: Int[Array, "shards local"]  # pairs of each home expert
    load: Int[Array, " shards"]
    total: Int[Array, ""]
    # One row per shard, by decreasing load (ties by shard index): the donor order;
    # the receiver order is its reverse. Columns: load, shard, top[m] for m = 0..S
    # (pairs of its m hottest experts), then the pairs of each of its L experts.
    table: Int[Array, "shards columns"]


def _loads(counts: Int[Array, "shards experts"], num_slots: int) -> _Loads:
    num_shards, num_experts = counts.shape
    local = num_experts // num_shards
    shards = np.arange(num_shards)
    # [R, L + 1]: the pairs of each home expert, then the shard's load.
    adds = np.concatenate([np.eye(local, dtype=bool), np.ones((1, local), bool)])
    counts = counts.astype(jnp.int32).reshape(num_shards, num_shards, 1, local)
    sums = jnp.where(adds, counts, 0).sum(axis=(0, 3))
    by_shard, load = sums[:, :local], sums[:, local]
    # [R, L + 2], one reduction over k: the experts of shard r hotter than its
    # expert j (k < L, ties by index), then the shards before r in the donor order
    # (k < R), then the total. `c` is the column, `r` the row.
    size = max(num_shards, local)
    c = np.arange(local + 2)[None, :, None]
    k = np.arange(size)[None, None, :]
    on_experts = c < local
    other = jnp.where(
        on_experts,
        jnp.pad(by_shard, ((0, 0), (0, size - local)))[:, None, :],
        jnp.pad(load, (0, size - num_shards))[None, None, :],
    )
    mine = jnp.where(
        on_experts, jnp.pad(by_shard, ((0, 0), (0, 2)))[:, :, None], load[:, None, None]
    )
    ahead = k < np.where(on_experts, c, shards[:, None, None])
    counted = (k < np.where(on_experts, local, num_shards)) & (
        (other > mine) | (other == mine) & ahead
    )
    ranks = jnp.where(c == local + 1, other, counted.astype(jnp.int32)).sum(axis=2)
    hot_rank, rank, total = ranks[:, :local], ranks[:, local], ranks[0, local + 1]
    # The table, one reduction over (shard, expert): a column adds up the pairs of
    # all experts (load), of the m hottest (top[m]) or of one; the shard column
    # adds up a constant.
    width = 3 + num_slots + local
    top = np.full((width, 1, 1), -1)
    top[2 : 3 + num_slots, 0, 0] = np.arange(num_slots + 1)
    adds = np.zeros((width, 1, local), bool)
    adds[0] = True
    adds[3 + num_slots :, 0] = np.eye(local, dtype=bool)
    shard = np.zeros((width, num_shards, local), np.int32)
    shard[1, :, 0] = shards
    entry = shard + jnp.where(adds | (hot_rank[None] < top), by_shard[None], 0)
    mine = rank[None, :] == shards[:, None]  # [row, shard]
    table = jnp.where(mine[:, None, :, None], entry[None], 0).sum(axis=(2, 3))
    return _Loads(by_shard=by_shard, load=load, total=total, table=table)


def _argmin(score: Int[Array, "levels local"]):
    """`(min, argmin)` along the last axis (the first index among ties), as one
    reduction."""

    def earlier(a, b):
        pick = (a[0] < b[0]) | (a[0] == b[0]) & (a[1] < b[1])
        return jnp.where(pick, a[0], b[0]), jnp.where(pick, a[1], b[1])

    index = jax.lax.broadcasted_iota(jnp.int32, score.shape, 1)
    init = (jnp.int32(_INT32_MAX), jnp.int32(score.shape[1]))
    return jax.lax.reduce((score, index), init, earlier, (1,))


# The search's state, a row per candidate level: the copy the last step made (its
# slot + 1, 0 for none; expert; pairs), the level, the current donor (position in
# the donor order, pairs still to shed, copies of its experts so far), the current
# receiver (position in the receiver order, slot, deficit), the remainders passed on
# since the last slot copy to a receiver; then, equal in all rows,
# the steps of this round (R S before the first round), the bracket (highest failed
# level, lowest feasible one), the row of the log of the best level so far (the
# last row, never written, for none) and the steps of its round (the rows of that
# log written by it: a half of the log is reused, and rows past the round's end
# hold an earlier round's copies); then the pairs left of each expert of the
# donor.
_COPY, _LEVEL, _POSITION, _LEFT, _EXPORTS, _INDEX, _SLOT, _NEED = 0, 3, 4, 5, 6, 7, 8, 9
_HOPS, _STEP, _BELOW, _ABOVE, _BEST, _LENGTH, _AVAIL = 10, 11, 12, 13, 14, 15, 16


def _put(state, values: dict):
    """`state` with column `c` replaced by `values[c]` (the state's shape, or
    broadcastable): selects against constant masks, which fuse into one kernel."""
    column = np.arange(state.shape[1])[None, :]
    for c, value in values.items():
        state = jnp.where(column == c, value, state)
    return state


def _wide(array, c):
    """Column `c` of `array` (row `0` if `c` is a pair), broadcast to `array`'s
    shape once: computing in that shape lets XLA emit every value once per element
    (a `[levels]` value broadcast into several places is emitted once per place,
    and past 15 XLA keeps it in a kernel of its own)."""
    part = (
        array[c[0] : c[0] + 1, c[1], None]
        if isinstance(c, tuple)
        else array[:, c, None]
    )
    return jnp.broadcast_to(part, array.shape)


def _step(loads, state, alive, num_slots):
    """One step of the greedy fill at every level: one slot copy per living level.

    Donors (shards above the level, by decreasing load) are emptied one after the
    other; receivers (shards below it, by increasing load, so the largest deficits
    meet the largest donors) each fill up to `num_slots` slots, each slot one piece
    of one expert of the current donor up to the receiver's deficit: the expert with
    the most pairs left, or in the receiver's last slot the one that fits most
    tightly. When the donor's remainder is smaller than the deficit and the
    receiver's remaining slots fill better from the next donor alone, the remainder
    is passed instead, as one slot copy, to the next donor, which sheds it with its
    own excess (it is above the level, so its slots are otherwise unused, and it
    receives at most this copy), up to `_CHAIN_HOPS` times in a row. A level is
    feasible once every donor has shed its excess, and fails when the receivers run
    out or a donor reaches `max_exports` copies first (`alive` is false from then
    on). Every value is `[levels, F]`, equal along a row but for the experts' pairs
    (see `_wide`).

    A living level always copies something (a donor with pairs to shed has an
    expert with pairs left), and an expert that a receiver took from the current
    donor has no pairs left unless the receiver is full or the donor empty (either
    ends the pair): a receiver never gets two copies of one expert, and its copies
    fill its slots in order.
    """
    table = loads.table
    num_shards, local = loads.by_shard.shape
    width, columns = state.shape[1], table.shape[1]
    # What a step reads, in one gather laid out like the state: the next donor's
    # load, shard, top[slots left - 1], top[slots left] (columns 0-3) and pairs per
    # expert (from `_AVAIL`); the next receiver's load (4); the current donor's
    # and receiver's shards (5, 6).
    source = np.zeros(width, np.int32)
    source[:7] = [0, 1, 1, 2, 0, 1, 1]
    source[_AVAIL:] = np.arange(3 + num_slots, columns)
    is_top = np.isin(np.arange(width), [2, 3]).astype(np.int32)[None, :]
    is_receiver = np.isin(np.arange(width), [4, 6])[None, :]
    is_next = (~np.isin(np.arange(width), [5, 6])).astype(np.int32)[None, :]
    column = np.arange(width)[None, :]
    level, position, left, exports, index, slot, need, hops, count = (
        _wide(state, c) for c in range(_LEVEL, _BELOW)
    )
    alive = jnp.broadcast_to(alive[:, None], state.shape)
    slots_left = num_slots - slot
    row = jnp.where(is_receiver, num_shards - 1 - index - is_next, position + is_next)
    row = jnp.clip(row, 0, num_shards - 1)
    read = table.reshape(-1)[row * columns + source[None, :] + is_top * slots_left]
    next_load, next_shard, top_less, top_all, receiver_load, donor, receiver = (
        _wide(read, c) for c in range(7)
    )

    # One reduction picks the expert: in the last slot the tightest fit (score =
    # its pairs), else, and if none fits, the largest (score above every fit).
    avail = state[:, _AVAIL:]
    fits = (avail >= state[:, _NEED, None]) | (avail >= state[:, _LEFT, None])
    tight = (state[:, _SLOT, None] == num_slots - 1) & fits
    best, expert = _argmin(jnp.where(tight, avail, _INT32_MAX - avail))
    best = jnp.broadcast_to(best[:, None], state.shape)
    expert = jnp.broadcast_to(expert[:, None], state.shape)
    pairs = jnp.where(best < _PAIRS_LIMIT, best, _INT32_MAX - best)
    # The receiver's fill from the remainder then the next donor, or from the next
    # donor alone (the remainder passed to it).
    excess = next_load - level
    stay = left + jnp.minimum(jnp.minimum(need - left, top_less), excess)
    move = jnp.minimum(jnp.minimum(need, top_all), excess + left)
    passes = alive & (excess > 0) & (left < need) & (move > stay) & (pairs >= left)
    passes = passes & (hops < _CHAIN_HOPS)
    amount = jnp.where(alive, jnp.minimum(jnp.minimum(need, left), pairs), 0)
    target = jnp.where(passes, next_shard * num_slots, receiver * num_slots + slot)
    finished = alive & (left == amount)
    takes = alive & ~passes
    need = need - jnp.where(takes, amount, 0)
    advance = takes & ((slot + 1 == num_slots) | (need == 0))
    # The donor's pairs per expert, or the next donor's once it is empty.
    taken = jnp.where(column == _AVAIL + expert, amount, 0)
    state = jnp.where(finished & (column >= _AVAIL), read, state - taken)
    return _put(
        state,
        {
            _COPY: jnp.where(alive, target + 1, 0),
            _COPY + 1: donor * local + expert,
            _COPY + 2: amount,
            _POSITION: position + finished.astype(jnp.int32),
            _LEFT: jnp.where(
                finished, excess + jnp.where(passes, amount, 0), left - amount
            ),
            _EXPORTS: jnp.where(finished, 0, exports + alive.astype(jnp.int32)),
            _INDEX: index + advance.astype(jnp.int32),
            _SLOT: jnp.where(advance, 0, slot + takes.astype(jnp.int32)),
            _NEED: jnp.where(advance, jnp.maximum(level - receiver_load, 0), need),
            _HOPS: jnp.where(passes, hops + 1, 0),
            _STEP: count + 1,
        },
    )


def _search(loads, num_slots, max_exports):
    """The lowest level at which the fill (`_step`) succeeds, searched exactly, and
    its log of copies.

    Rounds of `_LEVELS` levels, filled at once: the first round tries the levels of
    `_FIRST_FRACTIONS`; each later one tries evenly spaced levels strictly inside
    the bracket (highest failed, lowest feasible) until it closes. The highest load
    (nothing to shed, no copies) starts as the feasible end, so the result is
    feasible even where feasibility is not monotone. One loop runs the steps of all
    rounds: the step after a round's last one starts the next. The log holds two
    rounds, the one running and the one with the best level so far, and one empty
    row (the log of no copies); a half is reused by later rounds, so only the rows
    of the best round's own steps are returned.

    Returns `(level, log)`: the log `[steps, 3]` of copies at that level (slot + 1,
    0 for none, where slot is `shard * num_slots + column`; expert; pairs).
    """
    table = loads.table
    num_shards, local = loads.by_shard.shape
    width = _AVAIL + local
    # A step takes a receiver's slot or passes a remainder to the next donor: at
    # most R_receivers S + R_donors - 1 < R S steps per round.
    steps = num_shards * num_slots
    # Computed once, the state before the first round, which every round's start
    # reuses: the first donor's (row 0) pairs per expert; in the columns of the
    # level, pairs left and deficit, the first round's levels, the first donor's
    # load and the first receiver's (row R - 1) load; the first round's bracket; no
    # best level; and R S steps, which no round reaches.
    lowest = jax.lax.div(loads.total + num_shards - 1, num_shards)
    highest = table[0, 0]
    mean = loads.total.astype(jnp.float32) / num_shards
    # Clip in float32 before the cast so that no offset overflows int32.
    room = (highest - lowest).astype(jnp.float32)
    fractions = np.asarray(_FIRST_FRACTIONS, np.float32)[:, None]
    first = lowest + jnp.minimum(fractions * mean, room).astype(jnp.int32)
    template = _put(
        jnp.broadcast_to(
            jnp.pad(table[0, 3 + num_slots :], (_AVAIL, 0)), (_LEVELS, width)
        ),
        {
            _LEVEL: first,
            _LEFT: highest,
            _NEED: table[num_shards - 1, 0],
            _STEP: steps,
            _BELOW: lowest - 1,
            _ABOVE: highest,
            _BEST: 2 * _LEVELS,
        },
    )
    number = np.arange(_LEVELS, dtype=np.int32)[:, None]

    def body(carry):
        state, log = carry
        # The step cap never binds (see `steps`); it keeps every round's count
        # below `steps`, which marks the state before the first round.
        alive = (
            (state[:, _LEFT] > 0)
            & (state[:, _NEED] > 0)
            & (state[:, _EXPORTS] < max_exports)
            & (state[:, _STEP] < steps - 1)
        )
        # -1 while the round goes on, then its first feasible level (the levels
        # increase, so those below it failed), _LEVELS if none.
        status = jnp.where(
            alive, -1, jnp.where(state[:, _LEFT] <= 0, number[:, 0], _LEVELS)
        ).min()
        level = state[jnp.minimum(status, _LEVELS - 1), _LEVEL]
        previous = state[jnp.maximum(status - 1, 0), _LEVEL]
        count, below, above, best, length = (
            _wide(state, (0, c)) for c in (_STEP, _BELOW, _ABOVE, _BEST, _LENGTH)
        )
        ended = status >= 0
        started = count < steps  # not the state before the first round
        better = ended & started & (status < _LEVELS) & (level < above)
        # The round wrote the log's half that does not hold the best level.
        half = jnp.where(best < _LEVELS, _LEVELS, 0)
        below = jnp.where(started, below, _wide(template, (0, _BELOW)))
        below = jnp.where(ended & started & (status > 0), previous, below)
        above = jnp.where(
            started, jnp.where(better, level, above), _wide(template, (0, _ABOVE))
        )
        # Any spacing that keeps the levels inside the bracket is exact; a float
        # product rather than an integer division, which XLA keeps in a kernel of
        # its own.
        gap = (above - below).astype(jnp.float32) * (1 / (_LEVELS + 1))
        gap = jnp.maximum(gap.astype(jnp.int32), 1)
        levels = jnp.where(
            started,
            jnp.minimum(below + gap * (number + 1), above - 1),
            _wide(template, _LEVEL),
        )
        start = _put(
            template,
            {
                _LEVEL: levels,
                _LEFT: _wide(template, _LEFT) - levels,
                _NEED: jnp.maximum(levels - _wide(template, _NEED), 0),
                _STEP: 0,
                _BELOW: below,
                _ABOVE: above,
                _BEST: jnp.where(better, half + status, best),
                _LENGTH: jnp.where(better, count, length),
            },
        )
        state = jnp.where(ended, start, _step(loads, state, alive, num_slots))
        # The copies of the step, at row step - 1 of the round's half (a new
        # round writes its empty start at row 0).
        half = jnp.where(state[0, _BEST] < _LEVELS, _LEVELS, 0)
        offset = (half, state[0, _STEP] - 1, 0)
        return state, jax.lax.dynamic_update_slice(log, state[:, None, :_LEVEL], offset)

    # The template is also the state before the first round: no level alive (its
    # steps are used up), so the first step starts the first round.
    log = jnp.zeros_like(template, shape=(2 * _LEVELS + 1, steps, _LEVEL))
    state, log = jax.lax.while_loop(
        lambda carry: carry[0][0, _ABOVE] - carry[0][0, _BELOW] > 1,
        body,
        (template, log),
    )
    # Only the best round's own rows: the rest of its half may hold the copies of an
    # earlier, longer round.
    written = np.arange(steps)[:, None] < state[0, _LENGTH]
    return state[0, _ABOVE], jnp.where(written, log[state[0, _BEST]], 0)


def _assemble(loads, level, log, num_slots, max_exports) -> DuplicationPlan:
    """The plan from the log of copies at `level`: every copy's pairs come out of its
    expert's home quota; each shard lists its copies in fill order (hottest donor
    first), then its empty slots. Should the plan break an invariant (never
    expected), the home-only plan, which always holds."""
    num_shards, local = loads.by_shard.shape
    num_experts = num_shards * local
    usable = log.shape[0] // num_shards
    copies = num_shards * usable
    slot, expert, pairs = (log[None, :, c] for c in range(3))
    copied = slot > 0
    home = jax.lax.div(expert, local)
    receiver = jax.lax.div(slot + usable - 1, usable) - 1
    # One reduction over the log, with rows: per slot (expert + 1, pairs, writes);
    # per expert (-, pairs copied, -); per shard (copies of its experts, pairs its
    # slots receive less pairs its experts send, -).
    kind = np.repeat([0, 1, 2], [copies, num_experts, num_shards])[:, None]
    row = np.concatenate(
        [np.arange(1, copies + 1), np.arange(num_experts), np.arange(num_shards)]
    )[:, None]
    hit = (jnp.where(kind == 0, slot, jnp.where(kind == 1, expert, home)) == row) & (
        copied | (kind == 0)
    )
    received = copied & (receiver == row) & (kind == 2)
    sums = jnp.stack(
        [
            jnp.where(hit, jnp.where(kind == 0, expert + 1, 1), 0),
            jnp.where(hit, jnp.where(kind == 2, -pairs, pairs), 0)
            + jnp.where(received, pairs, 0),
            hit.astype(jnp.int32),
        ],
        axis=-1,
    ).sum(axis=1)
    total = loads.by_shard.reshape(-1)
    expert = sums[:copies, 0].reshape(num_shards, usable) - 1
    received = sums[:copies, 1].reshape(num_shards, usable)
    is_home = np.arange(num_experts)[:, None] // local == np.arange(num_shards)[None, :]
    kept = total - sums[copies : copies + num_experts, 1]  # the home quotas
    quota = jnp.where(
        expert[None] == np.arange(num_experts)[:, None, None], received[None], 0
    ).sum(axis=2) + jnp.where(is_home, kept[:, None], 0)
    # The checks, in one reduction. On the log: each slot written at most once (so
    # the plan holds exactly the logged copies), pairs copied within each expert's,
    # each shard at most at the level, at most `max_exports` copies of each shard's
    # experts. On the slots as assembled: filled ones first, each with work and an
    # expert id, never a home expert nor two copies of one expert on a shard.
    limit = jnp.concatenate(
        [jnp.full((copies,), _INT32_MAX), total, level - loads.load]
    )
    filled = expert >= 0
    later = (np.arange(usable)[:, None] < np.arange(usable)[None, :])[None]
    bad_slot = (
        jnp.pad(filled[:, 1:] & ~filled[:, :-1], ((0, 0), (1, 0)))
        | filled & (received <= 0)
        | (expert >= num_experts)
        | filled & (jax.lax.div(expert, local) == np.arange(num_shards)[:, None])
        | (filled[:, :, None] & (expert[:, :, None] == expert[:, None, :]) & later).any(
            2
        )
    )
    bad = jnp.concatenate(
        [
            (sums[:, 1] > limit)
            | (kind[:, 0] == 2) & (sums[:, 0] > max_exports)
            | (kind[:, 0] == 0) & (sums[:, 2] > 1),
            bad_slot.reshape(-1),
        ]
    )
    ok = ~bad.any()
    padding = jnp.full((num_shards, num_slots - usable), -1, jnp.int32)
    return DuplicationPlan(
        slot_expert=jnp.where(ok, jnp.concatenate([expert, padding], axis=1), -1),
        expert_shard_pairs=jnp.where(ok, quota, jnp.where(is_home, total[:, None], 0)),
    )


def _home_only(pairs, num_shards, num_slots) -> DuplicationPlan:
    local = pairs.shape[0] // num_shards
    is_home = (
        np.arange(pairs.shape[0])[:, None] // local == np.arange(num_shards)[None, :]
    )
    return DuplicationPlan(
        slot_expert=jnp.full((num_shards, num_slots), -1, jnp.int32),
        expert_shard_pairs=jnp.where(is_home, pairs[:, None], 0),
    )


def _check_int(name: str, value, *, none: bool = False) -> None:
    if none and value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(
            f"`{name}` must be {'None or ' if none else ''}an integer >= 0, "
            f"got {value!r}."
        )


def plan_duplication(
    counts: Int[Array, "shards experts"],
    *,
    num_slots: int,
    max_exports: int | None = None,
    max_pairs: int | None = None,
) -> DuplicationPlan:
    """Chooses the experts of every spare slot and each replica's quota of pairs.

    Balances the pairs processed per shard. At a level `c`, every shard above `c` (a
    donor) sheds its excess `load - c` and every shard below `c` (a receiver) can take
    up to its deficit `c - load` in its `S` slots. Donors are emptied one after the
    other, from the most loaded; receivers, from the least loaded, fill their slots
    from the current donor, each slot one expert piece up to the deficit: the
    donor's expert with the most pairs left, or in the last slot the one that fits
    most tightly. A donor's remainder too small to fill a receiver is passed on, as
    one slot copy, to the next donor, which sheds it with its own excess (its slots
    are otherwise unused), so receivers end exactly at `c`. The level is the lowest
    at which this succeeds, found by an exact search over the integers.

    Every shard computes the same plan from the same counts: exact integers (quotas
    sum to each expert's pairs), deterministic, static shapes, so it runs inside
    `jit`/`shard_map`. A shard never holds a copy of its own home expert nor two
    copies of one expert, and at most `max_exports` slot copies of the experts of any
    one home shard exist (the out-degree of a home shard: the slot weights it sends).

    **Arguments:**

    - `counts`: `[R, E]` integer pairs routed by each source shard to each expert
        (all-gathered, so identical on every shard). `E` must be a multiple of `R`;
        the total must stay below `2**30` (int32 arithmetic): checked here when
        `counts` is concrete, and through `max_pairs` when it is traced.
    - `num_slots`: `S`, spare slots per shard (static). `0` gives the home-only plan.
    - `max_exports`: `C`, the most slot copies of one home shard's experts (static),
        which bounds the slot weights one shard sends; `None` is
        `default_max_exports(R, L, S)` (this module). `0` gives the home-only plan.
        A home shard `X` times as loaded as the mean needs about `X - 1` copies to
        reach the mean, so a small `C` limits the balance where hot experts share a
        home shard.
    - `max_pairs`: a static bound on the total of `counts` that the caller knows
        (e.g. `R * T * k` routed pairs), or `None`. A `ValueError` unless it is
        below `2**30`.

    **Returns:**

    A `DuplicationPlan`; `plan.shard_load` is the resulting load per shard.

    Cost: a few rounds of the fill, each at most `R S` steps vectorised over 16
    candidate levels (one loop runs all rounds), and `O(E R (L + S) + (R S)^2)`
    element-wise work. On CPU at `R=64, E=256` this is about a millisecond.
    """
    check_array("counts", counts, ndim=2, kind="int", where="plan_duplication")
    num_shards, num_experts = counts.shape
    local = local_experts(num_experts, num_shards)
    _check_int("num_slots", num_slots)
    _check_int("max_exports", max_exports, none=True)
    _check_int("max_pairs", max_pairs, none=True)
    if max_pairs is not None and max_pairs >= _PAIRS_LIMIT:
        raise ValueError(
            f"`max_pairs` ({max_pairs}) must be below 2**30: the planner counts "
            "pairs in int32."
        )
    if not isinstance(counts, jax.core.Tracer):
        total = int(np.asarray(counts).sum(dtype=np.int64))
        if total >= _PAIRS_LIMIT:
            raise ValueError(
                f"`counts` sums to {total} pairs, not below 2**30: the planner "
                "counts pairs in int32."
            )
        if max_pairs is not None and total > max_pairs:
            raise ValueError(
                f"`counts` sums to {total} pairs, more than `max_pairs` ({max_pairs})."
            )
    if max_exports is None:
        max_exports = default_max_exports(num_shards, local, num_slots)
    # No home shard can send more copies than all the slots hold (keeps int32).
    max_exports = min(max_exports, num_shards * num_slots)
    return _plan(counts, num_slots, jnp.asarray(max_exports, jnp.int32))


def _plan(counts, num_slots: int, max_exports: Int[Array, ""]) -> DuplicationPlan:
    """`plan_duplication` after its checks; the bound may be traced (one compilation
    serves every bound)."""
    num_shards, num_experts = counts.shape
    local = num_experts // num_shards
    with jax.named_scope("moe_eqx.planner"):
        # Each slot holds a different foreign expert: at most E - L can be useful.
        usable = min(num_slots, num_experts - local)
        if usable == 0:
            return _home_only(
                counts.astype(jnp.int32).sum(axis=0), num_shards, num_slots
            )
        loads = _loads(counts, usable)
        level, log = _search(loads, usable, max_exports)
        return _assemble(loads, level, log, num_slots, max_exports)


def slot_pair_counts(
    plan: DuplicationPlan, *, num_local_experts: int
) -> Int[Array, "shards groups"]:
    """Pairs each shard processes per local group: `L` home experts, then `S` slots.

    These are the group sizes of each shard's grouped matmul.

    **Arguments:**

    - `plan`: the `DuplicationPlan`.
    - `num_local_experts`: `L = E / R`.

    **Returns:**

    `[R, L + S]` int32; row `r` sums to `plan.shard_load[r]`. Empty slots count 0.
    """
    q = plan.expert_shard_pairs
    num_experts, num_shards = q.shape
    if num_local_experts * num_shards != num_experts:
        raise ValueError(
            f"`num_local_experts` ({num_local_experts}) times the number of shards "
            f"({num_shards}) must equal the number of experts ({num_experts})."
        )
    with jax.named_scope("moe_eqx.slot_pair_counts"):
        shards = jnp.arange(num_shards)
        home_counts = q.reshape(num_shards, num_local_experts, num_shards)[
            shards, :, shards
        ]
        se = plan.slot_expert
        slot_counts = jnp.where(
            se >= 0, q[jnp.maximum(se, 0), shards[:, None]], jnp.zeros((), q.dtype)
        )
        return jnp.concatenate([home_counts, slot_counts], axis=1)


def _search_steps(num_shards: int) -> tuple[int, int]:
    """`(levels, width)` of `assign_destinations`' search over the shards: the
    fewest levels whose smallest `width` with `width**levels > R` stays within
    `_SEARCH_WIDTH`."""
    levels = 1
    while True:
        width = 2
        while width**levels <= num_shards:
            width += 1
        if width <= _SEARCH_WIDTH:
            return levels, width
        levels += 1


def assign_destinations(
    plan: DuplicationPlan,
    counts: Int[Array, "shards experts"],
    experts: Int[Array, "tokens k"],
    shard_index: Int[Array, ""] | int,
    *,
    num_local_experts: int,
    within: tuple[Int[Array, " experts"], Int[Array, " experts"]] | None = None,
) -> tuple[Int[Array, "tokens k"], Int[Array, "tokens k"]]:
    """Maps each of this shard's pairs to the replica that processes it.

    The pairs of expert `e` are put in one global order: all of source shard 0's pairs,
    then shard 1's, ...; within a shard in row-major `(token, j)` order. The replicas
    of `e`, in shard order, take consecutive ranges of that order of lengths
    `plan.expert_shard_pairs[e]`. So, over all source shards, replica `d` of `e`
    receives exactly `plan.expert_shard_pairs[e, d]` pairs. Sort-based: memory is
    `O(T k)`, and each pair's range is found by a search over the `R` shards, in
    steps of up to 15 compares.

    **Arguments:**

    - `plan`: the `DuplicationPlan` made from `counts`.
    - `counts`: `[R, E]` the all-gathered counts; row `shard_index` must be the
        histogram of `experts`.
    - `experts`: `[T, k]` this shard's routed experts, in `[0, E)`, or `E` for a
        pair routed to no expert here (it gets no destination, and sorts after all
        others, so it changes no other pair's).
    - `shard_index`: this shard's index (e.g. `lax.axis_index(axis_name)`).
    - `num_local_experts`: `L = E / R`.
    - `within`: `(own, offset)` when several devices share source shard
        `shard_index` (expert tensor parallelism: a tensor group's devices, whose
        rows are computed together): `counts` is then their sum, `own` `[E]` this
        device's histogram of `experts`, and `offset` `[E]` the pairs of each expert
        of the devices before it in the shard's order.

    **Returns:**

    `(dest_shard, dest_group)`, both `[T, k]` int32: the destination shard, and the
    local group there: `e % L` on the home shard `e // L`, else `L + s` where
    `plan.slot_expert[dest_shard, s] == e`. Both are `-1` for a pair that the plan
    gives no replica (its quotas sum to fewer pairs than were routed, or name a
    shard without a copy): a plan made by [`moe_eqx.plan_duplication`][] from the
    same `counts` never does, and the layer reports such pairs as lost.
    """
    num_shards, num_experts = counts.shape
    if num_local_experts * num_shards != num_experts:
        raise ValueError(
            f"`num_local_experts` ({num_local_experts}) times the number of shards "
            f"({num_shards}) must equal the number of experts ({num_experts})."
        )
    num_slots = plan.slot_expert.shape[1]
    with jax.named_scope("moe_eqx.assign_destinations"):
        experts = experts.astype(jnp.int32)
        routed = experts < num_experts  # else routed nowhere: no destination
        if num_slots == 0 or num_shards == 1:
            return (
                jnp.where(routed, jax.lax.div(experts, num_local_experts), -1),
                jnp.where(routed, jax.lax.rem(experts, num_local_experts), -1),
            )
        flat = experts.reshape(-1)
        num_pairs = flat.shape[0]
        index = jnp.arange(num_pairs, dtype=jnp.int32)
        # rank[j]: the index of pair j among this shard's pairs sorted by (expert,
        # position); one sort, then its inverse.
        bits = max(num_pairs - 1, 1).bit_length()
        mask = 2**bits - 1
        if (num_experts + 1) * 2**bits <= _SORT_KEY_LIMIT:
            # One int32 key sorts faster than a stable two-operand sort on CPU
            # (docs/measured.md).
            order = jnp.sort(jnp.left_shift(flat, bits) | index) & mask
        else:
            order = jax.lax.sort((flat, index), num_keys=1, is_stable=True)[1]
        # (`order` is a permutation: the scatter overwrites every entry of `flat`.)
        rank = flat.at[order].set(index, unique_indices=True)
        # Per expert: the position of its first pair here in its global order less
        # its first sorted index (pairs of lower source shards, less local pairs of
        # lower experts), and its cumulative quotas over the shards, padded to
        # `padded` shards with a quota above every position. Searched in `levels`
        # steps of `width - 1` compares.
        levels, width = _search_steps(num_shards)
        padded = width**levels
        counts = counts.astype(jnp.int32)
        shard = jnp.asarray(shard_index, jnp.int32)
        lower_shards = jnp.where(np.arange(num_shards)[:, None] < shard, counts, 0)
        lower_experts = (
            np.arange(num_experts)[:, None] > np.arange(num_experts)[None, :]
        )
        own, offset = (counts[shard], 0) if within is None else within
        own = jnp.asarray(own, jnp.int32)
        shift = jnp.concatenate(
            [lower_shards.T, jnp.where(lower_experts, -own[None, :], 0)],
            axis=1,
        ).sum(axis=1) + jnp.asarray(offset, jnp.int32)
        quota = plan.expert_shard_pairs.astype(jnp.int32)
        upto = np.arange(num_shards)[:, None] >= np.arange(num_shards)[None, :]
        cumulative = jnp.where(upto[None], quota[:, None, :], 0).sum(axis=2)
        cumulative = jnp.pad(
            cumulative, ((0, 0), (0, padded - num_shards)), constant_values=_INT32_MAX
        )
        position = rank + shift[flat]
        # The replica: the number of shards whose cumulative quota of the expert is
        # at most the position (R if none is above it: no replica). A step compares
        # the ends of `width - 1` consecutive blocks, one contiguous window of the
        # block ends per pair.
        dest = None
        for step in range(levels):
            block = width ** (levels - 1 - step)
            ends = cumulative[:, block - 1 :: block]
            if dest is None:  # the first window starts at shard 0: a row each
                window = ends[flat, : width - 1]
                dest = jnp.zeros_like(flat)
            else:
                window = jax.vmap(
                    lambda e, start, ends=ends: jax.lax.dynamic_slice(
                        ends, (e, start), (1, width - 1)
                    )[0]
                )(flat, jax.lax.div(dest, block))
            below = window <= position[:, None]
            dest = dest + block * below.sum(axis=1, dtype=jnp.int32)

        home = jax.lax.div(flat, num_local_experts)
        held = plan.slot_expert[jnp.minimum(dest, num_shards - 1)] == flat[:, None]
        at_home = dest == home
        slot = jnp.where(held, np.arange(num_slots, dtype=np.int32)[None, :], 0).sum(
            axis=1
        )
        group = jnp.where(
            at_home, flat - home * num_local_experts, num_local_experts + slot
        )
        # A pair past its expert's quotas, or sent where no copy of its expert lives,
        # has no destination: it is marked -1 (never sent), and the layer counts it
        # in `stats.lost_pairs`, rather than computing it with the wrong expert.
        ok = (dest < num_shards) & (at_home | held.any(axis=1))
        ok = ok & routed.reshape(-1)
        dest, group = jnp.where(ok, dest, -1), jnp.where(ok, group, -1)
        return dest.reshape(experts.shape), group.reshape(experts.shape)
