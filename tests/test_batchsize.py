"""mucudnn batch-size (mucudnn/batchsize.py): search, the measured margin, the CLI protocol."""

import sys
import textwrap
from collections import Counter

import pytest
from click.testing import CliRunner

from mucudnn.batchsize import BatchSizeError, Trial, check_command, parse_throughput, tune
from mucudnn.cli import main

MiB = 2**20


def fake_runner(limit, throughput, peak_growth=0):
    """Batch b runs (peak b MiB, +``peak_growth`` MiB each further run of b) up to ``limit``."""
    runs = Counter()

    def run(batch):
        runs[batch] += 1
        if batch > limit:
            return Trial(batch, 1, None, None, "out of memory")
        return Trial(batch, 0, throughput(batch), (batch + peak_growth * (runs[batch] - 1)) * MiB)
    return run, runs


def test_the_fastest_that_holds_not_the_largest():
    run, runs = fake_runner(100, lambda b: b * 10 if b <= 48 else 480 - (b - 48) * 2)
    best, trials, margin = tune(run, budget=1000 * MiB, start=8)
    assert best.batch == 64
    held = [t for t in trials if t.holds(1000 * MiB, margin)]
    assert best.throughput == max(t.throughput for t in held)
    assert max(t.batch for t in held) == 96            # doubling then bisection found it
    assert runs[64] == 2                               # the pick ran again


def test_the_margin_is_measured_from_a_second_run():
    run, _ = fake_runner(1000, lambda b: float(b), peak_growth=5)
    best, _, margin = tune(run, budget=100 * MiB, start=8)
    # 96 held once (peak 96 MiB) but ran again at 101 MiB: 5 MiB margin, so 64 (69 MiB again)
    assert margin == 5 * MiB and best.batch == 64


def test_nothing_holds_is_one_clear_error():
    run, _ = fake_runner(4, float)
    with pytest.raises(BatchSizeError, match="no batch size from 8 holds.*out of memory"):
        tune(run, budget=100 * MiB, start=8)


@pytest.mark.parametrize("command, message", [((), "give the training command"),
                                              (("python", "train.py"), "no {}")])
def test_bad_commands(command, message):
    with pytest.raises(BatchSizeError, match=message):
        check_command(command)


def test_bad_ranges():
    with pytest.raises(BatchSizeError, match="need 1 <= start"):
        tune(lambda b: None, budget=1, start=0)


def test_parse_throughput_takes_the_last_line():
    assert parse_throughput("x\nmucudnn-throughput: 12.5\nmucudnn-throughput: 14\n") == 14.0
    assert parse_throughput("images/s 12") is None


def test_cli_runs_the_script_for_each_candidate(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import sys
        b = int(sys.argv[1])
        if b > 40:
            sys.exit("RuntimeError: CUDA out of memory")
        print("mucudnn-throughput:", b * 3.0)
    """))
    result = CliRunner().invoke(main, ["batch-size", "--memory-budget", "1GiB", "--start", "4",
                                       "--", sys.executable, str(script), "{}"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[-1] == "40"
    assert any("batch 64: no throughput; does not hold (out of memory)" in line for line in lines)
    assert any(line.startswith("mucudnn: batch size 40: 120.0 images/s") for line in lines)


def test_cli_refuses_a_command_without_placeholder():
    result = CliRunner().invoke(main, ["batch-size", "--memory-budget", "1GiB", "--", "true"])
    assert result.exit_code != 0 and "no {}" in result.output
