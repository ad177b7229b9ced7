"""Test harness of the shim: builds the shim, the cuDNN double and the drivers, runs cases.

The test files use the session fixture ``shim_env`` (tests/conftest.py: :func:`build_shim_env`) and
import its helpers by name (pytest's ``pythonpath`` has this directory). A *case* is one line of
driver input: ``conv_driver`` runs legacy convolution
calls (see conv_driver.c, :meth:`ShimEnv.run`), ``graph_driver`` the same convolutions through the
graph (backend) API as PyTorch does (see graph_driver.c, :meth:`ShimEnv.run_graph`). A driver
prints one result line per case, and the double logs every call it receives to ``$FAKE_CUDNN_LOG``.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import subprocess
from pathlib import Path

import fakebuild
import pytest

HERE = Path(__file__).resolve().parent

FAKE_GPU_NAME = "mucudnn fake GPU"   # the double's defaults
FAKE_CUDNN_VERSION = 91900
WS_PER_SAMPLE = 4096                 # the double's workspace model: algo * n * WS_PER_SAMPLE bytes

_RUN_NUMBERS = itertools.count()

HEADER = (f"mucudnn-plan 1\ngpu {FAKE_GPU_NAME}\ncudnn {FAKE_CUDNN_VERSION}\nstrategy wr\n"
          "limit 67108864\npolicy powerOfTwo\n")


def parse_fields(text: str) -> dict[str, str]:
    """``name=value`` tokens of one line into a dict (the first word, without '=', is ``fn``)."""
    fields: dict[str, str] = {}
    for i, token in enumerate(text.split()):
        name, sep, value = token.partition("=")
        if sep:
            fields[name] = value
        elif i == 0:
            fields["fn"] = token
    return fields


@dataclasses.dataclass
class Run:
    """What one driver process produced."""

    cases: list[dict[str, str]]   # the driver's result lines, in case order
    calls: list[dict[str, str]]   # the double's log lines (``fn`` = function name)
    stderr: str                   # the shim's messages (and the driver's)
    returncode: int

    def conv_calls(self) -> list[dict[str, str]]:
        return [c for c in self.calls if c["fn"].startswith("cudnnConvolution")]

    def graph_executions(self) -> list[dict[str, str]]:
        return [c for c in self.calls if c["fn"] == "cudnnBackendExecute"]

    def shim_lines(self, level: str) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.startswith(f"mucudnn: {level}:")]


@dataclasses.dataclass
class ShimEnv:
    shim: Path
    fake_dir: Path
    driver: Path
    work: Path
    graph_driver: Path

    def write_plan(self, kernel_lines: list[str], header: str = HEADER, name: str = "plan") -> Path:
        path = self.work / f"{name}-{os.getpid()}-{len(list(self.work.iterdir()))}.plan"
        path.write_text(header + "".join(line + "\n" for line in kernel_lines))
        return path

    def run(self, cases: list[str], *, plan: Path | None = None, preload: bool = True,
            env: dict[str, str] | None = None, threads: int = 1, timeout: float = 60) -> Run:
        """Run the conv driver on ``cases`` (one per line on its input); see :meth:`run_program`."""
        args = [str(self.driver)] + (["--threads", str(threads)] if threads > 1 else [])
        return self.run_program(args, plan=plan, preload=preload, env=env, timeout=timeout,
                                stdin="".join(c + "\n" for c in cases))

    def run_graph(self, cases: list[str], *, plan: Path | None = None, preload: bool = True,
                  env: dict[str, str] | None = None, threads: int = 1, timeout: float = 60) -> Run:
        """Run the graph driver on ``cases``, like :meth:`run`."""
        args = [str(self.graph_driver)] + (["--threads", str(threads)] if threads > 1 else [])
        return self.run_program(args, plan=plan, preload=preload, env=env, timeout=timeout,
                                stdin="".join(c + "\n" for c in cases))

    def compile(self, sources: list[Path], output: Path, *, shared: bool = False,
                link_cudnn: bool = False) -> Path:
        """Compile C ``sources`` into ``output``, an executable or (``shared``) a library.

        The drivers' directory and the cuDNN and CUDA headers are on the include path. With
        ``link_cudnn`` the result depends on the double's ``libcudnn.so.9`` (``-lcudnn``, with an
        rpath to it). Fails the test with the compiler's output when compilation fails.
        """
        from mucudnn.shimlib import find_compiler

        command = [find_compiler(), "-std=c11", "-O1", "-Wall", "-Wextra", "-Werror",
                   f"-I{HERE}", f"-I{fakebuild.find_cudnn_include()}",
                   f"-I{fakebuild.find_cuda_include()}", *map(str, sources), "-o", str(output)]
        if shared:
            command += ["-shared", "-fPIC", "-fvisibility=hidden", "-Wl,--no-undefined"]
        if link_cudnn:
            command += [f"-L{self.fake_dir}", "-lcudnn", f"-Wl,-rpath,{self.fake_dir}"]
        result = subprocess.run(command + ["-ldl"], capture_output=True, text=True)
        if result.returncode != 0:
            pytest.fail(f"building {output.name} failed:\n$ {' '.join(command)}\n{result.stderr}")
        return output

    def run_program(self, args: list[str], *, plan: Path | None = None, preload: bool = True,
                    env: dict[str, str] | None = None, timeout: float = 60,
                    stdin: str | None = None) -> Run:
        """Run any program with the double's directory on ``LD_LIBRARY_PATH``, its call log, the
        shim preloaded unless not ``preload`` and ``plan`` as ``MUCUDNN_PLAN``, feeding it
        ``stdin`` (none by default); its ``case `` lines and the double's log are parsed.
        """
        log = self.work / f"calls-{os.getpid()}-{next(_RUN_NUMBERS)}.log"  # unique across threads
        environment = {k: v for k, v in os.environ.items()
                       if not k.startswith(("MUCUDNN_", "FAKE_CUDNN_"))}
        environment.update(LD_LIBRARY_PATH=str(self.fake_dir), FAKE_CUDNN_LOG=str(log))
        if preload:
            environment["LD_PRELOAD"] = str(self.shim)
        if plan is not None:
            environment["MUCUDNN_PLAN"] = str(plan)
        environment.update(env or {})
        result = subprocess.run(args, env=environment, input=stdin or "",
                                capture_output=True, text=True, timeout=timeout)
        calls = [parse_fields(line) for line in log.read_text().splitlines()] if log.exists() else []
        cases_out = [parse_fields(line) for line in result.stdout.splitlines()
                     if line.startswith("case ")]
        return Run(cases_out, calls, result.stderr, result.returncode)


def build_shim_env(work: Path) -> ShimEnv:
    """The shim, the double and the drivers built into `work` (fails the test where a build fails)."""
    from mucudnn.errors import MucudnnError
    from mucudnn.shimlib import build_shim, find_compiler

    reason = fakebuild.missing_prerequisite()
    if reason:
        pytest.skip(reason)
    library = fakebuild.build_fake_cudnn(work / "fake")
    cudnn_include, cuda_include = fakebuild.find_cudnn_include(), fakebuild.find_cuda_include()
    os.environ.setdefault("MUCUDNN_CUDNN_INCLUDE", str(cudnn_include))
    try:
        shim = build_shim(out_dir=work / "shim", force=True)
    except MucudnnError as exc:
        pytest.fail(str(exc))
    drivers = {}
    for name in ("conv_driver", "graph_driver"):
        drivers[name] = work / name
        command = [find_compiler(), "-std=c11", "-O1", "-Wall", "-Wextra", "-Werror",
                   f"-I{cudnn_include}", f"-I{cuda_include}", str(HERE / f"{name}.c"),
                   "-o", str(drivers[name]), f"-L{library.parent}", "-lcudnn",
                   f"-Wl,-rpath,{library.parent}", "-ldl", "-lpthread", "-lm"]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            pytest.fail(f"building {name} failed:\n{result.stderr}")
    (work / "run").mkdir()
    return ShimEnv(shim=shim, fake_dir=library.parent, driver=drivers["conv_driver"],
                   work=work / "run", graph_driver=drivers["graph_driver"])


# -- plans and cases -----------------------------------------------------------------------------

def key_of(case: str) -> str:
    """The kernel key of a driver case line, through mucudnn.problem (the Python half)."""
    from mucudnn.problem import ConvProblem

    f = parse_fields(case)
    dims = lambda name: tuple(int(v) for v in f[name].split("x"))  # noqa: E731
    spatial = len(dims("in"))
    return ConvProblem(
        direction=f.get("dir", "fwd"), dtype=f.get("dt", "f32"),
        compute_type=f.get("ct", f.get("dt", "f32")), math=f.get("math", "fma"),
        layout=f.get("layout", "nchw"), c=int(f.get("c", 1)), input_size=dims("in"),
        k=int(f.get("k", 1)), filter_size=dims("f") if "f" in f else (1,) * spatial,
        padding=dims("pad") if "pad" in f else (0,) * spatial,
        stride=dims("stride") if "stride" in f else (1,) * spatial,
        dilation=dims("dil") if "dil" in f else (1,) * spatial,
        groups=int(f.get("g", 1)), mode=f.get("mode", "xcorr"), n=int(f.get("n", 2)),
    ).key


def plan_line(case: str, pieces: list[tuple[int, str, str]], time_ms: float = 0.5,
              workspace: int | None = None) -> str:
    """A ``kernel`` line for a case: pieces are (b, algo name, math name)."""
    from mucudnn.problem import ALGORITHMS, Direction

    direction = Direction(parse_fields(case).get("dir", "fwd"))
    if workspace is None:
        workspace = max(ALGORITHMS[direction].index(a) * b * WS_PER_SAMPLE for b, a, _ in pieces)
    n = sum(b for b, _, _ in pieces)
    text = " ".join(f"{b}:{a}:{m}" for b, a, m in pieces)
    return f"kernel {key_of(case)} {n} {workspace} {time_ms} {text}"
