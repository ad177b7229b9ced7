"""The benchmarker's bookkeeping without a GPU: which sizes and APIs are still to be timed, the
beta micro-batches are timed with, and which configurations a probe is enough for."""

from __future__ import annotations

import dataclasses
import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mucudnn.bench import (Frontier, Pruning, SizeGate, backward_filter_beta, is_not_timed,
                           measure_kernel, missing_apis)
from mucudnn.engines import Api, api_of, format_numerical_notes, is_transform_based, numerical_notes
from mucudnn.errors import MucudnnError
from mucudnn.measurement import Measurement, Status
from mucudnn.optimizer import Policy, best_plan, candidate_sizes, pareto_plans
from mucudnn.problem import ALGORITHMS, ConvProblem, Direction
from mucudnn.timing import TimingMethod, calls_made, do_bench
from test_timing import timed

FWD = ConvProblem(Direction.FORWARD, c=8, input_size=(9, 9), k=8, filter_size=(3, 3),
                  padding=(1, 1), stride=(1, 1), dilation=(1, 1), n=8)
BOTH = frozenset(Api)


def row(batch: int, algo: str, status: Status = Status.OK) -> Measurement:
    return Measurement(FWD.key, batch, algo, "fma", 1.0, 0, status)


def test_a_size_counts_as_measured_per_api():
    rows = [row(1, "gemm"), row(1, "eng0"), row(2, "gemm"), row(4, "eng3.k2=1")]
    assert missing_apis(rows, [1, 2, 4, 8], BOTH) == {
        2: {Api.GRAPH}, 4: {Api.LEGACY}, 8: BOTH}
    assert missing_apis(rows, [1, 2, 4, 8], {Api.LEGACY}) == {4: {Api.LEGACY}, 8: {Api.LEGACY}}
    assert missing_apis(rows, [1, 4], {Api.GRAPH}) == {}


def test_refused_rows_count_as_measured():
    rows = [row(2, "fft", Status.NOT_SUPPORTED), row(2, "eng9", Status.FAILED)]
    assert missing_apis(rows, [2], BOTH) == {}


@pytest.mark.parametrize("direction, n, beta", [
    (Direction.BACKWARD_FILTER, 4, 1.0), (Direction.BACKWARD_FILTER, 8, 0.0),
    (Direction.FORWARD, 4, 0.0), (Direction.BACKWARD_DATA, 1, 0.0),
])
def test_backward_filter_micro_batches_are_timed_accumulating(direction, n, beta):
    assert backward_filter_beta(FWD.with_direction(direction).with_n(n), full_n=8) == beta


# -- pruning dominated configurations ---------------------------------------------------------------

FULL, CUT = types.SimpleNamespace(cut_short=False), types.SimpleNamespace(cut_short=True)


def timed_row(algo: str, time_ms: float, workspace: int, note: str = "") -> Measurement:
    return Measurement(FWD.key, 4, algo, "fma", time_ms, workspace, Status.OK, note)


def test_a_configuration_is_dominated_by_a_faster_one_with_no_more_workspace():
    frontier = Frontier(2.0)
    assert frontier.cutoff_ms(1 << 30) is None  # nothing timed yet: time fully
    frontier.add(timed_row("implicit_gemm", 3.0, 0), FULL)
    frontier.add(timed_row("implicit_precomp_gemm", 1.0, 1000), FULL)
    assert frontier.cutoff_ms(0) == 6.0
    assert frontier.cutoff_ms(999) == 6.0  # the 1 ms one needs more workspace: no help
    assert frontier.cutoff_ms(1000) == 2.0
    assert Frontier(None).cutoff_ms(0) is None


def test_cut_short_and_transform_rows_set_no_cutoff():
    frontier = Frontier(2.0)
    frontier.add(timed_row("fft", 0.5, 0), FULL)  # `tune --precise` may drop it
    frontier.add(timed_row("eng7", 0.5, 0, format_numerical_notes(["fft"])), FULL)
    frontier.add(timed_row("gemm", 0.8, 0), CUT)  # a probe only
    assert frontier.cutoff_ms(0) is None
    frontier.add(timed_row("eng3", 0.9, 0, format_numerical_notes(["tensor_core"])), FULL)
    assert frontier.cutoff_ms(0) == 1.8


def test_cut_short_rows_say_so_and_keep_their_numerical_notes():
    frontier = Frontier(2.0)
    assert frontier.note(FULL, "numerical notes: fft") == "numerical notes: fft"
    legacy = frontier.note(CUT)
    assert legacy.startswith("timed once: over 2x")
    engine = frontier.note(CUT, format_numerical_notes(["fft", "tensor_core"]))
    assert engine.endswith(legacy)
    assert is_transform_based(timed_row("eng7", 9.0, 0, engine))
    assert numerical_notes(engine) == {"fft", "tensor_core"}


# -- what is left untimed: a workspace limit, --quick (synthetic kernels) ------------------------

LEGACY_NAMES = ALGORITHMS[Direction.FORWARD]


@dataclasses.dataclass(frozen=True)
class Config:
    """A synthetic configuration: ``time_ms(b) = per_sample * b + fixed`` (ms) unless ``times``
    gives them by size, and ``workspace(b) = ws_fixed + ws_per_sample * b`` bytes."""

    algo: str
    per_sample: float
    fixed: float
    ws_fixed: int
    ws_per_sample: int
    times: tuple[tuple[int, float], ...] = ()

    def time_ms(self, b: int) -> float:
        return dict(self.times).get(b, self.per_sample * b + self.fixed)

    def workspace(self, b: int) -> int:
        return self.ws_fixed + self.ws_per_sample * b


class Synthetic:
    """A kernel of synthetic configurations, benchmarked through bench.measure_kernel as the
    Benchmarker does: counts the configurations timed in full and those probed only."""

    def __init__(self, problem: ConvProblem, configs: list[Config]) -> None:
        self.problem, self.configs, self.timed, self.probed = problem, configs, 0, 0

    def time_size(self, b: int, api: Api, gate: SizeGate) -> list[Measurement]:
        rows, todo = [], []
        for config in self.configs:
            if api_of(config.algo) is not api:
                continue
            workspace = config.workspace(b)
            if gate.skip(workspace):
                rows.append(Measurement(self.problem.key, b, config.algo, "fma", 0.0, workspace,
                                        Status.NOT_SUPPORTED, gate.skip(workspace)))
            else:
                todo.append((config, workspace))
        todo.sort(key=lambda item: not gate.fits(item[1]))
        for config, workspace in todo:
            note = gate.skip_late(workspace)
            if not note and gate.probe_only(workspace):
                self.probed += 1
                gate.probed(config.time_ms(b))
                note = gate.over_limit_note
            if note:
                rows.append(Measurement(self.problem.key, b, config.algo, "fma", 0.0, workspace,
                                        Status.NOT_SUPPORTED, note))
                continue
            self.timed += 1
            rows.append(gate.add(Measurement(self.problem.key, b, config.algo, "fma",
                                             config.time_ms(b), workspace)))
        return rows

    def bench(self, pruning: Pruning, stored=(), apis=BOTH) -> list[Measurement]:
        sizes = candidate_sizes(Policy.POWER_OF_TWO, self.problem.n)
        wanted = missing_apis(stored, sizes, apis, self.problem, pruning)
        rows, _ = measure_kernel(self.problem, wanted, list(stored), pruning, self.time_size)
        return rows


def kernel(n: int, configs: list[Config]) -> Synthetic:
    return Synthetic(FWD.with_n(n), configs)


def plan_or_error(rows, n, limit, borrow=0):
    try:
        return best_plan(rows, n, limit, Policy.POWER_OF_TWO, borrow_sample_bytes=borrow)
    except MucudnnError:  # no plan: the same conclusion whatever the message says
        return "no plan"


def fronts_or_error(rows, n, limit):
    try:
        return pareto_plans(rows, n, Policy.POWER_OF_TWO, max_workspace=limit)
    except MucudnnError:
        return "no plan"


def test_configurations_over_the_limit_are_not_timed_and_say_so():
    k = kernel(8, [Config("implicit_gemm", 1.0, 0.1, 0, 0),
                   Config("implicit_precomp_gemm", 0.5, 0.1, 0, 100),   # 100 B per sample
                   Config("eng0", 0.6, 0.1, 50, 0), Config("eng1", 0.3, 0.1, 1000, 0)])
    full = k.bench(Pruning())
    assert k.timed == 4 * 4  # 4 configurations at sizes 1, 2, 4, 8
    k.timed = 0
    pruned = k.bench(Pruning(limit=400))
    # precomp over 400 B above 4 samples, eng1 always: 1 + 4 of 16 left untimed
    assert k.timed == 16 - 5
    untimed = [r for r in pruned if is_not_timed(r)]
    assert {(r.algo, r.batch) for r in untimed} == {
        ("implicit_precomp_gemm", 8), ("eng1", 1), ("eng1", 2), ("eng1", 4), ("eng1", 8)}
    assert all(not r.ok and r.note == "not timed: over limit (400 bytes usable at this size)"
               for r in untimed)
    assert all(r.ok for r in pruned if not is_not_timed(r))
    assert best_plan(full, 8, 400) == best_plan(pruned, 8, 400)


def test_with_borrowing_a_piece_may_use_the_output_after_it():
    written = FWD.written_sample_bytes  # 8 x 9 x 9 floats a sample
    k = kernel(8, [Config("implicit_gemm", 1.0, 0.1, 0, 0),
                   Config("eng1", 0.3, 0.1, 5 * written, 0)])
    rows = k.bench(Pruning(limit=0, borrow_output=True))
    # a piece of b samples may use (8 - b) samples of output: eng1 fits at 1, 2 (and not 4, 8)
    assert sorted(r.batch for r in rows if r.algo == "eng1" and r.ok) == [1, 2]
    assert best_plan(rows, 8, 0, borrow_sample_bytes=written).pieces[0].borrow


def test_quick_skips_a_kernel_whose_fastest_configuration_at_n_fits():
    k = kernel(16, [Config("implicit_gemm", 1.0, 0.5, 0, 0), Config("eng0", 0.5, 0.5, 64, 1)])
    rows = k.bench(Pruning(limit=1 << 20, quick=True))
    assert k.timed == 2  # each API at N = 16 only; sizes 1..8 carry a marker
    assert sorted({r.batch for r in rows}) == [1, 2, 4, 8, 16]
    markers = [r for r in rows if r.batch < 16]
    assert all(not r.ok and r.note.startswith("not timed: --quick stopped at size 16")
               for r in markers) and len(markers) == 2 * 4
    # eng0 is over the limit: nothing of the graph API fits at 16, so quick goes down (and finds
    # nothing that fits at any size, with nothing to time)
    k.timed = 0
    rows = k.bench(Pruning(limit=32, quick=True))
    assert (k.timed, k.probed) == (1, 0)
    assert sorted(r.batch for r in rows if r.note.startswith("not timed: over limit")) == \
        [1, 2, 4, 8, 16]


def test_quick_probes_configurations_over_the_limit_only_where_they_decide():
    k = kernel(16, [Config("implicit_gemm", 1.0, 0.5, 0, 0),           # fits
                    Config("implicit_precomp_gemm", 0.5, 0.5, 0, 1 << 10),  # fits at 1 sample
                    Config("gemm", 2.0, 0.5, 1 << 20, 0)])             # never fits, slowest
    rows = k.bench(Pruning(limit=1 << 10, quick=True), apis={Api.LEGACY})
    # 16 to 2: precomp's probe is faster per sample than implicit_gemm, so quick goes on, without
    # probing gemm; at 1, precomp fits and gives the best plan (16 pieces): gemm is probed, slower
    assert (k.timed, k.probed) == (5 + 1, 4 + 1)
    assert {(r.algo, r.batch) for r in rows if is_not_timed(r)} == \
        {("gemm", b) for b in (1, 2, 4, 8, 16)} | \
        {("implicit_precomp_gemm", b) for b in (2, 4, 8, 16)}
    full = kernel(16, k.configs).bench(Pruning(), apis={Api.LEGACY})
    assert best_plan(rows, 16, 1 << 10) == best_plan(full, 16, 1 << 10)
    # without precomp: gemm is probed at 16, slower, and quick stops there
    k = kernel(16, [k.configs[0], k.configs[2]])
    rows = k.bench(Pruning(limit=1 << 10, quick=True), apis={Api.LEGACY})
    assert (k.timed, k.probed) == (1, 1)
    assert all(is_not_timed(r) for r in rows if r.batch < 16)


def test_quick_goes_down_until_smaller_sizes_cannot_help():
    # per sample 1 + 1/b ms and 64 B: at limit 200 B sizes <= 3 fit, 2 is the first that does
    k = kernel(16, [Config("implicit_gemm", 1.0, 1.0, 0, 64)])
    rows = k.bench(Pruning(limit=200, quick=True), apis={Api.LEGACY})
    assert [r.batch for r in rows if r.ok] == [2] and k.timed == 1
    assert [r.batch for r in rows if r.note.startswith("not timed: over limit")] == [16, 8, 4]
    assert [r.batch for r in rows if r.note.startswith("not timed: --quick")] == [1]
    full = kernel(16, k.configs).bench(Pruning(), apis={Api.LEGACY})
    assert best_plan(rows, 16, 200) == best_plan(full, 16, 200)


def test_rows_left_untimed_are_timed_when_a_later_bench_needs_them():
    k = kernel(8, [Config("implicit_gemm", 1.0, 0.1, 0, 0), Config("eng1", 0.3, 0.1, 1000, 0)])
    stored = k.bench(Pruning(limit=400))
    sizes = [1, 2, 4, 8]
    assert missing_apis(stored, sizes, BOTH, k.problem, Pruning(limit=400)) == {}
    assert missing_apis(stored, sizes, BOTH, k.problem, Pruning(limit=999)) == {}
    assert missing_apis(stored, sizes, BOTH, k.problem, Pruning(limit=1000)) == \
        {b: {Api.GRAPH} for b in sizes}
    assert missing_apis(stored, sizes, BOTH, k.problem, Pruning()) == \
        {b: {Api.GRAPH} for b in sizes}
    quick = k.bench(Pruning(quick=True))
    assert missing_apis(quick, sizes, BOTH, k.problem, Pruning(quick=True)) == {}
    assert missing_apis(quick, sizes, BOTH, k.problem, Pruning(limit=5, quick=True)) == \
        {b: BOTH for b in (1, 2, 4)}
    assert missing_apis(quick, sizes, BOTH, k.problem, Pruning()) == {b: BOTH for b in (1, 2, 4)}
    # timed again without --quick: the markers stay but the size is measured
    k.timed = 0
    again = k.bench(Pruning(), stored=quick)
    assert k.timed == 2 * 3
    assert missing_apis(quick + again, sizes, BOTH, k.problem, Pruning()) == {}


# Synthetic kernels: each configuration's time and workspace grow linearly with the micro-batch
# (workspace may be flat); with ``arbitrary`` the times are any positive numbers instead.
def configs(arbitrary: bool):
    time = st.integers(1, 64).map(lambda t: t / 8)  # exact in binary: sums do not round
    names = st.sampled_from([*LEGACY_NAMES, *(f"eng{i}" for i in range(6))])
    config = st.builds(Config, names, time, time, st.integers(0, 4096), st.integers(0, 512),
                       st.lists(st.tuples(st.sampled_from([1, 2, 4, 8, 12, 16]), time),
                                max_size=6).map(tuple) if arbitrary else st.just(()))
    return st.lists(config, min_size=1, max_size=6, unique_by=lambda c: c.algo)


@given(configs(arbitrary=True), st.sampled_from([8, 12, 16]), st.integers(0, 8192),
       st.booleans())
@settings(max_examples=150)
def test_plans_within_the_limit_are_those_of_the_full_store(configs, n, limit, borrow):
    k = kernel(n, configs)
    full = k.bench(Pruning())
    everything = k.timed
    k.timed = 0
    pruned = k.bench(Pruning(limit=limit, borrow_output=borrow))
    assert k.timed <= everything
    if borrow:
        written = k.problem.written_sample_bytes
        assert plan_or_error(full, n, limit, written) == plan_or_error(pruned, n, limit, written)
    else:
        assert plan_or_error(full, n, limit) == plan_or_error(pruned, n, limit)
        assert fronts_or_error(full, n, limit) == fronts_or_error(pruned, n, limit)


@given(configs(arbitrary=False), st.sampled_from([8, 12, 16]),
       st.one_of(st.none(), st.integers(0, 8192)))
@settings(max_examples=150)
def test_quick_plans_are_those_of_the_full_store_when_per_sample_time_falls_with_size(
        configs, n, limit):
    """Times per_sample * b + fixed (fixed > 0): per-sample time strictly falls as b grows,
    the model quick is exact for."""
    k = kernel(n, configs)
    full = k.bench(Pruning())
    everything = k.timed
    k.timed = 0
    quick = k.bench(Pruning(limit=limit, quick=True))
    assert k.timed <= everything
    assert plan_or_error(full, n, limit) == plan_or_error(quick, n, limit)


# -- the Benchmarker against the cuDNN test double (tests/fakecupy: a host-memory CuPy) ------------

def test_the_benchmarker_times_no_configuration_over_the_limit(tmp_path_factory, tmp_path):
    """Every configuration's workspace is asked before it is timed: with a limit, exactly the
    (configuration, size) pairs over it are left untimed, stored as such; quick times no more
    than all."""
    from test_graph_fake import WITH_FAKE_CUPY, fake_cudnn_or_skip, run_checks
    fake = fake_cudnn_or_skip(tmp_path_factory.mktemp("fake_cudnn"))
    result = run_checks(fake, '''
        from mucudnn.bench import Benchmarker, Pruning
        from mucudnn.timing import TimingMethod
        problem = ConvProblem(Direction.FORWARD, math=MathType.FMA, **SMALL)
        method = TimingMethod(budget_ms=1.0, max_reps=3)

        def bench(pruning):
            bench = Benchmarker(None, method, progress=False, pruning=pruning)
            rows = bench.measure(problem, [1, 2, 4, 8])
            return {"timings": bench.timings, "rows": [
                [r.batch, r.algo, r.status.value, r.workspace, r.note] for r in rows]}

        result["full"] = bench(Pruning())
        workspaces = sorted({r[3] for r in result["full"]["rows"] if r[2] == "ok"})
        result["limit"] = workspaces[len(workspaces) // 2]
        result["pruned"] = bench(Pruning(limit=result["limit"]))
        result["quick"] = bench(Pruning(quick=True))
        # through the Python API into a store, then a plan from it: quick leaves no size missing
        from mucudnn import tuner
        from mucudnn.bench import current_environment
        store = STORE
        tuner.benchmark([problem], store=store, workspace_limit=result["limit"], quick=True,
                        progress=False)
        plan = tuner.optimize([problem], workspace_limit=result["limit"], store=store,
                              env=current_environment())
        result["planned"] = [e.n for e in plan]
        from mucudnn.store import open_store
        with open_store(store, readonly=True) as stored:
            result["spreads"] = [[r.measurement.status.value, r.measurement.note, r.iqr_ms]
                                 for r in stored.rows()]
    '''.replace("STORE", repr(str(tmp_path / "quick.sqlite"))), PYTHONPATH=WITH_FAKE_CUPY)
    full, pruned, limit = result["full"], result["pruned"], result["limit"]
    over = {(b, algo) for b, algo, status, ws, _ in full["rows"] if status == "ok" and ws > limit}
    assert over, "the double's workspaces are all within the limit: nothing checked"
    assert full["timings"] == sum(r[2] == "ok" for r in full["rows"])
    assert pruned["timings"] == full["timings"] - len(over)
    untimed = {(b, algo) for b, algo, status, ws, note in pruned["rows"]
               if note.startswith("not timed: over limit")}
    assert untimed == over
    assert all(ws <= limit for b, algo, status, ws, _ in pruned["rows"] if status == "ok")
    assert result["quick"]["timings"] <= full["timings"]
    assert {r[0] for r in result["quick"]["rows"]} == {1, 2, 4, 8}
    assert result["planned"] == [8]
    # the spread is stored beside each median timed more than once, and only there
    spreads = result["spreads"]
    assert any(status == "ok" and "timed once" not in note for status, note, _ in spreads)
    for status, note, iqr in spreads:
        timed_fully = status == "ok" and "timed once" not in note
        assert (iqr is not None and iqr >= 0) if timed_fully else iqr is None, (status, note)


@pytest.mark.parametrize("args, error", [
    (["--quick"], "--quick skips the sizes that cannot help plans within a limit: give "
                  "--workspace-limit"),
    (["--quick", "--workspace-limit", "1MiB", "--policy", "fit"], "--quick skips sizes; policy "
     "fit needs every power of two"),
    (["--borrow-output"], "--borrow-output goes with --workspace-limit"),
])
def test_bench_options_that_do_not_go_together_are_refused_in_one_line(args, error):
    from click.testing import CliRunner

    from mucudnn.cli import main
    done = CliRunner().invoke(main, ["bench", "resnet18", *args])
    assert done.exit_code == 2 and error in done.output, done.output
    assert "Traceback" not in done.output


@pytest.mark.parametrize("cutoff", [5.0, 50.0, None])
def test_a_probe_only_timing_ends_at_the_probe_on_either_side_of_the_cutoff(clock, cutoff):
    """What quick asks of a configuration over the limit: which side of P * b it is on."""
    fn, calls = timed(clock, 10.0)
    timing = do_bench(fn, stream=None, cutoff_ms=cutoff, probe_only=True)
    assert timing.cut_short and timing.median_ms == pytest.approx(10.0)
    assert len(calls) == 2 == calls_made(10.0, TimingMethod(), cutoff, probe_only=True)
