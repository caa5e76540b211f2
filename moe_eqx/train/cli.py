"""The demo's command line: train a small MoE language model on synthetic Zipf/Markov
token sequences.

    python -m moe_eqx.demo                       # one device
    python -m moe_eqx.demo --ep 8 --skew-from 40 --skew-to 60
    python -m moe_eqx.demo --ckpt-dir /tmp/ck --ckpt-every 50 [--resume]
    python -m moe_eqx.launch --processes 2 --devices-per-process 4 -- --steps 50

With `--ep N` the MoE layers run expert-parallel over a mesh axis "expert" of N devices
(on CPU the demo simulates them). With `--distributed` (set by `moe_eqx.launch`) the
mesh spans every device of every process of a `jax.distributed` run; each process feeds
only its own rows of the global batch, and process 0 prints, logs and checkpoints.

Ctrl-C stops after the current step, checkpoints (with `--ckpt-dir`) and prints the
command that resumes the run; the exit code is then 130.
"""

import argparse
import math
import os
import sys

from .._config import GMM_BACKENDS, MoEConfig
from .._stats import LostPairsError
from .loop import Interrupted, run
from .resume import resume_command
from .runtime import ENV_LAUNCHER_PID, exit_with_launcher, set_cpu_devices

PROG = "python -m moe_eqx.demo"


def _buffer_factor(text: str) -> float | None:
    if text.lower() in ("none", "worst"):
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be > 0 or 'none', got {text!r}")
    return value


def _model_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--vocab", type=int, default=128, help="vocabulary size")
    g.add_argument("--d-model", type=int, default=64, help="model width")
    g.add_argument("--d-ff", type=int, default=32, help="hidden width of each expert")
    g.add_argument("--heads", type=int, default=4, help="attention heads")
    # 32 fine-grained experts, 4 per token: with --ep 8 each shard holds 4 experts, so
    # a token often picks two on one shard and deduplication sends it once.
    g.add_argument("--experts", type=int, default=32, help="routed experts per layer")
    g.add_argument("--top-k", type=int, default=4, help="experts per token")
    g.add_argument("--layers", type=int, default=2, help="transformer blocks")
    g.add_argument("--untied-head", action="store_true", help="separate output head")
    g.add_argument(
        "--deepseek",
        action="store_true",
        help="DeepSeek-V3-style routing: sigmoid scores, group-limited top-k "
        "(experts/2 groups, best half), selection bias, raw (unnormalised) weights "
        "scaled by 2.5, and a shared expert of width 2 * d_ff",
    )
    g = p.add_argument_group("expert-parallel layer")
    g.add_argument(
        "--buffer-factor",
        type=_buffer_factor,
        default=2.0,
        help="receive buffer of each shard, in multiples of its balanced load "
        "('none' = worst case, never overflows)",
    )
    g.add_argument(
        "--num-slots",
        type=int,
        default=None,
        help="spare expert slots per shard, filled with replicas of the hottest "
        "experts every step (dynamic duplication); default 1 with --ep > 1 or "
        "--distributed, else 0",
    )
    g.add_argument(
        "--rebalance-every",
        type=int,
        default=0,
        help="every N steps, re-place the experts on their home shards from the "
        "last N steps' load, model and optimizer state together (slow re-placement; "
        "the spare slots still balance every step); 0 = never",
    )
    g.add_argument(
        "--no-dedup",
        action="store_true",
        help="send one wire row per (token, expert) instead of one per (token, shard)",
    )
    g.add_argument(
        "--on-overflow",
        choices=("fallback", "drop"),
        default="fallback",
        help="what the layer does when a shard's receive buffer would overflow: "
        "'fallback' runs the chunked dropless path (nothing dropped), 'drop' drops "
        "the pairs that do not fit and counts them",
    )
    g.add_argument(
        "--gmm-backend",
        choices=GMM_BACKENDS,
        default="auto",
        help="grouped-matmul backend of the experts ('auto': by platform)",
    )


def _training_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=int, default=200, help="train up to this step")
    g.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    g.add_argument("--seq", type=int, default=32, help="sequence length")
    g.add_argument(
        "--lr", type=float, default=3e-3, help="peak learning rate (warmup, cosine)"
    )
    g.add_argument(
        "--schedule-steps",
        type=int,
        default=None,
        help="length of the learning-rate schedule (warmup, then cosine decay to "
        "0.1 * lr at this step); default --steps, and on --resume the checkpoint's",
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


def _run_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism")
    g.add_argument(
        "--ep",
        type=int,
        default=None,
        help="expert-parallel size (devices on the 'expert' mesh axis); "
        "default 1, or every global device with --distributed",
    )
    g.add_argument(
        "--data",
        type=int,
        default=1,
        help="data-parallel groups: a mesh axis 'data' of this size before 'expert' "
        "(--data x --ep devices; the batch is split over all of them)",
    )
    g.add_argument(
        "--fsdp",
        action="store_true",
        help="split the experts, their gradients and optimizer state over the "
        "'data' axis too (FSDP / ZeRO-3) instead of replicating them (needs "
        "--data > 1; each layer is rematerialised in the backward pass)",
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
        "--save-params", default=None, help="write the final parameters here (.npz)"
    )
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument(
        "--ckpt-dir",
        default=None,
        help="checkpoint directory (also written on Ctrl-C)",
    )
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
        help="continue from the latest good checkpoint in --ckpt-dir (a fresh start "
        "if it holds none)",
    )
    # For tests of failure handling: process `--die-process` exits abruptly at the start
    # of step `--die-at-step`.
    p.add_argument("--die-at-step", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--die-process", type=int, default=None, help=argparse.SUPPRESS)
    # For tests: trace the model under the library's house rules (strict dtype
    # promotion, no implicit rank promotion); optax itself is not strict-clean.
    p.add_argument("--strict-promotion", action="store_true", help=argparse.SUPPRESS)


class _HelpFormatter(
    argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter
):
    """Flag defaults shown, and the epilog's lines kept as written."""


LOG_COLUMNS = """\
columns of the log line printed every --log-every steps:
  loss (ce)          training loss (cross-entropy plus the auxiliary losses) and its
                     cross-entropy part, means over the interval
  lb                 load-balancing loss, E * sum_e f_e P_e (1.0 when balanced)
  z                  router z-loss, mean of logsumexp(logits)**2
  expert max/mean    the busiest expert's pairs over the mean (worst step)
  rank max/mean a -> b
                     the busiest expert-parallel shard's pairs over the mean, before
                     -> after hot experts are copied into spare slots (worst step)
  need bf            the smallest buffer_factor at which no receive buffer would have
                     overflowed (worst step); above --buffer-factor, the step
                     overflowed
  overflow, fallback steps whose buffers would overflow, and steps that ran the
                     chunked dropless fallback
  dropped            pairs dropped (only with --on-overflow drop)
  lost               pairs neither computed nor counted as dropped: always 0 (a
                     step with any stops the run)
  dedup              wire rows over routed pairs: below 1 when tokens cross the wire
                     once for several experts on one shard
  [skew n]           steps of the interval in the skew phase
"""


def build_parser() -> argparse.ArgumentParser:
    """The demo's command-line flags."""
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Train a small MoE language model on synthetic token sequences. "
        "Ctrl-C stops after the current step, checkpoints (with --ckpt-dir) and "
        "prints the command that resumes the run.",
        formatter_class=_HelpFormatter,
        epilog=LOG_COLUMNS,
    )
    _model_flags(p)
    _training_flags(p)
    _run_flags(p)
    return p


def _deepseek_options(args: argparse.Namespace) -> dict:
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


def moe_config(args: argparse.Namespace) -> MoEConfig:
    """The MoE layers' configuration from the flags (`num_slots` resolved)."""
    return MoEConfig(
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
        fsdp_axes=("data",) if args.fsdp else (),
        **(_deepseek_options(args) if args.deepseek else {}),
    )


_POSITIVE = (
    "steps batch seq d_model d_ff heads experts top_k layers log_every ckpt_keep"
).split()


def _check_ranges(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    for name in _POSITIVE:
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    for name in ("ckpt_every", "num_slots", "rebalance_every"):
        if getattr(a, name) is not None and getattr(a, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0")
    if a.vocab < 2:
        p.error("--vocab must be >= 2")
    if a.ep is not None and a.ep < 1:
        p.error("--ep must be >= 1")
    if a.data < 1:
        p.error("--data must be >= 1")
    if a.schedule_steps is not None and a.schedule_steps < 1:
        p.error("--schedule-steps must be >= 1")
    if not (math.isfinite(a.lr) and a.lr > 0):
        p.error(f"--lr must be a positive number, got {a.lr}")
    if not 0.0 <= a.dropout < 1.0:
        p.error("--dropout must be in [0, 1)")


def check_args(p: argparse.ArgumentParser, a: argparse.Namespace) -> MoEConfig:
    """Checks the flags together (exits with a usage error naming the flag) and
    resolves `--num-slots`.

    **Returns:**

    The MoE layers' configuration.
    """
    _check_ranges(p, a)
    if a.top_k > a.experts:
        p.error(f"--top-k ({a.top_k}) must not exceed --experts ({a.experts})")
    if a.ep is not None and a.experts % a.ep:
        p.error(f"--experts ({a.experts}) must be divisible by --ep ({a.ep})")
    if a.ep is not None and a.batch % (a.ep * a.data):
        what = f"--ep ({a.ep})" if a.data == 1 else f"--ep x --data ({a.ep * a.data})"
        p.error(f"--batch ({a.batch}) must be divisible by {what}")
    if a.fsdp and a.data < 2:
        p.error(
            "--fsdp splits the experts over the data-parallel groups: it needs "
            "--data > 1"
        )
    if a.d_model % a.heads:
        p.error(f"--d-model ({a.d_model}) must be divisible by --heads ({a.heads})")
    if (a.skew_from is None) != (a.skew_to is None):
        p.error("--skew-from and --skew-to go together")
    if a.skew_from is not None and not 0 <= a.skew_from < a.skew_to:
        p.error("need 0 <= --skew-from < --skew-to")
    if a.rebalance_every and (a.ep or 1) == 1 and not a.distributed:
        p.error("--rebalance-every re-places experts over shards: it needs --ep > 1")
    if a.resume and not a.ckpt_dir:
        p.error("--resume needs --ckpt-dir")
    if a.num_slots is None:
        a.num_slots = 1 if a.distributed or (a.ep or 1) > 1 else 0
    try:
        return moe_config(a)
    except ValueError as e:
        p.error(str(e))


def main(argv: list[str] | None = None) -> dict:
    """Runs the demo. Returns the summary dict (also written to `--json`).

    Exits with code 130 on Ctrl-C (after checkpointing, with `--ckpt-dir`), and with
    code 3 on the first step whose MoE layers lost pairs (a bug; nothing of that step
    is checkpointed).
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    config = check_args(parser, args)
    devices = (args.ep or 1) * args.data
    if devices > 1 and not args.distributed:
        set_cpu_devices(devices)
    if ENV_LAUNCHER_PID in os.environ:
        exit_with_launcher(int(os.environ[ENV_LAUNCHER_PID]))
    try:
        return run(args, config, prog=PROG, argv=argv)
    except Interrupted as e:
        print(e, file=sys.stderr, flush=True)
        raise SystemExit(130) from None
    except LostPairsError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(3) from None
    except KeyboardInterrupt:
        if args.ckpt_dir:
            hint = (
                "resume from the latest checkpoint in "
                f"{args.ckpt_dir} (if any) with:\n  {resume_command(PROG, argv)}"
            )
        else:
            hint = "nothing saved (no --ckpt-dir)."
        print(f"\ninterrupted (Ctrl-C); {hint}", file=sys.stderr, flush=True)
        raise SystemExit(130) from None
