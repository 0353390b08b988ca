"""Shipping output to the database: byte offsets across attempts, split UTF-8, the per-job cap."""

from service.db import make_engine, make_sessionmaker
from service.jobs import service as jobs
from service.jobs.spec import JobSpec
from service.logs import service as logs
from tests.conftest import mlp_spec
from worker.shipping import LogShipper


def test_log_is_one_byte_stream_that_survives_split_utf8_and_is_capped(settings):
    engine = make_engine(settings.database_url)
    sessions = make_sessionmaker(engine)
    with sessions() as db:
        job_id = jobs.create(db, spec=JobSpec.model_validate(mlp_spec())).id
        db.commit()
        first = LogShipper(db, job_id=job_id, attempt=1, max_bytes=64)
        snowman = "☃".encode()
        first.stage(b"a" + snowman[:1])  # a character split across two reads
        first.write(db)
        db.commit()
        first.committed()
        first.stage(snowman[1:] + b"b\n")
        first.write(db)
        db.commit()
        first.committed()
        assert logs.read(db, job_id=job_id) == ("a☃b\n".encode(), 6)
        second = LogShipper(db, job_id=job_id, attempt=2, max_bytes=64)  # a later attempt appends
        assert second.offset == 6
        second.stage(b"x" * 100)
        second.write(db)
        db.commit()
        second.committed()
        second.stage(b"more")
        second.write(db)
        data, end = logs.read(db, job_id=job_id)
        assert data.startswith("a☃b\n".encode() + b"x" * 58) and data.endswith(b"log truncated at 64 bytes\n")
        assert b"more" not in data
        assert logs.read(db, job_id=job_id, offset=end - 5) == (data[-5:], end)
    engine.dispose()
