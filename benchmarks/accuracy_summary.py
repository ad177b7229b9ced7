"""The table of `benchmarks/gpu_run.sh accuracy-CASES` runs: per case, PyTorch alone against
`mucudnn run --memory-budget B --offload` from the step lines of benchmarks/train_steps.py
``--detail`` (the logs ``accuracy-TAG.log`` and ``accuracy-TAG-pytorch.log``).

Per case: PyTorch's median step (from step ``--pytorch-from``), mucudnn's median, range and
p90/p50 (plan_timeline's: the steady-state criterion's) from step ``--from`` (traced steps left out: ``--skip``), the ratio, the most allocated
and reserved in those steps, the median of the allocator's flushes a step, and the plan's
prediction against the median.

    python -m benchmarks.accuracy_summary LOGDIR --skip 28
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path

from benchmarks.plan_timeline import p90_over_p50

STEP = re.compile(r"train_steps: step (\d+) .*?step_ms=([\d.]+) session=(\S+)(.*)")
FIELD = re.compile(r"(\w+)=([\d.]+)")


def read_steps(path: Path) -> list[dict]:
    """Each step line of a train_steps log: step, ms, state and its numeric fields."""
    steps = []
    for line in path.read_text(errors="replace").splitlines():
        match = STEP.search(line)
        if match:
            step = {"step": int(match.group(1)), "ms": float(match.group(2)),
                    "state": match.group(3)}
            step.update((key, float(value)) for key, value in FIELD.findall(match.group(4)))
            steps.append(step)
    return steps


def summarize(steps: list[dict], pytorch: list[dict], start: int = 15, pytorch_start: int = 5,
              skip: frozenset = frozenset()) -> dict | None:
    """One case's row (None where mucudnn ran no step from ``start``)."""
    timed = [s for s in steps if s["step"] >= start and s["step"] not in skip]
    alone = [s["ms"] for s in pytorch if s["step"] >= pytorch_start and s["step"] not in skip]
    if not timed or not alone:
        return None
    ms = [s["ms"] for s in timed]
    median, baseline = statistics.median(ms), statistics.median(alone)
    predicted = timed[-1].get("predicted_ms")
    return {"pytorch_ms": baseline, "median_ms": median, "least_ms": min(ms),
            "most_ms": max(ms), "p90_over_p50": p90_over_p50(ms),
            "ratio": median / baseline,
            "peak_gib": max(s.get("peak_gib", 0.0) for s in timed),
            "reserved_gib": max(s.get("reserved_gib", 0.0) for s in timed),
            "flushes": statistics.median(s.get("retries", 0.0) for s in timed),
            "predicted_ms": predicted,
            "predicted_off": None if predicted is None else predicted / median - 1}


def pytorch_log_name(stem: str) -> str:
    """The PyTorch log a case's log is compared with: its own, or for a workspace-limit variant
    (``accuracy-TAG-wsLIMIT``, gpu_run.sh's ``MODEL:BATCH@BUDGET~LIMIT``) its case's."""
    case, variant, _ = stem.rpartition("-ws")
    return f"{case if variant else stem}-pytorch.log"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("logs", type=Path, help="the stage's log folder (accuracy-*.log)")
    ap.add_argument("--from", dest="start", type=int, default=15)
    ap.add_argument("--pytorch-from", type=int, default=5)
    ap.add_argument("--skip", default="", help="steps left out (traced), e.g. 28 or 20,24")
    args = ap.parse_args(argv)
    skip = frozenset(int(k) for k in args.skip.split(",") if k.strip())
    print("| case | PyTorch ms | mucudnn ms (range) | x PyTorch | p90/p50 | peak / reserved GiB "
          "| flushes a step | predicted ms |")
    print("|---|---|---|---|---|---|---|---|")
    for log in sorted(args.logs.glob("accuracy-*.log")):
        if log.stem.endswith("-pytorch"):
            continue
        paired = log.with_name(pytorch_log_name(log.stem))
        row = summarize(read_steps(log), read_steps(paired) if paired.exists() else [],
                        args.start, args.pytorch_from, skip)
        case = log.stem[len("accuracy-"):]
        if row is None:
            print(f"| {case} | no step to time | | | | | | |")
            continue
        predicted = "-" if row["predicted_ms"] is None else \
            f"{row['predicted_ms']:.1f} ({row['predicted_off']:+.1%})"
        print(f"| {case} | {row['pytorch_ms']:.1f} | {row['median_ms']:.1f} "
              f"({row['least_ms']:.1f}-{row['most_ms']:.1f}) | {row['ratio']:.3f} | "
              f"{row['p90_over_p50']:.3f} | {row['peak_gib']:.2f} / {row['reserved_gib']:.2f} | "
              f"{row['flushes']:.0f} | {predicted} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
