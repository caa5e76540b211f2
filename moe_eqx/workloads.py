"""Synthetic routing workloads: who sends how many tokens to which expert.

Each workload is a per-expert preference (probabilities `[E]`, or `[R, E]` for one row
per source shard) from which [`sample_choices`][] draws, for every token, `k`
*distinct* experts without replacement (Gumbel-top-k on the log-probabilities, i.e.
Plackett-Luce sampling). Everything is drawn from a local `np.random.Generator` seeded
by the `seed` argument, so a workload is a pure function of its arguments.

```python
import moe_eqx.workloads as wl
probs = wl.zipf_probs(256, s=1.2, hot="contiguous", num_shards=64)
choices = wl.sample_choices(probs, num_shards=64, tokens=4096, top_k=8, seed=0)
counts = wl.counts_from_choices(choices, 256)      # [R, E], the planner's input
```

Expert `e` lives on shard `e // (E / R)` (the layout of the expert-parallel layer), so
"contiguous" hot experts share home shards while "spread" ones do not.

To make a real router follow a workload in a layer test, give it a selection-only bias
(`MoEConfig(use_router_bias=True)`) built by [`forcing_bias`][] (every token picks
exactly the given experts) or [`preference_bias`][] (a soft, Zipf-like skew).
"""

import math
from collections.abc import Sequence

import numpy as np
from jaxtyping import Bool, Float, Int

from ._checks import check_int

__all__ = [
    "HOT_LAYOUTS",
    "WORKLOADS",
    "adversarial_choices",
    "counts_from_choices",
    "drifting_zipf_probs",
    "forcing_bias",
    "lognormal_probs",
    "one_shard_choices",
    "preference_bias",
    "rotating_hotspot_probs",
    "sample_choices",
    "sample_workload",
    "uniform_probs",
    "zipf_probs",
]

HOT_LAYOUTS = ("spread", "contiguous", "random")
"""Where the hot ranks of [`zipf_probs`][] and [`drifting_zipf_probs`][] live
(`hot=`)."""

WORKLOADS = (
    "uniform",
    "zipf",
    "lognormal",
    "rotating_hotspot",
    "drifting_zipf",
    "same_experts",
    "one_shard",
)
"""The workload names [`sample_workload`][] takes."""


def _rank_to_expert(
    num_experts: int, hot: str, num_shards: int | None, seed: int
) -> Int[np.ndarray, " experts"]:
    """Expert that receives popularity rank `i` (rank 0 = hottest)."""
    if hot == "contiguous":
        return np.arange(num_experts)
    if hot == "random":
        return np.random.default_rng(seed).permutation(num_experts)
    if hot == "spread":
        if num_shards is None:
            raise ValueError("`num_shards` is required for hot='spread'.")
        check_int(num_shards, "num_shards")
        if num_experts % num_shards != 0:
            raise ValueError(
                f"`num_experts` ({num_experts}) must be divisible by `num_shards` "
                f"({num_shards})."
            )
        local = num_experts // num_shards
        ranks = np.arange(num_experts)
        # Round-robin over shards: ranks 0..R-1 land on shards 0..R-1, one each.
        return (ranks % num_shards) * local + ranks // num_shards
    raise ValueError(f"`hot` must be one of {HOT_LAYOUTS}, got {hot!r}.")


def _normalise(weights: np.ndarray) -> np.ndarray:
    weights = np.asarray(weights, dtype=np.float64)
    return weights / weights.sum(axis=-1, keepdims=True)


def uniform_probs(num_experts: int) -> Float[np.ndarray, " experts"]:
    """Every expert equally likely.

    **Arguments:**

    - `num_experts`: `E`.

    **Returns:**

    `[E]` float64 probabilities.
    """
    check_int(num_experts, "num_experts")
    return np.full((num_experts,), 1.0 / num_experts)


def zipf_probs(
    num_experts: int,
    s: float,
    *,
    hot: str = "spread",
    num_shards: int | None = None,
    seed: int = 0,
) -> Float[np.ndarray, " experts"]:
    """Zipf popularity: the expert of rank `i` (0 = hottest) has weight `(i + 1) ** -s`.

    **Arguments:**

    - `num_experts`: `E`.
    - `s`: Zipf exponent (`0` = uniform; `1.2` is strongly skewed).
    - `hot`: where the hot ranks live. `"spread"`: round-robin over the home shards
        (rank `i` on shard `i % R`), so no two of the `R` hottest share a shard;
        `"contiguous"`: rank `i` is expert `i`, so the hottest experts share shard 0;
        `"random"`: a permutation drawn from `seed`.
    - `num_shards`: `R`, needed for `hot="spread"`.
    - `seed`: seed of the `"random"` layout.

    **Returns:**

    `[E]` float64 probabilities.
    """
    check_int(num_experts, "num_experts")
    if not (math.isfinite(s) and s >= 0):
        raise ValueError(f"`s` must be a finite number >= 0, got {s!r}.")
    by_rank = _normalise(np.arange(1, num_experts + 1, dtype=np.float64) ** -s)
    probs = np.empty_like(by_rank)
    probs[_rank_to_expert(num_experts, hot, num_shards, seed)] = by_rank
    return probs


def lognormal_probs(
    num_experts: int, sigma: float, *, seed: int = 0
) -> Float[np.ndarray, " experts"]:
    """Log-normal popularity: `log p_e ~ N(0, sigma^2)` (independent experts).

    **Arguments:**

    - `num_experts`: `E`.
    - `sigma`: standard deviation of the log-weights (`0` = uniform).
    - `seed`: seed of the draw.

    **Returns:**

    `[E]` float64 probabilities.
    """
    check_int(num_experts, "num_experts")
    if not (math.isfinite(sigma) and sigma >= 0):
        raise ValueError(f"`sigma` must be a finite number >= 0, got {sigma!r}.")
    rng = np.random.default_rng(seed)
    return _normalise(np.exp(sigma * rng.standard_normal(num_experts)))


def rotating_hotspot_probs(
    num_experts: int,
    step: int,
    *,
    num_hot: int = 8,
    hot_factor: float = 50.0,
    stride: int | None = None,
) -> Float[np.ndarray, " experts"]:
    """A hot set of `num_hot` consecutive experts that moves by `stride` every step.

    At step `t` the experts `(t * stride + i) % E` for `i < num_hot` weigh `hot_factor`,
    the others `1`. With the default `stride = num_hot` the hot set jumps to fresh
    experts every step: a placement chosen from past steps is always wrong.

    **Arguments:**

    - `num_experts`: `E`.
    - `step`: the step index `t >= 0`.
    - `num_hot`: size of the hot set.
    - `hot_factor`: weight of a hot expert relative to a cold one.
    - `stride`: how far the hot set moves per step (default `num_hot`).

    **Returns:**

    `[E]` float64 probabilities.
    """
    check_int(num_experts, "num_experts")
    check_int(num_hot, "num_hot")
    if num_hot > num_experts:
        raise ValueError(f"`num_hot` ({num_hot}) must not exceed `num_experts`.")
    if not (math.isfinite(hot_factor) and hot_factor > 0):
        raise ValueError(f"`hot_factor` must be positive, got {hot_factor!r}.")
    stride = num_hot if stride is None else stride
    weights = np.ones((num_experts,))
    weights[(step * stride + np.arange(num_hot)) % num_experts] = hot_factor
    return _normalise(weights)


def drifting_zipf_probs(
    num_experts: int,
    step: int,
    *,
    s: float = 1.2,
    drift: float = 0.1,
    hot: str = "random",
    num_shards: int | None = None,
    seed: int = 0,
) -> Float[np.ndarray, " experts"]:
    """Zipf popularity whose log-weights follow a Gaussian random walk over steps.

    `log p_e(t) = log zipf_e + drift * (z_1 + ... + z_t)_e` with `z_i ~ N(0, I)` drawn
    from `seed`, so consecutive steps are correlated but the hot set changes over tens
    of steps, as routing does during training.

    **Arguments:**

    - `num_experts`: `E`.
    - `step`: the step index `t >= 0`.
    - `s`: Zipf exponent at step 0.
    - `drift`: per-step standard deviation of the log-weight walk.
    - `hot`, `num_shards`: layout of the step-0 ranks, as in [`zipf_probs`][].
    - `seed`: seed of the layout and of the walk.

    **Returns:**

    `[E]` float64 probabilities.
    """
    if not isinstance(step, int | np.integer) or step < 0:
        raise ValueError(f"`step` must be an integer >= 0, got {step!r}.")
    base = np.log(zipf_probs(num_experts, s, hot=hot, num_shards=num_shards, seed=seed))
    rng = np.random.default_rng([seed, 1])
    walk = drift * rng.standard_normal((step, num_experts)).sum(axis=0)
    logits = base + walk
    return _normalise(np.exp(logits - logits.max()))


def sample_choices(
    probs: Float[np.ndarray, " experts"] | Float[np.ndarray, "shards experts"],
    *,
    num_shards: int,
    tokens: int,
    top_k: int,
    seed: int,
) -> Int[np.ndarray, "shards tokens k"]:
    """Draws `k` distinct experts per token, without replacement, proportionally to
    `probs` (Gumbel-top-k on the log-probabilities).

    **Arguments:**

    - `probs`: `[E]` probabilities shared by all shards, or `[R, E]` one row per source
        shard. Zero entries are never chosen; at least `k` must be positive per row.
    - `num_shards`: `R`.
    - `tokens`: `T`, tokens per shard.
    - `top_k`: `k`.
    - `seed`: seed of the local `np.random.Generator`.

    **Returns:**

    `[R, T, k]` int32 expert ids; the `k` of a token are distinct and ordered by
    decreasing sampled score (the router's top choice first).
    """
    for name, value in (
        ("num_shards", num_shards),
        ("tokens", tokens),
        ("top_k", top_k),
    ):
        check_int(value, name)
    probs = np.asarray(probs, dtype=np.float64)
    if probs.ndim == 1:
        probs = np.broadcast_to(probs, (num_shards, probs.shape[0]))
    if probs.shape[0] != num_shards:
        raise ValueError(f"`probs` has {probs.shape[0]} rows, expected {num_shards}.")
    num_experts = probs.shape[1]
    if top_k > num_experts:
        raise ValueError(f"`top_k` ({top_k}) must not exceed `num_experts`.")
    if np.any(probs < 0) or np.any((probs > 0).sum(axis=1) < top_k):
        raise ValueError("`probs` must be >= 0 with at least `top_k` positive entries.")
    rng = np.random.default_rng(seed)
    out = np.empty((num_shards, tokens, top_k), dtype=np.int32)
    with np.errstate(divide="ignore"):
        log_probs = np.log(probs)
    # One shard at a time keeps the [T, E] score matrix small.
    for r in range(num_shards):
        scores = log_probs[r] + rng.gumbel(size=(tokens, num_experts))
        top = np.argpartition(-scores, top_k - 1, axis=1)[:, :top_k]
        order = np.argsort(-np.take_along_axis(scores, top, axis=1), axis=1)
        out[r] = np.take_along_axis(top, order, axis=1)
    return out


def adversarial_choices(
    *, num_shards: int, tokens: int, num_experts: int, top_k: int
) -> Int[np.ndarray, "shards tokens k"]:
    """Every token of every shard chooses the same experts `0, 1, ..., k-1`.

    Each of them receives all `R * T` tokens, the most any expert can receive; they
    live on shard 0 (and the next shards when `k > E / R`).

    **Arguments:**

    - `num_shards`, `tokens`, `num_experts`, `top_k`: `R`, `T`, `E`, `k`.

    **Returns:**

    `[R, T, k]` int32 expert ids.
    """
    for name, value in (
        ("num_shards", num_shards),
        ("tokens", tokens),
        ("num_experts", num_experts),
        ("top_k", top_k),
    ):
        check_int(value, name)
    if top_k > num_experts:
        raise ValueError(f"`top_k` ({top_k}) must not exceed `num_experts`.")
    row = np.arange(top_k, dtype=np.int32)
    return np.broadcast_to(row, (num_shards, tokens, top_k)).copy()


def one_shard_choices(
    *, num_shards: int, tokens: int, num_experts: int, top_k: int, seed: int
) -> Int[np.ndarray, "shards tokens k"]:
    """Every token chooses experts of shard 0 only (uniformly among them).

    When `k > E / R` a token cannot find `k` distinct experts on shard 0; it then takes
    all of shard 0's experts and the rest uniformly from the next shards' experts, in
    order (shard 1 first), which keeps shard 0 the hottest possible.

    **Arguments:**

    - `num_shards`, `tokens`, `num_experts`, `top_k`: `R`, `T`, `E`, `k`.
    - `seed`: seed of the local `np.random.Generator`.

    **Returns:**

    `[R, T, k]` int32 expert ids.
    """
    check_int(num_experts, "num_experts")
    check_int(num_shards, "num_shards")
    if num_experts % num_shards != 0:
        raise ValueError(
            f"`num_experts` ({num_experts}) must be divisible by `num_shards` "
            f"({num_shards})."
        )
    local = num_experts // num_shards
    # Enough whole shards (starting at 0) to hold k distinct experts.
    pool = min(num_experts, local * math.ceil(top_k / local))
    probs = np.zeros((num_experts,))
    probs[:local] = 1.0
    if pool > local:
        # Much colder than shard 0, so Gumbel-top-k takes all of shard 0 first.
        probs[local:pool] = 1e-12
    return sample_choices(
        _normalise(probs), num_shards=num_shards, tokens=tokens, top_k=top_k, seed=seed
    )


def counts_from_choices(
    choices: Int[np.ndarray, "shards tokens k"], num_experts: int
) -> Int[np.ndarray, "shards experts"]:
    """Pairs each source shard routes to each expert (the planner's `counts`).

    **Arguments:**

    - `choices`: `[R, T, k]` expert ids in `[0, E)`.
    - `num_experts`: `E`.

    **Returns:**

    `[R, E]` int32 counts; row `r` sums to `T * k`.
    """
    choices = np.asarray(choices)
    if choices.size and (choices.min() < 0 or choices.max() >= num_experts):
        raise ValueError("`choices` must lie in [0, num_experts).")
    num_shards = choices.shape[0]
    flat = choices.reshape(num_shards, -1).astype(np.int64)
    flat = flat + num_experts * np.arange(num_shards)[:, None]
    counts = np.bincount(flat.ravel(), minlength=num_shards * num_experts)
    return counts.reshape(num_shards, num_experts).astype(np.int32)


def sample_workload(
    name: str,
    *,
    num_shards: int,
    tokens: int,
    num_experts: int,
    top_k: int,
    seed: int = 0,
    step: int = 0,
    s: float = 1.2,
    hot: str = "spread",
    sigma: float = 1.0,
    drift: float = 0.1,
) -> Int[np.ndarray, "shards tokens k"]:
    """Expert choices of a named workload (one of [`WORKLOADS`][]).

    **Arguments:**

    - `name`: `"uniform"`, `"zipf"` (exponent `s`, layout `hot`), `"lognormal"`
        (`sigma`), `"rotating_hotspot"` (at `step`), `"drifting_zipf"` (`s`, `hot`, at
        `step`), `"same_experts"` ([`adversarial_choices`][]) or `"one_shard"`.
    - `num_shards`, `tokens`, `num_experts`, `top_k`: `R`, `T`, `E`, `k`.
    - `seed`: seed of the draw (and of random layouts).
    - `step`, `s`, `hot`, `sigma`, `drift`: workload parameters, ignored where
        irrelevant.

    **Returns:**

    `[R, T, k]` int32 expert ids.
    """
    shape = dict(num_shards=num_shards, tokens=tokens, top_k=top_k)
    if name == "uniform":
        probs = uniform_probs(num_experts)
    elif name == "zipf":
        probs = zipf_probs(num_experts, s, hot=hot, num_shards=num_shards, seed=seed)
    elif name == "lognormal":
        probs = lognormal_probs(num_experts, sigma, seed=seed)
    elif name == "rotating_hotspot":
        probs = rotating_hotspot_probs(num_experts, step)
    elif name == "drifting_zipf":
        probs = drifting_zipf_probs(
            num_experts,
            step,
            s=s,
            drift=drift,
            hot=hot,
            num_shards=num_shards,
            seed=seed,
        )
    elif name == "same_experts":
        return adversarial_choices(
            num_shards=num_shards, tokens=tokens, num_experts=num_experts, top_k=top_k
        )
    elif name == "one_shard":
        return one_shard_choices(
            num_shards=num_shards,
            tokens=tokens,
            num_experts=num_experts,
            top_k=top_k,
            seed=seed,
        )
    else:
        raise ValueError(f"Unknown workload {name!r}; expected one of {WORKLOADS}.")
    # Distinct seeds per step so that a step's tokens are not the previous step's.
    return sample_choices(probs, seed=seed + 7919 * step, **shape)


def forcing_bias(
    chosen: Sequence[int] | Bool[np.ndarray, " experts"] | Int[np.ndarray, " chosen"],
    num_experts: int,
    *,
    magnitude: float = 100.0,
) -> Float[np.ndarray, " experts"]:
    """A selection-only router bias that makes every token pick among `chosen`.

    A top-k router with a selection-only bias (DeepSeek-V3's aux-loss-free
    balancing, `MoEConfig(use_router_bias=True)`) selects the top-k of `score + bias`
    but weights by the unbiased scores. `magnitude` on the chosen experts and `0`
    elsewhere wins over any score difference smaller than `magnitude` (softmax and
    sigmoid scores lie in `[0, 1]`; if a bias were added to raw logits, their range
    must stay below `magnitude`). With exactly `k` chosen experts every token selects
    exactly them (e.g. `forcing_bias(range(k), E)` is the "same experts" adversary);
    with more, the router's own scores pick among them (all experts of shard 0 give
    the "one shard" adversary when `k <= E / R`). The default `magnitude` keeps
    float32 resolution (~1e-5) among the chosen experts.

    **Arguments:**

    - `chosen`: expert ids, or an `[E]` boolean mask.
    - `num_experts`: `E`.
    - `magnitude`: the bias on chosen experts.

    **Returns:**

    `[E]` float32 bias.
    """
    check_int(num_experts, "num_experts")
    chosen = np.asarray(chosen)
    mask = np.zeros((num_experts,), dtype=bool)
    if chosen.dtype == bool:
        if chosen.shape != (num_experts,):
            raise ValueError("A boolean `chosen` mask must have shape [num_experts].")
        mask = chosen
    else:
        if chosen.size and (chosen.min() < 0 or chosen.max() >= num_experts):
            raise ValueError("`chosen` expert ids must lie in [0, num_experts).")
        mask[chosen.astype(np.int64)] = True
    return np.where(mask, magnitude, 0.0).astype(np.float32)


def preference_bias(
    probs: Float[np.ndarray, " experts"], *, scale: float = 1.0
) -> Float[np.ndarray, " experts"]:
    """A selection-only router bias `scale * log(probs / max(probs))` (soft skew).

    Unlike [`forcing_bias`][] this does not reproduce `probs` exactly: tokens still
    choose by `score + bias`, so the router's own scores add the per-token randomness.
    Larger `scale` follows the preference more strictly (hot experts are picked by
    nearly every token). Use it to make a layer test see a Zipf-like skew, and
    [`counts_from_choices`][] on the router's output to know the counts it actually
    produced.

    **Arguments:**

    - `probs`: `[E]` positive preference weights (e.g. `zipf_probs(...)`).
    - `scale`: strength of the bias.

    **Returns:**

    `[E]` float32 bias, `0` on the most preferred expert and negative elsewhere.
    """
    probs = np.asarray(probs, dtype=np.float64)
    if np.any(probs <= 0):
        raise ValueError("`probs` must be positive.")
    return (scale * np.log(probs / probs.max())).astype(np.float32)
