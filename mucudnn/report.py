"""Human-readable views of plans: the table ``mucudnn show`` prints."""

from __future__ import annotations

import dataclasses
from collections import Counter
from itertools import groupby

from .plan import Plan, PlanEntry, Restrictions
from .problem import DataType, MathType
from .sizes import format_size

#: What a math type in an f32 kernel's key means for PyTorch (docs/configs.md).
_F32_MATH = {
    MathType.FMA: "TF32 off, as PyTorch with torch.backends.cudnn.allow_tf32 = False",
    MathType.DEFAULT: "TF32 allowed, PyTorch's default",
}


@dataclasses.dataclass(frozen=True)
class PlanRow:
    entry: PlanEntry
    undivided_ms: float | None   # best undivided algorithm within the same limit
    unlimited_ms: float | None   # best undivided algorithm with no limit (uncapped cuDNN)

    @property
    def speedup(self) -> float | None:
        return self.undivided_ms / self.entry.time_ms if self.undivided_ms and self.entry.time_ms else None

    @property
    def vs_unlimited(self) -> float | None:
        return self.unlimited_ms / self.entry.time_ms if self.unlimited_ms and self.entry.time_ms else None


def describe_kernel(entry: PlanEntry) -> str:
    """Short kernel name: ``fwd c64 56x56 k64 f3x3 s1 p1``."""
    p = entry.problem
    text = (f"{p.direction.value} c{p.c} {'x'.join(map(str, p.input_size))} k{p.k} "
            f"f{'x'.join(map(str, p.filter_size))}")
    if any(s != 1 for s in p.stride):
        text += f" s{'x'.join(map(str, p.stride))}"
    if p.groups != 1:
        text += f" g{p.groups}"
    return text


def describe_pieces(entry: PlanEntry) -> str:
    """Runs of equal pieces: ``2x128 implicit_precomp_gemm``; ``*`` marks pieces that borrow the
    output as workspace (``85* gemm``)."""
    parts = []
    for (batch, algo, _, borrow), run in groupby(
            entry.pieces, key=lambda p: (p.batch, p.algo, p.math, p.borrow)):
        count = len(list(run))
        size = f"{batch}{'*' if borrow else ''}"
        parts.append(f"{count}x{size} {algo}" if count > 1 else f"{size} {algo}")
    return ", ".join(parts)


def describe_math(plan: Plan) -> str:
    """The math types of the plan's kernel keys, with how many kernels each (a front plan's
    points of one kernel count once) and, for f32 data, whether that is PyTorch's default:
    ``math: fma (TF32 off, ...) 26 kernels``."""
    problems = (plan.get(key, n).problem for key, n in plan.kernels())
    counts = Counter((problem.dtype, problem.math) for problem in problems)
    parts = []
    for (dtype, math), count in sorted(counts.items(), key=lambda item: -item[1]):
        meaning = _F32_MATH.get(math) if dtype is DataType.FLOAT else None
        parts.append(f"{dtype.value} math={math.value}" + (f" ({meaning})" if meaning else "")
                     + f": {count} kernel{'s' if count != 1 else ''}")
    return "math: " + ("; ".join(parts) if parts else "no kernels")


def describe_restrictions(rules: Restrictions) -> str:
    """Which rows the plan and its baselines were chosen from, in words."""
    apis = {"both": "legacy algorithms and graph-API engines", "legacy": "legacy algorithms only",
            "graph": "graph-API engines only"}.get(rules.api, rules.api)
    text = f"pieces and baselines from: {apis}"
    if rules.precise:
        text += ", no FFT/Winograd (--precise)"
    if rules.exclude:
        text += f", excluding {', '.join(rules.exclude)}"
    return text


def plan_rows(plan: Plan, store=None, env=None) -> list[PlanRow]:
    """One row per entry, its baselines under the plan's own restrictions; a front plan's kernels
    each with their points fastest first; a WD plan's kernel is compared with undivided algorithms
    within the workspace the plan gave it."""
    from .tuner import baselines
    rows = []
    entries = ([e for key, n in plan.kernels() for e in reversed(plan.front(key, n))]
               if plan.is_front else list(plan))
    for entry in entries:
        limit = plan.limit if plan.strategy == "wr" else entry.workspace
        base = (baselines(store, env, entry, limit, plan.restrictions) if store is not None
                else (None, None))
        rows.append(PlanRow(entry, *base))
    return rows


def _ratio(value: float | None) -> str:
    return f"{value:.2f}x" if value else "-"


def _ms(value: float | None) -> str:
    return f"{value:.3f}" if value is not None else "-"


def _front_header(plan: Plan) -> str:
    """``FRONT (...) no limit`` or ``FRONT (...) limit 64.0 MiB``, and how many points."""
    from .plan import NO_LIMIT
    limit = "no limit" if plan.limit == NO_LIMIT else f"limit {format_size(plan.limit)}"
    return (f"FRONT (each call runs the fastest point within its workspace), {limit}, policy "
            f"{plan.policy}, {len(plan.kernels())} kernels, {len(plan)} points")


def format_plan_table(plan: Plan, rows: list[PlanRow]) -> str:
    """The table ``mucudnn show`` prints. In a front plan each kernel's points follow each other,
    fastest first, the kernel named on the first; ``point`` numbers them (1: the fastest) and the
    totals are those of the fastest points."""
    limit_name = "limit per kernel" if plan.strategy == "wr" else "total budget"
    header = (f"plan: {plan.gpu}, cuDNN {plan.cudnn}, "
              + (_front_header(plan) if plan.is_front else
                 f"{plan.strategy.upper()} {limit_name} {format_size(plan.limit)}, policy "
                 f"{plan.policy}, {len(plan)} kernels")
              + f"\n{describe_math(plan)}\n{describe_restrictions(plan.restrictions)}")
    columns = ("kernel", "N") + (("point",) if plan.is_front else ()) + (
        "micro-batches", "workspace", "plan ms", "undiv ms", "speedup", "uncapped ms",
        "vs uncapped")
    table = [columns]
    for r in rows:
        e = r.entry
        points = plan.front(e.key, e.n)
        first = points[-1] is e  # the fastest: the first row of its kernel
        point = ((f"{len(points) - points.index(e)}/{len(points)}",) if plan.is_front else ())
        table.append((describe_kernel(e) if first else "", str(e.n) if first else "") + point
                     + (describe_pieces(e), format_size(e.workspace), _ms(e.time_ms),
                        _ms(r.undivided_ms), _ratio(r.speedup), _ms(r.unlimited_ms),
                        _ratio(r.vs_unlimited)))
    text_columns = (0, columns.index("micro-batches"))
    smallest = [r for r in rows if plan.front(r.entry.key, r.entry.n)[0] is r.entry]
    rows = [r for r in rows if plan.get(r.entry.key, r.entry.n) is r.entry]  # the totals' rows
    total_plan = sum(r.entry.time_ms for r in rows)
    known = [r for r in rows if r.undivided_ms is not None and r.unlimited_ms is not None]
    widths = [max(len(row[i]) for row in table) for i in range(len(columns))]
    lines = [header, ""]
    for i, row in enumerate(table):
        lines.append("  ".join(cell.ljust(w) if j in text_columns else cell.rjust(w)
                               for j, (cell, w) in enumerate(zip(row, widths))).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines.append("")
    if any(piece.borrow for entry in plan for piece in entry.pieces):
        lines.append("*: the piece's workspace is the part of its output the later pieces write "
                     "(not in the workspace column)")
    if plan.is_front:
        lines.append(f"fastest points: {SUM_LABEL} {total_plan:.3f} ms; workspace: largest "
                     f"{format_size(max((r.entry.workspace for r in rows), default=0))}, all "
                     f"kernels {format_size(plan.total_workspace)}")
        least = sum(r.entry.time_ms for r in smallest)
        lines.append(f"smallest points: {SUM_LABEL} {least:.3f} ms; workspace: largest "
                     f"{format_size(max((r.entry.workspace for r in smallest), default=0))}, all "
                     f"kernels {format_size(sum(r.entry.workspace for r in smallest))}")
    else:
        lines.append(f"{SUM_LABEL}: plan {total_plan:.3f} ms; workspace: largest "
                     f"{format_size(plan.max_workspace)}, all kernels {format_size(plan.total_workspace)}")
    if known and len(known) == len(rows) and total_plan:
        undiv = sum(r.undivided_ms for r in known)
        unlim = sum(r.unlimited_ms for r in known)
        lines.append(f"{SUM_LABEL}: undivided within the limit {undiv:.3f} ms (plan "
                     f"{_faster(undiv, total_plan)}); uncapped {unlim:.3f} ms (plan "
                     f"{_faster(unlim, total_plan)})")
    return "\n".join(lines)


#: The label of Σ predicted time over a plan's kernels, each once; ``tune`` prints the same.
SUM_LABEL = "sum of kernel times (each kernel once)"


def _faster(baseline_ms: float, plan_ms: float) -> str:
    """``1.94x faster`` or ``1.49x slower``: the plan against a baseline, always a ratio >= 1;
    ``same time`` where the ratio is 1.00 at the two decimals printed."""
    ratio = f"{max(baseline_ms, plan_ms) / min(baseline_ms, plan_ms):.2f}"
    if ratio == "1.00":
        return "same time"
    return f"{ratio}x {'faster' if baseline_ms > plan_ms else 'slower'}"
