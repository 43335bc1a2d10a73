"""Chats on disk: one SQLite file of sessions, messages and per-reply stats.

Every write commits at once (autocommit, WAL journal), so a finished message survives a crash or a
kill. The database lives in the platform's user data directory; `--data-dir` or the MTPCHAT_DATA_DIR
environment variable move it.
"""
from __future__ import annotations

import json
import os
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

import platformdirs

from mtpchat.errors import UserError

ENV_DATA_DIR = "MTPCHAT_DATA_DIR"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    id INTEGER PRIMARY KEY,
    title TEXT NOT NULL,
    system TEXT NOT NULL DEFAULT '',
    model TEXT NOT NULL DEFAULT '',
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY,
    session_id INTEGER NOT NULL REFERENCES sessions(id) ON DELETE CASCADE,
    role TEXT NOT NULL,
    content TEXT NOT NULL,
    thinking TEXT NOT NULL DEFAULT '',
    spans TEXT,          -- JSON run lengths of the answer: [[chars, from_draft], ...]
    stats TEXT,          -- JSON Stats.as_dict() of the reply, plus its settings
    created REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS messages_by_session ON messages(session_id, id);
CREATE TABLE IF NOT EXISTS prefs (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""
# The schema's version, kept in the database (PRAGMA user_version). A change of schema raises it and
# adds the step from the one before to MIGRATIONS, applied in order when an older file is opened.
# 0 is a file from before the version was kept: the same tables as version 1.
SCHEMA_VERSION = 1
MIGRATIONS: dict[int, str] = {}      # version -> the SQL that takes a file of version - 1 to it


def data_dir(override: str | os.PathLike | None = None) -> Path:
    """--data-dir, then $MTPCHAT_DATA_DIR, then the platform's user data directory."""
    if override:
        return Path(override).expanduser()
    if os.environ.get(ENV_DATA_DIR):
        return Path(os.environ[ENV_DATA_DIR]).expanduser()
    return Path(platformdirs.user_data_dir("mtpchat", appauthor=False))


@dataclass(frozen=True)
class SessionRow:
    id: int
    title: str
    system: str
    model: str
    created: float
    updated: float
    messages: int


@dataclass(frozen=True)
class MessageRow:
    id: int
    session_id: int
    role: str
    content: str
    thinking: str
    spans: list | None
    stats: dict | None
    created: float


class Store:
    def __init__(self, folder: str | os.PathLike, now=time.time):
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / "chats.sqlite3"
        self.now = now
        self.db = sqlite3.connect(self.path, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA foreign_keys=ON")
        self._migrate()

    def _migrate(self) -> None:
        version = self.db.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            self.db.close()
            raise UserError(f"{self.path} was written by a newer mtpchat (chat schema {version}; this one reads up "
                            f"to {SCHEMA_VERSION}); upgrade mtpchat, or pass --data-dir to use another folder. "
                            "The file is left as it is")
        self.db.executescript(_SCHEMA)
        for step in range(max(version, 1) + 1, SCHEMA_VERSION + 1):
            self.db.executescript(f"BEGIN; {MIGRATIONS[step]}; COMMIT;")
        if version != SCHEMA_VERSION:
            self.db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    def close(self) -> None:
        self.db.close()

    # --- sessions ---
    def create_session(self, title: str, system: str = "", model: str = "") -> int:
        t = self.now()
        cur = self.db.execute("INSERT INTO sessions (title, system, model, created, updated) VALUES (?,?,?,?,?)",
                              (title, system, model, t, t))
        return cur.lastrowid

    def sessions(self) -> list[SessionRow]:
        rows = self.db.execute(
            "SELECT s.id, s.title, s.system, s.model, s.created, s.updated, COUNT(m.id) FROM sessions s "
            "LEFT JOIN messages m ON m.session_id = s.id GROUP BY s.id ORDER BY s.updated DESC, s.id DESC")
        return [SessionRow(*r) for r in rows]

    def session(self, session_id: int) -> SessionRow | None:
        return next((s for s in self.sessions() if s.id == session_id), None)

    def set_system(self, session_id: int, system: str) -> None:
        self.db.execute("UPDATE sessions SET system = ? WHERE id = ?", (system, session_id))

    def rename(self, session_id: int, title: str) -> None:
        self.db.execute("UPDATE sessions SET title = ? WHERE id = ?", (title, session_id))

    def delete_session(self, session_id: int) -> None:
        self.db.execute("DELETE FROM sessions WHERE id = ?", (session_id,))

    # --- messages ---
    def add_message(self, session_id: int, role: str, content: str, thinking: str = "",
                    spans: list | None = None, stats: dict | None = None) -> int:
        t = self.now()
        cur = self.db.execute(
            "INSERT INTO messages (session_id, role, content, thinking, spans, stats, created) VALUES (?,?,?,?,?,?,?)",
            (session_id, role, content, thinking, json.dumps(spans) if spans is not None else None,
             json.dumps(stats) if stats is not None else None, t))
        self.db.execute("UPDATE sessions SET updated = ? WHERE id = ?", (t, session_id))
        return cur.lastrowid

    def messages(self, session_id: int) -> list[MessageRow]:
        rows = self.db.execute("SELECT id, session_id, role, content, thinking, spans, stats, created "
                               "FROM messages WHERE session_id = ? ORDER BY id", (session_id,))
        return [MessageRow(i, s, r, c, th, json.loads(sp) if sp else None, json.loads(st) if st else None, t)
                for i, s, r, c, th, sp, st, t in rows]

    def delete_message(self, message_id: int) -> None:
        self.db.execute("DELETE FROM messages WHERE id = ?", (message_id,))

    # --- preferences (theme, last system prompt) ---
    def get_pref(self, key: str, default: str | None = None) -> str | None:
        row = self.db.execute("SELECT value FROM prefs WHERE key = ?", (key,)).fetchone()
        return row[0] if row else default

    def set_pref(self, key: str, value: str) -> None:
        self.db.execute("INSERT INTO prefs (key, value) VALUES (?, ?) "
                        "ON CONFLICT(key) DO UPDATE SET value = excluded.value", (key, value))


def encode_spans(spans) -> list[list[int]]:
    """[(text, from_draft), ...] -> [[chars, 0|1], ...] (the text itself is the message content)."""
    return [[len(text), int(d)] for text, d in spans]


def decode_spans(content: str, runs) -> list[tuple[str, bool]] | None:
    if not runs:
        return None
    out, i = [], 0
    for n, d in runs:
        out.append((content[i:i + n], bool(d)))
        i += n
    return out if i == len(content) else None   # edited or truncated text: drop the tint
