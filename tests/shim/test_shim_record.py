"""Kernel keys (the Python/C contract, tests/data/keys.txt) and MUCUDNN_RECORD."""

from __future__ import annotations

from pathlib import Path

import pytest

from shim_harness import key_of, parse_fields

KEYS = Path(__file__).resolve().parents[1] / "data" / "keys.txt"


def key_examples() -> list[tuple[str, str]]:
    examples = []
    for line in KEYS.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            fields, _, key = line.partition(" => ")
            examples.append((fields.strip(), key.strip()))
    return examples


def test_keys_file_has_examples_of_every_kind():
    fields = [parse_fields(f) for f, _ in key_examples()]
    for name, values in [("dir", {"fwd", "bwd_data", "bwd_filter"}), ("dt", {"f32", "f64", "f16", "bf16"}),
                         ("layout", {"nchw", "nhwc", "padded"}), ("mode", {"xcorr", "conv"})]:
        assert {f[name] for f in fields} == values


@pytest.mark.parametrize("fields, key", key_examples())
def test_python_builds_the_expected_key(fields, key):
    if key == "-":
        pytest.skip("descriptors without a key have no ConvProblem")
    assert key_of(fields) == key


def test_the_shim_builds_the_expected_keys(shim_env):
    """The contract test: the shim's key from real descriptors == ConvProblem(...).key."""
    examples = key_examples()
    run = shim_env.run([f"op=key {fields}" for fields, _ in examples])
    for (fields, key), result in zip(examples, run.cases):
        assert result.get("key", "-") == key, (fields, result)
        if key == "-":
            assert "nokey" in result


def test_record_appends_each_kernel_and_n_once_and_the_calls_at_exit(shim_env, tmp_path):
    from mucudnn.problem import ConvProblem

    record = tmp_path / "kernels.rec"
    record.write_text("# an earlier process\n")
    conv = "dir=bwd_filter n=4 c=2 in=6x6 k=3 f=3x3 ws=0"
    query = "op=get_v7 dir=fwd n=5 c=2 in=6x6 k=3 f=3x3 layout=nhwc"
    size = "op=ws dir=bwd_data n=2 c=2 in=5x5x5 k=2 f=1x1x1"
    unkeyable = "dir=fwd n=4 c=2 in=6x6 k=3 f=3x3 layout=padded ws=0"
    cases = [conv, query, conv, size, conv.replace("n=4", "n=7"), unkeyable, query]
    for _ in range(2):  # a second process appends to the same file
        run = shim_env.run(cases, env={"MUCUDNN_RECORD": str(record)}, threads=3)
        assert run.returncode == 0 and not run.stderr
    lines = record.read_text().splitlines()
    headers = [line for line in lines[1:] if line.startswith("#")]
    assert len(headers) == 2 and all(h.startswith("# mucudnn-record 1 pid=") for h in headers)
    kernels = [line for line in lines if line.startswith("kernel")]
    expected = {(key_of(c), int(parse_fields(c)["n"])) for c in (conv, query, size, conv.replace("n=4", "n=7"))}
    assert len(kernels) == 2 * len(expected)  # once per process
    recorded = set()
    for line in kernels:
        word, key, n = line.split(" ")
        assert word == "kernel"
        problem = ConvProblem.from_key(key, int(n))
        assert problem.key == key
        recorded.add((key, int(n)))
    assert recorded == expected
    # at exit, each process adds how often each kernel ran: the conv twice at n=4, once at n=7;
    # the queried kernels never ran
    calls = [line.split(" ") for line in lines if line.startswith("calls")]
    assert sorted((key, n, count) for _, key, n, count in calls) == sorted(
        2 * [(key_of(conv), "4", "2"), (key_of(conv), "7", "1")])
    assert len(kernels) + len(calls) + len(headers) + 1 == len(lines)  # nothing else


def test_record_file_that_cannot_be_opened_is_one_error(shim_env, tmp_path):
    case = "dir=fwd n=4 c=2 in=6x6 k=3 f=3x3 ws=0"
    run = shim_env.run([case], env={"MUCUDNN_RECORD": str(tmp_path / "missing" / "x.rec")})
    assert len(run.shim_lines("error")) == 1 and "MUCUDNN_RECORD=" in run.stderr
    assert run.cases[0]["exact"] == "1"


@pytest.mark.parametrize("reader", [False, True])
def test_a_record_file_that_is_a_fifo_is_one_error_and_no_hang(shim_env, tmp_path, reader):
    """Opening a FIFO for writing waits for a reader; the shim must neither wait nor write to one."""
    import os

    fifo = tmp_path / "record.fifo"
    os.mkfifo(fifo)
    reader_fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK) if reader else None
    try:
        case = "dir=fwd n=4 c=2 in=6x6 k=3 f=3x3 ws=0"
        run = shim_env.run([case], env={"MUCUDNN_RECORD": str(fifo)}, timeout=20)
        assert run.shim_lines("error") == [
            f"mucudnn: error: MUCUDNN_RECORD={fifo}: is a FIFO, not a regular file; not recording"]
        assert run.returncode == 0 and run.cases[0]["exact"] == "1"
        if reader_fd is not None:
            assert os.read(reader_fd, 1) == b""  # nothing was written to it
    finally:
        if reader_fd is not None:
            os.close(reader_fd)
