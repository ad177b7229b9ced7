"""The graph-API bindings (mucudnn/cudnn/graph.py) against the cuDNN test double, no GPU needed.

The double (tests/shim/fake_cudnn, its backend API in fake_backend.c) runs convolutions on host
memory, so numpy arrays' addresses serve as device pointers. Each check runs in a subprocess with
``MUCUDNN_CUDNN_LIBRARY`` naming the double, since the loaded cuDNN is process-wide; engine plans
are compared with the double's legacy functions on the same inputs (tests/shim/test_fake_cudnn.py
checks those against numpy).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace
from pathlib import Path

import pytest
from fakebuild import fake_cudnn_or_skip

from mucudnn.engines import is_transform_based

ROOT = Path(__file__).resolve().parents[1]

# PYTHONPATH for checks that run mucudnn.bench: the host-memory CuPy stand-in first
WITH_FAKE_CUPY = f"{ROOT / 'tests' / 'fakecupy'}{os.pathsep}{ROOT}"


@pytest.fixture(scope="module")
def fake_cudnn(tmp_path_factory) -> Path:
    return fake_cudnn_or_skip(tmp_path_factory.mktemp("fake_cudnn"))


PRELUDE = '''
import json
import numpy as np
from mucudnn.cudnn import ConvolutionCall, get
from mucudnn.cudnn.graph import ConvolutionGraph, HeurMode, candidate_configs
from mucudnn.engines import EngineConfig
from mucudnn.errors import CudnnNotSupportedError
from mucudnn.problem import ALGORITHMS, ConvProblem, DataType, Direction, Layout, MathType

cudnn = get()
handle = cudnn.handle(0)
SMALL = dict(c=4, input_size=(7, 7), k=6, filter_size=(3, 3), padding=(1, 1), stride=(1, 1),
             dilation=(1, 1), groups=2, n=8)


class HostBuffers:
    """x, w, y of a problem in host memory, with KernelBuffers' pointers() and output()."""

    def __init__(self, problem, seed=0):
        rng = np.random.default_rng(seed)
        dtype = np.float64 if problem.dtype is DataType.DOUBLE else np.float32
        self.problem = problem
        self.x, self.w, self.y = (rng.standard_normal(int(np.prod(shape))).astype(dtype)
                                  for shape in (problem.x_shape, problem.w_shape, problem.y_shape))
        self.per_sample = (self.x[0].nbytes * int(np.prod(problem.x_shape[1:])),
                           self.y[0].nbytes * int(np.prod(problem.y_shape[1:])))

    def pointers(self, offset):
        return (self.x.ctypes.data + offset * self.per_sample[0], self.w.ctypes.data,
                self.y.ctypes.data + offset * self.per_sample[1])

    def output(self):
        return {Direction.FORWARD: self.y, Direction.BACKWARD_DATA: self.x,
                Direction.BACKWARD_FILTER: self.w}[self.problem.direction]


WORKSPACE = np.zeros(1 << 22, dtype=np.uint8)


def legacy(problem, buffers, alpha=1.0, beta=0.0):
    """The double's legacy result for ``buffers``' inputs (the output buffer is restored)."""
    kept = buffers.output().copy()
    call = ConvolutionCall(cudnn, problem, problem.math)
    call.run(handle, 0, *buffers.pointers(0), WORKSPACE.ctypes.data, WORKSPACE.nbytes,
             alpha=alpha, beta=beta)
    result = buffers.output().copy()
    buffers.output()[...] = kept
    return result


result = {}
'''


def run_checks(fake_cudnn: Path, code: str, **env: str) -> dict:
    """Run ``code`` after PRELUDE against the double; returns the ``result`` dict it fills."""
    script = PRELUDE + textwrap.dedent(code) + "\nprint(json.dumps(result))\n"
    environment = {**os.environ, "MUCUDNN_CUDNN_LIBRARY": str(fake_cudnn),
                   "LD_LIBRARY_PATH": str(fake_cudnn.parent), "PYTHONPATH": str(ROOT), **env}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=environment, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_heuristics_name_engines_and_the_math_type_filters_them(fake_cudnn):
    result = run_checks(fake_cudnn, '''
        for math in (MathType.FMA, MathType.TENSOR_OP):
            problem = ConvProblem(Direction.FORWARD, math=math, **SMALL)
            with ConvolutionGraph(cudnn, handle, problem) as graph:
                found = graph.heuristics(HeurMode.A) + graph.heuristics(HeurMode.FALLBACK)
                result[math.value] = {
                    "found": sorted({c.name for c in found}),
                    "tensor_core": sorted({c.name for c in found if 0 in c.notes}),
                    "chosen": sorted(c.name for c in candidate_configs(graph))}
    ''')
    for math, seen in result.items():
        assert seen["found"] and all(name.startswith("eng") for name in seen["found"])
        assert seen["tensor_core"], "the double has a tensor-core engine"
    fma, tensor_op = result["fma"], result["tensor_op"]
    assert fma["chosen"] == sorted(set(fma["found"]) - set(fma["tensor_core"]))
    assert tensor_op["chosen"] == tensor_op["found"]


@pytest.mark.parametrize("direction", ["fwd", "bwd_data", "bwd_filter"])
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_engine_plans_compute_what_the_legacy_path_computes(fake_cudnn, direction, layout):
    result = run_checks(fake_cudnn, f'''
        result["errors"] = {{}}
        for shape in (dict(), dict(input_size=(5, 6, 7), filter_size=(3, 1, 3), padding=(1, 0, 1),
                                   stride=(2, 1, 1), dilation=(1, 1, 2), groups=1)):
            problem = ConvProblem(Direction({direction!r}), layout={layout!r},
                                  **{{**SMALL, **shape}})
            buffers = HostBuffers(problem)
            expected = legacy(problem, buffers)
            with ConvolutionGraph(cudnn, handle, problem) as graph:
                for candidate in candidate_configs(graph):
                    with graph.plan_from_name(candidate.config) as plan, \\
                            graph.plan_from_heuristics(candidate) as same:
                        assert plan.workspace_size == same.workspace_size
                        buffers.output().fill(np.nan)
                        plan.run(*buffers.pointers(0), WORKSPACE.ctypes.data)
                    name = f"{{len(shape)}}:{{candidate.name}}"
                    result["errors"][name] = float(np.abs(buffers.output() - expected).max())
    ''')
    assert len(result["errors"]) >= 2
    assert all(error < 1e-5 for error in result["errors"].values()), result["errors"]


def test_alpha_beta_and_double_data(fake_cudnn):
    """alpha/beta are baked into the graph, as float for float data and double for double data."""
    result = run_checks(fake_cudnn, '''
        for dtype in (DataType.FLOAT, DataType.DOUBLE):
            problem = ConvProblem(Direction.BACKWARD_FILTER, dtype=dtype, compute_type=dtype,
                                  **SMALL)
            buffers = HostBuffers(problem, seed=1)
            expected = legacy(problem, buffers, alpha=0.5, beta=0.75)
            with ConvolutionGraph(cudnn, handle, problem, alpha=0.5, beta=0.75) as graph:
                with graph.plan_from_name(candidate_configs(graph)[0].config) as plan:
                    plan.run(*buffers.pointers(0), WORKSPACE.ctypes.data)
            result[dtype.value] = float(np.abs(buffers.output() - expected).max())
    ''')
    assert result["f32"] < 1e-5 and result["f64"] < 1e-12


def test_knob_choices_and_refusals(fake_cudnn):
    """A name's knobs reach the engine configuration; engines cuDNN refuses raise NOT_SUPPORTED
    (the benchmarker's not_supported rows): an unknown global index at the engine's finalize, an
    unsupported engine at the plan's."""
    result = run_checks(fake_cudnn, '''
        problem = ConvProblem(Direction.FORWARD, **SMALL)
        with ConvolutionGraph(cudnn, handle, problem) as graph:
            with graph.plan_from_name(EngineConfig(3, ((3, -1), (14, 2)))) as plan, \\
                    graph.plan_from_name(EngineConfig(3)) as default:
                result["workspaces"] = [plan.workspace_size, default.workspace_size]
            for name, config in (("unsupported", EngineConfig(1)), ("unknown", EngineConfig(99))):
                try:
                    graph.plan_from_name(config)
                except CudnnNotSupportedError as exc:
                    result[name] = exc.call
    ''', FAKE_CUDNN_ENGINE_UNSUPPORTED="1")
    assert result == {"workspaces": [result["workspaces"][1]] * 2,
                      "unsupported": "cudnnBackendFinalize", "unknown": "cudnnBackendFinalize"}


def test_mixed_plan_runs_through_the_plan_executor(fake_cudnn):
    """Engine pieces at micro-batch offsets and a legacy piece, with alpha/beta, backward filter
    accumulating: the undivided legacy result."""
    result = run_checks(fake_cudnn, '''
        from mucudnn.execute import PlanExecutor
        from mucudnn.plan import PlanEntry, PlanPiece
        for direction in Direction:
            problem = ConvProblem(direction, **SMALL)
            buffers = HostBuffers(problem, seed=2)
            expected = legacy(problem, buffers, alpha=0.5, beta=0.75)
            legacy_algo = ALGORITHMS[direction][0]
            pieces = (PlanPiece(3, "eng1", "fma"), PlanPiece(1, legacy_algo, "fma"),
                      PlanPiece(4, "eng3.k2=7", "fma"))
            entry = PlanEntry(problem.key, problem.n, WORKSPACE.nbytes, 0.0, pieces)
            with PlanExecutor(cudnn, handle, entry) as executor:
                executor.run(buffers, WORKSPACE.ctypes.data, alpha=0.5, beta=0.75)
            result[direction.value] = float(np.abs(buffers.output() - expected).max())
    ''')
    assert set(result) == {"fwd", "bwd_data", "bwd_filter"}
    assert all(error < 1e-5 for error in result.values()), result


def test_every_descriptor_is_destroyed(fake_cudnn, tmp_path):
    """Graphs, heuristics results, plans and variant packs free what they create on close()."""
    log = tmp_path / "calls.log"
    run_checks(fake_cudnn, '''
        problem = ConvProblem(Direction.BACKWARD_DATA, **SMALL)
        buffers = HostBuffers(problem)
        with ConvolutionGraph(cudnn, handle, problem) as graph:
            for candidate in candidate_configs(graph):
                with graph.plan_from_name(candidate.config) as plan:
                    plan.run(*buffers.pointers(0), WORKSPACE.ctypes.data)
                with graph.plan_from_heuristics(candidate) as plan:
                    with plan.variant_pack(*buffers.pointers(0), WORKSPACE.ctypes.data) as pack:
                        plan.execute(pack)
            try:
                graph.plan_from_name(EngineConfig(99, ((1, 2),)))
            except CudnnNotSupportedError:
                pass
    ''', FAKE_CUDNN_LOG=str(log))
    live, created = set(), 0
    for line in log.read_text().splitlines():
        name, *pairs = line.split()
        fields = dict(pair.split("=", 1) for pair in pairs)
        if name == "cudnnBackendCreateDescriptor" and fields["status"] == "0":
            live.add(fields["desc"])
            created += 1
        elif name == "cudnnBackendDestroyDescriptor" and fields["status"] == "0":
            live.remove(fields["desc"])
    assert created > 10 and live == set()


def test_benchmarker_times_algorithms_and_engines_and_probes_dominated_ones_once(fake_cudnn):
    """mucudnn.bench end to end against the double, with a host-memory CuPy (tests/fakecupy).
    With pruning off every row is a full timing. With a cutoff so low that every probe exceeds it,
    the same configurations get rows, and exactly those timed after a full timing of the same size
    and API with no more workspace (not FFT/Winograd) are marked timed once; engines keep their
    numerical notes."""
    result = run_checks(fake_cudnn, '''
        from mucudnn.bench import Benchmarker
        from mucudnn.engines import api_of, numerical_notes
        from mucudnn.timing import TimingMethod
        problem = ConvProblem(Direction.FORWARD, math=MathType.FMA, **SMALL)
        for factor in (None, 1e-9):
            method = TimingMethod(dominated_factor=factor, budget_ms=1.0, max_reps=3)
            rows = Benchmarker(None, method, progress=False).measure(problem, [2, 8])
            result[str(factor)] = [
                [r.batch, r.algo, r.status.value, r.workspace, r.note,
                 sorted(numerical_notes(r.note)), api_of(r.algo).value] for r in rows]
    ''', PYTHONPATH=WITH_FAKE_CUPY)
    full, pruned = result["None"], result["1e-09"]
    assert [r[:3] for r in full] == [r[:3] for r in pruned]
    assert {r[6] for r in full} == {"legacy", "graph"} and all(r[0] in (2, 8) for r in full)
    assert not any("timed once" in r[4] for r in full)
    timed_fully: dict[tuple, list[int]] = {}
    for (batch, algo, status, ws, note, notes, api), was in zip(pruned, full):
        assert notes == was[5]  # an engine's numerical notes survive the mark
        if status != "ok":
            continue
        dominators = timed_fully.setdefault((batch, api), [])
        assert ("timed once" in note) == any(w <= ws for w in dominators), (batch, algo, ws)
        if "timed once" not in note and not is_transform_based(SimpleNamespace(algo=algo,
                                                                                note=note)):
            dominators.append(ws)
    assert sum("timed once" in r[4] for r in pruned) >= 4  # else the check above proves little


def test_benchmark_fit_measures_each_configurations_largest_fitting_size(fake_cudnn, tmp_path):
    """tuner.benchmark with policy fit, against the double (host-memory CuPy): after the powers of
    two, the sizes fit_sizes derives from them get rows too, and a fit plan can use them."""
    store = tmp_path / "fit.sqlite"
    result = run_checks(fake_cudnn, f'''
        from mucudnn import tuner
        from mucudnn.bench import current_environment
        from mucudnn.optimizer import fit_sizes
        from mucudnn.store import open_store
        problem = ConvProblem(Direction.FORWARD, math=MathType.FMA, **SMALL)
        limit = 13000  # bytes: the double's eng1 takes 4096 a sample, so it fits 3
        tuner.benchmark([problem], "fit", store={str(store)!r}, progress=False,
                        workspace_limit=limit)
        env = current_environment()
        with open_store({str(store)!r}) as st:
            rows = st.get(env.gpu, env.cudnn, problem.key)
            result["sizes"] = sorted({{r.batch for r in rows}})
            pow2 = [r for r in rows if r.batch in (1, 2, 4, 8)]
            result["expected_extra"] = fit_sizes(pow2, problem.n, limit)
            plan = tuner.optimize([problem], workspace_limit=limit, policy="fit", store=st,
                                  env=env)
            result["plan_sizes"] = sorted({{p.batch for e in plan for p in e.pieces}})
    ''', PYTHONPATH=WITH_FAKE_CUPY)
    assert result["expected_extra"], "the double's workspaces give no size to add: nothing checked"
    assert result["sizes"] == sorted({1, 2, 4, 8} | set(result["expected_extra"]))
    assert set(result["plan_sizes"]) <= set(result["sizes"])
