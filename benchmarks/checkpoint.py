"""Asynchronous checkpoints: how long the step loop waits for a save.

`moe_eqx.train.Checkpointer.save` (Orbax, asynchronous) against the same save waited
for (`save` + `wait`, what a synchronous save costs), for float32 states of 16 and
256 MiB, three saves each (keep 2), on the local disk.

    python benchmarks/checkpoint.py
"""

import tempfile
import time

import jax
import jax.random as jr
from _common import print_table, write_json

from moe_eqx.train import Checkpointer


def measure(mib: int, saves: int = 3) -> dict:
    n = mib * 2**20 // 4 // 8
    tree = {f"w{i}": jr.normal(jr.key(i), (n,)) for i in range(8)}
    jax.block_until_ready(tree)
    returns, on_disk = [], []
    with tempfile.TemporaryDirectory() as d:
        ck = Checkpointer(d, keep=2)
        for step in range(1, saves + 1):
            t0 = time.perf_counter()
            ck.save(step, tree)
            t1 = time.perf_counter()
            ck.wait()
            t2 = time.perf_counter()
            returns.append(t1 - t0)
            on_disk.append(t2 - t0)
        ck.close()
    return {
        "state_mib": mib,
        "save_returns_ms": 1e3 * min(returns),
        "on_disk_ms": 1e3 * min(on_disk),
        "loop_waits_fraction": min(returns) / min(on_disk),
    }


def main() -> None:
    rows = [measure(mib) for mib in (16, 256)]
    print("Orbax checkpoint: time until save() returns vs until it is on disk (min)\n")
    cols = ["state_mib", "save_returns_ms", "on_disk_ms", "loop_waits_fraction"]
    print_table(rows, cols)
    write_json("checkpoint", {"rows": rows})


if __name__ == "__main__":
    main()
