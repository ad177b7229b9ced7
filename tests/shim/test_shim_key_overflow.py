"""Hostile descriptors (a pad of 1.1e9 on 1x1 tensors, dims of 2^30, a filter of INT_MIN) through the
shim's key code: no key (the call passes through to cuDNN) and no undefined behaviour.

key.c runs against tests/fuzz/stub_cudnn.c (descriptor queries answered from a table), built with
-fsanitize=undefined -fno-sanitize-recover where the compiler has it, so a signed overflow aborts.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import descs
import fakebuild
import pytest
from shim_harness import key_of
from test_shim_record import key_examples

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
FUZZ = REPO / "tests" / "fuzz"

UBSAN = ["-fsanitize=undefined", "-fno-sanitize-recover=all"]
BIG = 1 << 30
HOSTILE = {
    # 2 * pad overflows int; y as a caller may set it
    "pad 1.1e9 on 1x1": "n=1 c=1 in=1x1 k=1 f=1x1 pad=1100000000x1100000000 y=1x1x1x1",
    "pad 1.1e9 on 1x1 3-d": "n=1 c=1 in=1x1x1 k=1 f=1x1x1 pad=1100000000x1100000000x1100000000 y=1x1x1x1x1",
    # filter - 1 overflows int
    "filter INT_MIN": "n=1 c=1 in=4x4 k=1 f=-2147483648x1 y=1x1x4x4",
    # C/groups x groups overflows int
    "filter channels x groups": "n=1 c=4 in=3x3 k=4 g=4 w=4x1073741824x1x1",
    # the packed strides of x and y overflow 64 bits
    "dims of 2^30": f"n={BIG} c={BIG} in={BIG}x{BIG} k=1 f=1x1 w=1x{BIG}x1x1",
    "dims of 2^30 nhwc": f"n={BIG} c={BIG} in={BIG}x{BIG} k=1 f=1x1 w=1x{BIG}x1x1 layout=nhwc",
    "dims of 2^30 3-d": f"n={BIG} c={BIG} in={BIG}x{BIG}x{BIG} k=1 f=1x1x1 w=1x{BIG}x1x1x1",
}


@pytest.fixture(scope="module")
def key_cases(tmp_path_factory) -> tuple[Path, bool]:
    """key_cases built from key.c and the stub; with UBSan when the compiler links it."""
    from mucudnn.shimlib import find_compiler

    reason = fakebuild.missing_prerequisite()
    if reason:
        pytest.skip(reason)
    out = tmp_path_factory.mktemp("keycases") / "key_cases"
    command = [find_compiler(), "-std=c11", "-D_GNU_SOURCE", "-O1", "-g", "-Wall", "-Wextra", "-Werror",
               f"-I{REPO / 'shim' / 'include'}", f"-I{REPO / 'shim' / 'src'}", f"-I{FUZZ}",
               f"-I{fakebuild.find_cudnn_include()}", f"-I{fakebuild.find_cuda_include()}",
               str(REPO / "shim" / "src" / "key.c"), str(FUZZ / "stub_cudnn.c"), str(FUZZ / "key_cases.c"),
               "-o", str(out)]
    if subprocess.run(command[:1] + UBSAN + command[1:], capture_output=True).returncode == 0:
        return out, True
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        pytest.fail(f"building key_cases failed:\n$ {' '.join(command)}\n{result.stderr}")
    return out, False


def run_cases(program: Path, cases: list[str]) -> list[str]:
    result = subprocess.run([str(program)], input="".join(descs.as_line(descs.encode(c)) + "\n" for c in cases),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and not result.stderr, result.stderr  # UBSan reports on stderr
    lines = result.stdout.splitlines()
    assert len(lines) == len(cases)
    return lines


def test_the_stub_gives_the_keys_of_keys_txt(key_cases):
    """The harness is faithful: keys.txt's contract holds through the stub too."""
    examples = key_examples()
    for (fields, key), line in zip(examples, run_cases(key_cases[0], [f for f, _ in examples])):
        assert line.startswith(f"key={key} n=") if key != "-" else line.startswith("nokey="), (fields, line)


@pytest.mark.parametrize("fields", HOSTILE.values(), ids=HOSTILE.keys())
def test_hostile_geometry_gets_no_key_and_no_undefined_behaviour(key_cases, fields):
    program, sanitized = key_cases
    [line] = run_cases(program, [f"dir={d} {fields}" for d in ("fwd",)])
    assert line.startswith("nokey="), line
    if not sanitized:
        pytest.skip("no -fsanitize=undefined here: only the result was checked")


def test_huge_but_consistent_geometry_keys_like_python(key_cases):
    """A pad of 1.1e9 with a stride to match is a real convolution, not an overflow."""
    case = "n=1 c=1 in=1x1 k=1 f=1x1 pad=1100000000x1100000000 stride=1100000000x1100000000"
    [line] = run_cases(key_cases[0], [case])
    assert line == f"key={key_of(case)} n=1"
