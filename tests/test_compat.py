"""Private JAX and Equinox APIs are used only in `moe_eqx/_compat.py`, each used
here as the library uses it (a release that moves one fails here, naming it, rather
than deep in a layer call), and the dependency bounds hold the versions installed here
(the ones the suite runs)."""

import ast
import pathlib
import re
import tomllib

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from helpers import auto_mesh, cpu_devices
from packaging.requirements import Requirement

import moe_eqx as me
from moe_eqx import _compat

ROOT = pathlib.Path(me.__file__).parent
PRIVATE = re.compile(r"jax\._src|equinox\._|eqxi\._|\._primitive\b")


def test_private_apis_only_in_the_compat_module():
    found = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in sorted(ROOT.rglob("*.py"))
        if path.name != "_compat.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if PRIVATE.search(line)
    ]
    assert found == []


@pytest.mark.parametrize("name, version", [("jax", jax), ("equinox", eqx)])
def test_bounds_hold_the_installed_version(name, version):
    """A lower bound the suite runs, and an upper bound (a private API is used)."""
    project = tomllib.loads((ROOT.parent / "pyproject.toml").read_text())
    (req,) = [
        Requirement(d)
        for d in project["project"]["dependencies"]
        if Requirement(d).name == name
    ]
    assert req.specifier.contains(version.__version__)
    assert any(s.operator == "<" for s in req.specifier)
    assert any(s.operator == ">=" for s in req.specifier)


def test_compat_reads_the_mesh():
    m = jax.make_mesh((2,), ("expert",), devices=cpu_devices()[:2])
    assert _compat.concrete_mesh() is None
    seen = []

    @jax.jit
    def f(x):
        seen.append((_compat.concrete_mesh(), _compat.abstract_mesh_platform()))
        return x

    with jax.set_mesh(m):
        f(jax.numpy.zeros(2))
    assert seen == [(m, "cpu")]


def test_missing_dynamic_marks_arrays_of_filtered_primitives():
    seen = []
    prim = jax.extend.core.Primitive("moe_eqx_compat_probe")
    prim.multiple_results = True

    def impl(x, flag):
        seen.append(flag)
        return [x + 1]

    prim.def_impl(_compat.filter_primitive_def(impl))
    prim.def_abstract_eval(
        _compat.filter_primitive_def(
            lambda x, flag: [jax.core.ShapedArray(x.shape, x.dtype)]
        )
    )
    (out,) = _compat.filter_primitive_bind(prim, jnp.ones(3), "static")
    assert seen == ["static"] and float(out[0]) == 2.0
    assert _compat.missing_dynamic is not None


def test_varying_avals_inside_shard_map():
    """The axes an aval varies over, and an aval made to vary over them."""
    m = auto_mesh(2)
    seen = []

    def body(x):
        aval = jax.typeof(x)
        axes = _compat.varying_axes(aval)
        made = _compat.varying_aval((3,), jnp.float32, aval, axes)
        seen.append((axes, _compat.varying_axes(made)))
        return x

    jax.shard_map(body, mesh=m, in_specs=jax.P("expert"), out_specs=jax.P("expert"))(
        jnp.ones(4)
    )
    assert seen == [(frozenset({"expert"}), frozenset({"expert"}))]
    assert _compat.varying_axes(jax.core.ShapedArray((2,), jnp.float32)) == frozenset()


def test_partial_eval_hooks():
    """`primal_and_tangent`, which registers its primitive's partial evaluation and
    tells staged values by `is_unknown`: its rule under `jax.linearize` (partial
    evaluation) and `jax.checkpoint` (the jaxpr rule, `partial_eval_as_call`)."""
    from moe_eqx._gmm import TiledGMM

    backend = TiledGMM()
    x = jax.random.normal(jax.random.key(0), (16, 4))
    w = jax.random.normal(jax.random.key(1), (2, 4, 6))
    sizes = jnp.asarray([10, 6], jnp.int32)

    def f(x):
        return jnp.sum(backend(x, w, sizes) ** 2)

    _, f_lin = jax.linearize(f, x)
    g = jax.grad(jax.checkpoint(f))(x)
    assert f_lin(x).shape == () and g.shape == x.shape
    seen = []

    @jax.custom_jvp
    def ident(x):
        return x

    @ident.defjvp
    def ident_jvp(primals, tangents):
        seen.append(_compat.is_unknown(tangents[0]))
        return primals[0], tangents[0]

    jax.jvp(ident, (1.0,), (1.0,))  # evaluated: known
    jax.linearize(ident, 1.0)  # staged: unknown
    assert seen == [False, True]


def test_sub_jaxpr_of_a_call():
    closed = jax.make_jaxpr(lambda x: jax.jit(lambda y: y + 1)(x))(1.0)
    (eqn,) = closed.jaxpr.eqns
    sub = _compat.sub_jaxpr(eqn)
    assert sub is not None and len(sub.invars) == 1
    plain = jax.make_jaxpr(lambda x: x + 1)(1.0).jaxpr.eqns[0]
    assert _compat.sub_jaxpr(plain) is None


_PRIVATE = ("jax._src", "jax.interpreters.partial_eval", "equinox.internal")


@pytest.mark.parametrize(
    "path",
    sorted(p for p in ROOT.rglob("*.py") if p.name != "_compat.py"),
    ids=lambda p: p.name,
)
def test_no_private_api_outside_compat(path):
    """No import of `jax._src`, `jax.interpreters.partial_eval` or
    `equinox.internal` outside `_compat.py` (the library's own `internal` module
    aside)."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            assert not name.startswith(_PRIVATE), f"{path.name}: {name}"


# The modules below the stages: the rules they share, the backends' building blocks.
_BELOW_STAGES = {
    "_checks",
    "_rules",
    "_settings",
    "_buffers",
    "_activation",
    "_autodiff",
    "_quant",
    "_compat",
}


@pytest.mark.parametrize(
    "path",
    sorted(
        p for folder in ("_exchange", "_gmm") for p in (ROOT / folder).rglob("*.py")
    ),
    ids=lambda p: f"{p.parent.name}/{p.name}",
)
def test_backends_call_no_stage(path):
    """Backends implement a contract and call no stage: a module of `_exchange/` or
    `_gmm/` imports only its own family and the modules below the stages."""
    tree = ast.parse(path.read_text())
    depth = len(path.relative_to(ROOT).parts) - 1  # levels below moe_eqx/
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level > depth:
            module = (node.module or "").split(".")[0]
            assert module in _BELOW_STAGES, f"{path.name} imports {module}"
