"""The SQLite benchmark store: contents, CSV exchange, file checks and several processes at once."""

from __future__ import annotations

import dataclasses
import datetime
import io
import math
import multiprocessing
import multiprocessing.synchronize
import os
import pathlib
import pickle
import shutil
import sqlite3
import time

import pytest

from mucudnn.errors import ReadOnlyStoreError, SchemaVersionError, StoreError
from mucudnn.measurement import Measurement, Status
from mucudnn.problem import ConvProblem, Direction, MathType
from mucudnn.store import (
    SCHEMA_VERSION, SQLiteStore, StoredMeasurement, default_store_path, open_store,
)

GPU = "NVIDIA H200"
CUDNN = 91900
KEY = ConvProblem(Direction.FORWARD, c=64, input_size=(56, 56), k=64, filter_size=(3, 3),
                  padding=(1, 1), stride=(1, 1), dilation=(1, 1)).key
WHEN = datetime.datetime(2026, 5, 9, 7, 35, 25, 123456, tzinfo=datetime.UTC)


def measurement(batch: int, algo: str = "implicit_gemm", math_type: MathType = MathType.FMA,
                time_ms: float = 1.25, workspace: int = 0, key: str = KEY,
                status: Status = Status.OK, note: str = "") -> Measurement:
    return Measurement(key=key, batch=batch, algo=algo, math=math_type, time_ms=time_ms,
                       workspace=workspace, status=status, note=note)


def comparable(row: StoredMeasurement | Measurement) -> tuple:
    """The fields of a row with NaN made equal to itself, for ==."""
    def flatten(value):
        if dataclasses.is_dataclass(value):
            return tuple(flatten(getattr(value, f.name)) for f in dataclasses.fields(value))
        return "NaN" if isinstance(value, float) and math.isnan(value) else value
    return flatten(row)


@pytest.fixture
def store_path(tmp_path: pathlib.Path) -> pathlib.Path:
    return tmp_path / "benchmarks.sqlite"


@pytest.fixture
def store(store_path: pathlib.Path):
    with SQLiteStore(store_path) as opened:
        yield opened


# OK and failed rows, in the store's order (batch, algo, math).
MIXED = [
    measurement(64, "fft", MathType.TENSOR_OP, 2.0000000000000004, 1 << 33),
    measurement(64, "implicit_precomp_gemm", MathType.FMA, 3.5, 50331648),
    measurement(64, "winograd", status=Status.NOT_SUPPORTED, time_ms=math.inf, workspace=0,
                note="CUDNN_STATUS_NOT_SUPPORTED (3000)"),
    measurement(128, "gemm", status=Status.FAILED, time_ms=math.nan, workspace=-1,
                note='out of memory, "quoted", ünïcode\nsecond line'),
]


# -- contents -----------------------------------------------------------------------------------
def test_round_trip_keeps_every_field_across_reopening(store_path):
    with SQLiteStore(store_path) as store:
        assert store.put(GPU, CUDNN, MIXED, repetitions=7, measured_at=WHEN) == len(MIXED)
    with SQLiteStore(store_path, readonly=True) as store:
        rows = store.rows()
        got = store.get(GPU, CUDNN, KEY)
    expected = [StoredMeasurement(GPU, CUDNN, m, WHEN, 7) for m in MIXED]
    assert list(map(comparable, rows)) == list(map(comparable, expected))
    assert list(map(comparable, got)) == list(map(comparable, MIXED))
    assert all(r.measured_at.tzinfo is not None for r in rows)


def test_put_defaults_to_now_and_unknown_repetitions(store):
    before = datetime.datetime.now(datetime.UTC)
    store.put(GPU, CUDNN, [measurement(1)])
    (row,) = store.rows()
    assert row.repetitions is None
    assert before <= row.measured_at <= datetime.datetime.now(datetime.UTC)


def test_put_replaces_a_row_with_the_same_identity(store):
    store.put(GPU, CUDNN, [measurement(32, time_ms=9.0, workspace=10)], repetitions=3)
    remeasured = measurement(32, time_ms=4.5, workspace=20, status=Status.FAILED, note="again")
    store.put(GPU, CUDNN, [remeasured], repetitions=11, measured_at=WHEN)
    assert store.get(GPU, CUDNN, KEY) == [remeasured]
    assert [(r.repetitions, r.measured_at) for r in store.rows()] == [(11, WHEN)]
    assert store.environments() == [(GPU, CUDNN, 1)]


@pytest.mark.parametrize("field, other", [
    ("gpu", "NVIDIA H100"), ("cudnn_version", 90100), ("key", KEY.replace("k=64", "k=128")),
    ("batch", 33), ("algo", "gemm"), ("math", MathType.TENSOR_OP),
])
def test_rows_differing_in_any_identity_field_are_kept_apart(store, field, other):
    base = dict(gpu=GPU, cudnn_version=CUDNN, key=KEY, batch=32, algo="implicit_gemm",
                math=MathType.FMA)
    for values, time_ms in ((base, 1.0), ({**base, field: other}, 2.0)):
        store.put(values["gpu"], values["cudnn_version"], [measurement(
            values["batch"], values["algo"], values["math"], time_ms, key=values["key"])])
    assert sorted(r.measurement.time_ms for r in store.rows()) == [1.0, 2.0]


def test_get_filters_by_batches(store):
    store.put(GPU, CUDNN, [measurement(b, algo) for b in (1, 2, 4, 8)
                           for algo in ("gemm", "fft")])
    assert {m.batch for m in store.get(GPU, CUDNN, KEY, batches=[2, 8, 16])} == {2, 8}
    assert len(store.get(GPU, CUDNN, KEY, batches=range(1, 5))) == 6
    assert store.get(GPU, CUDNN, KEY, batches=[]) == []
    assert store.get(GPU, CUDNN, "no such key") == []
    assert store.get(GPU, CUDNN + 1, KEY) == []


def test_a_batch_with_only_failed_rows_counts_as_measured(store):
    store.put(GPU, CUDNN, [measurement(4), measurement(8, status=Status.NOT_SUPPORTED),
                           measurement(16, status=Status.FAILED, time_ms=math.nan)])
    assert store.measured_batches(GPU, CUDNN, KEY) == {4, 8, 16}
    assert store.measured_batches("other gpu", CUDNN, KEY) == set()


def test_environments_and_keys(store):
    other_key = KEY.replace("c=64", "c=3")
    store.put(GPU, CUDNN, [measurement(1), measurement(2), measurement(1, key=other_key)])
    store.put(GPU, 90100, [measurement(1)])
    store.put("NVIDIA A100-SXM4-80GB", CUDNN, [measurement(1, a) for a in ("gemm", "fft")])
    assert store.environments() == [("NVIDIA A100-SXM4-80GB", CUDNN, 2), (GPU, 90100, 1),
                                     (GPU, CUDNN, 3)]
    assert store.keys(GPU, CUDNN) == sorted([KEY, other_key])
    assert store.keys(GPU, 80000) == []
    assert [len(store.rows(gpu=GPU)), len(store.rows(cudnn_version=CUDNN)),
            len(store.rows(key=other_key))] == [4, 5, 1]


def test_key_with_quotes_and_semicolons_round_trips(store):
    hostile = "x'); DROP TABLE measurements; --\"\\"
    store.put(hostile, CUDNN, [measurement(1, key=hostile, algo=hostile, note=hostile)])
    assert store.keys(hostile, CUDNN) == [hostile]
    assert store.get(hostile, CUDNN, hostile) == [measurement(1, key=hostile, algo=hostile,
                                                              note=hostile)]
    assert store.environments() == [(hostile, CUDNN, 1)]


@pytest.mark.parametrize("gpu, cudnn_version, row, message", [
    ("", CUDNN, measurement(1), "gpu"),
    (GPU, "9.19", measurement(1), "cudnn_version"),
    (GPU, CUDNN, measurement(0), "batch"),
    (GPU, CUDNN, "not a measurement", "Measurement"),
])
def test_invalid_rows_are_refused_and_nothing_of_the_call_is_written(store, gpu, cudnn_version,
                                                                      row, message):
    with pytest.raises((ValueError, TypeError), match=message):
        store.put(gpu, cudnn_version, [measurement(2), row])
    assert store.rows() == []


def test_a_transaction_that_raises_is_rolled_back(store):
    store.put(GPU, CUDNN, [measurement(1)])
    with pytest.raises(RuntimeError, match="midway"), store._transaction() as cursor:
        cursor.execute("DELETE FROM measurements")
        raise RuntimeError("midway")
    assert len(store.rows()) == 1


# -- CSV ----------------------------------------------------------------------------------------
def test_csv_export_import_round_trip(store, tmp_path):
    store.put(GPU, CUDNN, MIXED, repetitions=5, measured_at=WHEN)
    store.put("NVIDIA H100 80GB HBM3", 90800, [measurement(2)])
    csv_path = tmp_path / "shipped" / "h200.csv"
    assert store.export_csv(csv_path) == len(MIXED) + 1
    with SQLiteStore(tmp_path / "other.sqlite") as other:
        assert other.import_csv(csv_path) == len(MIXED) + 1
        assert list(map(comparable, other.rows())) == list(map(comparable, store.rows()))
        again = io.StringIO(newline="")
        other.export_csv(again)
    assert again.getvalue() == csv_path.read_text(encoding="utf-8"), "export is not deterministic"


def test_csv_export_filters_and_writes_a_header(store):
    store.put(GPU, CUDNN, [measurement(1)])
    store.put(GPU, 90100, [measurement(1), measurement(2)])
    out = io.StringIO(newline="")
    assert store.export_csv(out, gpu=GPU, cudnn_version=90100) == 2
    lines = out.getvalue().splitlines()
    assert lines[0].split(",")[:4] == ["gpu", "cudnn_version", "key", "batch"]
    assert len(lines) == 3 and all(line.startswith(f"{GPU},90100,") for line in lines[1:])


def test_csv_export_to_gz_is_compressed_and_imports_back(store, tmp_path):
    import gzip

    store.put(GPU, CUDNN, MIXED, repetitions=5, measured_at=WHEN)
    gz_path = tmp_path / "out" / "measurements.csv.gz"
    assert store.export_csv(gz_path) == len(MIXED)
    with gzip.open(gz_path, "rt", encoding="utf-8") as text:  # a gzip file, not plain text
        assert text.readline().startswith("gpu,cudnn_version,")
    with SQLiteStore(tmp_path / "other.sqlite") as other:
        assert other.import_csv(gz_path) == len(MIXED)
        assert list(map(comparable, other.rows())) == list(map(comparable, store.rows()))
    assert sorted(p.name for p in gz_path.parent.iterdir()) == ["measurements.csv.gz"], \
        "the temporary file of the atomic write stays behind"


def test_csv_export_that_fails_leaves_the_old_file(store, tmp_path, monkeypatch):
    store.put(GPU, CUDNN, [measurement(1)])
    csv_path = tmp_path / "old.csv"
    csv_path.write_text("old content\n")
    monkeypatch.setattr("mucudnn.store._csv_fields",
                        lambda row: (_ for _ in ()).throw(RuntimeError("midway")))
    with pytest.raises(RuntimeError, match="midway"):
        store.export_csv(csv_path)
    assert csv_path.read_text() == "old content\n"
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_merge_from_copies_every_row_and_the_other_store_wins(store, tmp_path):
    store.put(GPU, CUDNN, [measurement(1, time_ms=9.0), measurement(2)], measured_at=WHEN)
    with SQLiteStore(tmp_path / "other.sqlite") as other:
        other.put(GPU, CUDNN, [measurement(1, time_ms=1.0)], measured_at=WHEN)
        other.put("NVIDIA H100 80GB HBM3", 90800, [measurement(4)], measured_at=WHEN)
        assert store.merge_from(other) == 2
    times = {(r.gpu, r.measurement.batch): r.measurement.time_ms for r in store.rows()}
    assert times == {(GPU, 1): 1.0, (GPU, 2): 1.25, ("NVIDIA H100 80GB HBM3", 4): 1.25}


def test_checkpoint_folds_the_wal_into_the_file(store, store_path):
    store.put(GPU, CUDNN, [measurement(1), measurement(2)])
    wal = store_path.with_name(store_path.name + "-wal")
    assert wal.stat().st_size > 0, "the test needs rows still in the WAL"
    store.checkpoint()
    assert wal.stat().st_size == 0
    copy = store_path.with_name("copy.sqlite")
    shutil.copyfile(store_path, copy)  # the file alone, without its -wal
    with SQLiteStore(copy, readonly=True) as copied:
        assert len(copied.rows()) == 2


def test_csv_import_of_a_bad_row_names_file_line_and_column(store, tmp_path):
    store.put(GPU, CUDNN, [measurement(1), measurement(2)])
    csv_path = tmp_path / "bad.csv"
    store.export_csv(csv_path)
    lines = csv_path.read_text().splitlines()
    lines[2] = lines[2].replace(",fma,ok,", ",fma,ok_maybe,")
    csv_path.write_text("\n".join(lines) + "\n")
    with SQLiteStore(tmp_path / "fresh.sqlite") as fresh:
        with pytest.raises(StoreError, match=r"bad\.csv:3: column status: .*ok_maybe"):
            fresh.import_csv(csv_path)
        assert fresh.rows() == [], "a failed import must write nothing"


def test_csv_import_checks_the_header(store):
    with pytest.raises(StoreError, match="header must name the columns gpu,cudnn_version"):
        store.import_csv(io.StringIO("gpu,key,batch\nx,y,1\n"))


# -- files --------------------------------------------------------------------------------------
def test_a_new_store_creates_its_parent_directories(tmp_path):
    path = tmp_path / "a" / "b" / "benchmarks.sqlite"
    with open_store(path) as store:
        store.put(GPU, CUDNN, [measurement(1)])
    assert path.is_file()
    with open_store(path, readonly=True) as store:
        assert len(store.rows()) == 1


def test_schema_version_mismatch_says_what_to_do(store_path):
    SQLiteStore(store_path).close()
    with sqlite3.connect(store_path) as connection:
        connection.execute("PRAGMA user_version = 99")
    with pytest.raises(SchemaVersionError) as raised:
        SQLiteStore(store_path)
    message = str(raised.value)
    assert str(store_path) in message
    assert "schema version 99" in message and f"reads version {SCHEMA_VERSION}" in message
    assert "--store" in message


# Schema version 1 as mucudnn 0.1 wrote it, spelled out here (not taken from mucudnn.store) so
# that the migration is tested against the old layout itself.
_SCHEMA_V1 = """
CREATE TABLE measurements (
    gpu TEXT NOT NULL, cudnn_version INTEGER NOT NULL, key TEXT NOT NULL,
    batch INTEGER NOT NULL CHECK (batch >= 1), algo TEXT NOT NULL, math TEXT NOT NULL,
    status TEXT NOT NULL, time_ms REAL, workspace INTEGER NOT NULL, repetitions INTEGER,
    measured_at TEXT NOT NULL, note TEXT NOT NULL,
    PRIMARY KEY (gpu, cudnn_version, key, batch, algo, math)
) WITHOUT ROWID
"""


def version_1_store(path: pathlib.Path) -> pathlib.Path:
    """A store of schema version 1 holding one row (batch 1, 1.25 ms, 5 repetitions)."""
    with sqlite3.connect(path) as connection:
        connection.execute(_SCHEMA_V1)
        connection.execute("PRAGMA application_id = 1835230318")  # "mcdn"
        connection.execute("PRAGMA user_version = 1")
        connection.execute("INSERT INTO measurements VALUES (?, ?, ?, 1, 'gemm', 'fma', 'ok', "
                           "1.25, 0, 5, ?, '')", (GPU, CUDNN, KEY, WHEN.isoformat()))
    connection.close()
    return path


def table_layout(path: pathlib.Path) -> list[tuple]:
    with sqlite3.connect(path) as connection:
        layout = sorted(connection.execute("PRAGMA table_info(measurements)").fetchall())
    connection.close()
    return layout


@pytest.mark.parametrize("readonly", [False, True])
def test_a_version_1_store_is_migrated_on_opening(tmp_path, readonly):
    path = version_1_store(tmp_path / "old.sqlite")
    with SQLiteStore(path, readonly=readonly) as store:
        assert store.schema_version() == SCHEMA_VERSION == 2
        [row] = store.rows()
    assert (row.measurement.batch, row.measurement.time_ms, row.repetitions, row.iqr_ms) == \
        (1, 1.25, 5, None), "the old row keeps its fields; its spread is unknown"
    with SQLiteStore(tmp_path / "new.sqlite") as fresh:
        fresh.put(GPU, CUDNN, [measurement(1)])
    assert table_layout(path) == table_layout(tmp_path / "new.sqlite"), \
        "a migrated store must have the layout of a new one"
    with SQLiteStore(path) as store:  # opened again: already at the current version
        store.put_rows([StoredMeasurement(GPU, CUDNN, measurement(2), WHEN, 3, 0.5)])
        assert [r.iqr_ms for r in store.rows()] == [None, 0.5]


def test_every_old_schema_version_has_a_migration():
    from mucudnn.store import _MIGRATIONS

    assert sorted(_MIGRATIONS) == list(range(1, SCHEMA_VERSION))


def test_an_old_store_that_cannot_be_written_is_refused_in_one_line(shared_dir):
    path = version_1_store(shared_dir / "old.sqlite")
    hand_over(shared_dir, path)
    path.chmod(0o444)

    def open_it():
        with SQLiteStore(path, readonly=True):
            pass

    with pytest.raises(SchemaVersionError) as raised:
        as_unprivileged(open_it)
    message = str(raised.value)
    assert "\n" not in message and str(path) in message
    assert "schema version 1" in message and "the file is read-only" in message
    path.chmod(0o644)
    assert table_layout(path) == table_layout(version_1_store(shared_dir / "again.sqlite"))


def test_iqr_round_trips_through_the_store_and_csv(store, tmp_path):
    store.put(GPU, CUDNN, [measurement(1), measurement(2)], repetitions=4, measured_at=WHEN,
              iqr_ms={measurement(1): 0.125})
    assert [r.iqr_ms for r in store.rows()] == [0.125, None]
    csv_path = tmp_path / "m.csv"
    store.export_csv(csv_path)
    assert csv_path.read_text().splitlines()[0].split(",")[7:9] == ["time_ms", "iqr_ms"]
    with SQLiteStore(tmp_path / "other.sqlite") as other:
        other.import_csv(csv_path)
        assert [r.iqr_ms for r in other.rows()] == [0.125, None]


def test_a_csv_without_the_iqr_column_imports_with_no_spread(store, tmp_path):
    store.put(GPU, CUDNN, [measurement(1)], iqr_ms={measurement(1): 0.25})
    csv_path = tmp_path / "m.csv"
    store.export_csv(csv_path)
    import csv

    with open(csv_path, newline="") as text:
        lines = list(csv.reader(text))
    column = lines[0].index("iqr_ms")
    with open(csv_path, "w", newline="") as text:
        csv.writer(text).writerows(f[:column] + f[column + 1:] for f in lines)
    with SQLiteStore(tmp_path / "other.sqlite") as other:
        assert other.import_csv(csv_path) == 1
        assert [r.iqr_ms for r in other.rows()] == [None]


@pytest.mark.parametrize("bad", [-0.5, math.nan, math.inf, True])
def test_a_bad_iqr_is_refused(bad):
    with pytest.raises(ValueError, match="iqr_ms"):
        StoredMeasurement(GPU, CUDNN, measurement(1), WHEN, 3, bad)


@pytest.mark.parametrize("readonly", [False, True])
def test_a_file_that_is_not_a_database_is_refused(tmp_path, readonly):
    path = tmp_path / "notes.txt"
    path.write_text("these are not the measurements you are looking for\n" * 100)
    with pytest.raises(StoreError, match=rf"{path} is not an SQLite database"):
        SQLiteStore(path, readonly=readonly)
    assert path.read_text().startswith("these are not"), "the file must be left alone"


def test_another_programs_database_is_refused_and_left_alone(tmp_path):
    path = tmp_path / "other.sqlite"
    with sqlite3.connect(path) as connection:
        connection.execute("CREATE TABLE accounts (name TEXT)")
    with pytest.raises(StoreError, match=rf"{path} is an SQLite database but not a mucudnn"):
        SQLiteStore(path)
    with sqlite3.connect(path) as connection:
        tables = connection.execute("SELECT name FROM sqlite_master").fetchall()
    assert tables == [("accounts",)]


def test_readonly_store_must_exist_and_refuses_writes(store_path):
    with pytest.raises(StoreError, match=rf"no benchmark store at {store_path}"):
        SQLiteStore(store_path, readonly=True)
    assert not store_path.exists()
    SQLiteStore(store_path).close()
    with SQLiteStore(store_path, readonly=True) as store, \
            pytest.raises(StoreError, match="read-only"):
        store.put(GPU, CUDNN, [measurement(1)])


# -- read-only places ---------------------------------------------------------------------------
NOBODY = 65534  # the uid and gid root drops to, so permissions are enforced on it too


def as_unprivileged(function, *args):
    """``function(*args)`` in this process, or as root in a forked child that became ``nobody``
    (access rules do not stop root); its result or exception comes back."""
    if os.geteuid() != 0:
        return function(*args)
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            try:
                outcome = ("ok", function(*args))
            except Exception as exc:  # noqa: BLE001 - handed to the parent as it is
                outcome = ("raised", exc)
        except OSError as exc:
            outcome = ("skip", f"root cannot become uid {NOBODY} here: {exc}")
        with os.fdopen(write, "wb") as pipe:
            pickle.dump(outcome, pipe)
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        kind, value = pickle.load(pipe)
    os.waitpid(child, 0)
    if kind == "skip":
        pytest.skip(value)
    if kind == "raised":
        raise value
    return value


def hand_over(*paths: pathlib.Path) -> None:
    """Make the unprivileged user the owner of ``paths``, so only their modes limit it."""
    if os.geteuid() == 0:
        for path in paths:
            os.chown(path, NOBODY, NOBODY)


def read_and_try_writing(path: pathlib.Path, readonly: bool) -> tuple[int, str, str]:
    """(rows read, why check_writable refuses, what a write raised): nothing is written."""
    with SQLiteStore(path, readonly=readonly) as store:
        count = len(store.rows())
        with pytest.raises(ReadOnlyStoreError) as refused:
            store.check_writable()
        with pytest.raises(ReadOnlyStoreError) as written:
            store.put(GPU, CUDNN, [measurement(512)])
        return count, str(refused.value), str(written.value)


def filled_store(directory: pathlib.Path) -> pathlib.Path:
    path = directory / "shared.sqlite"
    with SQLiteStore(path) as store:
        store.put(GPU, CUDNN, [measurement(1), measurement(2)])
    return path


@pytest.mark.parametrize("readonly", [False, True])
def test_a_store_in_a_read_only_directory_is_read_and_refuses_writes(shared_dir, readonly):
    store_dir = shared_dir / "mount"
    store_dir.mkdir()
    path = filled_store(store_dir)
    hand_over(store_dir, path)
    store_dir.chmod(0o555)  # WAL readers cannot create the -shm file here
    count, refused, written = as_unprivileged(read_and_try_writing, path, readonly)
    assert count == 2
    for message in (refused, written):
        assert str(path) in message
        assert "opened read-only" in message if readonly else f"{store_dir} is read-only" in message
    assert sorted(p.name for p in store_dir.iterdir()) == ["shared.sqlite"]


@pytest.mark.parametrize("readonly", [False, True])
def test_a_read_only_store_file_is_read_and_refuses_writes(shared_dir, readonly):
    path = filled_store(shared_dir)
    hand_over(shared_dir, path)
    path.chmod(0o444)
    count, refused, written = as_unprivileged(read_and_try_writing, path, readonly)
    assert count == 2
    for message in (refused, written):
        assert str(path) in message
        assert "opened read-only" in message if readonly else "the file is read-only" in message
    path.chmod(0o644)
    with SQLiteStore(path, readonly=True) as store:
        assert len(store.rows()) == 2, "nothing was written"


def read_where_access_says_writable(path: pathlib.Path) -> tuple[int, str | None]:
    """As :func:`read_and_try_writing`, but access(2) claims everything is writable (as it does
    to root on some read-only mounts): SQLite's own refusals must lead to the same."""
    real_access = os.access
    os.access = lambda *args, **kwargs: True
    try:
        with SQLiteStore(path) as store:
            with pytest.raises(ReadOnlyStoreError, match="SQLite refuses"):
                store.put(GPU, CUDNN, [measurement(512)])
            return len(store.rows()), store.unwritable
    finally:
        os.access = real_access


def test_sqlite_refusing_what_access_allowed_still_reads(shared_dir):
    store_dir = shared_dir / "mount"
    store_dir.mkdir()
    path = filled_store(store_dir)
    hand_over(store_dir, path)
    store_dir.chmod(0o555)
    count, unwritable = as_unprivileged(read_where_access_says_writable, path)
    assert count == 2 and unwritable.startswith("SQLite refuses to write it")


def create_store(path: pathlib.Path) -> None:
    SQLiteStore(path).close()


@pytest.mark.parametrize("missing_parent", [False, True])
def test_creating_a_store_in_a_read_only_directory_names_path_and_reason(shared_dir,
                                                                         missing_parent):
    hand_over(shared_dir)
    shared_dir.chmod(0o555)
    path = shared_dir / "new" / "b.sqlite" if missing_parent else shared_dir / "b.sqlite"
    with pytest.raises(ReadOnlyStoreError) as raised:
        as_unprivileged(create_store, path)
    assert str(raised.value) == (f"cannot create benchmark store {path}: the directory "
                                 f"{shared_dir} is read-only")


def test_a_read_only_connection_is_refused_by_sqlite_itself(store_path):
    """Not only the store's own check: SQLite refuses writes through its read-only connection,
    also to root, and the refusal reads as ReadOnlyStoreError."""
    filled_store(store_path.parent)
    with SQLiteStore(store_path.parent / "shared.sqlite", readonly=True) as store:
        store.unwritable = None  # past the store's own check, to SQLite's
        with pytest.raises(ReadOnlyStoreError, match=r"cannot write benchmark store .*readonly"):
            store.put(GPU, CUDNN, [measurement(512)])
        assert len(store.rows()) == 2


def test_a_closed_store_refuses_use(store_path):
    with SQLiteStore(store_path) as store:
        pass
    with pytest.raises(StoreError, match=rf"{store_path} is closed"):
        store.rows()
    store.close()  # closing twice is harmless


def test_default_store_path(monkeypatch, tmp_path):
    monkeypatch.setenv("MUCUDNN_STORE", str(tmp_path / "explicit.sqlite"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert default_store_path() == tmp_path / "explicit.sqlite"
    monkeypatch.delenv("MUCUDNN_STORE")
    assert default_store_path() == tmp_path / "cache" / "mucudnn" / "benchmarks.sqlite"
    for unusable in ("", "relative/cache"):
        monkeypatch.setenv("XDG_CACHE_HOME", unusable)
        expected = pathlib.Path.home() / ".cache" / "mucudnn" / "benchmarks.sqlite"
        assert default_store_path() == expected


# -- several processes --------------------------------------------------------------------------
ROUNDS = 25        # puts per writer
OWN_ROWS = 4       # rows only one writer writes, per put
SHARED_ROWS = 12   # rows every writer rewrites in every put
SHARED_KEY = "shared"


def _own_rows(worker: int, round_: int) -> list[Measurement]:
    return [measurement(round_ * OWN_ROWS + i + 1, key=f"worker {worker}",
                        time_ms=round_ + i / 8, workspace=worker * 100 + i)
            for i in range(OWN_ROWS)]


def _shared_rows(worker: int, round_: int) -> list[Measurement]:
    return [measurement(b, key=SHARED_KEY, time_ms=float(round_), workspace=worker,
                        note=f"worker {worker} round {round_}")
            for b in range(1, SHARED_ROWS + 1)]


def _writer(path: str, worker: int, start: multiprocessing.synchronize.Barrier) -> None:
    start.wait(timeout=20)
    with SQLiteStore(path) as store:  # every writer may be the one that creates the file
        for round_ in range(ROUNDS):
            store.put(GPU, CUDNN, _own_rows(worker, round_) + _shared_rows(worker, round_))


def _snapshot_problems(rows: list[StoredMeasurement], writers: int) -> list[str]:
    """What in one read snapshot shows a put seen in part (each put must be all or nothing)."""
    problems = []
    shared_notes = {r.measurement.note for r in rows if r.measurement.key == SHARED_KEY}
    if len(shared_notes) > 1:
        problems.append(f"shared rows from several puts: {sorted(shared_notes)}")
    for worker in range(writers):
        own = sum(r.measurement.key == f"worker {worker}" for r in rows)
        if own % OWN_ROWS:
            problems.append(f"worker {worker} has {own} own rows, not a multiple of {OWN_ROWS}")
    return problems


def _reader(path: str, writers: int, start: multiprocessing.synchronize.Barrier,
            results: multiprocessing.Queue) -> None:
    start.wait(timeout=20)
    expected = writers * ROUNDS * OWN_ROWS + SHARED_ROWS
    snapshots, last_count, deadline = 0, 0, time.monotonic() + 15
    with SQLiteStore(path, readonly=True) as store:
        while time.monotonic() < deadline:
            rows = store.rows(GPU, CUDNN)
            snapshots += 1
            problems = _snapshot_problems(rows, writers)
            if len(rows) < last_count:
                problems.append(f"row count fell from {last_count} to {len(rows)}")
            if problems:
                results.put(("bad snapshot", problems))
                return
            last_count = len(rows)
            if last_count == expected:
                results.put(("complete", snapshots))
                return
    results.put(("timed out", f"saw {last_count} of {expected} rows"))


def _run_processes(targets_and_args: list[tuple]) -> None:
    processes = [multiprocessing.get_context("spawn").Process(target=target, args=args)
                 for target, args in targets_and_args]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=40)
    for process in processes:
        if process.is_alive():
            process.kill()
    assert [p.exitcode for p in processes] == [0] * len(processes), "a process failed (see stderr)"


def _check_final_contents(path: pathlib.Path, writers: int) -> None:
    with SQLiteStore(path, readonly=True) as store:
        rows = store.rows()
        assert len(rows) == writers * ROUNDS * OWN_ROWS + SHARED_ROWS
        for worker in range(writers):
            expected = [m for r in range(ROUNDS) for m in _own_rows(worker, r)]
            assert store.get(GPU, CUDNN, f"worker {worker}") == expected
        shared = store.get(GPU, CUDNN, SHARED_KEY)
    assert _snapshot_problems(rows, writers) == []
    # The last put to commit is some writer's last round, and it replaced every shared row.
    last_writer = shared[0].workspace
    assert shared == _shared_rows(last_writer, ROUNDS - 1)


def _creator(paths: list[str], worker: int, start: multiprocessing.synchronize.Barrier) -> None:
    try:
        for path in paths:
            start.wait(timeout=20)  # all processes open each new path at the same moment
            with SQLiteStore(path) as store:
                store.put(GPU, CUDNN, [measurement(1, key=f"worker {worker}")])
    except BaseException:
        start.abort()  # release the others at once instead of after the timeout
        raise


def test_processes_creating_the_same_new_store_at_once_all_succeed(tmp_path):
    processes, paths = 4, [str(tmp_path / f"new{i}.sqlite") for i in range(40)]
    start = multiprocessing.get_context("spawn").Barrier(processes)
    _run_processes([(_creator, (paths, w, start)) for w in range(processes)])
    for path in paths:
        with SQLiteStore(path) as store:
            assert store.keys(GPU, CUDNN) == [f"worker {w}" for w in range(processes)]
            assert store._connection.execute("PRAGMA journal_mode").fetchone() == ("wal",)


@pytest.mark.parametrize("writers", [2, 4])
def test_concurrent_writers_lose_nothing(tmp_path, writers):
    path = tmp_path / "shared.sqlite"  # not created yet: the writers race to create it
    start = multiprocessing.get_context("spawn").Barrier(writers)
    _run_processes([(_writer, (str(path), w, start)) for w in range(writers)])
    _check_final_contents(path, writers)


def test_a_reader_sees_only_whole_puts_while_writers_write(tmp_path):
    path = tmp_path / "shared.sqlite"
    SQLiteStore(path).close()
    writers = 2
    context = multiprocessing.get_context("spawn")
    start, results = context.Barrier(writers + 1), context.Queue()
    _run_processes([(_writer, (str(path), w, start)) for w in range(writers)]
                   + [(_reader, (str(path), writers, start, results))])
    outcome, detail = results.get(timeout=5)
    assert outcome == "complete", detail
    _check_final_contents(path, writers)


def test_a_store_opened_before_fork_refuses_use_in_the_child(store):
    if "fork" not in multiprocessing.get_all_start_methods():
        pytest.skip("fork is not available here")
    context = multiprocessing.get_context("fork")
    results = context.Queue()

    def use_inherited_store():
        try:
            store.rows()
            results.put("used")
        except StoreError as exc:
            results.put(str(exc))

    child = context.Process(target=use_inherited_store)
    child.start()
    message = results.get(timeout=10)
    child.join(timeout=10)
    assert "open it again in process" in message
