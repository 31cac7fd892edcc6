"""Where a thread's checkpoints live: SQLite beside the store, or PostgreSQL with the store."""

from __future__ import annotations

from agent.graph.state import Services
from agent.lifecycle import Status
from pipeline.api import Verdict

CHECKPOINT_SETUP_LOCK = 7_272_742  # a PostgreSQL advisory lock: one process at a time sets the saver up
STATE_TYPES = (Status, Verdict)  # the only types of ours a checkpoint holds (`State`)


def serializer():
    """langgraph's serializer, strict: a checkpoint reads back LangGraph's own safe types and
    `STATE_TYPES`, nothing else (an unlisted type would be a warning today, refused tomorrow)."""
    from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer

    return JsonPlusSerializer(allowed_msgpack_modules=list(STATE_TYPES))


def open_checkpointer(svc: Services):
    """SQLite beside the store by default; the Postgres saver when the store is PostgreSQL."""
    url = svc.store.url
    if url.startswith("postgresql"):
        import psycopg
        from langgraph.checkpoint.postgres import PostgresSaver

        conn = psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://"), autocommit=True,
                               prepare_threshold=0)
        saver = PostgresSaver(conn, serde=serializer())
        conn.execute("SELECT pg_advisory_lock(%s)", (CHECKPOINT_SETUP_LOCK,))  # drivers starting together
        try:
            saver.setup()
        finally:
            conn.execute("SELECT pg_advisory_unlock(%s)", (CHECKPOINT_SETUP_LOCK,))
        return saver
    import sqlite3

    from langgraph.checkpoint.sqlite import SqliteSaver

    path = svc.lab.state / "checkpoints.sqlite"
    path.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(str(path), check_same_thread=False, timeout=30)
    conn.execute("PRAGMA journal_mode=WAL")
    return SqliteSaver(conn, serde=serializer())
