"""The demo trains (one device and expert-parallel), and its skew phase triggers the
dropless fallback. The demo runs in subprocesses (it sets up its own devices), each
bounded by a timeout; a per-module persistent compilation cache lets runs with the same
shapes skip recompiling."""

import json
import math
import subprocess

import numpy as np
import pytest
from helpers import run_module

from moe_eqx._data import ZipfMarkovData

TINY = [
    "--batch", "8", "--seq", "8", "--d-model", "16", "--d-ff", "16", "--heads", "2",
    "--experts", "8", "--top-k", "2", "--layers", "1", "--vocab", "32",
    "--dropout", "0.1", "--no-progress", "--strict-promotion",
]  # fmt: skip


def run_demo(args, cache_dir, *, timeout=180) -> subprocess.CompletedProcess:
    return run_module(
        "moe_eqx.demo", args, cache_dir=cache_dir, timeout=timeout, expect=0
    )


def _losses(history):
    return [x for entry in history for x in entry["losses"]]


STEPS = "20"  # same flags (hence programs, cached) as in test_checkpoint.py


def test_single_device_loss_decreases(tmp_path, cache_dir):
    out = tmp_path / "h.json"
    proc = run_demo(
        [*TINY, "--steps", STEPS, "--log-every", "5", "--json", str(out)], cache_dir
    )
    assert "done: final loss" in proc.stdout
    result = json.loads(out.read_text())
    losses = _losses(result["history"])
    assert len(losses) == 20
    assert all(math.isfinite(x) for x in losses)
    first, last = result["history"][0]["loss"], result["history"][-1]["loss"]
    # Starts near log(vocab) = 3.47 and must visibly learn within 20 steps.
    assert first > 3.0
    assert last < first - 0.3, (first, last)
    assert result["summary"]["ep"] == 1
    assert result["summary"]["fallback_steps"] == 0


def test_expert_parallel_skew_phase_triggers_fallback(tmp_path, cache_dir):
    out = tmp_path / "h.json"
    proc = run_demo(
        [*TINY, "--ep", "8", "--steps", "24", "--log-every", "4",
         "--skew-from", "12", "--skew-to", "16", "--json", str(out)],
        cache_dir,
    )  # fmt: skip
    result = json.loads(out.read_text())
    history = result["history"]
    assert result["summary"]["ep"] == 8
    assert result["summary"]["devices"] == 8
    losses = _losses(history)
    assert len(losses) == 24 and all(math.isfinite(x) for x in losses)
    # Learning before the skew phase (intervals of 4 steps: [0, 4) vs [8, 12)).
    assert history[2]["loss"] < history[0]["loss"] - 0.2, history
    # During the skew phase every token picks shard 0's expert (and one other): shard 0
    # receives 4x the balanced load > buffer_factor 2, so every skew step falls back,
    # dropless.
    skew = [e for e in history if e["skew_steps"]]
    assert [e["step"] for e in skew] == [16]
    assert skew[0]["fallback_steps"] == 4
    assert skew[0]["overflow_steps"] == 4
    assert skew[0]["required_buffer_factor"] > 2.0
    assert skew[0]["max_over_mean_before"] == pytest.approx(4.0)
    assert all(e["dropped_pairs"] == 0 for e in history)
    assert "chunked dropless fallback in use" in proc.stdout
    assert "back on the capped path" in proc.stdout
    assert result["summary"]["fallback_steps"] == sum(
        e["fallback_steps"] for e in history
    )


def test_bad_flags_fail_cleanly(cache_dir):
    proc = run_module(
        "moe_eqx.demo",
        [*TINY, "--ep", "3", "--steps", "1"],
        cache_dir=cache_dir,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "--experts (8) must be divisible by --ep (3)" in proc.stderr


def test_data_is_a_pure_function_of_seed_and_step():
    state = np.random.get_state()[1].copy()
    data = ZipfMarkovData(64, seed=3)
    a = data.batch(7, 6, 10)
    assert a.shape == (6, 11) and a.dtype == np.int32
    assert a.min() >= 0 and a.max() < 64
    np.testing.assert_array_equal(a, ZipfMarkovData(64, seed=3).batch(7, 6, 10))
    # Any process can generate exactly its own rows of the global batch.
    np.testing.assert_array_equal(a[2:5], data.rows(7, range(2, 5), 10))
    assert not np.array_equal(a, data.batch(8, 6, 10))
    assert not np.array_equal(a, ZipfMarkovData(64, seed=4).batch(7, 6, 10))
    # The deterministic successor structure is there to be learnt.
    follows = np.mean(data.successor[a[:, :-1]] == a[:, 1:])
    assert follows > 0.5
    skew = data.batch(7, 6, 10, skew=True)
    assert set(np.unique(skew)) <= set(data.skew_tokens.tolist())
    assert 0 < data.entropy_floor() < math.log(64)
    # Never the global NumPy RNG.
    np.testing.assert_array_equal(np.random.get_state()[1], state)
