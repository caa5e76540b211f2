"""Synthetic routing workloads: shapes, distinct choices, determinism, skew."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_eqx.workloads as wl

R, T, E, K = 4, 256, 16, 4


def _distinct(choices: np.ndarray) -> bool:
    ordered = np.sort(choices, axis=-1)
    return bool((np.diff(ordered, axis=-1) > 0).all())


@pytest.mark.parametrize("name", wl.WORKLOADS)
def test_every_workload_shape_range_distinct(name):
    choices = wl.sample_workload(
        name, num_shards=R, tokens=T, num_experts=E, top_k=K, seed=0, step=3
    )
    assert choices.shape == (R, T, K) and choices.dtype == np.int32
    assert choices.min() >= 0 and choices.max() < E
    assert _distinct(choices)
    counts = wl.counts_from_choices(choices, E)
    assert counts.shape == (R, E) and counts.dtype == np.int32
    np.testing.assert_array_equal(counts.sum(axis=1), np.full(R, T * K))


@pytest.mark.parametrize("name", ["uniform", "zipf", "lognormal", "drifting_zipf"])
def test_deterministic_by_seed(name):
    kwargs = dict(num_shards=R, tokens=T, num_experts=E, top_k=K, step=2)
    a = wl.sample_workload(name, seed=7, **kwargs)
    b = wl.sample_workload(name, seed=7, **kwargs)
    c = wl.sample_workload(name, seed=8, **kwargs)
    np.testing.assert_array_equal(a, b)
    assert (a != c).any()


def test_does_not_touch_global_numpy_rng():
    np.random.seed(123)
    expected = np.random.random_sample()
    np.random.seed(123)
    wl.sample_workload("zipf", num_shards=R, tokens=T, num_experts=E, top_k=K)
    assert np.random.random_sample() == expected


def test_top1_frequencies_follow_probs():
    # With k=1, Gumbel-top-k samples the categorical distribution itself.
    probs = wl.zipf_probs(E, 1.0, hot="random", seed=2)
    choices = wl.sample_choices(probs, num_shards=2, tokens=20_000, top_k=1, seed=0)
    freq = np.bincount(choices.ravel(), minlength=E) / choices.size
    np.testing.assert_allclose(freq, probs, atol=0.01)


def test_per_shard_probs():
    probs = np.zeros((2, E))
    probs[0, :K] = 1.0
    probs[1, -K:] = 1.0
    choices = wl.sample_choices(probs, num_shards=2, tokens=8, top_k=K, seed=0)
    assert set(np.unique(choices[0])) == set(range(K))
    assert set(np.unique(choices[1])) == set(range(E - K, E))


def test_zipf_layouts():
    num_shards, local = 8, 4
    num_experts = num_shards * local
    spread = wl.zipf_probs(num_experts, 1.2, hot="spread", num_shards=num_shards)
    contiguous = wl.zipf_probs(num_experts, 1.2, hot="contiguous")
    for probs in (spread, contiguous):
        np.testing.assert_allclose(probs.sum(), 1.0)
        np.testing.assert_allclose(np.sort(probs), np.sort(contiguous))
    # Contiguous: hottest first. Spread: the R hottest on R different shards.
    assert (np.diff(contiguous) < 0).all()
    hottest = np.argsort(-spread)[:num_shards]
    assert len(set((hottest // local).tolist())) == num_shards
    with pytest.raises(ValueError, match="num_shards"):
        wl.zipf_probs(num_experts, 1.2, hot="spread")
    with pytest.raises(ValueError, match="hot"):
        wl.zipf_probs(num_experts, 1.2, hot="nowhere")


def _home_load(choices, num_experts):
    num_shards = choices.shape[0]
    counts = wl.counts_from_choices(choices, num_experts)
    return counts.sum(axis=0).reshape(num_shards, -1).sum(axis=1)


def test_skew_ordering():
    kwargs = dict(num_shards=8, tokens=512, num_experts=32, top_k=4, seed=1)

    def max_over_mean(**extra):
        load = _home_load(wl.sample_workload(**kwargs, **extra), 32)
        return load.max() / load.mean()

    uniform = max_over_mean(name="uniform")
    spread = max_over_mean(name="zipf", s=1.2, hot="spread")
    contiguous = max_over_mean(name="zipf", s=1.2, hot="contiguous")
    mild = max_over_mean(name="zipf", s=0.5, hot="contiguous")
    assert uniform < 1.1
    assert 1.1 < spread < contiguous
    assert mild < contiguous
    assert max_over_mean(name="one_shard") == 8.0


def test_lognormal_sigma_controls_skew():
    flat = wl.lognormal_probs(64, 0.0)
    np.testing.assert_allclose(flat, np.full(64, 1 / 64))
    wide = wl.lognormal_probs(64, 2.0, seed=0)
    assert wide.max() / wide.min() > 100


def test_rotating_hotspot_moves():
    a = wl.rotating_hotspot_probs(E, 0, num_hot=4)
    b = wl.rotating_hotspot_probs(E, 1, num_hot=4)
    np.testing.assert_array_equal(np.argsort(-a)[:4], [0, 1, 2, 3])
    assert set(np.argsort(-b)[:4].tolist()) == {4, 5, 6, 7}
    np.testing.assert_allclose(wl.rotating_hotspot_probs(E, 4, num_hot=4), a)


def test_drifting_zipf_drifts_slowly():
    p0 = wl.drifting_zipf_probs(64, 0, seed=0)
    np.testing.assert_allclose(p0, wl.zipf_probs(64, 1.2, hot="random", seed=0))
    p1 = wl.drifting_zipf_probs(64, 1, seed=0)
    p50 = wl.drifting_zipf_probs(64, 50, seed=0)
    # Consecutive steps stay close; far-apart steps do not.
    assert np.abs(p1 - p0).sum() < np.abs(p50 - p0).sum()
    np.testing.assert_allclose(p50, wl.drifting_zipf_probs(64, 50, seed=0))


def test_adversarial_workloads():
    same = wl.adversarial_choices(num_shards=R, tokens=T, num_experts=E, top_k=K)
    np.testing.assert_array_equal(same, np.broadcast_to(np.arange(K), (R, T, K)))
    # k <= L: only shard 0's experts.
    one = wl.one_shard_choices(num_shards=R, tokens=T, num_experts=E, top_k=3, seed=0)
    assert one.max() < E // R
    # k > L: all of shard 0's experts, and the rest from the next shard.
    wide = wl.one_shard_choices(num_shards=8, tokens=T, num_experts=16, top_k=3, seed=0)
    assert _distinct(wide)
    assert ((wide == 0).any(axis=-1) & (wide == 1).any(axis=-1)).all()
    assert wide.max() < 4


def test_bad_arguments():
    with pytest.raises(ValueError, match="top_k"):
        wl.sample_choices(wl.uniform_probs(4), num_shards=1, tokens=2, top_k=5, seed=0)
    with pytest.raises(ValueError, match="probs"):
        probs = np.array([1.0, 0.0, 0.0, 0.0])
        wl.sample_choices(probs, num_shards=1, tokens=2, top_k=2, seed=0)
    with pytest.raises(ValueError, match="tokens"):
        wl.sample_choices(wl.uniform_probs(4), num_shards=1, tokens=0, top_k=1, seed=0)
    with pytest.raises(ValueError, match="Unknown workload"):
        wl.sample_workload("nope", num_shards=1, tokens=1, num_experts=4, top_k=1)
    with pytest.raises(ValueError, match="choices"):
        wl.counts_from_choices(np.full((1, 2, 1), 4, np.int32), 4)


def _router_topk(scores, bias, top_k):
    """Selection-only bias: choose by score + bias (as DeepSeek-V3 does)."""
    return jax.lax.top_k(scores + bias[None, :], top_k)[1]


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_forcing_bias_forces_selection(score_func, getkey):
    logits = 3.0 * jax.random.normal(getkey(), (128, E))
    scores = (
        jax.nn.softmax(logits) if score_func == "softmax" else jax.nn.sigmoid(logits)
    )
    chosen = [3, 9, 10, 14]
    bias = jnp.asarray(wl.forcing_bias(chosen, E))
    picked = np.sort(np.asarray(_router_topk(scores, bias, K)), axis=-1)
    np.testing.assert_array_equal(picked, np.broadcast_to(chosen, picked.shape))
    # More chosen than k: the router's own scores pick among them.
    mask = np.zeros(E, bool)
    mask[: E // 2] = True
    picked = np.asarray(_router_topk(scores, jnp.asarray(wl.forcing_bias(mask, E)), K))
    assert picked.max() < E // 2
    # Up to float32 resolution at `magnitude` (~1e-5): near-ties may swap.
    best = jax.lax.top_k(scores[:, : E // 2], K)[0].sum(-1)
    got = jnp.take_along_axis(scores, jnp.asarray(picked), axis=1).sum(-1)
    np.testing.assert_allclose(got, best, atol=1e-4)


def test_preference_bias_skews_selection(getkey):
    scores = jax.nn.softmax(jax.random.normal(getkey(), (2048, E)))
    probs = wl.zipf_probs(E, 1.2, hot="contiguous")
    bias = wl.preference_bias(probs, scale=0.1)
    assert bias.dtype == np.float32 and bias.max() == 0.0
    picked = np.asarray(_router_topk(scores, jnp.asarray(bias), K))
    counts = np.bincount(picked.ravel(), minlength=E)
    unbiased = np.bincount(
        np.asarray(_router_topk(scores, jnp.zeros(E), K)).ravel(), minlength=E
    )
    # The preferred (low-index) experts gain, the cold ones lose.
    assert counts[:K].sum() > 2 * unbiased[:K].sum()
    assert counts[-K:].sum() < unbiased[-K:].sum()
