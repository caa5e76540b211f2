"""Saving a run's state and resuming it: which checkpoint, which learning-rate schedule,
and the command that resumes an interrupted run.

A checkpoint's metadata records the schedule's length (`schedule_steps`) and peak
learning rate, so that a resumed run keeps the schedule of the first one even when it
is resumed with a different `--steps` (a larger `--steps` would otherwise silently
stretch the cosine decay and raise the learning rate mid-run).
"""

import os
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from jaxtyping import PRNGKeyArray, PyTree

from . import checkpoint as ckpt
from .runtime import Runtime, all_agree
from .step import make_schedule

# Flags that inject failures for tests; a resume command never repeats them.
_ONE_OFF_FLAGS = {"--die-at-step": 1, "--die-process": 1}


class TrainState(NamedTuple):
    """The state a training step maps to the next one.

    **Fields:**

    - `step`: the number of steps done (the next step to run).
    - `params`: the model's arrays.
    - `opt_state`: the optimizer state.
    - `key`: the PRNG key of the next step (dropout).
    """

    step: int
    params: PyTree
    opt_state: PyTree
    key: PRNGKeyArray

    def tree(self) -> dict:
        """What a checkpoint stores (the step goes in its name)."""
        return {"params": self.params, "opt_state": self.opt_state, "key": self.key}


def save_state(
    checkpointer: ckpt.Checkpointer, state: TrainState, *, metadata: dict
) -> Path:
    """Starts checkpointing `state` (collective in a multi-process run: every process
    calls it and writes its own shards); the step loop does not wait for the disk.

    **Returns:**

    The checkpoint's directory.
    """
    return checkpointer.save(state.step, state.tree(), metadata=metadata)


def load_state(
    directory: str | os.PathLike,
    like: TrainState,
    runtime: Runtime,
    say: Callable[..., None],
) -> tuple[TrainState, dict] | None:
    """Loads the latest good checkpoint, every process its own shards; in a
    multi-process run the processes agree on each checkpoint's verdict, so all
    restore the same step.

    **Arguments:**

    - `directory`: the checkpoint directory.
    - `like`: a state with the structure, shapes, dtypes and shardings to restore.
    - `runtime`: which process this is.
    - `say`: prints a message (on process 0).

    **Returns:**

    `(state, metadata)`, or `None` when `directory` holds no checkpoint (a fresh
    start). Raises [`moe_eqx.train.CheckpointError`][] when it holds checkpoints
    but none is good.
    """
    if not ckpt.list_checkpoints(directory):
        say(f"--resume: no checkpoint in {directory}. Starting from scratch.")
        return None
    step, tree, metadata = ckpt.load_latest(
        directory, like.tree(), agree=lambda ok: all_agree(ok, runtime)
    )
    state = TrainState(step, tree["params"], tree["opt_state"], tree["key"])
    return state, metadata


def schedule_steps(
    *,
    steps: int,
    lr: float,
    requested: int | None,
    start: int,
    metadata: dict[str, Any] | None,
    say: Callable[..., None],
) -> int:
    """The length of the learning-rate schedule of a (possibly resumed) run.

    A fresh run uses `requested` (`--schedule-steps`), else `steps`. A resumed run
    keeps the length stored in its checkpoint and says so when `--steps` differs;
    an explicit different `--schedule-steps`, or a different `--lr`, is obeyed with a
    warning quoting the learning rate's jump at the resumed step.

    **Arguments:**

    - `steps`, `lr`: this run's `--steps` and `--lr`.
    - `requested`: `--schedule-steps`, or `None`.
    - `start`: the step the run resumes at (0 for a fresh run).
    - `metadata`: the checkpoint's metadata, or `None` for a fresh run.
    - `say`: prints a message (on process 0).

    **Returns:**

    The schedule length to build the optimizer with.
    """
    stored = (metadata or {}).get("schedule_steps")
    if stored is None:
        return requested or steps
    chosen = stored if requested is None else requested
    stored_lr = metadata.get("lr", lr)
    before = float(make_schedule(stored_lr, stored)(start))
    after = float(make_schedule(lr, chosen)(start))
    if chosen != stored or lr != stored_lr:
        say(
            f"WARNING: the learning-rate schedule differs from the checkpoint's "
            f"({stored} steps, peak lr {stored_lr:g}; now {chosen} steps, peak lr "
            f"{lr:g}): at step {start} the learning rate jumps from {before:.3g} to "
            f"{after:.3g}."
        )
    elif steps != stored and start < steps:
        tail = (
            f"then stays at {0.1 * lr:.3g} until step {steps}"
            if steps > stored
            else f"this run stops at step {steps}, before it ends"
        )
        say(
            f"note: keeping the learning-rate schedule of the first run: warmup, then "
            f"cosine decay to {0.1 * lr:.3g} at step {stored}; {tail}. Pass "
            "--schedule-steps N to change its length (the learning rate then jumps)."
        )
    return chosen


def resume_command(prog: str, argv: list[str]) -> str:
    """The shell command that resumes the run started by `prog argv`: the same flags
    with `--resume` (and without the test-only failure flags)."""
    kept, skip = [], 0
    for arg in argv:
        if skip:
            skip -= 1
            continue
        name = arg.split("=", 1)[0]
        if name in _ONE_OFF_FLAGS:
            skip = _ONE_OFF_FLAGS[name] if "=" not in arg else 0
            continue
        kept.append(arg)
    if "--resume" not in kept:
        kept.append("--resume")
    return shlex.join([*shlex.split(prog), *kept])
