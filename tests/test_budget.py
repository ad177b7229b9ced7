"""The memory budget (mucudnn/budget.py, launch.py, slack.py, mucudnn/_torch_site/): ``mucudnn run --memory-budget``,
``autotune --memory-budget`` and ``mucudnn.memory_budget``, against a stand-in PyTorch
(tests/faketorch: PyTorch's lazy CUDA initialisation, a log of every limit set) and no GPU."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

import mucudnn
from mucudnn import budget as budget_mod
from mucudnn import cli, shimlib, slack, tuner
from mucudnn.cli import main
from mucudnn.environment import Gpu
from mucudnn.launch import SITE_DIR


FAKE_TORCH = Path(__file__).resolve().parent / "faketorch"
GIB = 1 << 30
CASE = "dir=fwd op=ws n=8 c=4 in=7x7 k=6 f=3x3 pad=1x1 g=2 ws=65536 algo=0"

# The program under the budget: one line when torch is imported, then the first CUDA use.
PROGRAM = textwrap.dedent("""
    import json, os, sys
    import torch
    with open(os.environ["FAKE_TORCH_LOG"], "a") as log:
        log.write(json.dumps({"event": "imported", "initialized": torch.cuda.is_initialized(),
                              "budget": os.environ.get("MUCUDNN_MEMORY_BUDGET"),
                              "loader": type(torch.__spec__.loader).__name__}) + "\\n")
    torch.cuda._lazy_init()
    sys.exit(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
""")


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture
def child(monkeypatch, tmp_path):
    """Real child processes with the fake torch on PYTHONPATH and its log; no LD_PRELOAD (the
    shim is not what these tests are about, and no build is needed); GPUs the launcher sees are
    set with ``child.gpus``."""
    log = tmp_path / "torch.log"
    monkeypatch.setenv("PYTHONPATH", str(FAKE_TORCH))
    monkeypatch.setenv("FAKE_TORCH_LOG", str(log))
    monkeypatch.setenv("FAKE_TORCH_DEVICES", f"{80 * GIB},{40 * GIB}")
    monkeypatch.delenv("MUCUDNN_LOG_LEVEL", raising=False)
    monkeypatch.delenv("MUCUDNN_MEMORY_BUDGET", raising=False)
    shim_env_of = cli._shim_env

    def without_preload(*args, **kwargs):
        env = shim_env_of(*args, **kwargs)
        env.pop("LD_PRELOAD")
        return env

    monkeypatch.setattr(cli, "_shim_env", without_preload)
    monkeypatch.setattr(shimlib, "shim_path", lambda: tmp_path / "libmucudnn.so")  # never built

    class Child:
        gpus = [Gpu(0, "0", "Fake GPU 0", 80 * GIB), Gpu(1, "1", "Fake GPU 1", 40 * GIB)]

        @staticmethod
        def events():
            if not log.exists():
                return []
            return [json.loads(line) for line in log.read_text().splitlines()]

    monkeypatch.setattr(budget_mod, "visible_gpus", lambda: Child.gpus)
    return Child


def python(*args) -> list[str]:
    return ["--", sys.executable, "-c", PROGRAM, *args]


def lines(text: str, prefix: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(prefix)]


# -- run: PyTorch's caching allocator --------------------------------------------------------------

def test_run_applies_the_budget_at_cuda_initialisation_not_at_import(child, capfd):
    result = invoke("run", "--memory-budget", "1GiB", *python())
    assert result.exit_code == 0, result.output
    imported, init, *fractions = child.events()
    assert imported.pop("loader") == "SourceFileLoader"  # torch keeps its own loader
    # the hook queued its call: importing torch initialised nothing and limited nothing
    assert imported == {"event": "imported", "initialized": False, "budget": str(GIB)}
    assert init == {"event": "init"}
    assert fractions == [{"event": "fraction", "device": 0, "fraction": GIB / (80 * GIB)},
                         {"event": "fraction", "device": 1, "fraction": GIB / (40 * GIB)}]
    assert capfd.readouterr().err == "" and result.stderr == ""


def test_run_with_a_budget_passes_the_exit_status_on(child):
    assert invoke("run", "--memory-budget", "1GiB", *python("3")).exit_code == 3


def test_the_budget_reaches_python_processes_started_by_a_shell(child):
    """A launcher script, a shell, `python -m torch.distributed.run`: PYTHONPATH and the budget
    go down to every Python process of the command."""
    shell = shlex.join([sys.executable, "-c", PROGRAM])
    result = invoke("run", "--memory-budget", "2GiB", "--", "sh", "-c", shell)
    assert result.exit_code == 0, result.output
    assert [e["fraction"] for e in child.events() if e["event"] == "fraction"] == [
        2 / 80, 2 / 40]


def test_info_level_says_what_was_limited(child, capfd):
    assert invoke("run", "--log-level", "info", "--memory-budget", "1GiB",
                  *python()).exit_code == 0
    info = lines(capfd.readouterr().err, "mucudnn: info: memory budget")
    assert info == ["mucudnn: info: memory budget 1.00 GiB: PyTorch's caching allocator on GPU 0 "
                    "limited to 0.0125 of its memory",
                    "mucudnn: info: memory budget 1.00 GiB: PyTorch's caching allocator on GPU 1 "
                    "limited to 0.0250 of its memory"]


def test_an_existing_sitecustomize_still_runs(child, tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(textwrap.dedent("""
        import json, os, sys
        with open(os.environ["FAKE_TORCH_LOG"], "a") as log:
            log.write(json.dumps({"event": "site", "file": __file__,
                                  "torch": "torch" in sys.modules}) + "\\n")
    """))
    monkeypatch.setenv("PYTHONPATH", f"{FAKE_TORCH}:{site}")
    assert invoke("run", "--memory-budget", "1GiB", *python()).exit_code == 0
    events = child.events()
    assert events[0] == {"event": "site", "file": str(site / "sitecustomize.py"), "torch": False}
    assert [e["event"] for e in events[1:]] == ["imported", "init", "fraction", "fraction"]


def test_the_site_directory_is_put_on_pythonpath_once(fake_exec, monkeypatch):
    _, calls = fake_exec
    monkeypatch.setattr(budget_mod, "visible_gpus", lambda: [Gpu(0, "0", "GPU", 80 * GIB)])
    site = str(SITE_DIR)
    monkeypatch.setenv("PYTHONPATH", f"/elsewhere:{site}")
    assert invoke("run", "--memory-budget", "6GiB", "--", "true").exit_code == 0
    [(_, env)] = calls
    assert env["PYTHONPATH"] == f"{site}:/elsewhere"
    assert env["MUCUDNN_MEMORY_BUDGET"] == str(6 * GIB)  # bytes: for the shim and the hook
    assert not Path(env["MUCUDNN_BUDGET_REPORT"]).exists()  # the launcher's file, removed


@pytest.mark.parametrize("users", [None, "max_split_size_mb:128"])
def test_a_budget_avoids_fragmentation_unless_the_user_configured_the_allocator(fake_exec, monkeypatch,
                                                                                 users):
    _, calls = fake_exec
    monkeypatch.setattr(budget_mod, "visible_gpus", lambda: [Gpu(0, "0", "GPU", 80 * GIB)])
    if users is None:
        monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    else:
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", users)
    assert invoke("run", "--memory-budget", "6GiB", "--", "true").exit_code == 0
    [(_, env)] = calls
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == (users or "expandable_segments:True")


@pytest.mark.parametrize("users", [None, "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"])
@pytest.mark.parametrize("offload", [True, False])
def test_offload_asks_the_site_hook_for_threaded_pinning_where_the_allocator_is_ours(
        fake_exec, monkeypatch, users, offload):
    # only where the launcher configured the allocator itself (the user's configuration, under
    # either of PyTorch's names, is left whole) and only under --offload (what pins host memory)
    _, calls = fake_exec
    monkeypatch.setattr(budget_mod, "visible_gpus", lambda: [Gpu(0, "0", "GPU", 80 * GIB)])
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "MUCUDNN_PINNED_REGISTER"):
        monkeypatch.delenv(name, raising=False)
    if users is not None:
        monkeypatch.setenv(users, "max_split_size_mb:128")
    assert invoke("run", "--memory-budget", "6GiB", *["--offload"] * offload,
                  "--", "true").exit_code == 0
    [(_, env)] = calls
    assert env.get("MUCUDNN_PINNED_REGISTER") == ("1" if offload and users is None else None)
    # a user's own choice of the switch stays
    monkeypatch.setenv("MUCUDNN_PINNED_REGISTER", "0")
    calls.clear()
    assert invoke("run", "--memory-budget", "6GiB", "--offload", "--", "true").exit_code == 0
    assert calls[0][1]["MUCUDNN_PINNED_REGISTER"] == "0"


def test_without_a_budget_nothing_changes(fake_exec, monkeypatch):
    _, calls = fake_exec
    monkeypatch.delenv("PYTHONPATH", raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    assert invoke("run", "--", "true").exit_code == 0
    [(_, env)] = calls
    assert "PYTHONPATH" not in env and "MUCUDNN_MEMORY_BUDGET" not in env
    assert "PYTORCH_CUDA_ALLOC_CONF" not in env


# -- bad budgets, no torch, no GPU: one line each ------------------------------------------------

@pytest.mark.parametrize("command", ["run", "autotune"])
def test_a_malformed_budget_names_the_value_and_runs_nothing(fake_exec, command):
    _, calls = fake_exec
    extra = ["--workspace-limit", "64MiB"] if command == "autotune" else []
    result = invoke(command, *extra, "--memory-budget", "6 parsecs", "--", "true")
    assert result.exit_code == 2 and "'6 parsecs'" in result.stderr, result.output
    assert "Traceback" not in result.output and calls == []


def test_a_zero_budget_is_refused_and_runs_nothing(fake_exec):
    _, calls = fake_exec
    result = invoke("run", "--memory-budget", "0", "--", "true")
    assert result.exit_code == 2
    assert "memory budget '0' is not more than 0 bytes" in result.stderr, result.stderr
    assert calls == []


@pytest.mark.parametrize("text, expected", [("5.6GiB", 6012954214), ("0.5KiB", 512),
                                            ("1.5", 1), ("6GiB", 6 << 30), (1000, 1000)])
def test_a_budget_is_rounded_down_to_whole_bytes(text, expected):
    assert budget_mod.parse_budget(text) == expected


def test_run_takes_a_decimal_budget(fake_exec, monkeypatch):
    _, calls = fake_exec
    monkeypatch.setattr(budget_mod, "visible_gpus", lambda: [Gpu(0, "0", "GPU", 80 * GIB)])
    assert invoke("run", "--memory-budget", "5.6GiB", "--", "true").exit_code == 0
    [(_, env)] = calls
    assert env["MUCUDNN_MEMORY_BUDGET"] == str(int(5.6 * GIB))


def test_a_budget_larger_than_a_gpu_is_one_error_line_and_runs_nothing(child):
    child.gpus = [Gpu(0, "0", "Fake GPU 0", 80 * GIB), Gpu(1, "1", "Fake GPU 1", 8 * GIB)]
    result = invoke("run", "--memory-budget", "16GiB", *python())
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [
        f"mucudnn: error: memory budget {16 * GIB} bytes (16.0 GiB) is more than GPU 1's memory "
        f"(Fake GPU 1, {8 * GIB} bytes (8.0 GiB))"]
    assert child.events() == []  # nothing ran


def test_a_budget_larger_than_the_gpu_the_program_sees_is_a_warning_there(child, capfd,
                                                                         monkeypatch):
    """The launcher saw no GPU; the program sees one smaller than the budget: one line, no
    DeferredCudaCallError traceback, the program goes on unlimited."""
    child.gpus = None
    monkeypatch.setenv("FAKE_TORCH_DEVICES", str(8 * GIB))
    result = invoke("run", "--memory-budget", "16GiB", *python())
    assert result.exit_code == 0, result.output
    err = capfd.readouterr().err
    assert err.splitlines() == [
        "mucudnn: warning: memory budget 16.00 GiB is more than GPU 0's memory (Fake GPU 0, "
        "8.00 GiB); PyTorch's memory is not limited"], err
    assert [e["event"] for e in child.events()] == ["imported", "init"]


def test_no_gpu_visible_is_a_warning_and_the_command_runs(child, capfd, monkeypatch):
    child.gpus = None
    monkeypatch.setenv("FAKE_TORCH_DEVICES", "")
    script = ["--", sys.executable, "-c", "import torch; print('ran')"]
    result = invoke("run", "--memory-budget", "1GiB", *script)
    assert result.exit_code == 0
    assert result.stderr.splitlines() == [
        f"mucudnn: warning: memory budget {GIB} bytes (1.0 GiB): no GPU visible to this process "
        "(no CUDA driver); running the command anyway"]
    assert capfd.readouterr() == ("ran\n", "")


def test_no_torch_in_the_command_is_one_warning_line_after_it(child, capfd):
    command = [sys.executable, "-c", "print('ran')"]
    result = invoke("run", "--memory-budget", "1GiB", "--", *command)
    assert result.exit_code == 0
    assert result.stderr.splitlines() == [
        f"mucudnn: warning: memory budget {GIB} bytes (1.0 GiB): no Python process of "
        f"`{shlex.join(command)}` imported torch (or it ran with python -I/-E, which "
        "ignore PYTHONPATH), so only the shim had the budget"]
    assert capfd.readouterr() == ("ran\n", "")


def test_a_malformed_budget_variable_set_by_hand_is_one_warning_line(child, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", f"{SITE_DIR}:{FAKE_TORCH}")
    monkeypatch.setenv("MUCUDNN_MEMORY_BUDGET", "lots")
    done = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout == ""
    assert done.stderr.splitlines() == [
        "mucudnn: warning: MUCUDNN_MEMORY_BUDGET='lots' is not a size (expected bytes, or a "
        "number with B, KiB, MiB, GiB, TiB, KB, MB, GB or TB, e.g. 6GiB); PyTorch's memory is not "
        "limited"]
    assert [e["event"] for e in child.events()] == ["imported", "init"]


# -- autotune -------------------------------------------------------------------------------------

def test_autotune_runs_both_commands_under_the_budget(no_gpu, recording_exec, tmp_path, monkeypatch):
    kernels = [p for p, _ in mucudnn.load_config("alexnet").kernels()]
    _, calls = recording_exec(kernels=kernels)
    monkeypatch.setattr(budget_mod, "visible_gpus", lambda: [Gpu(0, "0", "GPU", 80 * GIB)])
    monkeypatch.setattr(tuner, "benchmark", lambda source, policy, **kw: 0)
    result = invoke("autotune", "--workspace-limit", "64MiB", "--memory-budget", "6GiB", "-o",
                    tmp_path / "auto.plan", "--", "python", "train.py")
    assert result.exit_code == 0, result.output
    (_, record_env), (_, run_env) = calls
    for env in (record_env, run_env):
        assert env["MUCUDNN_MEMORY_BUDGET"] == str(6 * GIB)
        assert env["PYTHONPATH"].split(":")[0] == str(SITE_DIR)


@pytest.mark.parametrize("options, expected", [((), "5"), (("--workspace-slack", "2"), "2"),
                                               (("--workspace-slack", "off"), None)])
def test_autotune_offloads_in_both_runs_and_gives_the_planned_run_the_slack(
        no_gpu, recording_exec, tmp_path, monkeypatch, options, expected):
    monkeypatch.setenv("MUCUDNN_WORKSPACE_SLACK", "x")   # recorded, so restored after the test
    monkeypatch.delenv("MUCUDNN_WORKSPACE_SLACK")
    kernels = [p for p, _ in mucudnn.load_config("alexnet").kernels()]
    _, calls = recording_exec(kernels=kernels)
    monkeypatch.setattr(budget_mod, "visible_gpus", lambda: [Gpu(0, "0", "GPU", 80 * GIB)])
    monkeypatch.setattr(tuner, "benchmark", lambda source, policy, **kw: 0)
    result = invoke("autotune", "--memory-budget", "6GiB", "--offload", *options, "-o",
                    tmp_path / "auto.plan", "--", "python", "train.py")
    assert result.exit_code == 0, result.output
    (_, record_env), (_, run_env) = calls
    assert record_env["MUCUDNN_OFFLOAD"] == run_env["MUCUDNN_OFFLOAD"] == "1"
    assert "MUCUDNN_WORKSPACE_SLACK" not in record_env   # recording runs no plan
    assert run_env.get("MUCUDNN_WORKSPACE_SLACK") == expected
    # and the step's share of the slack: the limit the written front plan gives, if any
    from mucudnn.plan import read_plan
    limit = expected and slack.plan_workspace_limit([read_plan(tmp_path / "auto.plan")],
                                                         int(expected))
    assert run_env.get("MUCUDNN_WORKSPACE_LIMIT") == (str(limit) if limit else None)
    assert "MUCUDNN_WORKSPACE_LIMIT" not in record_env


def test_autotune_offload_needs_a_budget(tmp_path):
    result = invoke("autotune", "--offload", "-o", tmp_path / "auto.plan", "--", "python", "t.py")
    assert result.exit_code == 2 and "--offload needs --memory-budget" in result.output


# -- in-process: mucudnn.memory_budget ------------------------------------------------------------

@pytest.fixture
def fake_torch(monkeypatch, tmp_path):
    """The fake torch importable in this process, fresh for each test."""
    log = tmp_path / "torch.log"
    monkeypatch.setenv("FAKE_TORCH_LOG", str(log))
    monkeypatch.setenv("FAKE_TORCH_DEVICES", f"{80 * GIB}")
    monkeypatch.delenv("MUCUDNN_MEMORY_BUDGET", raising=False)
    monkeypatch.syspath_prepend(str(FAKE_TORCH))
    for name in ("torch", "torch.cuda"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    import torch
    yield torch, lambda: [json.loads(line) for line in log.read_text().splitlines()]
    for name in ("torch", "torch.cuda"):
        sys.modules.pop(name, None)


def test_memory_budget_in_process_waits_for_cuda_and_sets_the_variable(fake_torch):
    torch, events = fake_torch
    mucudnn.memory_budget("2GiB")
    assert not torch.cuda.is_initialized()
    import os
    assert os.environ["MUCUDNN_MEMORY_BUDGET"] == str(2 * GIB)
    torch.cuda._lazy_init()
    assert events() == [{"event": "init"},
                        {"event": "fraction", "device": 0, "fraction": 2 / 80}]


def test_memory_budget_as_a_context_restores_the_fraction_and_variable(fake_torch, monkeypatch):
    torch, events = fake_torch
    import os
    monkeypatch.setenv("MUCUDNN_MEMORY_BUDGET", "123")
    torch.cuda._lazy_init()
    torch.cuda.set_per_process_memory_fraction(0.5, 0)
    with mucudnn.memory_budget("8GiB"):
        assert torch.cuda.get_per_process_memory_fraction(0) == 8 / 80
        assert os.environ["MUCUDNN_MEMORY_BUDGET"] == str(8 * GIB)
    assert torch.cuda.get_per_process_memory_fraction(0) == 0.5
    assert os.environ["MUCUDNN_MEMORY_BUDGET"] == "123"


def test_memory_budget_context_left_before_cuda_starts_limits_nothing(fake_torch):
    torch, events = fake_torch
    with mucudnn.memory_budget("8GiB"):
        pass
    torch.cuda._lazy_init()
    assert events() == [{"event": "init"}]


def test_memory_budget_larger_than_the_gpu_raises_one_line(fake_torch):
    torch, _ = fake_torch
    torch.cuda._lazy_init()
    with pytest.raises(mucudnn.BudgetError, match=r"^memory budget 100.00 GiB is more than GPU "
                                                   r"0's memory \(Fake GPU 0, 80.00 GiB\)$"):
        mucudnn.memory_budget("100GiB")
    assert torch.cuda.get_per_process_memory_fraction(0) == 1.0  # nothing limited


def test_memory_budget_without_a_gpu_warns(fake_torch, monkeypatch):
    monkeypatch.setenv("FAKE_TORCH_DEVICES", "")
    with pytest.warns(UserWarning, match="no GPU visible to PyTorch"):
        mucudnn.memory_budget("1GiB")


def test_memory_budget_without_torch_is_a_mucudnn_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    with pytest.raises(mucudnn.MucudnnError, match="memory_budget needs PyTorch"):
        mucudnn.memory_budget("1GiB")


@pytest.mark.parametrize("value", ["0", "0.1", "6 parsecs", "5.6 parsecs", -1])
def test_memory_budget_refuses_bad_sizes(value):
    with pytest.raises(mucudnn.MucudnnError):
        mucudnn.memory_budget(value)


# -- the shim's option -----------------------------------------------------------------------------

def test_the_shim_reads_the_budget_as_a_size_option(shim_env):
    run = shim_env.run([CASE], env={"MUCUDNN_MEMORY_BUDGET": "6GiB", "MUCUDNN_LOG_LEVEL": "debug"})
    assert f"mucudnn: debug: option MUCUDNN_MEMORY_BUDGET = {6 * GIB} (environment;" in run.stderr
    bad = shim_env.run([CASE], env={"MUCUDNN_MEMORY_BUDGET": "lots"})
    assert bad.shim_lines("warning") == [
        "mucudnn: warning: MUCUDNN_MEMORY_BUDGET='lots' is not valid (expected bytes, or a number "
        "with B, KiB, MiB, GiB, TiB, KB, MB, GB or TB); using the default"]


# -- the shim's room sees PyTorch's cached free memory -----------------------------------------------

class _Cuda:
    def __init__(self, reserved, allocated, initialized=True):
        self.stats = {"reserved_bytes": {"all": {"current": reserved}},
                      "allocated_bytes": {"all": {"current": allocated}}}
        self.initialized, self.devices = initialized, []

    def is_initialized(self):
        return self.initialized

    def current_device(self):
        return 1

    def memory_stats_as_nested_dict(self, device):
        self.devices.append(device)
        if self.stats is None:
            raise RuntimeError("CUDA error: an illegal memory access")
        return self.stats


class _Setter:
    """Stands in for the preloaded shim's mucudnn_set_allocator (a ctypes function: it takes
    argtypes): keeps the function it is given, as the C side does."""

    def __init__(self):
        self.fn = None

    def __call__(self, fn):
        self.fn = fn


class _Shim:
    def __init__(self):
        self.mucudnn_set_allocator = _Setter()

    def ask(self):
        """What the registered function answers, as the C side reads it."""
        import ctypes
        reserved, allocated = ctypes.c_size_t(7), ctypes.c_size_t(7)
        status = self.mucudnn_set_allocator.fn(ctypes.byref(reserved), ctypes.byref(allocated))
        return status, reserved.value, allocated.value


def test_the_shim_is_told_what_pytorchs_allocator_holds_and_uses(monkeypatch):
    from types import SimpleNamespace
    import ctypes
    hook = budget_mod._hook()
    exits = []
    monkeypatch.setattr("atexit.register", lambda fn, *args: exits.append((fn, args)))
    cuda, shim = _Cuda(reserved=10 * GIB, allocated=7 * GIB), _Shim()
    assert hook.tell_shim_allocator(SimpleNamespace(cuda=cuda), library=shim)
    assert shim.ask() == (0, 10 * GIB, 7 * GIB) and cuda.devices == [1]  # the current device
    cuda.stats = None  # a failing query says so (nonzero), never an exception into C
    assert shim.ask()[0] != 0
    cuda.initialized = False
    assert shim.ask()[0] != 0
    # unregistered at exit: a NULL function pointer
    (fn, (null,)), = exits
    assert fn is shim.mucudnn_set_allocator and not ctypes.cast(null, ctypes.c_void_p).value


def test_without_a_shim_nothing_is_registered():
    from types import SimpleNamespace
    hook = budget_mod._hook()
    assert not hook.tell_shim_allocator(SimpleNamespace(cuda=_Cuda(1, 0)), library=object())


# -- the step's share of the workspace slack (plan_workspace_limit) -------------------------------

KEY_A = "dir=fwd,dt=f32,ct=f32,math=default,layout=nchw,c=8,in=16x16,k=8,f=3x3,pad=1x1," \
        "stride=1x1,dil=1x1,g=1,mode=xcorr"
KEY_B = KEY_A.replace("c=8", "c=16")


def front_plan(points: dict[str, list[tuple[int, float]]], strategy="front"):
    """A plan of ``points`` per key (workspace MiB, ms), each point one undivided piece."""
    from mucudnn.plan import read_plan_text
    lines = ["mucudnn-plan 1", "gpu G", "cudnn 91900", f"strategy {strategy}",
             f"limit {2**62}", "policy powerOfTwo"]
    for key, front in points.items():
        for mib, ms in front:
            lines.append(f"kernel {key} 32 {mib * 2**20} {ms} 32:implicit_gemm:default")
    return read_plan_text("\n".join(lines) + "\n")


def test_the_plans_limit_is_the_least_whose_kernels_stay_within_the_slack():
    # A: 10 ms at 512 MiB, 10.8 at 256 (8 % slower: the per-kernel slack of 5 keeps 512);
    # B: 30 ms at 128 MiB. No limit: 40 ms. At 256 MiB: 40.8 ms (2 % more), at 128: A has no
    # point (so 128 is no limit here).
    plan = front_plan({KEY_A: [(512, 10.0), (256, 10.8)], KEY_B: [(128, 30.0)]})
    assert slack.plan_workspace_limit([plan], 5) == 256 * 2**20
    assert slack.plan_workspace_limit([plan], 1) is None      # 2 % more is over 1 %


def test_no_limit_where_none_lowers_the_largest_point():
    # every kernel already at its least workspace within the slack, or no plan of fronts
    plan = front_plan({KEY_A: [(512, 10.0), (256, 10.2)], KEY_B: [(128, 30.0)]})
    assert slack.plan_workspace_limit([plan], 5) is None
    assert slack.plan_workspace_limit([plan], 0) is None


def test_of_several_plans_the_limit_is_the_largest():
    loose = front_plan({KEY_A: [(512, 10.0), (256, 10.8)], KEY_B: [(128, 30.0)]})
    tight = front_plan({KEY_A: [(512, 10.0), (64, 10.1)], KEY_B: [(32, 30.0), (16, 30.2)]})
    assert slack.plan_workspace_limit([tight], 5) is None      # the slack alone gets there
    assert slack.plan_workspace_limit([loose, loose], 5) == 256 * 2**20


@pytest.mark.parametrize("env, offload, expected", [
    ({"MUCUDNN_WORKSPACE_SLACK": "5"}, True, str(256 * 2**20)),
    ({"MUCUDNN_WORKSPACE_SLACK": "5"}, False, None),                 # no offload: no limit
    ({}, True, None),                                                # slack off
    ({"MUCUDNN_WORKSPACE_SLACK": "5", "MUCUDNN_WORKSPACE_LIMIT": "1GiB"}, True, "1GiB"),  # given
    ({"MUCUDNN_WORKSPACE_SLACK": "²"}, True, None),    # no ASCII digit: the shim's to refuse
    ({"MUCUDNN_WORKSPACE_SLACK": "５"}, True, None),
])
def test_run_sets_the_plans_limit_under_offload_only(tmp_path, env, offload, expected):
    from mucudnn.plan import format_plan
    path = tmp_path / "front.plan"
    path.write_text(format_plan(front_plan({KEY_A: [(512, 10.0), (256, 10.8)],
                                            KEY_B: [(128, 30.0)]})))
    said = []
    slack.set_plan_workspace_limit(env, [path], offload, said.append)
    assert env.get("MUCUDNN_WORKSPACE_LIMIT") == expected
    assert len(said) == (1 if expected == str(256 * 2**20) else 0)
    assert all("256.0 MiB" in line or "256 MiB" in line for line in said), said


def test_run_plan_offload_gives_the_command_the_plans_limit(tmp_path, monkeypatch, capfd):
    from mucudnn.plan import format_plan
    for name in ("MUCUDNN_WORKSPACE_SLACK", "MUCUDNN_WORKSPACE_LIMIT"):
        monkeypatch.delenv(name, raising=False)
    path = tmp_path / "front.plan"
    path.write_text(format_plan(front_plan({KEY_A: [(512, 10.0), (256, 10.8)],
                                            KEY_B: [(128, 30.0)]})))
    out = tmp_path / "out.txt"
    result = invoke("run", "--plan", path, "--memory-budget", "1GiB", "--offload", "--", "sh",
                    "-c", f"echo ${{MUCUDNN_WORKSPACE_LIMIT:-unset}} > {out}")
    assert result.exit_code == 0, result.output
    assert out.read_text().strip() == str(256 * 2**20)
    assert "workspace limit 268435456 bytes (256.0 MiB) from the plan" in result.stderr


@pytest.mark.parametrize("env, budget, offload, online, expected", [
    ({}, 8 << 30, True, True, str(512 << 20)),                        # 1/16 of the budget
    ({}, 8 << 30, False, True, None),                                 # no offload
    ({}, None, True, True, None),                                     # no budget
    ({}, 8 << 30, True, False, None),                                 # a plan or --no-online
    ({"MUCUDNN_WORKSPACE_HOLD": "64MiB"}, 8 << 30, True, True, "64MiB"),  # the user's stays
    ({"MUCUDNN_WORKSPACE_LIMIT": "64MiB"}, 8 << 30, True, True, None),    # a hard limit given
])
def test_offload_tuning_online_holds_workspaces_to_a_share_of_the_budget(env, budget, offload, online,
                                                                         expected):
    said = []
    slack.set_offload_workspace_hold(env, budget, offload, online, said.append)
    assert env.get("MUCUDNN_WORKSPACE_HOLD") == expected
    assert len(said) == (1 if expected == str(512 << 20) else 0)
    assert all("1/16 of the memory budget" in line for line in said), said


def test_run_offload_online_gives_the_command_a_workspace_hold(tmp_path, monkeypatch):
    for name in ("MUCUDNN_WORKSPACE_LIMIT", "MUCUDNN_WORKSPACE_HOLD"):
        monkeypatch.delenv(name, raising=False)
    out = tmp_path / "out.txt"
    result = invoke("run", "--memory-budget", "1GiB", "--offload", "--", "sh",
                    "-c", f"echo ${{MUCUDNN_WORKSPACE_HOLD:-unset}} ${{MUCUDNN_WORKSPACE_LIMIT:-unset}} > {out}")
    assert result.exit_code == 0, result.output
    assert out.read_text().split() == [str((1 << 30) // slack.OFFLOAD_WORKSPACE_SHARE), "unset"]
    assert "held to" in result.stderr and "of the memory budget" in result.stderr
