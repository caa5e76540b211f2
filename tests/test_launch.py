"""Multi-process expert parallelism through `jax.distributed` (gloo over loopback):
2 processes x 4 CPU devices train like 1 process x 8 devices (losses within rtol 1e-5,
parameters within 1e-5); a process that dies makes the launcher fail fast, and a
restart from the last checkpoint reaches the uninterrupted run's parameters (bitwise
those of an uninterrupted 2-process run, with the experts split over both mesh axes
and each process restoring its own pieces); an
unreachable coordinator fails within a timeout; Ctrl-C says how to resume; gloo's
connection reports are not streamed.

Every subprocess is bounded by a timeout, so CI cannot hang here."""

import argparse
import json
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers import demo_env, load_params, run_module

from moe_eqx.train import checkpoint as ckpt
from moe_eqx.train.launch import build_parser, without_noise

# Worst-case buffers (`--buffer-factor none`) have no fallback branch, which halves
# the compile time of each process; the fallback itself is covered by test_demo.py.
TINY = [
    "--batch", "8", "--seq", "8", "--d-model", "16", "--d-ff", "16", "--heads", "2",
    "--experts", "8", "--top-k", "2", "--layers", "1", "--vocab", "32",
    "--dropout", "0.1", "--no-progress", "--strict-promotion", "--steps", "24",
    "--log-every", "4", "--buffer-factor", "none", "--num-slots", "0",
]  # fmt: skip


def _launch(demo_args, *, timeout=300):
    # No persistent compilation cache: multi-process CPU runs hang on a cached
    # executable (jax 0.10.2), and the demo disables it for them anyway.
    return run_module(
        "moe_eqx.launch",
        ["--processes", "2", "--devices-per-process", "4", "--timeout", "60",
         "--grace", "2", "--", *TINY, *demo_args],
        cache_dir=None,
        timeout=timeout,
    )  # fmt: skip


def _ok(proc):
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
    return proc


def _losses(path):
    history = json.loads(path.read_text())["history"]
    return np.array([x for e in history for x in e["losses"]])


@pytest.fixture(scope="module")
def single_process(tmp_path_factory, cache_dir):
    """1 process x 8 devices, uninterrupted."""
    d = tmp_path_factory.mktemp("single")
    _ok(
        run_module(
            "moe_eqx.demo",
            [*TINY, "--ep", "8", "--json", str(d / "h.json"),
             "--save-params", str(d / "p.npz")],
            cache_dir=cache_dir,
            timeout=300,
        )
    )  # fmt: skip
    return _losses(d / "h.json"), load_params(d / "p.npz")


@pytest.fixture(scope="module")
def crash_and_restart(tmp_path_factory):
    """2 processes x 4 devices; process 1 dies at the start of step 14, then the run
    is restarted from the last checkpoint (step 12)."""
    d = tmp_path_factory.mktemp("multi")
    ck = d / "ck"
    t0 = time.monotonic()
    died = _launch(
        ["--ckpt-dir", str(ck), "--ckpt-every", "6", "--die-at-step", "14",
         "--json", str(d / "died.json")],
    )  # fmt: skip
    died_s = time.monotonic() - t0
    checkpoints = ckpt.list_checkpoints(ck)
    resumed = _ok(
        _launch(
            ["--ckpt-dir", str(ck), "--resume", "--json", str(d / "resumed.json"),
             "--save-params", str(d / "p.npz")],
        )
    )  # fmt: skip
    return {
        "ck": ck,
        "died": died,
        "died_s": died_s,
        "checkpoints": checkpoints,
        "died_losses": _losses(d / "died.json"),
        "resumed": resumed,
        "resumed_losses": _losses(d / "resumed.json"),
        "params": load_params(d / "p.npz"),
    }


@pytest.mark.slow
def test_dead_process_fails_fast(crash_and_restart):
    died = crash_and_restart["died"]
    assert died.returncode != 0
    assert "[p1] [die-at-step] process 1 exits abruptly at step 14" in died.stdout
    assert "process 1 failed (exit code 17)" in died.stderr
    assert "FAILED" in died.stderr
    # Compiling and 14 steps, then at most --grace seconds to stop process 0.
    assert crash_and_restart["died_s"] < 240
    # Every process wrote its own shards (Orbax: one directory of data files per
    # process). Saves are asynchronous: step 12's, started two steps before the
    # crash, is normally complete; if not, the restart uses step 6.
    checkpoints = crash_and_restart["checkpoints"]
    assert checkpoints in ([6, 12], [6]), checkpoints
    latest = crash_and_restart["ck"] / str(checkpoints[-1])
    assert {p.name for p in latest.rglob("ocdbt.process_*")} == {
        "ocdbt.process_0",
        "ocdbt.process_1",
    }


@pytest.mark.slow
def test_two_processes_match_one_process(single_process, crash_and_restart):
    ref_losses, ref_params = single_process
    resumed = crash_and_restart["resumed"]
    out = resumed.stdout
    assert "[p0] moe_eqx demo" in out and "EP 8 over 2 process(es)" in out
    # Only process 0 logs (process 1's output is streamed too: see the dead process).
    assert "[p1] step" not in out and "[p0] step    24" in out
    start = crash_and_restart["checkpoints"][-1]
    assert f"[p0] resumed at step {start}" in out
    # Gloo's routine "[Gloo] Rank i is connected to 7 peer ranks" lines are dropped.
    assert "[Gloo]" not in out
    assert "all 2 process(es) finished" in resumed.stderr
    # Steps 0-11 logged before the crash (every 4 steps), the rest after the restart.
    assert len(crash_and_restart["died_losses"]) == 12
    losses = np.concatenate(
        [crash_and_restart["died_losses"][:start], crash_and_restart["resumed_losses"]]
    )
    assert len(losses) == 24
    # Same global program over the same 8 devices; only the collectives' transport
    # (gloo over loopback vs in-process) and so the summation order can differ.
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=0)
    # The restarted run reaches the uninterrupted run's parameters.
    params = crash_and_restart["params"]
    assert params.keys() == ref_params.keys()
    for k in params:
        np.testing.assert_allclose(
            params[k], ref_params[k], rtol=0, atol=1e-5, err_msg=k
        )


@pytest.mark.slow
def test_fsdp_across_processes_killed_and_resumed_is_bitwise(tmp_path):
    """2 processes x 4 devices as `--ep 4 --data 2 --fsdp`: the experts split over
    both mesh axes, so each process holds half of every expert shard. Killed at step
    10 and resumed from its Orbax checkpoint (each process restoring its own pieces),
    the run ends with bitwise the parameters of the uninterrupted run. (The
    expert-parallel run above is checked against one process, within the rounding
    of gloo's summation order; this is the bitwise check of a multi-process resume.)"""
    fsdp = ["--data", "2", "--fsdp", "--steps", "16"]
    straight = tmp_path / "straight.npz"
    proc = _ok(_launch([*fsdp, "--save-params", str(straight)]))
    assert "EP 4 x 2 data-parallel groups (experts split over them)" in proc.stdout
    ck = tmp_path / "ck"
    died = _launch([*fsdp, "--ckpt-dir", str(ck), "--ckpt-every", "4",
                    "--die-at-step", "10"])  # fmt: skip
    assert died.returncode != 0
    checkpoints = ckpt.list_checkpoints(ck)
    assert checkpoints in ([4, 8], [4]), checkpoints
    resumed = tmp_path / "resumed.npz"
    proc = _ok(
        _launch([*fsdp, "--ckpt-dir", str(ck), "--resume",
                 "--save-params", str(resumed)])
    )  # fmt: skip
    assert f"[p0] resumed at step {checkpoints[-1]}" in proc.stdout
    a, b = load_params(straight), load_params(resumed)
    assert a.keys() == b.keys() and len(a) > 5
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.mark.slow
def test_unreachable_coordinator_fails_within_timeout():
    # Only process 1 starts, so nobody hosts the coordinator.
    t0 = time.monotonic()
    proc = run_module(
        "moe_eqx.launch",
        ["--processes", "2", "--devices-per-process", "1", "--timeout", "3",
         "--only", "1", "--", "--steps", "1"],
        cache_dir=None,
        timeout=120,
    )  # fmt: skip
    took = time.monotonic() - t0
    assert proc.returncode != 0
    assert "could not register with the coordinator" in proc.stderr
    assert took < 90


def test_gloo_connection_reports_are_noise():
    ok = "[Gloo] Rank 3 is connected to 7 peer ranks. Expected number of connected "
    ok += "peer ranks is : 7"
    assert without_noise(ok) is None
    # Written into the middle of another line: the rest of the line stays.
    assert without_noise("resumed at step 12" + ok) == "resumed at step 12"
    # Two reports interleaved mid-word across two lines: both fragments go.
    tail = " peer ranks. Expected number of connected peer ranks is : 7"
    assert without_noise("[Gloo] Rank 7 is connected to 7[Gloo] Rank " + tail) is None
    assert without_noise("6 is connected to 7" + tail) is None
    # A rank with missing peers, and anything else, is shown.
    missing = ok.replace("to 7", "to 5")
    assert without_noise(missing) == missing
    assert without_noise("[Gloo] connect error: Connection refused") is not None
    assert without_noise("step    4  loss 3.2") == "step    4  loss 3.2"
    assert without_noise("") == ""


# `python -m moe_eqx.launch` as from a terminal: a test run started in the
# background (`cmd &` in a script) passes SIGINT on ignored, and Python then keeps it
# ignored, so the launcher is started with Python's own SIGINT handler.
_AS_FROM_A_TERMINAL = (
    "import runpy, signal, sys; signal.signal(signal.SIGINT, "
    "signal.default_int_handler); sys.argv[0] = 'moe_eqx.launch'; "
    "runpy.run_module('moe_eqx.launch', run_name='__main__', alter_sys=True)"
)


def test_ctrl_c_stops_the_processes_and_says_how_to_resume(tmp_path):
    # Only process 1 starts and waits for a coordinator that never comes: the
    # launcher is interrupted while its processes are up.
    ck = tmp_path / "ck"
    argv = ["--processes", "2", "--devices-per-process", "1", "--timeout", "60",
            "--grace", "2", "--only", "1", "--", "--steps", "3", "--ckpt-dir", str(ck),
            "--die-at-step", "2"]  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-c", _AS_FROM_A_TERMINAL, *argv],
        env=demo_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert "[launch] 1 of 2 process(es)" in proc.stderr.readline()
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    assert "interrupted (SIGINT/SIGTERM); stopping every process." in err
    resume = (
        "python -m moe_eqx.launch --processes 2 --devices-per-process 1 --timeout 60 "
        f"--grace 2 --only 1 -- --steps 3 --ckpt-dir {ck} --resume"
    )
    assert f"resume from the latest checkpoint in {ck}" in err
    assert f"with:\n  {resume}\n" in err


def test_every_launcher_flag_has_help():
    parser = build_parser()
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
            continue
        assert action.help and len(action.help) > 10, action.option_strings
