"""Benchmarking spread over several GPUs (mucudnn/multigpu.py): workers against the cuDNN test
double with several fake GPUs (tests/fakecupy's $FAKE_CUPY_GPUS), sharing one store."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mucudnn.errors import MucudnnError
from mucudnn.multigpu import Gpu, select_gpus, split_kernels
from mucudnn.problem import ConvProblem, Direction, MathType

ROOT = Path(__file__).resolve().parents[1]
SMALL = dict(c=4, input_size=(7, 7), k=6, filter_size=(3, 3), padding=(1, 1), stride=(1, 1),
             dilation=(1, 1), groups=2, n=8)
#: Six kernels of the double, cheap enough to measure in a test.
KERNELS = [ConvProblem(direction, math=MathType.FMA, **{**SMALL, "k": k})
           for direction in (Direction.FORWARD, Direction.BACKWARD_DATA) for k in (2, 4, 6)]


def identities(store: Path) -> set[tuple]:
    """What a measurement is, whoever took it: (gpu, key, batch, algo, math, status, workspace)."""
    with sqlite3.connect(store) as db:
        return set(db.execute("SELECT gpu, key, batch, algo, math, status, workspace "
                              "FROM measurements"))


@pytest.fixture(scope="module")
def fake_env(tmp_path_factory):
    """The environment of a process whose CuPy is the fake one and whose cuDNN is the double."""
    from test_graph_fake import WITH_FAKE_CUPY, fake_cudnn_or_skip
    fake = fake_cudnn_or_skip(tmp_path_factory.mktemp("fake_cudnn"))
    return {**os.environ, "MUCUDNN_CUDNN_LIBRARY": str(fake),
            "LD_LIBRARY_PATH": str(fake.parent), "PYTHONPATH": WITH_FAKE_CUPY}


def bench(env: dict, store: Path, gpus: str, fake_gpus: str, extra_path: str = "") -> \
        subprocess.CompletedProcess:
    """`mucudnn bench --recording` of KERNELS with ``FAKE_CUPY_GPUS=fake_gpus``."""
    recording = store.with_suffix(".record")
    recording.write_text("".join(f"kernel {p.key} {p.n}\n" for p in KERNELS))
    environment = {**env, "FAKE_CUPY_GPUS": fake_gpus}
    if extra_path:
        environment["PYTHONPATH"] = extra_path + os.pathsep + environment["PYTHONPATH"]
    return subprocess.run([sys.executable, "-m", "mucudnn", "bench", "--recording", str(recording),
                           "--api", "legacy", "--gpus", gpus, "--no-progress",
                           "--store", str(store)], env=environment, capture_output=True,
                          text=True, timeout=600)


def test_gpus_are_chosen_by_number_and_a_missing_one_is_refused():
    gpus = [Gpu(0, "3", "A"), Gpu(1, "5", "B")]
    assert select_gpus("all", gpus) == gpus and select_gpus(None, gpus) == gpus
    assert select_gpus("1", gpus) == [gpus[1]]
    for spec, error in [("2", "no GPU 2 here (2 visible: 0, 1)"), ("0,0", "name each GPU once"),
                        ("x", "expected 'all' or GPU numbers")]:
        with pytest.raises(MucudnnError, match=error.replace("(", r"\(").replace(")", r"\)")):
            select_gpus(spec, gpus)


def test_kernels_are_split_each_to_one_worker_greatest_cost_first():
    costs = [(KERNELS[i], cost) for i, cost in enumerate([1, 5, 2, 2, 4, 1])]
    shares = split_kernels(costs, 2)
    assert sorted(p.key for share in shares for p in share) == sorted(p.key for p in KERNELS)
    loads = [sum(dict((p.key, c) for p, c in costs)[p.key] for p in share) for share in shares]
    assert sorted(loads) == [7, 8]  # 5+2+1 / 4+2+1 (greedy), not a lopsided split
    # equal costs: round-robin
    equal = split_kernels([(p, 1.0) for p in KERNELS], 3)
    assert [[KERNELS.index(p) for p in share] for share in equal] == [[0, 3], [1, 4], [2, 5]]


def test_several_gpus_measure_each_kernel_once_into_the_store_one_process_fills(fake_env,
                                                                                 tmp_path):
    alone = bench(fake_env, tmp_path / "alone.sqlite", "0", "host stand-in")
    assert alone.returncode == 0, alone.stderr
    spread = bench(fake_env, tmp_path / "spread.sqlite", "all", ",".join(["host stand-in"] * 3))
    assert spread.returncode == 0, spread.stderr
    assert "measuring on 3 GPUs, kernels each: GPU 0 (host stand-in): 2, GPU 1 (host stand-in): " \
           "2, GPU 2 (host stand-in): 2" in spread.stderr
    assert identities(tmp_path / "spread.sqlite") == identities(tmp_path / "alone.sqlite")
    # each kernel measured exactly once: as many sizes timed as one process timed
    timed = [line for line in (alone.stdout, spread.stdout)]
    assert timed[0].split("measured")[1] == timed[1].split("measured")[1], timed
    assert "measured 24 kernel sizes" in timed[0]  # 6 kernels x sizes 1, 2, 4, 8
    # again: all reused, no worker started
    again = bench(fake_env, tmp_path / "spread.sqlite", "all", ",".join(["host stand-in"] * 3))
    assert again.returncode == 0 and "measured 0 kernel sizes" in again.stdout, again.stderr
    assert "measuring on" not in again.stderr


def test_a_mixed_node_measures_every_kernel_on_each_gpu_model(fake_env, tmp_path):
    store = tmp_path / "mixed.sqlite"
    done = bench(fake_env, store, "all", "model A,model B,model A")
    assert done.returncode == 0, done.stderr
    assert "GPU 0 (model A): 3, GPU 2 (model A): 3, GPU 1 (model B): 6" in done.stderr
    rows = identities(store)
    by_gpu = {gpu: {row[1:] for row in rows if row[0] == gpu} for gpu in ("model A", "model B")}
    assert by_gpu["model A"] == by_gpu["model B"]
    assert {row[1] for row in rows} == {p.key for p in KERNELS}


KILLER = '''
import os, signal
if os.environ.get("CUDA_VISIBLE_DEVICES") == "1":
    from mucudnn import store
    writes = [0]

    def put_rows(self, rows):
        values = [store._row_values(row) for row in rows]
        writes[0] += 1
        with self._transaction() as cursor:
            cursor.executemany(store._UPSERT, values)
            if writes[0] == 2:  # the second kernel's rows written, not committed
                os.kill(os.getpid(), signal.SIGKILL)
        return len(values)

    store.SQLiteStore.put_rows = put_rows
'''


def test_a_worker_killed_mid_write_loses_its_kernel_only_and_the_bench_fails_in_one_line(
        fake_env, tmp_path):
    killer = tmp_path / "killer"
    killer.mkdir()
    (killer / "sitecustomize.py").write_text(textwrap.dedent(KILLER))
    store = tmp_path / "killed.sqlite"
    done = bench(fake_env, store, "0,1", "host stand-in,host stand-in", extra_path=str(killer))
    assert done.returncode == 2, (done.stdout, done.stderr)
    errors = [line for line in done.stderr.splitlines() if line.startswith("mucudnn: error:")]
    assert errors == ["mucudnn: error: benchmarking failed on 1 of 2 GPUs: GPU 1 (host stand-in) "
                      "killed by SIGKILL after storing 1 of 3 kernels; the kernels stored are "
                      "kept, run bench again to measure the others"], done.stderr
    assert "Traceback" not in done.stderr
    with sqlite3.connect(store) as db:
        assert db.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    measured = {row[1] for row in identities(store)}
    # GPU 0's three kernels and GPU 1's first; GPU 1's second rolled back, its third never begun
    assert len(measured) == 4
    # bench again measures the other two, on one GPU, into the same store
    again = bench(fake_env, store, "0", "host stand-in")
    assert again.returncode == 0 and "measured 8 kernel sizes" in again.stdout, again.stderr
    assert {row[1] for row in identities(store)} == {p.key for p in KERNELS}


# -- the parent's reading of its workers' events ---------------------------------------------------

def scripted_workers(monkeypatch, script: str) -> None:
    """Every worker :func:`benchmark_on_gpus` starts runs ``script`` (python -c) instead."""
    from mucudnn import multigpu
    popen = subprocess.Popen

    def start(args, **kwargs):
        return popen([sys.executable, "-c", textwrap.dedent(script)], **kwargs)

    monkeypatch.setattr(multigpu.subprocess, "Popen", start)


def spread_one_kernel(progress: bool):
    from mucudnn.multigpu import benchmark_on_gpus
    return benchmark_on_gpus([Gpu(0, "0", "model A")], lambda name: [(KERNELS[0], 1.0)],
                             {"store": "unused"}, progress=progress)


def test_the_progress_display_of_several_workers_shows_their_sizes(monkeypatch, capsys):
    scripted_workers(monkeypatch, """
        import sys
        for event in ("todo 3", "size 1", "size 2", "size 4", "timed 3"):
            print("mucudnn-bench-event " + event, flush=True)
    """)
    assert spread_one_kernel(progress=True).timed == 3
    assert "3/3" in capsys.readouterr().err


def test_events_are_taken_as_they_come_whole_lines_or_not(monkeypatch, tmp_path):
    """A worker's events reach the display while it runs: two lines in one write, or another
    worker's unfinished line of its own output (block-buffered), do not hold them back. Each
    worker waits, while running, for the display to have counted the size one of them did."""
    from mucudnn import bench as bench_module
    seen = tmp_path / "seen"

    class Bar:
        total = None

        def update(self, n):
            seen.touch()

        def refresh(self):
            pass

        def close(self):
            pass

    monkeypatch.setattr(bench_module, "_progress", lambda total, enabled: Bar())
    scripted_workers(monkeypatch, f"""
        import os, sys, time
        def wait_seen():
            deadline = time.monotonic() + 5
            while not os.path.exists({str(seen)!r}):
                if time.monotonic() > deadline:
                    sys.exit(3)  # the parent did not take the event while the workers ran
                time.sleep(0.02)
        event = "mucudnn-bench-event "
        if os.environ["CUDA_VISIBLE_DEVICES"] == "0":
            os.write(1, b"the worker's own output, not yet a whole line")
            wait_seen()
            os.write(1, (" ended\\n" + event + "timed 0\\n").encode())
        else:
            os.write(1, (event + "todo 1\\n" + event + "size 1\\n").encode())
            wait_seen()
            os.write(1, (event + "timed 1\\n").encode())
    """)
    from mucudnn.multigpu import benchmark_on_gpus
    result = benchmark_on_gpus([Gpu(0, "0", "model A"), Gpu(1, "1", "model A")],
                               lambda name: [(KERNELS[0], 1.0), (KERNELS[1], 1.0)],
                               {"store": "unused"}, progress=False)
    assert result.timed == 1
