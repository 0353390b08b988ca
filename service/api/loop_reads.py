"""The hottest reads on the event loop: a job's owner and version (its ETag), its series' newest points.

A poll of a job is an owner check and a version: for a client that holds that version (a 304), or a body
this process rendered for it (service/jobs/bodies.py), that is the whole request. On PostgreSQL it runs
here, on the event loop's own autocommit psycopg connections: one round trip, where a session in the
threadpool costs a thread's turn, SQLAlchemy's execution and a pre-ping, BEGIN and ROLLBACK around it.
The same for a chart (GET .../metrics): the owner check and the newest point's id, which is the version of a
chart this process rendered before (service/metrics/charts.py). SQLite (the embedded `trainjobs up`) has
none of these connections: its reads keep the threadpool.
"""

import asyncio
import logging

import psycopg
from sqlalchemy.engine import make_url

from service.db import CONNECT_TIMEOUT_S

log = logging.getLogger(__name__)

# What a database out of reach raises here (the app answers it with a 503, as service.db.UNREACHABLE).
UNREACHABLE = (psycopg.OperationalError, psycopg.InterfaceError)
APPLICATION_NAME = "trainjobs-api-loop"  # in pg_stat_activity
JOB_HEAD = "SELECT owner, version FROM jobs WHERE id = %s"
# The owner, node 0's newest point (the event stream's cursor) and node_rank's (the version of its series): two
# index lookups on ix_metrics_job_node_id.
SERIES_HEAD = """SELECT owner, (SELECT max(id) FROM metrics WHERE job_id = jobs.id AND node_rank = 0),
       (SELECT max(id) FROM metrics WHERE job_id = jobs.id AND node_rank = %s) FROM jobs WHERE id = %s"""


class LoopReads:
    """A few autocommit connections, used by one event loop at a time: opened on demand, kept while they
    work. A pooled connection that fails (the server restarted) is dropped with every idle one, and the read
    is tried once on a new connection; a second failure is the caller's (a 503: the database is out of reach).
    """

    def __init__(self, url: str, *, size: int = 8):
        self.conninfo = make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
        self.size = size
        self.idle: list[psycopg.AsyncConnection] = []
        self._slots: asyncio.Semaphore | None = None

    @classmethod
    def for_url(cls, url: str) -> "LoopReads | None":
        return cls(url) if make_url(url).get_backend_name() == "postgresql" else None

    async def job_head(self, job_id: str) -> tuple[str, int] | None:
        """The job's (owner, version), or None if there is no such job."""
        return await self._fetchone(JOB_HEAD, (job_id,))

    async def series_head(self, job_id: str, node_rank: int) -> tuple[str, int, int] | None:
        """The job's (owner, node 0's newest point id, node_rank's newest point id), 0 for none; None if no job."""
        row = await self._fetchone(SERIES_HEAD, (node_rank, job_id))
        return None if row is None else (row[0], row[1] or 0, row[2] or 0)

    async def _fetchone(self, sql: str, params: tuple) -> tuple | None:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.size)
        async with self._slots:
            for fresh in (False, True):
                conn = self.idle.pop() if self.idle and not fresh else await self._connect()
                try:
                    cursor = await conn.execute(sql, params)
                    row = await cursor.fetchone()
                except UNREACHABLE:
                    await conn.close()
                    if fresh:
                        raise
                    await self._drop_idle()  # from before the failure: as stale
                    continue
                except BaseException:  # a cancelled request (the client left): the connection's state is unknown
                    await conn.close()
                    raise
                self.idle.append(conn)
                return row
        raise AssertionError("unreachable")

    async def _connect(self) -> psycopg.AsyncConnection:
        return await psycopg.AsyncConnection.connect(self.conninfo, autocommit=True, connect_timeout=CONNECT_TIMEOUT_S,
                                                     application_name=APPLICATION_NAME)

    async def _drop_idle(self) -> None:
        stale, self.idle = self.idle, []
        for conn in stale:
            await conn.close()

    async def close(self) -> None:
        await self._drop_idle()
