"""Start a multi-process `jax.distributed` run of the demo on this machine.

    python -m moe_eqx.launch --processes 2 --devices-per-process 4 -- --steps 50

starts `--processes` copies of `python -m moe_eqx.demo --distributed <demo flags>`, each
with `--devices-per-process` simulated CPU devices, that find each other through a
coordinator on 127.0.0.1:<free port> (process 0 hosts it) and run one SPMD program over
a mesh that spans all their devices, with gloo collectives over loopback. This is the
same runtime that spans several hosts (there, run one process per host with
`--distributed` and let jax detect the cluster, or set the `MOE_EQX_*` variables).

Output of process `i` is streamed with the prefix `[pi]` (without gloo's routine
connection reports). If any process dies, the
others are terminated and the launcher exits non-zero with a message saying which one;
a coordinator that cannot be reached makes the processes fail after `--timeout`
seconds, and `--max-time` bounds the whole run.
"""

import argparse
import collections
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

from .resume import resume_command
from .runtime import (
    ENV_COORDINATOR,
    ENV_INIT_TIMEOUT,
    ENV_LAUNCHER_PID,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
)

# Gloo prints one line per CPU device when its connections are up ("[Gloo] Rank 3 is
# connected to 7 peer ranks. Expected number of connected peer ranks is : 7"): 8 lines
# of noise per run on 2 x 4 devices. Only the report of a rank with missing peers is
# kept. Gloo writes to the same pipe as the demo, so a report can land in the middle of
# another line (seen: "resumed at step 12[Gloo] Rank 0 is connected ...").
_GLOO_CONNECTED = re.compile(
    r"\[Gloo\] Rank \d+ is connected to (\d+) peer ranks\. Expected number of "
    r"connected peer ranks is : (\d+)"
)
# Two ranks' reports written at once interleave mid-word across two lines (seen:
# "[Gloo] Rank 7 is connected to 7[Gloo] Rank  peer ranks. Expected ... : 7" then
# "6 is connected to 7 peer ranks. Expected ... : 7"): their fragments.
_GLOO_HEAD = re.compile(r"\[Gloo\] Rank\s*\d*(?: is connected to \d*)?")
_GLOO_TAIL = re.compile(
    r"\d*\s*(?:is connected to \d+ )?peer ranks\. Expected number of connected peer "
    r"ranks is : \d+"
)


def without_noise(line: str) -> str | None:
    """A child's output line without gloo's routine connection reports, wherever they
    are in it; `None` when nothing else is left."""
    text = _GLOO_CONNECTED.sub(
        lambda m: "" if m.group(1) == m.group(2) else m.group(0), line
    )
    if not _GLOO_CONNECTED.search(text):  # a rank with missing peers stays whole
        text = _GLOO_TAIL.sub("", _GLOO_HEAD.sub("", text))
    return None if text != line and not text.strip() else text


PROG = "python -m moe_eqx.launch"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_parser() -> argparse.ArgumentParser:
    """The launcher's command-line flags (demo flags follow `--`)."""
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Run the moe_eqx demo as N jax.distributed processes on this "
        "machine (CPU devices, gloo collectives over loopback).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--processes", type=int, default=2, help="number of processes")
    p.add_argument(
        "--devices-per-process",
        type=int,
        default=4,
        help="simulated CPU devices per process",
    )
    p.add_argument(
        "--timeout",
        type=int,
        default=60,
        help="seconds to wait for the coordinator and the other processes",
    )
    p.add_argument(
        "--max-time",
        type=float,
        default=None,
        help="terminate everything after this many seconds",
    )
    p.add_argument(
        "--port",
        type=int,
        default=None,
        help="coordinator port on 127.0.0.1 (None: a free one)",
    )
    p.add_argument(
        "--module",
        default="moe_eqx.demo",
        help="module run by each process (gets --distributed)",
    )
    p.add_argument(
        "--grace",
        type=float,
        default=5.0,
        help="seconds between SIGTERM and SIGKILL when stopping processes",
    )
    # For tests: start only these process ids (the others never come up).
    p.add_argument("--only", type=int, nargs="+", default=None, help=argparse.SUPPRESS)
    p.add_argument(
        "demo_args", nargs=argparse.REMAINDER, help="flags for the demo, after `--`"
    )
    return p


def _child_env(base: dict, *, address: str, n: int, i: int, devices: int, timeout: int):
    env = dict(base)
    env[ENV_COORDINATOR] = address
    env[ENV_NUM_PROCESSES] = str(n)
    env[ENV_PROCESS_ID] = str(i)
    env[ENV_INIT_TIMEOUT] = str(timeout)
    # Lets the process exit if the launcher itself is killed (even by SIGKILL).
    env[ENV_LAUNCHER_PID] = str(os.getpid())
    env.setdefault("JAX_PLATFORMS", "cpu")
    env["PYTHONUNBUFFERED"] = "1"
    flags = re.sub(
        r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", "")
    )
    env["XLA_FLAGS"] = (
        f"{flags} --xla_force_host_platform_device_count={devices}".strip()
    )
    return env


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _pump(
    proc: subprocess.Popen, prefix: str, lock: threading.Lock, tail: collections.deque
) -> None:
    assert proc.stdout is not None
    for line in iter(proc.stdout.readline, b""):
        text = line.decode(errors="replace").rstrip("\r\n")
        # tqdm redraws with carriage returns; keep the latest state only.
        text = text.split("\r")[-1]
        tail.append(text)
        text = without_noise(text)
        if text is None:
            continue
        with lock:
            sys.stdout.write(f"{prefix} {text}\n")
            sys.stdout.flush()
    proc.stdout.close()


def _unreachable(line: str) -> bool:
    return "RegisterTask" in line or (
        "DEADLINE_EXCEEDED" in line and "coordinat" in line.lower()
    )


def _stop(procs: dict[int, subprocess.Popen], grace: float) -> None:
    """SIGTERM, then SIGKILL after `grace` seconds, each process group we started."""
    for p in procs.values():
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace
    for p in procs.values():
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


def launch(
    demo_args: list[str],
    *,
    processes: int = 2,
    devices_per_process: int = 4,
    timeout: int = 60,
    max_time: float | None = None,
    port: int | None = None,
    module: str = "moe_eqx.demo",
    grace: float = 5.0,
    only: list[int] | None = None,
) -> int:
    """Runs `processes` copies of `python -m module --distributed *demo_args`.

    **Arguments:**

    - `demo_args`: flags passed to every process.
    - `processes`: number of processes.
    - `devices_per_process`: simulated CPU devices in each.
    - `timeout`: seconds a process waits for the coordinator (its
        `jax.distributed.initialize(initialization_timeout=...)`).
    - `max_time`: wall-clock limit of the whole run, or None.
    - `port`: coordinator port on 127.0.0.1; a free one by default.
    - `module`: the module each process runs.
    - `grace`: seconds between SIGTERM and SIGKILL when stopping processes.
    - `only`: start only these process ids (to test a missing coordinator/peer).

    **Returns:**

    0 when every process exits with 0; else non-zero (the failing process's code, or
    124 when `max_time` ran out), after stopping the remaining processes.
    """
    if processes < 1 or devices_per_process < 1:
        raise ValueError("`processes` and `devices_per_process` must be >= 1.")
    address = f"127.0.0.1:{port or free_port()}"
    ids = list(range(processes)) if only is None else list(only)
    lock = threading.Lock()
    procs: dict[int, subprocess.Popen] = {}
    tails: dict[int, collections.deque] = {}
    pumps = []

    def note(msg: str) -> None:
        with lock:
            print(f"[launch] {msg}", file=sys.stderr, flush=True)

    note(
        f"{len(ids)} of {processes} process(es) x {devices_per_process} CPU device(s), "
        f"coordinator {address}"
    )
    start = time.monotonic()
    try:
        for i in ids:
            env = _child_env(
                os.environ,
                address=address,
                n=processes,
                i=i,
                devices=devices_per_process,
                timeout=timeout,
            )
            cmd = [sys.executable, "-m", module, "--distributed", *demo_args]
            procs[i], tails[i], pump = _start(cmd, env, f"[p{i}]", lock)
            pumps.append(pump)
        code = _watch(procs, tails, note, address, timeout, max_time, start)
    except KeyboardInterrupt:
        note("interrupted (SIGINT/SIGTERM); stopping every process.")
        code = 130
    finally:
        _stop(procs, grace)
        for t in pumps:
            t.join(timeout=2.0)
    note(_outcome(code, procs, start))
    return code


def _outcome(code: int, procs: dict[int, subprocess.Popen], start: float) -> str:
    if code == 0:
        took = time.monotonic() - start
        return f"all {len(procs)} process(es) finished in {took:.1f} s."
    summary = ", ".join(f"p{i}: {_describe(p.returncode)}" for i, p in procs.items())
    return f"FAILED ({summary})."


def _start(cmd: list[str], env: dict, prefix: str, lock: threading.Lock):
    """Starts one process and the thread that streams its output with `prefix`."""
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,  # its own process group, to stop it whole
    )
    tail: collections.deque = collections.deque(maxlen=200)
    pump = threading.Thread(target=_pump, args=(proc, prefix, lock, tail))
    pump.daemon = True
    pump.start()
    return proc, tail, pump


def _watch(procs, tails, note, address, timeout, max_time, start) -> int:
    """Waits until every process exits with 0 (returns 0), one fails (returns its
    code, or 1 for a signal) or `max_time` runs out (returns 124)."""
    while True:
        codes = {i: p.poll() for i, p in procs.items()}
        failed = {i: c for i, c in codes.items() if c not in (None, 0)}
        if failed:
            i, c = next(iter(failed.items()))
            running = [j for j, cj in codes.items() if cj is None]
            note(
                f"process {i} failed ({_describe(c)}); stopping "
                f"{'processes ' + str(running) if running else 'nothing else'}."
            )
            time.sleep(0.2)  # let the pump read its last words
            if any(_unreachable(line) for line in list(tails[i])):
                note(
                    f"process {i} could not register with the coordinator at "
                    f"{address} within --timeout {timeout} s (process 0 hosts it: "
                    "did it start? is the port free and reachable?)."
                )
            return c if c > 0 else 1
        if all(c == 0 for c in codes.values()):
            return 0
        if max_time is not None and time.monotonic() - start > max_time:
            note(f"--max-time {max_time:g} s ran out; stopping every process.")
            return 124
        time.sleep(0.05)


def _terminate(signum, frame):
    raise KeyboardInterrupt  # stops the processes in `launch`'s `finally`


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m moe_eqx.launch`."""
    signal.signal(signal.SIGTERM, _terminate)
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    demo_args = list(args.demo_args)
    if demo_args[:1] == ["--"]:
        demo_args = demo_args[1:]
    if args.processes < 1:
        parser.error("--processes must be >= 1")
    if args.devices_per_process < 1:
        parser.error("--devices-per-process must be >= 1")
    if args.timeout < 1:
        parser.error("--timeout must be >= 1")
    if args.only is not None and any(not 0 <= i < args.processes for i in args.only):
        parser.error("--only ids must be in [0, --processes)")
    code = launch(
        demo_args,
        processes=args.processes,
        devices_per_process=args.devices_per_process,
        timeout=args.timeout,
        max_time=args.max_time,
        port=args.port,
        module=args.module,
        grace=args.grace,
        only=args.only,
    )
    if code == 130:
        print(f"[launch] {_resume_hint(argv, demo_args)}", file=sys.stderr, flush=True)
    return code


def _ckpt_dir(demo_args: list[str]) -> str | None:
    for i, arg in enumerate(demo_args):
        if arg == "--ckpt-dir" and i + 1 < len(demo_args):
            return demo_args[i + 1]
        if arg.startswith("--ckpt-dir="):
            return arg.split("=", 1)[1]
    return None


def _resume_hint(argv: list[str], demo_args: list[str]) -> str:
    directory = _ckpt_dir(demo_args)
    if directory is None:
        return "nothing to resume from (the demo ran without --ckpt-dir)."
    # The demo flags come last, so an appended --resume is one of them.
    return (
        f"resume from the latest checkpoint in {directory} (written every "
        f"--ckpt-every steps) with:\n  {resume_command(PROG, argv)}"
    )


if __name__ == "__main__":
    sys.exit(main())
