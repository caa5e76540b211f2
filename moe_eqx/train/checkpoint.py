"""Checkpoints of training state (model, optimizer state, key) with Orbax.

A checkpoint directory holds one Orbax step directory per checkpoint
(`<dir>/<step>/`), written by `orbax.checkpoint.CheckpointManager`:

- every process writes and reads only the shards of its own devices (arrays sharded
  over a multi-process mesh are never gathered);
- saving is asynchronous ([`Checkpointer.save`][moe_eqx.train.checkpoint.Checkpointer]
  returns once the arrays are copied off the devices; the disk writes overlap the next
  training steps);
- the last `keep` checkpoints are kept;
- a step directory is renamed into place only once complete, so a crash mid-write
  leaves the previous checkpoints as they were.

Orbax does not checksum its data files, and a flipped byte would restore silently
wrong values; so once a save is complete, each process writes the sha256 of the files
it wrote (`moe_eqx_checksums.process_<i>.json`), and a restore checks them first: a
truncated, altered or missing file is a [`CheckpointError`][moe_eqx.train.CheckpointError]
naming it, and [`load_checkpoint`][moe_eqx.train.load_checkpoint] falls back to the
previous good checkpoint.
"""

import hashlib
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jaxtyping import PyTree

_CHECKSUMS = "moe_eqx_checksums.process_{}.json"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, truncated, corrupt, or does not match the expected tree."""


def _is_key(x: Any) -> bool:
    return isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _is_key_like(x: Any) -> bool:
    return _is_key(x) or (
        isinstance(x, jax.ShapeDtypeStruct)
        and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)
    )


def _host_local(x: Any) -> bool:
    """An array of this process alone in a multi-process run (Orbax saves those as
    NumPy, from one process)."""
    return jax.process_count() > 1 and x.is_fully_addressable


def _is_stored(x: Any) -> bool:
    """Arrays and numbers are stored; other leaves (functions, strings...) come from
    the like tree on load."""
    return isinstance(x, jax.Array | np.ndarray | np.generic | bool | int | float)


def _saveable(x: Any) -> Any:
    if _is_key(x):
        x = jax.random.key_data(x)
    if isinstance(x, jax.Array):
        return np.asarray(x) if _host_local(x) else x
    return np.asarray(x)


def _flat(tree: PyTree, fn) -> dict[str, Any]:
    """The stored leaves of `tree` by their index in its flattening, through `fn`:
    Orbax sees one flat dict of arrays."""
    return {
        f"{i:06d}": fn(leaf)
        for i, leaf in enumerate(jax.tree.leaves(tree))
        if _is_stored(leaf) or isinstance(leaf, jax.ShapeDtypeStruct)
    }


def _target(like: Any) -> Any:
    """What Orbax restores a leaf as: a `ShapeDtypeStruct` with the like leaf's
    sharding (each process reads its own shards), or a NumPy array."""
    if isinstance(like, jax.Array | jax.ShapeDtypeStruct):
        sharding = getattr(like, "sharding", None)
        if _is_key_like(like):  # stored as its key data, sharded as the key
            like = jax.eval_shape(jax.random.key_data, like)
        if sharding is None or (
            jax.process_count() > 1 and sharding.is_fully_addressable
        ):
            return np.zeros(like.shape, like.dtype)
        return jax.ShapeDtypeStruct(like.shape, like.dtype, sharding=sharding)
    return np.asarray(like)


def list_checkpoints(directory: str | os.PathLike) -> list[int]:
    """Steps of the complete checkpoints in `directory`, oldest first.

    **Arguments:**

    - `directory`: the checkpoint directory (need not exist).

    **Returns:**

    A sorted list of steps; empty when there is none. (An incomplete save is a
    temporary directory Orbax never renamed into place: not listed.)
    """
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(
        int(e.name) for e in directory.iterdir() if e.is_dir() and e.name.isdigit()
    )


def _own_files(step_dir: Path, process: int) -> list[Path]:
    """The files of a step directory that `process` wrote: its `ocdbt.process_<i>`
    shard files, and for process 0 everything outside the per-process directories."""
    files = []
    for path in sorted(step_dir.rglob("*")):
        if not path.is_file() or path.name.startswith("moe_eqx_checksums."):
            continue
        parts = path.relative_to(step_dir).parts
        owner = next(
            (int(p.rsplit("_", 1)[1]) for p in parts if p.startswith("ocdbt.process_")),
            None,
        )
        if owner == process or (owner is None and process == 0):
            files.append(path)
    return files


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _write_checksums(step_dir: Path) -> None:
    process = jax.process_index()
    sums = {
        str(p.relative_to(step_dir)): [p.stat().st_size, _sha256(p)]
        for p in _own_files(step_dir, process)
    }
    path = step_dir / _CHECKSUMS.format(process)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(sums, indent=0))
    os.replace(tmp, path)


def _verify(step_dir: Path) -> None:
    """Checks the files listed in this process's checksums (all processes' when the
    checkpoint was written by another number of processes)."""
    mine = step_dir / _CHECKSUMS.format(jax.process_index())
    lists = [mine] if mine.exists() else sorted(step_dir.glob(_CHECKSUMS.format("*")))
    if jax.process_index() != 0 and (step_dir / _CHECKSUMS.format(0)).exists():
        lists.append(step_dir / _CHECKSUMS.format(0))  # the files every process reads
    if not lists:
        print(
            f"WARNING: checkpoint {step_dir} has no checksums (interrupted right after "
            "it was written?); restoring it unverified.",
            file=sys.stderr,
            flush=True,
        )
        return
    for listing in dict.fromkeys(lists):
        try:
            sums = json.loads(listing.read_text())
        except (OSError, ValueError) as e:
            raise CheckpointError(f"checksums {listing} are unreadable: {e}") from e
        for name, (size, digest) in sums.items():
            path = step_dir / name
            if not path.exists():
                raise CheckpointError(f"checkpoint file {path} is missing.")
            if path.stat().st_size != size:
                raise CheckpointError(
                    f"checkpoint file {path} is truncated or altered: "
                    f"{path.stat().st_size} bytes, {size} were written."
                )
            if _sha256(path) != digest:
                raise CheckpointError(
                    f"checkpoint file {path} is corrupt: its sha256 does not match "
                    "the one recorded when it was written."
                )


class Checkpointer:
    """Asynchronous, multi-process checkpoints of one directory (an Orbax
    `CheckpointManager`).

    In a multi-process run every process creates one and calls each method, in the
    same order.

    **Arguments:**

    - `directory`: the checkpoint directory (created if missing).
    - `keep`: how many most recent checkpoints to keep (>= 1).
    - `async_save`: return from `save` before the files are written.
    """

    def __init__(
        self, directory: str | os.PathLike, *, keep: int = 2, async_save: bool = True
    ):
        if keep < 1:
            raise ValueError(f"`keep` must be >= 1, got {keep}.")
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=async_save, create=True
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options)
        self._pending: int | None = None

    def save(self, step: int, tree: PyTree, *, metadata: dict | None = None) -> Path:
        """Starts writing `tree` as the checkpoint of `step` and returns its
        directory (complete once [`wait`][moe_eqx.train.checkpoint.Checkpointer.wait]
        or the next `save` returns).

        **Arguments:**

        - `step`: the step the state belongs to (the step to resume from).
        - `tree`: any PyTree of arrays (model, optimizer state, typed or raw PRNG
            keys); arrays sharded over the processes' devices stay so.
        - `metadata`: JSON-serialisable extra information.
        """
        if step < 0:
            raise ValueError(f"`step` must be >= 0, got {step}.")
        self._finish()
        if step in self._manager.all_steps():
            # A checkpoint of a run resumed from an earlier one (or one that did not
            # check out): replaced.
            self._manager.delete(step)
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(_flat(tree, _saveable)),
            metadata=ocp.args.JsonSave(metadata or {}),
        )
        self._manager.save(step, args=args, force=True)
        self._pending = step
        return self.directory / str(step)

    def _finish(self) -> None:
        if self._pending is None:
            return
        self._manager.wait_until_finished()
        step, self._pending = self._pending, None
        step_dir = self.directory / str(step)
        if step_dir.is_dir():
            _write_checksums(step_dir)

    def wait(self) -> None:
        """Waits until the last save is on disk (and checksummed)."""
        self._finish()

    def poll(self) -> None:
        """Checksums the last save if it has reached the disk; never waits (call it
        between steps, so that a crash soon after a save leaves it verifiable)."""
        if self._pending is not None and not self._manager.is_saving_in_progress():
            self._finish()

    def restore(
        self, step: int, like_tree: PyTree, *, verify: bool = True
    ) -> tuple[PyTree, dict]:
        """`(tree, metadata)` of the checkpoint of `step` (its checksums checked
        first unless `verify=False`); see
        [`read_checkpoint`][moe_eqx.train.read_checkpoint]."""
        self._finish()
        step_dir = self.directory / str(step)
        if not step_dir.is_dir():
            raise CheckpointError(f"checkpoint {step_dir} does not exist.")
        if verify:
            _verify(step_dir)
        targets = _flat(like_tree, _target)
        args = ocp.args.Composite(
            state=ocp.args.StandardRestore(targets), metadata=ocp.args.JsonRestore()
        )
        try:
            out = self._manager.restore(step, args=args)
        except Exception as e:  # Orbax and TensorStore raise many kinds
            raise CheckpointError(
                f"checkpoint {step_dir} does not match the expected tree or cannot be "
                f"read: {type(e).__name__}: {str(e)[:500]}"
            ) from e
        paths, treedef = jax.tree_util.tree_flatten_with_path(like_tree)
        if set(out.state) != set(targets):
            raise CheckpointError(f"checkpoint {step_dir} has a different tree.")
        leaves = [
            _check_like(
                out.state[f"{i:06d}"],
                like,
                f"checkpoint {step_dir}, {jax.tree_util.keystr(kp)}",
            )
            if f"{i:06d}" in targets
            else like
            for i, (kp, like) in enumerate(paths)
        ]
        return jax.tree.unflatten(treedef, leaves), dict(out.metadata or {})

    def close(self) -> None:
        """Waits for the last save and releases the manager."""
        self._finish()
        self._manager.close()


def _check_like(loaded: Any, like: Any, where: str) -> Any:
    if isinstance(like, bool | int | float):
        return type(like)(np.asarray(loaded))
    if _is_key_like(like):
        impl = jax.random.key_impl(like) if isinstance(like, jax.Array) else None
        want = jax.eval_shape(jax.random.key_data, like).shape
        if tuple(loaded.shape) != tuple(want):
            raise CheckpointError(
                f"{where}: PRNG key data has shape {tuple(loaded.shape)}, expected "
                f"{tuple(want)}."
            )
        sharding = getattr(like, "sharding", None)
        if isinstance(loaded, np.ndarray):
            loaded = (
                jnp.asarray(loaded)
                if sharding is None
                else (jax.device_put(loaded, sharding))
            )
        return jax.random.wrap_key_data(loaded, impl=impl)
    if tuple(loaded.shape) != tuple(like.shape) or loaded.dtype != like.dtype:
        raise CheckpointError(
            f"{where}: leaf has shape {tuple(loaded.shape)} and dtype {loaded.dtype}, "
            f"expected {tuple(like.shape)} and {like.dtype} (was the checkpoint "
            "written by a different model configuration?)."
        )
    if isinstance(like, np.ndarray | np.generic):
        return np.asarray(loaded)
    sharding = getattr(like, "sharding", None)
    if isinstance(loaded, np.ndarray) and sharding is not None:
        return jax.device_put(loaded, sharding)  # this process's own array
    return loaded


def save_checkpoint(
    directory: str | os.PathLike,
    step: int,
    tree: PyTree,
    *,
    keep: int = 2,
    metadata: dict | None = None,
) -> Path:
    """Writes `tree` as the checkpoint of `step` and waits until it is on disk (a
    [`Checkpointer`][moe_eqx.train.checkpoint.Checkpointer] saves without waiting).

    **Arguments:**

    - `directory`: the checkpoint directory (created if missing).
    - `step`: the step the state belongs to.
    - `tree`: any PyTree of arrays (sharded ones stay sharded).
    - `keep`: how many most recent checkpoints to keep (>= 1).
    - `metadata`: JSON-serialisable extra information.

    **Returns:**

    The checkpoint's directory.
    """
    checkpointer = Checkpointer(directory, keep=keep, async_save=False)
    try:
        return checkpointer.save(step, tree, metadata=metadata)
    finally:
        checkpointer.close()


def read_checkpoint(
    directory: str | os.PathLike, step: int, like_tree: PyTree
) -> PyTree:
    """Loads one checkpoint: checks its files' checksums, then restores each array
    with the sharding of `like_tree`'s leaf (each process reading its own shards).

    **Arguments:**

    - `directory`: the checkpoint directory.
    - `step`: which checkpoint.
    - `like_tree`: a PyTree with the structure, shapes and dtypes of the saved one
        (arrays or `jax.ShapeDtypeStruct`s, whose shardings the arrays get); its
        non-array leaves are kept.

    **Returns:**

    The loaded tree (NumPy arrays where `like_tree` has NumPy arrays).

    **Raises:**

    `CheckpointError` with the reason when the checkpoint is missing, truncated,
    corrupt or does not match `like_tree`.
    """
    return _open(directory).restore(step, like_tree)[0]


def read_metadata(directory: str | os.PathLike, step: int) -> dict:
    """The metadata saved with the checkpoint of `step`."""
    checkpointer = _open(directory)
    args = ocp.args.Composite(metadata=ocp.args.JsonRestore())
    try:
        return dict(checkpointer._manager.restore(step, args=args).metadata or {})
    except Exception as e:  # Orbax raises many kinds
        raise CheckpointError(
            f"checkpoint {directory}/{step} has no readable metadata: {e}"
        ) from e
    finally:
        checkpointer.close()


def _open(directory) -> Checkpointer:
    directory = Path(directory)
    if not list_checkpoints(directory):
        raise CheckpointError(f"no checkpoint in {directory}.")
    return Checkpointer(directory, async_save=False, keep=1 << 30)


def load_checkpoint(
    directory: str | os.PathLike,
    like_tree: PyTree,
    *,
    agree: Callable[[bool], bool] = bool,
) -> tuple[int, PyTree]:
    """Loads the most recent good checkpoint in `directory`.

    If the latest checkpoint is truncated, corrupt or unreadable, prints a warning to
    stderr and falls back to the previous one, and so on.

    **Arguments:**

    - `directory`: the checkpoint directory.
    - `like_tree`: a PyTree with the structure, shapes, dtypes (and shardings) of the
        saved one.
    - `agree`: in a multi-process run, combines each process's "this checkpoint
        checked out" into the verdict all of them act on (e.g. an all-reduce of
        `min`), so that every process restores the same step.

    **Returns:**

    `(step, tree)`.

    **Raises:**

    `CheckpointError` when the directory holds no checkpoint, or none is good (the
    message lists why each one was rejected).
    """
    step, tree, _ = load_latest(directory, like_tree, agree=agree)
    return step, tree


def load_latest(
    directory: str | os.PathLike,
    like_tree: PyTree,
    *,
    agree: Callable[[bool], bool] = bool,
) -> tuple[int, PyTree, dict]:
    """[`load_checkpoint`][moe_eqx.train.load_checkpoint], with the checkpoint's
    metadata: `(step, tree, metadata)`."""
    checkpointer = _open(directory)
    reasons = []
    try:
        for step in reversed(list_checkpoints(directory)):
            reason = None
            try:
                _verify(Path(directory) / str(step))
            except CheckpointError as e:
                reason = str(e)
            if agree(reason is None):
                try:
                    tree, metadata = checkpointer.restore(step, like_tree, verify=False)
                except CheckpointError as e:
                    reason = str(e)
                if agree(reason is None):
                    if reasons:
                        print(
                            "WARNING: resuming from the previous good checkpoint "
                            f"(step {step}).",
                            file=sys.stderr,
                            flush=True,
                        )
                    return step, tree, metadata
            reason = reason or "another process could not read it"
            reasons.append(f"step {step}: {reason}")
            print(
                f"WARNING: skipping checkpoint of step {step}: {reason}",
                file=sys.stderr,
                flush=True,
            )
    finally:
        checkpointer.close()
    raise CheckpointError(
        f"no good checkpoint in {directory}:\n  " + "\n  ".join(reasons)
    )
