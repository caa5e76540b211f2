"""The demo trains (one device and expert-parallel), its skew phase triggers the
dropless fallback, its defaults show deduplication and duplication, Ctrl-C checkpoints
and says how to resume, a finished run says it is complete, and bad flags are usage
errors. The demo runs in subprocesses (it sets up its own devices), each bounded by a
timeout; a per-module persistent compilation cache lets runs with the same shapes skip
recompiling."""

import argparse
import json
import math
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import demo_env, load_params, run_module

from moe_eqx.train import cli, list_checkpoints
from moe_eqx.train.data import ZipfMarkovData
from moe_eqx.train.launch import build_parser as launch_parser
from moe_eqx.train.resume import resume_command, schedule_steps

TINY = [
    "--batch", "8", "--seq", "8", "--d-model", "16", "--d-ff", "16", "--heads", "2",
    "--experts", "8", "--top-k", "2", "--layers", "1", "--vocab", "32",
    "--dropout", "0.1", "--no-progress", "--strict-promotion",
]  # fmt: skip

# The model's size flags only: the layer's defaults (experts, top-k, slots) stay.
TINY_WIDTHS = [
    "--batch", "8", "--seq", "8", "--d-model", "16", "--d-ff", "16", "--heads", "2",
    "--layers", "1", "--vocab", "32", "--no-progress", "--strict-promotion",
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
    assert result["summary"]["dropped_pairs"] == 0


def test_expert_parallel_skew_phase_triggers_fallback(tmp_path, cache_dir):
    out = tmp_path / "h.json"
    proc = run_demo(
        [*TINY, "--ep", "8", "--steps", "24", "--log-every", "4", "--num-slots", "0",
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


def test_expert_parallel_defaults_show_dedup_and_duplication(tmp_path, cache_dir):
    # The default layer (32 experts, top-4, one spare slot per shard with --ep) on 8
    # shards: 4 experts per shard, so tokens hit several experts of one shard and are
    # sent once; in the skew phase every token picks shard 0's 4 experts, and the
    # replicas in the other shards' slots take that load.
    out = tmp_path / "h.json"
    proc = run_demo(
        [*TINY_WIDTHS, "--ep", "8", "--steps", "8", "--log-every", "4",
         "--skew-from", "4", "--skew-to", "8", "--json", str(out)],
        cache_dir,
    )  # fmt: skip
    result = json.loads(out.read_text())
    assert result["args"]["num_slots"] == 1
    assert (result["args"]["experts"], result["args"]["top_k"]) == (32, 4)
    balanced, skewed = result["history"]
    assert skewed["skew_steps"] == 4 and balanced["skew_steps"] == 0
    # Deduplication saves wire rows on balanced routing ...
    assert balanced["dedup_ratio"] < 0.95, balanced
    assert "dedup 0." in proc.stdout
    # ... and duplication flattens the skew: shard 0 would get every pair (8x the
    # balanced load); after the plan, no shard gets more than twice its share.
    assert skewed["max_over_mean_before"] == pytest.approx(8.0)
    assert skewed["max_over_mean"] < 2.0, skewed
    # Nothing lost: no pair dropped, no non-finite loss.
    assert all(e["dropped_pairs"] == 0 for e in result["history"])
    assert result["summary"]["dropped_pairs"] == 0
    assert all(math.isfinite(x) for x in _losses(result["history"]))


def test_rebalance_every_re_places_hot_experts(tmp_path, cache_dir):
    # No spare slots, so the rank load is the home placement's alone. In the skew
    # phase every token picks shard 0's 4 experts (8x the balanced load); the
    # re-placement at step 8, from steps 4-7's load, spreads them over 4 shards
    # (2x at best with 4 hot experts on 8 shards; the re-placement at step 4 from a
    # balanced window leaves at least 2 of them together). A resumed run keeps the placement.
    out, ck = tmp_path / "h.json", tmp_path / "ck"
    common = [*TINY_WIDTHS, "--ep", "8", "--num-slots", "0", "--log-every", "4",
              "--skew-from", "4", "--skew-to", "16", "--rebalance-every", "4",
              "--ckpt-dir", str(ck)]  # fmt: skip
    proc = run_demo([*common, "--steps", "12", "--json", str(out)], cache_dir)
    assert "step 4: re-placed experts" in proc.stdout  # balanced window: little moves
    assert "step 8: re-placed experts" in proc.stdout, proc.stdout
    skewed = re.search(
        r"step 8: re-placed .* home max/mean ([\d.]+) -> ([\d.]+)", proc.stdout
    )
    assert float(skewed[1]) >= 4.0 and float(skewed[2]) == 2.0, proc.stdout
    history = json.loads(out.read_text())["history"]
    assert history[1]["max_over_mean_before"] >= 4.0
    assert history[2]["max_over_mean_before"] == pytest.approx(2.0)
    assert history[2]["max_over_mean"] == pytest.approx(2.0)
    assert all(e["dropped_pairs"] == 0 for e in history)
    losses = _losses(history)
    assert all(math.isfinite(x) for x in losses)
    # Resumed from step 12's checkpoint: the placement came back with it.
    proc = run_demo(
        [*common, "--steps", "16", "--resume", "--json", str(out)], cache_dir
    )
    (entry,) = json.loads(out.read_text())["history"]
    assert entry["max_over_mean_before"] == pytest.approx(2.0), proc.stdout


def _start_demo(args, cache_dir) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "moe_eqx.demo", *args],
        env=demo_env(cache_dir),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_ctrl_c_checkpoints_and_says_how_to_resume(tmp_path, cache_dir):
    ck = tmp_path / "ck"
    argv = [*TINY, "--steps", "100000", "--log-every", "1", "--ckpt-dir", str(ck)]
    proc = _start_demo(argv, cache_dir)
    try:
        # After the first logged step the run is in its loop: interrupt it there.
        for line in proc.stdout:
            if line.startswith("step"):
                break
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err, err
    assert "Ctrl-C: stopping after this step" in err
    steps = list_checkpoints(ck)
    assert len(steps) == 1 and 1 <= steps[0] < 100000
    step = steps[0]
    assert f"interrupted after step {step} (Ctrl-C)" in err
    assert f"checkpoint of step {step} saved: {ck / str(step)}" in err
    command = shlex.join(["python", "-m", "moe_eqx.demo", *argv, "--resume"])
    assert f"resume with:\n  {command}\n" in err

    # The printed command resumes (to two more steps), keeping the schedule of the
    # interrupted run (100000 steps) and saying so.
    resume_args = shlex.split(command)[3:]
    resumed = run_demo([*resume_args, "--steps", str(step + 2)], cache_dir)
    assert f"resumed at step {step}" in resumed.stdout
    assert "keeping the learning-rate schedule of the first run" in resumed.stdout
    assert "at step 100000" in resumed.stdout
    assert f"step {step + 2:5d}  loss" in resumed.stdout
    assert "dropped pairs 0" in resumed.stdout
    assert list_checkpoints(ck) == [step, step + 2]

    # Resuming the finished run again says it is complete instead of training.
    again = run_demo([*resume_args, "--steps", str(step + 2)], cache_dir)
    assert f"is complete: its latest checkpoint is at step {step + 2}" in again.stdout
    assert not re.search(r"\bnan\b", again.stdout)
    assert "done: final loss" not in again.stdout


def test_ctrl_c_without_checkpoint_dir_exits_cleanly(cache_dir):
    proc = _start_demo([*TINY, "--steps", "100000", "--log-every", "1"], cache_dir)
    try:
        for line in proc.stdout:
            if line.startswith("step"):
                break
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130
    assert "Traceback" not in err
    assert "nothing saved: run with --ckpt-dir DIR to be able to resume" in err


def test_schedule_kept_on_resume_with_more_steps():
    said = []
    # A fresh run: --schedule-steps, else --steps.
    fresh = dict(lr=1e-3, start=0, metadata=None, say=said.append)
    assert schedule_steps(steps=100, requested=None, **fresh) == 100
    assert schedule_steps(steps=100, requested=300, **fresh) == 300
    assert said == []
    stored = {"schedule_steps": 100, "lr": 1e-3}
    # Resumed with a larger --steps: the checkpoint's schedule is kept, with a note.
    kept = schedule_steps(
        steps=150, lr=1e-3, requested=None, start=100, metadata=stored, say=said.append
    )
    assert kept == 100
    assert len(said) == 1 and "keeping the learning-rate schedule" in said[0]
    assert "stays at 0.0001 until step 150" in said[0]
    # An explicit different length is obeyed, with a warning quoting the jump.
    said.clear()
    longer = schedule_steps(
        steps=150, lr=1e-3, requested=300, start=100, metadata=stored, say=said.append
    )
    assert longer == 300
    assert len(said) == 1 and said[0].startswith("WARNING")
    assert "at step 100 the learning rate jumps from 0.0001 to 0.000" in said[0]
    # So is a different --lr.
    said.clear()
    schedule_steps(
        steps=100, lr=2e-3, requested=None, start=50, metadata=stored, say=said.append
    )
    assert len(said) == 1 and "peak lr 0.002" in said[0]
    # Same flags: nothing to say.
    said.clear()
    schedule_steps(
        steps=100, lr=1e-3, requested=None, start=50, metadata=stored, say=said.append
    )
    assert said == []


def test_resume_command_drops_one_off_flags():
    argv = [
        "--steps",
        "9",
        "--die-at-step",
        "3",
        "--die-process=1",
        "--ckpt-dir",
        "a b",
    ]
    assert (
        resume_command("python -m moe_eqx.demo", argv)
        == "python -m moe_eqx.demo --steps 9 --ckpt-dir 'a b' --resume"
    )
    assert resume_command("p", ["--resume"]) == "p --resume"


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--experts", "8", "--top-k", "9"],
            "--top-k (9) must not exceed --experts (8)",
        ),
        (["--gmm-backend", "foo"], "argument --gmm-backend: invalid choice: 'foo'"),
        (["--on-overflow", "ignore"], "argument --on-overflow: invalid choice"),
        (["--buffer-factor", "0"], "argument --buffer-factor: must be > 0 or 'none'"),
        (["--buffer-factor", "lots"], "argument --buffer-factor: must be > 0"),
        (["--ep", "3"], "--experts (32) must be divisible by --ep (3)"),
        (["--ep", "4", "--batch", "6"], "--batch (6) must be divisible by --ep (4)"),
        (["--resume"], "--resume needs --ckpt-dir"),
        (["--num-slots", "-1"], "--num-slots must be >= 0"),
        (["--steps", "0"], "--steps must be >= 1"),
        (["--schedule-steps", "0"], "--schedule-steps must be >= 1"),
        (["--skew-from", "5"], "--skew-from and --skew-to go together"),
        (["--rebalance-every", "4"], "--rebalance-every re-places experts over shards"),
        (["--rebalance-every", "-1"], "--rebalance-every must be >= 0"),
        (["--fsdp"], "--fsdp splits the experts over the data-parallel groups"),
        (["--data", "0"], "--data must be >= 1"),
        (
            ["--ep", "4", "--data", "2", "--batch", "12"],
            "--batch (12) must be divisible by --ep x --data (8)",
        ),
    ],
)
def test_bad_flags_are_usage_errors(flags, message, capsys):
    parser = cli.build_parser()
    with pytest.raises(SystemExit) as e:
        cli.check_args(parser, parser.parse_args(flags))
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "usage: python -m moe_eqx.demo" in err
    assert message in err, err


def test_every_flag_has_help():
    parser = cli.build_parser()
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
            continue
        assert action.help and len(action.help) > 10, action.option_strings


def test_bad_flags_fail_cleanly(cache_dir):
    proc = run_module(
        "moe_eqx.demo",
        [*TINY, "--ep", "3", "--steps", "1"],
        cache_dir=cache_dir,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "--experts (8) must be divisible by --ep (3)" in proc.stderr
    assert "Traceback" not in proc.stderr


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


def _readme_commands(module: str) -> list[list[str]]:
    root = Path(__file__).resolve().parent.parent
    pages = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    readme = "\n".join(page.read_text() for page in pages)
    commands = []
    for line in readme.splitlines():
        line = line.split("#", 1)[0].strip().rstrip("`")
        for prefix in (f"python3 -m {module} ", f"python -m {module} "):
            if prefix in line:
                # Up to the end of an inline code span.
                commands.append(shlex.split(line.split(prefix, 1)[1].split("`")[0]))
    return commands


def test_readme_commands_parse():
    # Every demo and launcher command line of the README and the docs pages is
    # accepted as written.
    demo = [
        c
        for c in _readme_commands("moe_eqx.demo")
        if "..." not in c and "--help" not in c
    ]
    assert len(demo) >= 4, demo
    for args in demo:
        parser = cli.build_parser()
        cli.check_args(parser, parser.parse_args(args))
    launches = _readme_commands("moe_eqx.launch")
    assert launches, "the docs show the launcher"
    for args in launches:
        parsed = launch_parser().parse_args(args)
        demo_args = [a for a in parsed.demo_args if a != "--"]
        parser = cli.build_parser()
        cli.check_args(parser, parser.parse_args([*demo_args, "--distributed"]))


def test_first_step_with_lost_pairs_raises_and_is_not_checkpointed():
    """The training loop stops on the first step whose layers lost pairs, before that
    step's state exists: the checkpoints written are those of the steps before it,
    and the lost count is logged per interval."""
    import jax.numpy as jnp
    import jax.random as jr

    import moe_eqx as me
    from moe_eqx.train.data import Feed
    from moe_eqx.train.log import Reporter
    from moe_eqx.train.loop import train
    from moe_eqx.train.resume import TrainState

    class FakeFeed(Feed):
        def __init__(self):
            pass

        def batch(self, step):
            return jnp.int32(step)

        def router_bias(self, step):
            return jnp.zeros(())

        def in_skew(self, step):
            return False

    def fake_step(params, opt_state, key, batch, bias):
        metrics = {
            name: jnp.float32(0.0)
            for name in (
                "loss", "ce", "lb_loss", "z_loss", "max_over_mean_before",
                "max_over_mean", "required_buffer_factor", "dedup_ratio",
                "expert_max_over_mean", "num_chunks", "dropped_pairs",
            )
        }  # fmt: skip
        metrics.update(
            overflow=jnp.bool_(False),
            fallback=jnp.bool_(False),
            lost_pairs=jnp.where(batch == 3, 5, 0),
            expert_counts=jnp.zeros((1, 4), jnp.int32),
        )
        return params + 1, opt_state, key, metrics

    saved = []
    reporter = Reporter(lead=False, ep=8, buffer_factor=2.0, json_path=None, args={})
    state = TrainState(0, jnp.float32(0.0), jnp.float32(0.0), jr.key(0))
    with pytest.raises(me.LostPairsError, match="step 3: .* lost 5 pairs"):
        train(
            state,
            steps=10,
            train_step=fake_step,
            feed=FakeFeed(),
            reporter=reporter,
            log_every=2,
            checkpoint=lambda s: saved.append(s.step),
            checkpoint_every=1,
            stop_on_ctrl_c=False,
        )
    assert saved == [1, 2, 3]  # states after steps 0, 1, 2: none after step 3
    assert [e["lost_pairs"] for e in reporter.history] == [0]


def _host_metrics(step: int) -> dict:
    metrics = dict.fromkeys(
        (
            "loss", "ce", "lb_loss", "z_loss", "max_over_mean_before",
            "max_over_mean", "required_buffer_factor", "dedup_ratio",
            "expert_max_over_mean", "num_chunks", "dropped_pairs", "lost_pairs",
        ),
        0.0,
    )  # fmt: skip
    metrics.update(step=step, skew=False, overflow=False, fallback=False)
    return metrics


def test_progress_bar_says_it_compiles_and_its_rate_excludes_the_first_step():
    """The bar says the first step compiles; after it, the bar's clock restarts, so
    its elapsed time and rate count only the steps after the compilation."""
    import io
    import time

    from moe_eqx.train.log import Reporter

    out = io.StringIO()
    reporter = Reporter(lead=True, ep=1, buffer_factor=2.0, json_path=None, args={})
    reporter.open_bar(10, 0, file=out)
    assert "compiling the first step" in out.getvalue()
    time.sleep(0.5)  # the "compilation"
    reporter.step_done(_host_metrics(0), 0.5, log_every=100, last=10)
    bar = reporter.bar
    assert bar.desc.startswith("train") and "compiling" not in bar.desc
    assert bar.n == 1 and bar.initial == 1
    reporter.step_done(_host_metrics(1), 0.01, log_every=100, last=10)
    assert bar.n == 2
    # Without the restart, the elapsed time would include the 0.5 s first step.
    assert bar.format_dict["elapsed"] < 0.4
    reporter.close_bar()


def test_help_explains_every_log_column(capsys):
    """`--help` explains each column of the interval line the demo prints."""
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["--help"])
    help_text = capsys.readouterr().out
    for column in (
        "loss (ce)", "lb ", "z ", "expert max/mean", "rank max/mean a -> b",
        "need bf", "overflow, fallback", "dropped", "lost", "dedup", "[skew n]",
    ):  # fmt: skip
        assert column in help_text, column
    from moe_eqx.train.log import format_entry, summarise

    line = format_entry(summarise([_host_metrics(0) | {"skew": True}], 1), ep=8)
    for column in (
        "loss",
        "lb",
        "z",
        "expert max/mean",
        "rank max/mean",
        "need bf",
        "overflow",
        "fallback",
        "dropped",
        "lost",
        "dedup",
        "[skew",
    ):
        assert column in line and column.split()[0] in help_text, column


def test_header_quotes_the_skew_phase_floor(tmp_path, cache_dir):
    """With a skew phase the data header says how low the loss can go there, so a
    loss under the 'best possible loss' in that phase contradicts nothing."""
    proc = run_module(
        "moe_eqx.demo",
        [*TINY, "--steps", "2", "--skew-from", "0", "--skew-to", "1"],
        timeout=600,
        cache_dir=cache_dir,
    )
    header = next(l for l in proc.stdout.splitlines() if l.startswith("data:"))
    assert "best possible loss" in header
    assert (
        "in the skew phase (steps 0-0) tokens are drawn uniformly from 2 ids" in header
    )
    assert "~0.693 there" in header


def test_fsdp_trains_as_replicated(tmp_path, cache_dir):
    """`--ep 4 --data 2 --fsdp` (experts split over the data groups) trains to the
    parameters of `--ep 4 --data 2` (experts replicated over them). (Killed and
    resumed onto the split placement, bitwise: tests/test_launch.py, across two
    processes.)"""
    flags = [*TINY, "--ep", "4", "--data", "2", "--steps", "12", "--log-every", "4"]
    runs = {}
    for name, extra in (("replicated", []), ("fsdp", ["--fsdp"])):
        runs[name] = tmp_path / f"{name}.npz"
        proc = run_demo([*flags, *extra, "--save-params", str(runs[name])], cache_dir)
        assert "EP 4 x 2 data-parallel groups" in proc.stdout
    assert "(experts split over them)" in proc.stdout
    a, b = load_params(runs["replicated"]), load_params(runs["fsdp"])
    assert a.keys() == b.keys() and len(a) > 5
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-6, err_msg=k)
