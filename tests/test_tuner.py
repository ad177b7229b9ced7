"""The tuner: plans from synthetic measurements, where measurements come from, baselines."""

from __future__ import annotations

import collections
import csv
import gzip
import math
import os
import pathlib
import re
import tempfile
import warnings

import pytest

from mucudnn import tuner
from mucudnn.environment import Environment
from mucudnn.engines import TRANSFORM_ALGORITHMS, Api, format_numerical_notes
from mucudnn.errors import (
    InfeasibleError, MissingMeasurementsError, MucudnnError, StoreError, UnwritableError,
)
from mucudnn.measurement import Measurement, Status
from mucudnn.optimizer import FRONT_MAX_POINTS, Policy, candidate_sizes, pareto_plans
from mucudnn.plan import (NO_LIMIT, PlanEntry, PlanPiece, Restrictions, read_plan, read_restrictions,
                          write_plan)
from mucudnn.problem import ConvProblem, Direction, MathType
from mucudnn.sizes import parse_size
from mucudnn.store import open_store
from test_store import as_unprivileged, hand_over

ENV = Environment("Test GPU", 91900)
N = 8

FWD = ConvProblem(Direction.FORWARD, c=64, input_size=(56, 56), k=64, filter_size=(3, 3),
                  padding=(1, 1), stride=(1, 1), dilation=(1, 1), n=N)
BWD_DATA = FWD.with_direction(Direction.BACKWARD_DATA)
# A kernel every algorithm of which needs workspace (no zero-workspace fallback).
HUNGRY = ConvProblem(Direction.FORWARD, c=32, input_size=(28, 28), k=32, filter_size=(5, 5),
                     padding=(2, 2), stride=(1, 1), dilation=(1, 1), n=N)

# name: (ms per launch, ms per sample, workspace bytes per sample). Transform-based algorithms are
# the fastest and hungriest, so limits and budgets force real trade-offs.
FWD_ALGOS = {"implicit_gemm": (0.02, 1.0, 0), "gemm": (0.02, 0.8, 100),
             "winograd": (0.02, 0.5, 500), "fft": (0.05, 0.3, 1000)}
BWD_DATA_ALGOS = {"algo_0": (0.02, 1.2, 0), "algo_1": (0.02, 0.9, 64),
                  "fft_tiling": (0.05, 0.4, 800)}
HUNGRY_ALGOS = {"gemm": (0.02, 0.9, 100), "fft": (0.05, 0.3, 1000)}


def synthetic_rows(problem: ConvProblem, algos: dict[str, tuple[float, float, int]],
                   sizes=None) -> list[Measurement]:
    """One OK row per algorithm at each size (default: the powerOfTwo sizes of ``problem.n``),
    plus one NOT_SUPPORTED row that must never be planned."""
    rows = []
    for batch in sizes or candidate_sizes(Policy.POWER_OF_TWO, problem.n):
        for algo, (launch, per_sample, workspace) in algos.items():
            rows.append(Measurement(problem.key, batch, algo, MathType.FMA,
                                    launch + per_sample * batch, workspace * batch))
        rows.append(Measurement(problem.key, batch, "direct", MathType.FMA, math.nan, 0,
                                Status.NOT_SUPPORTED))
    return rows


@pytest.fixture
def store(tmp_path):
    with open_store(tmp_path / "synthetic.sqlite") as opened:
        opened.put(ENV.gpu, ENV.cudnn, synthetic_rows(FWD, FWD_ALGOS)
                   + synthetic_rows(BWD_DATA, BWD_DATA_ALGOS)
                   + synthetic_rows(HUNGRY, HUNGRY_ALGOS))
        yield opened


KERNELS = [(FWD, 3), (BWD_DATA, 1)]


def measured(store, entry: PlanEntry, piece: PlanPiece) -> Measurement:
    """The stored row a plan piece stands for."""
    [row] = [m for m in store.get(ENV.gpu, ENV.cudnn, entry.key, batches=[piece.batch])
             if m.algo == piece.algo and m.math == piece.math]
    return row


def check_entry_against_store(store, entry: PlanEntry) -> None:
    """Pieces cover N, and the entry's time and workspace are those of its measured pieces."""
    assert sum(piece.batch for piece in entry.pieces) == entry.n
    rows = [measured(store, entry, piece) for piece in entry.pieces]
    assert all(row.ok for row in rows)
    assert entry.workspace == max(row.workspace for row in rows)
    assert math.isclose(entry.time_ms, sum(row.time_ms for row in rows))


def best_undivided(store, problem: ConvProblem, limit: int | None) -> float | None:
    """The fastest single algorithm over the whole mini-batch within ``limit``, from the rows."""
    times = [m.time_ms for m in store.get(ENV.gpu, ENV.cudnn, problem.key, batches=[problem.n])
             if m.ok and (limit is None or m.workspace <= limit)]
    return min(times, default=None)


# -- WR --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("limit", [0, 800, "2KiB", 4000, 1 << 30])
def test_wr_keeps_every_kernel_within_the_limit(store, limit):
    plan = tuner.optimize(KERNELS, workspace_limit=limit, store=store, env=ENV)
    assert (plan.gpu, plan.cudnn) == (ENV.gpu, ENV.cudnn)
    assert (plan.strategy, plan.limit, plan.policy) == ("wr", parse_size(limit), "powerOfTwo")
    assert [(e.key, e.n) for e in plan] == [(p.key, p.n) for p, _ in KERNELS]
    for entry in plan:
        check_entry_against_store(store, entry)
        assert entry.workspace <= parse_size(limit)
        undivided = best_undivided(store, entry.problem, parse_size(limit))
        assert entry.time_ms <= undivided + 1e-9  # never worse than not dividing


def test_wr_divides_when_the_fast_algorithm_only_fits_small_micro_batches(store):
    # fft needs 1000 B per sample: within 2000 B it runs 2 samples at a time.
    plan = tuner.optimize([FWD], workspace_limit=2000, store=store, env=ENV)
    entry = plan.get(FWD.key, N)
    assert entry.is_divided
    assert {piece.algo for piece in entry.pieces} == {"fft"}
    assert entry.time_ms < best_undivided(store, FWD, 2000)


def test_wr_infeasible_limit_is_an_error(store):
    with pytest.raises(InfeasibleError):
        tuner.optimize([HUNGRY], workspace_limit=50, store=store, env=ENV)


@pytest.mark.parametrize("policy", ["undivided", Policy.POWER_OF_TWO])
def test_policy_limits_the_micro_batch_sizes(store, policy):
    plan = tuner.optimize([FWD], workspace_limit=2000, policy=policy, store=store, env=ENV)
    assert plan.policy == Policy(policy).value
    allowed = set(candidate_sizes(policy, N))
    assert all(piece.batch in allowed for entry in plan for piece in entry.pieces)


# -- WD --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("budget", [0, 1000, "4KiB", 9000, 1 << 30])
def test_wd_keeps_all_kernels_within_the_budget(store, budget):
    plan = tuner.optimize(KERNELS, total_workspace=budget, store=store, env=ENV)
    assert (plan.strategy, plan.limit, plan.policy) == ("wd", parse_size(budget), "powerOfTwo")
    assert len(plan) == len(KERNELS)
    assert plan.total_workspace <= parse_size(budget)
    for entry in plan:
        check_entry_against_store(store, entry)


def test_wd_gets_no_slower_with_a_larger_budget(store):
    def weighted_time(budget):
        plan = tuner.optimize(KERNELS, total_workspace=budget, store=store, env=ENV)
        return tuner.predicted_network_time(plan, KERNELS)

    times = [weighted_time(budget) for budget in (0, 2000, 8000, 1 << 20)]
    assert times == sorted(times, reverse=True)
    assert times[0] > times[-1]  # the budget matters for these kernels


def test_wd_infeasible_budget_is_an_error(store):
    with pytest.raises(InfeasibleError):
        tuner.optimize([HUNGRY], total_workspace=50, store=store, env=ENV)


@pytest.mark.parametrize("limits, reason", [
    ({"workspace_limit": "1MiB", "total_workspace": "1MiB"}, "at most one"),
    ({"total_workspace": "1MiB", "front": True}, "a front plan takes workspace_limit"),
    ({"borrow_output": True}, "not with a front plan"),
    ({"workspace_limit": "1MiB", "front": True, "borrow_output": True}, "not with a front plan"),
])
def test_conflicting_limits_are_refused(store, limits, reason):
    with pytest.raises(MucudnnError, match=reason):
        tuner.optimize(KERNELS, store=store, env=ENV, **limits)


# -- front plans -----------------------------------------------------------------------------------

def check_front_plan(store, plan, kernels, cap: int | None) -> None:
    """Each kernel's points: measured, within ``cap``, Pareto-optimal among themselves and taken
    from the kernel's whole front, the fastest the WR plan's time within ``cap`` (no cap: none)."""
    assert plan.strategy == "front" and plan.limit == (NO_LIMIT if cap is None else cap)
    assert plan.kernels() == [(p.key, p.n) for p, _ in kernels]
    for problem, _ in kernels:
        points = plan.front(problem.key, problem.n)
        assert 1 <= len(points) <= FRONT_MAX_POINTS
        for entry in points:
            check_entry_against_store(store, entry)
            assert cap is None or entry.workspace <= cap
        workspaces = [e.workspace for e in points]
        times = [e.time_ms for e in points]
        assert workspaces == sorted(set(workspaces))  # sorted, distinct
        assert all(a > b for a, b in zip(times, times[1:]))  # so none dominates another
        rows = tuner.measurements(store, ENV, problem, Policy.POWER_OF_TWO)
        whole = pareto_plans(rows, problem.n, Policy.POWER_OF_TWO, cap)
        assert {(e.workspace, e.time_ms) for e in points} <= {(p.workspace, p.time_ms) for p in whole}
        assert points[0].workspace == whole[0].workspace  # the smallest point stays
        wr = tuner.optimize([problem], workspace_limit=(1 << 62) if cap is None else cap,
                            store=store, env=ENV)
        assert math.isclose(points[-1].time_ms, wr.get(problem.key, problem.n).time_ms)


def test_no_limit_gives_a_front_plan(store):
    plan = tuner.optimize(KERNELS, store=store, env=ENV)
    check_front_plan(store, plan, KERNELS, None)
    assert max(len(plan.front(k, n)) for k, n in plan.kernels()) > 1  # real trade-offs


@pytest.mark.parametrize("cap", [0, 800, 2000, 5000])
def test_a_front_with_a_limit_is_cut_there(store, cap):
    plan = tuner.optimize(KERNELS, workspace_limit=cap, front=True, store=store, env=ENV)
    check_front_plan(store, plan, KERNELS, cap)


def test_a_front_plan_is_written_and_read_back_sorted(mixed_store, tmp_path):
    plan = tuner.optimize([FWD, BWD_DATA], store=mixed_store, env=ENV)
    write_plan(plan, tmp_path / "front.plan")
    read = read_plan(tmp_path / "front.plan")
    assert read.strategy == "front" and read.kernels() == plan.kernels()
    for key, n in plan.kernels():
        assert [e.pieces for e in read.front(key, n)] == [e.pieces for e in plan.front(key, n)]


def test_front_plans_keep_the_row_filters(mixed_store):
    def used(kernel=FWD, **options):
        return algorithms_used(tuner.optimize([kernel], store=mixed_store, env=ENV, **options))

    assert "eng7" in used() and "fft" not in used(exclude=["fft", "eng7"])
    assert "eng7" not in used(deterministic=True) and "eng7" not in used(exclude=["eng7"])
    assert not used(precise=True) & (TRANSFORM_ALGORITHMS | {"eng7"})
    assert used(api="legacy") <= set(FWD_ALGOS) and used(api="graph") <= set(FWD_ENGINES)
    assert used(BWD_DATA, deterministic=True) <= {"algo_1", "fft_tiling"}


# -- excluded algorithms ---------------------------------------------------------------------------

def algorithms_used(plan) -> set[str]:
    return {piece.algo for entry in plan for piece in entry.pieces}


@pytest.mark.parametrize("limits", [{"workspace_limit": 1 << 30}, {"total_workspace": 1 << 30}, {}])
def test_exclude_and_precise_drop_algorithms(store, limits):
    unrestricted = algorithms_used(tuner.optimize(KERNELS, store=store, env=ENV, **limits))
    assert {"fft", "fft_tiling"} <= unrestricted  # else the checks below prove nothing

    without_fft = algorithms_used(tuner.optimize(KERNELS, store=store, env=ENV,
                                                 exclude=["fft"], **limits))
    assert "fft" not in without_fft and "fft_tiling" in without_fft

    precise = algorithms_used(tuner.optimize(KERNELS, store=store, env=ENV, precise=True,
                                             **limits))
    assert not precise & TRANSFORM_ALGORITHMS
    assert precise  # GEMM-based algorithms remain


def test_excluding_every_algorithm_names_what_is_missing(store):
    with pytest.raises(MissingMeasurementsError):
        tuner.optimize([HUNGRY], workspace_limit=1 << 30, store=store, env=ENV,
                       exclude=list(HUNGRY_ALGOS))


# -- graph-API engine configurations ---------------------------------------------------------------

# name: (ms per launch, ms per sample, workspace bytes per sample, numerical notes). The FFT engine
# is the fastest of all; the zero-workspace engine beats every zero-workspace legacy algorithm.
FWD_ENGINES = {"eng0": (0.02, 0.7, 0, ()), "eng12.k3=1.k11=-1": (0.02, 0.4, 200, ("tensor_core",)),
               "eng7": (0.05, 0.1, 2000, ("fft", "nondeterministic"))}


def engine_rows(problem: ConvProblem, sizes=None) -> list[Measurement]:
    """OK rows of FWD_ENGINES at each size, plus a configuration whose plan did not finalize."""
    rows = []
    for batch in sizes or candidate_sizes(Policy.POWER_OF_TWO, problem.n):
        for name, (launch, per_sample, workspace, notes) in FWD_ENGINES.items():
            rows.append(Measurement(problem.key, batch, name, MathType.FMA,
                                    launch + per_sample * batch, workspace * batch,
                                    note=format_numerical_notes(notes)))
        rows.append(Measurement(problem.key, batch, "eng99", MathType.FMA, math.nan, 0,
                                Status.NOT_SUPPORTED, "cudnnBackendFinalize failed"))
    return rows


@pytest.fixture
def mixed_store(tmp_path):
    with open_store(tmp_path / "mixed.sqlite") as opened:
        opened.put(ENV.gpu, ENV.cudnn, synthetic_rows(FWD, FWD_ALGOS) + engine_rows(FWD)
                   + synthetic_rows(BWD_DATA, BWD_DATA_ALGOS))
        yield opened


def apis_used(plan) -> set[Api]:
    return {piece.api for entry in plan for piece in entry.pieces}


@pytest.mark.parametrize("limit, both", [(0, {"eng0"}), (1 << 30, {"eng7"})])
def test_api_picks_which_rows_plans_are_made_of(mixed_store, limit, both):
    def used(api):
        plan = tuner.optimize([FWD], workspace_limit=limit, store=mixed_store, env=ENV, api=api)
        return algorithms_used(plan), apis_used(plan)

    assert used("both") == (both, {Api.GRAPH})
    legacy, apis = used("legacy")
    assert apis == {Api.LEGACY} and legacy <= set(FWD_ALGOS)
    assert used("graph") == (both, {Api.GRAPH})


def test_precise_and_exclude_apply_to_engine_configurations(mixed_store):
    def used(**options):
        return algorithms_used(tuner.optimize([FWD], workspace_limit=1 << 30, store=mixed_store,
                                              env=ENV, **options))

    assert used(precise=True) == {"eng12.k3=1.k11=-1"}  # the FFT engine and algorithms are out
    assert used(exclude=["eng7"]) == {"fft"}
    assert used(exclude=["eng7"], api="graph") == {"eng12.k3=1.k11=-1"}


def test_mixed_plans_are_written_and_read_back(mixed_store, tmp_path):
    plan = tuner.optimize([FWD, BWD_DATA], workspace_limit=2000, store=mixed_store, env=ENV)
    write_plan(plan, tmp_path / "mixed.plan")
    read = read_plan(tmp_path / "mixed.plan")
    assert [entry.pieces for entry in read] == [entry.pieces for entry in plan]
    assert {Api.GRAPH, Api.LEGACY} == apis_used(read)  # BWD_DATA has legacy rows only


def test_missing_rows_of_the_chosen_api_are_named(store):
    with pytest.raises(MissingMeasurementsError) as exc:
        tuner.optimize([FWD], workspace_limit=0, store=store, env=ENV, api="graph")
    message = str(exc.value)
    assert "no graph API measurements of" in message and "--api graph" in message
    assert "size(s) 1, 2, 4, 8 " in message


def test_unknown_api_is_refused(store):
    with pytest.raises(MucudnnError, match="api 'new' is not one of legacy, graph, both"):
        tuner.optimize([FWD], workspace_limit=0, store=store, env=ENV, api="new")


# -- missing measurements --------------------------------------------------------------------------

def test_missing_sizes_are_named_with_the_key(tmp_path):
    with open_store(tmp_path / "partial.sqlite") as partial:
        partial.put(ENV.gpu, ENV.cudnn, synthetic_rows(FWD, FWD_ALGOS, sizes=[1, 4]))
        with pytest.raises(MissingMeasurementsError) as exc:
            tuner.optimize([FWD], workspace_limit=0, store=partial, env=ENV)
    message = str(exc.value)
    assert FWD.key in message
    assert "size(s) 2, 8 " in message
    assert ENV.gpu in message and str(ENV.cudnn) in message and "powerOfTwo" in message


def test_many_missing_sizes_are_shortened(store):
    twelve = FWD.with_n(12)  # policy 'all' wants sizes 1..12; the store has 1, 2, 4, 8
    with pytest.raises(MissingMeasurementsError) as exc:
        tuner.optimize([twelve], workspace_limit=0, policy="all", store=store, env=ENV)
    assert "size(s) 3, 5, 6, 7, 9, 10, 11, 12 for" in str(exc.value)
    with pytest.raises(MissingMeasurementsError) as exc:
        tuner.optimize([FWD.with_n(16)], workspace_limit=0, policy="all", store=store, env=ENV)
    assert "size(s) 3, 5, 6, 7, 9, 10, 11, 12 ... for" in str(exc.value)


def test_other_environment_has_no_measurements(store):
    with pytest.raises(MissingMeasurementsError, match="Other GPU"):
        tuner.optimize(KERNELS, workspace_limit=0, store=store, env=Environment("Other GPU", 1))


# -- as_kernels ------------------------------------------------------------------------------------

def test_as_kernels_merges_equal_kernels_in_first_seen_order():
    merged = tuner.as_kernels([FWD, BWD_DATA, FWD, (FWD, 2), FWD.with_n(4), (BWD_DATA, 5)])
    assert merged == [(FWD, 4), (BWD_DATA, 6), (FWD.with_n(4), 1)]


def test_as_kernels_takes_a_config_as_it_is():
    class Config:
        def kernels(self):
            return [(FWD, 2), (FWD, 3)]  # a config's own list is not merged again

    assert tuner.as_kernels(Config()) == [(FWD, 2), (FWD, 3)]


def test_as_kernels_of_a_shipped_config_matches_its_kernels():
    import mucudnn
    config = mucudnn.load_config("alexnet")
    assert tuner.as_kernels(config) == config.kernels()


def test_predicted_network_time_weighs_each_kernel(store):
    plan = tuner.optimize(KERNELS, workspace_limit=0, store=store, env=ENV)
    expected = sum(weight * plan.get(p.key, p.n).time_ms for p, weight in KERNELS)
    assert math.isclose(tuner.predicted_network_time(plan, KERNELS), expected)
    assert tuner.predicted_network_time(plan, [(HUNGRY, 7)]) == 0  # kernels without a plan


# -- open_measurements -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def shipped_cache_dir(tmp_path_factory):
    """One directory for every test's user store, so the shipped cache is built only once."""
    return tmp_path_factory.mktemp("stores")


@pytest.fixture
def no_gpu(monkeypatch, shipped_cache_dir, tmp_path, request):
    """No GPU, and a fresh empty user store (``$MUCUDNN_STORE``) beside the shared shipped cache.
    """
    user_store = shipped_cache_dir / f"{re.sub(r'[^A-Za-z0-9]+', '_', request.node.name)}.sqlite"
    open_store(user_store).close()  # MUCUDNN_STORE names a store that exists
    monkeypatch.setenv("MUCUDNN_STORE", str(user_store))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(tuner, "gpu_available", lambda: False)
    monkeypatch.setattr(tuner, "gpu_without_cupy", lambda: None)
    return user_store


def layer_paths(source: tuner.MeasurementSource) -> list:
    """The files a source reads, preferred first."""
    return [layer.path for _, layer in source.layers]


def shipped_environments() -> collections.Counter:
    """Rows per (gpu, cudnn) in the CSV shipped with the package, counted from the file itself."""
    with gzip.open(tuner.SHIPPED_MEASUREMENTS, "rt", encoding="utf-8", newline="") as src:
        return collections.Counter((row["gpu"], int(row["cudnn_version"]))
                                   for row in csv.DictReader(src))


def test_empty_store_and_no_gpu_fall_back_to_the_shipped_measurements(no_gpu):
    chosen_store, env = tuner.open_measurements()
    with chosen_store:
        (gpu, cudnn), _ = shipped_environments().most_common(1)[0]
        assert env == Environment(gpu, cudnn)
        # the user's store first; empty, it is left out of the description
        user, shipped = layer_paths(chosen_store)
        assert user == no_gpu
        assert shipped.parent == no_gpu.parent  # cached beside the user's store
        assert sum(count for *_, count in chosen_store.environments()) == \
            sum(shipped_environments().values())
        assert chosen_store.describe() == (f"measurements of {gpu} / cuDNN {cudnn}: "
                                           f"{shipped_environments()[(gpu, cudnn)]:,} rows from "
                                           "the measurements shipped with mucudnn")


def test_shipped_cache_is_built_once(no_gpu):
    first, _ = tuner.open_measurements()
    first.close()
    [_, path] = layer_paths(first)
    built = path.stat().st_mtime_ns
    second, _ = tuner.open_measurements()
    second.close()
    assert layer_paths(second) == [no_gpu, path] and path.stat().st_mtime_ns == built


def test_tuning_a_shipped_config_works_without_a_gpu(no_gpu):
    import mucudnn
    config = mucudnn.load_config("alexnet")
    plan = tuner.optimize(config, workspace_limit="64MiB")
    assert len(plan) == len(config.kernels())
    assert all(entry.workspace <= 64 << 20 for entry in plan)


def test_user_store_with_one_environment_is_preferred(no_gpu):
    with open_store(no_gpu) as user:
        user.put(ENV.gpu, ENV.cudnn, synthetic_rows(FWD, FWD_ALGOS))
    chosen_store, env = tuner.open_measurements()
    with chosen_store:
        assert env == ENV and layer_paths(chosen_store) == [no_gpu]  # nothing shipped of ENV
    plan = tuner.optimize([FWD], workspace_limit=0)  # no store or env given: found the same way
    assert (plan.gpu, plan.cudnn) == (ENV.gpu, ENV.cudnn)


def test_user_store_with_several_environments_asks_which(no_gpu):
    with open_store(no_gpu) as user:
        user.put(ENV.gpu, ENV.cudnn, synthetic_rows(FWD, FWD_ALGOS))
        user.put("Other GPU", 90100, synthetic_rows(FWD, FWD_ALGOS))
    with pytest.raises(MucudnnError) as exc:
        tuner.open_measurements()
    message = str(exc.value)
    assert "Test GPU / cuDNN 91900" in message and "Other GPU / cuDNN 90100" in message
    assert "--gpu" in message
    chosen_store, env = tuner.open_measurements(env=Environment("Other GPU", 90100))
    with chosen_store:
        assert layer_paths(chosen_store) == [no_gpu] and env.gpu == "Other GPU"


def test_named_environment_only_shipped_uses_the_shipped_store(no_gpu):
    (gpu, cudnn), _ = shipped_environments().most_common(1)[0]
    with open_store(no_gpu) as user:
        user.put(ENV.gpu, ENV.cudnn, synthetic_rows(FWD, FWD_ALGOS))
    chosen_store, env = tuner.open_measurements(env=Environment(gpu, cudnn))
    with chosen_store:
        assert env == Environment(gpu, cudnn)
        assert layer_paths(chosen_store)[0] == no_gpu and len(layer_paths(chosen_store)) == 2
        assert chosen_store.keys(gpu, cudnn), "the shipped rows of that environment"


def test_named_environment_measured_nowhere_reads_the_user_store(no_gpu):
    nowhere = Environment("Nowhere GPU", 1)
    with open_store(no_gpu) as user:
        user.put(ENV.gpu, ENV.cudnn, synthetic_rows(FWD, FWD_ALGOS))
    chosen_store, env = tuner.open_measurements(env=nowhere)
    with chosen_store:
        assert layer_paths(chosen_store) == [no_gpu] and env == nowhere
        with pytest.raises(MissingMeasurementsError, match="Nowhere GPU"):
            tuner.optimize([FWD], workspace_limit=0, store=chosen_store, env=env)


def test_a_store_path_that_does_not_exist_is_an_error_and_not_created(no_gpu, tmp_path):
    typo = tmp_path / "sotre" / "benchmarks.sqlite"
    with pytest.raises(StoreError) as raised:
        tuner.open_measurements(typo)
    assert str(raised.value) == (f"store {typo} does not exist; create it with "
                                 f"`mucudnn bench --store {typo}`")
    assert not typo.parent.exists()


def first_kernel(config: str, direction: Direction) -> ConvProblem:
    import mucudnn
    return next(p for p, _ in mucudnn.load_config(config).kernels() if p.direction is direction)


def test_user_rows_come_first_and_shipped_rows_fill_the_rest(no_gpu):
    """One bench of some kernels on the shipped GPU hides only the shipped rows it replaces."""
    import mucudnn
    (gpu, cudnn), _ = shipped_environments().most_common(1)[0]
    mine = first_kernel("alexnet", Direction.FORWARD)
    with open_store(no_gpu) as user:
        user.put(gpu, cudnn, synthetic_rows(mine, FWD_ALGOS))
    config = mucudnn.load_config("alexnet")
    source, env = tuner.open_measurements()
    with source:
        assert env == Environment(gpu, cudnn) and layer_paths(source)[0] == no_gpu
        plan = tuner.optimize(config, workspace_limit="64MiB", store=source, env=env,
                              api="legacy")
        used = source.describe(used=True)
    assert len(plan) == len(config.kernels())
    user_rows = {(m.batch, m.algo) for m in synthetic_rows(mine, FWD_ALGOS)}
    assert all((p.batch, p.algo) in user_rows for p in plan.get(mine.key, mine.n).pieces)
    counts = [int(n.replace(",", "")) for n in re.findall(r"([\d,]+) rows from", used)]
    assert len(counts) == 2 and all(counts), used
    assert used.startswith(f"measurements of {gpu} / cuDNN {cudnn}: ")
    assert f"rows from store {no_gpu}, " in used and used.endswith("shipped with mucudnn")
    assert plan.comments == (used,)


def test_every_kernel_lacking_measurements_is_counted(tmp_path):
    with open_store(tmp_path / "partial.sqlite") as partial:
        partial.put(ENV.gpu, ENV.cudnn, synthetic_rows(FWD, FWD_ALGOS))
        with pytest.raises(MissingMeasurementsError) as exc:
            tuner.optimize([FWD, BWD_DATA, HUNGRY], workspace_limit=0, store=partial, env=ENV)
    assert str(exc.value).startswith(
        "2 of 3 kernels lack measurements (8 micro-batch sizes in all); the first: no "
        f"measurements of {BWD_DATA.key} at micro-batch size(s) 1, 2, 4, 8 for {ENV.gpu}")


def test_a_gpu_without_cupy_is_named_with_what_benchmarking_needs(no_gpu, monkeypatch, tmp_path):
    monkeypatch.setattr(tuner, "gpu_without_cupy", lambda: "NVIDIA H100 80GB HBM3")
    source, env = tuner.open_measurements()
    source.close()
    [warning] = source.warnings
    assert "NVIDIA H100 80GB HBM3" in warning and "pip install 'mucudnn[gpu]'" in warning
    assert f"these are measurements of {env.gpu}, whose plans the shim refuses" in warning
    with pytest.warns(UserWarning, match=r"mucudnn\[gpu\]"):
        plan = tuner.optimize([first_kernel("alexnet", Direction.FORWARD)],
                              workspace_limit="64MiB")
    write_plan(plan, tmp_path / "a.plan")
    lines = (tmp_path / "a.plan").read_text().splitlines()
    assert lines[1] == f"# {plan.comments[0]}" and "shipped with mucudnn" in lines[1]
    assert [(e.key, e.pieces) for e in read_plan(tmp_path / "a.plan")] == \
        [(e.key, e.pieces) for e in plan]


def test_gpu_without_cupy_is_none_where_cupy_is_installed(monkeypatch):
    monkeypatch.setattr(tuner.importlib.util, "find_spec", lambda name: object())
    assert tuner.gpu_without_cupy() is None


def build_shipped_unprivileged(cache_home: str, temporary: str) -> str:
    os.environ.pop("MUCUDNN_STORE", None)
    os.environ["XDG_CACHE_HOME"] = cache_home
    tempfile.tempdir = temporary
    with tuner.shipped_store() as shipped:
        assert shipped.environments()
        return str(shipped.path)


def test_a_read_only_cache_directory_caches_the_shipped_rows_elsewhere(shared_dir):
    (shared_dir / "xdg").mkdir()
    (shared_dir / "tmp").mkdir()
    hand_over(shared_dir / "tmp")
    (shared_dir / "xdg").chmod(0o555)
    built = as_unprivileged(build_shipped_unprivileged, str(shared_dir / "xdg"),
                            str(shared_dir / "tmp"))
    uid = tuner.os.getuid() if tuner.os.geteuid() else 65534
    assert pathlib.Path(built).parent == shared_dir / "tmp" / f"mucudnn-{uid}"
    (shared_dir / "tmp").chmod(0o555)
    with pytest.raises(UnwritableError) as raised:
        as_unprivileged(build_shipped_unprivileged, str(shared_dir / "xdg"),
                        str(shared_dir / "tmp" / "none"))
    message = str(raised.value)
    assert message.startswith("cannot cache the shipped measurements (")
    assert str(shared_dir / "xdg" / "mucudnn") in message and str(shared_dir / "tmp") in message


# -- baselines -------------------------------------------------------------------------------------

def entry_of(problem: ConvProblem) -> PlanEntry:
    return PlanEntry(problem.key, problem.n, 0, 1.0,
                     (PlanPiece(problem.n, "gemm", MathType.FMA),))


@pytest.mark.parametrize("limit", [0, 800, 4000, 8000, 1 << 30])
def test_baselines_are_the_best_undivided_times(store, limit):
    within, uncapped = tuner.baselines(store, ENV, entry_of(FWD), limit)
    assert within == best_undivided(store, FWD, limit)
    assert uncapped == best_undivided(store, FWD, None)
    assert uncapped <= within


def test_baselines_without_a_fitting_algorithm(store):
    within, uncapped = tuner.baselines(store, ENV, entry_of(HUNGRY), 50)
    assert within is None
    assert uncapped == best_undivided(store, HUNGRY, None)


def test_baselines_without_measurements_at_n(store):
    assert tuner.baselines(store, ENV, entry_of(FWD.with_n(3)), 0) == (None, None)
    assert tuner.baselines(store, Environment("Other GPU", 1), entry_of(FWD), 0) == (None, None)


def test_a_store_object_without_an_environment_uses_its_only_one(store, monkeypatch):
    monkeypatch.setattr(tuner, "gpu_available", lambda: False)
    plan = tuner.optimize(KERNELS, workspace_limit="64MiB", store=store)
    assert (plan.gpu, plan.cudnn) == (ENV.gpu, ENV.cudnn)
    assert [(e.key, e.n) for e in plan] == [(p.key, p.n) for p, _ in KERNELS]
    assert store.keys(ENV.gpu, ENV.cudnn)  # the caller's store is left open


def test_a_store_path_is_opened_and_closed(store, monkeypatch):
    monkeypatch.setattr(tuner, "gpu_available", lambda: False)
    monkeypatch.setattr(tuner, "gpu_without_cupy", lambda: None)
    closed = []
    real_close = type(store).close
    monkeypatch.setattr(type(store), "close", lambda self: closed.append(self) or real_close(self))
    plan = tuner.optimize(KERNELS, total_workspace="1GiB", store=store.path, env=ENV)
    assert plan.strategy == "wd" and len(plan) == len(KERNELS)
    assert any(s is not store and s.path == store.path for s in closed)


# -- policy fit ------------------------------------------------------------------------------------

def test_fit_plans_use_the_stored_extra_sizes(store):
    # FWD at N = 8: fft takes 1000 bytes a sample; under 3000 bytes its largest size is 3
    limit = 3000
    extra = synthetic_rows(FWD, FWD_ALGOS, sizes=[3])
    store.put(ENV.gpu, ENV.cudnn, extra)
    fit = tuner.optimize([FWD], workspace_limit=limit, policy="fit", store=store, env=ENV)
    pow2 = tuner.optimize([FWD], workspace_limit=limit, policy="powerOfTwo", store=store, env=ENV)
    [fit_entry], [pow2_entry] = list(fit), list(pow2)
    assert 3 in {piece.batch for piece in fit_entry.pieces}
    assert fit_entry.time_ms < pow2_entry.time_ms
    assert fit.policy == "fit"
    rows = tuner.measurements(store, ENV, FWD, "fit")
    assert {row.batch for row in rows} == set(candidate_sizes("powerOfTwo", N)) | {3}


def test_fit_needs_the_powers_of_two_and_a_limit_to_benchmark(tmp_path):
    with open_store(tmp_path / "few.sqlite") as few:
        few.put(ENV.gpu, ENV.cudnn, synthetic_rows(FWD, FWD_ALGOS, sizes=[3, 8]))
        with pytest.raises(MissingMeasurementsError, match="policy fit"):
            tuner.measurements(few, ENV, FWD, "fit")
    with pytest.raises(MucudnnError, match="workspace limit"):
        tuner.benchmark([FWD], "fit", store=tmp_path / "s.sqlite")


# -- borrowing the output as workspace -------------------------------------------------------------

def test_borrow_output_plans_faster_within_the_same_limit(store, tmp_path):
    plain = tuner.optimize(KERNELS, workspace_limit=50, store=store, env=ENV)
    borrowing = tuner.optimize(KERNELS, workspace_limit=50, store=store, env=ENV, borrow_output=True)
    for problem, _ in KERNELS:
        entry, before = borrowing.get(problem.key, N), plain.get(problem.key, N)
        assert entry.time_ms < before.time_ms
        assert entry.workspace <= 50
        assert any(piece.borrow for piece in entry.pieces)
        done = 0
        for piece in entry.pieces:  # each borrowing piece fits the output the later pieces write
            done += piece.batch
            if piece.borrow:
                assert measured(store, entry, piece).workspace <= (N - done) * problem.written_sample_bytes
    path = tmp_path / "borrow.plan"
    write_plan(borrowing, path)
    assert [str(p) for p in read_plan(path).get(FWD.key, N).pieces] == [
        str(p) for p in borrowing.get(FWD.key, N).pieces]


def test_borrow_output_needs_a_limit_per_kernel(store):
    with pytest.raises(MucudnnError, match="borrow_output works with a workspace limit per kernel"):
        tuner.optimize(KERNELS, total_workspace=1 << 20, store=store, env=ENV, borrow_output=True)


# -- deterministic plans ---------------------------------------------------------------------------

def test_deterministic_plans_have_no_nondeterministic_piece(mixed_store):
    """The shim runs a plan for a caller that chose a deterministic algorithm or engine only if
    every piece is deterministic: `tune --deterministic` makes such plans."""
    def used(kernel, limit, **options):
        return algorithms_used(tuner.optimize([kernel], workspace_limit=limit, store=mixed_store,
                                              env=ENV, **options))

    assert "eng7" in used(FWD, 1 << 30)  # the fastest engine is noted non-deterministic
    assert "eng7" not in used(FWD, 1 << 30, deterministic=True)
    assert used(BWD_DATA, 0) == {"algo_0"}  # the only workspace-free backward-data algorithm
    with pytest.raises(MucudnnError, match="no plan within the workspace limit of 0 bytes"):
        used(BWD_DATA, 0, deterministic=True)
    assert used(BWD_DATA, 64, deterministic=True) == {"algo_1"}


def test_what_counts_as_nondeterministic():
    from mucudnn.engines import is_nondeterministic
    row = lambda algo, note="": Measurement("k", 1, algo, MathType.FMA, 1.0, 0, note=note)  # noqa: E731
    assert is_nondeterministic(row("algo_0"), "bwd_filter") and is_nondeterministic(row("algo_3"), "bwd_filter")
    assert is_nondeterministic(row("algo_0"), Direction.BACKWARD_DATA)
    assert not is_nondeterministic(row("algo_1"), "bwd_filter") and not is_nondeterministic(row("gemm"), "fwd")
    assert is_nondeterministic(row("eng7", format_numerical_notes(["nondeterministic"])), "fwd")
    assert not is_nondeterministic(row("eng0", format_numerical_notes([])), "fwd")
    assert is_nondeterministic(row("eng0", "cudnnBackendFinalize failed"), "fwd")  # notes unknown


def test_fit_without_the_fit_sizes_warns_how_many_kernels_lack_them(store):
    """The store has only powers of two: a fit plan would silently be the powerOfTwo plan."""
    limit = 3000  # fft's and fft_tiling's largest size within it is 3
    with pytest.warns(tuner.FitSizesMissingWarning, match=r"2 of 2 kernels .* --policy fit "):
        fit = tuner.optimize(KERNELS, workspace_limit=limit, policy="fit", store=store, env=ENV)
    pow2 = tuner.optimize(KERNELS, workspace_limit=limit, policy="powerOfTwo", store=store, env=ENV)
    assert [e.pieces for e in fit] == [e.pieces for e in pow2]

    store.put(ENV.gpu, ENV.cudnn, synthetic_rows(FWD, FWD_ALGOS, sizes=[3]))
    with pytest.warns(tuner.FitSizesMissingWarning, match=r"1 of 2 kernels"):
        tuner.optimize(KERNELS, workspace_limit=limit, policy="fit", store=store, env=ENV)
    store.put(ENV.gpu, ENV.cudnn, synthetic_rows(BWD_DATA, BWD_DATA_ALGOS, sizes=[3]))
    with warnings.catch_warnings():
        warnings.simplefilter("error", tuner.FitSizesMissingWarning)
        tuner.optimize(KERNELS, workspace_limit=limit, policy="fit", store=store, env=ENV)


@pytest.mark.parametrize("name, hint", [("fft_tilling", "did you mean 'fft_tiling'?"),
                                        ("eng", "or an engine name")])
def test_an_unknown_excluded_name_is_refused(store, name, hint):
    with pytest.raises(MucudnnError, match=re.escape(f"--exclude-algo {name!r}") + ".*"
                       + re.escape(hint)):
        tuner.optimize(KERNELS, workspace_limit="64MiB", store=store, env=ENV, exclude=[name])


def test_a_plan_carries_its_restrictions_and_its_baselines_obey_them(store, tmp_path):
    """A plan without fft: its baseline within the limit must not be an fft time either."""
    plan = tuner.optimize([HUNGRY], workspace_limit="1GiB", store=store, env=ENV,
                          exclude=["fft"], api="legacy")
    assert plan.restrictions == Restrictions(api="legacy", exclude=("fft",))
    write_plan(plan, tmp_path / "p.plan")
    assert read_restrictions(tmp_path / "p.plan") == plan.restrictions
    [entry] = plan
    undivided, uncapped = tuner.baselines(store, ENV, entry, plan.limit, plan.restrictions)
    assert {p.algo for p in entry.pieces} == {"gemm"}
    assert undivided == uncapped == pytest.approx(entry.time_ms)
    # everything allowed, fft is the baseline (faster than the plan that could not use it)
    assert tuner.baselines(store, ENV, entry, plan.limit)[0] < entry.time_ms


def test_a_plan_that_could_use_configurations_a_smaller_bench_limit_left_untimed_says_so(store):
    """A store benched with --workspace-limit 1KiB has no times above it: a front (or a larger
    limit) made from it silently lacks the fastest configurations unless tune says so."""
    from mucudnn.measurement import OVER_LIMIT_NOTE
    untimed = [Measurement(FWD.key, b, "winograd", MathType.FMA, math.nan, 5000 * b, Status.NOT_SUPPORTED,
                           note=OVER_LIMIT_NOTE.format(bound=1024))
               for b in candidate_sizes(Policy.POWER_OF_TWO, FWD.n)]
    store.put(ENV.gpu, ENV.cudnn, untimed)
    with pytest.warns(tuner.UntimedOverLimitWarning, match=r"1 of 2 kernels .* \(from 4.9KiB of workspace\) "
                      r"but this plan \(any workspace\)"):
        tuner.optimize(KERNELS, store=store, env=ENV)  # a front: no limit
    with pytest.warns(tuner.UntimedOverLimitWarning, match=r"1 of 2 kernels .*or with --workspace-limit"):
        tuner.optimize(KERNELS, workspace_limit="1MiB", store=store, env=ENV)
    with warnings.catch_warnings():  # a plan within the bench's own limit needs none of them
        warnings.simplefilter("error", tuner.UntimedOverLimitWarning)
        tuner.optimize(KERNELS, workspace_limit=1024, store=store, env=ENV)
