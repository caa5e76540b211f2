"""Shared test helpers: meshes, forced routing, oracle comparisons."""

import os
import subprocess
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np

import moe_eqx as me


def cpu_devices():
    """The 8 simulated CPU devices of the test session (also on an accelerator
    machine, where the default backend is the accelerator)."""
    return jax.devices("cpu")


def mesh(num_shards: int):
    return jax.make_mesh((num_shards,), ("expert",), devices=cpu_devices()[:num_shards])


def auto_mesh(num_shards: int):
    """A mesh with Auto axes, for calling `jax.shard_map` directly on unsharded inputs."""
    return jax.make_mesh(
        (num_shards,),
        ("expert",),
        devices=cpu_devices()[:num_shards],
        axis_types=(jax.sharding.AxisType.Auto,),
    )


def with_bias(layer: me.MoELayer, bias) -> me.MoELayer:
    return eqx.tree_at(lambda l: l.router.bias, layer, jnp.asarray(bias, jnp.float32))


def routing_bias(kind: str, num_experts: int, top_k: int, num_shards: int, seed=0):
    """A selection bias that forces a routing pattern on the router.

    - uniform: no bias.
    - zipf: Zipf(1.2) preference over a fixed random permutation of the experts.
    - one_expert: every token picks experts 0..k-1 (expert 0 and its neighbours on
      shard 0 get every token).
    - one_shard: every token picks among shard 0's experts only.
    """
    rng = np.random.default_rng(seed)
    bias = np.zeros(num_experts, np.float32)
    if kind == "zipf":
        p = 1.0 / np.arange(1, num_experts + 1) ** 1.2
        bias[rng.permutation(num_experts)] = np.log(p / p.sum()) * 0.5
    elif kind == "one_expert":
        bias[:top_k] = 10.0 + np.arange(top_k, 0, -1)
    elif kind == "one_shard":
        per_shard = num_experts // num_shards
        bias[:per_shard] = 10.0
    elif kind != "uniform":
        raise ValueError(kind)
    return bias


def loss_fn(y):
    # Every output element gets its own cotangent; mildly non-linear, and not so
    # non-linear that float32 rounding of large outputs is amplified.
    c = jnp.cos(jnp.arange(y.size, dtype=jnp.float32)).reshape(y.shape)
    return jnp.sum(y.astype(jnp.float32) * c) + 0.05 * jnp.sum(jnp.square(y))


@eqx.filter_jit
def layer_value_and_grad(layer, x, mesh):
    def f(args):
        layer, x = args
        y, stats = layer(x, mesh=mesh)
        return loss_fn(y), (y, stats)

    (_, (y, stats)), (grads, gx) = eqx.filter_value_and_grad(f, has_aux=True)(
        (layer, x)
    )
    return y, stats, grads, gx


@eqx.filter_jit
def oracle_value_and_grad(layer, x):
    def f(args):
        layer, x = args
        y = me.reference_moe(layer, x)
        return loss_fn(y), y

    (_, y), (grads, gx) = eqx.filter_value_and_grad(f, has_aux=True)((layer, x))
    return y, grads, gx


def received_token_by_token(experts, num_shards: int, num_local: int, dedup: bool):
    """Wire rows and pairs each shard receives on home placement (no duplication),
    counted token by token from the routing `experts: [tokens, k]`, independently of
    the layer's own counting."""
    rows = np.zeros(num_shards, int)
    pairs = np.zeros(num_shards, int)
    for row in np.asarray(experts):
        dests = [int(e) // num_local for e in row]
        np.add.at(pairs, dests, 1)
        np.add.at(rows, sorted(set(dests)) if dedup else dests, 1)
    return rows, pairs


def assert_nothing_lost(stats, num_tokens: int, top_k: int):
    """Every routed pair was computed or counted as dropped: `lost_pairs` is 0, and
    the pairs the shards report computing plus the dropped ones are all the pairs."""
    assert int(stats.lost_pairs) == 0, f"{int(stats.lost_pairs)} pairs lost"
    computed = int(jnp.sum(stats.recv_pairs))
    assert computed + int(stats.dropped_pairs) == num_tokens * top_k, (
        computed,
        int(stats.dropped_pairs),
        num_tokens * top_k,
    )
    assert int(jnp.sum(stats.expert_counts)) == num_tokens * top_k


def assert_matches_oracle(layer, x, mesh, *, atol=2e-5, rtol=2e-5):
    y, stats, grads, gx = layer_value_and_grad(layer, x, mesh)
    num_tokens = x.size // x.shape[-1]
    assert_nothing_lost(stats, num_tokens, layer.config.top_k)
    assert int(stats.dropped_pairs) == 0  # the oracle computes every pair
    y_ref, grads_ref, gx_ref = oracle_value_and_grad(layer, x)
    np.testing.assert_allclose(y, y_ref, atol=atol, rtol=rtol, err_msg="output")
    np.testing.assert_allclose(gx, gx_ref, atol=atol, rtol=rtol, err_msg="d/dx")
    # Every parameter: router, experts, shared experts (the same tree on both sides).
    paths = jax.tree_util.tree_flatten_with_path(grads)[0]
    ref = jax.tree.leaves(grads_ref)
    assert len(paths) == len(ref) >= 3
    for (path, got), want in zip(paths, ref, strict=True):
        np.testing.assert_allclose(
            got, want, atol=atol, rtol=rtol, err_msg=f"d/d{jax.tree_util.keystr(path)}"
        )
    return stats


def make_layer(key, *, mesh_size=1, bias_kind=None, **overrides):
    cfg = dict(d_model=16, d_ff=24, num_experts=8, top_k=2)
    cfg.update(overrides)
    if bias_kind is not None:
        cfg["use_router_bias"] = True
    config = me.MoEConfig(**cfg)
    layer = me.MoELayer(config, key=key)
    if bias_kind is not None:
        layer = with_bias(
            layer,
            routing_bias(bias_kind, config.num_experts, config.top_k, mesh_size),
        )
    return layer


def tokens(key, n, d_model=16):
    return jr.normal(key, (n, d_model), jnp.float32)


# XLA's own default emitters, where the session compiles with the older ones
# (conftest.py): for programs a test inspects once compiled.
_OLDER_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
USERS_OPTIONS = (
    {"xla_cpu_use_fusion_emitters": True}
    if _OLDER_EMITTERS in os.environ.get("XLA_FLAGS", "")
    else None
)


def compile_as_users(lowered):
    """`lowered.compile()` with XLA:CPU's default emitters, as a user's program
    compiles (the session's faster older emitters emit some ops, a scatter among
    them, otherwise): for a test that inspects the compiled program's HLO or
    memory."""
    return lowered.compile(USERS_OPTIONS)


def demo_env(cache_dir=None) -> dict:
    """Environment for a demo/launcher subprocess, with an optional persistent
    compilation cache (multi-process CPU runs must not use one)."""
    env = dict(os.environ)
    # The demo picks its own device count; don't inherit the test session's 8. The
    # backend optimisation level and emitters are the session's (see conftest.py):
    # compile time.
    env["XLA_FLAGS"] = "--xla_backend_optimization_level=0"
    if _OLDER_EMITTERS in os.environ.get("XLA_FLAGS", ""):
        env["XLA_FLAGS"] += f" {_OLDER_EMITTERS}"
    env["JAX_PLATFORMS"] = "cpu"
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    if cache_dir is not None:
        env["JAX_COMPILATION_CACHE_DIR"] = str(cache_dir)
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    return env


def run_module(module, args, *, timeout, cache_dir=None, expect=None):
    """Runs `python -m module args` bounded by `timeout`; checks the exit code if
    `expect` is given."""
    proc = subprocess.run(
        [sys.executable, "-m", module, *args],
        env=demo_env(cache_dir),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if expect is not None:
        assert proc.returncode == expect, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc


def load_params(path) -> dict:
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


def run_python(code: str, *, timeout: int = 120) -> str:
    """Runs `code` in a fresh interpreter (no pytest, no runtime type checks) on the
    CPU and returns its standard output; fails the test on a non-zero exit."""
    env = demo_env()
    # No XLA_FLAGS at all, as for a user: the README's first block only sets its
    # device count when XLA_FLAGS is unset.
    env.pop("XLA_FLAGS")
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout


def recording_read(read: list):
    """A replacement of the importer's safetensors reader's `TensorFile.read` that
    appends every read to `read`: `[name, start, stop]` for rows of a tensor,
    `[name, None, None]` for a whole one."""
    from moe_eqx._hf.safetensors_file import TensorFile

    real_read = TensorFile.read

    def recorded(self, name, start=0, stop=None):
        whole = start == 0 and stop is None
        read.append([name, None if whole else start, None if whole else stop])
        return real_read(self, name, start, stop)

    return recorded


def every_code_weight(fmt, k, n, key, parts=1):
    """A weight `[1, k, n]` in `fmt` holding every stored byte many times (FP8: NaN
    and subnormal codes too), with random scales (MXFP4: the scale bytes of finite
    values)."""
    codes = (np.arange(k * n) * 7 % 256).astype(np.uint8).view(np.int8)
    shape = (1, n, k // 2) if fmt == "mxfp4" else (1, k, n)
    values = jnp.asarray(codes[: int(np.prod(shape))].reshape(shape))
    scales_shape = me.internal.quantize(jnp.ones((1, k, n)), fmt).scales.shape
    if parts != 1:  # FP8's scales per part, each blocked from its own first column
        scales_shape = (1, -(-k // 128), -(-(n // parts) // 128) * parts)
    if fmt == "mxfp4":
        # (Above 252 a code times its scale overflows: infinity times the identity's
        # zeros would be NaN.)
        scales = jr.randint(key, scales_shape, 2, 253).astype(jnp.uint8)
    else:
        floats = jnp.exp(jr.normal(key, scales_shape) * 8)
        scales = jax.lax.bitcast_convert_type(floats, jnp.uint32)
    return me.QuantizedArray(values, scales, fmt, jnp.float32, parts)


def kernel_operand_sources(hlo: str, operand_type: str) -> list[str]:
    """For each operand of a `tpu_custom_call` in compiled HLO text whose type
    matches the regular expression `operand_type` (e.g. `s8\\[64,704,2048\\]`), the
    opcode of the instruction its bytes come from, through any `bitcast`s
    (`parameter`: the call's argument as it lies; `copy` or `fusion`: a copy made
    in the program). Operands may be written with their types or without (as
    `Compiled.as_text()` writes them)."""
    import re

    defined = {}  # instruction name -> (type, opcode, operand names)
    for m in re.finditer(r"(%[\w.\-]+) = (.*?) ([\w\-]+)\((.*)", hlo):
        defined[m[1]] = (m[2], m[3], re.findall(r"%[\w.\-]+", m[4]))
    sources = []
    for line in hlo.splitlines():
        if 'custom_call_target="tpu_custom_call"' not in line:
            continue
        args = line.split("custom-call(", 1)[1].split("), custom_call_target", 1)[0]
        for name in re.findall(r"%[\w.\-]+", args):
            kind, opcode, operands = defined.get(name, ("", "unknown", []))
            if not re.match(operand_type, kind):
                continue
            while opcode == "bitcast" and operands:
                _, opcode, operands = defined.get(operands[0], ("", "unknown", []))
            sources.append(opcode)
    return sources
