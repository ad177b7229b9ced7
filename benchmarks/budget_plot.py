"""Step time against the memory budget: the plot of benchmarks/offload.py's result rows, which
benchmarks/pressure.py also draws of its minmem probes (as such rows, ``pressure.minmem_rows``).

A row is a dict of offload.py's: ``model``, ``batch`` (absent in pressure.py's rows), ``method``
(``pytorch``, ``mucudnn``, ``mucudnn-run``, ``compile``, or another method drawn as an anchor), ``budget_bytes``
(None: unconstrained), ``status``, ``step_ms``, ``peak_reserved``; a ``part: min`` row carries
``min_budget_gib``, a compile row ``compile_fraction``. Its own module, so that neither benchmark
imports the other for it.

One panel per model and batch. The x axis is memory in GiB: a budget for mucudnn, PyTorch under a
cap and the other offload methods; the peak reserved for PyTorch unconstrained and torch.compile
(its knob is a fraction, not a size: the cap only has to hold it); the published peak for MONeT.

``python -m benchmarks.budget_plot A/offload.json [B/offload.json ...] --out PLOT.png``: one plot of
the rows of several runs (e.g. one device call per budget).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

GiB = 2**30

# MONeT (Shah, Wu, Mohan, Chidambaram, Krähenbühl, "Memory Optimization for Deep Networks", ICLR
# 2021, arXiv:2010.14501): the Results tables of its repository's README (github.com/utsaslab/MONeT,
# the paper's ResNet-50 and VGG-16 curves), per (model, batch): PyTorch's peak and MONeT's (peak,
# compute overhead in % of PyTorch's iteration). Their "GB" is GiB: the solver turns a budget in GB
# into KB by 1024 * 1024 (monet/cvxpy_solver.py, GB_TO_KB) and schedule.py reports
# torch.cuda.max_memory_allocated() / 2**20 as MB. Their peak is allocated memory of forward and
# backward (V100, PyTorch 1.5, no optimizer state); the overhead is of forward + backward.
MONET_PUBLISHED = {
    ("resnet50", 184): {"pytorch_gib": 15.06,
                        "points": ((10.01, 3.22), (9.01, 4.68), (8.01, 5.56), (6.99, 7.28),
                                   (6.00, 9.31), (4.99, 11.95))},
    ("vgg16", 176): {"pytorch_gib": 14.12,
                     "points": ((9.71, -5.30), (8.66, -4.64), (7.88, -2.18), (6.82, 1.99),
                                (5.90, 5.44), (5.51, 9.11))},
}
MONET_LABEL = "MONeT (published, ×this run's PyTorch step)"
MONET_PYTORCH_LABEL = "PyTorch as MONeT measured it (published, ×this run's step)"


# the methods drawn as a curve over their budgets: mucudnn.torch through its API (``mucudnn``) and
# through the CLI with the shim (``mucudnn-run``, as a user runs it), PyTorch under a cap
CURVES = ("mucudnn", "mucudnn-run", "pytorch")
#: statuses of rows that were not run to an outcome of their own (the driver's time budget spent
#: before or while they ran; a method the model does not support): no failure on the plot
NOT_RUN = ("skipped", "out_of_time", "unsupported")
#: how the legend names the outcome of a run that did not train, by its status
OUTCOMES = {"oom": "ran out of memory", "timeout": "passed its timeout"}


def trains(row: dict) -> bool:
    """Every step ran: a mucudnn step that ran out of memory would have ended a user's script."""
    return row.get("status") == "ok" and not row.get("failed_steps")


def monet_points(model: str, batch: int | None, pytorch_step_ms: float | None) -> dict | None:
    """MONeT's published points for ``model`` at ``batch``, each at its published GiB and its
    published overhead applied to ``pytorch_step_ms`` (this run's unconstrained PyTorch step);
    None where MONeT published nothing for that model and batch, or there is no step to scale."""
    published = MONET_PUBLISHED.get((model, batch))
    if published is None or not pytorch_step_ms:
        return None
    return {"points": [(gib, pytorch_step_ms * (1 + percent / 100))
                       for gib, percent in published["points"]],
            "pytorch": (published["pytorch_gib"], pytorch_step_ms)}


def plot_series(rows: list[dict], model: str, batch: int | None = None) -> dict:
    """What the plot draws for ``model`` (at ``batch``; None: whatever batch its rows have):
    mucudnn's and capped PyTorch's step time against the budget (every run that trained: table,
    sweeps, search probes), the anchors (PyTorch unconstrained at its peak reserved, the other
    methods at their budget), torch.compile's runs at their peak reserved, MONeT's published points
    where they exist for the model and batch, the minima found and the budgets where a run
    failed."""
    mine = [r for r in rows if r["model"] == model and r.get("part") not in ("min",)
            and (batch is None or r.get("batch") == batch)]

    def curve(method):
        return sorted({(r["budget_bytes"] / GiB, r["step_ms"]) for r in mine
                       if r["method"] == method and r.get("budget_bytes") and trains(r)})

    anchors = []
    unconstrained = [r for r in mine
                     if r["method"] == "pytorch" and r.get("budget_bytes") is None and trains(r)]
    for r in mine:
        if r in unconstrained:
            anchors.append((f"pytorch unconstrained (peak {r['peak_reserved'] / GiB:.1f} GiB)",
                            r["peak_reserved"] / GiB, r["step_ms"]))
        elif r["method"] not in CURVES + ("compile",) and r.get("budget_bytes") \
                and trains(r):
            anchors.append((f"{r['method']}@{r['budget_bytes'] / GiB:g}GiB "
                            f"(peak {r['peak_reserved'] / GiB:.1f} GiB)",
                            r["budget_bytes"] / GiB, r["step_ms"]))
    compiled = sorted((r["peak_reserved"] / GiB, r["step_ms"], r.get("compile_fraction"))
                      for r in mine if r["method"] == "compile" and trains(r))
    # the batch MONeT's numbers must match: the one asked for, else that of PyTorch's own run
    batches = {r.get("batch") for r in unconstrained}
    reference = statistics.median(r["step_ms"] for r in unconstrained) if unconstrained else None
    monet = monet_points(model, batch if batch is not None else
                         (batches.pop() if len(batches) == 1 else None), reference)
    minima = [(f"{r['method']} min {r['min_budget_gib']:g} GiB", r["min_budget_gib"])
              for r in rows if r["model"] == model and r.get("part") == "min"
              and (batch is None or r.get("batch") == batch) and r.get("min_budget_gib")]
    # budget -> {what ended the run: the methods it ended there}, for the runs that did not
    # train where no other row of the same method and budget trained (rows of several calls)
    trained = {(r["method"], r["budget_bytes"]) for r in mine if r.get("budget_bytes")
               and trains(r)}
    failed: dict[float, dict] = {}
    for r in mine:
        if r.get("budget_bytes") and r.get("status") not in NOT_RUN + ("ok",) and \
                (r["method"], r["budget_bytes"]) not in trained:
            outcome = OUTCOMES.get(r.get("status"), r.get("status") or "failed")
            methods = failed.setdefault(r["budget_bytes"] / GiB, {}).setdefault(outcome, [])
            if r["method"] not in methods:
                methods.append(r["method"])
    return {**{method: curve(method) for method in CURVES}, "anchors": anchors,
            "compile": compiled, "monet": monet, "minima": minima,
            "failures": sorted(failed), "failed_methods": failed}


def plot(rows: list[dict], path: Path) -> bool:
    """The plot, if matplotlib is installed; a failure to draw is said, never raised (the runs
    after it matter more)."""
    try:
        return _plot(rows, path)
    except Exception as exc:  # noqa: BLE001
        print(f"no plot: {type(exc).__name__}: {exc}", flush=True)
        return False


# one colour and marker per anchored method, so that its points at several budgets read as one
# method's (the anchor's label starts with its method, then "@" or " ")
ANCHOR_STYLES = {"pytorch": ("s", "C1"), "save_on_cpu": ("v", "C2"), "ondemand": ("^", "C4"),
                 "checkpoint": ("P", "C6")}
# a y range wider than this ratio is drawn on a log scale: host-bound offload (save_on_cpu) can be
# ten times PyTorch's step, which would flatten the differences between the rest
LOG_Y_RATIO = 3.0


def anchor_method(label: str) -> str:
    return label.split("@")[0].split(" ")[0]


def _plot(rows: list[dict], path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return False
    panels = list(dict.fromkeys((r["model"], r.get("batch")) for r in rows))
    fig, axes = plt.subplots(1, len(panels), figsize=(7.5 * len(panels), 4.5), squeeze=False)
    for ax, (model, batch) in zip(axes[0], panels):
        series = plot_series(rows, model, batch)
        # colours no anchor takes (ANCHOR_STYLES, compile's C9)
        for method, label, style, colour in (
                ("mucudnn", "mucudnn.torch.fit (no shim)", "s-", "C0"),
                ("mucudnn-run", "mucudnn run --offload", "o-", "C3"),
                ("pytorch", "PyTorch under the budget", "^--", "C7")):
            if series[method]:
                ax.plot(*zip(*series[method]), style, color=colour, label=label)
        for method in dict.fromkeys(anchor_method(label) for label, _, _ in series["anchors"]):
            points = sorted((x, y) for label, x, y in series["anchors"]
                            if anchor_method(label) == method)
            marker, colour = ANCHOR_STYLES.get(method, ("s", "C5"))
            if len(points) > 1:
                ax.plot(*zip(*points), "-", lw=0.6, color=colour)
        labelled = set()   # one legend entry per label (several runs' unconstrained PyTorch)
        for label, x, y in series["anchors"]:
            marker, colour = ANCHOR_STYLES.get(anchor_method(label), ("s", "C5"))
            ax.plot([x], [y], marker, color=colour,
                    label=label if label not in labelled else "_nolegend_")
            labelled.add(label)
        if series["compile"]:
            xs, ys, fractions = zip(*series["compile"])
            ax.plot(xs, ys, "D-", color="C9", label="torch.compile activation_memory_budget f "
                                                    "(at its peak reserved)")
            for x, y, fraction in series["compile"]:
                if fraction is not None:
                    ax.annotate(f"f={fraction:g}", (x, y), textcoords="offset points",
                                xytext=(4, -10), fontsize=6, color="C9")
        if series["monet"]:
            ax.plot(*zip(*series["monet"]["points"]), "*:", color="k", markersize=9,
                    label=MONET_LABEL)
            ax.plot(*series["monet"]["pytorch"], "*", color="k", markersize=11,
                    markerfacecolor="none", label=MONET_PYTORCH_LABEL)
        for label, x in series["minima"]:
            ax.axvline(x, ls="--", lw=1, color="C3" if label.startswith("mucudnn") else "C7",
                       label=label)
        for x in series["failures"]:
            ax.axvline(x, color="grey", lw=0.5, ls=":",
                       label=f"{x:g} GiB: " + "; ".join(
                           f"{', '.join(methods)} {outcome}"
                           for outcome, methods in series["failed_methods"][x].items()))
        ax.set(title=model if batch is None else f"{model} N={batch}", ylabel="step time (ms)",
               xlabel="GiB: budget (compile: peak reserved; MONeT: published peak)")
        low, high = ax.get_ylim()
        if low > 0 and high / low > LOG_Y_RATIO:
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
            ax.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="one plot of the rows of offload.json files")
    parser.add_argument("rows", nargs="+", help="offload.json files (benchmarks/offload.py's)")
    parser.add_argument("--out", required=True, help="the PNG to write")
    args = parser.parse_args(argv)
    rows = [row for path in args.rows for row in json.loads(Path(path).read_text())]
    if not plot(rows, Path(args.out)):
        print("no plot written (is matplotlib installed?)", file=sys.stderr)
        return 1
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
