"""The store's schema as an ordered list of migrations.

Migration ``n`` turns a version ``n - 1`` database into version ``n``. :func:`migrate` applies the
missing ones in a single transaction when the store opens and records each in ``schema_version``, so
a crash halfway leaves the database at its old version, never between two. A migration is a tuple of
single statements (``executescript`` would commit on its own and break that promise). Never edit a
released migration: append a new one.
"""

from __future__ import annotations

import functools
import sqlite3

from edgerev_daemon.errors import StoreError

MIGRATIONS: tuple[tuple[str, ...], ...] = (
    # 1: samples, labels, ingest batches, jobs, model versions, events, settings
    (
        """CREATE TABLE meta (
            key TEXT PRIMARY KEY,
            value TEXT NOT NULL
        )""",
        """CREATE TABLE labels (
            id INTEGER PRIMARY KEY,
            name TEXT NOT NULL UNIQUE,
            added_at REAL NOT NULL
        )""",
        """CREATE TABLE ingest_batches (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            at REAL NOT NULL,
            accepted INTEGER NOT NULL,
            duplicates INTEGER NOT NULL,
            quarantined INTEGER NOT NULL,
            refused INTEGER NOT NULL
        )""",
        """CREATE TABLE samples (
            sha256 TEXT PRIMARY KEY CHECK (length(sha256) = 64),
            label_id INTEGER NOT NULL REFERENCES labels(id),
            split TEXT NOT NULL CHECK (split IN ('train', 'heldout')),
            width INTEGER NOT NULL CHECK (width > 0),
            height INTEGER NOT NULL CHECK (height > 0),
            blob_sha256 TEXT NOT NULL CHECK (length(blob_sha256) = 64),
            source TEXT NOT NULL,
            added_at REAL NOT NULL,
            batch_id INTEGER NOT NULL REFERENCES ingest_batches(id)
        )""",
        "CREATE INDEX samples_batch ON samples(batch_id)",
        "CREATE INDEX samples_label ON samples(label_id)",
        """CREATE TABLE jobs (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            state TEXT NOT NULL CHECK (state IN ('queued', 'running', 'done', 'failed')),
            reason TEXT NOT NULL,
            created_at REAL NOT NULL,
            started_at REAL,
            finished_at REAL,
            data_batch_id INTEGER NOT NULL,
            checkpoint_dir TEXT,
            error TEXT
        )""",
        # at most one job queued or running, whatever the code above it does
        "CREATE UNIQUE INDEX jobs_one_active ON jobs((0)) WHERE state IN ('queued', 'running')",
        """CREATE TABLE versions (
            id TEXT PRIMARY KEY CHECK (id GLOB 'v[0-9][0-9][0-9][0-9]*'),
            number INTEGER NOT NULL UNIQUE,
            created_at REAL NOT NULL,
            job_id INTEGER REFERENCES jobs(id),
            parent_id TEXT REFERENCES versions(id),
            promoted INTEGER NOT NULL DEFAULT 0 CHECK (promoted IN (0, 1)),
            metrics TEXT NOT NULL DEFAULT '{}' CHECK (json_valid(metrics)),
            reason TEXT NOT NULL DEFAULT ''
        )""",
        """CREATE TABLE events (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            at REAL NOT NULL,
            kind TEXT NOT NULL,
            message TEXT NOT NULL CHECK (json_valid(message))
        )""",
        "CREATE INDEX events_kind ON events(kind, id)",
    ),
    # 2: a lasting condition is one event with a repeat count and the time it was last seen
    (
        "ALTER TABLE events ADD COLUMN repeats INTEGER NOT NULL DEFAULT 1",
        "ALTER TABLE events ADD COLUMN last_at REAL",
        "CREATE INDEX events_at ON events(at)",
    ),
    # 3: unlabelled samples (no label, no split until they get a label); a batch may label stored samples.
    # SQLite cannot drop a NOT NULL, so the table is made again with the same rows, in the same order.
    (
        """CREATE TABLE samples_v3 (
            sha256 TEXT PRIMARY KEY CHECK (length(sha256) = 64),
            label_id INTEGER REFERENCES labels(id),
            split TEXT CHECK (split IN ('train', 'heldout')),
            width INTEGER NOT NULL CHECK (width > 0),
            height INTEGER NOT NULL CHECK (height > 0),
            blob_sha256 TEXT NOT NULL CHECK (length(blob_sha256) = 64),
            source TEXT NOT NULL,
            added_at REAL NOT NULL,
            batch_id INTEGER NOT NULL REFERENCES ingest_batches(id),
            CHECK ((label_id IS NULL) = (split IS NULL))
        )""",
        "INSERT INTO samples_v3 (sha256, label_id, split, width, height, blob_sha256, source, added_at, batch_id) "
        "SELECT sha256, label_id, split, width, height, blob_sha256, source, added_at, batch_id FROM samples "
        "ORDER BY rowid",
        "DROP TABLE samples",
        "ALTER TABLE samples_v3 RENAME TO samples",
        "CREATE INDEX samples_batch ON samples(batch_id)",
        "CREATE INDEX samples_label ON samples(label_id)",
        "CREATE INDEX samples_unlabeled ON samples(batch_id) WHERE label_id IS NULL",
        "ALTER TABLE ingest_batches ADD COLUMN labeled INTEGER NOT NULL DEFAULT 0",
    ),
)

LATEST = len(MIGRATIONS)


def current_version(conn: sqlite3.Connection) -> int:
    """The database's schema version (0: empty)."""
    exists = conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'schema_version'").fetchone()
    if not exists:
        return 0
    return conn.execute("SELECT COALESCE(MAX(version), 0) FROM schema_version").fetchone()[0]


@functools.cache
def tables_at(version: int) -> dict[str, tuple[str, ...]]:
    """Each table of a version ``version`` database and its columns, in order: the migrations up to it, run on an
    empty database in memory."""
    conn = sqlite3.connect(":memory:")
    try:
        for statements in MIGRATIONS[:version]:
            for statement in statements:
                conn.execute(statement)
        return {name: columns(conn, name) for (name,) in conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'")}
    finally:
        conn.close()


def columns(conn: sqlite3.Connection, table: str) -> tuple[str, ...]:
    """The columns of ``table`` as the database's schema declares them, in order (none: no such table)."""
    return tuple(row[1] for row in conn.execute("SELECT * FROM pragma_table_info(?)", (table,)))


def schema_difference(conn: sqlite3.Connection, version: int) -> str | None:
    """How the tables of a database at ``version`` differ from what its migrations made (a damaged schema: a
    flipped byte in a column's name still parses), or None where they are the same."""
    for table, expected in tables_at(version).items():
        found = columns(conn, table)
        if found != expected:
            lacking = [c for c in expected if c not in found]
            return (f"table {table} lacks {', '.join(lacking)}" if lacking and found else
                    f"table {table} is missing" if not found else f"table {table} has columns {', '.join(found)}")
    return None


def migrate(conn: sqlite3.Connection, now: float, where: str) -> int:
    """Bring the database to :data:`LATEST` in one transaction; returns the version it was at.

    ``conn`` must be in autocommit mode (``isolation_level=None``): the transaction is explicit.

    Raises:
        StoreError: the database is newer than this code.
    """
    conn.execute("BEGIN IMMEDIATE")
    try:
        conn.execute("CREATE TABLE IF NOT EXISTS schema_version "
                     "(version INTEGER PRIMARY KEY, applied_at REAL NOT NULL)")
        old = current_version(conn)
        if old > LATEST:
            raise StoreError(f"{where} has schema version {old}, newer than this edgerev understands ({LATEST}); "
                             "upgrade edgerev or use another data directory")
        for version in range(old + 1, LATEST + 1):
            for statement in MIGRATIONS[version - 1]:
                conn.execute(statement)
            conn.execute("INSERT INTO schema_version (version, applied_at) VALUES (?, ?)", (version, now))
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    return old
