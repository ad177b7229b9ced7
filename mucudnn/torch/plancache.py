"""Offload plans kept between runs of a training script (torch-free): the second run of the same
script under the same budget loads the plan the first run settled on, and its first step runs
that plan, with no recording step and no solve.

Where: ``$XDG_CACHE_HOME/mucudnn/offload-plans/`` (``~/.cache/mucudnn/offload-plans/``, beside
online tuning's files), or the directory ``MUCUDNN_PLAN_CACHE`` names; ``MUCUDNN_PLAN_CACHE=off``
keeps none. One JSON file per :class:`PlanKey`, named by the key's hash; the key is stored in the
file too and compared on load, so a hash collision or an edited file is a miss, never a wrong
plan. The file is also a profile document (``profiles.FORMAT``'s fields): ``mucudnn offload-plan
FILE`` replays it.

The contract with the session (``OffloadSession``, which holds the PyTorch side):

1. **Look up**, once, where a budget is planned for (no ``modes``, no ``force``): at the first
   step's first leaf module, before it runs (the device is its input's; where it was given no
   tensor, at the step's first save, before that group is packed)::

       cache = PlanCache.from_environment(say)
       key = PlanKey.make(budget, options, gpu_name=torch.cuda.get_device_name(device),
                          gpu_memory=torch.cuda.get_device_properties(device).total_memory,
                          torch_version=torch.__version__,
                          cudnn_version=torch.backends.cudnn.version())
       entry = cache.load(key)

   ``options``: every session option that changes which plan is made or how it runs (headroom,
   lookahead, recompute, recompute_convolutions, staging, copy_exposure, trials, keep_apart,
   min_bytes, plan_time_limit_s, ...), by name. The script and its arguments come from
   ``sys.argv``, mucudnn's version from ``mucudnn._version``.
2. **No entry** (None: no file, the cache off, or a file not used, which ``load`` said in one
   line): record and plan as on any first run. A key with no file of its own is answered by the
   script's latest entry where there is one (:meth:`PlanKey.for_script`, the key less its
   arguments; ``store`` writes it beside each entry), with one line: the same script, budget,
   options, GPU and versions run with other arguments (``--epochs``, a learning rate) mostly
   saves the same step, and the check of rule 3 records anew where it does not.
3. **An entry**: the session takes ``entry.profile`` as its profile, ``entry.plan`` as the plan
   in force (its modes, lookahead, prefetch and release margins, releases, target, keep_apart),
   ``entry.kept_after_trial``, and where ``entry.stage`` is set the stage with
   ``entry.recorded_profile`` as its recorded profile. No trial runs: the entry is the plan a
   trial kept. Its first step runs the plan, and the session checks it against
   ``entry.signature`` as it goes:

   - as group ``index`` is first saved: ``entry.signature.check_group(index, nbytes, producer,
     offloadable, recompute_source)`` (what is not known yet is left out: not checked);
   - at the step's end: ``entry.signature.check_step(groups, unpacks, first_unpacks,
     last_unpacks)`` on the profile's clock (backward points; a group never unpacked at the last).

   Each returns None where the step is as recorded, else a one-line reason (``group 12: 96.0 MiB
   recorded, 48.0 MiB now (the batch changed?)``). On a reason the session drops the entry, says
   ``the cached offload plan does not fit this step: <reason>; recording anew`` in one info line,
   runs the rest of the step's groups as a recording step runs them (offloaded, fetched on
   demand) and records from the next step as on a first run (the mixed step is no recording).
   Offload and recompute are exact whatever the plan, so a mismatch risks memory, never a
   gradient. A staged entry's profile and signature number the groups as a staged step saves
   them: its stage's modules are the chain of ``entry.stage.modules`` the first leaf module
   starts (``stage.chain_of``), and that first step runs staged; where no such chain starts
   there, the session says so in one line and records anew.
4. **Store**: ``cache.store(key, CachedPlan.make(plan, profile, recorded_profile=...,
   stage=..., kept_after_trial=...))`` when the plan in force settles: its trial is over (the
   plan kept), or it was made where no trial runs; again whenever a later plan replaces it (a
   lowering after flushes, a replan after a step ran out of memory). On falling back to
   offloading everything: ``cache.forget(key)``, so the next run records anew instead of
   repeating a plan that ran out of memory. Once the plan in force has run its first armed
   steps (``rescue.ARMED_STEPS``) with none running out of memory, its entry is stored again
   with ``proven=True`` (where it was stored before that), and a run that loads a proven entry
   arms the out-of-memory rescue in its first step only (rescue.py, rule 5).

5. **The floor** (:class:`StepFloor`): where a run finds its budget below what its step needs
   at least (no plan met it: the least peak any plan reached; or a step with every saved tensor
   offloaded ran out of device memory), ``cache.store_floor(key, StepFloor(...))`` records it
   for the step under any budget (:meth:`PlanKey.for_any_budget`), the finding that rules out
   more kept. A later run whose look-up (rule 1) finds no entry reads ``cache.load_floor(key)``
   and, where it rules the run's budget out, says so in one warning line before its first step
   runs, naming the least budget the finding leaves. A plan that meets a budget the record
   rules out removes the record (``forget_floor_below``).

Neither ``load``, ``store`` nor ``forget`` raises for what the file system or the file holds: a
corrupt, unreadable or newer-format file is a miss with one line through ``say`` (the file is
left as it is until this key's entry replaces it); a directory that cannot be made or written is
one line, after which nothing more is stored in this process (the training goes on). Entries are
written atomically (a temporary file in the same directory, then ``os.replace``), so processes
storing the same key at once (torchrun's ranks) leave one whole entry, the last one's, and a
reader sees a whole entry or none.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import numbers
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

from .._version import __version__
from ..errors import MucudnnError
from ..settings import setting, user_cache_dir
from ..sizes import format_size
from . import profiles
from .planner import LEAST_HEADROOM, MODES, OffloadPlan, StepProfile, profile_from_dict
from .planner_stage import Stage

#: the entry format this module writes and the only one it reads (a file's ``plan_cache_format``)
FORMAT = 1
#: the setting naming the directory, or ``off``
SETTING = "MUCUDNN_PLAN_CACHE"
OFF = "off"
#: the cache's directory under :func:`mucudnn.settings.user_cache_dir`
DIRECTORY_NAME = "offload-plans"


def _arguments(arguments: tuple[str, ...] | None) -> str:
    """A run's arguments as its line names them (the first 80 characters)."""
    if not arguments:
        return "no arguments"
    text = " ".join(arguments)
    return "the arguments '" + (text if len(text) <= 80 else text[:77] + "...") + "'"


class PlanCacheError(MucudnnError):
    """A plan cache key made of values that are not plain (JSON) values."""


def _plain(name: str, value):
    """``value`` as the key holds it: JSON's scalars (a NumPy number as Python's), sequences as
    tuples."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real) and not isinstance(value, float):
        value = float(value)
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise PlanCacheError(f"plan cache key: {name} is {value}, not a finite number")
        return value
    if isinstance(value, (list, tuple)):
        return tuple(_plain(name, item) for item in value)
    raise PlanCacheError(f"plan cache key: {name} is a {type(value).__name__}, not a plain "
                         "value (a number, a string, a bool, None or a list of those)")


def _jsonable(value):
    return [_jsonable(item) for item in value] if isinstance(value, tuple) else value


@dataclass(frozen=True)
class PlanKey:
    """What must be equal for a cached plan to apply to this run."""

    #: None in :meth:`for_any_budget`'s key, which names the step's floor record
    budget: int | None
    #: the session's planning options, (name, value) sorted by name
    options: tuple[tuple[str, object], ...]
    gpu_name: str
    gpu_memory: int
    torch_version: str
    cudnn_version: str | None
    mucudnn_version: str
    #: the script's resolved path (``sys.argv[0]``; as given where it names no file: ``-c``)
    script: str
    #: its arguments; None in :meth:`for_script`'s key, which names the script's latest entry
    arguments: tuple[str, ...] | None

    @classmethod
    def make(cls, budget: int, options: Mapping[str, object], *, gpu_name: str,
             gpu_memory: int, torch_version: str, cudnn_version, argv: Sequence[str] | None = None,
             mucudnn_version: str = __version__) -> PlanKey:
        """The key of a run: ``argv`` is ``sys.argv`` unless given; ``cudnn_version`` as
        PyTorch says it (an int, or None without cuDNN). :class:`PlanCacheError` for an option
        whose value is not plain."""
        argv = list(sys.argv if argv is None else argv)
        script = argv[0] if argv else ""
        if script and os.path.isfile(script):
            script = os.path.realpath(script)
        return cls(budget=int(budget),
                   options=tuple(sorted((str(name), _plain(f"option {name!r}", value))
                                        for name, value in options.items())),
                   gpu_name=str(gpu_name), gpu_memory=int(gpu_memory),
                   torch_version=str(torch_version),
                   cudnn_version=None if cudnn_version is None else str(cudnn_version),
                   mucudnn_version=str(mucudnn_version), script=script,
                   arguments=tuple(str(arg) for arg in argv[1:]))

    @property
    def names_a_script(self) -> bool:
        """Whether the key's script is a path (not ``-c``, not an interactive session): only a
        script's runs share its latest entry (:meth:`for_script`)."""
        return os.path.isabs(self.script)

    def for_script(self) -> PlanKey:
        """This key whatever the script's arguments: the name of the script's latest entry,
        which a run with other arguments (``--epochs``, a learning rate, an output directory)
        tries where its own has none (:meth:`PlanCache.load`)."""
        return dataclasses.replace(self, arguments=None)

    def for_any_budget(self) -> PlanKey:
        """This key whatever the budget: the name of the step's floor record
        (:class:`StepFloor`), which a run under any budget reads before its first step."""
        return dataclasses.replace(self, budget=None)

    def document(self) -> dict:
        """The key as the file keeps it (JSON's types)."""
        return {"budget": self.budget, "options": {n: _jsonable(v) for n, v in self.options},
                "gpu": {"name": self.gpu_name, "memory": self.gpu_memory},
                "torch": self.torch_version, "cudnn": self.cudnn_version,
                "mucudnn": self.mucudnn_version, "script": self.script,
                "arguments": None if self.arguments is None else list(self.arguments)}

    def digest(self) -> str:
        """The hash of :meth:`document` naming the entry's file."""
        text = json.dumps(self.document(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


class _Unchecked:
    def __repr__(self) -> str:
        return "UNCHECKED"


#: an argument of :meth:`StepSignature.check_group` the session does not know yet
UNCHECKED = _Unchecked()


def _sizes(recorded: int, now: int) -> tuple[str, str]:
    """Two sizes as a person reads them, in bytes where the short forms are alike."""
    a, b = format_size(recorded), format_size(now)
    return (a, b) if a != b else (f"{recorded} bytes", f"{now} bytes")


def _sources(value) -> str:
    return "no recipe" if value is None else \
        "a recipe reading group" + ("s " if len(value) != 1 else " ") + \
        ", ".join(map(str, value))


@dataclass(frozen=True)
class GroupSignature:
    """What the first step under a cached plan checks of one saved group."""

    nbytes: int
    producer: str
    offloadable: bool
    #: the groups its recipe reads (None: no timed recipe: the plan never recomputes it)
    recompute_source: tuple[int, ...] | None
    first_unpack: int
    last_unpack: int


@dataclass(frozen=True)
class StepSignature:
    """The saved groups of the step a plan was made for, as a step run under it shows them."""

    groups: tuple[GroupSignature, ...]
    #: backward points (every unpack counts)
    unpacks: int

    @classmethod
    def of(cls, profile: StepProfile) -> StepSignature:
        return cls(tuple(GroupSignature(
            g.nbytes, g.producer, g.offloadable,
            None if g.recompute_source is None else tuple(g.recompute_source),
            g.first_unpack, g.last_unpack) for g in profile.groups), profile.unpacks)

    def check_group(self, index: int, nbytes: int, producer: str | None = None,
                    offloadable: bool | None = None, recompute_source=UNCHECKED) -> str | None:
        """None where group ``index``, first saved now, is the recorded one, else why not in
        one line. None (:data:`UNCHECKED` for ``recompute_source``, whose None means no recipe):
        not known yet, not checked. A recipe is checked only where the recorded group had one:
        the plan may recompute only those."""
        if not 0 <= index < len(self.groups):
            return (f"group {index}: the recorded step saved {len(self.groups)} groups, this one "
                    "saves more (the model or its input changed?)")
        group = self.groups[index]
        if producer is not None and producer != group.producer:
            return (f"group {index}: made by {group.producer or 'an unnamed op'} recorded, by "
                    f"{producer or 'an unnamed op'} now (the model changed?)")
        if nbytes != group.nbytes:
            recorded, now = _sizes(group.nbytes, nbytes)
            return f"group {index}: {recorded} recorded, {now} now (the batch changed?)"
        if offloadable is not None and bool(offloadable) != group.offloadable:
            said = ("offloadable", "not offloadable")
            return (f"group {index}: {said[not group.offloadable]} recorded, "
                    f"{said[not offloadable]} now (its layout changed?)")
        if recompute_source is not UNCHECKED and group.recompute_source is not None:
            now = None if recompute_source is None else tuple(recompute_source)
            if now != group.recompute_source:
                return (f"group {index}: {_sources(group.recompute_source)} recorded, "
                        f"{_sources(now)} now (the model changed?)")
        return None

    def check_step(self, groups: int, unpacks: int | None = None,
                   first_unpacks: Sequence[int | None] | None = None,
                   last_unpacks: Sequence[int | None] | None = None) -> str | None:
        """None where the step that ended (``groups`` saved, ``unpacks`` backward points; per
        group its first and last backward point, None: never unpacked, the last point as the
        profile has it) is the recorded one, else why not in one line. None: not checked."""
        if groups != len(self.groups):
            return (f"{len(self.groups)} saved groups recorded, {groups} now (the model or its "
                    "input changed?)")
        if unpacks is not None and unpacks != self.unpacks:
            return (f"{self.unpacks} backward points recorded, {unpacks} now (the backward "
                    "changed?)")
        last_point = max((self.unpacks if unpacks is None else unpacks) - 1, 0)
        for index, group in enumerate(self.groups):
            first = _at(first_unpacks, index, last_point)
            last = _at(last_unpacks, index, last_point)
            if (first is not None and first != group.first_unpack) or \
                    (last is not None and last != group.last_unpack):
                now = f"{group.first_unpack if first is None else first}-" \
                      f"{group.last_unpack if last is None else last}"
                return (f"group {index}: unpacked at backward points {group.first_unpack}-"
                        f"{group.last_unpack} recorded, {now} now (the backward changed?)")
        return None

    def document(self) -> dict:
        return {"unpacks": self.unpacks,
                "groups": [[g.nbytes, g.producer, g.offloadable,
                            None if g.recompute_source is None else list(g.recompute_source),
                            g.first_unpack, g.last_unpack] for g in self.groups]}

    @classmethod
    def from_document(cls, fields: Mapping) -> StepSignature:
        """ValueError for fields that are not a signature."""
        try:
            groups = tuple(GroupSignature(int(n), str(p), bool(o),
                                          None if s is None else tuple(int(i) for i in s),
                                          int(f), int(last))
                           for n, p, o, s, f, last in fields["groups"])
            return cls(groups, int(fields["unpacks"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a step signature ({exc})") from None


def _at(values: Sequence[int | None] | None, index: int, missing: int) -> int | None:
    if values is None or index >= len(values):
        return None
    return missing if values[index] is None else values[index]


@dataclass(frozen=True)
class CachedPlan:
    """A plan a session settled on, with all it needs to run it again without recording."""

    plan: OffloadPlan
    #: the profile the plan was made on (the staged one where ``stage`` is set)
    profile: StepProfile
    #: of ``profile``: what a step run under the plan is checked against
    signature: StepSignature
    #: the plan's one-line description (``OffloadPlan.describe``), for the session's line
    description: str
    #: the recorded profile, where the plan stages (``profile`` is then the staged one)
    recorded_profile: StepProfile | None = None
    stage: Stage | None = None
    #: how a trial's kept plan was made (``planning.trial_plans``' label; None: as made)
    kept_after_trial: str | None = None
    #: a run of the script ran the plan's first armed steps (``rescue.ARMED_STEPS``) with no
    #: step running out of memory: a later run arms its first step only (rescue.py, rule 5)
    proven: bool = False
    #: loaded: the arguments of the run that stored it (not part of what it is)
    arguments: tuple[str, ...] | None = dataclasses.field(default=None, compare=False)

    @classmethod
    def make(cls, plan: OffloadPlan, profile: StepProfile, *,
             recorded_profile: StepProfile | None = None, stage: Stage | None = None,
             kept_after_trial: str | None = None, proven: bool = False) -> CachedPlan:
        """The entry for ``plan`` made on ``profile``; ValueError where they do not go
        together (a mode per group, a stage with its recorded profile)."""
        entry = cls(plan, profile, StepSignature.of(profile), plan.describe(),
                    recorded_profile, stage, kept_after_trial, proven)
        problem = entry._problem()
        if problem:
            raise ValueError(f"not a plan to cache: {problem}")
        return entry

    def _problem(self) -> str | None:
        groups = len(self.profile.groups)
        if len(self.plan.modes) != groups or any(m not in MODES for m in self.plan.modes):
            return f"{len(self.plan.modes)} modes (of {', '.join(MODES)}) for {groups} groups"
        if len(self.plan.releases) not in (0, groups):
            return f"{len(self.plan.releases)} release points for {groups} groups"
        if (self.stage is None) != (self.recorded_profile is None):
            return "a stage goes with the recorded profile it was made from, and only then"
        if self.stage is not None:
            return _stage_problem(self.stage)
        return None

    def document(self, key: PlanKey) -> dict:
        """The file's JSON: a profile document (``profiles.load_profile`` reads it) with the key,
        the signature and the whole plan."""
        plan = self.plan
        document = {"format": profiles.FORMAT, "plan_cache_format": FORMAT,
                    "key": key.document(), "budget": key.budget, "target": plan.target,
                    "plan": self.description, "modes": list(plan.modes),
                    "releases": list(plan.releases), "release_margin": plan.release_margin,
                    "fell_back": False, "kept_after_trial": self.kept_after_trial,
                    "proven": self.proven,
                    "offload_plan": dataclasses.asdict(plan),
                    "signature": self.signature.document(),
                    "profile": dataclasses.asdict(self.profile)}
        if self.stage is not None:
            document.update(stage=dataclasses.asdict(self.stage),
                            recorded_profile=dataclasses.asdict(self.recorded_profile))
        return document

    @classmethod
    def from_document(cls, document: Mapping) -> CachedPlan:
        """The entry in a file's JSON (its key and format checked by the caller); ValueError,
        one line, for anything that is not one."""
        try:
            profile = profile_from_dict(document["profile"])
            fields = dict(document["offload_plan"])
            fields["modes"] = tuple(fields["modes"])
            fields["releases"] = tuple(fields.get("releases", ()))
            plan = OffloadPlan(**fields)
            stage = recorded = None
            if document.get("stage") is not None:
                stage = Stage(**document["stage"])
                recorded = profile_from_dict(document["recorded_profile"])
            kept = document.get("kept_after_trial")
            entry = cls(plan, profile, StepSignature.from_document(document["signature"]),
                        str(document["plan"]), recorded, stage,
                        kept if isinstance(kept, str) else None,
                        document.get("proven") is True)
        except KeyError as exc:
            raise ValueError(f"no {exc.args[0]!r}") from None
        except (TypeError, AttributeError) as exc:
            raise ValueError(str(exc)) from None
        problem = entry._problem()
        if problem is None and entry.signature != StepSignature.of(profile):
            problem = "its signature is not its profile's"
        if problem:
            raise ValueError(problem)
        return entry


@dataclass(frozen=True)
class StepFloor:
    """What an earlier run of a step (its script, arguments, options, GPU and versions, under
    any budget: :meth:`PlanKey.for_any_budget`) found of the least memory it needs, so that a
    run under a budget below that is told so before its first step.

    Two findings, the stronger kept (:meth:`needs`): no plan met the run's budget, the least
    peak any plan reached on its recorded step being ``least_peak``; or, ``least_peak`` None,
    the run ran out of device memory in a step with every saved tensor offloaded (its
    recording, or after falling back), before any plan."""

    #: the budget of the run that found it
    budget: int
    least_peak: int | None = None
    #: the least share of a budget its runs leave as headroom (the session's headroom, or
    #: planner.LEAST_HEADROOM where that is less: its smaller headrooms go down to there)
    least_headroom: float = LEAST_HEADROOM

    def needs(self) -> int:
        """The least budget this finding does not rule out: one whose planning target at the
        least headroom reaches ``least_peak``, or one byte over the budget that ran out."""
        if self.least_peak is None:
            return self.budget + 1
        return math.ceil(self.least_peak / (1 - self.least_headroom))

    def rules_out(self, budget: int) -> bool:
        return budget < self.needs()

    def line(self, budget: int) -> str:
        """The one line a run under ``budget`` (ruled out) is told before its first step."""
        found = (f"a run of it under {format_size(self.budget)} found no offload plan, the least "
                 f"peak any plan reached being {format_size(self.least_peak)}"
                 if self.least_peak is not None else
                 f"a run of it under {format_size(self.budget)} ran out of device memory with "
                 "every saved tensor offloaded")
        wanted = (f"at least {format_size(self.needs())}" if self.least_peak is not None
                  else f"more than {format_size(self.budget)}")
        return (f"the {format_size(budget)} memory budget is below what this training step needs "
                f"at least: {found} (the same script, arguments, options, GPU and versions); "
                f"give it {wanted}, or it is likely to run out of device memory")

    def document(self, key: PlanKey) -> dict:
        return {"plan_cache_format": FORMAT, "floor": True, "key": key.document(),
                "budget": self.budget, "least_peak": self.least_peak,
                "least_headroom": self.least_headroom}


def _stage_problem(stage: Stage) -> str | None:
    """What makes ``stage`` no stage a run can stage its first step with (a cached run uses its
    modules' count and its micro-batches as they are); None where it is one."""
    def whole(value) -> bool:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if not (whole(stage.modules) and stage.modules >= 1 and whole(stage.chunks)
            and stage.chunks >= 1 and whole(stage.recorded_chunks) and stage.recorded_chunks >= 1):
        return f"a stage of {stage.modules!r} modules in {stage.chunks!r} micro-batches"
    if not all(whole(value) and value >= 0 for value in
               (stage.first_group, stage.end_group, stage.input_bytes)) or \
            stage.input_group is not None and not (whole(stage.input_group)
                                                   and stage.input_group >= 0) or \
            not isinstance(stage.forward_ms, numbers.Real) or isinstance(stage.forward_ms, bool):
        return f"a stage of groups {stage.first_group!r}..{stage.end_group!r} that is none"
    if not isinstance(stage.input_saved, bool):
        return f"a stage whose input_saved is {stage.input_saved!r}, not true or false"
    return None


def _whole(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


#: the largest size a floor record may hold (an exabyte: no GPU's; a float holds it exactly)
LARGEST_SIZE = 2**60


def _shown(value) -> str:
    """``repr(value)`` for a line, at most 40 characters."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _size(value) -> bool:
    """A size of bytes a record may hold: a whole number from 1 to :data:`LARGEST_SIZE`."""
    return _whole(value) and 1 <= value <= LARGEST_SIZE


def _plain_number(value):
    """JSON for a NumPy or torch scalar handed in as a number."""
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


class PlanCache:
    """The directory of cached plans (None: no cache), and the session's ``say`` for its
    lines."""

    def __init__(self, directory: str | os.PathLike | None,
                 say: Callable[[str], None] | None = None):
        self.directory = Path(directory) if directory is not None else None
        self.say = say if say is not None else (lambda text: None)
        #: why nothing more is stored in this process (None: entries are stored)
        self.not_storing: str | None = None

    @classmethod
    def from_environment(cls, say: Callable[[str], None] | None = None,
                         environ: Mapping[str, str] | None = None) -> PlanCache:
        """The cache ``MUCUDNN_PLAN_CACHE`` asks for: unset or empty, the user's cache
        directory's; ``off``, none; else that directory. A value the setting does not accept is
        one line, and the default."""
        environ = os.environ if environ is None else environ
        value = environ.get(SETTING, "")
        default = user_cache_dir() / DIRECTORY_NAME
        problem = setting(SETTING).problem(value)
        if problem:
            made = cls(default, say)
            made.say(f"{SETTING}={value!r} is not valid ({problem}); offload plans are cached "
                     f"in {default}")
            return made
        if not value.strip():
            return cls(default, say)
        if value.strip().lower() == OFF:
            return cls(None, say)
        return cls(Path(value).expanduser(), say)

    @property
    def enabled(self) -> bool:
        return self.directory is not None

    def path_for(self, key: PlanKey) -> Path | None:
        """The entry's file for ``key`` (None: no cache)."""
        return None if self.directory is None else self.directory / f"{key.digest()}.json"

    def load(self, key: PlanKey) -> CachedPlan | None:
        """The entry stored for ``key``, else None: no file (silent), no cache, or a file not
        used (one line: unreadable, corrupt, another format, another key). Where ``key`` has no
        file, the script's latest entry (:meth:`PlanKey.for_script`: stored by a run of the same
        script, budget, options, GPU and versions with other arguments), with one line: its
        first step is checked against the entry's signature as any cached plan's is, so a run
        whose arguments change the step records anew."""
        path = self.path_for(key)
        if path is None:
            return None
        found, entry = self._read(path, lambda stored: stored == key.document(),
                                  "another run's key (an edited file, or another key of the "
                                  "same hash)")
        if found or key.arguments is None or not key.names_a_script:
            return entry
        script_key = key.for_script().document()
        found, entry = self._read(
            self.path_for(key.for_script()),
            lambda stored: isinstance(stored, dict) and {**stored, "arguments": None} ==
            script_key, "another script's key (an edited file, or another key of the same hash)")
        if entry is not None:
            self.say(f"no offload plan is cached for this script's arguments; its first step "
                     f"runs the one cached for {_arguments(entry.arguments)}, checked as it goes")
        return entry

    def _read(self, path: Path, accepts: Callable, other_key: str
              ) -> tuple[bool, CachedPlan | None]:
        """(whether ``path`` is there, its entry where it can be used); one line where it is
        there but not used. ``accepts``: whether the key the file holds is one it may answer."""
        try:
            text = path.read_text(encoding="utf-8")
        except (FileNotFoundError, NotADirectoryError):   # no entry (no directory) there
            return False, None
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            return True, self._unused(path, f"it cannot be read ({reason})")
        try:
            document = json.loads(text)
        except ValueError as exc:
            return True, self._unused(path, f"it is not JSON ({exc})")
        except RecursionError:
            return True, self._unused(path, "it is not JSON (nested too deep)")
        if not isinstance(document, dict):
            return True, self._unused(path, "it is not a plan cache entry")
        version = document.get("plan_cache_format")
        profile_version = document.get("format")
        for name, value, newest in (("plan_cache_format", version, FORMAT),
                                    ("format", profile_version, profiles.FORMAT)):
            if isinstance(value, bool) or not isinstance(value, int):
                return True, self._unused(path, f"it has no {name} (not a plan cache entry)")
            if value > newest:
                return True, self._unused(path, f"it was written by a newer mucudnn ({name} "
                                                f"{value}, this one reads {newest})")
        if version != FORMAT or profile_version != profiles.FORMAT:
            return True, self._unused(path, f"it was written by an older mucudnn "
                                            f"(plan_cache_format {version}, format "
                                            f"{profile_version})")
        if not accepts(document.get("key")):
            return True, self._unused(path, f"it holds {other_key}")
        try:
            entry = CachedPlan.from_document(document)
        except ValueError as exc:
            return True, self._unused(path, f"it is not a whole plan cache entry ({exc})")
        arguments = document["key"].get("arguments")
        return True, dataclasses.replace(
            entry, arguments=tuple(map(str, arguments)) if isinstance(arguments, list) else None)

    def _unused(self, path: Path, reason: str) -> None:
        self.say(f"the cached offload plan {path} is not used: {reason}; recording anew")
        return None

    def store(self, key: PlanKey, entry: CachedPlan) -> bool:
        """Write ``entry`` as ``key``'s, replacing what was there, atomically; whether it was
        written. A directory that cannot be made or written: one line, and nothing more is
        stored in this process."""
        path = self.path_for(key)
        if path is None or self.not_storing is not None:
            return False
        text = self._text(entry.document(key), "the offload plan was not cached")
        if text is None:
            return False
        from ..outputs import write_text_atomically
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomically(path, text)
            if key.arguments is not None and key.names_a_script:   # its latest (:meth:`load`)
                write_text_atomically(self.path_for(key.for_script()), text)
        except OSError as exc:
            reason = exc.strerror if exc.strerror else exc
            self.not_storing = f"{path.parent}: {reason}"
            self.say(f"offload plans are not cached: {path} cannot be written ({reason}); "
                     f"training goes on without a plan cache ({SETTING} names another "
                     "directory, or off)")
            return False
        return True

    def _text(self, document: dict, unkept: str) -> str | None:
        """``document`` as a file's JSON (a NumPy or torch number as a plain one); None where it
        holds a value JSON cannot, with one line beginning ``unkept``."""
        try:
            return json.dumps(document, default=_plain_number) + "\n"
        except (TypeError, ValueError) as exc:   # a value handed in that JSON cannot hold
            self.say(f"{unkept}: {exc}")
            return None

    def floor_path(self, key: PlanKey) -> Path | None:
        """The step's floor record for ``key`` (any budget; None: no cache)."""
        if self.directory is None:
            return None
        return self.directory / f"{key.for_any_budget().digest()}.floor.json"

    def load_floor(self, key: PlanKey) -> StepFloor | None:
        """The floor an earlier run of ``key``'s step under any budget found, else None: no
        record (silent), no cache, or a record not used (one line: unreadable, not one, another
        key, another format)."""
        path = self.floor_path(key)
        if path is None:
            return None
        try:
            document = json.loads(path.read_text(encoding="utf-8"))
        except (FileNotFoundError, NotADirectoryError):
            return None
        except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else \
                "nested too deep" if isinstance(exc, RecursionError) else exc
            return self._floor_unused(path, f"it cannot be read as JSON ({reason})")
        if not isinstance(document, dict) or document.get("floor") is not True:
            return self._floor_unused(path, "it is not a floor record")
        if document.get("plan_cache_format") != FORMAT:
            return self._floor_unused(path, f"it has plan_cache_format "
                                            f"{document.get('plan_cache_format')!r}, this "
                                            f"mucudnn reads {FORMAT}")
        if document.get("key") != key.for_any_budget().document():
            return self._floor_unused(path, "it holds another run's key (an edited file, or "
                                            "another key of the same hash)")
        budget, least = document.get("budget"), document.get("least_peak")
        headroom = document.get("least_headroom")
        if not _size(budget) or least is not None and not _size(least) or \
                isinstance(headroom, bool) or not isinstance(headroom, (int, float)) or \
                not 0 <= headroom < 1:
            return self._floor_unused(path, f"its budget {_shown(budget)}, least peak "
                                            f"{_shown(least)} and least headroom "
                                            f"{_shown(headroom)} are not a floor's")
        return StepFloor(budget, least, float(headroom))

    def _floor_unused(self, path: Path, reason: str) -> None:
        self.say(f"the offload floor record {path} is not used: {reason}")
        return None

    def store_floor(self, key: PlanKey, floor: StepFloor) -> bool:
        """Record ``floor`` for ``key``'s step, where it rules out more than the record there
        (``StepFloor.needs``); whether it was written. As :meth:`store`, atomically; a
        directory that cannot be written is one line."""
        path = self.floor_path(key)
        if path is None or self.not_storing is not None:
            return False
        if not _size(floor.budget) or floor.least_peak is not None and \
                not _size(floor.least_peak):   # not one load_floor would read back
            return False
        known = self._quietly(lambda: self.load_floor(key))
        if known is not None and known.needs() >= floor.needs():
            return False
        text = self._text(floor.document(key.for_any_budget()),
                          "the offload floor was not recorded")
        if text is None:
            return False
        from ..outputs import write_text_atomically
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomically(path, text)
        except OSError as exc:
            self.say(f"the offload floor was not recorded: {path} cannot be written "
                     f"({exc.strerror or exc})")
            return False
        return True

    def forget_floor_below(self, key: PlanKey, budget: int) -> bool:
        """Remove ``key``'s step's floor record where it rules ``budget`` out, which a plan has
        just met (the record was wrong: another workspace, a changed model); whether it did."""
        path = self.floor_path(key)
        known = self._quietly(lambda: self.load_floor(key)) if path is not None else None
        if known is None or not known.rules_out(budget):
            return False
        try:
            path.unlink()
        except OSError:
            return False
        return True

    def _quietly(self, read: Callable):
        """``read()`` with this cache's lines silenced (a record that is not used is replaced)."""
        say, self.say = self.say, (lambda text: None)
        try:
            return read()
        finally:
            self.say = say

    def forget(self, key: PlanKey) -> bool:
        """Remove ``key``'s entry (this cache's own file; nothing else); whether one was there.
        A file that cannot be removed is one line."""
        path = self.path_for(key)
        if path is None:
            return False
        if key.arguments is not None and key.names_a_script:
            self._forget_script_entry(key)
        try:
            path.unlink()
        except FileNotFoundError:
            return False
        except OSError as exc:
            self.say(f"the cached offload plan {path} was not removed "
                     f"({exc.strerror or exc})")
            return False
        return True

    def _forget_script_entry(self, key: PlanKey) -> None:
        """The script's latest entry removed where it is ``key``'s own (a run of other
        arguments stored since keeps theirs)."""
        script_path = self.path_for(key.for_script())
        try:
            stored = json.loads(script_path.read_text(encoding="utf-8")).get("key")
        except (OSError, UnicodeDecodeError, ValueError, AttributeError):
            return
        if stored == key.document():
            try:
                script_path.unlink()
            except OSError:
                pass

