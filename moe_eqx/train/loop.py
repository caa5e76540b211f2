"""The training run: set up (devices, model, placement, resume), the loop over steps,
checkpoints, Ctrl-C, and the final summary.

The loop runs `between_steps` hooks before every step: functions
`(TrainState) -> TrainState` that may transform the model and optimizer state (a
periodic transform checks `state.step` itself, and returns a state placed like the one
it got, so that the step keeps its compilation). `_hooks` builds them from the flags;
fault injection for tests is one. Checkpoints are taken after a step, so a state a hook
changed is saved at the next one.
"""

import argparse
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence

import equinox as eqx
import jax
import jax.random as jr
import numpy as np

from .._config import MoEConfig
from .._stats import LostPairsError
from . import checkpoint as ckpt
from .data import Feed, ZipfMarkovData
from .log import Reporter, entropy
from .model import model_from_args
from .rebalance import Rebalancer
from .resume import TrainState, load_state, resume_command, save_state, schedule_steps
from .runtime import Runtime, gather_to_host, make_runtime
from .step import (
    Placement,
    make_loss_fn,
    make_optimizer,
    make_placement,
    make_train_step,
)

Hook = Callable[[TrainState], TrainState]


class Interrupted(Exception):
    """The run stopped on Ctrl-C (SIGINT); the message says what was saved and how to
    resume. The command line exits with code 130."""


class _StopOnCtrlC:
    """While entered: the first SIGINT asks the loop to stop after the current step;
    a second one raises `KeyboardInterrupt` at once. Only in the main thread of a
    single-process run (the processes of a multi-process run would stop at different
    steps and wait for each other in a collective)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.requested = False
        self._previous = None

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print(
            "\nCtrl-C: stopping after this step (press Ctrl-C again to stop at once).",
            file=sys.stderr,
            flush=True,
        )

    def __enter__(self):
        if self.enabled:
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc):
        if self.enabled:
            signal.signal(signal.SIGINT, self._previous)
        return False


def die_at_step(args: argparse.Namespace, runtime: Runtime) -> Hook:
    """For tests of failure handling: process `--die-process` (default: the last)
    exits abruptly at the start of step `--die-at-step`."""
    victim = args.die_process if args.die_process is not None else -1
    victim %= runtime.num_processes

    def hook(state: TrainState) -> TrainState:
        if state.step == args.die_at_step and runtime.process == victim:
            print(
                f"[die-at-step] process {runtime.process} exits abruptly at step "
                f"{state.step}",
                flush=True,
            )
            os._exit(17)
        return state

    return hook


def _one_step(state: TrainState, train_step: Callable, feed: Feed):
    """One step, its metrics as Python numbers and its `[layers, E]` expert counts;
    raises [`moe_eqx.LostPairsError`][] if a layer lost pairs."""
    params, opt_state, key, metrics = train_step(
        state.params,
        state.opt_state,
        state.key,
        feed.batch(state.step),
        feed.router_bias(state.step),
    )
    metrics = jax.device_get(metrics)
    counts = np.asarray(metrics.pop("expert_counts"))
    metrics = {k: v.item() for k, v in metrics.items()}
    if metrics["lost_pairs"]:
        # Before the step's state exists: nothing of this step is checkpointed.
        raise LostPairsError(
            f"step {state.step}: the MoE layers lost {metrics['lost_pairs']} pairs "
            "(routed, but neither computed nor counted as dropped); the last "
            "checkpoint is from before this step."
        )
    if not math.isfinite(metrics["loss"]):
        raise SystemExit(f"loss is not finite at step {state.step}: {metrics}")
    metrics["step"] = state.step
    metrics["skew"] = feed.in_skew(state.step)
    return TrainState(state.step + 1, params, opt_state, key), metrics, counts


def train(
    state: TrainState,
    *,
    steps: int,
    train_step: Callable,
    feed: Feed,
    reporter: Reporter,
    log_every: int,
    checkpoint: Callable[[TrainState], None] | None = None,
    checkpoint_every: int = 0,
    between_steps: Sequence[Hook] = (),
    stop_on_ctrl_c: bool = True,
) -> tuple[TrainState, bool]:
    """Runs steps `state.step, ..., steps - 1`.

    **Arguments:**

    - `state`: where to start.
    - `steps`: the step to stop at.
    - `train_step`: from [`moe_eqx.train.step.make_train_step`][].
    - `feed`: the batches and router biases.
    - `reporter`: records and prints the metrics.
    - `log_every`: steps per logged interval.
    - `checkpoint`: saves a state, or `None`.
    - `checkpoint_every`: checkpoint every N steps (0: only at the end).
    - `between_steps`: hooks applied, in order, before every step; a hook with an
        `observe(expert_counts)` method also gets each step's `[layers, E]` counts.
    - `stop_on_ctrl_c`: the first Ctrl-C stops the loop after the current step.

    **Returns:**

    `(state, interrupted)`: the state after the last finished step, and whether
    Ctrl-C stopped the loop early.
    """
    with _StopOnCtrlC(stop_on_ctrl_c) as stop:
        try:
            while state.step < steps and not stop.requested:
                for hook in between_steps:
                    state = hook(state)
                t0 = time.perf_counter()
                state, metrics, counts = _one_step(state, train_step, feed)
                for hook in between_steps:
                    if hasattr(hook, "observe"):
                        hook.observe(counts)
                reporter.step_done(
                    metrics, time.perf_counter() - t0, log_every=log_every, last=steps
                )
                every = checkpoint_every and state.step % checkpoint_every == 0
                if checkpoint is not None and (every or state.step == steps):
                    checkpoint(state)
        except KeyboardInterrupt:
            if not stop.enabled:
                raise
            # A second Ctrl-C. `state` is still the last finished step's (it is
            # assigned whole), so it can be checkpointed.
            stop.requested = True
    return state, stop.requested


def _init_state(args, config: MoEConfig, runtime: Runtime, schedule: int):
    init_key, train_key = jr.split(jr.key(args.seed))
    model = model_from_args(args, config, key=init_key)
    params, static = eqx.partition(model, eqx.is_array)

    def optimizer_for(schedule_steps: int):
        return make_optimizer(
            model,
            lr=args.lr,
            weight_decay=args.weight_decay,
            schedule_steps=schedule_steps,
        )

    optimizer = optimizer_for(schedule)
    placement, params, opt_state = make_placement(runtime.mesh, params, optimizer)
    state = TrainState(0, params, opt_state, placement.put(train_key))
    return state, static, placement, optimizer_for


def _resume(args, state: TrainState, placement: Placement, runtime, reporter):
    loaded = load_state(args.ckpt_dir, state, runtime, reporter.say)
    if loaded is None:
        return state, None
    resumed, metadata = loaded  # restored onto `state`'s shardings (each process
    # its own shards), so the step reuses its compilation
    reporter.say(f"resumed at step {resumed.step}")
    return resumed, metadata


def _say_header(args, runtime: Runtime, data: ZipfMarkovData, reporter: Reporter):
    groups = ""
    if runtime.data > 1:
        split = " (experts split over them)" if args.fsdp else ""
        groups = f" x {runtime.data} data-parallel groups{split}"
    reporter.say(
        f"moe_eqx demo: {args.layers} layers, d_model {args.d_model}, {args.experts} "
        f"experts (top-{args.top_k}), d_ff {args.d_ff}, vocab {args.vocab}; batch "
        f"{args.batch} x seq {args.seq}; EP {runtime.ep}{groups} over "
        f"{runtime.num_processes} process(es), {jax.device_count()} "
        f"{jax.default_backend()} device(s); buffer_factor {args.buffer_factor}, "
        f"num_slots {args.num_slots}, dedup {not args.no_dedup}, on_overflow "
        f"{args.on_overflow}" + ("; DeepSeek-V3 routing" if args.deepseek else "")
    )
    skew = ""
    if args.skew_from is not None:
        ids = len(data.skew_tokens)
        skew = (
            f"; in the skew phase (steps {args.skew_from}-{args.skew_to - 1}) tokens "
            f"are drawn uniformly from {ids} ids, so the loss can fall to "
            f"~{math.log(ids):.3f} there"
        )
    reporter.say(
        f"data: Zipf/Markov, unigram entropy {entropy(data.unigram):.3f} nats, "
        f"best possible loss ~{data.entropy_floor():.3f}, log(vocab) "
        f"{math.log(args.vocab):.3f}{skew}"
    )


def _complete(args, start: int, metadata: dict, reporter: Reporter) -> dict:
    loss = metadata.get("loss")
    reporter.say(
        f"the run in {args.ckpt_dir} is complete: its latest checkpoint is at step "
        f"{start} and --steps is {args.steps}, so there is nothing to train"
        + (
            f" (loss of its last logged interval {loss:.4f})"
            if loss is not None
            else ""
        )
        + ". To train further, resume with a larger --steps."
    )
    return {"complete": True, "start_step": start, "steps": args.steps}


def _finish(args, state: TrainState, runtime: Runtime, reporter: Reporter, start):
    summary = reporter.summary(
        steps=args.steps,
        start=start,
        extra={
            "ep": runtime.ep,
            "data": runtime.data,
            "processes": runtime.num_processes,
            "devices": jax.device_count(),
        },
    )
    if args.save_params:
        host = gather_to_host(state.params)
        if runtime.lead:
            flat = {
                jax.tree_util.keystr(kp): np.asarray(v)
                for kp, v in jax.tree_util.tree_flatten_with_path(host)[0]
            }
            np.savez(args.save_params, **flat)
    reporter.print_summary(summary)
    if runtime.ep == 1 and not runtime.distributed:
        reporter.say(
            "(one device: try --ep 8 --skew-from 80 --skew-to 120 for expert "
            "parallelism with deduplicated dispatch and hot experts duplicated into "
            "spare slots; add --num-slots 0 to see the dropless fallback instead)"
        )
    reporter.write_json(summary)
    return summary


def _interrupted(args, state: TrainState, start: int, save, command: str) -> str:
    where = f"interrupted after step {state.step} (Ctrl-C)"
    if not args.ckpt_dir:
        return f"{where}; nothing saved: run with --ckpt-dir DIR to be able to resume."
    if state.step > start:
        path = save(state)
        saved = f"checkpoint of step {state.step} saved: {path}"
    elif args.resume:
        saved = f"no step finished; the checkpoint of step {start} is still the latest"
    else:
        return f"{where}; no step finished, nothing saved."
    return f"{where}; {saved}\nresume with:\n  {command}"


def _prepare(args, config: MoEConfig, runtime: Runtime, reporter: Reporter):
    """The state to start from (resumed or fresh), the model's static part, the step
    function, the placement, the schedule's length and the resumed metadata."""
    schedule = args.schedule_steps or args.steps
    state, static, placement, optimizer_for = _init_state(
        args, config, runtime, schedule
    )
    metadata = None
    if args.resume:
        state, metadata = _resume(args, state, placement, runtime, reporter)
        schedule = schedule_steps(
            steps=args.steps,
            lr=args.lr,
            requested=args.schedule_steps,
            start=state.step,
            metadata=metadata,
            say=reporter.say,
        )
    loss_fn = make_loss_fn(
        static,
        runtime.mesh,
        lb_coef=args.lb_coef,
        z_coef=args.z_coef,
        strict=args.strict_promotion,
    )
    train_step = make_train_step(loss_fn, optimizer_for(schedule), placement)
    return state, static, train_step, placement, schedule, metadata or {}


def _hooks(args, runtime: Runtime, static, placement, reporter) -> list[Hook]:
    """What runs between steps, in order: periodic transforms of the model and
    optimizer state (`--rebalance-every`), and fault injection for tests."""
    hooks = []
    if args.rebalance_every:
        hooks.append(
            Rebalancer(
                args.rebalance_every,
                num_shards=runtime.ep,
                static=static,
                placement=placement,
                say=reporter.say,
            )
        )
    if args.die_at_step is not None:
        hooks.append(die_at_step(args, runtime))
    return hooks


class _Saver:
    """Saves states with the metadata a resumed run needs (collective), through one
    asynchronous [`moe_eqx.train.checkpoint.Checkpointer`][]; `close` waits for the
    last save."""

    def __init__(self, args, reporter: Reporter, schedule: int, argv):
        self.args, self.reporter, self.schedule, self.argv = (
            args,
            reporter,
            schedule,
            argv,
        )
        self.checkpointer = None

    def __call__(self, state: TrainState):
        args = self.args
        if self.checkpointer is None:
            self.checkpointer = ckpt.Checkpointer(args.ckpt_dir, keep=args.ckpt_keep)
        metadata = {
            "data_step": state.step,
            "seed": args.seed,
            "argv": self.argv,
            "steps": args.steps,
            "schedule_steps": self.schedule,
            "lr": args.lr,
            "loss": self.reporter.last_logged_loss(),
        }
        return save_state(self.checkpointer, state, metadata=metadata)

    def poll(self, state: TrainState) -> TrainState:
        """A between-steps hook: checksums a finished save."""
        if self.checkpointer is not None:
            self.checkpointer.poll()
        return state

    def close(self) -> None:
        if self.checkpointer is not None:
            self.checkpointer.close()
            self.checkpointer = None


def run(
    args: argparse.Namespace, config: MoEConfig, *, prog: str, argv: list[str]
) -> dict:
    """Runs the demo's training; `args` are checked flags and `config` the layer's.

    **Arguments:**

    - `args`: the parsed, checked flags of [`moe_eqx.train.cli.build_parser`][].
    - `config`: the MoE layers' configuration.
    - `prog`, `argv`: the command line, to print the command that resumes the run.

    **Returns:**

    The summary dict (also written to `--json`). Raises
    [`moe_eqx.train.loop.Interrupted`][] on Ctrl-C, after checkpointing.
    """
    runtime = make_runtime(
        args.ep,
        experts=args.experts,
        batch=args.batch,
        distributed=args.distributed,
        data=args.data,
    )
    reporter = Reporter(
        lead=runtime.lead,
        ep=runtime.ep,
        buffer_factor=args.buffer_factor,
        json_path=args.json,
        args=vars(args),
    )
    data = ZipfMarkovData(args.vocab, args.seed)
    _say_header(args, runtime, data, reporter)
    state, static, train_step, placement, schedule, metadata = _prepare(
        args, config, runtime, reporter
    )
    start = state.step
    if start >= args.steps:
        summary = _complete(args, start, metadata, reporter)
        if runtime.distributed:
            jax.distributed.shutdown()
        return summary
    save = _Saver(args, reporter, schedule, argv)
    if not args.no_progress:
        reporter.open_bar(args.steps, start)
    try:
        state, interrupted = train(
            state,
            steps=args.steps,
            train_step=train_step,
            feed=Feed(data, placement, args, runtime.ep, runtime.ep * runtime.data),
            reporter=reporter,
            log_every=args.log_every,
            checkpoint=save if args.ckpt_dir else None,
            checkpoint_every=args.ckpt_every,
            between_steps=[
                save.poll,
                *_hooks(args, runtime, static, placement, reporter),
            ],
            stop_on_ctrl_c=runtime.num_processes == 1,
        )
    finally:
        reporter.close_bar()
    if interrupted:
        reporter.write_json(None)
        try:
            message = _interrupted(args, state, start, save, resume_command(prog, argv))
        finally:
            save.close()
        raise Interrupted(message)
    save.close()  # the last checkpoint is on disk before the summary says so
    summary = _finish(args, state, runtime, reporter, start)
    if runtime.distributed:
        jax.distributed.shutdown()
    return summary
