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
from jaxtyping import Array, Int

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


# Search for the lowest feasible level: the first round tries these levels (fractions
# of the mean load above the lowest possible level, ceil(mean)), since most plans land
# at or just above the mean; later rounds split the bracket evenly until it is exact.
# fmt: off
_FIRST_FRACTIONS = (
    0.0, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02,
    0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 4.0, 8.0,
)
# fmt: on
_LEVELS_PER_ROUND = len(_FIRST_FRACTIONS)
# Donors a remainder may be passed through within one slot (a chain of small donors).
_CHAIN_HOPS = 2
_INT32_MAX = 2**31 - 1


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
    donors: Int[Array, " shards"]  # shards by decreasing load: the donor order
    receivers: Int[Array, " shards"]  # shards by increasing load: the receiver order
    # top[r, m]: pairs of the m hottest experts of shard r (m = 0..L).
    top: Int[Array, "shards local_plus_one"]


class _Donor(NamedTuple):
    """The donor being emptied, at each candidate level."""

    position: Int[Array, " levels"]  # in the donor order; past the donors when done
    shard: Int[Array, " levels"]
    left: Int[Array, " levels"]  # pairs it still has to shed
    avail: Int[Array, "levels local"]  # pairs of each of its experts not yet shed
    exports: Int[Array, " levels"]  # slot copies of its experts so far


def _loads(counts: Int[Array, "shards experts"]) -> _Loads:
    num_shards, num_experts = counts.shape
    by_shard = counts.astype(jnp.int32).sum(axis=0).reshape(num_shards, -1)
    load = by_shard.sum(axis=1)
    hot_first = -jnp.sort(-by_shard, axis=1)
    top = jnp.concatenate(
        [jnp.zeros_like(load)[:, None], jnp.cumsum(hot_first, axis=1)], axis=1
    )
    return _Loads(
        by_shard=by_shard,
        load=load,
        donors=jnp.argsort(-load, stable=True).astype(jnp.int32),
        receivers=jnp.argsort(load, stable=True).astype(jnp.int32),
        top=top,
    )


def _enter(loads, levels, position, received):
    """The donor at `position` of the donor order (clipped), having `received` pairs
    of the previous donor's expert in a slot: it sheds its excess plus those."""
    shard = loads.donors[jnp.minimum(position, loads.load.shape[0] - 1)]
    return _Donor(
        position=position,
        shard=shard,
        left=loads.load[shard] - levels + received,
        avail=loads.by_shard[shard],
        exports=jnp.zeros_like(position),
    )


def _select(pick, new, old):
    return jax.tree.map(
        lambda a, b: jnp.where(pick.reshape(pick.shape + (1,) * (a.ndim - 1)), a, b),
        new,
        old,
    )


def _chain(loads, levels, num_donors, max_exports, slots_left, donor, need, used):
    """Passes the donor's whole remainder to the next donor, in one slot copy there,
    when the receiver's remaining slots then fill better from the next donor alone.

    A donor's remainder smaller than the receiver's deficit would otherwise take a
    slot of the receiver for a small piece (or, in its last slot, leave it short);
    the next donor sheds the received pairs along with its own excess. The next donor
    is above the level, so its slots are otherwise unused, and it receives at most
    this one copy. Returns the updated donor, used-mask and the copy (target shard,
    expert, pairs; target -1 when not passed).
    """
    local = loads.by_shard.shape[1]
    active = donor.position < num_donors
    after = _enter(loads, levels, donor.position + 1, donor.left)
    excess = after.left - donor.left
    top = loads.top[after.shard]
    stay = donor.left + jnp.minimum(
        jnp.minimum(need - donor.left, top[:, jnp.minimum(slots_left - 1, local)]),
        excess,
    )
    move = jnp.minimum(
        jnp.minimum(need, top[:, jnp.minimum(slots_left, local)]), after.left
    )
    expert = jnp.argmax(donor.avail, axis=1).astype(jnp.int32)
    biggest = donor.avail.max(axis=1)
    go = (
        active
        & (donor.position + 1 < num_donors)
        & (donor.left < need)
        & (move > stay)
        & (biggest >= donor.left)
        & (donor.exports < max_exports)
    )
    copy = (
        jnp.where(go, after.shard, -1),
        donor.shard * local + expert,
        jnp.where(go, donor.left, 0),
    )
    return _select(go, after, donor), used & ~go[:, None], copy


def _take(loads, levels, num_donors, max_exports, last, donor, need, used):
    """Fills one slot of the receiver from the donor: its expert with the most pairs
    left, or in the receiver's last slot the one that fits the deficit most tightly.
    Moves on to the next donor once this one has shed its excess."""
    local = loads.by_shard.shape[1]
    active = (donor.position < num_donors) & (donor.exports < max_exports)
    avail = jnp.where(used, -1, donor.avail)
    want = jnp.minimum(need, donor.left)
    fits = avail >= want[:, None]
    tightest = jnp.argmin(jnp.where(fits, avail, _INT32_MAX), axis=1)
    largest = jnp.argmax(avail, axis=1)
    expert = jnp.where(last & fits.any(axis=1), tightest, largest).astype(jnp.int32)
    amount = jnp.minimum(
        want, jnp.take_along_axis(avail, expert[:, None], axis=1)[:, 0]
    )
    amount = jnp.where(active, jnp.maximum(amount, 0), 0)
    hit = (jnp.arange(local, dtype=jnp.int32)[None, :] == expert[:, None]) & (
        amount > 0
    )[:, None]
    taken = donor._replace(
        left=donor.left - amount,
        avail=donor.avail - jnp.where(hit, amount[:, None], 0),
        exports=donor.exports + (amount > 0).astype(jnp.int32),
    )
    finished = active & (taken.left == 0)
    after = _enter(loads, levels, donor.position + 1, jnp.zeros_like(amount))
    take = (donor.shard * local + expert, amount)
    donor = _select(finished, after, taken)
    used = (used | hit) & ~finished[:, None]
    return donor, need - amount, used, take


def _fill(loads, levels, num_slots, max_exports):
    """The greedy fill at every candidate level.

    Donors (shards above the level, by decreasing load) are emptied one after the
    other; receivers (shards below it, by increasing load, so the largest deficits
    meet the largest donors) each fill up to `num_slots` slots from the current
    donor, each slot a different expert, `_take` and `_chain` choosing the piece. A
    level is feasible if every donor has shed its excess.

    Returns `done [levels]` and the history: the receivers' slot copies `(expert,
    pairs, slot)` (`[shards, slots, levels]` each, in receiver order, slot
    `num_slots` where none) and the passed copies `(target, expert, pairs)`
    (`[shards, slots, hops, levels]` each, target `-1` where none).
    """
    num_donors = (loads.load[None, :] > levels[:, None]).sum(axis=1, dtype=jnp.int32)
    zeros = jnp.zeros_like(levels)
    first = _enter(loads, levels, zeros, zeros)

    def receiver(donor, shard):
        need = jnp.maximum(levels - loads.load[shard], 0)
        used = jnp.zeros_like(donor.avail, dtype=bool)

        def slot(carry, slots_left):
            donor, need, used, filled = carry
            copies = []
            for _ in range(_CHAIN_HOPS):
                donor, used, copy = _chain(
                    loads,
                    levels,
                    num_donors,
                    max_exports,
                    slots_left,
                    donor,
                    need,
                    used,
                )
                copies.append(copy)
            donor, need, used, take = _take(
                loads,
                levels,
                num_donors,
                max_exports,
                slots_left == 1,
                donor,
                need,
                used,
            )
            # Where the copy goes among the receiver's slots: no gaps even after a
            # slot that found nothing.
            expert, pairs = take
            column = jnp.where(pairs > 0, filled, num_slots)
            filled = filled + (pairs > 0).astype(jnp.int32)
            passed = tuple(jnp.stack(parts) for parts in zip(*copies, strict=True))
            return (donor, need, used, filled), ((expert, pairs, column), passed)

        slots_left = jnp.arange(num_slots, 0, -1, dtype=jnp.int32)
        carry = (donor, need, used, jnp.zeros_like(need))
        (donor, *_), out = jax.lax.scan(slot, carry, slots_left)
        return donor, out

    donor, history = jax.lax.scan(receiver, first, loads.receivers)
    done = donor.position >= num_donors
    return done, history


def _search(loads, num_slots, max_exports):
    """The lowest level at which `_fill` succeeds, searched exactly, and its fill.

    The first round tries the levels of `_FIRST_FRACTIONS`; each later round tries
    `_LEVELS_PER_ROUND` evenly spaced levels strictly inside the bracket (highest
    failed, lowest feasible) until it closes. The highest load (nothing to shed,
    no copies) starts as the feasible end, so the result is feasible even where
    feasibility is not monotone. Each round keeps the fill of its best level, so
    the fill is compiled once, not again to record the plan.

    Returns `(level, done, history)` as `_fill` records them at that level.
    """
    num_shards = loads.load.shape[0]
    total = loads.load.sum()
    lowest = (total + num_shards - 1) // num_shards
    highest = loads.load.max()
    mean = total.astype(jnp.float32) / num_shards
    fractions = jnp.asarray(_FIRST_FRACTIONS, jnp.float32)
    # Clip in float32 before the cast so that no offset overflows int32.
    room = (highest - lowest).astype(jnp.float32)
    first = lowest + jnp.minimum(fractions * mean, room).astype(jnp.int32)
    offsets = jnp.arange(1, _LEVELS_PER_ROUND + 1, dtype=jnp.int32)

    def round_(state):
        count, below, above, best = state
        step = jnp.maximum((above - below) // (_LEVELS_PER_ROUND + 1), 1)
        evenly = jnp.minimum(below + step * offsets, above - 1)
        levels = jnp.where(count == 0, first, evenly)
        fill = _fill(loads, levels, num_slots, max_exports)
        done = fill[0]
        pick = jnp.argmin(jnp.where(done, levels, _INT32_MAX))
        better = done[pick] & (levels[pick] < above)
        best = jax.tree.map(
            lambda new, old: jnp.where(better, new[..., pick], old), fill, best
        )
        above = jnp.where(better, levels[pick], above)
        failed = jnp.where(~done & (levels < above), levels, below).max()
        return count + 1, jnp.maximum(below, failed), above, best

    # No copies at all: the fill at the highest load.
    zero = jnp.zeros_like(highest)
    shapes = jax.eval_shape(lambda: _fill(loads, first, num_slots, max_exports))
    done, ((expert, pairs, column), (to, passed_expert, passed_pairs)) = jax.tree.map(
        lambda s: jnp.broadcast_to(zero, s.shape[:-1]), shapes
    )
    takes = (expert, pairs, column + num_slots)
    nothing = (done == 0, (takes, (to - 1, passed_expert, passed_pairs)))
    state = (zero, lowest - 1, highest, nothing)
    _, _, level, (done, history) = jax.lax.while_loop(
        lambda s: (s[0] == 0) | (s[2] - s[1] > 1), round_, state
    )
    return level, done, history


def _home_only(pairs, num_shards, num_slots) -> DuplicationPlan:
    home = jnp.arange(pairs.shape[0], dtype=jnp.int32) // (pairs.shape[0] // num_shards)
    is_home = home[:, None] == jnp.arange(num_shards, dtype=jnp.int32)[None, :]
    return DuplicationPlan(
        slot_expert=jnp.full((num_shards, num_slots), -1, jnp.int32),
        expert_shard_pairs=jnp.where(is_home, pairs[:, None], jnp.zeros((), jnp.int32)),
    )


def _assemble(loads, level, done, history, num_slots, max_exports) -> DuplicationPlan:
    """The plan from the fill recorded at `level`: every copy's pairs come out of its
    expert's home quota; each shard lists its copies in fill order (hottest donor
    first), then its empty slots. Should the plan break an invariant (never
    expected), the home-only plan, which always holds."""
    num_shards, local = loads.by_shard.shape
    num_experts = num_shards * local
    (take_expert, take_pairs, column), (to, passed_expert, passed_pairs) = history
    usable = take_expert.shape[1]
    # (expert, pairs) of every slot; out-of-range indices (no copy) are dropped. A
    # copy passed to a donor goes in its first slot: donors receive nothing else.
    slots = jnp.stack([jnp.full((num_shards, usable), -1, jnp.int32)] * 2, axis=-1)
    slots = slots.at[loads.receivers[:, None], column].set(
        jnp.stack([take_expert, take_pairs], axis=-1), mode="drop"
    )
    to = jnp.where(to >= 0, to, num_shards).ravel()
    slots = slots.at[to, 0].set(
        jnp.stack([passed_expert.ravel(), passed_pairs.ravel()], axis=-1), mode="drop"
    )
    expert, pairs = slots[..., 0], jnp.maximum(slots[..., 1], 0)

    shards = jnp.arange(num_shards, dtype=jnp.int32)
    moved = jnp.zeros((num_experts, num_shards), jnp.int32)
    moved = moved.at[jnp.where(expert >= 0, expert, num_experts), shards[:, None]].add(
        pairs, mode="drop"
    )
    total = loads.by_shard.reshape(-1)
    is_home = (jnp.arange(num_experts, dtype=jnp.int32) // local)[:, None] == shards[
        None, :
    ]
    quota = moved + jnp.where(is_home, (total - moved.sum(axis=1))[:, None], 0)
    sent = (expert[:, :, None] // local == shards[None, None, :]).sum(
        axis=(0, 1), dtype=jnp.int32
    )
    ok = (
        done
        & (quota >= 0).all()
        & (quota.sum(axis=0) <= level).all()
        & (sent <= max_exports).all()
    )
    padding = jnp.full((num_shards, num_slots - usable), -1, jnp.int32)
    plan = DuplicationPlan(
        slot_expert=jnp.concatenate([expert, padding], axis=1),
        expert_shard_pairs=quota,
    )
    fallback = _home_only(total, num_shards, num_slots)
    return jax.tree.map(lambda a, b: jnp.where(ok, a, b), plan, fallback)


def plan_duplication(
    counts: Int[Array, "shards experts"],
    *,
    num_slots: int,
    max_exports: int | None = None,
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
        the total must stay below `2**30` (int32 arithmetic).
    - `num_slots`: `S`, spare slots per shard (static). `0` gives the home-only plan.
    - `max_exports`: `C`, the most slot copies of one home shard's experts (static),
        which bounds the slot weights one shard sends; `None` is
        `default_max_exports(R, L, S)` (this module). `0` gives the home-only plan.
        A home shard `X` times as loaded as the mean needs about `X - 1` copies to
        reach the mean, so a small `C` limits the balance where hot experts share a
        home shard.

    **Returns:**

    A `DuplicationPlan`; `plan.shard_load` is the resulting load per shard.

    Cost: a few rounds of the fill (a `lax.scan` over the `R` receivers and their
    slots, vectorised over 16 candidate levels), one more to record it, and `O(E R)`
    element-wise work. On CPU at `R=64, E=256` this is about a millisecond.
    """
    num_shards, num_experts = counts.shape
    local = local_experts(num_experts, num_shards)
    if not isinstance(num_slots, int) or isinstance(num_slots, bool) or num_slots < 0:
        raise ValueError(f"`num_slots` must be an integer >= 0, got {num_slots!r}.")
    if max_exports is None:
        max_exports = default_max_exports(num_shards, local, num_slots)
    elif (
        not isinstance(max_exports, int)
        or isinstance(max_exports, bool)
        or max_exports < 0
    ):
        raise ValueError(
            f"`max_exports` must be None or an integer >= 0, got {max_exports!r}."
        )
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
        loads = _loads(counts)
        level, done, history = _search(loads, usable, max_exports)
        return _assemble(loads, level, done, history, num_slots, max_exports)


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


def assign_destinations(
    plan: DuplicationPlan,
    counts: Int[Array, "shards experts"],
    experts: Int[Array, "tokens k"],
    shard_index: Int[Array, ""] | int,
    *,
    num_local_experts: int,
) -> tuple[Int[Array, "tokens k"], Int[Array, "tokens k"]]:
    """Maps each of this shard's pairs to the replica that processes it.

    The pairs of expert `e` are put in one global order: all of source shard 0's pairs,
    then shard 1's, ...; within a shard in row-major `(token, j)` order. The replicas
    of `e`, in shard order, take consecutive ranges of that order of lengths
    `plan.expert_shard_pairs[e]`. So, over all source shards, replica `d` of `e`
    receives exactly `plan.expert_shard_pairs[e, d]` pairs. Sort-based: memory is
    `O(T k)`, and each pair's range is found by a binary search over the `R` shards.

    **Arguments:**

    - `plan`: the `DuplicationPlan` made from `counts`.
    - `counts`: `[R, E]` the all-gathered counts; row `shard_index` must be the
        histogram of `experts`.
    - `experts`: `[T, k]` this shard's routed experts, in `[0, E)`.
    - `shard_index`: this shard's index (e.g. `lax.axis_index(axis_name)`).
    - `num_local_experts`: `L = E / R`.

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
        home_shard = experts // num_local_experts
        home_group = experts % num_local_experts
        if num_slots == 0 or num_shards == 1:
            return home_shard, home_group
        shard_index = jnp.asarray(shard_index, jnp.int32)
        counts = counts.astype(jnp.int32)
        flat = experts.reshape(-1)
        num_pairs = flat.shape[0]

        # Rank of each pair among this shard's pairs of the same expert, from one
        # sort by (expert, position).
        index = jnp.arange(num_pairs, dtype=jnp.int32)
        if num_experts * num_pairs < 2**31:
            # A single int32 key sorts ~5x faster than a stable argsort on CPU.
            key = jnp.sort(flat * num_pairs + index)
            perm, sorted_experts = key % num_pairs, key // num_pairs
        else:
            perm = jnp.argsort(flat, stable=True).astype(jnp.int32)
            sorted_experts = flat[perm]
        local_counts = counts[shard_index]
        start = jnp.cumsum(local_counts) - local_counts
        rank_sorted = index - start[sorted_experts]
        rank = (
            jnp.zeros((num_pairs,), jnp.int32)
            .at[perm]
            .set(rank_sorted, unique_indices=True)
        )
        offset = (jnp.cumsum(counts, axis=0) - counts)[shard_index]
        position = offset[flat] + rank

        # First shard d with cumulative quota[e, :d+1] > position (binary search).
        cum = jnp.cumsum(plan.expert_shard_pairs.astype(jnp.int32), axis=1).reshape(-1)
        base = flat * num_shards
        lo = jnp.zeros_like(flat)
        hi = jnp.full_like(flat, num_shards - 1)
        for _ in range((num_shards - 1).bit_length()):
            mid = (lo + hi) // 2
            above = cum[base + mid] > position
            lo = jnp.where(above, lo, mid + 1)
            hi = jnp.where(above, mid, hi)
        dest = lo

        slot_match = plan.slot_expert[dest] == flat[:, None]
        slot = jnp.argmax(slot_match, axis=1).astype(jnp.int32)
        at_home = dest == home_shard.reshape(-1)
        group = jnp.where(at_home, home_group.reshape(-1), num_local_experts + slot)
        # A pair past its expert's quotas, or sent where no copy of its expert lives,
        # has no destination: it is marked -1 (never sent), and the layer counts it
        # in `stats.lost_pairs`, rather than computing it with the wrong expert.
        has_quota = position < cum[base + num_shards - 1]
        has_copy = at_home | jnp.any(slot_match, axis=1)
        ok = has_quota & has_copy
        dest = jnp.where(ok, dest, -1)
        group = jnp.where(ok, group, -1)
        return dest.reshape(experts.shape), group.reshape(experts.shape)
