"""`mucudnn run --memory-budget SIZE --offload`: an unmodified script's Python process runs one
OffloadSession (real CPU PyTorch in a child process)."""

import os
import subprocess
import sys
import textwrap

import pytest
from click.testing import CliRunner

torch = pytest.importorskip("torch")
if not hasattr(torch, "autograd") or not hasattr(torch.autograd, "graph"):
    pytest.skip("needs a real PyTorch", allow_module_level=True)

from mucudnn.cli import main  # noqa: E402

SCRIPT = textwrap.dedent("""
    import sys, torch
    hooks = torch.nn.modules.module._global_forward_hooks
    print("hooks", len(hooks))
""")


def run(tmp_path, *options, text=SCRIPT):
    """`mucudnn run OPTIONS` of a script ``text``: (the CLI's result, what the script printed)."""
    script = tmp_path / "train.py"
    script.write_text(text)
    out = tmp_path / "out.txt"
    result = CliRunner().invoke(main, ["run", *options, "--", "sh", "-c",
                                       f"{sys.executable} {script} > {out}"])
    return result, out.read_text() if out.exists() else ""


def test_offload_starts_a_session_in_the_script(tmp_path, monkeypatch):
    monkeypatch.delenv("MUCUDNN_OFFLOAD", raising=False)
    result, out = run(tmp_path, "--memory-budget", "1GiB", "--offload")
    assert result.exit_code == 0, result.output
    assert "hooks 1" in out


def test_without_offload_no_session(tmp_path, monkeypatch):
    monkeypatch.delenv("MUCUDNN_OFFLOAD", raising=False)
    result, out = run(tmp_path, "--memory-budget", "1GiB")
    assert result.exit_code == 0, result.output
    assert "hooks 0" in out


@pytest.mark.parametrize("users", [None, "max_split_size_mb:128"])
def test_the_script_sees_pinned_memory_page_locked_on_threads_unless_it_set_the_allocator(
        tmp_path, monkeypatch, users):
    # the site hook, in the script's own interpreter (whose PyTorch is this one), before torch
    monkeypatch.delenv("MUCUDNN_PINNED_REGISTER", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    if users is None:
        monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    else:
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", users)
    result, out = run(tmp_path, "--memory-budget", "1GiB", "--offload",
                      text="import os\nprint('conf', os.environ.get('PYTORCH_CUDA_ALLOC_CONF'))\n")
    assert result.exit_code == 0, result.output
    conf = out.split("conf ", 1)[1].strip()
    if users is not None:
        assert conf == users
    else:
        major, minor = (int(part) for part in torch.__version__.split(".")[:2])
        assert (major, minor) >= (2, 2)   # this project's PyTorch: the keys are known
        assert conf.startswith("expandable_segments:True,pinned_use_cuda_host_register:True,"
                               "pinned_num_register_threads:")


def test_offload_needs_a_budget(tmp_path):
    result, _ = run(tmp_path, "--offload")
    assert result.exit_code != 0 and "--offload needs --memory-budget" in result.output


def sessions_attribute(tmp_path, attribute: str, *options) -> tuple[object, str]:
    """`mucudnn run --memory-budget 1GiB --offload OPTIONS` of a script that prints
    ``ATTRIBUTE [value of each OffloadSession in its process]``: (the CLI's result, the output)."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(f"""
        import gc, torch
        from mucudnn.torch.offload_session import OffloadSession
        sessions = [o for o in gc.get_objects() if isinstance(o, OffloadSession)]
        print("{attribute}", [s.{attribute} for s in sessions])
    """))
    out = tmp_path / "out.txt"
    result = CliRunner().invoke(main, ["run", "--memory-budget", "1GiB", "--offload", *options,
                                       "--", "sh", "-c", f"{sys.executable} {script} > {out}"])
    return result, out.read_text() if out.exists() else ""


def attribute_under(tmp_path, monkeypatch, variable: str, value: str | None, attribute: str,
                    refused: bool) -> tuple[object, str]:
    """:func:`sessions_attribute` with ``variable`` set to ``value`` (None: unset); where it is
    ``refused``, asserts `mucudnn run` refuses it in one line naming it and starts nothing."""
    monkeypatch.delenv("MUCUDNN_OFFLOAD", raising=False)
    if value is None:
        monkeypatch.delenv(variable, raising=False)
    else:
        monkeypatch.setenv(variable, value)
    result, out = sessions_attribute(tmp_path, attribute)
    if refused:
        said = [line for line in result.output.splitlines() if variable in line]
        assert result.exit_code == 2 and len(said) == 1 and repr(value) in said[0], result.output
        assert "Traceback" not in result.output and not out
    return result, out


@pytest.mark.parametrize("options,expected", [((), "[True]"),
                                              (("--no-recompute-convolutions",), "[False]")])
def test_offload_recomputes_convolutions_unless_told_not_to(tmp_path, monkeypatch, options,
                                                            expected):
    monkeypatch.delenv("MUCUDNN_OFFLOAD", raising=False)
    result, out = sessions_attribute(tmp_path, "recompute_convolutions", *options)
    assert result.exit_code == 0, result.output
    assert f"recompute_convolutions {expected}" in out


def test_no_recompute_convolutions_needs_offload(tmp_path):
    result, _ = run(tmp_path, "--memory-budget", "1GiB", "--no-recompute-convolutions")
    assert result.exit_code != 0 and "--no-recompute-convolutions needs --offload" in result.output


def test_a_bad_offload_value_is_one_line_and_no_offload(tmp_path, monkeypatch):
    # the launcher's environment without the CLI: a value it does not know
    monkeypatch.setenv("MUCUDNN_OFFLOAD", "sometimes")
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    from mucudnn.launch import SITE_DIR
    env = {**os.environ, "MUCUDNN_MEMORY_BUDGET": str(2**30),
           "PYTHONPATH": f"{SITE_DIR}:{SITE_DIR.parent.parent}"}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "hooks 0" in done.stdout
    said = [line for line in done.stderr.splitlines() if "MUCUDNN_OFFLOAD" in line]
    assert len(said) == 1 and "'sometimes'" in said[0] and "Traceback" not in done.stderr


@pytest.mark.parametrize("value", ["", "PATH"])
def test_the_session_writes_its_profile_where_the_environment_says(tmp_path, monkeypatch, value):
    path = str(tmp_path / "profile.json") if value == "PATH" else ""
    monkeypatch.delenv("MUCUDNN_OFFLOAD", raising=False)
    monkeypatch.setenv("MUCUDNN_OFFLOAD_PROFILE", path)
    result, out = sessions_attribute(tmp_path, "profile_to")
    assert result.exit_code == 0, result.output
    assert f"profile_to {[path or None]}" in out


@pytest.mark.parametrize("options, preset, expected", [
    (("--memory-budget", "1GiB", "--offload"), None, "5"),           # offload's default
    (("--memory-budget", "1GiB", "--offload"), "12", "12"),          # the user's environment kept
    (("--memory-budget", "1GiB", "--offload", "--workspace-slack", "2"), "12", "2"),
    (("--memory-budget", "1GiB", "--offload", "--workspace-slack", "off"), "12", "unset"),
    (("--memory-budget", "1GiB"), None, "unset"),                    # no offload: no slack
    (("--workspace-slack", "3",), None, "3"),
])
def test_workspace_slack_reaches_the_shim(tmp_path, monkeypatch, options, preset, expected):
    monkeypatch.delenv("MUCUDNN_OFFLOAD", raising=False)
    if preset is None:
        monkeypatch.delenv("MUCUDNN_WORKSPACE_SLACK", raising=False)
    else:
        monkeypatch.setenv("MUCUDNN_WORKSPACE_SLACK", preset)
    out = tmp_path / "out.txt"
    result = CliRunner().invoke(main, ["run", *options, "--", "sh", "-c",
                                       f"echo ${{MUCUDNN_WORKSPACE_SLACK:-unset}} > {out}"])
    assert result.exit_code == 0, result.output
    assert out.read_text().strip() == expected


@pytest.mark.parametrize("value", ["5%", "\u00b2", "\uff15", "1001", "-1"])
def test_a_bad_workspace_slack_is_one_line(tmp_path, value):
    result, _ = run(tmp_path, "--workspace-slack", value)
    assert result.exit_code == 2 and "Traceback" not in result.output
    said = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert said == [f"Error: Invalid value for '--workspace-slack': {value!r}: a whole number of "
                    "percent from 0 to 1000 (e.g. 5), or off"]


def test_workspace_slack_off_in_any_case(tmp_path, monkeypatch):
    monkeypatch.setenv("MUCUDNN_WORKSPACE_SLACK", "12")
    out = tmp_path / "out.txt"
    result = CliRunner().invoke(main, ["run", "--workspace-slack", "OFF", "--", "sh", "-c",
                                       f"echo ${{MUCUDNN_WORKSPACE_SLACK:-unset}} > {out}"])
    assert result.exit_code == 0, result.output
    assert out.read_text().strip() == "unset"


@pytest.mark.parametrize("value, expected, warned", [
    (None, "[0.1]", False),      # the session's default
    ("5", "[0.05]", False),
    ("0", "[0.0]", False),
    ("51", "[0.1]", True),       # over the most: the default, and one line naming it
    ("0.05", "[0.1]", True),     # a fraction, not a percent
    ("５", "[0.1]", True),       # a digit, but not an ASCII one
])
def test_the_plans_headroom_comes_from_the_environment(tmp_path, monkeypatch, capfd, value,
                                                       expected, warned):
    result, out = attribute_under(tmp_path, monkeypatch, "MUCUDNN_OFFLOAD_HEADROOM", value,
                                  "headroom", refused=warned)
    if warned:
        return
    assert result.exit_code == 0, result.output
    assert f"headroom {expected}" in out
    stderr = capfd.readouterr().err      # the script's process writes it, not the CLI
    said = [line for line in stderr.splitlines() if "MUCUDNN_OFFLOAD_HEADROOM" in line]
    assert len(said) == (1 if warned else 0) and "Traceback" not in stderr, stderr


@pytest.mark.parametrize("variable, attribute, value, expected", [
    ("MUCUDNN_OFFLOAD_RESCUE", "rescuer.when", None, "[True]"),   # default: a plan's first steps
    ("MUCUDNN_OFFLOAD_RESCUE", "rescuer.when", "always", "['always']"),
    ("MUCUDNN_OFFLOAD_RESCUE", "rescuer.when", "0", "[False]"),
    ("MUCUDNN_OFFLOAD_RESCUE", "rescuer.when", "sometimes", None),   # refused in one line
    ("MUCUDNN_OFFLOAD_LEND", "lender.on", None, "[False]"),          # default: nothing lent
    ("MUCUDNN_OFFLOAD_LEND", "lender.on", "1", "[True]"),
    ("MUCUDNN_OFFLOAD_LEND", "lender.on", "off", "[False]"),
    ("MUCUDNN_OFFLOAD_LEND", "lender.on", "sometimes", None),        # refused in one line
    ("MUCUDNN_OFFLOAD_STAND_ASIDE", "aside.on", None, "[True]"),     # default: it stands aside
    ("MUCUDNN_OFFLOAD_STAND_ASIDE", "aside.on", "0", "[False]"),
    ("MUCUDNN_OFFLOAD_STAND_ASIDE", "aside.on", "sometimes", None),  # refused in one line
    ("MUCUDNN_OFFLOAD_REPLAY", "replay", None, "[True]"),            # default: replays
    ("MUCUDNN_OFFLOAD_REPLAY", "replay", "0", "[False]"),
    ("MUCUDNN_OFFLOAD_REPLAY", "replay", "sometimes", None),         # refused in one line
])
def test_the_rescue_and_lending_come_from_the_environment(tmp_path, monkeypatch, variable,
                                                          attribute, value, expected):
    result, out = attribute_under(tmp_path, monkeypatch, variable, value, attribute,
                                  refused=expected is None)
    if expected is None:
        return
    assert result.exit_code == 0, result.output
    assert f"{attribute} {expected}" in out


OUT_OF_MEMORY_SCRIPT = textwrap.dedent("""
    import torch
    # activations of 4 MiB: saved groups of the session's (not under its least size)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    model(torch.randn(4096, 256)).sum().backward()     # a recording step
    loss = model(torch.randn(4096, 256)).sum()
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")
""")


def test_a_script_that_dies_out_of_memory_gets_one_line_of_the_session_first(tmp_path, capfd):
    # issue 40 item 3: the script sees PyTorch's OutOfMemoryError after one line saying what the
    # session ran the step as, and the budget: here, on the CPU, the session saved no tensor (it
    # moves a GPU's only), so the line blames what the script allocated; a recording's line is
    # tests/torch/test_session_plans.py's (script_ran_out_of_memory)
    script = tmp_path / "train.py"
    script.write_text(OUT_OF_MEMORY_SCRIPT)
    result = CliRunner().invoke(main, ["run", "--memory-budget", "1GiB", "--offload", "--",
                                       sys.executable, str(script)])
    assert result.exit_code != 0
    stderr = capfd.readouterr().err
    said = [line for line in stderr.splitlines() if line.startswith("mucudnn: error:")]
    assert len(said) == 1, stderr
    assert "ran out of device memory before the offload session saved any tensor" in said[0]
    assert "the 1.0 GiB memory budget" in said[0]
    # then the script's own traceback, as ever
    assert stderr.index(said[0]) < stderr.index("torch.OutOfMemoryError: CUDA out of memory")


def test_the_out_of_memory_line_names_the_plan_in_force_and_other_errors_pass(capfd):
    from mucudnn._torch_site.mucudnn_torch_budget import out_of_memory_hook
    from mucudnn.torch.offload_session import OffloadSession
    from session_helpers import RecordingLink, train
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    data = [(torch.randn(8, 32), torch.randint(0, 4, (8,))) for _ in range(6)]
    session = OffloadSession(budget=2**30, link=RecordingLink(), min_bytes=0, trials=False)
    train(model, data, session)
    line = session.out_of_memory_line()
    assert line.startswith(f"the step ran out of device memory under the offload plan in force "
                           f"({session.state}, planned for ") and "1.0 GiB memory budget" in line
    seen = []
    hook = out_of_memory_hook(session, lambda *args: seen.append(args[0]))
    hook(torch.OutOfMemoryError, torch.OutOfMemoryError("x"), None)
    hook(ValueError, ValueError("y"), None)
    errors = [l for l in capfd.readouterr().err.splitlines() if l.startswith("mucudnn: error:")]
    assert errors == [f"mucudnn: error: {line}"] and seen == [torch.OutOfMemoryError, ValueError]
    assert OffloadSession(modes=[]).out_of_memory_line() is None   # no budget, nothing to say
