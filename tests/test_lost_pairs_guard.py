"""The suite's own `lost_pairs` guard (the `lost_pairs_seen` fixture of
tests/conftest.py): a loss is charged to the test that runs the program, also when
that program was compiled before the test, or traced by a `lowering_only` test.

The loss is injected into the layer's single-device dispatch (one pair of the hottest
expert is not computed) and only happens when every token chose that expert, so one
compiled program loses nothing on one layer and a pair on another that differs from it
only in its router bias (data, not shapes). The tests run in file order: each relies
on what the one before it compiled or traced.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import pytest
from helpers import make_layer, routing_bias, tokens, with_bias

import moe_eqx._layer as layer_module

TOKENS = 16
TRACES = []  # one entry per trace of `_run`


def _loses_a_pair_when_every_token_chose_one_expert(sort_by_expert):
    def sort(experts, weights, num_experts):
        pairs = sort_by_expert(experts, weights, num_experts)
        sizes = pairs.group_sizes
        hot = jnp.argmax(sizes)
        lose = (sizes[hot] == experts.shape[0]).astype(sizes.dtype)
        return eqx.tree_at(lambda p: p.group_sizes, pairs, sizes.at[hot].add(-lose))

    return sort


def _patch_dispatch(monkeypatch):
    monkeypatch.setattr(
        layer_module,
        "sort_by_expert",
        _loses_a_pair_when_every_token_chose_one_expert(layer_module.sort_by_expert),
    )


@jax.jit
def _run(layer, x):
    TRACES.append(None)
    return layer(x)


@jax.jit
def _run_after_lowering(layer, x):
    return layer(x)


def _layers(d_ff=12):
    # d_ff unique to this module: the layer's own jitted call is traced here with the
    # lossy dispatch, and no other test may reuse that.
    layer = make_layer(jr.key(0), bias_kind="uniform", d_ff=d_ff)
    skewed = with_bias(layer, routing_bias("one_expert", 8, 2, 1))
    return layer, skewed, tokens(jr.key(1), TOKENS)


@pytest.fixture(scope="module")
def compiled_before():
    """`_run`, traced and compiled with the lossy dispatch outside every test body
    (the test that uses this first compiles it in its setup)."""
    layer, skewed, x = _layers()
    with pytest.MonkeyPatch.context() as monkeypatch:
        _patch_dispatch(monkeypatch)
        _, stats = _run(layer, x)
    assert int(stats.lost_pairs) == 0
    return layer, skewed, x


def test_a_program_that_loses_nothing_reports_nothing(compiled_before, lost_pairs_seen):
    layer, _, x = compiled_before
    _, stats = _run(layer, x)
    assert len(TRACES) == 1
    assert int(stats.lost_pairs) == 0
    jax.effects_barrier()
    assert lost_pairs_seen == []


def test_a_loss_in_a_program_compiled_earlier_is_charged_here(
    compiled_before, lost_pairs_seen
):
    _, skewed, x = compiled_before
    _, stats = _run(skewed, x)
    assert len(TRACES) == 1  # not traced again: the program of an earlier test
    assert int(stats.lost_pairs) == 1
    jax.effects_barrier()
    assert lost_pairs_seen == [1]
    lost_pairs_seen.clear()


@pytest.mark.lowering_only
def test_a_lowering_only_trace_carries_no_report(monkeypatch):
    """Also for the shapes the tests above compiled (with reports) just before."""
    _patch_dispatch(monkeypatch)
    for d_ff in (12, 10):
        _, skewed, x = _layers(d_ff)
        text = _run_after_lowering.trace(skewed, x).lower().as_text()
        assert "callback" not in text


def test_a_program_traced_by_a_lowering_only_test_is_not_run_without_its_report(
    monkeypatch, lost_pairs_seen
):
    """If the trace of the test above (d_ff=10, first traced there) were still
    cached, this call would reuse it and its loss would go unreported."""
    _, skewed, x = _layers(d_ff=10)
    _patch_dispatch(monkeypatch)
    _, stats = _run_after_lowering(skewed, x)
    assert int(stats.lost_pairs) == 1
    jax.effects_barrier()
    assert lost_pairs_seen == [1]
    lost_pairs_seen.clear()
