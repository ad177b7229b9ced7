"""The benchmark store: measurements kept per GPU and cuDNN version (docs/store.md).

:class:`BenchmarkStore` states the contract; :class:`SQLiteStore` keeps it in one SQLite file that
several processes (benchmark runs, training ranks) may read and write at once. A row is a
:class:`~mucudnn.measurement.Measurement` plus its environment, keyed by
``(gpu, cudnn_version, key, batch, algo, math)``; writing that identity again replaces the row.
"""

from __future__ import annotations

import abc
import contextlib
import csv
import dataclasses
import datetime
import gzip
import math
import numbers
import os
import pathlib
import sqlite3
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import IO, Any, Self

from .errors import ReadOnlyStoreError, SchemaVersionError, StoreError
from .measurement import Measurement, Status
from .problem import MathType

PathLike = str | os.PathLike[str]

#: The table layout this mucudnn writes. An older store is migrated on opening (``_MIGRATIONS``);
#: a newer one is refused.
SCHEMA_VERSION = 2
#: ``PRAGMA application_id`` of every mucudnn store ("mcdn"), so a foreign database is recognised.
APPLICATION_ID = 0x6D63646E
#: Seconds a connection waits for another process's write lock before giving up.
BUSY_TIMEOUT_S = 30.0
#: The mucudnn releases that read each older schema version (named in SchemaVersionError).
_RELEASES_BY_SCHEMA = {1: "0.1"}
#: SQLite's result codes of a refused write or of a file it could not open (primary codes: the
#: extended ones, e.g. SQLITE_READONLY_DIRECTORY, keep them in their low byte).
_SQLITE_READONLY = 8
_SQLITE_CANTOPEN = 14

CSV_COLUMNS = ("gpu", "cudnn_version", "key", "batch", "algo", "math", "status", "time_ms",
               "iqr_ms", "workspace", "repetitions", "measured_at", "note")
#: Columns a CSV may lack (files written before they existed); their rows get NULL there.
OPTIONAL_CSV_COLUMNS = frozenset({"iqr_ms"})

# Schema version 1. A new store is created as this and then migrated like an old one, so a new and
# a migrated store have one layout by construction.
_BASE_SCHEMA = """
CREATE TABLE measurements (
    gpu           TEXT    NOT NULL,
    cudnn_version INTEGER NOT NULL,
    key           TEXT    NOT NULL,
    batch         INTEGER NOT NULL CHECK (batch >= 1),
    algo          TEXT    NOT NULL,
    math          TEXT    NOT NULL,
    status        TEXT    NOT NULL,
    time_ms       REAL,                 -- NULL stands for NaN, which SQLite cannot store
    workspace     INTEGER NOT NULL,
    repetitions   INTEGER,              -- NULL: not recorded
    measured_at   TEXT    NOT NULL,     -- ISO 8601, UTC
    note          TEXT    NOT NULL,
    PRIMARY KEY (gpu, cudnn_version, key, batch, algo, math)
) WITHOUT ROWID
"""


def _add_iqr_column(cursor: sqlite3.Cursor) -> None:
    # The interquartile range of the timed samples beside their median; NULL where the writer had
    # fewer than two samples (a configuration timed once) or did not say (rows of version 1).
    cursor.execute("ALTER TABLE measurements ADD COLUMN iqr_ms REAL")


#: ``version -> migration`` that takes a store from ``version`` to ``version + 1``; applied in
#: order, all in one transaction, when a store of an older version is opened. Every version from
#: 1 to SCHEMA_VERSION - 1 has one.
_MIGRATIONS: dict[int, Callable[[sqlite3.Cursor], None]] = {
    1: _add_iqr_column,
}

_COLUMNS = ", ".join(CSV_COLUMNS)
_UPSERT = f"""
INSERT INTO measurements ({_COLUMNS}) VALUES ({", ".join("?" * len(CSV_COLUMNS))})
ON CONFLICT (gpu, cudnn_version, key, batch, algo, math) DO UPDATE SET
    status = excluded.status, time_ms = excluded.time_ms, iqr_ms = excluded.iqr_ms,
    workspace = excluded.workspace,
    repetitions = excluded.repetitions, measured_at = excluded.measured_at, note = excluded.note
"""


@dataclasses.dataclass(frozen=True)
class StoredMeasurement:
    """One row of a store: a measurement with the environment it was taken in.

    ``measured_at`` is timezone-aware (UTC once stored); ``repetitions`` is the number of timed
    runs the median came from, or ``None`` when the writer did not say; ``iqr_ms`` the
    interquartile range of those runs' times (the spread beside the median ``time_ms``), or
    ``None`` where there were fewer than two or the writer did not say.
    """

    gpu: str
    cudnn_version: int
    measurement: Measurement
    measured_at: datetime.datetime
    repetitions: int | None = None
    iqr_ms: float | None = None

    def __post_init__(self) -> None:
        _check_environment(self.gpu, self.cudnn_version)
        _check_measurement(self.measurement)
        if self.measured_at.tzinfo is None:
            raise ValueError(f"measured_at {self.measured_at} must be timezone-aware")
        object.__setattr__(self, "measured_at", self.measured_at.astimezone(datetime.UTC))
        if self.repetitions is not None and not _is_int_at_least(self.repetitions, 1):
            raise ValueError(f"repetitions must be an integer >= 1 or None, "
                             f"got {self.repetitions!r}")
        if self.iqr_ms is not None and not (
                isinstance(self.iqr_ms, numbers.Real) and not isinstance(self.iqr_ms, bool)
                and math.isfinite(self.iqr_ms) and self.iqr_ms >= 0):
            raise ValueError(f"iqr_ms must be a finite number >= 0 or None, got {self.iqr_ms!r}")


class BenchmarkStore(abc.ABC):
    """Where measurements live between ``mucudnn bench`` and ``mucudnn tune``.

    Contract of every implementation:

    - A row is identified by ``(gpu, cudnn_version, key, batch, algo, math)``. Writing a row whose
      identity exists replaces it (re-measuring wins); nothing else is ever deleted.
    - Each :meth:`put_rows` call is atomic: readers see all of its rows or none of them.
    - Several processes may use the same store at once; every committed write survives.
    - Rows come back exactly as written (``time_ms`` NaN stays NaN), ordered by
      ``(gpu, cudnn_version, key, batch, algo, math)``.
    - Failures of the storage raise :class:`~mucudnn.errors.StoreError` naming the store.

    Subclasses implement the abstract methods; the rest is built on them.
    """

    # -- implemented by each backend ------------------------------------------------------------
    @abc.abstractmethod
    def put_rows(self, rows: Iterable[StoredMeasurement]) -> int:
        """Upsert ``rows`` in one atomic write (of duplicates, the last wins); returns the count.

        Every row is validated before anything is written.
        """

    @abc.abstractmethod
    def rows(self, gpu: str | None = None, cudnn_version: int | None = None,
             key: str | None = None) -> list[StoredMeasurement]:
        """Every row matching the filters given (``None`` matches anything)."""

    @abc.abstractmethod
    def measured_batches(self, gpu: str, cudnn_version: int, key: str) -> set[int]:
        """The batch sizes with at least one row for ``key`` (OK or not)."""

    @abc.abstractmethod
    def environments(self) -> list[tuple[str, int, int]]:
        """``(gpu, cudnn_version, row count)`` of every environment with rows, sorted."""

    @abc.abstractmethod
    def keys(self, gpu: str, cudnn_version: int) -> list[str]:
        """The kernel keys measured in one environment, sorted."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the store; further use raises StoreError. Closing twice is harmless."""

    def check_writable(self) -> None:
        """Raise :class:`~mucudnn.errors.ReadOnlyStoreError` if writes are known to be refused
        (so a long benchmark fails before it starts, not at its first write)."""

    # -- built on the above ---------------------------------------------------------------------
    def put(self, gpu: str, cudnn_version: int, measurements: Iterable[Measurement],
            repetitions: int | None = None,
            measured_at: datetime.datetime | None = None,
            iqr_ms: Mapping[Measurement, float | None] | None = None) -> int:
        """Upsert ``measurements`` taken on ``gpu`` with cuDNN ``cudnn_version`` (e.g. 91900).

        All rows get the same ``repetitions`` and ``measured_at`` (default: now); ``iqr_ms``
        gives the spread of those measurements that have one (the others store NULL). Atomic;
        returns the number of measurements written.
        """
        when = measured_at or datetime.datetime.now(datetime.UTC)
        spreads = iqr_ms or {}
        return self.put_rows(
            StoredMeasurement(gpu, cudnn_version, m, when, repetitions, spreads.get(m))
            for m in measurements
        )

    def get(self, gpu: str, cudnn_version: int, key: str,
            batches: Iterable[int] | None = None) -> list[Measurement]:
        """The measurements of ``key``, optionally only those at the given batch sizes."""
        wanted = None if batches is None else set(batches)
        return [row.measurement for row in self.rows(gpu, cudnn_version, key)
                if wanted is None or row.measurement.batch in wanted]

    def export_csv(self, destination: PathLike | IO[str], gpu: str | None = None,
                   cudnn_version: int | None = None, key: str | None = None) -> int:
        """Write the matching rows as CSV (header :data:`CSV_COLUMNS`); returns the row count.

        ``destination`` is a path (parent directories are created) or a text file opened with
        ``newline=""``. Rows are sorted and floats written exactly, so the file diffs well and
        :meth:`import_csv` restores every field.
        """
        rows = self.rows(gpu, cudnn_version, key)
        with _open_text(destination, "w") as out:
            writer = csv.writer(out, lineterminator="\n")
            writer.writerow(CSV_COLUMNS)
            writer.writerows(_csv_fields(row) for row in rows)
        return len(rows)

    def import_csv(self, source: PathLike | IO[str]) -> int:
        """Upsert every row of a CSV written by :meth:`export_csv`, atomically; returns the count.

        A malformed file imports nothing and raises StoreError naming the file, line and column.
        """
        with _open_text(source, "r") as text:
            rows = list(_parse_csv(text, getattr(text, "name", "<csv>")))
        return self.put_rows(rows)

    def merge_from(self, other: BenchmarkStore) -> int:
        """Upsert every row of ``other`` into this store, atomically; returns the count.

        A row whose identity is in both stores takes ``other``'s values (as a re-measurement
        would)."""
        return self.put_rows(other.rows())

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class SQLiteStore(BenchmarkStore):
    """A :class:`BenchmarkStore` in one SQLite file (WAL journal, safe across processes).

    Opening a path that does not exist creates the store (and its parent directories) unless
    ``readonly``. Raises :class:`StoreError` if the file is not a mucudnn store and
    :class:`SchemaVersionError` if it has another schema version.

    A store this process cannot write (a read-only file or directory, a read-only mount) opens
    for reading even without ``readonly``; its writes raise :class:`ReadOnlyStoreError` naming
    the reason (:attr:`unwritable`). In a directory it cannot write, SQLite cannot create the
    ``-shm`` file WAL readers share, so the store is read as an immutable file: no locks, and a
    write by another process (one allowed to write there) while it is open is not seen
    consistently.

    A store object belongs to the process (and thread) that opened it: each process, e.g. each
    training rank, opens its own. Writers wait up to :data:`BUSY_TIMEOUT_S` for each other.
    """

    def __init__(self, path: PathLike, readonly: bool = False):
        self.path = pathlib.Path(path).expanduser()
        self.readonly = readonly
        #: Why writes are refused (None: writable, as far as access(2) tells before trying).
        self.unwritable: str | None = "opened read-only" if readonly else None
        self._immutable = False
        self._found_version = SCHEMA_VERSION  # the file's schema version before any migration
        self._pid = os.getpid()
        self._connection: sqlite3.Connection | None = self._connect()
        try:
            self._prepare()
        except BaseException:
            self._connection.close()
            raise

    def __repr__(self) -> str:
        mode = ", readonly=True" if self.readonly else ""
        return f"SQLiteStore({str(self.path)!r}{mode})"

    # -- opening ----------------------------------------------------------------------------------
    def _connect(self) -> sqlite3.Connection:
        if not self.readonly:
            self.unwritable = _unwritable_reason(self.path)
        if self.unwritable is not None:
            if not self.path.is_file():
                if self.readonly:
                    raise StoreError(f"no benchmark store at {self.path} "
                                     "(run `mucudnn bench` first)")
                raise ReadOnlyStoreError(f"cannot create benchmark store {self.path}: "
                                         f"{self.unwritable}")
            # WAL readers share a -shm file beside the store, which this directory cannot get.
            self._immutable = not os.access(self.path.parent, os.W_OK)
            return self._connect_to(self._read_only_uri(), uri=True)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ReadOnlyStoreError(f"cannot create benchmark store {self.path}: "
                                     f"{exc.strerror}: {exc.filename}") from None
        return self._connect_to(str(self.path), uri=False)

    def _connect_to(self, target: str, uri: bool) -> sqlite3.Connection:
        try:
            # isolation_level=None: no implicit transactions; _transaction() opens them explicitly.
            return sqlite3.connect(target, timeout=BUSY_TIMEOUT_S, isolation_level=None, uri=uri)
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open benchmark store {self.path}: {exc}") from None

    def _read_only_uri(self) -> str:
        # immutable=1: SQLite reads the file as it is, without locks or a -shm file.
        return self.path.resolve().as_uri() + ("?mode=ro&immutable=1" if self._immutable
                                               else "?mode=ro")

    def _checked_format(self) -> bool:
        """:meth:`_format_check`, first reopening the file for reading only, then as immutable,
        where SQLite refuses what access(2) allowed (it does not see every refusal: root's on
        some mounts, a -shm file SQLite cannot create)."""
        while True:
            try:
                return self._format_check()
            except sqlite3.Error as exc:
                if _primary_code(exc) not in (_SQLITE_READONLY, _SQLITE_CANTOPEN) \
                        or self._immutable or not self.path.is_file():
                    raise
                if self.unwritable is None:
                    self.unwritable = f"SQLite refuses to write it ({exc})"
                else:
                    self._immutable = True
                self._open_connection().close()
                self._connection = self._connect_to(self._read_only_uri(), uri=True)

    def _prepare(self) -> None:
        """Check the file is a store of our schema or an older one, which is migrated; create the
        schema in an empty file."""
        try:
            is_empty = self._checked_format()
        except sqlite3.Error as exc:
            if getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_NOTADB:
                raise StoreError(f"{self.path} is not an SQLite database; point --store at a "
                                 "benchmark store or a new file") from None
            raise StoreError(f"benchmark store {self.path}: opening failed: {exc}") from None
        if self.unwritable is not None:
            if is_empty:
                raise StoreError(f"{self.path} is an empty database, not a benchmark store "
                                 "(run `mucudnn bench` first)")
            if self._found_version < SCHEMA_VERSION:
                self._migrate_aside()
            return
        connection = self._open_connection()
        self._use_wal()
        with self._sqlite_errors("opening"):
            # In WAL mode NORMAL still survives process crashes; only a power cut may lose the
            # last commits, which a re-measurement restores.
            connection.execute("PRAGMA synchronous = NORMAL")
        if is_empty:
            with self._transaction() as cursor:
                # Another process may have created the schema since the check above.
                if self._format_check():
                    cursor.execute(_BASE_SCHEMA)
                    # PRAGMAs take no parameters; both values are our own integer constants.
                    cursor.execute(f"PRAGMA application_id = {APPLICATION_ID:d}")
                    _migrate(cursor, 1)
        elif self._found_version < SCHEMA_VERSION:
            with self._transaction() as cursor:
                _migrate(cursor, cursor.execute("PRAGMA user_version").fetchone()[0])

    def _migrate_aside(self) -> None:
        """Migrate an old store opened for reading only, through a short-lived connection of
        its own, where this process may write the file (``readonly=True`` promises that the
        caller writes no rows; bringing the layout up to date is not such a write)."""
        reason = self.unwritable if not self.readonly else _unwritable_reason(self.path)
        if reason is not None or self._immutable:
            raise SchemaVersionError(
                f"benchmark store {self.path} has schema version {self._found_version}, which "
                f"mucudnn migrates to version {SCHEMA_VERSION} on opening, but it cannot write "
                f"it: {reason or 'its directory is read-only'}; open it once where it can be "
                "written, or export it with `mucudnn store export` and import that")
        try:
            writer = sqlite3.connect(str(self.path), timeout=BUSY_TIMEOUT_S, isolation_level=None)
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open benchmark store {self.path}: {exc}") from None
        try:
            with self._sqlite_errors("migrating"):
                writer.execute("BEGIN IMMEDIATE")
                try:
                    _migrate(writer.cursor(), writer.execute("PRAGMA user_version").fetchone()[0])
                    writer.execute("COMMIT")
                except BaseException:
                    if writer.in_transaction:
                        writer.execute("ROLLBACK")
                    raise
        finally:
            writer.close()

    def _use_wal(self) -> None:
        """Switch the file to WAL, which lets readers go on while one process writes.

        The mode persists in the file, so this changes something only once. While another process
        switches or writes, SQLite refuses at once rather than after the busy timeout, so retry.
        """
        connection = self._open_connection()
        deadline = time.monotonic() + BUSY_TIMEOUT_S
        while True:
            try:
                if connection.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                    connection.execute("PRAGMA journal_mode = WAL")
                return
            except sqlite3.OperationalError as exc:
                busy = getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_BUSY
                if not busy or time.monotonic() > deadline:
                    raise StoreError(f"benchmark store {self.path}: switching to WAL journal "
                                     f"mode failed: {exc}") from None
            time.sleep(0.005)

    def _format_check(self) -> bool:
        """True if the database is empty; raises if it holds something other than our schema."""
        run = self._open_connection()
        table_count = run.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]
        if table_count == 0:
            return True
        application_id = run.execute("PRAGMA application_id").fetchone()[0]
        if application_id != APPLICATION_ID:
            raise StoreError(f"{self.path} is an SQLite database but not a mucudnn benchmark "
                             "store; point --store at a benchmark store or a new file")
        version = run.execute("PRAGMA user_version").fetchone()[0]
        if version != SCHEMA_VERSION and version not in _MIGRATIONS:
            raise SchemaVersionError(_schema_version_message(self.path, version))
        self._found_version = version
        return False

    # -- plumbing -------------------------------------------------------------------------------
    def _open_connection(self) -> sqlite3.Connection:
        if self._connection is None:
            raise StoreError(f"benchmark store {self.path} is closed")
        if os.getpid() != self._pid:
            # SQLite forbids carrying a connection across fork(): it can corrupt the database.
            raise StoreError(f"benchmark store {self.path} was opened in process {self._pid}; "
                             f"open it again in process {os.getpid()}")
        return self._connection

    @contextlib.contextmanager
    def _sqlite_errors(self, doing: str) -> Iterator[None]:
        """Turn SQLite's errors into StoreError naming this store."""
        try:
            yield
        except sqlite3.Error as exc:
            if _primary_code(exc) == _SQLITE_READONLY:
                raise ReadOnlyStoreError(f"cannot write benchmark store {self.path}: "
                                         f"SQLite refuses ({exc})") from None
            raise StoreError(f"benchmark store {self.path}: {doing} failed: {exc}") from exc

    def check_writable(self) -> None:
        if self.unwritable is not None:
            raise ReadOnlyStoreError(f"cannot write benchmark store {self.path}: "
                                     f"{self.unwritable}")

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Cursor]:
        """A write transaction: commits if the block succeeds, rolls back if it raises.

        ``BEGIN IMMEDIATE`` takes the write lock up front (waiting up to the busy timeout), so
        two writers never both read and then fail to upgrade to writing.
        """
        self.check_writable()
        connection = self._open_connection()
        with self._sqlite_errors("writing"):
            cursor = connection.execute("BEGIN IMMEDIATE")
            try:
                yield cursor
                connection.execute("COMMIT")
            except BaseException:
                if connection.in_transaction:  # the block or COMMIT itself failed
                    connection.execute("ROLLBACK")
                raise

    def _query(self, sql: str, parameters: Sequence[object] = ()) -> list[tuple]:
        """Run one SELECT; a single statement reads one consistent snapshot."""
        connection = self._open_connection()
        with self._sqlite_errors("reading"):
            return connection.execute(sql, parameters).fetchall()

    # -- the contract ---------------------------------------------------------------------------
    def put_rows(self, rows: Iterable[StoredMeasurement]) -> int:
        values = [_row_values(row) for row in rows]
        with self._transaction() as cursor:
            cursor.executemany(_UPSERT, values)
        return len(values)

    def rows(self, gpu: str | None = None, cudnn_version: int | None = None,
             key: str | None = None) -> list[StoredMeasurement]:
        filters = {"gpu": gpu, "cudnn_version": cudnn_version, "key": key}
        given = {column: value for column, value in filters.items() if value is not None}
        # Only our own column names go into the text; the values are bound as parameters.
        where = " AND ".join(f"{column} = ?" for column in given) or "1"
        found = self._query(
            f"SELECT {_COLUMNS} FROM measurements WHERE {where} "
            "ORDER BY gpu, cudnn_version, key, batch, algo, math",
            list(given.values()),
        )
        return [_row_from_values(values) for values in found]

    def measured_batches(self, gpu: str, cudnn_version: int, key: str) -> set[int]:
        found = self._query(
            "SELECT DISTINCT batch FROM measurements "
            "WHERE gpu = ? AND cudnn_version = ? AND key = ?",
            (gpu, cudnn_version, key),
        )
        return {batch for (batch,) in found}

    def environments(self) -> list[tuple[str, int, int]]:
        return [tuple(found) for found in self._query(
            "SELECT gpu, cudnn_version, count(*) FROM measurements "
            "GROUP BY gpu, cudnn_version ORDER BY gpu, cudnn_version"
        )]

    def keys(self, gpu: str, cudnn_version: int) -> list[str]:
        found = self._query(
            "SELECT DISTINCT key FROM measurements "
            "WHERE gpu = ? AND cudnn_version = ? ORDER BY key",
            (gpu, cudnn_version),
        )
        return [key for (key,) in found]

    def schema_version(self) -> int:
        """The schema version the file is at (``PRAGMA user_version``)."""
        return self._query("PRAGMA user_version")[0][0]

    def checkpoint(self) -> None:
        """Fold the WAL journal's committed rows into the store file and empty the journal, so
        the file alone (copied, compressed) holds every row. Waits for readers like a write."""
        self.check_writable()
        connection = self._open_connection()
        with self._sqlite_errors("checkpointing"):
            busy, _, _ = connection.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        if busy:
            raise StoreError(f"benchmark store {self.path}: checkpoint incomplete: another "
                             "process is reading or writing it")

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None


def _migrate(cursor: sqlite3.Cursor, version: int) -> None:
    """Take a store at schema ``version`` (read inside this write transaction, so a migration
    another process finished meanwhile is not applied twice) to :data:`SCHEMA_VERSION`."""
    for step in range(version, SCHEMA_VERSION):
        _MIGRATIONS[step](cursor)
    # PRAGMAs take no parameters; the value is our own integer constant.
    cursor.execute(f"PRAGMA user_version = {SCHEMA_VERSION:d}")


def _unwritable_reason(path: pathlib.Path) -> str | None:
    """Why access(2) says this process cannot write the store at ``path`` (None: it can)."""
    if path.exists():
        if not os.access(path, os.W_OK):
            return "the file is read-only"
    else:
        path = path.parent  # the nearest directory that exists is where it would be created
        while not path.exists() and path != path.parent:
            path = path.parent
        if path.is_dir() and not os.access(path, os.W_OK):
            return f"the directory {path} is read-only"
        return None
    if not os.access(path.parent, os.W_OK):
        return (f"its directory {path.parent} is read-only (SQLite writes its -wal and -shm "
                "files beside the store)")
    return None


def _primary_code(exc: sqlite3.Error) -> int | None:
    code = getattr(exc, "sqlite_errorcode", None)
    return None if code is None else code & 0xFF


def default_store_path() -> pathlib.Path:
    """``$MUCUDNN_STORE`` if set, else ``mucudnn/benchmarks.sqlite`` in the XDG cache directory
    (``$XDG_CACHE_HOME``, or ``~/.cache`` when that is unset or not absolute)."""
    from .settings import user_cache_dir
    explicit = os.environ.get("MUCUDNN_STORE")
    if explicit:
        return pathlib.Path(explicit).expanduser()
    return user_cache_dir() / "benchmarks.sqlite"


def open_store(path: PathLike | None = None, readonly: bool = False) -> SQLiteStore:
    """Open the store at ``path`` (default :func:`default_store_path`)."""
    return SQLiteStore(default_store_path() if path is None else path, readonly=readonly)


def describe(store: SQLiteStore) -> list[str]:
    """What ``mucudnn store info`` prints: the path, the schema version and each environment
    (GPU, cuDNN version) with its row count."""
    environments = store.environments()
    lines = [f"store: {store.path}", f"schema version: {store.schema_version()}",
             f"rows: {sum(count for _, _, count in environments)}"]
    if not environments:
        lines.append("environments: none (run `mucudnn bench` or `mucudnn store import`)")
    else:
        lines.append("environments (GPU, cuDNN, rows):")
        width = max(len(gpu) for gpu, _, _ in environments)
        lines += [f"  {gpu:<{width}}  {cudnn:>6}  {count:>7}"
                  for gpu, cudnn, count in environments]
    return lines


# -- validation ---------------------------------------------------------------------------------
def _is_int_at_least(value: object, minimum: int | None) -> bool:
    """Whether ``value`` is an integer (numpy's count, bools do not) of at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return False
    return minimum is None or int(value) >= minimum


def _check_environment(gpu: object, cudnn_version: object) -> None:
    if not isinstance(gpu, str) or not gpu.strip():
        raise ValueError(f"gpu must be a non-empty device name, got {gpu!r}")
    if not _is_int_at_least(cudnn_version, 1):
        raise ValueError(f"cudnn_version must be a positive integer such as 91900, "
                         f"got {cudnn_version!r}")


def _check_measurement(m: object) -> None:
    if not isinstance(m, Measurement):
        raise TypeError(f"expected a Measurement, got {type(m).__name__}")
    if not _is_int_at_least(m.batch, 1):
        raise ValueError(f"batch must be an integer >= 1 in {m}")
    if not _is_int_at_least(m.workspace, None):
        raise ValueError(f"workspace must be an integer number of bytes in {m}")
    if not isinstance(m.time_ms, numbers.Real):
        raise ValueError(f"time_ms must be a number (NaN for none) in {m}")


def _schema_version_message(path: pathlib.Path, found: int) -> str:
    if found in _RELEASES_BY_SCHEMA:
        reader = f"mucudnn {_RELEASES_BY_SCHEMA[found]}"
    else:
        reader = f"a mucudnn release that reads schema version {found}"
    from . import __version__  # late: mucudnn/__init__ may import this module
    return (f"benchmark store {path} has schema version {found}, but mucudnn {__version__} "
            f"reads version {SCHEMA_VERSION}: re-measure into a new store with --store NEW_PATH, "
            f"or use {reader}")


# -- row conversions ----------------------------------------------------------------------------
def _row_values(row: StoredMeasurement) -> tuple:
    """The column values of ``row`` in :data:`CSV_COLUMNS` order, as SQLite stores them."""
    m = row.measurement
    time_ms = None if math.isnan(m.time_ms) else float(m.time_ms)
    repetitions = None if row.repetitions is None else int(row.repetitions)
    iqr_ms = None if row.iqr_ms is None else float(row.iqr_ms)
    return (row.gpu, int(row.cudnn_version), m.key, int(m.batch), m.algo, m.math.value,
            m.status.value, time_ms, iqr_ms, int(m.workspace), repetitions,
            _timestamp(row.measured_at), m.note)


def _row_from_values(values: Sequence) -> StoredMeasurement:
    (gpu, cudnn_version, key, batch, algo, math_type, status, time_ms, iqr_ms, workspace,
     repetitions, measured_at, note) = values
    measurement = Measurement(
        key=key, batch=batch, algo=algo, math=MathType(math_type),
        time_ms=math.nan if time_ms is None else time_ms, workspace=workspace,
        status=Status(status), note=note,
    )
    return StoredMeasurement(gpu, cudnn_version, measurement,
                             datetime.datetime.fromisoformat(measured_at), repetitions, iqr_ms)


def _timestamp(when: datetime.datetime) -> str:
    """ISO 8601 with a fixed shape (always microseconds and offset), so stored texts compare."""
    return when.isoformat(timespec="microseconds")


# -- CSV ----------------------------------------------------------------------------------------
@contextlib.contextmanager
def _open_text(target: PathLike | IO[str], mode: str) -> Iterator[IO[str]]:
    """Yield the file at path ``target``, opened, or ``target`` itself if it is a file object.

    A path whose name ends in ``.gz`` is read or written gzip-compressed. A path opened for
    writing is written to a temporary file beside it that replaces it only once the block
    succeeded, so a failed export leaves the old file as it was.
    """
    if not isinstance(target, (str, os.PathLike)):
        yield target  # the caller's file: theirs to close
        return
    path = pathlib.Path(target).expanduser()
    compressed = path.name.endswith(".gz")
    opened = path
    if mode == "w":
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot write CSV file {path}: {exc.strerror}: "
                             f"{exc.filename}") from None
        opened = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        if compressed:
            handle = gzip.open(opened, mode + "t", newline="", encoding="utf-8")
        else:
            handle = open(opened, mode, newline="", encoding="utf-8")  # noqa: SIM115
    except OSError as exc:
        verb = "write" if mode == "w" else "open"
        raise StoreError(f"cannot {verb} CSV file {path}: {exc.strerror}") from None
    try:
        with handle:
            yield handle
        if mode == "w":
            os.replace(opened, path)
    except (OSError, EOFError, gzip.BadGzipFile) as exc:
        raise StoreError(f"CSV file {path}: {getattr(exc, 'strerror', None) or exc}") from None
    finally:
        if mode == "w":
            opened.unlink(missing_ok=True)


def _csv_fields(row: StoredMeasurement) -> list[str]:
    m = row.measurement
    return [row.gpu, str(row.cudnn_version), m.key, str(m.batch), m.algo, m.math.value,
            m.status.value, repr(float(m.time_ms)),
            "" if row.iqr_ms is None else repr(float(row.iqr_ms)), str(m.workspace),
            "" if row.repetitions is None else str(row.repetitions),
            _timestamp(row.measured_at), m.note]


def _parse_csv(text: IO[str], name: str) -> Iterator[StoredMeasurement]:
    reader = csv.DictReader(text)
    header = tuple(reader.fieldnames or ())
    required = [column for column in CSV_COLUMNS if column not in OPTIONAL_CSV_COLUMNS]
    if len(set(header)) != len(header) or not set(required) <= set(header) <= set(CSV_COLUMNS):
        raise StoreError(f"{name}:1: CSV header must name the columns {','.join(CSV_COLUMNS)} "
                         f"({', '.join(sorted(OPTIONAL_CSV_COLUMNS))} may be left out); "
                         f"got {','.join(header) or 'nothing'}")
    for fields in reader:
        try:
            yield _parse_csv_row(fields)
        except ValueError as exc:
            raise StoreError(f"{name}:{reader.line_num}: {exc}") from None


def _parse_csv_row(fields: dict[str, str]) -> StoredMeasurement:
    """One CSV row as a StoredMeasurement; ValueError names the offending column."""
    if None in fields or None in fields.values():  # DictReader's marks of extra / missing fields
        raise ValueError("as many fields as the header names expected")

    def parse(column: str, convert: Callable[[str], object]) -> Any:
        try:
            return convert(fields.get(column, ""))
        except ValueError as exc:
            raise ValueError(f"column {column}: {exc}") from None

    measurement = Measurement(
        key=fields["key"], batch=parse("batch", int), algo=fields["algo"],
        math=parse("math", MathType), time_ms=parse("time_ms", float),
        workspace=parse("workspace", int), status=parse("status", Status), note=fields["note"],
    )
    return StoredMeasurement(
        gpu=fields["gpu"], cudnn_version=parse("cudnn_version", int), measurement=measurement,
        measured_at=parse("measured_at", datetime.datetime.fromisoformat),
        repetitions=parse("repetitions", lambda text: int(text) if text else None),
        iqr_ms=parse("iqr_ms", lambda text: float(text) if text else None),
    )
