"""A layer closed over by `jax.jit` (its arrays become constants of the program): no
scatter in the compiled program takes one instruction as two of its operands.

The TPU compiler aborts the process on such a scatter
(`ScatterEmitter::ShouldFuseInputIntoScatter`: `operand_indices.size() == 1`). It
arose when a constant `expert_ids` (an iota) was both the indices and the updates of
the scatter that inverted it; XLA's CSE merges equal constants on every backend, so
the CPU's optimised HLO shows it too. `benchmarks/tpu_check.sh` runs the same calls on
a chip.
"""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import pytest
from helpers import compile_as_users, mesh as cpu_mesh

import moe_eqx as me

_SCATTER = re.compile(r"=\s*\S+\s+scatter\(([^)]*)\)")


def _repeated_operand_scatters(text: str) -> list[str]:
    """The scatters of an HLO module's text with an operand named twice."""
    bad = []
    for match in _SCATTER.finditer(text):
        operands = [o.strip().split(" ")[-1] for o in match.group(1).split(",")]
        if len(operands) != len(set(operands)):
            bad.append(match.group(0))
    return bad


def _compiled_text(fn, *args) -> str:
    return compile_as_users(jax.jit(fn).lower(*args)).as_text()


def test_the_check_sees_the_bad_scatter():
    """The check finds the scatter that aborted the TPU compiler: a constant iota as
    both indices and updates."""

    def inverse(x):
        ids = jnp.arange(8, dtype=jnp.int32)
        position = jnp.zeros((8,), jnp.int32).at[ids].set(ids, unique_indices=True)
        return x[position]

    text = _compiled_text(inverse, jnp.arange(8.0))
    assert _repeated_operand_scatters(text), text


_CASES = {
    "one device": dict(mesh=None),
    "one device, shared, quantized": dict(mesh=None, shared_d_ff=32, fmt="int8"),
    "EP4 fallback, slot": dict(mesh=4, buffer_factor=0.5, num_slots=1),
    # The default buffer, under EP4's worst case: the fallback compiled in, as in
    # every EP4 case here.
    "EP4 chunks": dict(mesh=4, token_chunks=2),
    # The TPU's products (in Pallas' interpreter here): the own grouped kernels'
    # schedule at many rows, the decode kernel's at few.
    "one device, TPU many rows": dict(
        mesh=None, gmm_backend=me.PallasTPUGMM(max_rows=16, interpret=True)
    ),
    "one device, TPU decode kernel": dict(
        mesh=None, gmm_backend=me.PallasTPUGMM(interpret=True)
    ),
}


@pytest.mark.parametrize("case", list(_CASES))
def test_closed_over_layer_has_no_repeated_operand_scatter(case):
    settings = dict(_CASES[case])
    mesh = settings.pop("mesh")
    fmt = settings.pop("fmt", None)
    cfg = me.MoEConfig(d_model=32, d_ff=32, num_experts=8, top_k=2, **settings)
    layer = me.MoELayer(cfg, key=jr.key(0))
    if fmt is not None:
        layer = me.quantize_experts(layer, fmt)
    mesh = None if mesh is None else cpu_mesh(mesh)
    x = jr.normal(jr.key(1), (32, cfg.d_model))

    def forward(x):
        return layer(x, mesh=mesh)[0]

    def grad(x):
        return jax.grad(lambda x: jnp.sum(forward(x) ** 2))(x)

    floats, ints = eqx.partition(layer, eqx.is_inexact_array)

    def grad_floats(p):
        y = eqx.combine(p, ints)(x, mesh=mesh)[0]
        return jax.grad(lambda p: jnp.sum(eqx.combine(p, ints)(x, mesh=mesh)[0]))(p), y

    for name, fn, arg in (
        ("jit", forward, x),
        ("grad", grad, x),
        ("grad of the float leaves", grad_floats, floats),
    ):
        bad = _repeated_operand_scatters(_compiled_text(fn, arg))
        assert not bad, (name, bad)
