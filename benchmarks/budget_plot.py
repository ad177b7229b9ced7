"""Step time against the memory budget: the plot of benchmarks/offload.py's result rows, which
benchmarks/pressure.py also draws of its minmem probes (as such rows, ``pressure.minmem_rows``).

A row is a dict of offload.py's: ``model``, ``method`` (``pytorch``, ``mucudnn``, or another
method drawn as an anchor), ``budget_bytes`` (None: unconstrained), ``status``, ``step_ms``,
``peak_reserved``; a ``part: min`` row carries ``min_budget_gib``. Its own module, so that neither
benchmark imports the other for it.
"""

from __future__ import annotations

from pathlib import Path

GiB = 2**30


def trains(row: dict) -> bool:
    """Every step ran: a mucudnn step that ran out of memory would have ended a user's script."""
    return row.get("status") == "ok" and not row.get("failed_steps")


def plot_series(rows: list[dict], model: str) -> dict:
    """What the plot draws for ``model``: mucudnn's and capped PyTorch's step time against the
    budget (every run that trained: table, sweeps, search probes), the anchors (PyTorch
    unconstrained at its peak reserved, the other methods at their budget), the minima found and
    the budgets where a run failed."""
    mine = [r for r in rows if r["model"] == model and r.get("part") not in ("min",)]

    def curve(method):
        return sorted({(r["budget_bytes"] / GiB, r["step_ms"]) for r in mine
                       if r["method"] == method and r.get("budget_bytes") and trains(r)})

    anchors = []
    for r in mine:
        if r["method"] == "pytorch" and r.get("budget_bytes") is None and trains(r):
            anchors.append((f"pytorch unconstrained (peak {r['peak_reserved'] / GiB:.1f} GiB)",
                            r["peak_reserved"] / GiB, r["step_ms"]))
        elif r["method"] not in ("pytorch", "mucudnn") and r.get("budget_bytes") and trains(r):
            anchors.append((f"{r['method']} (peak {r['peak_reserved'] / GiB:.1f} GiB)",
                            r["budget_bytes"] / GiB, r["step_ms"]))
    minima = [(f"{r['method']} min {r['min_budget_gib']:g} GiB", r["min_budget_gib"])
              for r in rows if r["model"] == model and r.get("part") == "min"
              and r.get("min_budget_gib")]
    failures = sorted({r["budget_bytes"] / GiB for r in mine if r.get("budget_bytes")
                       and r.get("status") not in ("ok", "skipped", "unsupported")})
    return {"mucudnn": curve("mucudnn"), "pytorch": curve("pytorch"), "anchors": anchors,
            "minima": minima, "failures": failures}


def plot(rows: list[dict], path: Path) -> bool:
    """The plot, if matplotlib is installed; a failure to draw is said, never raised (the runs
    after it matter more)."""
    try:
        return _plot(rows, path)
    except Exception as exc:  # noqa: BLE001
        print(f"no plot: {type(exc).__name__}: {exc}", flush=True)
        return False


def _plot(rows: list[dict], path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        series = plot_series(rows, model)
        for method, label, style in (("mucudnn", "mucudnn.torch", "o-"),
                                     ("pytorch", "PyTorch under the budget", "^--")):
            if series[method]:
                ax.plot(*zip(*series[method]), style, label=label)
        for label, x, y in series["anchors"]:
            ax.plot([x], [y], "s", label=label)
        for label, x in series["minima"]:
            ax.axvline(x, ls="--", lw=1, color="C3" if label.startswith("mucudnn") else "C7",
                       label=label)
        for x in series["failures"]:
            ax.axvline(x, color="grey", lw=0.5, ls=":")
        ax.set(title=model, xlabel="budget (GiB)", ylabel="step time (ms)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
