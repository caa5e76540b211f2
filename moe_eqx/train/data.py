"""Synthetic, learnable, exactly resumable token sequences for the training demo, and
the feed that places each step's batch on the mesh.

Every batch is a pure function of `(seed, step, row)`: resuming at step `s` reproduces
the batches an uninterrupted run would have seen, and every process of a multi-process
run can generate exactly its own rows of the same global batch.
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from .step import Placement

# Domain-separation words for `np.random.default_rng([...])`, so the structure of the
# language and the per-step samples never share a random stream.
_STRUCTURE = 0x5EED
_SAMPLES = 0xDA7A


class ZipfMarkovData:
    """Token sequences from a Zipf unigram mixed with a deterministic bigram map.

    Each next token is `successor[prev]` with probability `follow`, else a fresh draw
    from a Zipf(`exponent`) distribution over the vocabulary. A model that learns the
    successor map can push the loss well below the unigram entropy, so training visibly
    makes progress. During a "skew" phase all tokens collapse onto the `skew_ids` most
    frequent ids (an adversarial distribution for expert routing).

    Uses only local `np.random.Generator`s; never the global NumPy RNG.

    **Arguments:**

    - `vocab`: vocabulary size.
    - `seed`: fixes both the language (Zipf ranks, successor map) and the samples.
    - `exponent`: Zipf exponent of the unigram distribution.
    - `follow`: probability that the next token is the deterministic successor.
    - `skew_ids`: number of distinct ids in the collapsed (skewed) distribution.
    """

    def __init__(
        self,
        vocab: int,
        seed: int,
        *,
        exponent: float = 1.1,
        follow: float = 0.75,
        skew_ids: int = 2,
    ):
        if vocab < 2:
            raise ValueError(f"`vocab` must be >= 2, got {vocab}.")
        if not 0.0 <= follow <= 1.0:
            raise ValueError(f"`follow` must be in [0, 1], got {follow}.")
        if not 1 <= skew_ids <= vocab:
            raise ValueError(f"`skew_ids` must be in [1, vocab], got {skew_ids}.")
        self.vocab = vocab
        self.seed = seed
        self.follow = follow
        rng = np.random.default_rng([seed, _STRUCTURE])
        # Rank r (0 = most frequent) is token id order[r].
        order = rng.permutation(vocab)
        weights = 1.0 / np.arange(1, vocab + 1, dtype=np.float64) ** exponent
        probs = np.empty(vocab)
        probs[order] = weights / weights.sum()
        self.unigram = probs
        self._cdf = np.cumsum(probs)
        self._cdf[-1] = 1.0
        self.successor = rng.permutation(vocab).astype(np.int32)
        self.skew_tokens = order[:skew_ids].astype(np.int32)

    def _row_draws(self, step: int, row: int, length: int):
        rng = np.random.default_rng([self.seed, _SAMPLES, step, row])
        return rng.random(length), rng.random(length)

    def rows(
        self, step: int, rows: range, seq: int, *, skew: bool = False
    ) -> np.ndarray:
        """Rows `rows` of the global batch of `step`.

        **Arguments:**

        - `step`: training step (the data position).
        - `rows`: which rows of the global batch (e.g. `range(batch)`, or one process's
            share of it).
        - `seq`: sequence length; `seq + 1` tokens are returned per row so that inputs
            are `[:, :-1]` and targets `[:, 1:]`.
        - `skew`: draw from the collapsed distribution instead.

        **Returns:**

        An int32 array `[len(rows), seq + 1]`.
        """
        length = seq + 1
        draws = [self._row_draws(step, r, length) for r in rows]
        if not draws:
            return np.zeros((0, length), np.int32)
        u_follow = np.stack([d[0] for d in draws])
        u_token = np.stack([d[1] for d in draws])
        if skew:
            idx = np.minimum(
                (u_token * len(self.skew_tokens)).astype(np.int64),
                len(self.skew_tokens) - 1,
            )
            return self.skew_tokens[idx].astype(np.int32)
        fresh = np.minimum(np.searchsorted(self._cdf, u_token), self.vocab - 1)
        out = np.empty_like(fresh, dtype=np.int32)
        out[:, 0] = fresh[:, 0]
        for t in range(1, length):
            follow = u_follow[:, t] < self.follow
            out[:, t] = np.where(follow, self.successor[out[:, t - 1]], fresh[:, t])
        return out

    def batch(
        self, step: int, batch: int, seq: int, *, skew: bool = False
    ) -> np.ndarray:
        """The whole global batch of `step`: `rows(step, range(batch), seq, skew=skew)`."""
        return self.rows(step, range(batch), seq, skew=skew)

    def entropy_floor(self) -> float:
        """Cross-entropy (nats per token) of the true next-token distribution under the
        chain's stationary distribution: the loss no model can beat on long sequences."""
        p, f = self.unigram, self.follow
        pi = p.copy()
        for _ in range(500):
            nxt = (1.0 - f) * p
            np.add.at(nxt, self.successor, f * pi)
            pi = nxt
        # Given prev, next ~ f * onehot(successor[prev]) + (1 - f) * p.
        q = np.broadcast_to((1.0 - f) * p, (self.vocab, self.vocab)).copy()
        q[np.arange(self.vocab), self.successor] += f
        h = -(q * np.log(np.maximum(q, 1e-300))).sum(axis=1)
        return float(pi @ h)


class Feed:
    """The batch and router selection bias of each step, for this process's rows of
    the global batch.

    **Arguments:**

    - `data`: the token source.
    - `placement`: where the batch goes.
    - `args`: the flags (`batch`, `seq`, `experts`, `top_k`, `skew_*`).
    - `ep`: expert-parallel size.
    - `devices`: the devices the batch is split over (`ep` times the data-parallel
        groups).
    """

    def __init__(
        self,
        data: ZipfMarkovData,
        placement: Placement,
        args: argparse.Namespace,
        ep: int,
        devices: int | None = None,
    ):
        self.data = data
        self.placement = placement
        self.seq = args.seq
        self.global_shape = (args.batch, args.seq + 1)
        self.local_rows = self._local_rows(args.batch, devices or ep)
        self.skew = (args.skew_from, args.skew_to)
        self.no_bias = np.zeros((args.experts,), np.float32)
        self.skew_bias = self.no_bias.copy()
        # The experts of shard 0 (on one device: the first top_k experts).
        self.skew_bias[: args.experts // ep if ep > 1 else args.top_k] = args.skew_bias

    def _local_rows(self, batch: int, devices: int) -> range:
        # Rows of the global batch that live on this process's devices.
        if self.placement.batch is None:
            return range(batch)
        index_map = self.placement.batch.addressable_devices_indices_map(
            self.global_shape
        )
        starts = sorted({idx[0].start or 0 for idx in index_map.values()})
        per_device = batch // devices
        rows = range(starts[0], starts[-1] + per_device)
        if len(rows) != per_device * len(starts):
            raise SystemExit("this process's devices do not hold contiguous batch rows")
        return rows

    def in_skew(self, step: int) -> bool:
        lo, hi = self.skew
        return lo is not None and lo <= step < hi

    def batch(self, step: int) -> jax.Array:
        local = self.data.rows(step, self.local_rows, self.seq, skew=self.in_skew(step))
        if self.placement.batch is None:
            return jnp.asarray(local)
        return jax.make_array_from_process_local_data(
            self.placement.batch, local, self.global_shape
        )

    def router_bias(self, step: int) -> jax.Array:
        return self.placement.put(
            self.skew_bias if self.in_skew(step) else self.no_bias
        )
