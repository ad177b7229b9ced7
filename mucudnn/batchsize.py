"""``mucudnn batch-size``: the batch size with the most images/s that holds under a memory budget
(AccUDNN's tuner; docs/torch.md, "Batch size").

The protocol with the training script: its command line has ``{}`` where the batch size goes; it
prints ``mucudnn-throughput: <images/s>`` (the last such line counts) and exits 0. The tuner runs
it under ``--memory-budget`` (and ``--offload`` when asked), where the site hook reports PyTorch's
peak reserved memory at exit. A candidate *holds* when the run exits 0, prints a throughput and its
peak plus the safety margin is within the budget. The margin is measured, not guessed: the fastest
holding candidate runs again and the difference of its peaks (growth from one run to another) is
the margin every candidate must keep.

Search: doubling from ``start`` while candidates hold (up to ``largest``), then bisection between
the largest that held and the smallest that did not, to a multiple of ``multiple``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from .errors import MucudnnError
from .sizes import describe_size

THROUGHPUT = re.compile(r"^mucudnn-throughput:\s*([0-9.eE+-]+)\s*$", re.MULTILINE)
PLACEHOLDER = "{}"


class BatchSizeError(MucudnnError, ValueError):
    """Bad input to the tuner, or no batch size held."""


@dataclass(frozen=True)
class Trial:
    batch: int
    code: int
    throughput: float | None     # images/s, the script's last line
    peak: int | None             # bytes reserved by PyTorch at its peak (None: not reported)
    note: str = ""               # why it did not hold, from its output

    def holds(self, budget: int, margin: int) -> bool:
        return (self.code == 0 and self.throughput is not None
                and (self.peak is None or self.peak + margin <= budget))


def parse_throughput(output: str) -> float | None:
    values = THROUGHPUT.findall(output)
    try:
        return float(values[-1]) if values else None
    except ValueError:
        return None


def command_for(command: tuple[str, ...] | list[str], batch: int) -> list[str]:
    return [part.replace(PLACEHOLDER, str(batch)) for part in command]


def check_command(command) -> None:
    if not command:
        raise BatchSizeError("give the training command after --, with {} for the batch size")
    if not any(PLACEHOLDER in part for part in command):
        raise BatchSizeError("the command has no {} where the batch size goes "
                             "(e.g. -- python train.py --batch-size {})")


def tune(run: Callable[[int], Trial], budget: int, start: int = 8, largest: int = 4096,
         multiple: int | None = None, say: Callable[[str], None] = lambda text: None
         ) -> tuple[Trial, list[Trial], int]:
    """(the chosen trial, every trial in order, the margin in bytes). ``run(batch)`` runs one
    candidate."""
    multiple = multiple or start
    if start < 1 or largest < start or multiple < 1:
        raise BatchSizeError(f"batch sizes: start {start}, largest {largest}, multiple "
                             f"{multiple}: need 1 <= start <= largest and multiple >= 1")
    trials: dict[int, Trial] = {}

    def attempt(batch: int, margin: int) -> Trial:
        if batch not in trials:
            trials[batch] = run(batch)
            trial = trials[batch]
            say(f"batch {batch}: " + (f"{trial.throughput:.1f} images/s" if trial.throughput
                                      else "no throughput") +
                (f", peak {describe_size(trial.peak)}" if trial.peak is not None else "") +
                ("" if trial.holds(budget, margin) else f"; does not hold ({_why(trial, budget)})"))
        return trials[batch]

    good, bad = None, None
    batch = start
    while batch <= largest:
        if attempt(batch, 0).holds(budget, 0):
            good, batch = batch, batch * 2
        else:
            bad = batch
            break
    if good is None:
        raise BatchSizeError(f"no batch size from {start} holds under "
                             f"{describe_size(budget)}: {_why(trials[start], budget)}")
    if bad is not None:
        while bad - good > multiple:
            middle = (good + bad) // 2 // multiple * multiple
            if middle <= good:
                break
            if attempt(middle, 0).holds(budget, 0):
                good = middle
            else:
                bad = middle
    margin = 0
    while True:
        holding = sorted((t for t in trials.values() if t.holds(budget, margin)),
                         key=lambda t: -t.throughput)
        if not holding:
            raise BatchSizeError(f"no batch size holds under {describe_size(budget)} with the "
                                 f"measured margin of {describe_size(margin)}")
        best = holding[0]
        again = run(best.batch)
        say(f"batch {best.batch} again: peak "
            + (describe_size(again.peak) if again.peak is not None else "not reported")
            + f", exit {again.code}")
        if again.code != 0 or again.throughput is None:
            trials[best.batch] = again
            continue
        if best.peak is not None and again.peak is not None:
            margin = max(margin, abs(again.peak - best.peak))
        if best.holds(budget, margin) and again.holds(budget, margin):
            ordered = [trials[b] for b in sorted(trials)]
            return best, ordered, margin


def _why(trial: Trial, budget: int) -> str:
    if trial.code != 0:
        return trial.note or f"exit {trial.code}"
    if trial.throughput is None:
        return "it printed no 'mucudnn-throughput: <images/s>' line"
    return f"peak {describe_size(trial.peak)} over {describe_size(budget)}"


def explain(best: Trial, trials: list[Trial], budget: int, margin: int) -> list[str]:
    """A few lines: the pick, the runner-up, the margin, the largest that held."""
    held = [t for t in trials if t.holds(budget, margin)]
    lines = [f"batch size {best.batch}: {best.throughput:.1f} images/s, the fastest of "
             f"{len(trials)} tried that held under {describe_size(budget)}"]
    others = sorted((t for t in held if t is not best), key=lambda t: -t.throughput)
    if others:
        lines.append(f"next: batch {others[0].batch} at {others[0].throughput:.1f} images/s "
                     f"({(best.throughput / others[0].throughput - 1) * 100:+.1f} %)")
    largest = max(held, key=lambda t: t.batch)
    if largest is not best:
        lines.append(f"larger batch {largest.batch} also held but is slower "
                     f"({largest.throughput:.1f} images/s)")
    failed = [t for t in trials if not t.holds(budget, margin)]
    if failed:
        smallest = min(failed, key=lambda t: t.batch)
        lines.append(f"batch {smallest.batch} did not hold: {_why(smallest, budget)}")
    lines.append(f"safety margin {describe_size(margin)} (peak growth between two runs of "
                 f"batch {best.batch}" + (", peak " + describe_size(best.peak) + ")"
                                          if best.peak is not None else "; no peak reported)"))
    return lines
