"""Plan files (docs/plan-format.md): what the shim runs for each (kernel key, N).

:func:`read_plan` / :func:`write_plan` are the Python half of the contract; ``shim/src/plan.c`` is the
C half. Both are tested on the same files in ``tests/data/plans/``.
"""

from __future__ import annotations

import dataclasses
import io
import math as _math
import os
import re
import stat
from pathlib import Path
from typing import Iterable

from .engines import Api, api_of, is_nondeterministic, is_transform_based, parse_engine_name, select_apis
from .errors import EngineNameError, KeyFormatError, PlanError
from .outputs import write_text_atomically
from .policy import POLICIES  # noqa: F401 (the plan header's policy names)
from .problem import ALGORITHMS, ConvProblem, Direction, MathType

FORMAT_VERSION = 1
MAGIC = "mucudnn-plan"
HEADER_FIELDS = ("gpu", "cudnn", "strategy", "limit", "policy")
STRATEGIES = ("wr", "wd", "front")
#: ``strategy front``: each kernel's lines are the points of its time-workspace front.
FRONT = "front"
#: The ``limit`` of a ``front`` plan whose points may have any workspace.
NO_LIMIT = (1 << 64) - 1


@dataclasses.dataclass(frozen=True)
class PlanPiece:
    """``batch`` consecutive samples run with one algorithm and math type, or with one engine
    configuration of the graph API (``algo`` an engine name, mucudnn.engines).

    ``borrow``: the piece's workspace is the part of the output tensor that the pieces after it
    have not written yet, not the caller's workspace (forward and backward-data, beta = 0;
    docs/plan-format.md)."""

    batch: int
    algo: str
    math: MathType
    borrow: bool = dataclasses.field(default=False, kw_only=True)

    def __post_init__(self) -> None:
        object.__setattr__(self, "math", MathType(self.math))
        if self.batch < 1:
            raise ValueError(f"piece batch must be >= 1, got {self.batch}")

    @property
    def api(self) -> Api:
        return api_of(self.algo)

    def __str__(self) -> str:
        """The plan-file form ``B:ALGO:MATH``, or ``B:ALGO:MATH:out`` when it borrows
        (docs/plan-format.md)."""
        return f"{self.batch}:{self.algo}:{self.math.value}" + (f":{BORROW_MARK}" if self.borrow else "")


#: The suffix of a piece that borrows the output's unwritten part as its workspace.
BORROW_MARK = "out"


@dataclasses.dataclass(frozen=True)
class PlanEntry:
    """The plan of one kernel at one mini-batch size: one ``kernel`` line."""

    key: str
    n: int
    workspace: int
    time_ms: float
    pieces: tuple[PlanPiece, ...]

    @property
    def problem(self) -> ConvProblem:
        return ConvProblem.from_key(self.key, self.n)

    @property
    def is_divided(self) -> bool:
        return len(self.pieces) > 1


@dataclasses.dataclass(frozen=True)
class Restrictions:
    """Which measurements a plan was allowed to use (``tune --api``, ``--precise``,
    ``--exclude-algo``): its pieces and every baseline it is compared with come from the rows
    :meth:`usable` accepts. Written into the plan as a comment (:data:`RESTRICTIONS_MARK`)."""

    api: str = "both"
    precise: bool = False
    exclude: tuple[str, ...] = ()
    deterministic: bool = False

    def usable(self, row) -> bool:
        """Whether a measurement row (``key``, ``algo``, ``note``) may be a piece under these rules."""
        return (api_of(row.algo) in select_apis(self.api) and row.algo not in self.exclude
                and not (self.precise and is_transform_based(row))
                and not (self.deterministic and is_nondeterministic(row)))

    def __str__(self) -> str:
        return (f"api={self.api} precise={'yes' if self.precise else 'no'} "
                f"exclude={','.join(self.exclude)} deterministic={'yes' if self.deterministic else 'no'}")

    @classmethod
    def parse(cls, text: str) -> "Restrictions":
        """The inverse of ``str``; fields it does not know are ignored."""
        fields = dict(item.partition("=")[::2] for item in text.split())
        return cls(api=fields.get("api") or "both", precise=fields.get("precise") == "yes",
                   exclude=tuple(name for name in fields.get("exclude", "").split(",") if name),
                   deterministic=fields.get("deterministic") == "yes")


#: The comment line that carries a plan's :class:`Restrictions` (the shim and read_plan skip it
#: as any comment).
RESTRICTIONS_MARK = "# restrictions:"


@dataclasses.dataclass
class Plan:
    """A whole plan file: header plus its entries (``kernel`` lines), in the order added.

    In ``wr`` and ``wd`` plans a (key, N) has one entry. In a ``front`` plan the entries of one
    (key, N) are the points of its time-workspace front: each has another workspace, none over
    ``limit`` (docs/plan-format.md); :meth:`front` lists them."""

    gpu: str
    cudnn: int
    strategy: str
    limit: int
    policy: str
    entries: list[PlanEntry] = dataclasses.field(default_factory=list)
    #: Written as ``#`` lines after the first (readers ignore them): e.g. where the
    #: measurements came from. Not read back.
    comments: tuple[str, ...] = dataclasses.field(default=(), compare=False)
    restrictions: Restrictions = dataclasses.field(default_factory=Restrictions)
    # (key, N) -> its entries in the order added: kept by add(), rebuilt from ``entries`` when
    # that list's length shows it changed otherwise (entries are meant to be added with add()).
    _points: dict[tuple[str, int], list[PlanEntry]] = dataclasses.field(
        default_factory=dict, init=False, repr=False, compare=False)
    _indexed: int = dataclasses.field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        entries, self.entries = list(self.entries), []
        for entry in entries:
            self.add(entry)

    @property
    def is_front(self) -> bool:
        return self.strategy == FRONT

    def check(self, entry: PlanEntry) -> None:
        """Raise :class:`PlanError` (no file position) if ``entry`` cannot join this plan: the
        rules of docs/plan-format.md for a kernel line after the lines already added."""
        points = self._index().get((entry.key, entry.n), ())
        if not self.is_front:
            if points:
                raise PlanError(f"duplicate kernel {entry.key} n={entry.n}")
            return
        if any(p.workspace == entry.workspace for p in points):
            raise PlanError(f"duplicate kernel {entry.key} n={entry.n} workspace={entry.workspace} "
                            "(the points of a front each have another workspace)")
        if entry.workspace > self.limit:
            raise PlanError(f"workspace {entry.workspace} of kernel {entry.key} n={entry.n} is "
                            f"over the plan's limit {self.limit}")

    def add(self, entry: PlanEntry) -> None:
        self.check(entry)
        self._points.setdefault((entry.key, entry.n), []).append(entry)
        self.entries.append(entry)
        self._indexed = len(self.entries)

    def _index(self) -> dict[tuple[str, int], list[PlanEntry]]:
        if self._indexed != len(self.entries):
            self._points = {}
            for entry in self.entries:
                self._points.setdefault((entry.key, entry.n), []).append(entry)
            self._indexed = len(self.entries)
        return self._points

    def kernels(self) -> list[tuple[str, int]]:
        """Each (key, N) once, in the order first added."""
        return list(self._index())

    def front(self, key: str, n: int) -> tuple[PlanEntry, ...]:
        """The entries of (key, N) by workspace ascending (so time descending on a front): in a
        ``front`` plan its points, else its one entry; () if the plan has none."""
        return tuple(sorted(self._index().get((key, n), ()), key=lambda e: e.workspace))

    def get(self, key: str, n: int) -> PlanEntry | None:
        """The entry of (key, N); in a ``front`` plan its point with the largest workspace (the
        fastest, what a call with room for every point runs)."""
        points = self.front(key, n)
        return points[-1] if points else None

    def __iter__(self):
        return iter(self.entries)

    def __len__(self) -> int:
        """How many entries (``kernel`` lines): in a ``front`` plan, points."""
        return len(self.entries)

    @property
    def total_workspace(self) -> int:
        """Workspace of all kernels together, each at its :meth:`get` entry."""
        return sum(self.get(key, n).workspace for key, n in self.kernels())

    @property
    def max_workspace(self) -> int:
        return max((e.workspace for e in self), default=0)


# -- writing -------------------------------------------------------------------------------------

def format_plan(plan: Plan) -> str:
    out = io.StringIO()
    out.write("# mucudnn plan file: see docs/plan-format.md\n")
    for comment in plan.comments:
        out.write("".join(f"# {line}\n" for line in comment.splitlines()))
    out.write(f"{MAGIC} {FORMAT_VERSION}\n")
    out.write(f"gpu {plan.gpu}\ncudnn {plan.cudnn}\nstrategy {plan.strategy}\n")
    out.write(f"limit {plan.limit}\npolicy {plan.policy}\n")
    out.write(f"{RESTRICTIONS_MARK} {plan.restrictions}\n")
    for key, n in plan.kernels():
        for e in plan.front(key, n):  # a front's points by workspace ascending
            pieces = " ".join(str(p) for p in e.pieces)
            out.write(f"kernel {e.key} {e.n} {e.workspace} {e.time_ms:.6g} {pieces}\n")
    return out.getvalue()


def write_plan(plan: Plan, path: str | os.PathLike) -> None:
    """Write atomically (temporary file + rename) so a running shim never reads half a plan."""
    text = format_plan(plan)
    read_plan_text(text, source=str(path))  # never write what we could not read back
    write_text_atomically(path, text)


def read_restrictions(path: str | os.PathLike) -> Restrictions:
    """The :class:`Restrictions` comment a plan file carries (write_plan's); the defaults (every
    row usable) for a plan without one. Assumes a plan :func:`read_plan` has accepted."""
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.startswith(RESTRICTIONS_MARK):
            return Restrictions.parse(line[len(RESTRICTIONS_MARK):])
    return Restrictions()


# -- reading -------------------------------------------------------------------------------------

#: The largest plan file either reader takes (docs/plan-format.md; MU_PLAN_MAX_BYTES in plan.c).
MAX_PLAN_BYTES = 64 << 20
INT32_MAX = (1 << 31) - 1
UINT64_MAX = (1 << 64) - 1

_INTEGER = re.compile(r"0|[1-9][0-9]*")
_DECIMAL = re.compile(r"[0-9]+(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_BLANKS = re.compile(r"[ \t]+")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def read_plan(path: str | os.PathLike) -> Plan:
    """Read and check a plan file; :class:`PlanError` (``PATH:LINE: what``) says why not."""
    data = _read_regular_file(path, MAX_PLAN_BYTES, "plan file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise PlanError(f"{path}:{line}: not UTF-8 (byte 0x{data[exc.start]:02x})") from None
    return read_plan_text(text, source=str(path))


def _read_regular_file(path: str | os.PathLike, limit: int, what: str) -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes. Opened without blocking, so a FIFO
    is refused instead of waiting for a writer (and a device such as /dev/zero is never read)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise PlanError(f"{path}:0: cannot open {what}: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise PlanError(f"{path}:0: {what} is not a regular file")
        if info.st_size > limit:
            raise PlanError(f"{path}:0: {what} is larger than {limit} bytes")
        chunks, size = [], 0
        while size <= limit:  # the file may grow after fstat
            chunk = os.read(fd, min(1 << 20, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:
            raise PlanError(f"{path}:0: {what} is larger than {limit} bytes")
        return b"".join(chunks)
    except OSError as exc:
        raise PlanError(f"{path}:0: cannot read {what}: {exc.strerror}") from None
    finally:
        os.close(fd)


def _check_characters(line: str, where: str) -> None:
    """No control character but tab; UTF-8 encodable (docs/plan-format.md)."""
    bad = _CONTROL.search(line)
    if bad is not None:
        char = bad.group()
        what = ("a carriage return (lines end with \\n alone)" if char == "\r"
                else f"control character U+{ord(char):04X}")
        raise PlanError(f"{where}: {what}")
    try:
        line.encode("utf-8")
    except UnicodeEncodeError:
        raise PlanError(f"{where}: not UTF-8 (a lone surrogate)") from None


def read_plan_text(text: str, source: str = "<plan>") -> Plan:
    header: dict[str, str | int] = {}
    plan: Plan | None = None
    seen_magic = False
    for lineno, raw in enumerate(text.split("\n"), 1):
        where = f"{source}:{lineno}"
        _check_characters(raw, where)
        line = raw.strip(" \t")
        if not line or line.startswith("#"):
            continue
        word, rest = (_BLANKS.split(line, 1) + [""])[:2]
        if word != "gpu" and not line.isascii():
            raise PlanError(f"{where}: non-ASCII character outside a comment or the gpu value")
        if not seen_magic:
            if word != MAGIC:
                raise PlanError(f"{where}: not a mucudnn plan file (first record must be "
                                f"'{MAGIC} {FORMAT_VERSION}')")
            if rest != str(FORMAT_VERSION):
                raise PlanError(f"{where}: plan format version {rest!r} is not supported "
                                f"(this mucudnn reads version {FORMAT_VERSION}); re-run mucudnn tune")
            seen_magic = True
        elif word in HEADER_FIELDS:
            if plan is not None:
                raise PlanError(f"{where}: header record '{word}' after the first kernel line")
            if word in header:
                raise PlanError(f"{where}: header record '{word}' given twice")
            if not rest:
                raise PlanError(f"{where}: header record '{word}' has no value")
            header[word] = _header_value(word, rest, where)
        elif word == "kernel":
            if plan is None:
                plan = _plan_from_header(header, where)
            entry = _parse_kernel(rest, where)
            try:
                plan.add(entry)
            except PlanError as exc:
                raise PlanError(f"{where}: {exc}") from None
        else:
            raise PlanError(f"{where}: unknown record '{word}'")
    if not seen_magic:
        raise PlanError(f"{source}:0: empty plan file (first record must be "
                        f"'{MAGIC} {FORMAT_VERSION}')")
    return plan if plan is not None else _plan_from_header(header, f"{source}:{lineno}")


def _header_value(word: str, text: str, where: str) -> str | int:
    """One header record's value, checked on its own line (as the shim does)."""
    if word == "strategy" and text not in STRATEGIES:
        raise PlanError(f"{where}: strategy {text!r} is not one of {', '.join(STRATEGIES)}")
    if word == "policy" and text not in POLICIES:
        raise PlanError(f"{where}: policy {text!r} is not one of {', '.join(POLICIES)}")
    if word == "cudnn":
        return _int(text, "cudnn", where, 1, INT32_MAX)
    if word == "limit":
        return _int(text, "limit", where, 0, UINT64_MAX)
    return text


def _plan_from_header(header: dict[str, str | int], where: str) -> Plan:
    missing = [f for f in HEADER_FIELDS if f not in header]
    if missing:
        raise PlanError(f"{where}: missing header record(s) {', '.join(missing)} before the kernels")
    return Plan(**header)


def _int(text: str, what: str, where: str, minimum: int, maximum: int = INT32_MAX) -> int:
    """An integer of the plan grammar: ASCII digits, canonical, within [minimum, maximum]."""
    # The length test keeps int() off numbers past its digit limit (and off needless work).
    if (len(text) > len(str(maximum)) or not _INTEGER.fullmatch(text)
            or not minimum <= int(text) <= maximum):
        raise PlanError(f"{where}: {what} {text!r} is not an integer in {minimum}..{maximum}")
    return int(text)


def _parse_kernel(rest: str, where: str) -> PlanEntry:
    fields = _BLANKS.split(rest) if rest else []
    if len(fields) < 5:
        raise PlanError(f"{where}: kernel line needs KEY N WORKSPACE TIME PIECE..., got "
                        f"{len(fields)} field(s)")
    key, n_text, ws_text, time_text, *piece_texts = fields
    try:
        problem = ConvProblem.from_key(key)
    except KeyFormatError as exc:
        raise PlanError(f"{where}: {exc}") from None
    n = _int(n_text, "N", where, 1)
    workspace = _int(ws_text, "workspace", where, 0, UINT64_MAX)
    time_ms = float(time_text) if _DECIMAL.fullmatch(time_text) else _math.nan
    if not _math.isfinite(time_ms):
        raise PlanError(f"{where}: time {time_text!r} is not a finite decimal number >= 0")
    pieces = tuple(_parse_piece(t, problem, where) for t in piece_texts)
    total = sum(p.batch for p in pieces)
    if total != n:
        raise PlanError(f"{where}: micro-batches add up to {total}, not N = {n}")
    return PlanEntry(key=key, n=n, workspace=workspace, time_ms=time_ms, pieces=pieces)


def _parse_piece(text: str, problem: ConvProblem, where: str) -> PlanPiece:
    parts = text.split(":")
    borrow = len(parts) == 4 and parts[3] == BORROW_MARK
    if len(parts) != 3 and not borrow:
        raise PlanError(f"{where}: piece {text!r} is not B:ALGO:MATH or B:ALGO:MATH:{BORROW_MARK}")
    if borrow and problem.direction is Direction.BACKWARD_FILTER:
        raise PlanError(f"{where}: piece {text!r}: only fwd and bwd_data pieces can borrow their "
                        f"output as workspace (':{BORROW_MARK}'); bwd_filter accumulates into its")
    batch_text, algo, math_text = parts[:3]
    batch = _int(batch_text, f"piece {text!r} batch", where, 1)
    if api_of(algo) is Api.GRAPH:
        try:
            parse_engine_name(algo)
        except EngineNameError as exc:
            raise PlanError(f"{where}: piece {text!r}: {exc}") from None
    elif algo not in ALGORITHMS[problem.direction]:
        raise PlanError(f"{where}: piece {text!r}: unknown {problem.direction.value} algorithm "
                        f"{algo!r} (expected one of {', '.join(ALGORITHMS[problem.direction])} "
                        "or an engine name eng…)")
    try:
        math = MathType(math_text)
    except ValueError:
        raise PlanError(f"{where}: piece {text!r}: unknown math type {math_text!r} (expected one of "
                        + ", ".join(m.value for m in MathType) + ")") from None
    return PlanPiece(batch, algo, math, borrow=borrow)


# -- record files (written by the shim) ----------------------------------------------------------

def read_recording(paths: Iterable[str | os.PathLike]) -> list[ConvProblem]:
    """Distinct (kernel, N) from record files, in first-seen order, as problems with their N."""
    return [problem for problem, _ in _read_records(paths)]


def read_recording_weights(paths: Iterable[str | os.PathLike]) -> list[tuple[ConvProblem, int]]:
    """:func:`read_recording`'s problems with how often each ran, as ``(problem, weight)``.

    Weights come from the ``calls`` lines a process writes at exit, summed over processes and
    divided by their greatest common divisor, so a recording of several steps gives the calls of
    one step when some kernel runs once per step. A kernel without calls (queried, never run, or
    a file from before ``calls`` lines) weighs 1; with no ``calls`` line at all, every kernel does.
    """
    records = _read_records(paths)
    counts = [calls for _, calls in records if calls]
    unit = _math.gcd(*counts) if counts else 1
    return [(problem, calls // unit if calls else 1) for problem, calls in records]


def _read_records(paths: Iterable[str | os.PathLike]) -> list[tuple[ConvProblem, int]]:
    """(problem, total calls) of every kernel line, first-seen order; calls 0 where none."""
    seen: dict[tuple[str, int], ConvProblem] = {}
    calls: dict[tuple[str, int], int] = {}
    for path in paths:
        try:
            lines = Path(path).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise PlanError(f"{path}: cannot read recording: {exc}") from None
        for lineno, raw in enumerate(lines, 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            fields = line.split()
            where = f"{path}:{lineno}"
            if fields[0] == "calls" and len(fields) == 4:
                n = _int(fields[2], "N", where, 1)
                key = (fields[1], n)
                calls[key] = calls.get(key, 0) + _int(fields[3], "calls", where, 0, UINT64_MAX)
                continue
            if len(fields) != 3 or fields[0] != "kernel":
                raise PlanError(f"{where}: expected 'kernel KEY N' or 'calls KEY N COUNT', "
                                f"got {line[:80]!r}")
            n = _int(fields[2], "N", where, 1)
            try:
                problem = ConvProblem.from_key(fields[1], n)
            except KeyFormatError as exc:
                raise PlanError(f"{where}: {exc}") from None
            seen.setdefault((fields[1], n), problem)
    return [(problem, calls.get(key, 0)) for key, problem in seen.items()]
