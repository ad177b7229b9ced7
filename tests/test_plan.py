"""Plan files (docs/plan-format.md) and record files: writing, reading, and the shared examples."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mucudnn import plan as plan_mod
from mucudnn.engines import INT64_MAX, INT64_MIN, Api, EngineConfig
from mucudnn.errors import PlanError
from mucudnn.plan import (
    POLICIES, STRATEGIES, Plan, PlanEntry, PlanPiece, format_plan, read_plan, read_plan_text,
    read_recording, read_recording_weights, write_plan,
)
from mucudnn.problem import ALGORITHMS, ConvProblem, Direction, MathType

PLAN_DIR = Path(__file__).resolve().parent / "data" / "plans"
VALID_PLANS = sorted(PLAN_DIR.glob("valid_*.plan"))
INVALID_PLANS = sorted(PLAN_DIR.glob("invalid_*.plan"))

GEOMETRIES = [
    dict(c=64, input_size=(56, 56), k=64, filter_size=(3, 3), padding=(1, 1), stride=(1, 1),
         dilation=(1, 1)),
    dict(c=4, input_size=(7, 7), k=6, filter_size=(3, 3), padding=(1, 1), stride=(1, 1),
         dilation=(1, 1), groups=2),
    dict(c=6, input_size=(5, 7, 9), k=4, filter_size=(1, 3, 3), padding=(0, 1, 1),
         stride=(1, 1, 2), dilation=(1, 1, 1)),
]


def problem(direction: Direction = Direction.FORWARD, geometry: int = 0, n: int = 1) -> ConvProblem:
    return ConvProblem(direction, n=n, **GEOMETRIES[geometry])


# -- random plans ----------------------------------------------------------------------------------

engine_names = st.builds(
    EngineConfig, global_index=st.integers(0, 200),
    knobs=st.dictionaries(st.integers(0, 50), st.integers(INT64_MIN, INT64_MAX), max_size=4)
    .map(lambda knobs: tuple(sorted(knobs.items()))),
).map(str)


@st.composite
def entries(draw) -> PlanEntry:
    kernel = problem(draw(st.sampled_from(Direction)), draw(st.integers(0, len(GEOMETRIES) - 1)))
    batches = draw(st.lists(st.integers(1, 64), min_size=1, max_size=6))
    can_borrow = kernel.direction is not Direction.BACKWARD_FILTER
    pieces = tuple(
        PlanPiece(batch, draw(st.one_of(st.sampled_from(ALGORITHMS[kernel.direction]),
                                        engine_names)),
                  draw(st.sampled_from(MathType)), borrow=can_borrow and draw(st.booleans()))
        for batch in batches
    )
    return PlanEntry(key=kernel.key, n=sum(batches), workspace=draw(st.integers(0, 1 << 40)),
                     time_ms=draw(st.floats(0, 1e6, allow_nan=False, allow_infinity=False)),
                     pieces=pieces)


# Device names: printable, may hold inner blanks and '#', never start or end with a blank.
gpu_names = st.from_regex(r"[A-Za-z0-9#()_.-]([A-Za-z0-9 #()_.-]{0,30}[A-Za-z0-9#()_.-])?",
                          fullmatch=True)


@st.composite
def plans(draw) -> Plan:
    plan = Plan(gpu=draw(gpu_names), cudnn=draw(st.integers(1, 10**6)),
                strategy=draw(st.sampled_from(STRATEGIES)), limit=draw(st.integers(0, 1 << 45)),
                policy=draw(st.sampled_from(POLICIES)))
    # In a front plan a (key, N) may have several entries (points), so draw few keys and N.
    for entry in draw(st.lists(entries(), max_size=8)):
        try:
            plan.add(entry)
        except PlanError:  # a duplicate kernel, or a point over a front plan's limit
            pass
    return plan


def written_order(plan: Plan) -> list[PlanEntry]:
    """The order the writer writes entries in: kernels as first added, points by workspace."""
    return [entry for key, n in plan.kernels() for entry in plan.front(key, n)]


def assert_same_plan(read: Plan, written: Plan) -> None:
    """Equal but for TIME, which the file keeps to 6 significant digits."""
    assert (read.gpu, read.cudnn, read.strategy, read.limit, read.policy) == \
        (written.gpu, written.cudnn, written.strategy, written.limit, written.policy)
    want_entries = written_order(written)
    assert [(e.key, e.n, e.workspace) for e in read] == \
        [(e.key, e.n, e.workspace) for e in want_entries]  # same kernels, same order
    for got, want in zip(read, want_entries):
        assert (got.key, got.n, got.workspace, got.pieces) == \
            (want.key, want.n, want.workspace, want.pieces)
        assert math.isclose(got.time_ms, want.time_ms, rel_tol=5e-6, abs_tol=0)


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # tmp_path is reused: fine
@given(plan=plans())
def test_write_read_round_trip(tmp_path, plan):
    path = tmp_path / "round.plan"
    write_plan(plan, path)
    read = read_plan(path)
    assert_same_plan(read, plan)
    assert format_plan(read) == path.read_text(encoding="utf-8")  # stable once written


def test_written_file_follows_the_documented_layout(tmp_path):
    entry = PlanEntry(problem().key, 256, 50331648, 4.125,
                      (PlanPiece(128, "implicit_precomp_gemm", MathType.FMA),) * 2)
    plan = Plan("NVIDIA H200", 91900, "wr", 67108864, "powerOfTwo")
    plan.add(entry)
    write_plan(plan, tmp_path / "p.plan")
    records = [line for line in (tmp_path / "p.plan").read_text().splitlines()
               if not line.startswith("#")]
    assert records == [
        "mucudnn-plan 1", "gpu NVIDIA H200", "cudnn 91900", "strategy wr", "limit 67108864",
        "policy powerOfTwo",
        f"kernel {entry.key} 256 50331648 4.125 128:implicit_precomp_gemm:fma "
        "128:implicit_precomp_gemm:fma",
    ]


def test_plan_without_kernels_round_trips(tmp_path):
    plan = Plan("mucudnn fake GPU", 91900, "wd", 0, "all")
    write_plan(plan, tmp_path / "empty.plan")
    read = read_plan(tmp_path / "empty.plan")
    assert len(read) == 0 and read.strategy == "wd" and read.limit == 0


def test_add_refuses_a_duplicate_kernel():
    plan = Plan("g", 1, "wr", 0, "all")
    entry = PlanEntry(problem().key, 4, 0, 0.0, (PlanPiece(4, "gemm", MathType.FMA),))
    plan.add(entry)
    with pytest.raises(PlanError, match="duplicate kernel"):
        plan.add(entry)


def test_totals_over_entries():
    plan = Plan("g", 1, "wd", 0, "all")
    for n, workspace in ((2, 100), (4, 300), (8, 0)):
        plan.add(PlanEntry(problem().key, n, workspace, 1.0, (PlanPiece(n, "gemm", MathType.FMA),)))
    assert (plan.total_workspace, plan.max_workspace) == (400, 300)
    assert Plan("g", 1, "wd", 0, "all").max_workspace == 0


# -- atomic write ----------------------------------------------------------------------------------

def small_plan(time_ms: float = 1.0) -> Plan:
    plan = Plan("mucudnn fake GPU", 91900, "wr", 1 << 26, "powerOfTwo")
    plan.add(PlanEntry(problem(geometry=1).key, 8, 0, time_ms,
                       (PlanPiece(8, "implicit_gemm", MathType.FMA),)))
    return plan


def test_write_replaces_the_file_in_one_rename(tmp_path, monkeypatch):
    """The new text goes to a sibling file first; readers see the old plan until the rename."""
    path = tmp_path / "live.plan"
    write_plan(small_plan(1.0), path)
    old_text = path.read_text()
    renames = []

    def checking_replace(source, target):
        renames.append((Path(source), Path(target)))
        assert path.read_text() == old_text, "the live plan changed before the rename"
        assert Path(source).parent == path.parent  # same directory: rename is atomic
        assert read_plan(source).get(problem(geometry=1).key, 8).time_ms == 2.0
        real_replace(source, target)

    real_replace = os.replace
    monkeypatch.setattr(plan_mod.os, "replace", checking_replace)
    write_plan(small_plan(2.0), path)
    assert [target for _, target in renames] == [path]
    assert read_plan(path).get(problem(geometry=1).key, 8).time_ms == 2.0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["live.plan"]  # no temporary left


def test_write_refuses_a_plan_it_could_not_read_back(tmp_path):
    path = tmp_path / "live.plan"
    write_plan(small_plan(1.0), path)
    old_text = path.read_text()
    bad = small_plan()
    bad.strategy = "fastest"
    with pytest.raises(PlanError, match="strategy 'fastest'"):
        write_plan(bad, path)
    assert path.read_text() == old_text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["live.plan"]


# -- the shared examples ---------------------------------------------------------------------------

def test_the_example_directory_has_both_kinds():
    assert len(VALID_PLANS) >= 2 and len(INVALID_PLANS) >= 10


@pytest.mark.parametrize("path", VALID_PLANS, ids=lambda p: p.name)
def test_valid_examples_read(path):
    plan = read_plan(path)
    assert plan.strategy in STRATEGIES and plan.policy in POLICIES
    assert len(plan) >= 1
    for entry in plan:
        assert sum(piece.batch for piece in entry.pieces) == entry.n
        assert entry.problem.key == entry.key
        assert all(piece.algo in ALGORITHMS[entry.problem.direction] for piece in entry.pieces)
    assert_same_plan(read_plan_text(format_plan(plan)), plan)


def test_blanks_and_comments_example_reads_every_kernel():
    plan = read_plan(PLAN_DIR / "valid_blanks_comments.plan")
    assert (plan.gpu, plan.cudnn, plan.strategy, plan.limit, plan.policy) == \
        ("mucudnn fake GPU", 91900, "wd", 0, "all")
    assert sorted(entry.n for entry in plan) == [4, 8, 8, 8]
    assert {entry.problem.direction for entry in plan} == set(Direction)
    last = list(plan)[-1]
    assert (last.workspace, last.time_ms) == (32768, 0.15)
    assert [str(piece) for piece in last.pieces] == ["2:algo_3:fma", "6:fft_tiling:fma"]


def test_engine_pieces_example_reads():
    """tests/data/plans/engines.plan: engine pieces alone, mixed with legacy pieces, and with
    knob values at the ends of int64."""
    plan = read_plan(PLAN_DIR / "engines.plan")
    assert sorted((entry.problem.direction.value, entry.n) for entry in plan) == [
        ("bwd_data", 8), ("bwd_filter", 8), ("fwd", 8), ("fwd", 16)]
    pieces = {(entry.problem.direction.value, entry.n): [str(p) for p in entry.pieces]
              for entry in plan}
    assert pieces[("fwd", 8)] == ["4:eng12.k3=1:fma", "4:eng0:fma"]
    assert [p.api for p in plan.get(list(plan)[1].key, 16).pieces] == \
        [Api.GRAPH, Api.LEGACY, Api.GRAPH]
    assert pieces[("bwd_filter", 8)][1:] == [f"2:eng3.k0={INT64_MIN}:fma",
                                             f"2:eng3.k0={INT64_MAX}:fma"]
    assert_same_plan(read_plan_text(format_plan(plan)), plan)


@pytest.mark.parametrize("piece, reason", [
    ("8:eng:fma", "engine name 'eng' is not eng<G>"),
    ("8:eng01:fma", "'eng01' is not eng<G>"),
    ("8:eng3.k2=1.k1=0:fma", "not strictly ascending"),
    ("8:eng3.k2=1.k2=1:fma", "not strictly ascending"),
    ("8:eng3.k2=-0:fma", "is not eng<G>"),
    (f"8:eng3.k2={INT64_MAX + 1}:fma", "not an int64"),
    ("8:engine_3:fma", "is not eng<G>"),
    ("8:eng3:tf32", "unknown math type 'tf32'"),
    ("8:eng3.k2=1:fma:x", "is not B:ALGO:MATH"),
    ("8:implicit_gemm:fma", "unknown bwd_data algorithm 'implicit_gemm' (expected one of"),
])
def test_malformed_engine_pieces_are_refused_on_their_line(piece, reason):
    key = problem(Direction.BACKWARD_DATA).key
    text = ("mucudnn-plan 1\ngpu g\ncudnn 1\nstrategy wr\nlimit 0\npolicy all\n"
            f"kernel {key} 8 0 0 {piece}\n")
    with pytest.raises(PlanError) as exc:
        read_plan_text(text, source="e.plan")
    assert str(exc.value).startswith(f"e.plan:7: piece {piece!r}")
    assert reason in str(exc.value)


def expected_error_line(path: Path) -> str:
    """The ``# expect-error-line: N`` header: a line number, or '-' for the whole file (line 0)."""
    first = path.read_text(encoding="utf-8").splitlines()[0]
    match = re.fullmatch(r"#\s*expect-error-line:\s*(\d+|-)\s*", first)
    assert match, f"{path.name}: first line must be '# expect-error-line: N', got {first!r}"
    return match.group(1)


@pytest.mark.parametrize("path", INVALID_PLANS, ids=lambda p: p.name)
def test_invalid_examples_name_the_file_and_line(path):
    line = expected_error_line(path)
    with pytest.raises(PlanError) as exc:
        read_plan(path)
    message = str(exc.value)
    if line == "-":  # about the whole file: line 0, as the shim says it
        assert message.startswith(f"{path}:0:"), message
    else:
        assert message.startswith(f"{path}:{line}:"), message
    assert "\n" not in message


# What each invalid example's message must say about the fault its name describes.
INVALID_REASONS = {
    "invalid_bad_key.plan": "kernel key", "invalid_bad_number.plan": "workspace '64MiB'",
    "invalid_bad_strategy.plan": "strategy 'fast'", "invalid_duplicate_kernel.plan": "duplicate",
    "invalid_empty.plan": "empty", "invalid_header_after_kernel.plan": "'limit' after",
    "invalid_missing_field.plan": "got 4 field(s)", "invalid_missing_header.plan": "policy",
    "invalid_negative_time.plan": "time '-1'", "invalid_not_a_plan.plan": "not a mucudnn plan",
    "invalid_pieces_sum.plan": "add up to 7", "invalid_unknown_algo.plan": "'algo_0'",
    "invalid_unknown_math.plan": "'tf32'", "invalid_unknown_record.plan": "'kernal'",
    "invalid_version_2.plan": "version '2'", "invalid_zero_batch.plan": "'0:implicit_gemm:fma'",
}


@pytest.mark.parametrize("name, reason", INVALID_REASONS.items())
def test_invalid_examples_say_what_is_wrong(name, reason):
    with pytest.raises(PlanError) as exc:
        read_plan(PLAN_DIR / name)
    assert reason in str(exc.value)


def test_unreadable_plan_file_names_the_path(tmp_path):
    missing = tmp_path / "nope.plan"
    with pytest.raises(PlanError, match=re.escape(str(missing))):
        read_plan(missing)
    binary = tmp_path / "binary.plan"
    binary.write_bytes(b"mucudnn-plan 1\n\xff\xfe\n")
    with pytest.raises(PlanError, match=re.escape(str(binary))):
        read_plan(binary)


@pytest.mark.parametrize("record, value, reason", [
    ("cudnn", "9.1", "cudnn '9.1'"), ("cudnn", "0", "cudnn '0'"),
    ("limit", "64MiB", "limit '64MiB'"), ("limit", "-1", "limit '-1'"),
    ("strategy", "WR", "strategy 'WR'"), ("policy", "power_of_two", "policy 'power_of_two'"),
])
def test_bad_header_value_is_named_on_its_own_line(record, value, reason):
    """Not at the first kernel line or the end of the file: the shim names the header's line."""
    header = {"gpu": "g", "cudnn": "91900", "strategy": "wr", "limit": "0", "policy": "all",
              record: value}
    text = "mucudnn-plan 1\n" + "".join(f"{name} {header[name]}\n" for name in header) \
        + f"kernel {problem().key} 1 0 0 1:gemm:fma\n"
    line = 2 + list(header).index(record)
    with pytest.raises(PlanError) as exc:
        read_plan_text(text, source="p.plan")
    assert str(exc.value).startswith(f"p.plan:{line}: {reason}")


def test_header_given_twice_is_refused():
    text = "mucudnn-plan 1\ngpu a\ngpu b\ncudnn 1\nstrategy wr\nlimit 0\npolicy all\n"
    with pytest.raises(PlanError, match=r"^here:3: header record 'gpu' given twice"):
        read_plan_text(text, source="here")


# -- record files ----------------------------------------------------------------------------------

def record_line(kernel: ConvProblem) -> str:
    return f"kernel {kernel.key} {kernel.n}\n"


def test_recording_dedupes_in_first_seen_order(tmp_path):
    a, b = problem(n=8), problem(Direction.BACKWARD_DATA, geometry=1, n=4)
    a16 = a.with_n(16)
    first = tmp_path / "rank0.record"
    second = tmp_path / "rank1.record"
    first.write_text("# mucudnn-record 1 pid=10\n" + record_line(a) + "\n" + record_line(b)
                     + record_line(a))
    second.write_text("# mucudnn-record 1 pid=11\n   # indented comment\n" + record_line(b)
                      + record_line(a16) + record_line(a))
    kernels = read_recording([first, second])
    assert [(k.key, k.n) for k in kernels] == [(a.key, 8), (b.key, 4), (a.key, 16)]
    assert kernels == [a, b, a16]


def test_empty_recording_gives_no_kernels(tmp_path):
    path = tmp_path / "empty.record"
    path.write_text("# mucudnn-record 1 pid=1\n\n")
    assert read_recording([path]) == []


def calls_line(kernel: ConvProblem, count: int) -> str:
    return f"calls {kernel.key} {kernel.n} {count}\n"


def test_recorded_calls_weigh_kernels_as_often_as_one_step_runs_them(tmp_path):
    stem, block, queried = problem(n=8), problem(Direction.BACKWARD_DATA, geometry=1, n=8), \
        problem(Direction.BACKWARD_FILTER, n=8)
    # two processes of two steps each: the block kernel runs three times per step
    rank0, rank1 = tmp_path / "rank0.record", tmp_path / "rank1.record"
    for path in (rank0, rank1):
        path.write_text("# mucudnn-record 1 pid=1\n" + record_line(stem) + record_line(block)
                        + record_line(queried) + calls_line(block, 6) + calls_line(stem, 2))
    assert read_recording_weights([rank0, rank1]) == [(stem, 1), (block, 3), (queried, 1)]
    assert read_recording([rank0, rank1]) == [stem, block, queried]  # calls lines are no kernels
    old = tmp_path / "old.record"  # written before calls lines existed
    old.write_text(record_line(stem) + record_line(block))
    assert read_recording_weights([old]) == [(stem, 1), (block, 1)]


@pytest.mark.parametrize("bad, reason", [
    ("calls {key} 4", "expected 'kernel KEY N' or 'calls KEY N COUNT'"),
    ("calls {key} 4 many", "calls 'many'"),
    ("calls {key} 0 3", "N '0'"),
    ("kernel {key}", "expected 'kernel KEY N'"),
    ("kernel {key} 4 5", "expected 'kernel KEY N'"),
    ("kernal {key} 4", "expected 'kernel KEY N'"),
    ("kernel {key} 0", "N '0'"),
    ("kernel {key} four", "N 'four'"),
    ("kernel dir=fwd,c=3 4", "kernel key"),
])
def test_malformed_recording_line_names_file_and_line(tmp_path, bad, reason):
    path = tmp_path / "bad.record"
    path.write_text("# mucudnn-record 1 pid=1\n" + record_line(problem(n=2))
                    + bad.format(key=problem().key) + "\n")
    with pytest.raises(PlanError) as exc:
        read_recording_weights([path])
    assert str(exc.value).startswith(f"{path}:3: ")
    assert reason in str(exc.value)


def test_missing_recording_names_the_path(tmp_path):
    with pytest.raises(PlanError, match=re.escape(str(tmp_path / "absent.record"))):
        read_recording([tmp_path / "absent.record"])


def test_borrowing_pieces_read_and_write_with_their_mark():
    plan = read_plan(PLAN_DIR / "valid_borrow.plan")
    (entry,) = plan
    assert [piece.borrow for piece in entry.pieces] == [True, True, False]
    assert [str(piece) for piece in entry.pieces] == [
        "4:gemm:fma:out", "2:gemm:fma:out", "2:implicit_gemm:fma"]
    assert entry.workspace == 0


def test_only_forward_and_backward_data_pieces_borrow():
    with pytest.raises(PlanError, match="only fwd and bwd_data pieces can borrow"):
        read_plan(PLAN_DIR / "invalid_borrow_bwd_filter.plan")
    with pytest.raises(PlanError, match=r"is not B:ALGO:MATH or B:ALGO:MATH:out"):
        read_plan(PLAN_DIR / "invalid_piece_suffix.plan")


# -- the exact grammar (docs/plan-format.md): every refusal is a PlanError on its line ------------

GOOD_HEADER = "mucudnn-plan 1\ngpu g\ncudnn 1\nstrategy wr\nlimit 0\npolicy all\n"


def kernel_text(n="8", workspace="0", time="0", piece="8:gemm:fma", key=None) -> str:
    return GOOD_HEADER + f"kernel {key or problem().key} {n} {workspace} {time} {piece}\n"


@pytest.mark.parametrize("text, line", [
    (GOOD_HEADER.replace("cudnn 1", "cudnn ²"), 3),             # str.isdigit, int() refuses it
    (GOOD_HEADER.replace("cudnn 1", "cudnn ١"), 3),             # an Arabic-Indic digit
    (GOOD_HEADER.replace("limit 0", "limit " + "9" * 5000), 5),  # past int()'s digit limit
    (GOOD_HEADER.replace("limit 0", f"limit {1 << 64}"), 5),
    (GOOD_HEADER.replace("cudnn 1", "cudnn 0"), 3),
    (GOOD_HEADER.replace("cudnn 1", "cudnn 01"), 3),
    (kernel_text(n=str(1 << 31), piece=f"{1 << 31}:gemm:fma"), 7),
    (kernel_text(workspace=str(1 << 64)), 7),
    (kernel_text(time="0x10"), 7), (kernel_text(time="1_0"), 7), (kernel_text(time="inf"), 7),
    (kernel_text(time=".5"), 7), (kernel_text(time="1e309"), 7), (kernel_text(time="٣"), 7),
    (kernel_text(piece="8:eng" + "9" * 5000 + ":fma"), 7),
    (kernel_text(key=problem().key.replace("c=64", "c=" + "6" * 5000)), 7),
    (kernel_text(key=problem().key.replace("in=56x56", f"in=56x{1 << 31}")), 7),
    (GOOD_HEADER.replace("\n", "\r\n"), 1),                      # CRLF: \r is refused
    (GOOD_HEADER + "\x00kernel\n", 7),                           # NUL: not the end of the file
    (GOOD_HEADER.replace("policy all", "policy\u00a0all"), 6),   # NBSP is not a blank
    (GOOD_HEADER.replace("policy all", "policy all\u00a0"), 6),
    (kernel_text().replace(" 8 0 0", "\u00a08 0 0"), 7),
    (GOOD_HEADER.replace("limit 0", "limit 0\x0b"), 5),          # VT, FF: controls, not line ends
    (GOOD_HEADER.replace("limit 0\n", "limit 0\x0c"), 5),
    (GOOD_HEADER.replace("limit 0\n", "limit 0\x1c"), 5),
    (GOOD_HEADER.replace("limit 0\n", "limit 0\u2028"), 5),
])
def test_what_the_grammar_refuses_is_a_plan_error_on_its_line(tmp_path, text, line):
    path = tmp_path / "p.plan"
    path.write_text(text, encoding="utf-8", newline="")
    with pytest.raises(PlanError) as exc:
        read_plan(path)
    assert str(exc.value).startswith(f"{path}:{line}: "), str(exc.value)


def test_the_grammar_accepts_its_edge_values():
    text = GOOD_HEADER.replace("limit 0", f"limit {(1 << 64) - 1}").replace(
        "cudnn 1", f"cudnn {(1 << 31) - 1}").replace("gpu g", "gpu Gérard's  GPU") \
        + "# é, \u00a0 and \u2028 are fine in a comment\n" \
        + f"kernel {problem().key} 8 {(1 << 64) - 1} 1.5E+2 8:gemm:fma"  # no final newline
    plan = read_plan_text(text)
    assert (plan.limit, plan.cudnn, plan.gpu) == ((1 << 64) - 1, (1 << 31) - 1, "Gérard's  GPU")
    (entry,) = plan
    assert (entry.workspace, entry.time_ms) == ((1 << 64) - 1, 150.0)


def test_invalid_utf8_is_named_on_its_line(tmp_path):
    path = tmp_path / "p.plan"
    path.write_bytes(GOOD_HEADER.encode() + b"# \xed\xa0\x80 (a surrogate)\n")
    with pytest.raises(PlanError, match=rf"^{re.escape(str(path))}:7: not UTF-8"):
        read_plan(path)


def _read_in_child(path: Path) -> subprocess.CompletedProcess:
    """read_plan(path) in a child process under a timeout: a hang fails the test, not the run."""
    code = ("import sys\nfrom mucudnn.plan import read_plan\nfrom mucudnn.errors import PlanError\n"
            "try:\n    read_plan(sys.argv[1])\nexcept PlanError as exc:\n    print(exc)\n")
    return subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True,
                          timeout=60)


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path):
    fifo = tmp_path / "plan.fifo"
    os.mkfifo(fifo)
    result = _read_in_child(fifo)
    assert result.stdout == f"{fifo}:0: plan file is not a regular file\n", result.stderr


@pytest.mark.parametrize("path", ["/dev/zero", "/"])
def test_devices_and_directories_are_refused_before_reading(path):
    result = _read_in_child(Path(path))
    assert result.stdout == f"{path}:0: plan file is not a regular file\n", result.stderr


def test_a_plan_over_the_maximum_size_is_refused(tmp_path):
    path = tmp_path / "big.plan"
    with open(path, "wb") as f:
        f.truncate(plan_mod.MAX_PLAN_BYTES + 1)
    with pytest.raises(PlanError, match=rf"^{re.escape(str(path))}:0: .*larger than 67108864 bytes"):
        read_plan(path)


# -- front plans (strategy front): a kernel's lines are the points of its front -------------------

@st.composite
def front_plans(draw) -> Plan:
    """Front plans of 0-3 kernels with 1-4 points each, added in a random order."""
    limit = draw(st.sampled_from([0, 1 << 20, 1 << 40, plan_mod.NO_LIMIT]))
    plan = Plan(gpu=draw(gpu_names), cudnn=draw(st.integers(1, 10**6)), strategy="front",
                limit=limit, policy=draw(st.sampled_from(POLICIES)))
    points = []
    for index in range(draw(st.integers(0, 3))):
        kernel = problem(draw(st.sampled_from(Direction)), index, n=draw(st.integers(1, 64)))
        for workspace in draw(st.lists(st.integers(0, limit), min_size=1, max_size=4, unique=True)):
            points.append(PlanEntry(kernel.key, kernel.n, workspace,
                                    draw(st.floats(0, 1e6, allow_nan=False)),
                                    (PlanPiece(kernel.n, ALGORITHMS[kernel.direction][0],
                                               MathType.FMA),)))
    for entry in draw(st.permutations(points)):
        plan.add(entry)
    return plan


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=front_plans())
def test_front_plans_round_trip_with_each_kernels_points_by_workspace(tmp_path, plan):
    path = tmp_path / "front.plan"
    write_plan(plan, path)
    read = read_plan(path)
    assert_same_plan(read, plan)
    assert read.kernels() == plan.kernels()
    lines = [line.split() for line in path.read_text().splitlines() if line.startswith("kernel ")]
    for key, n in plan.kernels():  # written together, by workspace ascending
        written = [int(f[3]) for f in lines if (f[1], int(f[2])) == (key, n)]
        assert written == sorted(e.workspace for e in plan if (e.key, e.n) == (key, n))
        assert [e.workspace for e in read.front(key, n)] == written
    assert format_plan(read) == path.read_text(encoding="utf-8")


def test_front_example_reads_each_kernels_points():
    plan = read_plan(PLAN_DIR / "front.plan")
    assert (plan.strategy, plan.limit, plan.is_front) == ("front", 1 << 20, True)
    fwd = problem(Direction.FORWARD, 1).key
    assert plan.kernels() == [(fwd, 8), (fwd, 16), (problem(Direction.BACKWARD_DATA, 1).key, 8),
                              (problem(Direction.BACKWARD_FILTER, 1).key, 8)]
    points = plan.front(fwd, 8)
    assert [(e.workspace, e.time_ms) for e in points] == [
        (0, 1.5), (4096, 0.75), (65536, 0.5), (1 << 20, 0.25)]
    assert plan.get(fwd, 8) is points[-1]  # the fastest
    assert [len(plan.front(key, n)) for key, n in plan.kernels()] == [4, 2, 1, 2]
    assert len(plan) == 9 and [e.workspace for e in plan][:3] == [1 << 20, 0, 65536]  # file order
    assert plan.front(fwd, 4) == () and plan.get(fwd, 4) is None
    assert plan.total_workspace == (1 << 20) + 65536 + 0 + 32768  # each kernel's fastest point


FRONT_HEADER = GOOD_HEADER.replace("strategy wr", "strategy front").replace("limit 0", "limit 4096")


def front_line(workspace: int, n: int = 8, time: str = "1") -> str:
    return f"kernel {problem().key} {n} {workspace} {time} {n}:gemm:fma\n"


@pytest.mark.parametrize("text, line, reason", [
    (FRONT_HEADER + front_line(0) + front_line(16) + front_line(0, time="2"), 9,
     "duplicate kernel .* n=8 workspace=0"),
    (FRONT_HEADER + front_line(0) + front_line(4097), 8, "workspace 4097 .* over the plan's limit 4096"),
    (FRONT_HEADER + front_line((1 << 64) - 1), 7, "over the plan's limit"),
    (GOOD_HEADER + front_line(0) + front_line(16), 8, "duplicate kernel"),  # wr: one per (KEY, N)
    (GOOD_HEADER.replace("strategy wr", "strategy wd") + front_line(0) + front_line(16), 8,
     "duplicate kernel"),
])
def test_front_rules_are_plan_errors_on_the_offending_line(tmp_path, text, line, reason):
    path = tmp_path / "p.plan"
    path.write_text(text)
    with pytest.raises(PlanError, match=rf"^{re.escape(str(path))}:{line}: .*{reason}"):
        read_plan(path)


def test_a_front_plan_takes_points_up_to_its_limit_and_several_n():
    text = FRONT_HEADER + front_line(4096) + front_line(0) + front_line(0, n=16) + front_line(4096, n=16)
    plan = read_plan_text(text)
    assert [(e.n, e.workspace) for e in plan] == [(8, 4096), (8, 0), (16, 0), (16, 4096)]
    no_limit = read_plan_text(text.replace("limit 4096", f"limit {plan_mod.NO_LIMIT}")
                              + front_line(plan_mod.NO_LIMIT))
    assert [e.workspace for e in no_limit.front(problem().key, 8)] == [0, 4096, plan_mod.NO_LIMIT]


def test_plan_add_keeps_the_front_rules():
    plan = Plan("g", 1, "front", 100, "all")
    entry = PlanEntry(problem().key, 4, 100, 1.0, (PlanPiece(4, "gemm", MathType.FMA),))
    plan.add(entry)
    plan.add(PlanEntry(problem().key, 4, 0, 2.0, entry.pieces))
    with pytest.raises(PlanError, match="duplicate kernel"):
        plan.add(PlanEntry(problem().key, 4, 100, 0.5, entry.pieces))
    with pytest.raises(PlanError, match="over the plan's limit 100"):
        plan.add(PlanEntry(problem().key, 4, 101, 0.5, entry.pieces))
    assert [e.workspace for e in plan.front(problem().key, 4)] == [0, 100] and len(plan) == 2
    # Entries given to the constructor obey the same rules.
    with pytest.raises(PlanError, match="duplicate kernel"):
        Plan("g", 1, "wr", 0, "all", entries=[entry, entry])
