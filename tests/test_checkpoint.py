"""Checkpoints: roundtrip, atomic writes, corruption detection and fallback, and an
interrupted-then-resumed demo run that reaches the uninterrupted run's parameters."""

import json
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
    assert ckpt.read_manifest(tmp_path, 5)["metadata"] == {"note": "hi"}
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
    assert sorted(os.listdir(tmp_path)) == [
        "ckpt_0000000002.eqx", "ckpt_0000000002.json",
        "ckpt_0000000003.eqx", "ckpt_0000000003.json",
    ]  # fmt: skip
    step, loaded = load_checkpoint(tmp_path, _fresh_like(key))
    assert step == 3
    _assert_same(_state(jr.fold_in(key, 3)), loaded)


def test_crash_mid_write_leaves_the_previous_checkpoint(tmp_path, key, monkeypatch):
    good = _state(key)
    save_checkpoint(tmp_path, 1, good)
    real_replace = os.replace
    calls = []

    def crash_on_manifest(src, dst):
        calls.append(dst)
        # Everything reaching its final name has been fully written and fsynced.
        assert os.path.getsize(src) > 0
        if str(dst).endswith(".json"):
            raise OSError("simulated crash before the manifest is in place")
        return real_replace(src, dst)

    monkeypatch.setattr(ckpt.os, "replace", crash_on_manifest)
    with pytest.raises(OSError, match="simulated crash"):
        save_checkpoint(tmp_path, 2, _state(jr.fold_in(key, 2)))
    monkeypatch.setattr(ckpt.os, "replace", real_replace)
    assert [os.path.basename(c) for c in calls] == [
        "ckpt_0000000002.eqx",
        "ckpt_0000000002.json",
    ]
    # No temporary file is left behind, and the half-written step 2 is invisible.
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]
    assert ckpt.list_checkpoints(tmp_path) == [1]
    step, loaded = load_checkpoint(tmp_path, _fresh_like(key))
    assert step == 1
    _assert_same(good, loaded)


def test_truncated_or_corrupt_latest_falls_back(tmp_path, key, capsys):
    old, new = _state(key), _state(jr.fold_in(key, 1))
    save_checkpoint(tmp_path, 10, old)
    save_checkpoint(tmp_path, 20, new)
    payload = tmp_path / "ckpt_0000000020.eqx"
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
    with pytest.raises(CheckpointError, match="corrupt: sha256"):
        ckpt.read_checkpoint(tmp_path, 20, _fresh_like(key))
    assert load_checkpoint(tmp_path, _fresh_like(key))[0] == 10

    (tmp_path / "ckpt_0000000020.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="unreadable"):
        ckpt.read_checkpoint(tmp_path, 20, _fresh_like(key))
    assert load_checkpoint(tmp_path, _fresh_like(key))[0] == 10

    (tmp_path / "ckpt_0000000010.eqx").unlink()
    with pytest.raises(CheckpointError, match="no good checkpoint"):
        load_checkpoint(tmp_path, _fresh_like(key))


def test_mismatched_tree_and_empty_dir(tmp_path, key):
    with pytest.raises(CheckpointError, match="no checkpoint in"):
        load_checkpoint(tmp_path, _state(key))
    save_checkpoint(tmp_path, 1, {"w": jnp.zeros((3, 4))})
    with pytest.raises(
        CheckpointError, match=r"does not match the expected tree.*shape"
    ):
        ckpt.read_checkpoint(tmp_path, 1, {"w": jnp.zeros((4, 3))})
    with pytest.raises(ValueError, match="keep"):
        save_checkpoint(tmp_path, 2, {"w": jnp.zeros(3)}, keep=0)


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
    # Dies at the start of step 13: checkpoints of steps 8 and 12 remain (keep 2).
    proc = _demo(
        ["--ckpt-dir", str(ck), "--ckpt-every", "4", "--die-at-step", "13"],
        cache_dir,
        expect=17,
    )  # fmt: skip
    assert "exits abruptly at step 13" in proc.stdout
    assert ckpt.list_checkpoints(ck) == [8, 12]
    manifest = json.loads((ck / "ckpt_0000000012.json").read_text())
    assert manifest["metadata"]["data_step"] == 12

    # Resume from the latest (step 12).
    ck2 = tmp_path / "ck2"
    shutil.copytree(ck, ck2)
    resumed = tmp_path / "resumed.npz"
    proc = _demo(
        ["--ckpt-dir", str(ck2), "--resume", "--save-params", str(resumed)],
        cache_dir,
    )  # fmt: skip
    assert "resumed at step 12" in proc.stdout
    a, b = load_params(straight), load_params(resumed)
    assert a.keys() == b.keys() and len(a) > 5
    for k in a:  # same program, same inputs: bitwise
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)

    # Corrupt the latest: the demo warns and resumes from step 8, same result.
    payload = ck / "ckpt_0000000012.eqx"
    payload.write_bytes(payload.read_bytes()[:-100])
    fell_back = tmp_path / "fell_back.npz"
    proc = _demo(
        ["--ckpt-dir", str(ck), "--ckpt-every", "4", "--resume",
         "--save-params", str(fell_back)],
        cache_dir,
    )  # fmt: skip
    assert "WARNING: skipping checkpoint of step 12" in proc.stderr
    assert "truncated" in proc.stderr
    assert "resumed at step 8" in proc.stdout
    c = load_params(fell_back)
    for k in a:
        np.testing.assert_array_equal(a[k], c[k], err_msg=k)
    # The resumed run rewrote step 12 (atomically) and kept the last two.
    assert ckpt.list_checkpoints(ck) == [16, 20]
