"""Set-up: the pinned cuDNN headers in the user's cache, and scripts/setup.sh's .venv check."""

from __future__ import annotations

import csv
import gzip
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from mucudnn import shimlib, tuner
from mucudnn.errors import MucudnnError

ROOT = Path(__file__).resolve().parent.parent


def fake_wheel(path: Path) -> Path:
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr("nvidia/cudnn/include/cudnn.h", "/* cudnn.h */\n")
        wheel.writestr("nvidia/cudnn/include/cudnn_graph.h", "/* cudnn_graph.h */\n")
        wheel.writestr("nvidia/cudnn/include/sub/other.h", "/* not a top-level header */\n")
        wheel.writestr("nvidia/cudnn/lib/libcudnn.so.9", b"\x7fELF" + b"\0" * 64)
    return path


def test_the_pinned_headers_are_the_shipped_measurements_cudnn():
    name, _, version = shimlib.CUDNN_HEADERS_WHEEL.partition("==")
    major, minor, patch = map(int, version.split(".")[:3])
    with gzip.open(tuner.SHIPPED_MEASUREMENTS, "rt", newline="") as rows:
        shipped = {int(next(csv.DictReader(rows))["cudnn_version"])}
    assert name.startswith("nvidia-cudnn-") and {major * 10000 + minor * 100 + patch} == shipped


def test_unpacked_headers_land_in_the_user_cache_where_the_shim_build_finds_them(tmp_path,
                                                                               monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("MUCUDNN_CUDNN_INCLUDE", raising=False)
    monkeypatch.setattr(shimlib, "_nvidia_wheel_dirs", lambda *parts: [])
    if Path("/usr/include/cudnn.h").exists() or Path("/usr/local/cuda/include/cudnn.h").exists():
        pytest.skip("system cuDNN headers present (found before the cache)")
    with pytest.raises(MucudnnError, match=r"run bash scripts/quickstart\.sh \(it fetches the headers\)"):
        shimlib.find_cudnn_include()
    dest = shimlib.unpack_cudnn_headers(fake_wheel(tmp_path / "w.whl"))
    assert dest == tmp_path / "cache" / "mucudnn" / "cudnn-headers-9.19.0.56" / "include"
    assert sorted(p.name for p in dest.iterdir()) == ["cudnn.h", "cudnn_graph.h"]
    assert shimlib.find_cudnn_include() == dest
    assert [p.name for p in dest.parent.parent.iterdir()] == ["cudnn-headers-9.19.0.56"]


def test_a_wheel_without_cudnn_h_is_one_error(tmp_path):
    with zipfile.ZipFile(tmp_path / "w.whl", "w") as wheel:
        wheel.writestr("nvidia/cudnn/lib/libcudnn.so.9", b"")
    with pytest.raises(MucudnnError, match="no nvidia/cudnn/include/cudnn.h in it"):
        shimlib.unpack_cudnn_headers(tmp_path / "w.whl", tmp_path / "inc")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.whl"]


def ensure_venv(cwd: Path, python: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", f"set -eu; source {ROOT / 'scripts/setup.sh'}; ensure_venv"],
                          cwd=cwd, env={**os.environ, "PYTHON": python}, capture_output=True,
                          text=True, timeout=120)


def fake_python(path: Path, version: str, prefix: str = "/elsewhere") -> str:
    """A 'python' that reports ``version`` and fails the >= 3.11 check below 3.11."""
    old = tuple(map(int, version.split("."))) < (3, 11)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\ncase \"$2\" in *exit*) exit {int(old)};; esac\n"
                    f"echo {version} {prefix}\n")
    path.chmod(0o755)
    return str(path)


def test_a_venv_of_another_python_is_replaced(tmp_path):
    fake_python(tmp_path / ".venv" / "bin" / "python", "3.9")
    (tmp_path / ".venv" / "marker").write_text("old venv")
    result = ensure_venv(tmp_path, sys.executable)
    assert result.returncode == 0, result.stderr
    assert "setup: .venv is Python 3.9 /elsewhere, not" in result.stderr
    assert not (tmp_path / ".venv" / "marker").exists()
    probe = "import sys; print(sys.version_info[:2], sys.base_prefix)"
    made = subprocess.run([tmp_path / ".venv" / "bin" / "python", "-c", probe],
                          capture_output=True, text=True).stdout
    assert made == subprocess.run([sys.executable, "-c", probe], capture_output=True,
                                  text=True).stdout
    # the same Python again: reused as it is
    (tmp_path / ".venv" / "marker").write_text("kept")
    again = ensure_venv(tmp_path, sys.executable)
    assert again.returncode == 0 and again.stderr == "" and (tmp_path / ".venv" / "marker").exists()


def test_a_python_older_than_3_11_is_refused(tmp_path):
    old = fake_python(tmp_path / "bin" / "python3.9", "3.9")
    result = ensure_venv(tmp_path, old)
    assert result.returncode != 0
    assert result.stderr.strip() == f"setup: mucudnn needs Python >= 3.11; {old} is 3.9: set PYTHON to another"
    assert not (tmp_path / ".venv").exists()


def test_missing_headers_are_downloaded_once_pinned_announced_and_cached(tmp_path, monkeypatch):
    """scripts/setup.sh's ensure_cudnn_headers with a .venv whose pip download writes a small
    wheel (and logs what it was asked for) instead of fetching 500 MB."""
    if Path("/usr/include/cudnn.h").exists() or Path("/usr/local/cuda/include/cudnn.h").exists():
        pytest.skip("system cuDNN headers present: nothing to download")
    wheel, log = fake_wheel(tmp_path / "nvidia_cudnn_cu13-9.19.0.56-py3-none-any.whl"), tmp_path / "pip.log"
    python = tmp_path / "repo" / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f"""#!/bin/sh
if [ "$1 $2 $3" = "-m pip download" ]; then
  echo "$@" >>{log}
  while [ $# -gt 1 ]; do [ "$1" = -d ] && cp {wheel} "$2/"; shift; done
  exit 0
fi
exec {sys.executable} "$@"
""")
    python.chmod(0o755)
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "TMPDIR": str(tmp_path),
           "PYTHONPATH": str(ROOT)}
    env.pop("MUCUDNN_CUDNN_INCLUDE", None)
    # a python that sees no nvidia wheel: PyTorch's headers would be found first
    command = f"set -eu; source {ROOT / 'scripts/setup.sh'}; ensure_cudnn_headers"
    if subprocess.run([python, "-c", "import nvidia"], env=env, capture_output=True).returncode == 0:
        pytest.skip("an nvidia wheel is installed here: its headers are found first")
    runs = [subprocess.run(["bash", "-c", command], cwd=python.parent.parent.parent, env=env,
                           capture_output=True, text=True, timeout=60) for _ in range(2)]
    assert [r.returncode for r in runs] == [0, 0], runs[0].stderr + runs[1].stderr
    dest = tmp_path / "cache" / "mucudnn" / "cudnn-headers-9.19.0.56" / "include"
    assert runs[0].stderr.strip() == (f"setup: no cudnn.h found; downloading {shimlib.CUDNN_HEADERS_WHEEL}"
                                      f" (about 500 MB, once) to unpack its headers into {dest}")
    assert runs[1].stderr == ""  # found in the cache: no second download
    [asked] = log.read_text().splitlines()
    assert asked.split()[-1] == "nvidia-cudnn-cu13==9.19.0.56" and "--no-deps" in asked.split()
    assert (dest / "cudnn.h").is_file()
    assert not list(tmp_path.glob("tmp.*")), "the downloaded wheel is deleted"


@pytest.mark.parametrize("wheel, installs", [(None, False),
                                             ("torch-2.12.0+cpu-cp311-none-any.whl", False),
                                             ("torch-2.13.0+cpu-cp311-none-any.whl", True)])
def test_torch_is_installed_only_from_a_local_wheel_file(tmp_path, wheel, installs):
    """scripts/setup.sh's ensure_local_torch: pip installs the wheel file itself, and only when a
    torch-2.13.0 wheel for the venv's Python lies in $PIP_FIND_LINKS (never torch from an index)."""
    links = tmp_path / "wheels"
    links.mkdir()
    if wheel:
        (links / wheel).write_bytes(b"")
    log = tmp_path / "calls.log"
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    # a .venv Python 3.11 without torch that logs its pip calls
    python.write_text(f'#!/bin/sh\ncase "$2" in *version_info*) echo cp311; exit 0;; esac\n'
                      f'[ "$1" = -m ] && echo "$@" >> {log}\nexit 1\n')
    python.chmod(0o755)
    subprocess.run(["bash", "-c", f"source {ROOT}/scripts/setup.sh; ensure_local_torch"],
                   cwd=tmp_path, env={**os.environ, "PIP_FIND_LINKS": str(links)}, check=True,
                   capture_output=True)
    calls = log.read_text() if log.exists() else ""
    assert (f"install -q --disable-pip-version-check {links / wheel}" in calls if wheel else False) == installs
    assert "torch==" not in calls


def quickstart_with_doubles(tmp_path: Path, gpu: bool) -> tuple[subprocess.CompletedProcess, list]:
    """scripts/quickstart.sh in a copy of the scripts, its .venv's python and mucudnn test doubles
    that log each call (pip installs nothing, mucudnn tunes nothing), and an ``nvidia-smi`` that
    lists a GPU (``gpu``) or fails: the calls it made, in order."""
    repo, log = tmp_path / "repo", tmp_path / "calls.log"
    wheel = fake_wheel(tmp_path / "nvidia_cudnn_cu13-9.19.0.56-py3-none-any.whl")
    (repo / "scripts").mkdir(parents=True)
    for name in ("quickstart.sh", "setup.sh"):
        (repo / "scripts" / name).write_text((ROOT / "scripts" / name).read_text())
    bin_dir = repo / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    doubles = {
        # the probe of ensure_venv and the module checks run the real Python; pip only logs; the
        # GPU check answers as the GPU is
        "python": f"""#!/bin/sh
case "$*" in
  *"-m pip download"*)
    while [ $# -gt 1 ]; do [ "$1" = -d ] && cp {wheel} "$2/"; shift; done; exit 0 ;;
  *"-m pip"*) echo "pip $*" >>{log}; exit 0 ;;
  *gpu_available*) exit {0 if gpu else 1} ;;
esac
PYTHONPATH={ROOT} exec {sys.executable} "$@"
""",
        "mucudnn": f"""#!/bin/sh
echo "mucudnn $*" >>{log}
[ "$1" = build-shim ] && echo /cache/libmucudnn.so
exit 0
""",
    }
    for name, text in doubles.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "nvidia-smi").write_text(f"#!/bin/sh\n{'echo GPU 0: NVIDIA H100' if gpu else 'exit 9'}\n")
    (tools / "nvidia-smi").chmod(0o755)
    env = {**os.environ, "PATH": f"{tools}:{os.environ['PATH']}", "PYTHON": sys.executable,
           "XDG_CACHE_HOME": str(tmp_path / "cache")}
    done = subprocess.run(["bash", "scripts/quickstart.sh"], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=120)
    return done, log.read_text().splitlines() if log.exists() else []


@pytest.mark.parametrize("gpu", [False, True])
def test_the_quickstart_leaves_every_readme_command_working(tmp_path, gpu):
    """After `bash scripts/quickstart.sh` the README's next steps work in a new shell: it says to
    activate the venv, the shim is built (`mucudnn run` needs it), and on a GPU machine CuPy is
    installed and the GPU benchmarked before tuning; without a GPU it tunes from the shipped data."""
    done, calls = quickstart_with_doubles(tmp_path, gpu)
    assert done.returncode == 0, done.stdout + done.stderr
    installs = [call for call in calls if call.startswith("pip ")]
    assert len(installs) == 1 and installs[0].endswith("-e .[gpu]" if gpu else "-e .")
    mucudnn_calls = [call.split()[1] for call in calls if call.startswith("mucudnn ")]
    expected = ["build-shim"] + (["bench"] if gpu else []) + ["tune", "show"]
    assert mucudnn_calls == expected
    assert "source .venv/bin/activate" in done.stdout.splitlines()[-1]
