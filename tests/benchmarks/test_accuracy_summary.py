"""benchmarks/accuracy_summary.py on logs written here: the step lines it reads, the steps it
times and leaves out, and the row it makes."""

from __future__ import annotations

from benchmarks.accuracy_summary import main, read_steps, summarize


def step_line(step, ms, state="watching", **fields):
    extra = "".join(f" {key}={value}" for key, value in fields.items())
    return (f"train_steps: step {step} start_s=1.000 end_s=2.000 step_ms={ms} "
            f"session={state}{extra}")


def test_a_case_is_timed_from_its_start_step_without_the_traced_ones(tmp_path, capsys):
    ours = [step_line(1, 9000.0, "recording")] + [
        step_line(k, 200.0 if k == 16 else 100.0 + k % 2, peak_gib=4.5, reserved_gib=4.9,
                  retries=k % 3, predicted_ms=105.0) for k in range(2, 21)]
    (tmp_path / "accuracy-net-8-5GiB.log").write_text("\n".join(["noise"] + ours) + "\n")
    (tmp_path / "accuracy-net-8-5GiB-pytorch.log").write_text("\n".join(
        step_line(k, 80.0, "none") for k in range(1, 21)) + "\n")
    steps = read_steps(tmp_path / "accuracy-net-8-5GiB.log")
    assert len(steps) == 20 and steps[1]["peak_gib"] == 4.5 and steps[0]["state"] == "recording"
    row = summarize(steps, read_steps(tmp_path / "accuracy-net-8-5GiB-pytorch.log"),
                    start=15, skip=frozenset({16}))
    # steps 15, 17-20 (16 traced): 101, 101, 100, 101, 100
    assert row["median_ms"] == 101.0 and row["most_ms"] == 101.0 and row["pytorch_ms"] == 80.0
    assert row["ratio"] == 101.0 / 80.0 and row["peak_gib"] == 4.5
    assert abs(row["predicted_off"] - (105.0 / 101.0 - 1)) < 1e-12
    assert main([str(tmp_path), "--skip", "16"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[2].startswith("| net-8-5GiB | 80.0 | 101.0 (100.0-101.0) | 1.262 |")


def test_a_case_that_timed_no_step_says_so(tmp_path, capsys):
    (tmp_path / "accuracy-net-8-5GiB.log").write_text(step_line(1, 9000.0, "recording") + "\n")
    assert main([str(tmp_path)]) == 0
    assert "| net-8-5GiB | no step to time |" in capsys.readouterr().out


def test_a_workspace_limit_variant_is_compared_with_its_cases_pytorch_run():
    from benchmarks.accuracy_summary import pytorch_log_name
    assert pytorch_log_name("accuracy-vgg16-176-5.5GiB") == "accuracy-vgg16-176-5.5GiB-pytorch.log"
    assert pytorch_log_name("accuracy-vgg16-176-5.5GiB-ws320MiB") == "accuracy-vgg16-176-5.5GiB-pytorch.log"
