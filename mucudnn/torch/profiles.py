"""Recorded step profiles read back off the GPU (torch-free), for ``mucudnn offload-plan`` and
benchmarks/offload.py's ``replay``.

Two kinds of file hold a profile:

- a session's document (``OffloadSession(profile_to=...)``, ``MUCUDNN_OFFLOAD_PROFILE``): one JSON
  object with ``profile`` (:class:`~mucudnn.torch.planner.StepProfile`'s fields), ``budget``,
  ``target``, ``plan`` (its description, None where none met the target), ``modes``, ... and
  ``format`` (:data:`FORMAT`; a document without it is format 1, written before the field);
- benchmarks/offload.py's ``offload.json``: a list of rows, those of mucudnn's configurations
  with ``profile`` and ``budget_bytes`` (a row's ``format``, where it has one, is read as a
  document's).

A file of a newer format than :data:`FORMAT` is refused: its fields may mean what this reader
does not know.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import MucudnnError
from . import planner
from . import planning
from .plan_runner import FIRST, TRIALS, PlanMaker, PlanRequest
from .planner import OffloadPlan, StepProfile, profile_from_dict
from .planner_stage import Stage

#: the format ``OffloadSession.write_profile`` writes and the newest this module reads
FORMAT = 2
#: the format of a document without a ``format`` field
UNVERSIONED = 1

# OffloadSession's defaults (runtime.py; a test holds them equal), so that a replay plans as an
# unconfigured session does without importing torch
HEADROOM = 0.1
LOOKAHEAD = 2
PLAN_TIME_LIMIT_S = 20.0
KEEP_APART = False


class ProfileFormatError(MucudnnError):
    """A profile file of a format newer than :data:`FORMAT`."""


@dataclass(frozen=True)
class RecordedProfile:
    """One recorded step as a file keeps it."""

    profile: StepProfile
    #: the budget it was recorded under (None: the file does not say)
    budget: int | None
    #: what the session planned for (None: not said)
    target: int | None
    #: the recorded plan's description (None: no plan, or not said)
    plan: str | None
    #: the chain the session staged (the profile is then the staged one), else None
    stage: Stage | None
    format: int
    #: the file, and for offload.json ``row K`` and the row's configuration
    source: str
    #: the whole document (or row), its ``profile`` as the file has it
    document: dict = field(repr=False, compare=False)

    def get(self, key, default=None):
        """A field of the document as the file has it (``modes``, ``fell_back``, ...)."""
        return self.document.get(key, default)


def _format(path, data: dict) -> int:
    value = data.get("format", UNVERSIONED)
    if isinstance(value, bool) or not isinstance(value, int) or value < UNVERSIONED:
        raise MucudnnError(f"{path}: format {value!r} is not a profile format "
                           f"({UNVERSIONED} to {FORMAT})")
    if value > FORMAT:
        raise ProfileFormatError(f"{path}: profile format {value} is newer than this mucudnn "
                                 f"reads ({FORMAT}); replay it with a newer mucudnn")
    return value


def _size(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def load_profile(path, row: int | None = None) -> RecordedProfile:
    """The recorded step in ``path``: a session's document or, from offload.json's rows, the
    ``row``-th that has a profile (the first without ``row``). :class:`MucudnnError` naming the
    file, one line, for anything else (unreadable, not JSON, no profile, a bad one, a format newer
    than :data:`FORMAT`: :class:`ProfileFormatError`)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise MucudnnError(f"{path}: cannot be read as JSON ({reason})") from None
    source = str(path)
    if isinstance(data, list):
        rows = [r for r in data if isinstance(r, dict) and r.get("profile")]
        index = row or 0
        if not 0 <= index < len(rows):
            raise MucudnnError(f"{path}: {len(rows)} rows with a profile, no row {index}")
        data = rows[index]
        source = f"{path} row {index}" + (f" ({data['config']})" if data.get("config") else "")
    elif row:
        raise MucudnnError(f"{path}: one session's document, no rows (no row {row})")
    if not isinstance(data, dict) or not isinstance(data.get("profile"), dict):
        raise MucudnnError(f"{path}: no recorded profile in it (MUCUDNN_OFFLOAD_PROFILE's file, "
                           "or offload.json)")
    version = _format(path, data)
    try:
        profile = profile_from_dict(data["profile"])
    except ValueError as exc:
        raise MucudnnError(f"{path}: {exc}") from None
    stage = None
    if isinstance(data.get("stage"), dict):
        try:
            stage = Stage(**data["stage"])
        except TypeError as exc:
            raise MucudnnError(f"{path}: not a recorded stage: {exc}") from None
    plan = data.get("plan")
    return RecordedProfile(profile=profile,
                           budget=_size(data.get("budget")) or _size(data.get("budget_bytes")),
                           target=_size(data.get("target")),
                           plan=plan if isinstance(plan, str) else None, stage=stage,
                           format=version, source=source, document=data)


@dataclass(frozen=True)
class Replayed:
    """What :func:`replay` planned for one budget."""

    budget: int
    #: the target the plan met: the headroom's, or a smaller headroom's where that had no plan
    target: int
    plan: OffloadPlan | None
    #: why the headroom's target had no plan (None: it had one)
    error: MucudnnError | None
    #: wall seconds of :func:`planning.plan_with_prefetch`, with the smaller headrooms tried
    plan_s: float
    #: :func:`planning.trial_plans`' (label, plan), None where not asked for or there is no plan
    trials: list[tuple[str, OffloadPlan]] | None = None
    trials_s: float | None = None


def replay(profile: StepProfile, budget: int, headroom: float = HEADROOM,
           lookahead: int = LOOKAHEAD, time_limit_s: float | None = PLAN_TIME_LIMIT_S,
           trials: bool = False, keep_apart: bool = KEEP_APART,
           method: str = planning.FAST) -> Replayed:
    """The plan an :class:`OffloadSession` with these options makes for ``budget`` after
    recording ``profile`` (its first plan, before any step runs it; the session's own
    :class:`~.plan_runner.PlanMaker`, no stage weighed): for
    :func:`planner.planning_target`, else, where no plan meets that (an
    :class:`InfeasibleError`), for the smaller headrooms of
    :func:`planning.plan_with_less_headroom`; with ``trials``, the others the session would run
    against it (:func:`planning.trial_plans`; for smaller headrooms too, unless the target was
    lowered). A solver's failure at the first target (a plan may exist) leaves no plan, as in
    the session. ``method``: the planner's (planning.py: the session's fast one, or the ILP).
    The plan is the full search's: a session with trials puts its quick construction's plan in
    force first, and this one replaces it where it is predicted faster (plan_runner.py,
    ``PlanRequest.quick``)."""
    maker = PlanMaker(lookahead, time_limit_s, method)
    first = maker(PlanRequest(FIRST, profile, planner.planning_target(budget, headroom),
                              budget=budget, headroom=headroom))
    plan, error = first.plan, first.error
    if not trials or plan is None:
        return Replayed(budget, first.target, plan, error, first.seconds)
    larger = planner.trial_budgets(budget, headroom) if error is None else ()
    made = maker(PlanRequest(TRIALS, profile, first.target, plan=plan, larger_budgets=larger,
                             keep_apart=keep_apart))
    return Replayed(budget, first.target, plan, error, first.seconds, list(made.trials),
                    made.seconds)


GROUPS_HEADER = (f"{'group':>5s} {'mode':9s} {'MiB':>9s} {'recompute ms':>12s} {'unpacks':>9s}  "
                 "producer")


def group_lines(profile: StepProfile, modes) -> list[str]:
    """One line per saved group under :data:`GROUPS_HEADER`: its index, its mode in ``modes``,
    size, recompute time (- without a recipe), backward points that read it and producer."""
    lines = []
    for index, (group, mode) in enumerate(zip(profile.groups, modes)):
        recompute = "-" if group.recompute_ms is None else f"{group.recompute_ms:.2f}"
        unpacks = f"{group.first_unpack}-{group.last_unpack}"
        lines.append(f"{index:5d} {mode:9s} {group.nbytes / 2**20:9.1f} {recompute:>12s} "
                     f"{unpacks:>9s}  {group.producer}")
    return lines
