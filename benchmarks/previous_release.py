"""Step speed of this code against a previous release, side by side in one process.

    python3 benchmarks/previous_release.py               # against commit 5e74673
    python3 benchmarks/previous_release.py --quick       # tiny smoke run (about a minute)
    python3 benchmarks/previous_release.py --commit REV --only gmm,layer

The previous release's `moe_eqx` is extracted with `git archive REV moe_eqx` into a
temporary directory as the package `moe_eqx_prev` (any absolute `moe_eqx` import
rewritten), and both are imported here. Every section times its candidates round-robin
(`--repeats` rounds after one untimed call each), each a jitted program compiled ahead
of time, always together with the same dense baseline, so that all see the same load of
a shared machine; `ms` is the minimum wall time and `cpu` the minimum process CPU time
(all threads) of one call. Sections:

- `gmm G=8`, `gmm G=64`: the tiled grouped matmul, forward and forward+backward (the
  output and its `jax.vjp` in `lhs` and `rhs`), M=4096, K=512, N=1024, float32, group
  sizes multinomial(M, uniform), as benchmarks/gmm.py; baseline `x @ w[0]`.
- `gmm G=32 skewed`: the same at M=16384 with group shares drawn from Dirichlet(1)
  (sizes from 61 to 1890 rows at the seed used), as routing leaves them.
- `layer forward`, `layer fwd+bwd`: the one-device layer (T=4096, d_model=512,
  d_ff=256, E=32, k=4, float32), as benchmarks/layer.py, with the same weights in both
  versions; forward+backward is `jax.grad` of `sum(y**2)` in every floating-point
  parameter and `x`. Baseline: the SwiGLU as three dense matmuls on `[T*k, d_model]`.
  The fwd+bwd section also times the same layer on 8 simulated devices with
  `on_overflow="drop"` and `"fallback"` (routing that does not overflow, checked),
  the tokens sharded over the devices.

The table gives each version's time, `today/prev` (the previous release's time over
today's: above 1 is faster today) from the minimum wall times, `median today/prev` (the
median over rounds of that ratio within each round: steadier when the load changes
during the run) and `cpu today/prev` from the minimum CPU times, and each version
against the dense baseline; the relative rows (EP8 over one device, fallback over drop)
compare the two versions' own ratios. `uptime`'s load average is printed before and after. Writes
benchmarks/results/previous_release.json.
"""

import argparse
import importlib
import os
import pathlib
import platform
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

from _common import layer_fns, print_table, setup_devices, write_json

setup_devices(8)

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax.random as jr  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import moe_eqx as me  # noqa: E402

PREVIOUS = "5e74673"
PREV_NAME = "moe_eqx_prev"


def import_previous(commit: str, folder: str):
    """`moe_eqx` at `commit` imported as the package `moe_eqx_prev` from `folder`."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", commit, "moe_eqx"],
        check=True,
        capture_output=True,
    ).stdout
    target = pathlib.Path(folder)
    with tempfile.TemporaryFile() as f:
        f.write(archive)
        f.seek(0)
        with tarfile.open(fileobj=f) as tar:
            tar.extractall(target, filter="data")
    (target / "moe_eqx").rename(target / PREV_NAME)
    absolute = re.compile(r"^(\s*)(from|import)\s+moe_eqx\b", re.MULTILINE)
    for path in (target / PREV_NAME).rglob("*.py"):
        text = path.read_text()
        new = absolute.sub(rf"\1\2 {PREV_NAME}", text)
        if new != text:
            path.write_text(new)
    sys.path.insert(0, str(target))
    return importlib.import_module(PREV_NAME)


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return " ".join(f"{v:.2f}" for v in os.getloadavg())


def interleaved(candidates: dict, repeats: int) -> dict:
    """`name -> {"ms", "cpu_ms", "rounds"}`: the minimum wall and process CPU time of
    one call of each `name -> (compiled fn, args)`, run round-robin `repeats` times
    after one untimed call each, and every round's wall time."""
    for fn, args in candidates.values():
        jax.block_until_ready(fn(*args))
    walls = {name: [] for name in candidates}
    cpus = {name: [] for name in candidates}
    for _ in range(repeats):
        for name, (fn, args) in candidates.items():
            start, cpu = time.perf_counter(), time.process_time()
            jax.block_until_ready(fn(*args))
            walls[name].append(1e3 * (time.perf_counter() - start))
            cpus[name].append(1e3 * (time.process_time() - cpu))
    return {
        k: {"ms": min(walls[k]), "cpu_ms": min(cpus[k]), "rounds": walls[k]}
        for k in candidates
    }


def median_ratio(num: list, den: list) -> float:
    """The median over rounds of `num[i] / den[i]` (times taken in the same round)."""
    return statistics.median(n / d for n, d in zip(num, den, strict=True))


def compiled(fn, *args):
    """`(fn compiled ahead of time, args)`."""
    return jax.jit(fn).lower(*args).compile(), args


# ---------------------------------------------------------------------------------
# Programs.


def _value_and_vjp(f, x, w, d):
    out, vjp = jax.vjp(f, x, w)
    return out, *vjp(d)


def gmm_programs(lib, x, w, sizes, d_out):
    def fwd(x, w, s):
        return lib._gmm.gmm(x, w, s, backend="tiled")

    def fwd_bwd(x, w, s, d):
        return _value_and_vjp(lambda a, b: fwd(a, b, s), x, w, d)

    return compiled(fwd, x, w, sizes), compiled(fwd_bwd, x, w, sizes, d_out)


def dense_gmm_programs(x, w0, d_out):
    def fwd(x, w):
        return x @ w

    def fwd_bwd(x, w, d):
        return _value_and_vjp(fwd, x, w, d)

    return compiled(fwd, x, w0), compiled(fwd_bwd, x, w0, d_out)


def dense_ffn_programs(rows, d_model, d_ff, key):
    """The layer's baseline: one expert's SwiGLU on all `T*k` rows (as
    benchmarks/layer.py)."""
    k1, k2, k3 = jr.split(key, 3)
    x = jr.normal(k1, (rows, d_model), jnp.float32)
    w_gu = jr.normal(k2, (d_model, 2 * d_ff), jnp.float32) / d_model**0.5
    w_dn = jr.normal(k3, (d_ff, d_model), jnp.float32) / d_ff**0.5

    def ffn(x, w_gu, w_dn):
        gu = x @ w_gu
        return (jax.nn.silu(gu[:, :d_ff]) * gu[:, d_ff:]) @ w_dn

    def loss(x, w_gu, w_dn):
        return jnp.sum(jnp.square(ffn(x, w_gu, w_dn)))

    args = (x, w_gu, w_dn)
    return compiled(ffn, *args), compiled(jax.grad(loss, argnums=(0, 1, 2)), *args)


def make_layer(lib, shape, like=None, **overrides):
    """`lib.MoELayer` of `shape`; with `like`, carrying its router and expert
    weights (so both versions route the same way)."""
    t, d, f, e, k = shape
    cfg = lib.MoEConfig(d_model=d, d_ff=f, num_experts=e, top_k=k, **overrides)
    layer = lib.MoELayer(cfg, key=jr.key(0))
    if like is not None:

        def where(m):
            return m.router.weight, m.experts.w_gate_up, m.experts.w_down

        layer = eqx.tree_at(where, layer, where(like))
    return layer


def layer_programs(layer, x, mesh, forward: bool):
    """The layer's forward (`forward`) or fwd+bwd step, compiled; raises if its
    routing overflows or loses pairs."""
    (fwd, args), (step, _) = layer_fns(layer, x, mesh)
    fn, args = compiled(fwd if forward else step, *args)
    stats = fn(*args)[1]
    if bool(stats.overflow) or int(stats.lost_pairs) != 0:
        raise RuntimeError(f"the routing overflowed or lost pairs: {stats}")
    return fn, args


# ---------------------------------------------------------------------------------
# Rows.


def speed_row(name, times, today, prev, dense="dense"):
    """A row comparing candidates `today` and `prev` of `times`."""
    t, p, b = times[today], times[prev], times[dense]
    return {
        "row": name,
        "unit": "ms",
        "today": t["ms"],
        "prev": p["ms"],
        "today/prev": p["ms"] / t["ms"],
        "median today/prev": median_ratio(p["rounds"], t["rounds"]),
        "cpu today/prev": p["cpu_ms"] / t["cpu_ms"],
        "today vs dense": b["ms"] / t["ms"],
        "prev vs dense": b["ms"] / p["ms"],
        "dense_ms": b["ms"],
    }


def relative_row(name, times, today, today_base, prev, prev_base):
    """A row comparing the ratio `today / today_base` with `prev / prev_base` (times:
    above 1 is slower than the base)."""
    t = times[today]["ms"] / times[today_base]["ms"]
    p = times[prev]["ms"] / times[prev_base]["ms"]
    t_cpu = times[today]["cpu_ms"] / times[today_base]["cpu_ms"]
    p_cpu = times[prev]["cpu_ms"] / times[prev_base]["cpu_ms"]
    r = {k: times[k]["rounds"] for k in (today, today_base, prev, prev_base)}
    t_rounds = [a / b for a, b in zip(r[today], r[today_base], strict=True)]
    p_rounds = [a / b for a, b in zip(r[prev], r[prev_base], strict=True)]
    return {
        "row": name,
        "unit": "ratio",
        "today": t,
        "prev": p,
        "today/prev": p / t,
        "median today/prev": median_ratio(p_rounds, t_rounds),
        "cpu today/prev": p_cpu / t_cpu,
    }


def gmm_section(libs, g, m, k, n, repeats, rng, skewed=False):
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    d_out = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((g, k, n)), jnp.float32)
    shares = rng.dirichlet(np.ones(g)) if skewed else np.full(g, 1.0 / g)
    sizes = jnp.asarray(rng.multinomial(m, shares), jnp.int32)
    dense = dense_gmm_programs(x, w[0], d_out)
    progs = {name: gmm_programs(lib, x, w, sizes, d_out) for name, lib in libs.items()}
    rows = []
    for i, label in enumerate(("fwd", "fwd+bwd")):
        cands = {"dense": dense[i], **{name: p[i] for name, p in progs.items()}}
        times = interleaved(cands, repeats)
        name = f"gmm G={g}{' skewed' if skewed else ''} {label}"
        rows.append(speed_row(name, times, "today", "prev"))
        print_table(rows[-1:], list(rows[-1]))
    return rows


def layer_sections(libs, shape, repeats, ep: bool):
    t, d, f, e, k = shape
    x = jr.normal(jr.key(2), (t, d), jnp.float32)
    dense = dense_ffn_programs(t * k, d, f, jr.key(1))
    today = make_layer(libs["today"], shape)
    layers = {"today": today, "prev": make_layer(libs["prev"], shape, like=today)}
    rows = []
    cands = {"dense": dense[0]}
    for name, layer in layers.items():
        cands[name] = layer_programs(layer, x, None, forward=True)
    times = interleaved(cands, repeats)
    rows.append(speed_row("layer forward", times, "today", "prev"))
    print_table(rows[-1:], list(rows[-1]))

    cands = {"dense": dense[1]}
    for name, layer in layers.items():
        cands[name] = layer_programs(layer, x, None, forward=False)
    mesh = jax.make_mesh((len(jax.devices()),), ("expert",)) if ep else None
    modes = ("drop", "fallback") if ep else ()
    # Tokens sharded over the mesh, as in a data-parallel step: the previous release
    # returned `y` sharded whatever `x` was, today's `y` takes `x`'s sharding.
    x_ep = jax.device_put(x, NamedSharding(mesh, P("expert"))) if ep else None
    for mode in modes:
        for name, lib in libs.items():
            layer = make_layer(lib, shape, like=today, on_overflow=mode)
            cands[f"{name} EP8 {mode}"] = layer_programs(
                layer, x_ep, mesh, forward=False
            )
    times = interleaved(cands, repeats)
    new = [speed_row("layer fwd+bwd", times, "today", "prev")]
    for mode in modes:
        new.append(
            speed_row(
                f"EP8 {mode} fwd+bwd", times, f"today EP8 {mode}", "prev EP8 " + mode
            )
        )
    if ep:
        new.append(
            relative_row(
                "EP8 drop / one device",
                times,
                "today EP8 drop",
                "today",
                "prev EP8 drop",
                "prev",
            )
        )
        new.append(
            relative_row(
                "EP8 fallback / drop",
                times,
                "today EP8 fallback",
                "today EP8 drop",
                "prev EP8 fallback",
                "prev EP8 drop",
            )
        )
    print_table(new, list(new[0]))
    return rows + new, times


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny shapes, two repeats")
    p.add_argument("--commit", default=PREVIOUS, help="the previous release")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--only", default="gmm,layer", help="sections: gmm, layer")
    p.add_argument("--no-ep", action="store_true", help="no EP8 rows")
    args = p.parse_args(argv)

    if args.quick:
        gmm_shape, groups, layer_shape, repeats = (256, 32, 64), (4, 8), None, 2
        skewed_groups = 8
        layer_shape = (256, 64, 64, 8, 2)
    else:
        gmm_shape, groups, repeats = (4096, 512, 1024), (8, 64), 10
        skewed_groups = 32
        layer_shape = (4096, 512, 256, 32, 4)
    repeats = args.repeats or repeats
    only = set(args.only.split(","))
    load_before = uptime()
    print(f"load before: {load_before}")
    with tempfile.TemporaryDirectory(prefix="moe_eqx_prev_") as folder:
        prev = import_previous(args.commit, folder)
        libs = {"today": me, "prev": prev}
        rows, layer_times = [], {}
        rng = np.random.default_rng(0)
        if "gmm" in only:
            for g in groups:
                rows += gmm_section(libs, g, *gmm_shape, repeats, rng)
            m, k, n = gmm_shape
            rows += gmm_section(
                libs, skewed_groups, 4 * m, k, n, repeats, rng, skewed=True
            )
        if "layer" in only:
            new, layer_times = layer_sections(
                libs, layer_shape, repeats, ep=not args.no_ep
            )
            rows += new
    load_after = uptime()
    print(
        f"\ntoday ({ROOT}) against {args.commit}: today/prev = the previous release's "
        f"time over today's (relative rows: its ratio over today's); min of "
        f"{repeats} interleaved repetitions; {jax.devices()[0].device_kind}"
    )
    columns = ["row", "unit", "today", "prev", "today/prev", "median today/prev"]
    columns.append("cpu today/prev")
    print_table(rows, [*columns, "today vs dense", "prev vs dense"])
    print(f"load before: {load_before}\nload after:  {load_after}")
    write_json(
        "previous_release",
        {
            "commit": args.commit,
            "gmm_shape": dict(zip("MKN", gmm_shape, strict=True), groups=groups),
            "skewed_gmm": {"M": 4 * gmm_shape[0], "groups": skewed_groups},
            "layer_shape": dict(
                zip(("T", "d_model", "d_ff", "E", "k"), layer_shape, strict=True)
            ),
            "dtype": "float32",
            "device": jax.devices()[0].device_kind,
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "jax": jax.__version__,
            "quick": args.quick,
            "repeats": repeats,
            "load_before": load_before,
            "load_after": load_after,
            "rows": rows,
            "layer_times": layer_times,
        },
    )
    return rows


if __name__ == "__main__":
    main()
