"""Expert variants as stage objects: every built-in activation (gated, clamped,
ungated), the shared experts' own activation, routing weights on the experts' inputs
(Llama-4) and `sqrt(softplus)` scores, through every path (one device; EP with the
fallback and slot copies; drop; bfloat16), each against the oracle, whose built-in
activations are written out from their fields; and the FFN of every CPU backend
against a plain-JAX reference."""

import contextlib
import io

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    assert_matches_oracle,
    layer_value_and_grad,
    make_layer,
    mesh,
    oracle_value_and_grad,
    tokens,
)
from jax.ad_checkpoint import print_saved_residuals

import moe_eqx as me
import moe_eqx.internal as mi

ACTIVATIONS = [
    dict(activation="swiglu"),
    dict(activation=me.SwiGLU(limit=0.5)),
    dict(activation=me.ClampedSwiGLU(limit=0.7)),
    dict(activation=me.SoftcapSwiGLU(gate_cap=0.9, up_cap=1.1)),
    dict(
        activation=me.SwiGLU(limit=0.5, limit_after=True),
        shared=me.SharedCombination(activation=me.SwiGLU(limit=0.3, limit_after=True)),
    ),
    dict(activation="geglu"),
    dict(activation="geglu_tanh"),
    dict(activation="relu"),
    dict(activation="relu2"),
    dict(activation="gelu"),
    dict(activation="gelu_tanh"),
    dict(activation="silu"),
]
IDS = ["-".join(str(v) for v in a.values()) for a in ACTIVATIONS]
# Those also run under EP4 with the fallback and a slot: a clamp, a softcap, the
# shared experts' own activation, an ungated one and a tanh-approximated GELU. (The
# activation is a field of the experts' FFN, the same function on every path; the
# default SwiGLU runs under EP in most other files, ClampedSwiGLU in the biases'
# test below.)
ON_EP4 = {1, 3, 4, 6, 8}


@pytest.mark.parametrize("i", range(len(ACTIVATIONS)), ids=IDS)
def test_activation_matches_oracle(getkey, i):
    """One device, then (`ON_EP4`) EP4 with every token sent to shard 0's experts:
    the capped trip overflows, the fallback runs, and a slot copy of a hot expert
    computes part of its tokens; outputs and every gradient equal the oracle's,
    shared expert included."""
    act = ACTIVATIONS[i]
    key = getkey()
    x = tokens(getkey(), 64)
    one = make_layer(key, d_ff=8, shared_d_ff=6, **act)
    gated = one.experts.activation.gated
    assert one.experts.w_gate_up.shape == (8, 16, 16 if gated else 8)
    assert one.shared_experts.w_gate_up.shape == (16, 12 if gated else 6)
    assert_matches_oracle(one, x, None)
    if i not in ON_EP4:
        return
    ep = make_layer(
        key, mesh_size=4, bias_kind="one_shard", d_ff=8, num_slots=1,
        buffer_factor=0.3, **act,
    )  # fmt: skip
    stats = assert_matches_oracle(ep, x, mesh(4))
    assert bool(stats.fallback_used)
    assert float(stats.max_over_mean) < float(stats.max_over_mean_before)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(on_overflow="drop", buffer_factor=None),
        dict(buffer_factor=0.3, num_slots=1),
    ],
    ids=["drop", "fallback+slots"],
)
def test_weights_on_the_inputs(getkey, overrides):
    """Llama-4's routing: `sum_e expert_e(w_e x)`, sigmoid weights not renormalised, on
    one device and under EP4; the weights' gradient reaches the router."""
    key = getkey()
    x = tokens(getkey(), 64)
    kw = dict(
        expert_options=me.ExpertOptions(weight_on_input=True),
        score_func="sigmoid",
        norm_topk=False,
        shared_d_ff=8,
    )
    assert_matches_oracle(make_layer(key, **kw), x, None)
    layer = make_layer(key, mesh_size=4, bias_kind="one_shard", **kw, **overrides)
    assert_matches_oracle(layer, x, mesh(4))
    # Not the same function as weights on the outputs (same weights, same key).
    on_out = make_layer(key, **(kw | dict(expert_options=me.ExpertOptions())))
    on_in = make_layer(key, **kw)
    diff = me.reference_moe(on_in, x) - me.reference_moe(on_out, x)
    assert float(jnp.max(jnp.abs(diff))) > 1e-2


def test_sqrtsoftplus_scores(getkey):
    """DeepSeek-V4's scores: the chosen weights are `sqrt(softplus(logit))`,
    renormalised; the layer matches the oracle under EP4."""
    layer = make_layer(getkey(), score_func="sqrtsoftplus", use_router_bias=True)
    x = tokens(getkey(), 32)
    routing = layer.router(x)
    logits = np.asarray(x, np.float64) @ np.asarray(layer.router.weight, np.float64)
    scores = np.sqrt(np.log1p(np.exp(logits)))
    chosen = np.take_along_axis(scores, np.asarray(routing.experts), axis=1)
    np.testing.assert_allclose(
        routing.weights, chosen / chosen.sum(1, keepdims=True), rtol=1e-5
    )
    assert_matches_oracle(
        make_layer(getkey(), mesh_size=4, score_func="sqrtsoftplus"), x, mesh(4)
    )


def test_forward_mode_through_variants(getkey):
    """`jax.jvp` through an ungated, input-weighted layer under EP4 equals the same
    transform of the oracle."""
    layer = make_layer(
        getkey(), activation="relu2", score_func="sigmoid", norm_topk=False,
        expert_options=me.ExpertOptions(weight_on_input=True),
    )  # fmt: skip
    x = tokens(getkey(), 32)
    t = tokens(getkey(), 32)
    m = mesh(4)
    y, ty = jax.jit(lambda x, t: jax.jvp(lambda x: layer(x, mesh=m)[0], (x,), (t,)))(
        x, t
    )
    y_ref, ty_ref = jax.jit(
        lambda x, t: jax.jvp(lambda x: me.reference_moe(layer, x), (x,), (t,))
    )(x, t)
    np.testing.assert_allclose(y, y_ref, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(ty, ty_ref, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize(
    "act",
    [
        me.ReLU2(),
        me.ClampedSwiGLU(limit=0.6),
        me.GeGLU(approximate=True),
        me.SwiGLU(limit=0.5),
    ],
    ids=["relu2", "swiglu_oai", "geglu_tanh", "swiglu_limit"],
)
@pytest.mark.parametrize(
    "backend",
    [me.TiledGMM(tile_rows=7), mi.DenseGMM(), me.RaggedDotGMM()],
    ids=["tiled", "dense", "ragged_dot"],
)
def test_backend_ffn_with_activation(act, backend):
    """`backend.ffn(..., activation=)` against a one-hot einsum reference with the
    activation written out: output, and the gradients of the rows and both weights
    (plain and through the fallback's accumulators)."""
    rng = np.random.default_rng(0)
    sizes = jnp.asarray([7, 0, 30, 3], jnp.int32)
    m, d, f = 48, 6, 5
    x = jnp.asarray(rng.standard_normal((m, d)), jnp.float32)
    w1 = jnp.asarray(rng.standard_normal((4, d, f * (1 + act.gated))) / 2, jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((4, f, d)) / 2, jnp.float32)
    dy = jnp.asarray(rng.standard_normal((m, d)), jnp.float32)

    def reference(x, w1, w2):
        ends = jnp.cumsum(sizes)[None, :]
        rows = jnp.arange(m)[:, None]
        member = ((rows >= ends - sizes[None, :]) & (rows < ends)).astype(jnp.float32)
        h = jnp.einsum("mg,mk,gkn->mn", member, x, w1)
        a = _written_out(act, h)
        return jnp.einsum("mg,mf,gfd->md", member, a, w2)

    def ffn(x, w1, w2):
        return backend.ffn(x, w1, w2, sizes, activation=act)

    out, vjp = jax.vjp(ffn, x, w1, w2)
    ref, ref_vjp = jax.vjp(reference, x, w1, w2)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    for got, want in zip(vjp(dy), ref_vjp(dy), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    acc = (jnp.zeros_like(w1), jnp.zeros_like(w2))
    _, acc_vjp = jax.vjp(
        lambda x, acc: backend.ffn(x, w1, w2, sizes, acc, activation=act), x, acc
    )
    d_x, (d_w1, d_w2) = acc_vjp((dy, acc))
    _, (r_x, r_w1, r_w2) = out, ref_vjp(dy)
    for got, want in ((d_x, r_x), (d_w1, r_w1), (d_w2, r_w2)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "backend", [me.RaggedDotGMM(), me.MegabloxGMM(interpret=True)], ids=str
)
def test_backward_keeps_only_the_first_product(backend):
    """Between a backend's two products, the backward keeps the first product in its
    own dtype (bfloat16 here) and no float32 `[rows, d_ff]` intermediate of the
    activation: plain autodiff of the float32 SwiGLU kept five."""
    m, d, f = 64, 16, 24
    x = jnp.ones((m, d), jnp.bfloat16)
    w1 = jnp.ones((4, d, 2 * f), jnp.bfloat16)
    w2 = jnp.ones((4, f, d), jnp.bfloat16)
    sizes = jnp.asarray([16, 0, 40, 8], jnp.int32)

    def loss(x, w1, w2):
        out = backend.ffn(x, w1, w2, sizes)
        return jnp.sum(out.astype(jnp.float32))

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_saved_residuals(loss, x, w1, w2)
    saved = [line.split()[0] for line in out.getvalue().splitlines()]
    assert f"bf16[{m},{2 * f}]" in saved, saved
    wide = [a for a in saved if a in (f"f32[{m},{f}]", f"f32[{m},{2 * f}]")]
    assert not wide, saved


def _written_out(act, h):
    if not act.gated:
        assert isinstance(act, me.ReLU2)
        return jnp.maximum(h, 0) ** 2
    gate, up = jnp.split(h, 2, axis=-1)
    limit = getattr(act, "limit", None)
    if limit is not None:
        gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
    if isinstance(act, me.ClampedSwiGLU):
        return gate * jax.nn.sigmoid(1.702 * gate) * (up + 1)
    if isinstance(act, me.GeGLU):
        c = np.sqrt(2 / np.pi)
        return 0.5 * gate * (1 + jnp.tanh(c * (gate + 0.044715 * gate**3))) * up
    return gate * jax.nn.sigmoid(gate) * up


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(activation="tanh"), "`activation` must be one of"),
        (dict(activation="swiglu_oai"), r"needs its settings: pass .*ClampedSwiGLU"),
        (dict(activation="swiglu_softcap"), r"needs its settings: .*SoftcapSwiGLU"),
        (dict(score_func="tanh"), "`score_func` must be one of"),
        (dict(selection=me.Weighting()), "`selection` must be an `moe_eqx.Selection`"),
    ],
)
def test_bad_variant_settings_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        me.MoEConfig(d_model=8, d_ff=4, num_experts=4, top_k=2, **overrides)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: me.SwiGLU(limit=-1.0), "`SwiGLU.limit` must be a positive"),
        (lambda: me.SwiGLU(limit_after=True), "`SwiGLU.limit_after` needs a `limit`"),
        (lambda: me.ClampedSwiGLU(limit=0.0), "`ClampedSwiGLU.limit` must be"),
        (lambda: me.SoftcapSwiGLU(gate_cap=1.0, up_cap=-1.0), "`SoftcapSwiGLU.up_cap`"),
        (
            lambda: me.ExpertOptions(weight_on_input=1),
            "`ExpertOptions.weight_on_input`",
        ),
        (lambda: me.Sigmoid(softcap=-1.0), r"`Sigmoid.softcap` must be .* >= 0"),
        (lambda: me.Selection(group_top=0), "`Selection.group_top` must be a positive"),
        (lambda: me.Weighting(floor=float("nan")), "`Weighting.floor` must be"),
        (lambda: me.SharedCombination(scored=-1), "`SharedCombination.scored` must"),
        (lambda: me.OutputTransform(norm_eps=0.0), "`OutputTransform.norm_eps` must"),
    ],
)
def test_bad_stage_objects_are_refused(make, message):
    """Each stage object checks its own fields, naming the object and the field."""
    with pytest.raises(ValueError, match=message):
        make()


def test_removed_fields_name_their_replacement():
    """A field of the earlier flat config is a `TypeError` naming the object it moved
    to, as a keyword and as an attribute; a misspelt field suggests the right one."""
    with pytest.raises(TypeError, match=r"`activation=me.SwiGLU\(limit=...\)`"):
        me.MoEConfig(d_model=8, d_ff=4, num_experts=4, top_k=2, activation_limit=1.0)
    with pytest.raises(TypeError, match=r"me.ExpertOptions\(bias=True\)"):
        me.MoEConfig(d_model=8, d_ff=4, num_experts=4, top_k=2, expert_bias=True)
    config = me.MoEConfig(d_model=8, d_ff=4, num_experts=4, top_k=2)
    with pytest.raises(AttributeError, match=r"me.Selection\(group_fill=...\)"):
        _ = config.group_fill
    with pytest.raises(TypeError, match="did you mean `num_slots`"):
        me.MoEConfig(d_model=8, d_ff=4, num_experts=4, top_k=2, num_slot=1)


def test_weights_of_the_wrong_width_are_refused(getkey):
    """Gated weights given to an ungated activation name the mismatch."""
    layer = make_layer(getkey())
    x = tokens(getkey(), 8)
    with pytest.raises(ValueError, match=r"ReLU2\(\) activation with d_ff=24 needs 24"):
        mi.expert_ffn(
            x, layer.experts.w_gate_up, layer.experts.w_down,
            jnp.asarray([8, 0, 0, 0, 0, 0, 0, 0]), activation=me.ReLU2(),
        )  # fmt: skip


def _with_random_biases(layer, key):
    """Every bias of the layer drawn at random (they start at zero)."""
    k1, k2, k3, k4 = jax.random.split(key, 4)
    e = layer.experts
    return eqx.tree_at(
        lambda l: (
            l.experts.b_gate_up, l.experts.b_down, l.router.logit_bias, l.output_bias,
        ),
        layer,
        (
            jax.random.normal(k1, e.b_gate_up.shape, e.b_gate_up.dtype),
            jax.random.normal(k2, e.b_down.shape, e.b_down.dtype),
            jax.random.normal(k3, layer.router.logit_bias.shape),
            jax.random.normal(k4, layer.output_bias.shape),
        ),
    )  # fmt: skip


BIASED = dict(
    expert_options=me.ExpertOptions(bias=True),
    score_func=me.Softmax(logit_bias=True),
    output=me.OutputTransform(bias=True),
    d_ff=8,
)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(activation=me.ClampedSwiGLU(limit=0.7)),
        dict(activation="relu2", shared_d_ff=6),
        dict(on_overflow="drop", buffer_factor=None),
    ],
    ids=["swiglu_oai", "relu2+shared", "drop"],
)
def test_biases_match_oracle(getkey, overrides):
    """Per-expert biases on both projections (folded into the weights as one more
    row), a router logit bias and an output bias: one device, then EP4 with the
    fallback and a slot copy (whose biases travel with its weights), then after a
    re-placement of the experts (the biases move with them); all against the
    oracle, gradients of every bias included."""
    key, bias_key = getkey(), getkey()
    x = tokens(getkey(), 64)
    one = _with_random_biases(make_layer(key, **BIASED, **overrides), bias_key)
    assert_matches_oracle(one, x, None)
    ep = make_layer(
        key, mesh_size=4, bias_kind="one_shard", num_slots=1,
        **(dict(buffer_factor=0.3) | BIASED | overrides),
    )  # fmt: skip
    ep = _with_random_biases(ep, bias_key)
    stats = assert_matches_oracle(ep, x, mesh(4))
    if overrides.get("on_overflow") != "drop":
        assert bool(stats.fallback_used)
    perm = jnp.asarray(np.random.default_rng(0).permutation(8), jnp.int32)
    assert_matches_oracle(mi.permute_experts(ep, perm), x, mesh(4))


def test_biases_are_not_ignored(getkey):
    """The oracle sees each bias: zeroing any one of them changes the output (so
    the comparisons above would catch a path that dropped one)."""
    layer = _with_random_biases(make_layer(getkey(), **BIASED), getkey())
    x = tokens(getkey(), 32)
    y = me.reference_moe(layer, x)
    for where in (
        lambda l: l.experts.b_gate_up,
        lambda l: l.experts.b_down,
        lambda l: l.router.logit_bias,
        lambda l: l.output_bias,
    ):
        zeroed = eqx.tree_at(where, layer, jnp.zeros_like(where(layer)))
        assert float(jnp.max(jnp.abs(me.reference_moe(zeroed, x) - y))) > 1e-2


def test_biases_in_bfloat16_expert_parallel(getkey):
    """bfloat16 weights and biases through EP4's fallback and slots: within
    bfloat16 precision of the float32 oracle of the same parameters."""
    config = me.MoEConfig(
        d_model=16, d_ff=8, num_experts=8, top_k=2, buffer_factor=0.3, num_slots=1,
        activation=me.ClampedSwiGLU(limit=0.7), **BIASED_FIELDS,
    )  # fmt: skip
    layer = me.MoELayer(config, key=getkey(), dtype=jnp.bfloat16)
    layer = _with_random_biases(layer, getkey())
    assert layer.experts.b_down.dtype == jnp.bfloat16
    x = tokens(getkey(), 64)
    y, stats = jax.jit(lambda l, x: l(x, mesh=mesh(4)))(layer, x)
    np.testing.assert_allclose(y, me.reference_moe(layer, x), rtol=3e-2, atol=3e-2)
    assert int(stats.lost_pairs) == 0


BIASED_FIELDS = {k: v for k, v in BIASED.items() if k != "d_ff"}


def test_weights_on_inputs_with_biases_refused():
    with pytest.raises(ValueError, match=r"weight_on_input=True, bias=True\)` is not"):
        me.ExpertOptions(weight_on_input=True, bias=True)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(num_slots=1, buffer_factor=0.3),
        dict(on_overflow="drop", buffer_factor=None, shared_d_ff=8),
        dict(norm_topk=False, use_router_bias=True),
    ],
    ids=["fallback+slots", "drop+shared", "raw-weights+bias"],
)
def test_identity_experts(getkey, overrides):
    """Zero-computation experts (LongCat-Flash): a pick of one adds `w x` on the
    token's own shard; nothing is sent for it and it is counted in no expert's load
    (the pairs computed are exactly the picks of routed experts, nothing lost);
    outputs and every gradient equal the oracle's, one device and EP4."""
    key = getkey()
    x = tokens(getkey(), 64)
    for shards in (1, 4):
        layer = make_layer(
            key, mesh_size=shards, num_identity_experts=3, top_k=3, **overrides
        )
        assert layer.router.weight.shape == (16, 11)
        routing = layer.router(x)
        identity = int(jnp.sum(routing.experts >= 8))
        assert 0 < identity < 64 * 3
        assert int(jnp.sum(routing.counts)) == 64 * 3 - identity
        m = mesh(shards) if shards > 1 else None
        y, stats, grads, gx = layer_value_and_grad(layer, x, m)
        y_ref, grads_ref, gx_ref = oracle_value_and_grad(layer, x)
        assert int(stats.lost_pairs) == 0 and int(stats.dropped_pairs) == 0
        assert int(jnp.sum(stats.recv_pairs)) == 64 * 3 - identity
        np.testing.assert_allclose(y, y_ref, rtol=2e-5, atol=2e-5)
        np.testing.assert_allclose(gx, gx_ref, rtol=2e-5, atol=2e-5)
        for got, want in zip(
            jax.tree.leaves(grads), jax.tree.leaves(grads_ref), strict=True
        ):
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
