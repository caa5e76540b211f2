"""Train a small MoE language model on synthetic Zipf/Markov token sequences.

    python -m moe_eqx.demo                       # one device, ~1 minute on 2 CPU cores
    python -m moe_eqx.demo --ep 8 --buffer-factor 1.0 --skew-from 40 --skew-to 60
    python -m moe_eqx.demo --ckpt-dir /tmp/ck --ckpt-every 50 [--resume]
    python -m moe_eqx.launch --processes 2 --devices-per-process 4 -- --steps 50

The model: token embedding, pre-norm transformer blocks (causal self-attention, then a
`moe_eqx.MoELayer` as the FFN), a tied (or separate) output head; AdamW. The objective
is cross-entropy + `--lb-coef` * load-balance loss + `--z-coef` * router z-loss.

With `--ep N` the MoE layers run expert-parallel over a mesh axis "expert" of N devices
(on CPU the demo simulates them). With `--distributed` (set by `moe_eqx.launch`) the
mesh spans every device of every process of a `jax.distributed` run; each process feeds
only its own rows of the global batch, and process 0 prints, logs and checkpoints.

The simulated CPU device count (`--ep N`) is applied in `main`, after the flags are
parsed and before anything initialises a jax backend (importing jax does not; the
count is read when the first device is touched). Nothing at import time touches one.
"""

import argparse
import contextlib
import json
import math
import os
import sys
import time
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .train import checkpoint as ckpt
from ._config import GMM_BACKENDS, MoEConfig
from ._data import ZipfMarkovData
from ._layer import MoELayer, MoEStats

ENV_COORDINATOR = "MOE_EQX_COORDINATOR"
ENV_NUM_PROCESSES = "MOE_EQX_NUM_PROCESSES"
ENV_PROCESS_ID = "MOE_EQX_PROCESS_ID"
ENV_INIT_TIMEOUT = "MOE_EQX_INIT_TIMEOUT"
ENV_LAUNCHER_PID = "MOE_EQX_LAUNCHER_PID"


# ---- the model


def rms_norm(
    x: Float[Array, "*batch d_model"], scale: Float[Array, " d_model"]
) -> Float[Array, "*batch d_model"]:
    """RMSNorm over the last axis.

    **Arguments:**

    - `x`: activations `[..., d_model]`.
    - `scale`: `[d_model]` learnt gain.

    **Returns:**

    `x / rms(x) * scale`, same shape as `x`.
    """
    var = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    gain = scale.reshape((1,) * (x.ndim - 1) + scale.shape)
    return x * jax.lax.rsqrt(var + jnp.asarray(1e-6, x.dtype)) * gain


class Attention(eqx.Module):
    """Causal multi-head self-attention without biases.

    **Fields:**

    - `w_qkv`: `[d_model, 3 d_model]` fused query/key/value projection.
    - `w_out`: `[d_model, d_model]` output projection.
    - `num_heads`: number of heads (divides `d_model`).
    """

    w_qkv: Float[Array, "d_model three_d_model"]
    w_out: Float[Array, "d_model d_model"]
    num_heads: int = eqx.field(static=True)

    def __init__(self, d_model: int, num_heads: int, *, key: PRNGKeyArray):
        qkv_key, out_key = jr.split(key)
        scale = 1.0 / math.sqrt(d_model)
        self.w_qkv = scale * jr.normal(qkv_key, (d_model, 3 * d_model), jnp.float32)
        self.w_out = scale * jr.normal(out_key, (d_model, d_model), jnp.float32)
        self.num_heads = num_heads

    def __call__(
        self, x: Float[Array, "batch seq d_model"]
    ) -> Float[Array, "batch seq d_model"]:
        """Attends each position to itself and the positions before it.

        **Arguments:**

        - `x`: `[batch, seq, d_model]`.

        **Returns:**

        `[batch, seq, d_model]`.
        """
        b, s, d = x.shape
        h = self.num_heads
        qkv = (x @ self.w_qkv).reshape(b, s, 3, h, d // h)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        logits = jnp.einsum("bqhc,bkhc->bhqk", q, k) / jnp.asarray(
            math.sqrt(d // h), x.dtype
        )
        causal = jnp.tril(jnp.ones((1, 1, s, s), bool))
        logits = jnp.where(causal, logits, jnp.asarray(-1e30, logits.dtype))
        attn = jax.nn.softmax(logits, axis=-1)
        out = jnp.einsum("bhqk,bkhc->bqhc", attn, v).reshape(b, s, d)
        return out @ self.w_out


class Block(eqx.Module):
    """Pre-norm transformer block: `x + attn(norm(x))`, then `x + moe(norm(x))`.

    **Fields:**

    - `attn_norm`, `moe_norm`: `[d_model]` RMSNorm gains.
    - `attn`: the [`moe_eqx.demo.Attention`][].
    - `moe`: the [`moe_eqx.MoELayer`][] used as the feed-forward network.
    """

    attn_norm: Float[Array, " d_model"]
    attn: Attention
    moe_norm: Float[Array, " d_model"]
    moe: MoELayer

    def __init__(self, config: MoEConfig, num_heads: int, *, key: PRNGKeyArray):
        attn_key, moe_key = jr.split(key)
        d = config.d_model
        self.attn_norm = jnp.ones((d,), jnp.float32)
        self.attn = Attention(d, num_heads, key=attn_key)
        self.moe_norm = jnp.ones((d,), jnp.float32)
        self.moe = MoELayer(config, key=moe_key)

    def __call__(
        self, x: Float[Array, "batch seq d_model"], *, mesh: Mesh | None
    ) -> tuple[Float[Array, "batch seq d_model"], MoEStats]:
        """Applies the block; the MoE layer sees the `batch * seq` tokens flattened.

        **Arguments:**

        - `x`: `[batch, seq, d_model]`.
        - `mesh`: `None` (one device) or the expert-parallel mesh.

        **Returns:**

        `(x, stats)`: `[batch, seq, d_model]` and the layer's [`moe_eqx.MoEStats`][].
        """
        b, s, d = x.shape
        x = x + self.attn(rms_norm(x, self.attn_norm))
        h = rms_norm(x, self.moe_norm).reshape(b * s, d)
        y, stats = self.moe(h, mesh=mesh)
        return x + y.reshape(b, s, d), stats


class MoELM(eqx.Module):
    """A decoder-only MoE language model: embedding, scanned `Block`s, final norm,
    tied or separate output head.

    **Fields:**

    - `embed`: `[vocab, d_model]` token embedding.
    - `blocks`: one [`moe_eqx.demo.Block`][] whose arrays have a leading `layers`
        axis (applied with `lax.scan`, so compile time does not grow with depth).
    - `final_norm`: `[d_model]` RMSNorm gain.
    - `head`: `[d_model, vocab]`, or `None` for a head tied to `embed`.
    - `dropout`: embedding dropout rate.
    """

    embed: Float[Array, "vocab d_model"]
    blocks: Block
    final_norm: Float[Array, " d_model"]
    head: Float[Array, "d_model vocab"] | None
    dropout: float = eqx.field(static=True)

    def __init__(
        self,
        config: MoEConfig,
        *,
        vocab: int,
        num_layers: int,
        num_heads: int,
        tied_head: bool,
        dropout: float,
        key: PRNGKeyArray,
    ):
        embed_key, blocks_key, head_key = jr.split(key, 3)
        d = config.d_model
        self.embed = jr.normal(embed_key, (vocab, d), jnp.float32)
        block_keys = jr.split(blocks_key, num_layers)
        self.blocks = eqx.filter_vmap(lambda k: Block(config, num_heads, key=k))(
            block_keys
        )
        self.final_norm = jnp.ones((d,), jnp.float32)
        self.head = (
            None
            if tied_head
            else jr.normal(head_key, (d, vocab), jnp.float32) / math.sqrt(d)
        )
        self.dropout = dropout

    def __call__(
        self,
        tokens: Int[Array, "batch seq"],
        *,
        mesh: Mesh | None,
        key: PRNGKeyArray | None = None,
    ) -> tuple[Float[Array, "batch seq vocab"], MoEStats]:
        """Next-token logits.

        **Arguments:**

        - `tokens`: `[batch, seq]` token ids.
        - `mesh`: `None` (one device) or the expert-parallel mesh.
        - `key`: for dropout; `None` disables it.

        **Returns:**

        `(logits, stats)`: `[batch, seq, vocab]` and the MoE stats of every layer,
        stacked along a leading `layers` axis.
        """
        x = self.embed[tokens]
        if self.dropout > 0 and key is not None:
            keep = jr.bernoulli(key, 1.0 - self.dropout, x.shape)
            x = jnp.where(keep, x / jnp.asarray(1.0 - self.dropout, x.dtype), 0.0)
        dynamic, static = eqx.partition(self.blocks, eqx.is_array)

        def layer(x, block_arrays):
            block = eqx.combine(block_arrays, static)
            return block(x, mesh=mesh)

        x, stats = jax.lax.scan(layer, x, dynamic)
        x = rms_norm(x, self.final_norm)
        if self.head is None:
            # The embedding rows have unit scale; 1/sqrt(d) keeps tied logits O(1).
            logits = x @ self.embed.T / jnp.asarray(math.sqrt(x.shape[-1]), x.dtype)
        else:
            logits = x @ self.head
        return logits, stats


def _deepseek_options(args) -> dict:
    groups = args.experts // 2 if args.experts % 4 == 0 else 1
    top_groups = max(1, groups // 2)
    if top_groups * (args.experts // groups) < args.top_k:
        groups = top_groups = 1
    return dict(
        score_func="sigmoid",
        norm_topk=False,
        num_groups=groups,
        top_groups=top_groups,
        routed_scaling_factor=2.5,
        shared_d_ff=2 * args.d_ff,
    )


def _buffer_factor(text: str) -> float | None:
    if text.lower() in ("none", "worst"):
        return None
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be > 0 or 'none', got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The demo's command-line flags."""
    p = argparse.ArgumentParser(
        prog="python -m moe_eqx.demo",
        description="Train a small MoE language model on synthetic token sequences.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("model")
    g.add_argument("--vocab", type=int, default=128, help="vocabulary size")
    g.add_argument("--d-model", type=int, default=64, help="model width")
    g.add_argument("--d-ff", type=int, default=64, help="hidden width of each expert")
    g.add_argument("--heads", type=int, default=4, help="attention heads")
    g.add_argument("--experts", type=int, default=8, help="routed experts per layer")
    g.add_argument("--top-k", type=int, default=2, help="experts per token")
    g.add_argument("--layers", type=int, default=2, help="transformer blocks")
    g.add_argument("--untied-head", action="store_true", help="separate output head")
    g.add_argument(
        "--buffer-factor",
        type=_buffer_factor,
        default=2.0,
        help="receive buffer factor of the EP layer ('none' = worst case)",
    )
    g.add_argument(
        "--num-slots",
        type=int,
        default=0,
        help="spare expert slots per shard (dynamic duplication)",
    )
    g.add_argument(
        "--no-dedup",
        action="store_true",
        help="send one wire row per (token, expert) instead of per shard",
    )
    g.add_argument(
        "--on-overflow",
        choices=("fallback", "drop"),
        default="fallback",
        help="what the EP layer does when a shard's receive buffer would overflow: "
        "'fallback' runs the chunked dropless path (nothing dropped), 'drop' drops "
        "the pairs that do not fit and counts them",
    )
    g.add_argument(
        "--gmm-backend",
        choices=GMM_BACKENDS,
        default="auto",
        help="grouped-matmul backend of the experts",
    )
    g.add_argument(
        "--deepseek",
        action="store_true",
        help="DeepSeek-V3-style routing: sigmoid scores, group-limited top-k "
        "(experts/2 groups, best half), selection bias, raw (unnormalised) weights "
        "scaled by 2.5, and a shared expert of width 2 * d_ff",
    )
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=int, default=200, help="training steps")
    g.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    g.add_argument("--seq", type=int, default=32, help="sequence length")
    g.add_argument(
        "--lr",
        type=float,
        default=3e-3,
        help="peak learning rate (warmup, cosine decay)",
    )
    g.add_argument(
        "--weight-decay",
        type=float,
        default=0.01,
        help="AdamW weight decay (matrices only)",
    )
    g.add_argument(
        "--lb-coef", type=float, default=0.01, help="weight of the load-balance loss"
    )
    g.add_argument("--z-coef", type=float, default=1e-3, help="weight of the z-loss")
    g.add_argument("--dropout", type=float, default=0.0, help="embedding dropout")
    g.add_argument(
        "--seed", type=int, default=0, help="seed of the model, data and dropout"
    )
    g = p.add_argument_group("skew phase (adversarial routing)")
    g.add_argument(
        "--skew-from", type=int, default=None, help="first step of the skew phase"
    )
    g.add_argument(
        "--skew-to", type=int, default=None, help="end (exclusive) of the skew phase"
    )
    g.add_argument(
        "--skew-bias",
        type=float,
        default=1.0,
        help="router selection bias towards the experts of shard 0 during "
        "the skew phase (0 = data skew only)",
    )
    g = p.add_argument_group("parallelism")
    g.add_argument(
        "--ep",
        type=int,
        default=None,
        help="expert-parallel size (devices on the 'expert' mesh axis); "
        "default 1, or every global device with --distributed",
    )
    g.add_argument(
        "--distributed",
        action="store_true",
        help="join a jax.distributed run (set up by moe_eqx.launch, or "
        "cluster auto-detection when MOE_EQX_* variables are absent)",
    )
    g = p.add_argument_group("output and checkpoints")
    g.add_argument(
        "--log-every", type=int, default=20, help="steps per logged interval"
    )
    g.add_argument("--json", default=None, help="write the per-interval history here")
    g.add_argument(
        "--save-params",
        default=None,
        help="write the final model parameters here (.npz)",
    )
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("--ckpt-dir", default=None, help="checkpoint directory")
    g.add_argument(
        "--ckpt-every",
        type=int,
        default=0,
        help="checkpoint every N steps (and at the end); 0 = only at the end",
    )
    g.add_argument("--ckpt-keep", type=int, default=2, help="checkpoints to keep")
    g.add_argument(
        "--resume",
        action="store_true",
        help="resume from the latest good checkpoint in --ckpt-dir",
    )
    # For tests of failure handling: process `--die-process` exits abruptly at the start
    # of step `--die-at-step`.
    p.add_argument("--die-at-step", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--die-process", type=int, default=None, help=argparse.SUPPRESS)
    # For tests: trace the model under the library's house rules (strict dtype
    # promotion, no implicit rank promotion); optax itself is not strict-clean.
    p.add_argument("--strict-promotion", action="store_true", help=argparse.SUPPRESS)
    return p


def _check_args(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    for name in (
        "steps",
        "batch",
        "seq",
        "d_model",
        "d_ff",
        "heads",
        "experts",
        "top_k",
        "layers",
        "log_every",
    ):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.vocab < 2:
        p.error("--vocab must be >= 2")
    if a.top_k > a.experts:
        p.error(f"--top-k ({a.top_k}) must not exceed --experts ({a.experts})")
    if a.ep is not None and a.experts % a.ep:
        p.error(f"--experts ({a.experts}) must be divisible by --ep ({a.ep})")
    if a.d_model % a.heads:
        p.error(f"--d-model ({a.d_model}) must be divisible by --heads ({a.heads})")
    if a.ep is not None and a.ep < 1:
        p.error("--ep must be >= 1")
    if (a.skew_from is None) != (a.skew_to is None):
        p.error("--skew-from and --skew-to go together")
    if a.skew_from is not None and not 0 <= a.skew_from < a.skew_to:
        p.error("need 0 <= --skew-from < --skew-to")
    if a.resume and not a.ckpt_dir:
        p.error("--resume needs --ckpt-dir")
    if not 0.0 <= a.dropout < 1.0:
        p.error("--dropout must be in [0, 1)")


def _set_cpu_devices(count: int) -> None:
    """Asks XLA:CPU for `count` devices unless the user already chose a count.

    Importing `moe_eqx` imports jax, but the CPU device count is only read when the
    backend is first initialised, so it is not too late here (the caller checks
    `jax.device_count()` in case it is)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" in flags:
        return
    try:
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:
        pass  # backend already initialised (e.g. called in-process by a test)


def main(argv: list[str] | None = None) -> dict:
    """Runs the demo. Returns the summary dict (also written to `--json`)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_args(parser, args)
    if args.ep is not None and args.ep > 1 and not args.distributed:
        _set_cpu_devices(args.ep)
    if ENV_LAUNCHER_PID in os.environ:
        _exit_with_launcher(int(os.environ[ENV_LAUNCHER_PID]))
    return _run(args)


def _exit_with_launcher(launcher_pid: int) -> None:
    """Exits this process when the launcher that started it is gone: an orphaned
    process would otherwise wait in a collective forever."""
    import threading

    def watch():
        while True:
            if os.getppid() != launcher_pid:
                print("launcher is gone; exiting.", file=sys.stderr, flush=True)
                os._exit(3)
            time.sleep(0.5)

    threading.Thread(target=watch, daemon=True, name="moe_eqx-launcher-watch").start()


def _run(args: argparse.Namespace) -> dict:
    # ---- processes and devices
    if args.distributed:
        _init_distributed()
    process = jax.process_index()
    num_processes = jax.process_count()
    lead = process == 0
    ep = (
        args.ep
        if args.ep is not None
        else (jax.device_count() if args.distributed else 1)
    )
    if args.distributed and ep != jax.device_count():
        raise SystemExit(
            f"--ep {ep} must equal the global device count ({jax.device_count()}) with "
            "--distributed: the mesh spans every device of every process."
        )
    if ep > jax.device_count():
        raise SystemExit(
            f"--ep {ep} needs {ep} devices, but jax sees {jax.device_count()} "
            f"({jax.default_backend()}). On CPU, unset XLA_FLAGS or set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={ep}; on an accelerator "
            "host, JAX_PLATFORMS=cpu simulates devices on the CPU."
        )
    if args.experts % ep:
        raise SystemExit(
            f"--experts ({args.experts}) must be divisible by --ep ({ep})."
        )
    if args.batch % ep:
        raise SystemExit(
            f"--batch ({args.batch}) must be divisible by --ep ({ep}): the batch is "
            "sharded over the expert axis."
        )
    mesh = None
    if ep > 1 or args.distributed:
        devices = jax.devices()[:ep]
        mesh = jax.make_mesh(
            (ep,),
            ("expert",),
            axis_types=(jax.sharding.AxisType.Auto,),
            devices=devices,
        )

    def say(*parts) -> None:
        if lead:
            msg = " ".join(str(x) for x in parts)
            if bar is not None:
                bar.write(msg)
            else:
                print(msg, flush=True)

    bar = None

    # ---- model, optimizer, data
    config = MoEConfig(
        d_model=args.d_model,
        d_ff=args.d_ff,
        num_experts=args.experts,
        top_k=args.top_k,
        use_router_bias=True,
        buffer_factor=args.buffer_factor,
        on_overflow=args.on_overflow,
        num_slots=args.num_slots,
        dedup=not args.no_dedup,
        gmm_backend=args.gmm_backend,
        **(_deepseek_options(args) if args.deepseek else {}),
    )
    init_key, train_key = jr.split(jr.PRNGKey(args.seed))
    model = MoELM(
        config,
        vocab=args.vocab,
        num_layers=args.layers,
        num_heads=args.heads,
        tied_head=not args.untied_head,
        dropout=args.dropout,
        key=init_key,
    )
    warmup = max(1, min(50, args.steps // 10))
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, args.lr, warmup, max(args.steps, warmup + 1), end_value=0.1 * args.lr
    )
    # Decay matrices only; in particular never the router's selection bias, which
    # has no gradient and is set by the skew phase.
    decay_mask = jax.tree.map(lambda a: a.ndim >= 2, eqx.filter(model, eqx.is_array))
    optimizer = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(schedule, weight_decay=args.weight_decay, mask=decay_mask),
    )
    data = ZipfMarkovData(args.vocab, args.seed)
    num_shards = ep

    # ---- placement: experts sharded over the expert axis, everything else replicated
    def put(host, sharding):
        host = np.asarray(host)
        if sharding is None:
            return jnp.asarray(host)
        return jax.make_array_from_callback(host.shape, sharding, lambda i: host[i])

    params, static = eqx.partition(model, eqx.is_array)
    if mesh is not None:
        replicated = NamedSharding(mesh, P())
        param_shardings = jax.tree.map(lambda _: replicated, params)
        param_shardings = eqx.tree_at(
            lambda m: (m.blocks.moe.experts.w_gate_up, m.blocks.moe.experts.w_down),
            param_shardings,
            (NamedSharding(mesh, P(None, "expert")),) * 2,
        )
        batch_sharding = NamedSharding(mesh, P("expert"))
    else:
        replicated = param_shardings = batch_sharding = None

    def place(tree, shardings):
        if mesh is None:
            return jax.tree.map(jnp.asarray, tree)
        return jax.tree.map(put, tree, shardings)

    params = place(params, param_shardings)
    opt_state = jax.jit(optimizer.init)(params)
    opt_shardings = None
    if mesh is not None:
        # Moments inherit the parameters' shardings; scalars (step counts) come out on
        # one device and are replicated instead.
        opt_shardings = jax.tree.map(
            lambda a: (
                a.sharding
                if isinstance(a.sharding, NamedSharding) and a.sharding.mesh == mesh
                else replicated
            ),
            opt_state,
        )
        opt_state = place(_gather_to_host(opt_state), opt_shardings)
    key = put(train_key, replicated)

    # ---- checkpoints: resume
    start = 0
    if args.resume:
        start, params, opt_state, key = _resume(
            args, params, opt_state, key, say, lead, num_processes
        )
        params = place(params, param_shardings)
        opt_state = place(opt_state, opt_shardings)
        key = put(key, replicated)

    # ---- one training step
    lb_coef, z_coef = args.lb_coef, args.z_coef

    def constrain(tree, shardings):
        if mesh is None:
            return tree
        return jax.tree.map(jax.lax.with_sharding_constraint, tree, shardings)

    def strict():
        if not args.strict_promotion:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(jax.numpy_dtype_promotion("strict"))
        stack.enter_context(jax.numpy_rank_promotion("raise"))
        return stack

    def loss_fn(params, batch, router_bias, key):
        model = eqx.combine(params, static)
        biases = jnp.broadcast_to(router_bias, model.blocks.moe.router.bias.shape)
        model = eqx.tree_at(lambda m: m.blocks.moe.router.bias, model, biases)
        inputs, targets = batch[:, :-1], batch[:, 1:]
        with strict():
            logits, stats = model(inputs, mesh=mesh, key=key)
        ce = jnp.mean(
            optax.softmax_cross_entropy_with_integer_labels(
                logits.astype(jnp.float32), targets
            )
        )
        lb = jnp.mean(stats.load_balance_loss)
        z = jnp.mean(stats.router_z_loss)
        loss = (
            ce
            + jnp.asarray(lb_coef, jnp.float32) * lb
            + jnp.asarray(z_coef, jnp.float32) * z
        )
        metrics = {
            "loss": loss,
            "ce": ce,
            "lb_loss": lb,
            "z_loss": z,
            "overflow": jnp.any(stats.overflow),
            "fallback": jnp.any(stats.fallback_used),
            "dropped_pairs": jnp.sum(stats.dropped_pairs),
            "max_over_mean_before": jnp.max(stats.max_over_mean_before),
            "max_over_mean": jnp.max(stats.max_over_mean),
            "required_buffer_factor": jnp.max(stats.required_buffer_factor),
            "dedup_ratio": jnp.mean(stats.dedup_ratio),
            "num_chunks": jnp.max(stats.num_chunks),
            "expert_max_over_mean": jnp.max(
                jnp.max(stats.expert_counts, axis=-1).astype(jnp.float32)
                / jnp.mean(stats.expert_counts.astype(jnp.float32), axis=-1)
            ),
        }
        return loss, metrics

    @eqx.filter_jit
    def train_step(params, opt_state, key, batch, router_bias):
        key, sub = jr.split(key)
        grads, metrics = jax.grad(loss_fn, has_aux=True)(
            params, batch, router_bias, sub
        )
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = eqx.apply_updates(params, updates)
        params = constrain(params, param_shardings)
        opt_state = constrain(opt_state, opt_shardings)
        return params, opt_state, key, metrics

    # Rows of the global batch that live on this process's devices.
    global_shape = (args.batch, args.seq + 1)
    if batch_sharding is not None:
        starts = sorted(
            {
                idx[0].start or 0
                for idx in batch_sharding.addressable_devices_indices_map(
                    global_shape
                ).values()
            }
        )
        per_device = args.batch // ep
        local_rows = range(starts[0], starts[-1] + per_device)
        if len(local_rows) != per_device * len(starts):
            raise SystemExit("this process's devices do not hold contiguous batch rows")
    else:
        local_rows = range(args.batch)

    def in_skew(step: int) -> bool:
        return args.skew_from is not None and args.skew_from <= step < args.skew_to

    skew_bias = np.zeros((args.experts,), np.float32)
    # The experts of shard 0 (on one device: the first top_k experts).
    skew_bias[: args.experts // num_shards if num_shards > 1 else args.top_k] = (
        args.skew_bias
    )
    no_bias = np.zeros((args.experts,), np.float32)

    def get_batch(step: int):
        local = data.rows(step, local_rows, args.seq, skew=in_skew(step))
        if batch_sharding is None:
            return jnp.asarray(local)
        return jax.make_array_from_process_local_data(
            batch_sharding, local, global_shape
        )

    def save(step: int) -> None:
        tree = {"params": params, "opt_state": opt_state, "key": key}
        host = _gather_to_host(tree)
        if lead:
            ckpt.save_checkpoint(
                args.ckpt_dir,
                step,
                host,
                keep=args.ckpt_keep,
                metadata={"data_step": step, "seed": args.seed, "argv": sys.argv[1:]},
            )

    def write_json(summary: dict | None) -> None:
        if not (args.json and lead):
            return
        out = {"args": vars(args), "history": history, "summary": summary}
        tmp = f"{args.json}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(out, f, indent=1)
        os.replace(tmp, args.json)

    # ---- loop
    say(
        f"moe_eqx demo: {args.layers} layers, d_model {args.d_model}, {args.experts} "
        f"experts (top-{args.top_k}), d_ff {args.d_ff}, vocab {args.vocab}; batch "
        f"{args.batch} x seq {args.seq}; EP {ep} over {num_processes} process(es), "
        f"{jax.device_count()} {jax.default_backend()} device(s); "
        f"buffer_factor {args.buffer_factor}, num_slots {args.num_slots}, dedup "
        f"{not args.no_dedup}, on_overflow {args.on_overflow}"
    )
    say(
        f"data: Zipf/Markov, unigram entropy {_entropy(data.unigram):.3f} nats, "
        f"best possible loss ~{data.entropy_floor():.3f}, log(vocab) "
        f"{math.log(args.vocab):.3f}"
    )
    if start:
        say(f"resumed at step {start}")
    if lead and not args.no_progress:
        from tqdm.auto import tqdm

        bar = tqdm(
            total=args.steps,
            initial=start,
            desc="train",
            unit="step",
            disable=None,
            dynamic_ncols=True,
        )
    history: list[dict] = []
    interval: list[dict] = []
    fallback_steps = overflow_steps = dropped_total = 0
    fallback_on = False
    fallback_since = 0
    first_step_time = None
    t_loop = time.perf_counter()
    t_after_first = None
    steps_after_first = 0
    metrics_host: dict = {}
    for step in range(start, args.steps):
        if args.die_at_step == step and process == (
            args.die_process if args.die_process is not None else num_processes - 1
        ):
            print(
                f"[die-at-step] process {process} exits abruptly at step {step}",
                flush=True,
            )
            os._exit(17)
        skewed = in_skew(step)
        bias = put(skew_bias if skewed else no_bias, replicated)
        t0 = time.perf_counter()
        params, opt_state, key, metrics = train_step(
            params, opt_state, key, get_batch(step), bias
        )
        metrics_host = {k: v.item() for k, v in jax.device_get(metrics).items()}
        dt = time.perf_counter() - t0
        if first_step_time is None:
            first_step_time = dt
            t_after_first = time.perf_counter()
        else:
            steps_after_first += 1
        if not math.isfinite(metrics_host["loss"]):
            raise SystemExit(f"loss is not finite at step {step}: {metrics_host}")
        metrics_host["step"] = step
        metrics_host["skew"] = skewed
        interval.append(metrics_host)
        fallback_steps += bool(metrics_host["fallback"])
        overflow_steps += bool(metrics_host["overflow"])
        dropped_total += int(metrics_host["dropped_pairs"])
        if metrics_host["fallback"] and not fallback_on:
            fallback_on, fallback_since = True, step
            say(
                f"  ! step {step}: a receive buffer would overflow (needs buffer_factor "
                f"{metrics_host['required_buffer_factor']:.2f} > {args.buffer_factor}); "
                f"chunked dropless fallback in use ({metrics_host['num_chunks']} chunks)"
            )
        elif not metrics_host["fallback"] and fallback_on:
            fallback_on = False
            say(
                f"  ! step {step}: back on the capped path (fallback ran for steps "
                f"{fallback_since}-{step - 1})"
            )
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{metrics_host['loss']:.3f}", refresh=False)
        done = step + 1
        if done % args.log_every == 0 or done == args.steps:
            entry = _summarise(interval, done)
            history.append(entry)
            interval = []
            say(_format(entry, ep))
            write_json(None)  # so that a run that dies still leaves its history
        if args.ckpt_dir and (
            (args.ckpt_every and done % args.ckpt_every == 0) or done == args.steps
        ):
            save(done)
    if bar is not None:
        bar.close()
        bar = None
    wall = time.perf_counter() - t_loop
    steady = (
        steps_after_first / (time.perf_counter() - t_after_first)
        if steps_after_first
        else float("nan")
    )
    summary = {
        # Mean over the last logging interval: a single step's loss is noisy.
        "final_loss": history[-1]["loss"] if history else float("nan"),
        "final_ce": history[-1]["ce"] if history else float("nan"),
        "last_step_loss": metrics_host.get("loss", float("nan")),
        "steps": args.steps,
        "start_step": start,
        "first_step_s": first_step_time,
        "steps_per_s": steady,
        "loop_s": wall,
        "fallback_steps": fallback_steps,
        "overflow_steps": overflow_steps,
        "dropped_pairs": dropped_total,
        "ep": ep,
        "processes": num_processes,
        "devices": jax.device_count(),
    }
    if args.save_params:
        host = _gather_to_host(params)
        if lead:
            flat = {
                jax.tree_util.keystr(kp): np.asarray(v)
                for kp, v in jax.tree_util.tree_flatten_with_path(host)[0]
            }
            np.savez(args.save_params, **flat)
    say(
        f"done: final loss {summary['final_loss']:.4f} (ce {summary['final_ce']:.4f}, "
        f"mean of the last {len(history[-1]['losses']) if history else 0} steps); "
        f"{steady:.1f} steps/s after a first step (compile) of "
        f"{first_step_time or 0.0:.1f} s; fallback on {fallback_steps} steps, overflow "
        f"on {overflow_steps}, dropped pairs {dropped_total}"
    )
    if ep == 1 and not args.distributed:
        say(
            "(one device: try --ep 8 --skew-from 80 --skew-to 120 for expert "
            "parallelism, a skewed phase and the dropless fallback; add --num-slots 1 "
            "to absorb the skew by duplicating hot experts)"
        )
    write_json(summary)
    if args.distributed:
        jax.distributed.shutdown()
    return summary


def _entropy(p: np.ndarray) -> float:
    return float(-(p * np.log(np.maximum(p, 1e-300))).sum())


def _summarise(interval: list[dict], done: int) -> dict:
    def mean(k):
        return float(np.mean([m[k] for m in interval]))

    def peak(k):
        return float(np.max([m[k] for m in interval]))

    return {
        "step": done,
        "loss": mean("loss"),
        "ce": mean("ce"),
        "last_loss": interval[-1]["loss"],
        "lb_loss": mean("lb_loss"),
        "z_loss": mean("z_loss"),
        "max_over_mean_before": peak("max_over_mean_before"),
        "max_over_mean": peak("max_over_mean"),
        "expert_max_over_mean": peak("expert_max_over_mean"),
        "required_buffer_factor": peak("required_buffer_factor"),
        "dedup_ratio": mean("dedup_ratio"),
        "overflow_steps": int(sum(bool(m["overflow"]) for m in interval)),
        "fallback_steps": int(sum(bool(m["fallback"]) for m in interval)),
        "dropped_pairs": int(sum(int(m["dropped_pairs"]) for m in interval)),
        "skew_steps": int(sum(bool(m["skew"]) for m in interval)),
        "losses": [m["loss"] for m in interval],
    }


def _format(e: dict, ep: int) -> str:
    line = (
        f"step {e['step']:5d}  loss {e['loss']:.4f} (ce {e['ce']:.4f})  lb "
        f"{e['lb_loss']:.3f}  z {e['z_loss']:.2f}  expert max/mean "
        f"{e['expert_max_over_mean']:.2f}"
    )
    if ep > 1:
        line += (
            f"  rank max/mean {e['max_over_mean_before']:.2f} -> "
            f"{e['max_over_mean']:.2f}  need bf {e['required_buffer_factor']:.2f}  "
            f"overflow {e['overflow_steps']}  fallback {e['fallback_steps']}  "
            f"dropped {e['dropped_pairs']}  dedup {e['dedup_ratio']:.2f}"
        )
    if e["skew_steps"]:
        line += f"  [skew {e['skew_steps']}]"
    return line


def _gather_to_host(tree: Any) -> Any:
    """Host NumPy copy of `tree`. Collective in a multi-process run: every process must
    call it, in the same order."""
    from jax.experimental import multihost_utils

    def get(a):
        if not isinstance(a, jax.Array):
            return a
        if a.is_fully_addressable or a.is_fully_replicated:
            return np.asarray(a)
        return np.asarray(multihost_utils.process_allgather(a, tiled=True))

    return jax.tree.map(get, tree)


def _init_distributed() -> None:
    """`jax.distributed.initialize` from the launcher's variables, or auto-detection."""
    # Cross-process collectives on CPU need gloo (XLA:CPU has none by default). Only
    # the CPU client reads this, and asking which backend is in use would initialise
    # it too early, so it is set unconditionally.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if os.environ.get("JAX_PLATFORMS", "").strip() == "cpu":
        # Measured on jax 0.10.2: with a persistent compilation cache written by an
        # earlier multi-process CPU run, the next run loads the cached executable and
        # hangs in its first collective. Compiling afresh always works.
        jax.config.update("jax_enable_compilation_cache", False)
    address = os.environ.get(ENV_COORDINATOR)
    if address is None:
        # TPU pods, SLURM, ...: jax detects the cluster itself.
        jax.distributed.initialize()
        return
    jax.distributed.initialize(
        coordinator_address=address,
        num_processes=int(os.environ[ENV_NUM_PROCESSES]),
        process_id=int(os.environ[ENV_PROCESS_ID]),
        initialization_timeout=int(os.environ.get(ENV_INIT_TIMEOUT, "60")),
    )


def _resume(args, params, opt_state, key, say, lead, num_processes):
    """Loads the latest good checkpoint; in a multi-process run, process 0 chooses the
    step and every process loads that one."""
    like = {"params": params, "opt_state": opt_state, "key": key}
    step = -1
    if lead:
        try:
            step, tree = ckpt.load_checkpoint(args.ckpt_dir, like)
        except ckpt.CheckpointError as e:
            if ckpt.list_checkpoints(args.ckpt_dir):
                raise
            say(f"--resume: {e} Starting from scratch.")
            step, tree = -1, None
    if num_processes > 1:
        from jax.experimental import multihost_utils

        step = int(multihost_utils.broadcast_one_to_all(np.int32(step)))
        if not lead and step >= 0:
            tree = ckpt.read_checkpoint(args.ckpt_dir, step, like)
    if step < 0:
        return 0, params, opt_state, key
    return step, tree["params"], tree["opt_state"], tree["key"]


if __name__ == "__main__":
    main()
