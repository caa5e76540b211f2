"""Dispatch stages: sort pairs by expert (one device), build deduplicated wire rows
(sender), and expand received wire rows into pairs grouped by local expert (receiver).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from ._checks import check_array
from ._permute import permute_rows, trimmed_inverse
from ._rules import cumsum, div, histogram, rem


class SortedPairs(eqx.Module):
    """Pairs sorted by group, ready for the grouped matmul.

    **Fields:**

    - `row`: `[P]` index of the source row (token, or wire row) of each sorted pair.
    - `weight`: `[P]` float32 routing weight (0 for padding pairs).
    - `group_sizes`: `[G]` pairs per group; pairs past `sum(group_sizes)` are padding.
    - `order`: optional `[P]` candidate pair at each sorted position (pair
        `r * per_row + j` is row `r`'s `j`-th pair), so `row = order // per_row`.
    - `inverse`: optional `[N = rows * per_row]` sorted position of each candidate
        pair (`>= P` for one that was not kept). With `order`, it lets
        [`moe_eqx.combine`][] and [`moe_eqx.internal.permute_rows`][] run as gathers in
        both directions instead of scatter-adds. `None` when the
        pairs were not built as a permutation.
    """

    row: Int[Array, " pairs"]
    weight: Float[Array, " pairs"]
    group_sizes: Int[Array, " groups"]
    order: Int[Array, " pairs"] | None = None
    inverse: Int[Array, " candidates"] | None = None

    def rows_of(self, x: Float[Array, "rows ..."]) -> Float[Array, "pairs ..."]:
        """Each pair's source row of `x` (`x[row]`): with `order` and `inverse` set, a
        gather whose backward is a gather too ([`moe_eqx.internal.permute_rows`][]),
        else a gather by `row` whose backward is a scatter-add."""
        if self.order is not None and self.inverse is not None:
            return permute_rows(x, self.order, self.inverse)
        return x[self.row]


def _sort_pairs(
    groups: Int[Array, " candidates"],
    weights: Float[Array, " candidates"],
    valid: Bool[Array, " candidates"],
    *,
    num_groups: int,
    capacity: int,
    per_row: int,
) -> tuple[SortedPairs, Int[Array, ""]]:
    key = jnp.where(valid, groups, num_groups)
    whole = _stable_order(key, num_groups + 1)
    order, inverse = whole[:capacity], trimmed_inverse(whole, capacity)
    sizes = histogram(key, num_groups)
    total = jnp.sum(sizes)
    # Keep the first `capacity` pairs in sorted order: trim the group sizes to match.
    ends = jnp.minimum(cumsum(sizes), capacity)
    kept = ends - jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    in_range = jnp.arange(capacity) < ends[-1]
    # The gathers both ways (the combine, the pairs' rows and their transposes) read
    # every candidate slot (rows x per_row); the scatter-adds touch only the pairs.
    # So `order`/`inverse` are kept where the slots are at most twice the pairs the
    # buffer holds (one shard's rows, rows of one pair each) and dropped where a
    # receiver's rows are mostly empty slots (many shards).
    dense = key.shape[0] <= 2 * order.shape[0]
    pairs = SortedPairs(
        row=div(order, per_row),
        weight=jnp.where(in_range, permute_rows(weights, order, inverse), 0.0),
        group_sizes=kept,
        order=order if dense else None,
        inverse=inverse if dense else None,
    )
    return pairs, total - ends[-1]


def sort_by_expert(
    experts: Int[Array, "tokens k"],
    weights: Float[Array, "tokens k"],
    num_experts: int,
) -> SortedPairs:
    """Single-device dispatch: sort the `T * k` pairs by expert.

    **Arguments:**

    - `experts`: `[T, k]` chosen experts.
    - `weights`: `[T, k]` routing weights.
    - `num_experts`: `E`.

    **Returns:**

    [`moe_eqx.internal.SortedPairs`][] with `T * k` pairs, `row` = token index, and `order` /
    `inverse` set (a full permutation of the `T * k` pairs): the weights' gradient,
    [`moe_eqx.combine`][] and [`moe_eqx.internal.permute_rows`][] are then gathers.
    """
    where = "sort_by_expert"
    check_array("experts", experts, ndim=2, kind="int", where=where)
    check_array("weights", weights, shape=experts.shape, kind="float", where=where)
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(
            f"{where}: `num_experts` must be a positive int, got {num_experts!r}."
        )
    with jax.named_scope("moe_eqx.dispatch"):
        tokens, k = experts.shape
        flat = experts.ravel()
        order = _stable_order(flat, num_experts)
        inverse = trimmed_inverse(order, tokens * k)
        return SortedPairs(
            row=div(order, k),
            weight=permute_rows(weights.ravel(), order, inverse),
            group_sizes=_histogram(flat, num_experts),
            order=order,
            inverse=inverse,
        )


def _stable_order(flat: Int[Array, " pairs"], num_groups: int) -> Int[Array, " pairs"]:
    """`argsort(flat, stable=True)` for `0 <= flat < num_groups`."""
    num = flat.shape[0]
    if (num_groups + 1) * num >= 2**31:
        return jnp.argsort(flat, stable=True).astype(jnp.int32)
    # One int32 key per pair, `group * num + pair`, is unique, so an unstable sort of a
    # single array gives the stable order, faster than a stable (key, index) sort.
    key = flat.astype(jnp.int32) * num + jnp.arange(num, dtype=jnp.int32)
    return rem(jnp.sort(key), num)


class WireRows(eqx.Module):
    """The sender's wire rows, sorted by destination shard.

    One row per (token, destination shard) when deduplicating, else one per pair. Each
    row carries the token's activation once plus `(local group, weight)` for each of the
    token's pairs on that shard (`width = k` with dedup, 1 without; unused entries have
    group -1 and weight 0).

    **Fields:**

    - `token`: `[N]` source token of each row.
    - `groups`: `[N, width]` destination-local groups (-1 = unused entry).
    - `weights`: `[N, width]` float32 weights (0 for unused entries).
    - `send_counts`: `[R]` rows for each destination; rows past their sum are padding.
    - `send_pairs`: `[R]` pairs those rows carry to each destination.
    - `order`: `[N]` the candidate pair `t * k + j` each row was built from (its first
        pair on that shard), so `token = order // k`.
    - `inverse`: `[T * k]` the row of each candidate pair (`>= N` for one that is not a
        row), the inverse of `order`.
    - `token_rows`: `[T * w]` each token's rows, `w = min(k, R)` with dedup (`k`
        without), in pair order, then `N` (none): with it,
        [`moe_eqx.internal.sum_rows`][] sums each token's rows back into it by `w`
        gathers, not a scatter-add (on the return trip, and in the backward of the
        gather of tokens into rows). With dedup `inverse` would take `k` gathers,
        most of them of no row where `k > R`.
    - `num_tokens`: `T`.
    """

    token: Int[Array, " rows"]
    groups: Int[Array, "rows width"]
    weights: Float[Array, "rows width"]
    send_counts: Int[Array, " shards"]
    send_pairs: Int[Array, " shards"]
    order: Int[Array, " rows"]
    inverse: Int[Array, " candidates"]
    token_rows: Int[Array, " token_slots"]
    num_tokens: int = eqx.field(static=True)

    @property
    def num_pairs(self) -> Int[Array, " rows"]:
        return jnp.sum(self.groups >= 0, axis=1).astype(jnp.int32)


def dedup_rows(
    dest_shard: Int[Array, "tokens k"],
    dest_group: Int[Array, "tokens k"],
    weights: Float[Array, "tokens k"],
    valid: Bool[Array, "tokens k"],
    *,
    num_shards: int,
    dedup: bool,
) -> WireRows:
    """Dedup dispatcher (sender side): group a shard's pairs into wire rows.

    **Arguments:**

    - `dest_shard`, `dest_group`: `[T, k]` physical destination of each pair.
    - `weights`: `[T, k]` routing weights.
    - `valid`: `[T, k]` pairs to send (padding tokens are not sent).
    - `num_shards`: `R`.
    - `dedup`: one row per (token, shard) if True, else one row per pair.

    **Returns:**

    [`moe_eqx.internal.WireRows`][] with `T * min(k, R)` rows if deduplicating, else `T * k`.
    """
    with jax.named_scope("moe_eqx.dedup_dispatch"):
        tokens, k = dest_shard.shape
        if dedup:
            same = _same_shard(dest_shard, valid)
            is_first = _first_of_shard(same, valid)
            carry = same & is_first[:, :, None]  # rows that are not sent carry nothing
            groups = jnp.where(carry, dest_group[:, None, :], -1)
            wts = jnp.where(carry, weights[:, None, :], 0.0)
            width, num_rows = k, tokens * min(k, num_shards)
        else:
            is_first = valid
            groups = jnp.where(valid, dest_group, -1)[:, :, None]
            wts = jnp.where(valid, weights, 0.0)[:, :, None]
            width, num_rows = 1, tokens * k
        dest = jnp.where(is_first, dest_shard, num_shards).ravel()
        whole = _stable_order(dest, num_shards + 1)
        order, inverse = whole[:num_rows], trimmed_inverse(whole, num_rows)
        if dedup:
            token_rows = _token_rows(inverse, is_first, min(k, num_shards), num_rows)
        else:
            token_rows = inverse
        return WireRows(
            token=div(order, k),
            groups=groups.reshape(tokens * k, width)[order],
            # A gather both ways (its plain transpose is a scatter-add).
            weights=permute_rows(wts.reshape(tokens * k, width), order, inverse),
            send_counts=_histogram(dest, num_shards),
            send_pairs=_histogram(
                jnp.where(valid, dest_shard, num_shards).ravel(), num_shards
            ),
            order=order,
            inverse=inverse,
            token_rows=token_rows,
            num_tokens=tokens,
        )


def _token_rows(inverse, is_first, width: int, none: int):
    """`[T * width]`: the rows of each token's first pairs on a shard, in pair
    order, then `none` (elementwise over `[T, width, k]`: no sort, no gather)."""
    tokens, k = is_first.shape
    rank = cumsum(is_first.astype(jnp.int32), axis=1) - 1  # [T, k]
    slot = jnp.arange(width, dtype=jnp.int32)[None, :, None]
    hit = is_first[:, None, :] & (rank[:, None, :] == slot)  # [T, width, k]
    row = jnp.sum(jnp.where(hit, inverse.reshape(tokens, 1, k), 0), axis=2)
    return jnp.where(jnp.any(hit, axis=2), row, none).astype(jnp.int32).ravel()


def _histogram(index: Int[Array, " n"], size: int) -> Int[Array, " size"]:
    """Counts of each value in `[0, size)`; the value `size` marks "not counted"."""
    return histogram(index, size)


def _same_shard(dest_shard: Array, valid: Array) -> Array:
    same = dest_shard[:, :, None] == dest_shard[:, None, :]  # [T, k, k]
    return same & valid[:, None, :] & valid[:, :, None]


def _first_of_shard(same: Array, valid: Array) -> Array:
    k = same.shape[1]
    earlier = jnp.tril(jnp.ones((k, k), bool), -1)
    return valid & ~jnp.any(same & earlier[None], axis=2)


def send_counts(
    dest_shard: Int[Array, "tokens k"],
    valid: Bool[Array, "tokens k"],
    *,
    num_shards: int,
    dedup: bool,
) -> Int[Array, " shards"]:
    """Wire rows this shard sends to each shard (what [`moe_eqx.internal.dedup_rows`][] would
    produce), without building the rows: the input of the overflow predicate.

    **Arguments:**

    - `dest_shard`: `[T, k]` destination shard of each pair.
    - `valid`: `[T, k]` pairs to send.
    - `num_shards`: `R`.
    - `dedup`: one row per (token, shard) if True, else one per pair.

    **Returns:**

    `[R]` int32 row counts.
    """
    first = _first_of_shard(_same_shard(dest_shard, valid), valid) if dedup else valid
    return _histogram(jnp.where(first, dest_shard, num_shards).ravel(), num_shards)


def expand_rows(
    groups: Int[Array, "rows width"],
    weights: Float[Array, "rows width"],
    num_rows: Int[Array, ""],
    *,
    local_groups: int,
    capacity: int,
) -> tuple[SortedPairs, Int[Array, ""]]:
    """Receiver side: expand received wire rows into pairs grouped by local group.

    **Arguments:**

    - `groups`, `weights`: `[B, width]` metadata of the received rows.
    - `num_rows`: how many leading rows are valid.
    - `local_groups`: the receiver's GMM groups `L + S` (home experts, then slots).
    - `capacity`: pair buffer size.

    **Returns:**

    `(pairs, dropped)`: [`moe_eqx.internal.SortedPairs`][] with `capacity` pairs (`row` = wire row)
    and the number of valid pairs that did not fit (deterministic: the last in group
    order). The pairs keep `order` and `inverse` (so that the pairs' rows and the
    combine are gathers both ways, not scatter-adds) where the `B * width` candidate
    slots are at most twice `capacity`.
    """
    with jax.named_scope("moe_eqx.expand"):
        rows, width = groups.shape
        valid = (groups >= 0) & (jnp.arange(rows)[:, None] < num_rows)
        return _sort_pairs(
            groups.ravel(),
            weights.ravel(),
            valid.ravel(),
            num_groups=local_groups,
            capacity=capacity,
            per_row=width,
        )
