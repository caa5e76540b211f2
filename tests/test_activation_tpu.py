"""The gated activation's backward as one Pallas pass (`moe_eqx._gmm.activation_tpu`),
which `me.PallasTPUGMM` takes between its many-row products, in Pallas' interpreter
on the CPU: its values against JAX's own vjp of the activation for every activation it
takes, rows that fill no whole step and one row, its own derivatives (forward mode and
second order), the cases it leaves to JAX, the layer on it (one device, a two-shard
mesh capped and with the fallback taken) against `reference_moe`, and Mosaic's
lowering at a model shape. `tests/test_tpu.py` runs it compiled on a chip."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from helpers import mesh as cpu_mesh

import moe_eqx as me
from moe_eqx._activation import WithBiasColumn
from moe_eqx._gmm import activation_tpu
from moe_eqx._gmm.activation_tpu import gated_vjp, in_kernel

TAKEN = [
    me.SwiGLU(),
    me.SwiGLU(limit=1.0),
    me.SwiGLU(limit=1.0, limit_after=True),
    me.GeGLU(approximate=True),
    me.ClampedSwiGLU(limit=2.0),
    me.SoftcapSwiGLU(gate_cap=2.0, up_cap=3.0),
]


def _formula(act, h, ct):
    """JAX's own vjp of the whole activation (`jax.vjp` of its `__call__` on all of
    `h` in float32), rounded to `h`'s dtype: the reference, apart from the halves
    the library forms it from."""
    return act.vjp(h.astype(jnp.float32), ct).astype(h.dtype)


def _close(a, b, dtype):
    tol = 1e-2 if dtype == jnp.bfloat16 else 1e-5
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    scale = max(1.0, float(np.abs(b).max(initial=0.0)))
    np.testing.assert_allclose(a, b, atol=tol * scale, rtol=tol)


def _pallas_names(fn, *args):
    return str(jax.make_jaxpr(fn)(*args)).count("pallas_call")


def _counted(monkeypatch):
    """The kernel's calls, counted as they are traced."""
    calls = []
    kernel = activation_tpu._gated_vjp

    def counted(*args):
        calls.append(args[0])
        return kernel(*args)

    monkeypatch.setattr(activation_tpu, "_gated_vjp", counted)
    return calls


@pytest.mark.parametrize("act", TAKEN, ids=repr)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("rows", [1, 37, 1000])
def test_kernel_equals_the_vjp_of_the_halves(act, dtype, rows):
    """Every activation it takes, one row, rows short of a step, and steps whose
    last one is partial (1000 rows, 512 a step): both halves of the cotangent as
    JAX's vjp of each half, rounded to `h`'s dtype."""
    d_ff = 128
    h = (3 * jr.normal(jr.key(0), (rows, 2 * d_ff))).astype(dtype)
    ct = jr.normal(jr.key(1), (rows, d_ff)).astype(dtype)
    assert in_kernel(act, h)
    fn = jax.jit(lambda h, ct: gated_vjp(act, h, ct, interpret=True))
    got = fn(h, ct)
    assert got.dtype == dtype and got.shape == h.shape
    assert _pallas_names(lambda h, ct: gated_vjp(act, h, ct, interpret=True), h, ct)
    _close(got, _formula(act, h, ct), dtype)
    # The two halves are apart: the gate's cotangent is not the up half's.
    assert not np.allclose(np.asarray(got[:, :d_ff]), np.asarray(got[:, d_ff:]))


def test_several_steps_each_take_their_own_rows(monkeypatch):
    """At 16 rows a step, 100 rows are seven steps (the last partial): each row's
    cotangent its own."""
    monkeypatch.setattr(activation_tpu, "_rows_per_step", lambda *_: 16)
    act = me.SwiGLU()
    h = jr.normal(jr.key(2), (100, 256))
    ct = jr.normal(jr.key(3), (100, 128))
    got = activation_tpu._gated_vjp(act, True, h, ct)
    _close(got, _formula(act, h, ct), jnp.float32)


def test_derivatives_are_those_of_the_formula():
    """Forward mode and the gradient of a loss of the kernel's output (second order
    of the layer) are JAX's own of the activation's vjp."""
    act = me.SwiGLU()
    h = jr.normal(jr.key(4), (40, 256))
    ct = jr.normal(jr.key(5), (40, 128))
    tangents = (jr.normal(jr.key(6), h.shape), jr.normal(jr.key(7), ct.shape))

    def kernel(h, ct):
        return gated_vjp(act, h, ct, interpret=True)

    def formula(h, ct):
        return _formula(act, h, ct)

    _close(
        jax.jvp(kernel, (h, ct), tangents)[1],
        jax.jvp(formula, (h, ct), tangents)[1],
        jnp.float32,
    )
    for argnum in (0, 1):
        got = jax.grad(lambda *a: jnp.sum(jnp.sin(kernel(*a))), argnum)(h, ct)
        want = jax.grad(lambda *a: jnp.sum(jnp.sin(formula(*a))), argnum)(h, ct)
        _close(got, want, jnp.float32)


class _OwnSwiGLU(me.SwiGLU):
    pass


@pytest.mark.parametrize(
    "act, width, rows",
    [
        (me.GeGLU(), 256, 8),  # the exact GELU: Mosaic has no `erfc`
        (_OwnSwiGLU(), 256, 8),  # a subclass: its own `__call__` may be anything
        (me.SwiGLU(), 192, 8),  # halves of 96 columns
        (me.SwiGLU(), 256, 0),  # no rows
        (me.ReLU(), 256, 8),  # not gated
        (WithBiasColumn(me.SwiGLU()), 257, 8),  # biases folded: a column more
    ],
    ids=["exact-gelu", "subclass", "narrow", "no-rows", "ungated", "bias-column"],
)
def test_what_the_kernel_leaves_to_jax(act, width, rows):
    h = jr.normal(jr.key(8), (rows, width))
    assert not in_kernel(act, h)
    if act.gated and width % 2 == 0:
        ct = jr.normal(jr.key(9), (rows, width // 2))
        fn = jax.jit(lambda h, ct: gated_vjp(act, h, ct, interpret=True))
        assert not _pallas_names(fn, h, ct)
        _close(fn(h, ct), _formula(act, h, ct), jnp.float32)


def _layer(activation, backend, buffer_factor=2.0):
    cfg = me.MoEConfig(
        d_model=64,
        d_ff=128,
        num_experts=4,
        top_k=2,
        gmm_backend=backend,
        buffer_factor=buffer_factor,
        exchange="dense",
        activation=activation,
    )
    return me.MoELayer(cfg, key=jr.key(10))


@pytest.mark.parametrize(
    "where", ["one device", "mesh capped", "mesh fallback", "megablox", "other backend"]
)
def test_the_layer_takes_it_on_every_path(where, monkeypatch):
    """`PallasTPUGMM` (many rows) takes the kernel between its products on one
    device and on a two-shard mesh, capped and with the chunked fallback taken (its
    accumulating FFN); so does `MegabloxGMM`: output and gradients against
    `reference_moe`. A backend off the TPU (`dense`) does not."""
    backend = {
        "other backend": "dense",
        "megablox": me.MegabloxGMM(tiles=(128, 128, 128), interpret=True),
    }.get(where, me.PallasTPUGMM(max_rows=16, interpret=True))
    act = me.SoftcapSwiGLU(gate_cap=2.0, up_cap=3.0)
    layer = _layer(act, backend, 0.6 if where == "mesh fallback" else 2.0)
    x = jr.normal(jr.key(11), (48, 64)) + 3.0 * layer.router.weight[None, :, 0]
    mesh = cpu_mesh(2) if where.startswith("mesh") else None

    def loss(fn, layer, x):
        return jnp.sum(jnp.sin(fn(layer, x)))

    def run(layer, x):
        y, stats = layer(x, mesh=mesh)
        return y

    grad = eqx.filter_grad(lambda a: loss(run, *a))
    calls = _counted(monkeypatch)
    got = eqx.filter_jit(grad)((layer, x))
    if where == "other backend":
        assert calls == []
    else:  # (the fallback's program traces its pieces' FFN besides the capped one's)
        assert calls and set(calls) == {act}
    y, stats = eqx.filter_jit(lambda l, x: l(x, mesh=mesh))(layer, x)
    stats.check()
    assert int(stats.lost_pairs) == 0
    assert bool(stats.fallback_used) == (where == "mesh fallback")
    np.testing.assert_allclose(y, me.reference_moe(layer, x), atol=1e-5)
    want = eqx.filter_grad(lambda a: loss(me.reference_moe, *a))((layer, x))
    for a, b in [
        (got[1], want[1]),
        (got[0].experts.w_gate_up, want[0].experts.w_gate_up),
        (got[0].experts.w_down, want[0].experts.w_down),
    ]:
        np.testing.assert_allclose(a, b, atol=1e-4 * max(1.0, float(jnp.abs(b).max())))


@pytest.mark.lowering_only
@pytest.mark.parametrize("act", TAKEN, ids=repr)
def test_lowers_for_tpu_at_a_model_shape(act):
    """Mosaic's lowering (run here, on the CPU) accepts every activation the kernel
    takes at the DeepSeek-V2-Lite-like first product (49152 rows, 2 x 1408)."""
    h = jax.ShapeDtypeStruct((49152, 2816), jnp.bfloat16)
    ct = jax.ShapeDtypeStruct((49152, 1408), jnp.bfloat16)
    text = (
        jax.jit(lambda h, ct: gated_vjp(act, h, ct))
        .trace(h, ct)
        .lower(lowering_platforms=("tpu",))
        .as_text()
    )
    assert text.count("tpu_custom_call") == 1
