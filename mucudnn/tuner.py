"""The Python API: benchmark kernels, optimise plans (WR or WD), in a few calls.

    >>> import mucudnn
    >>> cfg = mucudnn.load_config("resnet50")
    >>> mucudnn.benchmark(cfg)                                  # on a GPU: fills the store
    >>> plan = mucudnn.optimize(cfg)                            # front: each kernel's trade-offs
    >>> plan = mucudnn.optimize(cfg, workspace_limit="64MiB")   # WR, policy powerOfTwo
    >>> plan = mucudnn.optimize(cfg, total_workspace="1GiB")    # WD (ILP over all kernels)
    >>> mucudnn.write_plan(plan, "resnet50.plan")

Kernels come from a network config or from a recording of what a framework ran
(:func:`mucudnn.plan.read_recording_weights`), as ``(problem, weight)`` pairs: ``weight`` is how
many layers run that kernel (in a recording, how often it ran per step), which the WD optimiser
and the predicted time per pass use to weigh time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import gzip
import hashlib
import importlib.util
import os
import tempfile
import warnings
from pathlib import Path
from typing import Sequence

from . import store as store_mod
from .environment import (Environment, cupy_module, current_environment, gpu_available,
                          visible_gpus)
from .engines import api_of, parse_engine_name, select_apis
from .errors import (EngineNameError, MissingMeasurementsError, MucudnnError, ReadOnlyStoreError,
                     UnwritableError)
from .measurement import OVER_LIMIT, Measurement
from .optimizer import (Policy, best_plan, candidate_sizes, fit_sizes, pareto_plans, solve_budget,
                        thin_front)
from .plan import FRONT, NO_LIMIT, Plan, PlanEntry, Restrictions
from .problem import ALGORITHMS, ConvProblem
from .sizes import format_size, parse_size

Kernels = Sequence[tuple[ConvProblem, int]]

SHIPPED_MEASUREMENTS = Path(__file__).parent / "data" / "measurements.csv.gz"


def as_kernels(source) -> list[tuple[ConvProblem, int]]:
    """(problem, weight) pairs from a NetworkConfig, a list of problems, or such pairs."""
    if hasattr(source, "kernels"):
        return list(source.kernels())
    merged: dict[tuple[str, int], list] = {}
    for item in source:
        problem, weight = item if isinstance(item, tuple) else (item, 1)
        slot = merged.setdefault((problem.key, problem.n), [problem, 0])
        slot[1] += weight
    return [(p, w) for p, w in merged.values()]


# -- where measurements come from ---------------------------------------------------------------

#: How the shipped measurements are named in messages and plan comments.
SHIPPED_NAME = "the measurements shipped with mucudnn"


def shipped_store() -> store_mod.SQLiteStore:
    """The measurements shipped with mucudnn (taken on the lent GPU), as a read-only store.

    Loaded once from the package's CSV into a cache file named by the CSV's hash, beside the
    default store or, where that directory cannot be written, in the temporary directory.
    """
    data = SHIPPED_MEASUREMENTS.read_bytes()
    name = f"shipped-{hashlib.sha256(data).hexdigest()[:16]}.sqlite"
    places = [store_mod.default_store_path().parent,
              Path(tempfile.gettempdir()) / f"mucudnn-{os.getuid()}"]
    failures = []
    for place in places:
        cache = place / name
        try:
            if not cache.exists():
                _build_shipped_cache(cache)
            return store_mod.SQLiteStore(cache, readonly=True)
        except (OSError, store_mod.StoreError) as exc:
            failures.append(f"{cache}: {getattr(exc, 'strerror', None) or exc}")
    raise UnwritableError("cannot cache the shipped measurements (" + "; ".join(failures)
                          + "): set XDG_CACHE_HOME to a writable directory")


def _build_shipped_cache(cache: Path) -> None:
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_name(cache.name + f".tmp{os.getpid()}")
    try:
        with store_mod.SQLiteStore(tmp) as fresh:
            with gzip.open(SHIPPED_MEASUREMENTS, "rt", encoding="utf-8", newline="") as src:
                fresh.import_csv(src)
        os.replace(tmp, cache)
    finally:
        for leftover in (tmp, Path(f"{tmp}-wal"), Path(f"{tmp}-shm")):
            leftover.unlink(missing_ok=True)


class MeasurementSource(store_mod.BenchmarkStore):
    """The measurements plans are made from: the user's store first, then the shipped ones.

    Read-only. ``layers`` are ``(name, store)`` pairs, first preferred. The rows of one kernel at
    one micro-batch size in one API (legacy algorithms, graph-API engines) are timed together, so
    they come whole from the first layer that has any of them: a user's ``bench`` of some
    kernels or sizes hides only the shipped rows it replaces. :meth:`describe` says where the
    rows came from; ``warnings`` holds what the user must hear about them.
    """

    def __init__(self, env: Environment, layers: Sequence[tuple[str, store_mod.BenchmarkStore]]):
        self.env = env
        self.layers = list(layers)
        self.warnings: list[str] = []
        self._used: dict[str, set[tuple]] = {name: set() for name, _ in self.layers}

    def __repr__(self) -> str:
        return f"MeasurementSource({self.describe()!r})"

    def put_rows(self, rows) -> int:
        raise ReadOnlyStoreError(f"cannot write {self.describe()}: open a store with "
                                 "mucudnn.store.open_store to write")

    def check_writable(self) -> None:
        self.put_rows(())

    def rows(self, gpu=None, cudnn_version=None, key=None) -> list[store_mod.StoredMeasurement]:
        return self._merged(gpu, cudnn_version, key, count=True)

    def _merged(self, gpu, cudnn_version, key, count: bool) -> list[store_mod.StoredMeasurement]:
        chosen, taken = [], set()
        for name, layer in self.layers:
            here = layer.rows(gpu, cudnn_version, key)
            fresh = {_group(row) for row in here} - taken
            for row in here:
                if _group(row) in fresh:
                    chosen.append(row)
                    if count:
                        self._used[name].add(_identity(row))
            taken |= fresh
        return sorted(chosen, key=_identity)

    def measured_batches(self, gpu: str, cudnn_version: int, key: str) -> set[int]:
        return set().union(*(layer.measured_batches(gpu, cudnn_version, key)
                             for _, layer in self.layers))

    def environments(self) -> list[tuple[str, int, int]]:
        envs = sorted({env[:2] for _, layer in self.layers for env in layer.environments()})
        return [(gpu, cudnn, len(self._merged(gpu, cudnn, None, count=False)))
                for gpu, cudnn in envs]

    def keys(self, gpu: str, cudnn_version: int) -> list[str]:
        return sorted(set().union(*(layer.keys(gpu, cudnn_version) for _, layer in self.layers)))

    def close(self) -> None:
        for _, layer in self.layers:
            layer.close()

    def describe(self, used: bool = False) -> str:
        """``measurements of GPU / cuDNN V: N rows from store PATH, M rows from the shipped
        ones``: each layer's rows of the environment, or (``used``) those read so far; a layer
        with none is left out."""
        parts = []
        for name, layer in self.layers:
            if used:
                count = len(self._used[name])
            else:
                count = sum(n for g, c, n in layer.environments()
                            if (g, c) == (self.env.gpu, self.env.cudnn))
            if count:
                parts.append(f"{count:,} rows from {name}")
        return (f"measurements of {self.env.gpu} / cuDNN {self.env.cudnn}: "
                + (", ".join(parts) if parts else "none"))


def _identity(row: store_mod.StoredMeasurement) -> tuple:
    m = row.measurement
    return row.gpu, row.cudnn_version, m.key, m.batch, m.algo, m.math.value


def _group(row: store_mod.StoredMeasurement) -> tuple:
    """The rows timed together: one kernel at one size in one API, in one environment."""
    m = row.measurement
    return row.gpu, row.cudnn_version, m.key, m.batch, api_of(m.algo)


def open_measurements(path=None, env: Environment | None = None):
    """The measurements to tune from (a read-only :class:`MeasurementSource`), and their
    environment.

    The environment is ``env``, else this GPU's, else the user's store's only one, else the
    shipped measurements' (no GPU and no measurements of one's own: tuning works anywhere).
    Its rows come from the user's store (``path``, ``$MUCUDNN_STORE`` or the default) first and
    from the shipped measurements of the same GPU and cuDNN for the rest. A ``path`` given that
    does not exist is an error (a mistyped ``--store`` must not tune from other data), and so is
    a ``$MUCUDNN_STORE`` that does not exist; the default store may be absent.
    """
    named = "" if path is not None else " (MUCUDNN_STORE)"
    if path is None and os.environ.get("MUCUDNN_STORE"):
        path = store_mod.default_store_path()
    if path is not None and not Path(path).expanduser().exists():
        raise store_mod.StoreError(f"store {path}{named} does not exist; create it with "
                                   f"`mucudnn bench --store {path}`")
    user_path = Path(path).expanduser() if path is not None else store_mod.default_store_path()
    user = store_mod.SQLiteStore(user_path, readonly=True) if user_path.exists() else None
    layers = [] if user is None else [(f"store {user_path}", user)]
    notes = []
    try:
        chosen = env or _pick_environment(user)
        try:
            shipped = shipped_store()
        except UnwritableError as exc:
            if chosen is None:
                raise
            notes.append(f"{exc}; tuning without them")
            shipped = None
        if shipped is not None:
            layers.append((SHIPPED_NAME, shipped))
        envs = {(g, c): n for g, c, n in shipped.environments()} if shipped else {}
        if chosen is None:
            if not envs:
                raise MissingMeasurementsError(
                    "no measurements anywhere: run 'mucudnn bench' on a GPU")
            chosen = Environment(*max(envs, key=envs.get))
        if shipped is not None and (chosen.gpu, chosen.cudnn) not in envs:
            layers.pop()
            shipped.close()
    except BaseException:
        for _, layer in layers:
            layer.close()
        raise
    source = MeasurementSource(chosen, layers)
    source.warnings.extend(notes)
    unseen = gpu_without_cupy()
    if unseen is not None:
        source.warnings.append(
            f"this machine has a GPU ({unseen}) but no CuPy, so nothing is benchmarked on it: "
            f"benchmarking needs pip install 'mucudnn[gpu]'"
            + ("" if unseen == chosen.gpu else
               f"; these are measurements of {chosen.gpu}, whose plans the shim refuses on "
               f"{unseen}"))
    return source, chosen


def gpu_without_cupy() -> str | None:
    """The name of this machine's first GPU when CuPy is not installed (so ``bench`` cannot run)
    but the CUDA driver lists one, else None."""
    if importlib.util.find_spec("cupy") is not None:
        return None
    gpus = visible_gpus()
    return gpus[0].name if gpus else None


def _pick_environment(store) -> Environment | None:
    if gpu_available():
        return current_environment()
    envs = store.environments() if store is not None else []
    if len(envs) == 1:
        return Environment(envs[0][0], envs[0][1])
    if len(envs) > 1:
        names = "; ".join(f"{g} / cuDNN {c} ({n} rows)" for g, c, n in envs)
        raise MucudnnError(f"the store holds measurements of several environments ({names}): "
                           "choose one with --gpu and --cudnn")
    return None


# -- benchmark ----------------------------------------------------------------------------------

def benchmark(source, policy: Policy | str = Policy.POWER_OF_TWO, store=None,
              remeasure: bool = False, progress: bool = True, method=None, api: str = "both",
              max_engine_configs: int = 8, workspace_limit=None, borrow_output: bool = False,
              quick: bool = False, gpus=None, events=None) -> int:
    """Measure every kernel of ``source`` at the policy's micro-batch sizes on the current GPU.

    ``api`` is ``"legacy"`` (cuDNN's algorithms), ``"graph"`` (engine configurations of the graph
    API: up to ``max_engine_configs`` from heuristics mode A and all fallback ones per size) or
    ``"both"``. Policy ``fit`` needs ``workspace_limit``: after the powers of two it measures
    :func:`~mucudnn.optimizer.fit_sizes` (with ``borrow_output``, also the sizes pieces that
    borrow their output would take). With another policy, configurations over ``workspace_limit``
    (beyond the output they may borrow, with ``borrow_output``) are not timed, and ``quick``
    skips the sizes that cannot beat the larger ones (:class:`~mucudnn.bench.Pruning`).
    Rows already in the store are reused unless ``remeasure``. Returns how many sizes were timed.

    ``gpus``: ``"all"`` or None (every GPU CuPy sees), ``"0,1"`` or a list of CuPy ordinals. With
    more than one, the kernels are split over one worker process per GPU, every GPU model
    measuring every kernel (:mod:`mucudnn.multigpu`); with one, this process measures on the
    current GPU. ``events``: see :class:`~mucudnn.bench.Benchmarker`.
    """
    from .bench import Benchmarker, Pruning
    from .timing import TimingMethod
    policy = Policy(policy)
    if policy is Policy.FIT and workspace_limit is None:
        raise MucudnnError("policy fit measures the sizes that fit a workspace limit: give one "
                           "(bench --workspace-limit)")
    if quick and workspace_limit is None:
        raise MucudnnError("quick skips the sizes that cannot help plans within a workspace "
                           "limit: give one (bench --workspace-limit)")
    if policy is Policy.FIT and quick:
        raise MucudnnError("quick times sizes largest first and stops; policy fit derives its "
                           "sizes from every power of two: use one or the other")
    limit = None if workspace_limit is None else parse_size(workspace_limit)
    # fit reads every configuration's workspace at each power of two to place its sizes
    pruning = Pruning(None if policy is Policy.FIT else limit, borrow_output, quick)
    apis = select_apis(api)
    own = store is None or isinstance(store, (str, os.PathLike))
    # without CuPy nothing can be measured: no store is created, and no worker started, for nothing
    cupy_module()
    st = store_mod.open_store(store) if own else store
    try:
        st.check_writable()
        kernels = [p for p, _ in as_kernels(source)]
        spread = _gpus_to_spread_over(gpus)
        if spread:
            job = {"store": str(Path(st.path).resolve()), "policy": policy.value,
                   "remeasure": remeasure, "api": api, "max_engine_configs": max_engine_configs,
                   "workspace_limit": limit, "borrow_output": borrow_output, "quick": quick,
                   "method": dataclasses.asdict(method or TimingMethod())}

            def costs(gpu_name: str) -> list[tuple[ConvProblem, float]]:
                return _kernels_to_measure(st, gpu_name, kernels, policy, pruning, apis,
                                           remeasure)

            from .multigpu import benchmark_on_gpus
            return benchmark_on_gpus(spread, costs, job, progress).timed
        bench = Benchmarker(st, method or TimingMethod(), progress=progress,
                            max_engine_configs=max_engine_configs, pruning=pruning, events=events)
        timed = bench.benchmark([(p, candidate_sizes(policy, p.n)) for p in kernels],
                                remeasure=remeasure, apis=apis)
        if policy is Policy.FIT:
            more = [(p, fit_sizes(st.get(bench.env.gpu, bench.env.cudnn, p.key), p.n, limit,
                                  p.written_sample_bytes if borrow_output else 0))
                    for p in kernels]
            timed += bench.benchmark([(p, sizes) for p, sizes in more if sizes],
                                     remeasure=remeasure, apis=apis)
        return timed
    finally:
        if own:
            st.close()


def _gpus_to_spread_over(gpus) -> list | None:
    """The GPUs :func:`benchmark` spreads over (:mod:`mucudnn.multigpu`), or None where this
    process measures alone on its current GPU: one GPU (or none: the benchmarker says why)."""
    from .multigpu import select_gpus
    if gpus in ("0", [0], (0,)):
        return None  # the current GPU: this process (what a worker asks for)
    visible = visible_gpus() or []
    if gpus in (None, "all"):
        return visible if len(visible) > 1 else None
    chosen = select_gpus(gpus, visible)
    return None if [gpu.index for gpu in chosen] == [0] else chosen


def gpu_models_here() -> list[Environment]:
    """The distinct GPU models here (:func:`~mucudnn.environment.visible_gpus`), in device order,
    each with the loaded cuDNN's version ([] without a GPU): what measurements and plans are made
    for on this node."""
    names = list(dict.fromkeys(gpu.name for gpu in visible_gpus() or []))
    if not names:
        return []
    from .cudnn import get
    version = get().version
    return [Environment(name, version) for name in names]


def _kernels_to_measure(store, gpu_name: str, kernels: Sequence[ConvProblem], policy: Policy,
                        pruning, apis, remeasure: bool) -> list[tuple[ConvProblem, float]]:
    """The kernels GPU model ``gpu_name`` still has to measure, each with its cost: the count of
    sizes it lacks (each costs about a timing budget per configuration; no finer estimate is
    known before measuring). Policy fit: every kernel, as its fit sizes are known only later."""
    from .bench import missing_apis
    from .cudnn import get
    env = Environment(gpu_name, get().version)
    found = []
    for p in kernels:
        sizes = candidate_sizes(policy, p.n)
        missing = len(sizes) if remeasure else len(missing_apis(
            store.get(env.gpu, env.cudnn, p.key, batches=sizes), sizes, apis, p, pruning))
        if missing or policy is Policy.FIT:
            found.append((p, float(missing + (policy is Policy.FIT))))
    return found


def measurements(store, env: Environment, problem: ConvProblem, policy: Policy | str,
                 api: str = "both") -> list[Measurement]:
    """Stored rows of ``problem`` at the policy's sizes in ``api`` (``"legacy"``, ``"graph"`` or
    ``"both"``); raises if any size has no row of those APIs."""
    rows, missing = _rows_and_missing(store, env, problem, policy, api)
    if missing:
        raise MissingMeasurementsError(_missing_message([(problem, missing)], 1, env, policy, api))
    return rows


def _rows_and_missing(store, env: Environment, problem: ConvProblem, policy: Policy | str,
                      api: str) -> tuple[list[Measurement], list[int]]:
    """(the rows :func:`measurements` returns, the policy's sizes with no row)."""
    apis = select_apis(api)
    sizes = candidate_sizes(policy, problem.n)
    # fit plans may use every measured size up to n; the powers of two must be there
    wanted = None if Policy(policy) is Policy.FIT else sizes
    rows = [m for m in store.get(env.gpu, env.cudnn, problem.key, batches=wanted)
            if api_of(m.algo) in apis and m.batch <= problem.n]
    return rows, sorted(set(sizes) - {m.batch for m in rows})


def _missing_message(missing: list[tuple[ConvProblem, list[int]]], kernels: int,
                     env: Environment, policy: Policy | str, api: str) -> str:
    """One line: the first kernel lacking measurements, its sizes, and how many lack any."""
    which = "" if len(select_apis(api)) > 1 else f"{api} API "
    problem, sizes = missing[0]
    shown = ", ".join(map(str, sizes[:8])) + (" ..." if len(sizes) > 8 else "")
    text = f"no {which}measurements of {problem.key} at micro-batch size(s) {shown} for "
    if len(missing) > 1:
        total = sum(len(s) for _, s in missing)
        text = (f"{len(missing)} of {kernels} kernels lack {which}measurements "
                f"({total} micro-batch sizes in all); the first: " + text)
    return (text + f"{env.gpu} / cuDNN {env.cudnn} (policy {Policy(policy).value}): run "
            f"'mucudnn bench' with this policy{f' and --api {api}' if which else ''} "
            "on that GPU first")


# -- optimise -----------------------------------------------------------------------------------

def optimize(source, workspace_limit=None, total_workspace=None,
             policy: Policy | str = Policy.POWER_OF_TWO, store=None,
             env: Environment | None = None, exclude: Sequence[str] = (),
             precise: bool = False, api: str = "both", borrow_output: bool = False,
             deterministic: bool = False, front: bool = False) -> Plan:
    """A plan for every kernel of ``source``.

    With neither ``workspace_limit`` nor ``total_workspace``: a ``front`` plan, each kernel's
    Pareto front of (time, workspace) from :func:`pareto_plans`, thinned by :func:`thin_front`
    (the shim runs, per call, the fastest point within the workspace the call has).
    ``workspace_limit`` alone (WR): each kernel's fastest plan within this many bytes; with
    ``front=True``, the front cut at that many bytes instead (the plan's ``limit``).
    ``total_workspace`` (WD): all kernels' workspaces together within this budget. Sizes may be
    strings like ``"64MiB"``. Algorithms and engine configurations named in ``exclude`` are
    never used (a name that is neither raises :class:`MucudnnError`); ``precise`` also excludes the
    transform-based ones (:func:`~mucudnn.engines.is_transform_based`), ``deterministic`` the
    non-deterministic ones (:func:`~mucudnn.engines.is_nondeterministic`: a caller that chose a
    deterministic algorithm or engine, as ``torch.backends.cudnn.deterministic`` makes PyTorch do,
    runs only plans without them). The plan records these restrictions (``Plan.restrictions``),
    and its baselines (:func:`baselines`) obey them.
    ``api`` limits the pieces to one cuDNN API: ``"legacy"`` for plans the shim runs on the legacy
    path, ``"graph"``, or ``"both"`` (every stored row). ``borrow_output`` (WR only) lets forward
    and backward-data pieces over the limit use the part of their output that later pieces will
    write as their workspace (:func:`best_plan`): no memory beyond the limit, only the order of the
    pieces is fixed, and the shim runs such a plan only for calls with beta = 0.
    """
    if workspace_limit is not None and total_workspace is not None:
        raise MucudnnError("give at most one of workspace_limit (WR, or a front's cap) and "
                           "total_workspace (WD)")
    if front and total_workspace is not None:
        raise MucudnnError("a front plan takes workspace_limit as its cap, not total_workspace")
    front = front or (workspace_limit is None and total_workspace is None)
    if borrow_output and (front or total_workspace is not None):
        raise MucudnnError("borrow_output works with a workspace limit per kernel (WR), "
                           "not with a front plan or total_workspace (WD)")
    policy = Policy(policy)
    kernels = as_kernels(source)
    check_excluded_names(exclude)
    rules = Restrictions(api=api, precise=precise, exclude=tuple(dict.fromkeys(exclude)),
                         deterministic=deterministic)
    select_apis(api)  # an unknown api is one error here, not a failure per row

    rows, missing = {}, []
    with _measurements_source(store, env) as (st, env):
        for p, _ in kernels:
            found, lacking = _rows_and_missing(st, env, p, policy, api)
            rows[(p.key, p.n)] = [m for m in found if rules.usable(m)]
            if lacking:
                missing.append((p, lacking))
        source = _source_comment(st, env)
    if missing:
        raise MissingMeasurementsError(_missing_message(missing, len(kernels), env, policy, api))
    _warn_untimed_over_a_smaller_limit(rows, kernels, front, workspace_limit, total_workspace)
    if front:
        limit = NO_LIMIT if workspace_limit is None else parse_size(workspace_limit)
        cap = None if workspace_limit is None else limit
        plans = [point for p, _ in kernels
                 for point in thin_front(pareto_plans(rows[(p.key, p.n)], p.n, policy, cap))]
        strategy = FRONT
    elif workspace_limit is not None:
        limit = parse_size(workspace_limit)
        if policy is Policy.FIT:
            _warn_missing_fit_sizes(rows, kernels, limit, borrow_output)
        plans = [best_plan(rows[(p.key, p.n)], p.n, limit, policy,
                           borrow_sample_bytes=p.written_sample_bytes if borrow_output else 0)
                 for p, _ in kernels]
        strategy = "wr"
    else:
        limit = parse_size(total_workspace)
        fronts = {(p.key, p.n): pareto_plans(rows[(p.key, p.n)], p.n, policy) for p, _ in kernels}
        chosen = solve_budget(fronts, limit, weights={(p.key, p.n): w for p, w in kernels})
        plans = [chosen[(p.key, p.n)] for p, _ in kernels]
        strategy = "wd"
    plan = Plan(gpu=env.gpu, cudnn=env.cudnn, strategy=strategy, limit=limit,
                policy=policy.value, comments=(source,), restrictions=rules)
    for kp in plans:
        plan.add(kp.plan_entry())
    return plan


class UntimedOverLimitWarning(UserWarning):
    """Rows a ``bench --workspace-limit`` left untimed, as over its limit, could be pieces of this
    plan (no limit, or a larger one): the plan is made without them, so it may be slower than one
    from a full bench."""


def _warn_untimed_over_a_smaller_limit(rows: dict, kernels: Kernels, front: bool,
                                       workspace_limit, total_workspace) -> None:
    """Warn (:class:`UntimedOverLimitWarning`) naming how many kernels have configurations a bench
    under a smaller workspace limit did not time but this plan could use."""
    limit = None
    if workspace_limit is not None:
        limit = parse_size(workspace_limit)
    elif total_workspace is not None:
        limit = parse_size(total_workspace)
    lacking, smallest = 0, None
    for p, _ in kernels:
        over = [m for m in rows[(p.key, p.n)] if m.note.startswith(OVER_LIMIT)
                and (limit is None or m.workspace <= limit)]
        if over:
            lacking += 1
            least = min(m.workspace for m in over)
            smallest = least if smallest is None else min(smallest, least)
    if lacking:
        within = "any workspace" if limit is None else f"{format_size(limit).replace(' ', '')}"
        warnings.warn(UntimedOverLimitWarning(
            f"{lacking} of {len(kernels)} kernels have configurations that a bench with a smaller "
            f"--workspace-limit left untimed (from {format_size(smallest).replace(' ', '')} of "
            f"workspace) but this plan ({within}) could use: it is made without them; measure them "
            f"with 'mucudnn bench' without --workspace-limit"
            + ("" if limit is None else f" or with --workspace-limit {within}")),
            stacklevel=3)


class FitSizesMissingWarning(UserWarning):
    """Policy ``fit`` was asked for, but the store lacks the fit sizes of some kernels: their plans
    use the powers of two only (what policy ``powerOfTwo`` gives)."""


def _warn_missing_fit_sizes(rows: dict, kernels: Kernels, limit: int, borrow_output: bool) -> None:
    """Warn (:class:`FitSizesMissingWarning`) naming how many kernels have none of the sizes
    :func:`fit_sizes` says policy ``fit`` adds for them at ``limit`` measured: their fit plans are
    their powerOfTwo plans."""
    lacking = 0
    for p, _ in kernels:
        kernel_rows = rows[(p.key, p.n)]
        wanted = fit_sizes(kernel_rows, p.n, limit, p.written_sample_bytes if borrow_output else 0)
        if wanted and not set(wanted) & {m.batch for m in kernel_rows}:
            lacking += 1
    if lacking:
        warnings.warn(FitSizesMissingWarning(
            f"policy fit: {lacking} of {len(kernels)} kernels have no measurements at the sizes "
            f"policy fit adds within this limit, so their plans use the powers of two only (as policy "
            f"powerOfTwo); measure them with 'mucudnn bench ... --policy fit --workspace-limit "
            f"{format_size(limit).replace(' ', '')}{' --borrow-output' if borrow_output else ''}' "
            "on that GPU"), stacklevel=3)


def check_excluded_names(names: Sequence[str]) -> None:
    """Raise :class:`MucudnnError` for a name that is neither a legacy algorithm nor an engine
    name (a typo would otherwise exclude nothing), suggesting the closest algorithm name."""
    known = sorted({name for names_ in ALGORITHMS.values() for name in names_})
    for name in names:
        if name in known:
            continue
        try:
            parse_engine_name(name)
            continue
        except EngineNameError:
            pass
        close = difflib.get_close_matches(name, known, n=1)
        hint = (f"did you mean {close[0]!r}?" if close
                else f"expected one of {', '.join(known)} or an engine name such as eng0")
        raise MucudnnError(f"--exclude-algo {name!r} is no cuDNN algorithm or engine name: {hint}")


@contextlib.contextmanager
def _measurements_source(store, env: Environment | None):
    """(store, environment) to read: a store object is used as given (and stays open); a path, or
    None for the default, is opened with :func:`open_measurements` and closed afterwards."""
    if isinstance(store, store_mod.BenchmarkStore):
        chosen = env or _pick_environment(store)
        if chosen is None:
            raise MissingMeasurementsError(f"{store!r} holds no measurements")
        yield store, chosen
        return
    opened, chosen = open_measurements(store, env)
    for text in opened.warnings:
        warnings.warn(text, stacklevel=4)
    with opened:
        yield opened, chosen


def _source_comment(store, env: Environment) -> str:
    """Where a plan's measurements came from, for a comment line of the plan file."""
    if isinstance(store, MeasurementSource):
        return store.describe(used=True)
    where = f"store {store.path}" if isinstance(getattr(store, "path", None), Path) else repr(store)
    return f"measurements of {env.gpu} / cuDNN {env.cudnn}: {where}"


def predicted_network_time(plan: Plan, kernels: Kernels) -> float:
    """Σ weight × predicted time over the kernels (ms): one pass of the network or recorded step,
    each kernel as often as layers (or calls) run it. :func:`sum_of_kernel_times` counts each
    kernel once."""
    return sum(w * plan.get(p.key, p.n).time_ms for p, w in kernels if plan.get(p.key, p.n))


def sum_of_kernel_times(plan: Plan, smallest: bool = False) -> float:
    """Σ predicted time over the plan's kernels, each (key, N) once (ms): what a plan file alone
    gives (it does not say how often each kernel runs); ``show`` prints it. A front plan's kernel
    counts at its fastest point, or with ``smallest`` at its point of least workspace."""
    return sum(plan.front(key, n)[0 if smallest else -1].time_ms for key, n in plan.kernels())


def baselines(store, env: Environment, entry: PlanEntry, limit: int | None,
              restrictions: Restrictions = Restrictions()) -> tuple[float | None, float | None]:
    """(best undivided time within ``limit``, best undivided time with no limit), None if unknown,
    from the rows ``restrictions`` allows (the plan's own, so that plan and baselines compare like
    with like)."""
    try:
        rows = [m for m in measurements(store, env, entry.problem, Policy.UNDIVIDED, restrictions.api)
                if restrictions.usable(m)]
    except MissingMeasurementsError:
        return None, None
    out = []
    for lim in (limit, None):
        try:
            out.append(best_plan(rows, entry.n, lim, Policy.UNDIVIDED).time_ms)
        except MucudnnError:
            out.append(None)
    return out[0], out[1]
