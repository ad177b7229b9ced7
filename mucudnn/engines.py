"""Names of cuDNN graph-API engine configurations, and which API a plan piece runs through.

A plan piece names either a legacy algorithm (``implicit_precomp_gemm``, run through
``cudnnConvolution*``) or an *engine configuration* of cuDNN's graph ("backend") API, the way
PyTorch's default path runs convolutions: an engine, by its global index, with knob choices.

Grammar (docs/plan-format.md), all integers in canonical decimal (no sign on ``G`` and ``T``, no
leading zeros, no ``-0``)::

    eng<G>                              engine G with its default knobs
    eng<G>.k<T>=<V>.k<T>=<V>...         with knob choices: knob type T, value V (int64)

Knob types are listed strictly ascending, so one configuration has exactly one name: the name is
its identity in the store and in plan files. A name lists at most :data:`MAX_KNOBS` knobs (the
shim's limit; cuDNN 9.19's configurations have up to 8).
"""

from __future__ import annotations

import dataclasses
import enum
import re

from .errors import EngineNameError, MucudnnError

PREFIX = "eng"
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
INT32_MAX = (1 << 31) - 1  # knob types are a C enum
MAX_KNOBS = 16  # MU_MAX_KNOBS in shim/src/internal.h

# At most 19 digits: every int64 fits, and int() is never asked for a number past its digit limit
# (ValueError); the ranges themselves are EngineConfig's.
_NUMBER = r"(?:0|[1-9][0-9]{0,18})"
_NAME = re.compile(rf"eng({_NUMBER})((?:\.k{_NUMBER}=(?:0|-?[1-9][0-9]{{0,18}}))*)")
_KNOB = re.compile(r"\.k([0-9]+)=(-?[0-9]+)")


class Api(str, enum.Enum):
    """The cuDNN API a measurement or plan piece uses."""

    LEGACY = "legacy"  # cudnnConvolutionForward & co., legacy algorithm names
    GRAPH = "graph"    # the graph (backend) API, engine configuration names


#: What ``--api`` accepts: one API, or both.
API_CHOICES = (*(api.value for api in Api), "both")


def select_apis(choice: str) -> frozenset[Api]:
    """The APIs an ``--api`` value stands for."""
    if choice == "both":
        return frozenset(Api)
    try:
        return frozenset({Api(choice)})
    except ValueError:
        raise MucudnnError(f"api {choice!r} is not one of {', '.join(API_CHOICES)}") from None


def api_of(algo: str) -> Api:
    """GRAPH for an engine name (``eng…``), LEGACY for anything else (an algorithm name)."""
    return Api.GRAPH if algo.startswith(PREFIX) else Api.LEGACY


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """An engine (global index) with knob choices ``(type, value)``, sorted by type."""

    global_index: int
    knobs: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        knobs = tuple((int(t), int(v)) for t, v in self.knobs)
        object.__setattr__(self, "knobs", knobs)
        if not 0 <= self.global_index <= INT64_MAX:
            raise EngineNameError(f"engine global index {self.global_index} is not in "
                                  f"0..{INT64_MAX}")
        for knob_type, value in knobs:
            if not 0 <= knob_type <= INT32_MAX:
                raise EngineNameError(f"knob type {knob_type} is not in 0..{INT32_MAX}")
            if not INT64_MIN <= value <= INT64_MAX:
                raise EngineNameError(f"knob {knob_type} value {value} is not an int64")
        if len(knobs) > MAX_KNOBS:
            raise EngineNameError(f"{len(knobs)} knob choices, at most {MAX_KNOBS} can be named")
        types = [t for t, _ in knobs]
        if any(a >= b for a, b in zip(types, types[1:])):
            raise EngineNameError(f"knob types {types} are not strictly ascending (one choice "
                                  "per knob, sorted by type)")

    @classmethod
    def with_knobs(cls, global_index: int, knobs) -> "EngineConfig":
        """From knob choices in any order (as cuDNN lists them)."""
        return cls(global_index, tuple(sorted((int(t), int(v)) for t, v in knobs)))

    @property
    def name(self) -> str:
        return format_engine_name(self)

    def __str__(self) -> str:
        return self.name


def format_engine_name(config: EngineConfig) -> str:
    """``eng<G>`` followed by ``.k<T>=<V>`` for each knob choice."""
    return PREFIX + str(config.global_index) + "".join(f".k{t}={v}" for t, v in config.knobs)


def parse_engine_name(name: str) -> EngineConfig:
    """The configuration a name stands for; :class:`EngineNameError` says why it is not one."""
    match = _NAME.fullmatch(name)
    if match is None:
        raise EngineNameError(f"engine name {name!r} is not eng<G> or eng<G>.k<T>=<V>... "
                              "(canonical decimal integers)")
    knobs = tuple((int(t), int(v)) for t, v in _KNOB.findall(match.group(2)))
    try:
        return EngineConfig(int(match.group(1)), knobs)
    except EngineNameError as exc:
        raise EngineNameError(f"engine name {name!r}: {exc}") from None


# -- numerical notes in a measurement's note ------------------------------------------------------

_NOTES_LABEL = "numerical notes: "
#: Notes of engines whose results round like the legacy FFT/Winograd algorithms (``--precise``).
TRANSFORM_NOTES = frozenset({"fft", "winograd", "winograd_tile_4x4", "winograd_tile_6x6",
                             "winograd_tile_13x13"})


def format_numerical_notes(notes) -> str:
    """The note an OK graph-API row carries: ``numerical notes: fft, tensor_core`` (lower case,
    sorted), or ``numerical notes: none``."""
    return _NOTES_LABEL + (", ".join(sorted(note.lower() for note in notes)) or "none")


def numerical_notes(note: str) -> frozenset[str]:
    """The notes :func:`format_numerical_notes` wrote into ``note`` (empty for any other note);
    what follows a ``"; "`` (e.g. the benchmarker's "timed once") is not a note."""
    listed = note[len(_NOTES_LABEL):] if note.startswith(_NOTES_LABEL) else "none"
    listed = listed.split("; ", 1)[0]
    return frozenset() if listed == "none" else frozenset(listed.split(", "))


# Transform-based algorithms (FFT, Winograd) round differently: in fp32 with TF32 off they were
# measured 1e-4 to 5e-3 away from a float64 reference where GEMM-based ones stay near 1e-6
# (benchmarks/results). ``tune --precise`` keeps plans to the GEMM-based ones, and off the graph
# API's engines whose numerical notes say FFT or Winograd.
TRANSFORM_ALGORITHMS = frozenset({"fft", "fft_tiling", "winograd", "winograd_nonfused"})


def is_transform_based(row) -> bool:
    """Whether a measurement row (``algo``, ``note``) is a legacy FFT/Winograd algorithm, or an
    engine whose numerical notes say FFT/Winograd."""
    if api_of(row.algo) is Api.GRAPH:
        return bool(numerical_notes(row.note) & TRANSFORM_NOTES)
    return row.algo in TRANSFORM_ALGORITHMS


# cuDNN documents these legacy algorithms as non-deterministic (atomic adds): the shim runs a plan
# with them only for callers that did not choose a deterministic algorithm or engine
# (shim/src/directions.c holds the same list). ``tune --deterministic`` keeps plans off them, and
# off engines noted NONDETERMINISTIC or whose notes were not stored.
NONDETERMINISTIC_ALGORITHMS = {"fwd": frozenset(), "bwd_data": frozenset({"algo_0"}),
                               "bwd_filter": frozenset({"algo_0", "algo_3"})}


def is_nondeterministic(row, direction=None) -> bool:
    """Whether a measurement row (``key``, ``algo``, ``note``) may give other bits on another run;
    ``direction`` (``"fwd"``, ``"bwd_data"``, ``"bwd_filter"``) defaults to the key's."""
    if api_of(row.algo) is Api.GRAPH:
        return not row.note.startswith(_NOTES_LABEL) or "nondeterministic" in numerical_notes(row.note)
    if direction is None:
        direction = row.key.split(",", 1)[0].partition("=")[2]
    return row.algo in NONDETERMINISTIC_ALGORITHMS[str(getattr(direction, "value", direction))]
