"""benchmarks/host_overhead.py on the CPU: a dry run on a small ResNet times every configuration,
its mixed plan keeps some groups and recomputes others, the sessions' parameters equal PyTorch
alone's bitwise, and bad arguments are refused in one line."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
if not hasattr(torch, "autograd") or not hasattr(torch.autograd, "graph"):
    pytest.skip("needs a real PyTorch", allow_module_level=True)

from benchmarks import host_overhead  # noqa: E402


def test_dry_run_times_every_configuration(tmp_path, capsys):
    out = tmp_path / "host.json"
    document = host_overhead.main(["--layers", "1", "1", "1", "1", "--steps", "2", "--rounds",
                                   "2", "--warmup", "1", "--json", str(out)])
    assert json.loads(out.read_text())["configs"].keys() == {"pytorch", "mixed", "kept"}
    assert document["mixed_kept"] > 0 and document["mixed_recomputed"] > 0
    assert document["mixed_kept"] + document["mixed_recomputed"] == document["groups"]
    for name, row in document["configs"].items():
        assert len(row["samples"]) == 4, name          # 2 rounds x 2 steps
        assert all(f > 0 and b > 0 and o > 0 for f, b, o in row["samples"])
        assert row["forward_ms"]["least"] <= row["forward_ms"]["median"] <= \
            row["forward_ms"]["most"]
        assert row["same_parameters_as"] == "pytorch", name
    page = capsys.readouterr().out
    assert [line.split(" |")[0] for line in page.splitlines() if line.startswith("| ")][1:] == \
        ["| pytorch", "| mixed", "| kept"]
    assert "| yes |" in page and "| NO |" not in page


def test_bad_arguments_are_refused_in_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        host_overhead.main(["--steps", "0"])
    assert exit_info.value.code == 2
    assert "must be positive" in capsys.readouterr().err


def test_the_hook_mechanism_alone_runs_only_where_named_and_leaves_no_hook_behind(capsys):
    import torch.nn.modules.module as hooks
    top_saved_hooks = torch._C._autograd._top_saved_tensors_default_hooks
    before = (len(hooks._global_forward_pre_hooks), len(hooks._global_forward_hooks),
              torch._C._len_torch_function_stack(), top_saved_hooks(False))
    document = host_overhead.main(["--layers", "1", "1", "1", "1", "--steps", "1", "--rounds",
                                   "1", "--warmup", "1", "--configs", "pytorch", "hooks",
                                   "hooks-mode"])
    assert list(document["configs"]) == ["pytorch", "hooks", "hooks-mode"]
    for name, row in document["configs"].items():
        assert row["same_parameters_as"] == "pytorch", name
    assert (len(hooks._global_forward_pre_hooks), len(hooks._global_forward_hooks),
            torch._C._len_torch_function_stack(), top_saved_hooks(False)) == before


def test_the_mixed_plan_replaying_recorded_and_without_the_short_path_trains_as_pytorch():
    document = host_overhead.main(["--layers", "1", "1", "1", "1", "--steps", "2", "--rounds",
                                   "1", "--warmup", "4", "--configs", "pytorch", "mixed",
                                   "mixed-whole", "mixed-recorded"])
    assert list(document["configs"]) == ["pytorch", "mixed", "mixed-whole", "mixed-recorded"]
    for name, row in document["configs"].items():
        assert row["same_parameters_as"] == "pytorch", name
