"""Private JAX and Equinox APIs are used only in `moe_eqx/_compat.py`, and the
dependency bounds hold the versions installed here (the ones the suite runs)."""

import pathlib
import re
import tomllib

import equinox as eqx
import jax
import pytest
from helpers import cpu_devices
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
