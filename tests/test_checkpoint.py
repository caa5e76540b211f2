"""Checkpoints (Orbax): roundtrip, asynchronous saves, keep-last-N, crash mid-write,
corruption detection and fallback, sharded restore, and an interrupted-then-resumed
demo run that reaches the uninterrupted run's parameters."""

import os
import shutil

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest
from helpers import load_params, run_module

from moe_eqx.train import (
    CheckpointError,
    checkpoint as ckpt,
    load_checkpoint,
    save_checkpoint,
)

TINY = [
    "--batch",
    "8",
    "--seq",
    "8",
    "--d-model",
    "16",
    "--d-ff",
    "16",
    "--heads",
    "2",
    "--experts",
    "8",
    "--top-k",
    "2",
    "--layers",
    "1",
    "--vocab",
    "32",
    "--dropout",
    "0.1",
    "--no-progress",
    "--strict-promotion",
    "--steps",
    "20",
]  # fmt: skip  (the flags of test_demo.py: the compiled program is cached)


def _state(key):
    model_key, data_key = jr.split(key)
    model = eqx.nn.MLP(4, 3, 8, 2, key=model_key)
    params = eqx.filter(model, eqx.is_array)
    opt = optax.adamw(1e-2)
    grads = jax.tree.map(lambda p: jr.normal(data_key, p.shape, p.dtype), params)
    # optax is not clean under the suite's strict dtype promotion.
    with jax.numpy_dtype_promotion("standard"):
        opt_state = opt.init(params)
        _, opt_state = opt.update(grads, opt_state, params)
    return {
        "model": model,
        "opt_state": opt_state,
        "key": jr.key(7),  # typed key
        "raw_key": jr.PRNGKey(8),  # uint32 key data
        "scale": np.float32(0.5),
    }


def _assert_same(a, b):
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb
    for x, y in zip(la, lb):
        if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            assert jnp.issubdtype(y.dtype, jax.dtypes.prng_key)
            x, y = jr.key_data(x), jr.key_data(y)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _fresh_like(key):
    return _state(jr.fold_in(key, 99))


def test_roundtrip(tmp_path, key):
    state = _state(key)
    save_checkpoint(tmp_path, 5, state, metadata={"note": "hi"})
    step, loaded = load_checkpoint(tmp_path, _fresh_like(key))
    assert step == 5
    _assert_same(state, loaded)
    # The restored key still works as a key.
    np.testing.assert_array_equal(
        jr.key_data(jr.split(loaded["key"])), jr.key_data(jr.split(state["key"]))
    )
    assert ckpt.read_metadata(tmp_path, 5) == {"note": "hi"}
    # Also against a like tree of shapes only.
    shapes = jax.tree.map(
        lambda x: (
            jax.ShapeDtypeStruct(x.shape, x.dtype) if isinstance(x, jax.Array) else x
        ),
        state,
    )
    _assert_same(state, ckpt.read_checkpoint(tmp_path, 5, shapes))


def test_keeps_the_last_two(tmp_path, key):
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, _state(jr.fold_in(key, step)))
    assert ckpt.list_checkpoints(tmp_path) == [2, 3]
    assert sorted(os.listdir(tmp_path)) == ["2", "3"]
    step, loaded = load_checkpoint(tmp_path, _fresh_like(key))
    assert step == 3
    _assert_same(_state(jr.fold_in(key, 3)), loaded)


def test_saving_is_asynchronous(tmp_path, key, monkeypatch):
    """`Checkpointer.save` returns while the checkpoint is still being written: with
    Orbax's final rename held back, the save has returned and the step is not yet
    listed; once released, `wait` completes it (a synchronous save would have
    waited for the rename: the step would be listed when `save` returned)."""
    import asyncio
    import threading

    from orbax.checkpoint._src.path import async_path

    release = threading.Event()
    real_rename = async_path.rename

    async def held_rename(src, dst):
        await asyncio.to_thread(release.wait, 30)
        return await real_rename(src, dst)

    monkeypatch.setattr(async_path, "rename", held_rename)
    checkpointer = ckpt.Checkpointer(tmp_path, keep=2)
    state = _state(key)
    checkpointer.save(1, state)
    assert ckpt.list_checkpoints(tmp_path) == []
    release.set()
    checkpointer.wait()
    assert ckpt.list_checkpoints(tmp_path) == [1]
    checkpointer.close()
    _assert_same(state, load_checkpoint(tmp_path, _fresh_like(key))[1])


def test_crash_mid_write_leaves_the_previous_checkpoint(tmp_path, key, monkeypatch):
    """A save that dies before Orbax renames its temporary directory into place is
    invisible: the previous checkpoint is the latest."""
    from orbax.checkpoint._src.path import async_path

    good = _state(key)
    save_checkpoint(tmp_path, 1, good)

    async def crash(src, dst):
        raise OSError("simulated crash before the checkpoint is in place")

    monkeypatch.setattr(async_path, "rename", crash)
    with pytest.raises(OSError, match="simulated crash"):
        save_checkpoint(tmp_path, 2, _state(jr.fold_in(key, 2)))
    monkeypatch.undo()
    assert ckpt.list_checkpoints(tmp_path) == [1]
    step, loaded = load_checkpoint(tmp_path, _fresh_like(key))
    assert step == 1
    _assert_same(good, loaded)


def _largest_file(step_dir):
    files = [
        p for p in step_dir.rglob("*") if p.is_file() and "checksums" not in p.name
    ]
    return max(files, key=lambda p: p.stat().st_size)


def test_truncated_or_corrupt_latest_falls_back(tmp_path, key, capsys):
    """Orbax restores a flipped byte silently (measured): the checksums written
    after each save catch it, and a truncated or missing file too; the previous
    good checkpoint is used."""
    old, new = _state(key), _state(jr.fold_in(key, 1))
    save_checkpoint(tmp_path, 10, old)
    save_checkpoint(tmp_path, 20, new)
    payload = _largest_file(tmp_path / "20")
    data = payload.read_bytes()

    payload.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        ckpt.read_checkpoint(tmp_path, 20, _fresh_like(key))
    step, loaded = load_checkpoint(tmp_path, _fresh_like(key))
    assert step == 10
    _assert_same(old, loaded)
    err = capsys.readouterr().err
    assert "WARNING: skipping checkpoint of step 20" in err
    assert "previous good checkpoint (step 10)" in err

    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0xFF
    payload.write_bytes(bytes(flipped))
    with pytest.raises(CheckpointError, match="corrupt: its sha256"):
        ckpt.read_checkpoint(tmp_path, 20, _fresh_like(key))
    assert load_checkpoint(tmp_path, _fresh_like(key))[0] == 10

    payload.unlink()
    with pytest.raises(CheckpointError, match="is missing"):
        ckpt.read_checkpoint(tmp_path, 20, _fresh_like(key))
    assert load_checkpoint(tmp_path, _fresh_like(key))[0] == 10

    _largest_file(tmp_path / "10").unlink()
    with pytest.raises(CheckpointError, match="no good checkpoint"):
        load_checkpoint(tmp_path, _fresh_like(key))


def test_mismatched_tree_and_empty_dir(tmp_path, key):
    with pytest.raises(CheckpointError, match="no checkpoint in"):
        load_checkpoint(tmp_path, _state(key))
    save_checkpoint(tmp_path, 1, {"w": jnp.zeros((3, 4))})
    with pytest.raises(CheckpointError, match="does not match the expected tree"):
        ckpt.read_checkpoint(tmp_path, 1, {"w": jnp.zeros((4, 3))})
    with pytest.raises(ValueError, match="keep"):
        save_checkpoint(tmp_path, 2, {"w": jnp.zeros(3)}, keep=0)


def test_sharded_arrays_restore_onto_their_sharding(tmp_path, key):
    """Experts split over a mesh are saved as they are (not gathered) and come back
    split the same way, from the like tree's shardings."""
    m = jax.make_mesh((4,), ("expert",), devices=jax.devices("cpu")[:4])
    sharding = jax.NamedSharding(m, jax.P("expert"))
    w = jax.device_put(jr.normal(key, (8, 3)), sharding)
    save_checkpoint(tmp_path, 1, {"w": w})
    like = {"w": jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=sharding)}
    loaded = ckpt.read_checkpoint(tmp_path, 1, like)["w"]
    assert loaded.sharding == sharding
    np.testing.assert_array_equal(loaded, w)


# ---- the demo: interrupted + resumed == uninterrupted


def _demo(args, cache_dir, *, expect=0, timeout=180):
    return run_module(
        "moe_eqx.demo",
        [*TINY, *args],
        cache_dir=cache_dir,
        timeout=timeout,
        expect=expect,
    )


def test_demo_resume_matches_uninterrupted_run(tmp_path, cache_dir):
    straight = tmp_path / "straight.npz"
    _demo(["--save-params", str(straight)], cache_dir)
    ck = tmp_path / "ck"
    # Dies at the start of step 13. Saves are asynchronous: the checkpoint of step
    # 12, started just before, may not have reached the disk (its temporary
    # directory is then ignored); the complete ones remain (keep 2).
    proc = _demo(
        ["--ckpt-dir", str(ck), "--ckpt-every", "4", "--die-at-step", "13"],
        cache_dir,
        expect=17,
    )  # fmt: skip
    assert "exits abruptly at step 13" in proc.stdout
    steps = ckpt.list_checkpoints(ck)
    assert steps in ([8, 12], [4, 8]), steps
    latest = steps[-1]
    assert ckpt.read_metadata(ck, latest)["data_step"] == latest

    # Resume from the latest complete checkpoint.
    ck2 = tmp_path / "ck2"
    shutil.copytree(ck, ck2)
    resumed = tmp_path / "resumed.npz"
    proc = _demo(
        ["--ckpt-dir", str(ck2), "--resume", "--save-params", str(resumed)],
        cache_dir,
    )  # fmt: skip
    assert f"resumed at step {latest}" in proc.stdout
    a, b = load_params(straight), load_params(resumed)
    assert a.keys() == b.keys() and len(a) > 5
    for k in a:  # same program, same inputs: bitwise
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)

    # Truncate a file of the latest: the demo warns and resumes from the one
    # before, same result.
    payload = _largest_file(ck / str(latest))
    payload.write_bytes(payload.read_bytes()[:-100])
    fell_back = tmp_path / "fell_back.npz"
    proc = _demo(
        ["--ckpt-dir", str(ck), "--ckpt-every", "4", "--resume",
         "--save-params", str(fell_back)],
        cache_dir,
    )  # fmt: skip
    assert f"WARNING: skipping checkpoint of step {latest}" in proc.stderr
    assert "truncated" in proc.stderr
    assert f"resumed at step {steps[-2]}" in proc.stdout
    c = load_params(fell_back)
    for k in a:
        np.testing.assert_array_equal(a[k], c[k], err_msg=k)
    # The resumed run rewrote its later steps and kept the last two.
    assert ckpt.list_checkpoints(ck) == [16, 20]
