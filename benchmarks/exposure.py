"""Where offloading's time goes beyond the host-link bound (issue 12 (b); planner.COPY_EXPOSURE).

The planner charges every offloaded byte ``COPY_EXPOSURE`` (0.6) of its copies' time on top of
the bound ``max(F, out) + max(B, in)``, as measured on ResNet-50; the 3-D U-Net's plans ran as
charged (7.25 GiB: 142.9 ms against 140.7 predicted). Two mechanisms could make it so, and this
study tells them apart on one model and budget, each configuration in its own process
(benchmarks/offload.py's worker, mucudnn.torch without the shim):

- the memory cap: an offloaded tensor's device memory returns to the caching allocator only
  once its copy is done, while the forward goes on allocating; at a cap the allocator then
  flushes (synchronises the device, frees every cached block, allocates again). ``--no-cap``
  plans for the same budget without holding the allocator to it;
- the copies in flight (``max_pending``): past them the host thread waits for the oldest, and
  the device runs dry once it has run what was queued.

Each row has the step time, the plan's prediction, the allocator's counters per timed step
(flushes, device allocations) and one profiled step's compute-stream idle time and host waits.

    python -m benchmarks.exposure --model unet3d --budget 7.25GiB --out OUT
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.models import parse_model
from benchmarks.offload import GiB, run_config
from mucudnn.budget import parse_budget
from mucudnn.errors import MucudnnError
from mucudnn.outputs import write_text_atomically

#: (label, worker options): the cap and the copies in flight, each alone
VARIANTS = (("cap", ()), ("cap pending=128MiB", ("--max-pending-mib", "128")),
            ("no-cap", ("--no-cap",)), ("no-cap pending=128MiB", ("--no-cap", "--max-pending-mib", "128")))


def table(rows: list[dict]) -> str:
    lines = ["| model, N | config | status | step ms | predicted ms | plan k/o/r | moved GiB each way "
             "| flushes per step | device allocs per step | compute idle ms (gaps) | host waits ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ok = r.get("status") == "ok"
        steps = r.get("allocator_steps") or []
        per = (lambda key: "/".join(str(s.get(key, 0)) for s in steps)) if steps else (lambda key: "—")
        trace = r.get("trace") or {}
        calls = trace.get("runtime_calls_ms", {})
        waits = sum(calls.get(name, [0, 0])[0] for name in
                    ("cudaEventSynchronize", "cudaStreamSynchronize"))
        lines.append("| " + " | ".join([
            f"{r['model']} N={r['batch']}", r["config"], r.get("status", "?"),
            f"{r['step_ms']:.1f}" if ok else "—",
            f"{r['predicted_ms']:.1f}" if "predicted_ms" in r else "—",
            f"{r['kept']}/{r['offloaded']}/{r['recomputed']}" if "kept" in r else "—",
            f"{r['moved_bytes'] / GiB:.2f}" if "moved_bytes" in r else "—",
            per("num_alloc_retries"), per("num_device_alloc"),
            f"{trace['compute_idle_ms']:.1f} ({trace['compute_gaps_over_50us']})" if trace else "—",
            f"{waits:.1f}" if trace else "—"]) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.exposure", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="MODEL or MODEL:BATCH (benchmarks/models.py)")
    ap.add_argument("--budget", required=True, help="e.g. 7.25GiB")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--headroom", type=float, default=0.1)
    ap.add_argument("--timeout", type=float, default=150)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    try:
        (model, batch), budget = parse_model(args.model), parse_budget(args.budget)
    except (KeyError, ValueError, MucudnnError) as exc:   # one line: the model or budget named
        ap.error(str(exc))
    args.trace = True
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = [run_config(args, model, batch, "pytorch", None, part="exposure")]
    for label, extra in VARIANTS:
        rows.append(run_config(args, model, batch, "mucudnn", budget, part="exposure",
                               extra=extra, label=label))
        (out / "exposure.json").write_text(json.dumps(rows, indent=1))
    write_text_atomically(out / "exposure.md", f"# Offload exposure: {model} N={batch}, "
                          f"budget {args.budget}\n\n" + table(rows))
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
