"""A short seeded run of each libFuzzer harness (README.md here), where clang has -fsanitize=fuzzer.

Every harness is built with AddressSanitizer and UndefinedBehaviorSanitizer and runs 20,000 inputs
from seed 1, starting from the corpora of make_corpus.py: a crash, a sanitizer report or a broken
invariant fails the test. Skipped without clang's fuzzer runtime, make or the cuDNN headers.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import fakebuild
import make_corpus
import pytest

HERE = Path(__file__).resolve().parent

RUNS = ["-runs=20000", "-seed=1"]


def fuzzer_reason(work: Path) -> str | None:
    """Why the harnesses cannot be built here, or None."""
    if shutil.which("clang") is None:
        return "no clang on PATH (the harnesses need -fsanitize=fuzzer)"
    if shutil.which("make") is None:
        return "no make on PATH"
    probe = work / "probe.c"
    probe.write_text("#include <stddef.h>\n#include <stdint.h>\n"
                     "int LLVMFuzzerTestOneInput(const uint8_t *d, size_t n) { (void)d; (void)n; return 0; }\n")
    result = subprocess.run(["clang", "-fsanitize=fuzzer,address,undefined", str(probe), "-o", str(work / "probe")],
                            capture_output=True, text=True)
    if result.returncode != 0:
        return f"clang cannot link -fsanitize=fuzzer,address,undefined: {result.stderr.strip()[:200]}"
    if fakebuild.find_cudnn_include() is None or fakebuild.find_cuda_include() is None:
        return "no cuDNN or CUDA headers (see tests/shim/fakebuild.py)"
    return None


@pytest.fixture(scope="module")
def harnesses(tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    work = tmp_path_factory.mktemp("fuzz")
    reason = fuzzer_reason(work)
    if reason:
        pytest.skip(reason)
    build = work / "build"
    result = subprocess.run(["make", "-C", str(HERE), f"CUDNN_INCLUDE={fakebuild.find_cudnn_include()}",
                             f"CUDA_INCLUDE={fakebuild.find_cuda_include()}", f"OUT={build}"],
                            capture_output=True, text=True)
    if result.returncode != 0:
        pytest.fail(f"building the harnesses failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    return build, make_corpus.write(work / "corpus")


@pytest.mark.parametrize("corpus", sorted(make_corpus.HARNESSES))
def test_a_short_seeded_fuzz_run_finds_nothing(harnesses, corpus, tmp_path):
    build, corpora = harnesses
    assert any(corpora[corpus].iterdir()), f"no seeds for {corpus}"
    harness = build / make_corpus.HARNESSES[corpus]
    result = subprocess.run([str(harness), *RUNS, f"-artifact_prefix={tmp_path}/", str(corpora[corpus])],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{harness.name} failed:\n{result.stderr[-6000:]}"
    assert "Done 20000 runs" in result.stderr, result.stderr[-2000:]
