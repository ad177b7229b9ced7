"""The two plan readers agree: mucudnn/plan.py and the shim's shim/src/plan.c (through
tests/shim/drivers/plan_driver.c) accept the same files with the same entries and refuse the
others on the same line (docs/plan-format.md).

Mutants of the example plans (tests/data/plans) are made from a fixed seed: byte flips, tricky
tokens inserted or put in place of numbers and key values (``0x10``, ``1_0``, ``²``, NBSP, CR,
NUL, numbers at and past 2^31, 2^63 and 2^64, a 5000-digit number, invalid UTF-8), lines
duplicated, removed or swapped. ``MUCUDNN_PLAN_MUTANTS`` sets how many (default 3000) and
``MUCUDNN_PLAN_SEED`` the seed, for a long run::

    MUCUDNN_PLAN_MUTANTS=200000 MUCUDNN_PLAN_SEED=7 pytest -q tests/test_plan_differential.py
"""

from __future__ import annotations

import os
import random
import re
import subprocess
from pathlib import Path

import fakebuild
import pytest

from mucudnn.engines import Api, api_of, format_engine_name, parse_engine_name
from mucudnn.errors import PlanError
from mucudnn.plan import MAX_PLAN_BYTES, read_plan

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PLAN_DIR = HERE / "data" / "plans"
DRIVERS = HERE / "shim" / "drivers"

MUTANTS = int(os.environ.get("MUCUDNN_PLAN_MUTANTS", "3000"))
SEED = int(os.environ.get("MUCUDNN_PLAN_SEED", "20261123"))
BATCH = 400  # files per driver run


@pytest.fixture(scope="session")
def plan_driver(tmp_path_factory) -> Path:
    """plan_driver built from plan.c and key.c, as the shim's own build compiles them."""
    from mucudnn.shimlib import find_compiler

    reason = fakebuild.missing_prerequisite()
    if reason:
        pytest.skip(reason)
    output = tmp_path_factory.mktemp("plan_driver") / "plan_driver"
    command = [find_compiler(), "-std=c11", "-D_GNU_SOURCE", "-O1", "-Wall", "-Wextra", "-Werror",
               f"-I{REPO / 'shim' / 'include'}", f"-I{REPO / 'shim' / 'src'}",
               f"-I{fakebuild.find_cudnn_include()}", f"-I{fakebuild.find_cuda_include()}",
               str(DRIVERS / "plan_driver.c"), str(REPO / "shim" / "src" / "plan.c"),
               str(REPO / "shim" / "src" / "key.c"), "-o", str(output), "-lm"]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        pytest.fail(f"building plan_driver failed:\n$ {' '.join(command)}\n{result.stderr}")
    return output


# -- both readers' verdicts, in one form -----------------------------------------------------------

def dump_c(driver: Path, paths: list[Path]) -> dict[str, list[str]]:
    """What plan.c makes of each file: ``["accept", header and kernel lines...]`` or
    ``["reject LINE"]`` (the error's message is left out: only the verdict and line must agree)."""
    result = subprocess.run([str(driver), *map(str, paths)], capture_output=True, timeout=120)
    assert result.returncode == 0, result.stderr.decode(errors="replace")
    dumps: dict[str, list[str]] = {}
    current: list[str] = []
    for line in result.stdout.decode("utf-8").split("\n")[:-1]:
        if line.startswith("file "):
            current = dumps.setdefault(line[5:], [])
        elif not line.startswith("error "):
            current.append(line)
    return dumps


def dump_python(path: Path) -> list[str]:
    """What mucudnn.plan makes of a file, as plan_driver prints it. Anything but PlanError fails."""
    try:
        plan = read_plan(path)
    except PlanError as exc:
        match = re.match(re.escape(str(path)) + r":(\d+): ", str(exc))
        assert match, f"message does not start with PATH:LINE: {exc}"
        assert "\n" not in str(exc)
        return [f"reject {match.group(1)}"]
    lines = ["accept", f"gpu {plan.gpu}", f"cudnn {plan.cudnn}", f"strategy {plan.strategy}",
             f"limit {plan.limit}", f"policy {plan.policy}"]
    for entry in plan:
        pieces = "".join(
            f" {p.batch}:"
            + (format_engine_name(parse_engine_name(p.algo)) if api_of(p.algo) is Api.GRAPH else p.algo)
            + f":{p.math.value}" + (":out" if p.borrow else "")
            for p in entry.pieces)
        lines.append(f"kernel {entry.key} {entry.n} {entry.workspace} "
                     f"{format(entry.time_ms, '.17g')}{pieces}")
    return lines


def compare(driver: Path, paths: list[Path]) -> tuple[int, list[str]]:
    """(how many both accept, the disagreements described)."""
    c_dumps = dump_c(driver, paths)
    accepted, differences = 0, []
    for path in paths:
        python, c = dump_python(path), c_dumps.get(str(path))
        if python != c:
            differences.append(f"{path.name}: python {python[:1]}... C {(c or ['none'])[:1]}...; "
                               f"first difference: "
                               + next((f"python {a!r} / C {b!r}" for a, b in zip(python, c or [])
                                       if a != b), f"{len(python)} vs {len(c or [])} lines"))
        accepted += python[0] == "accept"
    return accepted, differences


# -- mutants ---------------------------------------------------------------------------------------

TRICKY = [
    "0x10", "1_0", "²", "١٢", "+1", "-1", "-0", "00", "01", "0", "1", "2147483647", "2147483648",
    "4294967296", "9223372036854775807", "9223372036854775808", "-9223372036854775808",
    "-9223372036854775809", "18446744073709551615", "18446744073709551616", "9" * 5000,
    "1e308", "1e309", "1e-400", "1.5e-1", "1E+3", ".5", "5.", "1.", "inf", "nan", "1e", "1e+",
    "\u00a0", "\u2003", "\u3000", "\ufeff", "\x85", "\r", "\r\n", "\x00", "\x0b", "\x0c", "\x1c",
    "\x7f", "\t", " ", "  ", "#", ":", ":out", ":in", ",", "x", "=", "eng", "eng0", ".k3=1",
    ".k3=-1", ".k-1=0", "é", "\U0001f600",
]
TRICKY_BYTES = [b"\xff", b"\xc0\x80", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xe2\x82", b"\x80"]
KEY_VALUES = ["f32", "f64", "f16", "bf16", "xx", "abc", "0", "1", "2", "3", "7", "-1", "1x1",
              "3x3", "0x0", "1x1x1", "2147483647", "2147483648", "7x7", "fma", "default",
              "nchw", "nhwc", "fwd", "bwd_data", "bwd_filter", "xcorr", "conv", "", "1x", "x1"]
NUMBER = re.compile(rb"[0-9]{1,40}")
KEY_FIELD = re.compile(rb"(?<=[=,])[^,= \t\n]*(?=[, \t\n])")


def mutate(data: bytes, rng: random.Random) -> bytes:
    """One to three random edits of a plan's bytes."""
    for _ in range(rng.choice((1, 1, 2, 3))):
        lines = data.split(b"\n")
        kind = rng.randrange(10)
        if kind == 0 and data:  # change one byte
            i = rng.randrange(len(data))
            data = data[:i] + bytes([rng.randrange(256)]) + data[i + 1:]
        elif kind == 1:  # insert a tricky token anywhere
            token = (rng.choice(TRICKY).encode() if rng.random() < 0.8
                     else rng.choice(TRICKY_BYTES))
            i = rng.randrange(len(data) + 1)
            data = data[:i] + token + data[i:]
        elif kind in (2, 3):  # a number becomes a tricky one
            numbers = list(NUMBER.finditer(data))
            if numbers:
                m = rng.choice(numbers)
                token = rng.choice(TRICKY).encode() if rng.random() < 0.7 else \
                    str(int(m.group()) + rng.choice((-1, 1, 2, 7))).encode()
                data = data[:m.start()] + token + data[m.end():]
        elif kind == 4:  # a key value (or any =/,-delimited value) becomes another
            fields = list(KEY_FIELD.finditer(data))
            if fields:
                m = rng.choice(fields)
                data = data[:m.start()] + rng.choice(KEY_VALUES).encode() + data[m.end():]
        elif kind == 5:  # duplicate a line
            i = rng.randrange(len(lines))
            lines.insert(rng.randrange(len(lines) + 1), lines[i])
            data = b"\n".join(lines)
        elif kind == 6 and len(lines) > 1:  # remove a line
            del lines[rng.randrange(len(lines))]
            data = b"\n".join(lines)
        elif kind == 7 and len(lines) > 1:  # swap two lines
            i, j = rng.randrange(len(lines)), rng.randrange(len(lines))
            lines[i], lines[j] = lines[j], lines[i]
            data = b"\n".join(lines)
        elif kind == 8:  # a blank becomes another blank or a look-alike
            blanks = [m.start() for m in re.finditer(rb"[ \t]", data)]
            if blanks:
                i = rng.choice(blanks)
                token = rng.choice([b"\t", b"  ", b" \t", "\u00a0".encode(), b"\x0b", b"\r", b""])
                data = data[:i] + token + data[i + 1:]
        elif kind == 9:  # line ends: CRLF, none at the end, or cut short
            choice = rng.randrange(3)
            if choice == 0:
                data = data.replace(b"\n", b"\r\n", rng.randint(1, 50))
            elif choice == 1:
                data = data.rstrip(b"\n")
            else:
                data = data[:rng.randrange(len(data) + 1)]
    return data


def mutants(count: int, seed: int) -> list[tuple[str, bytes]]:
    bases = [(p.name, p.read_bytes()) for p in sorted(PLAN_DIR.glob("*.plan"))]
    # Mostly the valid examples, so that many mutants are accepted and their entries compared.
    weights = [1 if name.startswith("invalid_") else 6 for name, _ in bases]
    rng = random.Random(seed)
    out = []
    for i in range(count):
        name, data = rng.choices(bases, weights)[0]
        out.append((f"m{i:06d}-{name}", mutate(data, rng)))
    return out


def test_the_readers_agree_on_the_examples(plan_driver):
    paths = sorted(PLAN_DIR.glob("*.plan"))
    accepted, differences = compare(plan_driver, paths)
    assert not differences, "\n".join(differences)
    assert accepted == len([p for p in paths if not p.name.startswith("invalid_")])


def test_both_readers_accept_the_shared_key_examples(plan_driver, tmp_path):
    """Every key of tests/data/keys.txt (what Python and the shim build) reads in a plan."""
    keys = [line.split(" => ")[1] for line in (HERE / "data" / "keys.txt").read_text().splitlines()
            if " => " in line and not line.startswith("#") and not line.endswith(" => -")]
    path = tmp_path / "keys.plan"
    path.write_text("mucudnn-plan 1\ngpu g\ncudnn 1\nstrategy wr\nlimit 0\npolicy all\n" + "".join(
        f"kernel {key} 2 0 0 2:{'gemm' if key.startswith('dir=fwd') else 'algo_0'}:fma\n"
        for key in keys))
    python = dump_python(path)
    assert dump_c(plan_driver, [path])[str(path)] == python
    assert python[0] == "accept" and len(python) == 6 + len(keys) > 6


def test_the_readers_agree_on_seeded_mutants(plan_driver, tmp_path):
    cases = mutants(MUTANTS, SEED)
    accepted, differences = 0, []
    for start in range(0, len(cases), BATCH):
        paths = []
        for name, data in cases[start:start + BATCH]:
            path = tmp_path / name
            path.write_bytes(data)
            paths.append(path)
        got, diff = compare(plan_driver, paths)
        accepted += got
        differences += diff
        for path in paths:
            if not any(d.startswith(path.name + ":") for d in diff):
                path.unlink()  # keep only the files that disagree, for a look
    assert not differences, (f"{len(differences)} of {len(cases)} mutants (seed {SEED}) disagree, "
                             f"kept in {tmp_path}:\n" + "\n".join(differences[:20]))
    # Not a vacuous comparison: both verdicts are well represented.
    assert 0.05 * len(cases) < accepted < 0.95 * len(cases), accepted


# Single cases the issue named, each with the verdict the grammar gives (and both readers agree).
VALID = (PLAN_DIR / "valid_basic.plan").read_bytes()
KEY = rb"dir=fwd,dt=f32,ct=f32,math=fma,layout=nchw,c=4,in=7x7,k=6,f=3x3,pad=1x1,stride=1x1,dil=1x1,g=2,mode=xcorr"
SINGLE_CASES = {
    "nul_before_the_kernels": (VALID.replace(b"policy powerOfTwo\n", b"policy powerOfTwo\n\x00"), False),
    "dt_xx": (VALID.replace(b"dt=f32", b"dt=xx", 1), False),
    "c_abc": (VALID.replace(b",c=4,", b",c=abc,", 1), False),
    "cudnn_0": (VALID.replace(b"cudnn 91900", b"cudnn 0"), False),
    "n_past_int32": (VALID.replace(KEY + b" 8 ", KEY + b" 2147483648 ", 1), False),
    "limit_past_uint64": (VALID.replace(b"limit 67108864", b"limit 18446744073709551616"), False),
    "limit_uint64_max": (VALID.replace(b"limit 67108864", b"limit 18446744073709551615"), True),
    "superscript_digit": (VALID.replace(b"cudnn 91900", "cudnn 9190²".encode()), False),
    "arabic_digits": (VALID.replace(b"limit 67108864", "limit ١٢".encode()), False),
    "hex_time": (VALID.replace(b" 0.5 ", b" 0x10 ", 1), False),
    "underscore_time": (VALID.replace(b" 0.5 ", b" 1_0 ", 1), False),
    "exponent_time": (VALID.replace(b" 0.5 ", b" 1.5e-1 ", 1), True),
    "crlf": (VALID.replace(b"\n", b"\r\n"), False),
    "nbsp_blank": (VALID.replace(b"policy powerOfTwo", "policy\u00a0powerOfTwo".encode()), False),
    "nbsp_after_key": (VALID.replace(KEY + b" ", KEY + "\u00a0 ".encode(), 1), False),
    "nbsp_in_gpu": (VALID.replace(b"gpu mucudnn fake GPU", "gpu mucudnn\u00a0fake GPU".encode()), True),
    "invalid_utf8_in_comment": (b"# \xff\n" + VALID, False),
    "long_engine_number": (VALID.replace(b"2:implicit_gemm:", b"2:eng" + b"9" * 5000 + b":"), False),
    "key_past_int32": (VALID.replace(b"in=7x7", b"in=7x2147483648", 1), False),
    "empty_output": (VALID.replace(b"in=7x7,k=6,f=3x3,pad=1x1", b"in=1x7,k=6,f=3x3,pad=0x1"), False),
}


@pytest.mark.parametrize("name", SINGLE_CASES)
def test_named_cases_get_the_documented_verdict_from_both(plan_driver, tmp_path, name):
    data, accept = SINGLE_CASES[name]
    assert data != VALID, "the case must change the example"
    path = tmp_path / f"{name}.plan"
    path.write_bytes(data)
    python = dump_python(path)
    assert dump_c(plan_driver, [path])[str(path)] == python
    assert (python[0] == "accept") is accept, python


# -- what is not a plan file: both refuse it at once, on line 0 -----------------------------------

def plan_of_size(size: int) -> bytes:
    head = b"mucudnn-plan 1\ngpu g\ncudnn 1\nstrategy wr\nlimit 0\npolicy all\n#"
    return head + b"x" * (size - len(head) - 1) + b"\n"


def test_not_a_regular_file_or_too_large_is_refused_by_both(plan_driver, tmp_path):
    fifo = tmp_path / "fifo.plan"
    os.mkfifo(fifo)
    largest, too_large = tmp_path / "largest.plan", tmp_path / "too_large.plan"
    largest.write_bytes(plan_of_size(MAX_PLAN_BYTES))
    too_large.write_bytes(plan_of_size(MAX_PLAN_BYTES + 1))
    paths = [fifo, Path("/dev/zero"), tmp_path, too_large, largest]
    c = dump_c(plan_driver, paths)  # its timeout turns a hang into a failure
    for path in paths[:-1]:
        assert c[str(path)] == ["reject 0"], path
        with pytest.raises(PlanError, match=rf"^{re.escape(str(path))}:0: "):
            read_plan(path)
    assert c[str(largest)] == dump_python(largest) == [
        "accept", "gpu g", "cudnn 1", "strategy wr", "limit 0", "policy all"]


def test_the_shim_given_a_fifo_as_plan_says_so_and_passes_through(shim_env, tmp_path):
    fifo = tmp_path / "plan.fifo"
    os.mkfifo(fifo)
    case = "dir=fwd n=8 c=4 in=7x7 k=6 f=3x3 pad=1x1 g=2 ws=65536 algo=0"
    run = shim_env.run([case], plan=fifo, timeout=60)  # a blocking open would hang here
    assert run.returncode == 0, run.stderr
    assert run.shim_lines("error") == [
        f"mucudnn: error: {fifo}:0: plan file is not a regular file; passing every call through"]
    assert [c["n"] for c in run.conv_calls()] == ["8", "8"]  # undivided, then the reference
