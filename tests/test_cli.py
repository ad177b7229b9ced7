"""The ``mucudnn`` command line, on the shipped measurements, with no GPU and no real shim."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import mucudnn
from mucudnn import shimlib, tuner
from mucudnn.cli import main
from mucudnn.measurement import Measurement
from mucudnn.optimizer import candidate_sizes
from mucudnn.plan import NO_LIMIT, read_plan
from mucudnn.sizes import format_size
from mucudnn.store import open_store
from test_store import as_unprivileged, hand_over

PLAN_DIR = Path(__file__).resolve().parent / "data" / "plans"
BAD_PLAN = PLAN_DIR / "invalid_pieces_sum.plan"  # its first line names the faulty line
VALID_PLAN = PLAN_DIR / "valid_basic.plan"


def invoke(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args])


def expected_error_line(path: Path) -> str:
    return re.fullmatch(r"# expect-error-line: (\d+)", path.read_text().splitlines()[0]).group(1)


def assert_one_error_line(result, *fragments: str) -> str:
    """Exit status 2 and a single ``mucudnn: error:`` line on stderr holding every fragment."""
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mucudnn: error: "), result.stderr
    assert all(fragment in lines[0] for fragment in fragments), lines[0]
    return lines[0]


def assert_usage_error(result, *fragments: str) -> None:
    assert result.exit_code == 2, result.output
    assert "Usage:" in result.stderr
    assert all(fragment in result.stderr for fragment in fragments), result.stderr


# -- where measurements come from and where plans go -------------------------------------------

@pytest.mark.parametrize("command", ["tune", "show"])
def test_a_store_that_does_not_exist_is_one_error_line_and_not_created(no_gpu, tmp_path,
                                                                        command):
    typo = tmp_path / "sotre.sqlite"
    args = (["tune", "alexnet", "--workspace-limit", "64MiB", "-o", tmp_path / "a.plan"]
            if command == "tune" else ["show", VALID_PLAN])
    result = invoke(*args, "--store", typo)
    assert_one_error_line(result, f"store {typo} does not exist; create it with "
                                  f"`mucudnn bench --store {typo}`")
    assert not typo.exists() and not (tmp_path / "a.plan").exists()


def test_tune_says_that_benchmarking_needs_cupy(no_gpu, monkeypatch, tmp_path):
    monkeypatch.setattr(tuner, "gpu_without_cupy", lambda: "NVIDIA H100 80GB HBM3")
    result = invoke("tune", "alexnet", "--workspace-limit", "64MiB", "-o", tmp_path / "a.plan")
    assert result.exit_code == 0, result.output
    [warning] = result.stderr.splitlines()
    assert warning.startswith("mucudnn: warning: this machine has a GPU (NVIDIA H100 80GB HBM3)")
    assert "pip install 'mucudnn[gpu]'" in warning and "measurements of NVIDIA H200" in warning


@pytest.mark.parametrize("command", ["tune", "autotune"])
def test_a_plan_into_a_missing_directory_is_one_error_line(no_gpu, fake_exec, tmp_path,
                                                            command):
    plan_path = tmp_path / "missing" / "a.plan"
    args = (["tune", "alexnet", "--workspace-limit", "64MiB", "-o", plan_path]
            if command == "tune" else
            ["autotune", "--workspace-limit", "64MiB", "-o", plan_path, "--", "python", "t.py"])
    result = invoke(*args)
    assert_one_error_line(result, f"cannot write plan {plan_path}: directory "
                                  f"{plan_path.parent} does not exist")
    assert fake_exec[1] == [], "nothing ran"


def tune_unprivileged(store: Path, recording: Path, plan_path: Path) -> tuple[int, str, str]:
    result = invoke("tune", "--recording", recording, "--workspace-limit", "64MiB",
                    "--store", store, "-o", plan_path)
    return result.exit_code, result.stdout, result.stderr


def test_tune_from_a_read_only_store_into_a_read_only_directory(shared_dir, monkeypatch):
    """A shared store on a read-only mount is read (A); a plan cannot go there (D): one line."""
    from test_tuner import FWD, FWD_ALGOS, synthetic_rows
    monkeypatch.setattr(tuner, "gpu_available", lambda: False)
    monkeypatch.setattr(tuner, "gpu_without_cupy", lambda: None)
    monkeypatch.setenv("XDG_CACHE_HOME", str(shared_dir / "xdg"))
    monkeypatch.delenv("MUCUDNN_STORE", raising=False)
    tuner.shipped_store().close()  # built here; read-only to the unprivileged user
    mount, out = shared_dir / "mount", shared_dir / "out"
    mount.mkdir()
    out.mkdir()
    store = mount / "shared.sqlite"
    with open_store(store) as writer:
        writer.put("Test GPU", 91900, synthetic_rows(FWD, FWD_ALGOS))
    recording = mount / "one.record"
    recording.write_text(f"# mucudnn-record 1 pid=42\nkernel {FWD.key} {FWD.n}\n")
    hand_over(out)
    mount.chmod(0o555)

    code, stdout, stderr = as_unprivileged(tune_unprivileged, store, recording,
                                           mount / "a.plan")
    assert code == 2 and stderr == (f"mucudnn: error: cannot write plan {mount / 'a.plan'}: "
                                    f"directory {mount} is read-only\n")
    code, stdout, stderr = as_unprivileged(tune_unprivileged, store, recording, out / "a.plan")
    assert code == 0, stdout + stderr
    assert stdout.splitlines()[-1] == (
        f"measurements of Test GPU / cuDNN 91900: {len(synthetic_rows(FWD, FWD_ALGOS))} rows "
        f"from store {store} (used by the plan)")
    assert read_plan(out / "a.plan").gpu == "Test GPU"
    assert sorted(p.name for p in mount.iterdir()) == ["one.record", "shared.sqlite"]


# -- help ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("command", sorted(main.commands))
def test_every_command_has_help(command):
    result = invoke(command, "--help")
    assert result.exit_code == 0, result.output
    assert f"{command} [OPTIONS]" in result.stdout
    assert (main.commands[command].help or "").split()[0] in result.stdout


def test_main_help_lists_every_command():
    result = invoke("-h")
    assert result.exit_code == 0
    assert all(command in result.stdout for command in main.commands)


def test_python_dash_m_mucudnn_help():
    result = subprocess.run([sys.executable, "-m", "mucudnn", "--help"], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "Usage:" in result.stdout
    assert all(command in result.stdout for command in ("bench", "tune", "show", "run", "record"))


# -- configs ---------------------------------------------------------------------------------------

def test_configs_lists_the_shipped_configs():
    result = invoke("configs")
    assert result.exit_code == 0, result.output
    lines = result.stdout.strip().splitlines()
    assert [line.split()[0] for line in lines] == mucudnn.list_configs()
    assert len(lines) == 5
    for line in lines:
        name = line.split()[0]
        kernels = len(mucudnn.load_config(name).kernels())
        assert re.search(rf"\b{kernels} kernels\b", line), line
        assert line.rstrip().endswith(str(mucudnn.find_config(name)))


# -- tune and show ---------------------------------------------------------------------------------

def test_tune_then_show_on_the_shipped_measurements(no_gpu, tmp_path):
    plan_path = tmp_path / "r50.plan"
    kernels = mucudnn.load_config("resnet50").kernels()
    tuned = invoke("tune", "resnet50", "--workspace-limit", "64MiB", "-o", plan_path)
    assert tuned.exit_code == 0, tuned.output
    assert f"wrote {plan_path}: {len(kernels)} kernels" in tuned.stdout
    source = tuned.stdout.splitlines()[-1]
    assert re.fullmatch(r"measurements of NVIDIA H200 / cuDNN 91900: [\d,]+ rows from the "
                        r"measurements shipped with mucudnn \(used by the plan\)", source), source
    assert f"# {source.removesuffix(' (used by the plan)')}\n" in plan_path.read_text()

    plan = read_plan(plan_path)
    assert (plan.strategy, plan.limit, plan.policy) == ("wr", 64 << 20, "powerOfTwo")
    assert [(e.key, e.n) for e in plan] == [(p.key, p.n) for p, _ in kernels]
    assert all(e.workspace <= 64 << 20 for e in plan)

    shown = invoke("show", plan_path)
    assert shown.exit_code == 0, shown.output
    out = shown.stdout
    assert out.startswith(f"plan: {plan.gpu}, cuDNN {plan.cudnn}, WR limit per kernel 64.0 MiB, "
                          f"policy powerOfTwo, {len(kernels)} kernels")
    header = next(line for line in out.splitlines() if line.startswith("kernel "))
    assert header.split() == ["kernel", "N", "micro-batches", "workspace", "plan", "ms", "undiv",
                              "ms", "speedup", "uncapped", "ms", "vs", "uncapped"]
    rows = [line for line in out.splitlines() if re.match(r"(fwd|bwd_data|bwd_filter) c\d", line)]
    assert len(rows) == len(kernels)
    total = sum(e.time_ms for e in plan)
    assert (f"sum of kernel times (each kernel once): plan {total:.3f} ms; workspace: largest "
            f"{format_size(plan.max_workspace)}, all kernels {format_size(plan.total_workspace)}"
            in out)
    # The speedup columns and their totals come from the same shipped measurements.
    assert "undivided within the limit" in out and "uncapped" in out.splitlines()[-2]
    assert out.splitlines()[-1] == (f"baselines from measurements of {plan.gpu} / cuDNN "
                                    f"{plan.cudnn}: 74,803 rows from the measurements shipped "
                                    "with mucudnn")
    assert not re.search(r"\s-\s", "\n".join(rows)), "every row should have its baselines"


def test_tune_wd_writes_a_plan_within_the_budget(no_gpu, tmp_path):
    plan_path = tmp_path / "alexnet.plan"
    result = invoke("tune", "alexnet", "--total-workspace", "256MiB", "-o", plan_path)
    assert result.exit_code == 0, result.output
    plan = read_plan(plan_path)
    assert plan.strategy == "wd" and plan.total_workspace <= 256 << 20


def test_show_without_measurements_of_the_plan_gpu_omits_the_baselines(no_gpu):
    plan = read_plan(VALID_PLAN)
    result = invoke("show", VALID_PLAN)
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(f"plan: {plan.gpu}, cuDNN {plan.cudnn}, WR")
    [row] = [line for line in result.stdout.splitlines() if line.startswith("fwd c4 ")]
    assert row.split()[-4:] == ["-", "-", "-", "-"]
    assert "undivided within the limit" not in result.stdout


@pytest.mark.parametrize("options, reason", [
    (["--workspace-limit", "64MiB", "--total-workspace", "1GiB"],
     "at most one of --workspace-limit and --total-workspace"),
    (["--total-workspace", "1GiB", "--front"], "--front goes with --workspace-limit"),
    (["--borrow-output"], "--borrow-output makes WR plans"),
    (["--workspace-limit", "64MiB", "--front", "--borrow-output"], "--borrow-output makes WR plans"),
])
def test_tune_refuses_conflicting_limits(no_gpu, tmp_path, options, reason):
    result = invoke("tune", "alexnet", *options, "-o", tmp_path / "p.plan")
    assert_usage_error(result, reason)
    assert not (tmp_path / "p.plan").exists()


# -- front plans -----------------------------------------------------------------------------------

def test_tune_without_a_limit_writes_a_front_plan_and_show_prints_its_points(no_gpu, tmp_path):
    plan_path = tmp_path / "r50.plan"
    kernels = mucudnn.load_config("resnet50").kernels()
    tuned = invoke("tune", "resnet50", "-o", plan_path)
    assert tuned.exit_code == 0, tuned.output
    plan = read_plan(plan_path)
    assert (plan.strategy, plan.limit) == ("front", NO_LIMIT)
    assert plan.kernels() == [(p.key, p.n) for p, _ in kernels]
    assert len(plan) > len(kernels)  # some kernels have several points
    assert f"wrote {plan_path}: {len(kernels)} kernels, {len(plan)} points (" in tuned.stdout
    wr = tuner.optimize(kernels, workspace_limit=1 << 62)
    assert [plan.get(p.key, p.n).time_ms for p, _ in kernels] == pytest.approx(
        [wr.get(p.key, p.n).time_ms for p, _ in kernels], rel=1e-5)  # the file keeps 6 digits

    shown = invoke("show", plan_path)
    assert shown.exit_code == 0, shown.output
    out = shown.stdout.splitlines()
    assert out[0] == (f"plan: {plan.gpu}, cuDNN {plan.cudnn}, FRONT (each call runs the fastest "
                      f"point within its workspace), no limit, policy powerOfTwo, "
                      f"{len(kernels)} kernels, {len(plan)} points")
    at = next(i for i, line in enumerate(out) if line.split()[:1] == ["kernel"])  # after math, restrictions
    assert out[at].split()[:3] == ["kernel", "N", "point"]
    body = out[at + 2:out.index("", at + 2)]
    assert len(body) == len(plan)
    # Each kernel's points follow its first row, numbered from 1 (the fastest) with falling time
    # and workspace; the kernel is named once.
    rows, kernel = [], None
    for line in body:
        match = re.search(r"\s(\d+)/(\d+)\s.*?\s([\d.]+ [KMG]?i?B)\s+([\d.]+)\s+[\d.-]", line)
        assert match, line
        if not line.startswith(" "):
            kernel = line.split("  ")[0]
            rows.append([])
        rows[-1].append((int(match.group(1)), int(match.group(2)), float(match.group(4))))
    assert len(rows) == len(kernels)
    for (key, n), points in zip(plan.kernels(), rows):
        count = len(plan.front(key, n))
        assert [(i, total) for i, total, _ in points] == [(i, count) for i in range(1, count + 1)]
        times = [t for _, _, t in points]
        assert times == sorted(times) and times[0] == pytest.approx(plan.get(key, n).time_ms, abs=1e-3)
    assert kernel is not None
    assert any(line.startswith("fastest points: sum of kernel times ") for line in out)
    assert any(line.startswith("smallest points: sum of kernel times ") for line in out)


def test_tune_front_with_a_limit_is_cut_there(no_gpu, tmp_path):
    plan_path = tmp_path / "cut.plan"
    result = invoke("tune", "alexnet", "--workspace-limit", "1MiB", "--front", "-o", plan_path)
    assert result.exit_code == 0, result.output
    plan = read_plan(plan_path)
    assert (plan.strategy, plan.limit) == ("front", 1 << 20)
    assert all(e.workspace <= 1 << 20 for e in plan)
    shown = invoke("show", plan_path)
    assert shown.exit_code == 0 and ", limit 1.0 MiB, policy" in shown.stdout.splitlines()[0]


def test_tune_front_keeps_the_row_filters(mixed_recording, tmp_path):
    def algos(*options):
        path = tmp_path / "p.plan"
        result = invoke("tune", "--recording", mixed_recording, *options, "-o", path)
        assert result.exit_code == 0, result.output
        assert read_plan(path).strategy == "front"
        return {piece.algo for entry in read_plan(path) for piece in entry.pieces}

    assert algos() == {"implicit_gemm", "eng7.k2=16.k11=-1"}  # a front of both
    assert algos("--api", "legacy") == algos("--exclude-algo", "eng7.k2=16.k11=-1") == {"implicit_gemm"}
    assert algos("--api", "graph") == {"eng7.k2=16.k11=-1"}
    assert algos("--deterministic", "--precise") == {"implicit_gemm", "eng7.k2=16.k11=-1"}


@pytest.mark.parametrize("option", ["--workspace-limit", "--total-workspace"])
def test_bad_size_names_the_value(tmp_path, option):
    result = invoke("tune", "alexnet", option, "64XB", "-o", tmp_path / "p.plan")
    assert_usage_error(result, "'64XB'", option)


def test_tune_from_a_recording(no_gpu, tmp_path):
    first, second = [problem for problem, _ in mucudnn.load_config("alexnet").kernels()[:2]]
    recording = tmp_path / "run.record"
    recording.write_text("# mucudnn-record 1 pid=42\n"
                         + "".join(f"kernel {p.key} {p.n}\n" for p in (first, second, first)))
    plan_path = tmp_path / "recorded.plan"
    result = invoke("tune", "--recording", recording, "--workspace-limit", "64MiB",
                    "-o", plan_path)
    assert result.exit_code == 0, result.output
    assert f"wrote {plan_path}: 2 kernels" in result.stdout
    assert [(e.key, e.n) for e in read_plan(plan_path)] == \
        [(first.key, first.n), (second.key, second.n)]


def test_tune_from_config_and_recording_is_refused(no_gpu, tmp_path):
    recording = tmp_path / "run.record"
    recording.write_text("")
    result = invoke("tune", "alexnet", "--recording", recording, "--workspace-limit", "1MiB",
                    "-o", tmp_path / "p.plan")
    assert_one_error_line(result, "either a CONFIG or --recording")


def test_tune_from_a_malformed_recording_names_file_and_line(no_gpu, tmp_path):
    recording = tmp_path / "bad.record"
    recording.write_text("# mucudnn-record 1 pid=1\nkernel only-two-fields\n")
    result = invoke("tune", "--recording", recording, "--workspace-limit", "1MiB",
                    "-o", tmp_path / "p.plan")
    assert_one_error_line(result, f"{recording}:2:")


def test_tune_of_an_unknown_config_is_one_error_line(no_gpu, tmp_path):
    result = invoke("tune", "no-such-net", "--workspace-limit", "1MiB", "-o", tmp_path / "p.plan")
    assert_one_error_line(result, "no-such-net")


# -- the two cuDNN APIs ----------------------------------------------------------------------------

@pytest.mark.parametrize("options, api", [((), "both"), (("--api", "graph"), "graph"),
                                          (("--api", "legacy"), "legacy")])
def test_bench_times_the_api_asked_for(no_gpu, monkeypatch, options, api):
    asked = []
    monkeypatch.setattr(tuner, "benchmark",
                        lambda source, policy, **kw: asked.append(kw["api"]) or 0)
    result = invoke("bench", "alexnet", *options)
    assert result.exit_code == 0, result.output
    assert asked == [api]


@pytest.mark.parametrize("options, factor", [((), 2.0), (("--no-prune",), None)])
def test_bench_prunes_dominated_configurations_unless_asked_not_to(no_gpu, monkeypatch, options,
                                                                   factor):
    asked = []
    monkeypatch.setattr(tuner, "benchmark",
                        lambda source, policy, **kw: asked.append(kw["method"]) or 0)
    result = invoke("bench", "alexnet", *options)
    assert result.exit_code == 0, result.output
    assert [method.dominated_factor for method in asked] == [factor]


def test_bench_fit_needs_the_limit_it_fits(no_gpu, monkeypatch):
    asked = []
    monkeypatch.setattr(tuner, "benchmark",
                        lambda source, policy, **kw: asked.append((policy, kw["workspace_limit"])) or 0)
    assert_usage_error(invoke("bench", "alexnet", "--policy", "fit"), "--workspace-limit")
    result = invoke("bench", "alexnet", "--policy", "fit", "--workspace-limit", "64MiB")
    assert result.exit_code == 0, result.output
    assert asked == [("fit", 64 << 20)]


def test_bench_refuses_an_unknown_api(no_gpu):
    assert_usage_error(invoke("bench", "alexnet", "--api", "v8"), "'v8'", "legacy", "graph")


@pytest.fixture
def mixed_recording(no_gpu, tmp_path):
    """A recording of one kernel whose user-store rows have a fast engine configuration."""
    problem = next(p for p, _ in mucudnn.load_config("alexnet").kernels()
                   if p.direction is mucudnn.Direction.FORWARD)
    rows = []
    for b in candidate_sizes("powerOfTwo", problem.n):
        rows.append(Measurement(problem.key, b, "implicit_gemm", "fma", 1.0 * b, 0))
        rows.append(Measurement(problem.key, b, "eng7.k2=16.k11=-1", "fma", 0.5 * b, 1024 * b,
                                note="numerical notes: none"))
    with open_store() as store:  # $MUCUDNN_STORE of no_gpu
        store.put("Test GPU", 91900, rows)
    recording = tmp_path / "one.record"
    recording.write_text(f"kernel {problem.key} {problem.n}\n")
    return recording


def test_tune_api_filters_the_pieces_and_show_prints_engines(mixed_recording, tmp_path):
    plans = {}
    for api in ("both", "legacy", "graph"):
        plans[api] = tmp_path / f"{api}.plan"
        result = invoke("tune", "--recording", mixed_recording, "--workspace-limit", "64MiB",
                        "--api", api, "-o", plans[api])
        assert result.exit_code == 0, result.output
    pieces = {api: {str(piece).split(":")[1] for entry in read_plan(path) for piece in entry.pieces}
              for api, path in plans.items()}
    assert pieces == {"both": {"eng7.k2=16.k11=-1"}, "legacy": {"implicit_gemm"},
                      "graph": {"eng7.k2=16.k11=-1"}}
    shown = invoke("show", plans["both"])
    assert shown.exit_code == 0, shown.output
    [row] = [line for line in shown.stdout.splitlines() if line.startswith("fwd ")]
    assert " eng7.k2=16.k11=-1 " in row


def test_tune_predicts_a_recordings_time_per_pass_with_its_calls(mixed_recording, tmp_path):
    _, key, n = mixed_recording.read_text().split()
    half = int(n) // 2  # the same kernel at half the batch: measured too (powerOfTwo sizes)

    def predicted(text: str) -> float:
        recording = tmp_path / "run.record"
        recording.write_text(text)
        result = invoke("tune", "--recording", recording, "--workspace-limit", "64MiB",
                        "-o", tmp_path / "p.plan")
        assert result.exit_code == 0, result.output
        return float(re.search(r"predicted ([0-9.]+) ms per step", result.stdout).group(1))

    full, halved = predicted(f"kernel {key} {n}\n"), predicted(f"kernel {key} {half}\n")
    # two steps: the half-batch kernel ran 3 times a step (three identical layers), the other once
    both = f"kernel {key} {n}\nkernel {key} {half}\ncalls {key} {n} 2\ncalls {key} {half} 6\n"
    assert predicted(both) == pytest.approx(full + 3 * halved, rel=1e-3)


def test_tune_graph_api_without_engine_measurements_says_how_to_get_them(no_gpu, tmp_path):
    result = invoke("tune", "alexnet", "--workspace-limit", "64MiB", "--api", "graph",
                    "-o", tmp_path / "p.plan")
    assert_one_error_line(result, "no graph API measurements of", "--api graph")


def test_show_prints_the_engine_pieces_example(no_gpu):
    result = invoke("show", PLAN_DIR / "engines.plan")
    assert result.exit_code == 0, result.output
    assert "4 eng12.k3=1, 4 eng0" in result.stdout
    assert "2 eng3.k0=-9223372036854775808, 2 eng3.k0=9223372036854775807" in result.stdout


def test_show_marks_pieces_that_borrow_the_output(no_gpu):
    result = invoke("show", PLAN_DIR / "valid_borrow.plan")
    assert result.exit_code == 0, result.output
    assert "4* gemm, 2* gemm, 2 implicit_gemm" in result.stdout
    assert "*: the piece's workspace is the part of its output the later pieces write" in result.stdout


# -- malformed plans -------------------------------------------------------------------------------

def test_show_of_a_malformed_plan_names_file_and_line(no_gpu):
    assert_one_error_line(invoke("show", BAD_PLAN),
                          f"{BAD_PLAN}:{expected_error_line(BAD_PLAN)}:", "add up to")


def test_run_of_a_malformed_plan_names_file_and_line(fake_exec):
    _, calls = fake_exec
    result = invoke("run", "--plan", BAD_PLAN, "--", "true")
    assert_one_error_line(result, f"{BAD_PLAN}:{expected_error_line(BAD_PLAN)}:")
    assert calls == []  # nothing was run


# -- run and record --------------------------------------------------------------------------------

@pytest.mark.parametrize("command", ["run", "record"])
@pytest.mark.parametrize("rest", [[], ["--"]], ids=["nothing", "bare --"])
def test_run_and_record_need_a_command(monkeypatch, command, rest):
    def no_build():
        raise AssertionError("the shim must not be built without a command to run")

    monkeypatch.setattr(shimlib, "shim_path", no_build)
    assert_usage_error(invoke(command, *rest), "give the command to run after --")


def test_run_sets_up_the_shim_environment(fake_exec):
    shim, calls = fake_exec
    result = invoke("run", "--plan", VALID_PLAN, "--workspace-limit", "64MiB", "--log-level",
                    "debug", "--summary", "--", "true", "--not-an-option-of-run")
    assert result.exit_code == 0, result.output
    [(args, env)] = calls
    assert args == ["true", "--not-an-option-of-run"]
    assert env["LD_PRELOAD"] == str(shim)
    assert env["MUCUDNN_PLAN"] == str(VALID_PLAN.resolve())
    assert env["MUCUDNN_WORKSPACE_LIMIT"] == str(64 << 20)
    assert "TORCH_CUDNN_V8_API_DISABLED" not in env  # the shim intercepts the default path too
    assert env["MUCUDNN_LOG_LEVEL"] == "debug" and env["MUCUDNN_SUMMARY"] == "1"
    assert "MUCUDNN_RECORD" not in env


def test_run_without_a_plan_tunes_online(fake_exec, tmp_path, monkeypatch):
    _, calls = fake_exec
    monkeypatch.delenv("MUCUDNN_ONLINE_DIR", raising=False)
    assert invoke("run", "--online-dir", str(tmp_path / "online"), "--", "true").exit_code == 0
    assert invoke("run", "--", "true").exit_code == 0
    assert invoke("run", "--no-online", "--", "true").exit_code == 0
    assert invoke("run", "--plan", VALID_PLAN, "--", "true").exit_code == 0
    [(_, online_dir), (_, default), (_, off), (_, planned)] = calls
    assert online_dir["MUCUDNN_ONLINE"] == "1" and online_dir["MUCUDNN_ONLINE_DIR"] == str(tmp_path / "online")
    assert default["MUCUDNN_ONLINE"] == "1" and "MUCUDNN_ONLINE_DIR" not in default
    assert "MUCUDNN_ONLINE" not in off and "MUCUDNN_ONLINE" not in planned


def test_run_keeps_existing_preloads_and_torch_setting(fake_exec, monkeypatch):
    shim, calls = fake_exec
    monkeypatch.setenv("LD_PRELOAD", "libother.so")
    monkeypatch.setenv("TORCH_CUDNN_V8_API_DISABLED", "0")
    assert invoke("run", "--", "true").exit_code == 0
    [(_, env)] = calls
    assert env["LD_PRELOAD"] == f"{shim} libother.so"  # ours first, so it wins
    assert env["TORCH_CUDNN_V8_API_DISABLED"] == "0"  # the user's explicit choice stays
    assert "MUCUDNN_PLAN" not in env and "MUCUDNN_WORKSPACE_LIMIT" not in env


def test_run_passes_the_exit_status_on(fake_exec, monkeypatch):
    monkeypatch.setattr(subprocess, "call", lambda args, env=None: 3)
    assert invoke("run", "--", "false").exit_code == 3


def test_run_of_a_missing_program_is_one_error_line(fake_exec, monkeypatch):
    def missing(args, env=None):
        raise FileNotFoundError(2, "No such file or directory")

    monkeypatch.setattr(subprocess, "call", missing)
    assert_one_error_line(invoke("run", "--", "no-such-program", "x"), "no-such-program x")


def test_record_sets_the_record_file(fake_exec, tmp_path, monkeypatch):
    shim, calls = fake_exec
    monkeypatch.chdir(tmp_path)
    result = invoke("record", "-o", "out.record", "--", "python", "train.py")
    assert result.exit_code == 0, result.output
    [(args, env)] = calls
    assert args == ["python", "train.py"]
    assert env["MUCUDNN_RECORD"] == str(tmp_path / "out.record")
    assert env["LD_PRELOAD"] == str(shim) and "MUCUDNN_PLAN" not in env
    # the dummy command recorded nothing: one warning line says so, not "recording in"
    assert "recording in" not in result.stderr
    assert ("mucudnn: warning: python train.py ran no cuDNN convolution the shim saw: nothing was "
            "recorded in out.record") in result.stderr


def test_record_says_how_many_kernels_it_recorded(fake_exec, tmp_path, monkeypatch):
    shim, calls = fake_exec
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out.record").write_text("# mucudnn-record 1 pid=1\nkernel K1 8\nkernel K2 8\nkernel K1 8\n")
    result = invoke("record", "-o", "out.record", "--", "python", "train.py")
    assert result.exit_code == 0 and "mucudnn: recording in out.record (2 kernels)" in result.stderr


def test_bad_size_for_run_names_the_value(fake_exec):
    _, calls = fake_exec
    assert_usage_error(invoke("run", "--workspace-limit", "12 parsecs", "--", "true"),
                       "'12 parsecs'")
    assert calls == []


def test_version():
    result = invoke("--version")
    assert result.exit_code == 0 and mucudnn.__version__ in result.stdout


# -- autotune --------------------------------------------------------------------------------------
def test_autotune_records_benchmarks_tunes_then_runs_with_the_plan(no_gpu, recording_exec, tmp_path,
                                                                   monkeypatch):
    """The recording run writes kernels; they are benchmarked and tuned (from the shipped
    measurements here), and the command runs again with the plan and the limit."""
    kernels = [p for p, _ in mucudnn.load_config("alexnet").kernels()]
    shim, calls = recording_exec(kernels=kernels)
    benchmarked = []
    monkeypatch.setattr(tuner, "benchmark", lambda source, policy, **kw: benchmarked.append(
        (len(source), policy, kw["api"])) or 0)
    plan_path = tmp_path / "auto.plan"
    result = invoke("autotune", "--workspace-limit", "64MiB", "-o", plan_path,
                    "--record-command", "python train.py --steps 2", "--", "python", "train.py")
    assert result.exit_code == 0, result.output
    (record_args, record_env), (run_args, run_env) = calls
    assert record_args == ["python", "train.py", "--steps", "2"]
    # recorded into a fresh file beside the plan, renamed to auto.record once the plan is written
    assert Path(record_env["MUCUDNN_RECORD"]).parent == plan_path.parent.resolve()
    assert not Path(record_env["MUCUDNN_RECORD"]).exists()
    assert plan_path.with_suffix(".record").read_text().count("kernel ") == len(kernels)
    assert benchmarked == [(len(kernels), "powerOfTwo", "both")]
    plan = read_plan(plan_path)
    assert {(e.key, e.n) for e in plan} == {(p.key, p.n) for p in kernels}
    assert all(e.workspace <= 64 << 20 for e in plan) and any(e.is_divided for e in plan)
    assert run_args == ["python", "train.py"]
    assert run_env["MUCUDNN_PLAN"] == str(plan_path.resolve())
    assert run_env["MUCUDNN_WORKSPACE_LIMIT"] == str(64 << 20)
    assert run_env["LD_PRELOAD"].split()[0] == str(shim)


@pytest.mark.parametrize("limit", [[], ["--workspace-limit", "64MiB", "--front"]],
                         ids=["no-limit", "front-cut"])
def test_autotune_makes_a_front_plan_without_a_limit_or_with_front(no_gpu, recording_exec, tmp_path,
                                                                    monkeypatch, limit):
    kernels = [p for p, _ in mucudnn.load_config("alexnet").kernels()]
    _, calls = recording_exec(kernels=kernels)
    monkeypatch.setattr(tuner, "benchmark", lambda source, policy, **kw: 0)
    plan_path = tmp_path / "auto.plan"
    result = invoke("autotune", *limit, "-o", plan_path, "--", "python", "train.py")
    assert result.exit_code == 0, result.output
    plan = read_plan(plan_path)
    assert plan.strategy == "front" and plan.limit == (64 << 20 if limit else NO_LIMIT)
    assert set(plan.kernels()) == {(p.key, p.n) for p in kernels}
    assert "points (" in result.stderr
    (_, record_env), (_, run_env) = calls
    for env in (record_env, run_env):  # the limit stays a hard cap for the shim, if given
        assert env.get("MUCUDNN_WORKSPACE_LIMIT") == (str(64 << 20) if limit else None)


@pytest.mark.parametrize("options, reason", [
    (["--borrow-output"], "--borrow-output makes WR plans"),
    (["--policy", "fit"], "--policy fit needs --workspace-limit"),
])
def test_autotune_refuses_what_a_front_plan_cannot_do(no_gpu, fake_exec, tmp_path, options, reason):
    _, calls = fake_exec
    result = invoke("autotune", *options, "-o", tmp_path / "p.plan", "--", "python", "train.py")
    assert_usage_error(result, reason)
    assert not calls


def test_autotune_api_reaches_benchmark_and_tuning(mixed_recording, recording_exec, tmp_path,
                                                   monkeypatch):
    """--api legacy: for a program on PyTorch's legacy path, where engine pieces cannot run."""
    recording_exec(text=mixed_recording.read_text())
    asked = []
    monkeypatch.setattr(tuner, "benchmark", lambda source, policy, **kw: asked.append(kw["api"]))
    for api, algo in (("legacy", "implicit_gemm"), ("both", "eng7.k2=16.k11=-1")):
        plan_path = tmp_path / f"{api}.plan"
        result = invoke("autotune", "--workspace-limit", "64MiB", "--api", api, "-o", plan_path,
                        "--", "python", "train.py")
        assert result.exit_code == 0, result.output
        assert {p.algo for e in read_plan(plan_path) for p in e.pieces} == {algo}
    assert asked == ["legacy", "both"]


def test_autotune_stops_when_the_recording_run_fails(no_gpu, fake_exec, tmp_path, monkeypatch):
    _, calls = fake_exec
    monkeypatch.setattr(subprocess, "call", lambda args, env=None: calls.append(args) or 1)
    result = invoke("autotune", "--workspace-limit", "64MiB", "-o", tmp_path / "p.plan",
                    "--", "python", "train.py")
    assert result.exit_code == 2, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("mucudnn: error: ")]
    assert len(errors) == 1 and "recording run exited with 1" in errors[0], result.stderr
    assert len(calls) == 1 and not (tmp_path / "p.plan").exists()


# -- outputs never destroy inputs ------------------------------------------------------------------

def test_tune_refuses_to_write_its_plan_over_its_store(no_gpu, tmp_path):
    store_path = tmp_path / "S.sqlite"
    with open_store(store_path):
        pass
    before = store_path.read_bytes()
    result = invoke("tune", "resnet50", "--workspace-limit", "64MiB", "--store", store_path,
                    "-o", store_path)
    assert_one_error_line(result, f"-o {store_path} is the benchmark store")
    assert store_path.read_bytes() == before


def test_tune_refuses_to_write_its_plan_over_its_config(no_gpu, tmp_path):
    config = tmp_path / "r50.yaml"
    config.write_text(Path(mucudnn.find_config("resnet50")).read_text())
    before = config.read_text()
    result = invoke("tune", config, "--workspace-limit", "64MiB", "-o", config)
    assert_one_error_line(result, "is the config this command reads")
    assert config.read_text() == before


def test_tune_refuses_to_write_its_plan_over_its_recording(mixed_recording):
    before = mixed_recording.read_text()
    result = invoke("tune", "--recording", mixed_recording, "--workspace-limit", "64MiB",
                    "-o", mixed_recording)
    assert_one_error_line(result, "is the recording this command reads")
    assert mixed_recording.read_text() == before


def test_autotune_that_fails_keeps_the_previous_recording_and_plan(no_gpu, fake_exec, tmp_path,
                                                                  monkeypatch):
    plan_path, recording = tmp_path / "train.plan", tmp_path / "train.record"
    recording.write_text("kernel from-an-earlier-run 1\n")
    plan_path.write_text(VALID_PLAN.read_text())
    monkeypatch.setattr(subprocess, "call", lambda args, env=None: 1)
    result = invoke("autotune", "--workspace-limit", "64MiB", "-o", plan_path, "--", "python", "t.py")
    assert result.exit_code == 2, result.output
    [error] = [line for line in result.stderr.splitlines() if line.startswith("mucudnn: error: ")]
    assert "recording run exited with 1" in error and "left as they were" in error
    assert recording.read_text() == "kernel from-an-earlier-run 1\n"
    assert plan_path.read_text() == VALID_PLAN.read_text()
    assert not list(tmp_path.glob(".train.record*"))  # no temporary left behind


def test_autotune_refuses_a_plan_path_that_is_its_recording(no_gpu, fake_exec, tmp_path):
    recording = tmp_path / "train.record"
    recording.write_text("kernel from-an-earlier-run 1\n")
    result = invoke("autotune", "--workspace-limit", "64MiB", "-o", recording, "--", "python", "t.py")
    assert_one_error_line(result, f"-o {recording} is the recording")
    assert recording.read_text() == "kernel from-an-earlier-run 1\n"
    assert fake_exec[1] == []  # nothing ran


# -- what the totals count, under which restrictions -----------------------------------------------

def test_tune_and_show_print_the_same_total_under_the_same_label(no_gpu, tmp_path):
    plan_path = tmp_path / "r50.plan"
    tuned = invoke("tune", "resnet50", "--workspace-limit", "64MiB", "-o", plan_path)
    shown = invoke("show", plan_path)
    assert tuned.exit_code == shown.exit_code == 0, tuned.output + shown.output
    label = re.escape("sum of kernel times (each kernel once): plan ") + r"([0-9.]+) ms"
    [tune_total] = re.findall(label, tuned.stdout)
    [show_total] = re.findall(label, shown.stdout)
    assert tune_total == show_total == f"{sum(e.time_ms for e in read_plan(plan_path)):.3f}"
    # the weighted total says what it weighs
    weighted = re.search(r"predicted ([0-9.]+) ms per pass \(each kernel x the layers that run it\)",
                         tuned.stdout)
    kernels = mucudnn.load_config("resnet50").kernels()
    plan = read_plan(plan_path)
    assert float(weighted.group(1)) == pytest.approx(
        sum(w * plan.get(p.key, p.n).time_ms for p, w in kernels), abs=1e-3)


def test_tune_of_a_front_plan_prints_the_totals_show_prints(no_gpu, tmp_path):
    """A front plan's total counts each kernel once, at its fastest point (and at its smallest),
    as `show` prints them; the math line counts kernels, not points."""
    plan_path = tmp_path / "alexnet.plan"
    tuned = invoke("tune", "alexnet", "-o", plan_path)
    shown = invoke("show", plan_path)
    assert tuned.exit_code == shown.exit_code == 0, tuned.output + shown.output
    plan = read_plan(plan_path)
    assert plan.is_front and len(plan) > len(plan.kernels())  # points outnumber kernels
    for which in ("fastest", "smallest"):
        label = re.escape(f"{which} points: sum of kernel times (each kernel once) ") + r"([0-9.]+) ms"
        [tune_total] = re.findall(label, tuned.stdout)
        [show_total] = re.findall(label, shown.stdout)
        assert tune_total == show_total, (which, tuned.stdout)
    fastest = sum(plan.get(key, n).time_ms for key, n in plan.kernels())
    assert f"fastest points: sum of kernel times (each kernel once) {fastest:.3f} ms" in tuned.stdout
    math = f": {len(plan.kernels())} kernels"
    assert [line for line in tuned.stdout.splitlines() if line.startswith("math: ")] == [
        line for line in shown.stdout.splitlines() if line.startswith("math: ")]
    assert next(line for line in tuned.stdout.splitlines()
                if line.startswith("math: ")).endswith(math), tuned.stdout


@pytest.mark.parametrize("restriction", [("--api", "legacy"),
                                         ("--exclude-algo", "eng7.k2=16.k11=-1")])
def test_show_compares_a_restricted_plan_with_baselines_under_its_restrictions(
        mixed_recording, tmp_path, restriction):
    """The engine is twice as fast as the only legacy algorithm; a plan that may not use it is
    compared with the legacy algorithm, not with the engine."""
    plan_path = tmp_path / "p.plan"
    tuned = invoke("tune", "--recording", mixed_recording, "--workspace-limit", "64MiB",
                   *restriction, "-o", plan_path)
    assert tuned.exit_code == 0, tuned.output
    assert {p.algo for e in read_plan(plan_path) for p in e.pieces} == {"implicit_gemm"}
    shown = invoke("show", plan_path)
    assert shown.exit_code == 0, shown.output
    [row] = [line for line in shown.stdout.splitlines() if line.startswith("fwd ")]
    assert row.split()[-4:] == [row.split()[-5], "1.00x", row.split()[-5], "1.00x"], row
    assert "pieces and baselines from: " in shown.stdout
    assert re.search(r"\b0\.\d+x (faster|slower)", shown.stdout) is None


# -- the math type, policy fit without its sizes -----------------------------------------------------

def test_tune_and_show_name_the_math_type_and_what_it_means_for_pytorch(no_gpu, tmp_path):
    plan_path = tmp_path / "r50.plan"
    tuned = invoke("tune", "resnet50", "--workspace-limit", "64MiB", "-o", plan_path)
    shown = invoke("show", plan_path)
    count = len(read_plan(plan_path))
    line = ("math: f32 math=fma (TF32 off, as PyTorch with torch.backends.cudnn.allow_tf32 = "
            f"False): {count} kernels")
    assert line in tuned.stdout.splitlines() and line in shown.stdout.splitlines()


def test_tune_fit_without_fit_sizes_warns_once_with_the_count(no_gpu, tmp_path):
    """The shipped fit sizes are of PyTorch's TF32 kernels, not of the configs' fma ones."""
    result = invoke("tune", "resnet50", "--workspace-limit", "64MiB", "--policy", "fit",
                    "-o", tmp_path / "fit.plan")
    assert result.exit_code == 0, result.output
    [warning] = [line for line in result.stderr.splitlines() if "warning" in line]
    lacking, total = map(int, re.match(r"mucudnn: warning: policy fit: (\d+) of (\d+) kernels",
                                       warning).groups())
    assert 0 < lacking <= total == len(mucudnn.load_config("resnet50").kernels())
    assert "--policy fit --workspace-limit 64.0MiB" in warning


# -- bad input -----------------------------------------------------------------------------------

def test_tune_refuses_a_misspelt_excluded_algorithm(no_gpu, tmp_path):
    result = invoke("tune", "resnet50", "--workspace-limit", "64MiB", "--exclude-algo",
                    "fft_tilling", "-o", tmp_path / "p.plan")
    assert_one_error_line(result, "--exclude-algo 'fft_tilling'", "did you mean 'fft_tiling'?")
    assert not (tmp_path / "p.plan").exists()


@pytest.mark.parametrize("command", ["tune", "bench"])
def test_an_empty_recording_is_one_error_line(no_gpu, tmp_path, command, monkeypatch):
    monkeypatch.setattr(tuner, "benchmark", lambda *a, **k: pytest.fail("benchmarked nothing"))
    recording = tmp_path / "empty.record"
    recording.write_text("# mucudnn-record 1 pid=1\n")
    extra = ["-o", tmp_path / "p.plan"] if command == "tune" else []
    result = invoke(command, "--recording", recording, "--workspace-limit", "64MiB", *extra)
    assert_one_error_line(result, f"{recording}: no kernels recorded")
    assert not (tmp_path / "p.plan").exists()


# -- store --------------------------------------------------------------------------------------
def _filled_store(path: Path, gpu: str = "NVIDIA H200", cudnn: int = 91900,
                  batches=(1, 2, 4), time_ms: float = 1.5) -> Path:
    with open_store(path) as store:
        store.put(gpu, cudnn, [Measurement("k", b, "gemm", "fma", time_ms, 0) for b in batches])
    return path


def test_store_info_names_path_schema_and_environments(tmp_path):
    from mucudnn.store import SCHEMA_VERSION

    path = _filled_store(tmp_path / "s.sqlite")
    _filled_store(path, gpu="NVIDIA H100 80GB HBM3", cudnn=90800, batches=(8,))
    result = invoke("store", "info", "--store", path)
    assert result.exit_code == 0, result.output
    assert f"store: {path}" in result.output
    assert f"schema version: {SCHEMA_VERSION}" in result.output
    assert re.search(r"NVIDIA H200\s+91900\s+3\n", result.output), result.output
    assert re.search(r"NVIDIA H100 80GB HBM3\s+90800\s+1\n", result.output), result.output


def test_store_info_of_a_missing_store_is_one_line_and_creates_nothing(tmp_path):
    path = tmp_path / "typo.sqlite"
    result = invoke("store", "info", "--store", path)
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        f"mucudnn: error: no benchmark store at {path} (run `mucudnn bench` first)"]
    assert not path.exists()


def test_store_export_import_round_trip_through_gz(tmp_path):
    import gzip

    source = _filled_store(tmp_path / "a.sqlite")
    out = tmp_path / "m.csv.gz"
    result = invoke("store", "export", out, "--store", source)
    assert result.exit_code == 0, result.output
    assert "wrote 3 rows" in result.output
    with gzip.open(out, "rt") as text:
        assert len(text.read().splitlines()) == 4
    target = tmp_path / "b.sqlite"
    result = invoke("store", "import", out, "--store", target)
    assert result.exit_code == 0, result.output
    with open_store(source, readonly=True) as a, open_store(target, readonly=True) as b:
        assert a.rows() == b.rows()


def test_store_export_refuses_to_overwrite_the_store(tmp_path):
    source = _filled_store(tmp_path / "a.sqlite")
    before = source.read_bytes()
    result = invoke("store", "export", source, "--store", source)
    assert result.exit_code == 2
    assert "mucudnn: error:" in result.output and "Traceback" not in result.output
    assert source.read_bytes() == before


def test_store_import_of_a_bad_csv_names_the_line(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("gpu,cudnn_version\nx,1\n")
    result = invoke("store", "import", bad, "--store", tmp_path / "s.sqlite")
    assert result.exit_code == 2
    assert result.output.startswith(f"mucudnn: error: {bad}:1: CSV header")


def test_store_merge_copies_rows_and_refuses_itself(tmp_path):
    target = _filled_store(tmp_path / "a.sqlite", batches=(1, 2), time_ms=9.0)
    other = _filled_store(tmp_path / "b.sqlite", batches=(2, 8), time_ms=1.0)
    result = invoke("store", "merge", other, "--store", target)
    assert result.exit_code == 0, result.output
    assert "merged 2 rows" in result.output
    with open_store(target, readonly=True) as store:
        assert {r.measurement.batch: r.measurement.time_ms for r in store.rows()} == {
            1: 9.0, 2: 1.0, 8: 1.0}
    result = invoke("store", "merge", target, "--store", target)
    assert result.exit_code == 2 and "is the store itself" in result.output


def test_store_checkpoint_empties_the_wal(tmp_path):
    path = _filled_store(tmp_path / "a.sqlite")
    wal = Path(f"{path}-wal")
    with open_store(path) as keep_open:  # the last close would checkpoint by itself
        keep_open.put("NVIDIA H200", 91900, [Measurement("k", 16, "gemm", "fma", 1.0, 0)])
        assert wal.stat().st_size > 0
        result = invoke("store", "checkpoint", "--store", path)
        assert result.exit_code == 0, result.output
        assert wal.stat().st_size == 0


# -- several GPUs (ranks of one job, GPUs of several models) ---------------------------------------

def test_run_gives_the_shim_every_plan_of_repeated_options_and_directories(fake_exec, tmp_path):
    _, calls = fake_exec
    plans = tmp_path / "plans"
    plans.mkdir()
    for name, gpu in (("b.plan", "GPU B"), ("a.plan", "GPU A")):
        (plans / name).write_text(VALID_PLAN.read_text().replace(
            f"gpu {read_plan(VALID_PLAN).gpu}", f"gpu {gpu}"))
    (plans / "notes.txt").write_text("not a plan")
    result = invoke("run", "--plan", VALID_PLAN, "--plan", plans, "--", "true")
    assert result.exit_code == 0, result.output
    (_, env), = calls
    assert env["MUCUDNN_PLAN"] == ":".join(str(p) for p in (VALID_PLAN, plans / "a.plan",
                                                              plans / "b.plan"))
    assert "warning" not in result.output
    # two plans for one GPU: the shim takes the first, which a warning says
    copy = tmp_path / "copy.plan"
    copy.write_text((plans / "a.plan").read_text())
    result = invoke("run", "--plan", plans, "--plan", copy, "--", "true")
    assert result.exit_code == 0
    assert result.stderr.splitlines() == [
        f"mucudnn: warning: {plans / 'a.plan'} and {copy} are both for GPU A / cuDNN "
        f"{read_plan(VALID_PLAN).cudnn}: the shim takes {plans / 'a.plan'}"]


def test_run_refuses_a_malformed_plan_among_several_and_an_empty_directory(fake_exec, tmp_path):
    _, calls = fake_exec
    assert_one_error_line(invoke("run", "--plan", VALID_PLAN, "--plan", BAD_PLAN, "--", "true"),
                          f"{BAD_PLAN}:{expected_error_line(BAD_PLAN)}:")
    (tmp_path / "empty").mkdir()
    assert_one_error_line(invoke("run", "--plan", tmp_path / "empty", "--", "true"),
                          "no *.plan files in the directory")
    assert calls == []


def test_run_refuses_a_plan_whose_path_holds_a_colon_wherever_it_comes_from(fake_exec, tmp_path,
                                                                          monkeypatch):
    """MUCUDNN_PLAN separates plans with ':': a plan path holding one, found in a directory or
    from a working directory whose path holds one, would name two files that do not exist."""
    _, calls = fake_exec
    plans = tmp_path / "plans"
    plans.mkdir()
    (plans / "a:b.plan").write_text(VALID_PLAN.read_text())
    assert_one_error_line(invoke("run", "--plan", plans, "--", "true"), f"{plans / 'a:b.plan'}",
                          "':'")
    odd = tmp_path / "run:1"
    odd.mkdir()
    (odd / "r.plan").write_text(VALID_PLAN.read_text())
    monkeypatch.chdir(odd)
    assert_one_error_line(invoke("run", "--plan", "r.plan", "--", "true"), f"{odd / 'r.plan'}", "':'")
    assert calls == []


def test_autotune_on_gpus_of_two_models_writes_and_runs_a_plan_for_each(no_gpu, recording_exec,
                                                                        tmp_path, monkeypatch):
    """Every model was benchmarked (bench --gpus); each gets its plan, and the command runs with
    both, its ranks each taking the one for its GPU."""
    import os

    from mucudnn.environment import Environment
    from mucudnn.store import StoredMeasurement
    kernels = [p for p, _ in mucudnn.load_config("alexnet").kernels()]
    _, calls = recording_exec(kernels=kernels)
    shipped = tuner.shipped_store()
    (gpu, cudnn, _), = shipped.environments()
    with open_store(os.environ["MUCUDNN_STORE"]) as store:  # the other model's measurements
        store.put_rows(StoredMeasurement("Other GPU 80GB", cudnn, row.measurement,
                                         row.measured_at, row.repetitions, row.iqr_ms)
                       for p in kernels for row in shipped.rows(gpu, cudnn, p.key))
    monkeypatch.setattr(tuner, "benchmark", lambda source, policy, **kw: 0)
    monkeypatch.setattr(tuner, "gpu_models_here", lambda: [Environment(gpu, cudnn),
                                                           Environment("Other GPU 80GB", cudnn)])
    result = invoke("autotune", "--workspace-limit", "64MiB", "-o", tmp_path / "auto.plan", "--",
                    "torchrun", "--nproc-per-node", "2", "train.py")
    assert result.exit_code == 0, result.output
    paths = [tmp_path / f"auto.{gpu.replace(' ', '_')}.plan", tmp_path / "auto.Other_GPU_80GB.plan"]
    assert [read_plan(path).gpu for path in paths] == [gpu, "Other GPU 80GB"]
    assert not (tmp_path / "auto.plan").exists()
    (_, _), (run_args, run_env) = calls
    assert run_args[:3] == ["torchrun", "--nproc-per-node", "2"]
    assert run_env["MUCUDNN_PLAN"] == ":".join(str(path.resolve()) for path in paths)
    assert f"(for {gpu})" in result.stderr and "(for Other GPU 80GB)" in result.stderr
