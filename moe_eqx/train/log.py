"""What a training run prints and records: a progress bar, one line per logging
interval, notes when the dropless fallback starts and stops, the history written to
`--json`, and the final summary."""

import json
import os
import time

import numpy as np


def entropy(p: np.ndarray) -> float:
    """Entropy in nats of the distribution `p`."""
    return float(-(p * np.log(np.maximum(p, 1e-300))).sum())


def summarise(interval: list[dict], done: int) -> dict:
    """One history entry: means (losses, dedup) and peaks (imbalance) of the per-step
    metrics of a logging interval that ends with step `done`."""

    def mean(k):
        return float(np.mean([m[k] for m in interval]))

    def peak(k):
        return float(np.max([m[k] for m in interval]))

    def count(k):
        return int(sum(bool(m[k]) for m in interval))

    return {
        "step": done,
        "loss": mean("loss"),
        "ce": mean("ce"),
        "last_loss": interval[-1]["loss"],
        "lb_loss": mean("lb_loss"),
        "z_loss": mean("z_loss"),
        "max_over_mean_before": peak("max_over_mean_before"),
        "max_over_mean": peak("max_over_mean"),
        "expert_max_over_mean": peak("expert_max_over_mean"),
        "required_buffer_factor": peak("required_buffer_factor"),
        "dedup_ratio": mean("dedup_ratio"),
        "overflow_steps": count("overflow"),
        "fallback_steps": count("fallback"),
        "dropped_pairs": int(sum(int(m["dropped_pairs"]) for m in interval)),
        "lost_pairs": int(sum(int(m.get("lost_pairs", 0)) for m in interval)),
        "skew_steps": count("skew"),
        "losses": [m["loss"] for m in interval],
    }


def format_entry(e: dict, ep: int) -> str:
    """The printed line of a history entry (routing columns only with EP > 1)."""
    line = (
        f"step {e['step']:5d}  loss {e['loss']:.4f} (ce {e['ce']:.4f})  lb "
        f"{e['lb_loss']:.3f}  z {e['z_loss']:.2f}  expert max/mean "
        f"{e['expert_max_over_mean']:.2f}"
    )
    if ep > 1:
        line += (
            f"  rank max/mean {e['max_over_mean_before']:.2f} -> "
            f"{e['max_over_mean']:.2f}  need bf {e['required_buffer_factor']:.2f}  "
            f"overflow {e['overflow_steps']}  fallback {e['fallback_steps']}  "
            f"dropped {e['dropped_pairs']}  lost {e['lost_pairs']}  "
            f"dedup {e['dedup_ratio']:.2f}"
        )
    if e["skew_steps"]:
        line += f"  [skew {e['skew_steps']}]"
    return line


class Reporter:
    """Prints (on the lead process only), keeps the history and the run's counters.

    **Arguments:**

    - `lead`: whether this process prints and writes files.
    - `ep`: expert-parallel size (decides the logged columns).
    - `buffer_factor`: the layer's receive buffer factor (quoted in fallback notes).
    - `json_path`: where `write_json` writes the history, or `None`.
    - `args`: the run's flags, stored in the JSON.
    """

    def __init__(self, *, lead: bool, ep: int, buffer_factor, json_path, args: dict):
        self.lead = lead
        self.ep = ep
        self.buffer_factor = buffer_factor
        self.json_path = json_path
        self.args = args
        self.bar = None
        self.history: list[dict] = []
        self.interval: list[dict] = []
        self.fallback_steps = self.overflow_steps = self.dropped_total = 0
        self._fallback_since: int | None = None
        self.first_step_s: float | None = None
        self._t_after_first: float | None = None
        self._steps_after_first = 0
        self._t_start = time.perf_counter()
        self.last_metrics: dict = {}

    def say(self, *parts) -> None:
        """Prints a line on the lead process, above the progress bar."""
        if not self.lead:
            return
        msg = " ".join(str(x) for x in parts)
        if self.bar is not None:
            self.bar.write(msg)
        else:
            print(msg, flush=True)

    def open_bar(self, total: int, initial: int, file=None) -> None:
        """Shows a progress bar (lead process, a terminal or notebook only, or into
        `file`). It says that the first step compiles, and its rate counts the steps
        after it."""
        if self.lead:
            from tqdm.auto import tqdm

            self.bar = tqdm(
                total=total,
                initial=initial,
                desc="train (compiling the first step)",
                unit="step",
                disable=None if file is None else False,
                dynamic_ncols=True,
                file=file,
            )

    def close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def step_done(self, metrics: dict, seconds: float, *, log_every: int, last: int):
        """Records one step's host metrics (with "step" and "skew" set); prints fallback
        transitions, and an interval line every `log_every` steps and at step `last`."""
        step = metrics["step"]
        if self.first_step_s is None:
            self.first_step_s = seconds
            self._t_after_first = time.perf_counter()
        else:
            self._steps_after_first += 1
        self.last_metrics = metrics
        self.interval.append(metrics)
        self.fallback_steps += bool(metrics["fallback"])
        self.overflow_steps += bool(metrics["overflow"])
        self.dropped_total += int(metrics["dropped_pairs"])
        self._note_fallback(metrics)
        if self.bar is not None:
            if self._steps_after_first == 0:
                # The first step compiled: restart the bar's clock after it.
                total, done = self.bar.total, self.bar.n + 1
                self.bar.reset(total=total)
                self.bar.initial = self.bar.n = done
                self.bar.set_description("train", refresh=False)
                self.bar.set_postfix(loss=f"{metrics['loss']:.3f}", refresh=True)
            else:
                self.bar.update(1)
                self.bar.set_postfix(loss=f"{metrics['loss']:.3f}", refresh=False)
        done = step + 1
        if done % log_every == 0 or done == last:
            entry = summarise(self.interval, done)
            self.history.append(entry)
            self.interval = []
            self.say(format_entry(entry, self.ep))
            self.write_json(None)  # so that a run that dies still leaves its history

    def _note_fallback(self, m: dict) -> None:
        step = m["step"]
        if m["fallback"] and self._fallback_since is None:
            self._fallback_since = step
            self.say(
                f"  ! step {step}: a receive buffer would overflow (needs buffer_factor "
                f"{m['required_buffer_factor']:.2f} > {self.buffer_factor}); "
                f"chunked dropless fallback in use ({m['num_chunks']} chunks)"
            )
        elif not m["fallback"] and self._fallback_since is not None:
            self.say(
                f"  ! step {step}: back on the capped path (fallback ran for steps "
                f"{self._fallback_since}-{step - 1})"
            )
            self._fallback_since = None

    def last_logged_loss(self) -> float | None:
        """Mean loss of the last logged interval (a single step's loss is noisy)."""
        return self.history[-1]["loss"] if self.history else None

    def summary(self, *, steps: int, start: int, extra: dict) -> dict:
        """The run's summary (also printed by `print_summary`, stored in the JSON)."""
        steady = (
            self._steps_after_first / (time.perf_counter() - self._t_after_first)
            if self._steps_after_first
            else None
        )
        last = self.history[-1] if self.history else None
        return {
            "final_loss": last["loss"] if last else None,
            "final_ce": last["ce"] if last else None,
            "last_step_loss": self.last_metrics.get("loss"),
            "steps": steps,
            "start_step": start,
            "first_step_s": self.first_step_s,
            "steps_per_s": steady,
            "loop_s": time.perf_counter() - self._t_start,
            "fallback_steps": self.fallback_steps,
            "overflow_steps": self.overflow_steps,
            "dropped_pairs": self.dropped_total,
            **extra,
        }

    def print_summary(self, s: dict) -> None:
        if s["final_loss"] is None:
            return
        n = len(self.history[-1]["losses"])
        speed = (
            f"{s['steps_per_s']:.1f} steps/s after a first step (compile) of "
            f"{s['first_step_s']:.1f} s"
            if s["steps_per_s"] is not None
            else f"one step (with compilation) in {s['first_step_s']:.1f} s"
        )
        self.say(
            f"done: final loss {s['final_loss']:.4f} (ce {s['final_ce']:.4f}, mean of "
            f"the last {n} steps); {speed}; fallback on {s['fallback_steps']} steps, "
            f"overflow on {s['overflow_steps']}, dropped pairs {s['dropped_pairs']}"
        )

    def write_json(self, summary: dict | None) -> None:
        """Writes `{args, history, summary}` to `--json` atomically (lead only)."""
        if not (self.json_path and self.lead):
            return
        out = {"args": self.args, "history": self.history, "summary": summary}
        tmp = f"{self.json_path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(out, f, indent=1)
        os.replace(tmp, self.json_path)
