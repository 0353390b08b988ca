"""Submissions admitted together (service/jobs/admission.py's admit_many, the API's admitter): each keeps the answer
it would get alone, and one refused never harms another."""

import asyncio
import threading

from sqlalchemy import select

from service.api.admitter import Admitter
from service.auth.limits import TooManyRequests
from service.auth.tokens import Principal
from service.db import make_engine, make_sessionmaker
from service.errors import Forbidden, IdempotencyConflict, NotFound
from service.jobs import admission
from service.jobs import service as jobs
from service.jobs.bodies import RenderedJobs
from service.jobs.models import Job, JobEvent, JobTag
from tests.conftest import QUEUE_PREFIX, mlp_spec
from tests.helpers import queued_ids
from trainjobs.spec import JobSpec

ALICE = Principal(user="alice", role="user", token_id=None, can_run_entrypoints=False)
BOB = Principal(user="bob", role="user", token_id=None, can_run_entrypoints=True)


def spec(**overrides) -> JobSpec:
    return JobSpec.model_validate(mlp_spec(**overrides))


def sessions(settings):
    engine = make_engine(settings.database_url)
    return engine, make_sessionmaker(engine)


def test_a_batch_answers_each_submission_as_alone_and_stores_and_enqueues_only_the_accepted(settings, redis):
    settings = settings.model_copy(update={"quota_active_jobs": 2})
    engine, factory = sessions(settings)
    own_code = mlp_spec(model=None, data=None, entrypoint={"module": "train"})
    asked = [
        admission.Submission(spec(tags=["a", "b"]), ALICE, "k1"),
        admission.Submission(JobSpec.model_validate(own_code), ALICE),  # alice may not run her own code
        admission.Submission(spec(tags=["a", "b"]), ALICE, "k1"),  # a retry of the first, inside the batch
        admission.Submission(spec(name="other"), ALICE, "k1"),  # the first's key with another spec
        admission.Submission(spec(), ALICE),  # alice's second: her quota's last
        admission.Submission(spec(), ALICE),  # her third: over it
        admission.Submission(JobSpec.model_validate({**own_code, "entrypoint": {
            "module": "train", "package": "sha256:" + "0" * 64}}), BOB),  # no such package
        admission.Submission(spec(), BOB, "k1"),  # keys are per owner
    ]
    with factory() as db:
        out = admission.admit_many(asked, db=db, redis=redis, settings=settings)
    first, refused, retry, conflict, second, over, missing, bobs = out
    assert first[1] is True and second[1] is True and bobs[1] is True
    assert retry[0].id == first[0].id and retry[1] is False
    assert isinstance(conflict, IdempotencyConflict) and first[0].id in conflict.message
    assert isinstance(refused, Forbidden) and refused.field == "entrypoint"
    assert isinstance(over, TooManyRequests) and over.field == "quota"
    assert isinstance(missing, NotFound) and missing.field == "entrypoint.package"
    made = [first[0].id, second[0].id, bobs[0].id]
    with factory() as db:
        assert sorted(db.scalars(select(Job.id))) == sorted(made)
        assert sorted(db.scalars(select(JobTag.tag).where(JobTag.job_id == first[0].id))) == ["a", "b"]
        assert sorted(db.scalars(select(JobEvent.job_id).where(JobEvent.kind == "queued"))) == sorted(made)
    assert sorted(queued_ids(redis, prefix=QUEUE_PREFIX)) == sorted(made)
    engine.dispose()


def test_a_key_committed_by_another_process_mid_batch_answers_its_job_and_the_rest_are_still_stored(
        settings, redis, monkeypatch):
    engine, factory = sessions(settings)
    with factory() as db:
        theirs = jobs.create(db, spec=spec(), owner="alice", idempotency_key="raced")
        db.commit()
    # As if it committed after this batch looked for its key: the INSERT is what finds it.
    monkeypatch.setattr(jobs, "find_by_keys", lambda db, keys: {})
    asked = [admission.Submission(spec(), ALICE), admission.Submission(spec(), ALICE, "raced"),
             admission.Submission(spec(name="other"), BOB, "raced-too")]
    with factory() as db:
        mine, raced, bobs = admission.admit_many(asked, db=db, redis=redis, settings=settings)
    assert mine[1] is True and bobs[1] is True
    assert raced[0].id == theirs.id and raced[1] is False
    with factory() as db:
        assert len(db.scalars(select(Job.id)).all()) == 3
    assert sorted(queued_ids(redis, prefix=QUEUE_PREFIX)) == sorted([mine[0].id, bobs[0].id])
    engine.dispose()


def test_concurrent_submissions_share_batches_and_each_gets_its_own_job(settings, redis, monkeypatch):
    engine, factory = sessions(settings)
    sizes: list[int] = []
    first_batch = threading.Event()
    real = admission.admit_many

    def admit_many(asked, **kw):
        sizes.append(len(asked))
        first_batch.wait(5)  # the rest queue up behind the first
        return real(asked, **kw)

    monkeypatch.setattr(admission, "admit_many", admit_many)
    admitter = Admitter(settings, factory, redis, RenderedJobs(), needs={})

    async def submit_all():
        tasks = [asyncio.ensure_future(admitter.admit(admission.Submission(spec(), ALICE))) for _ in range(20)]
        await asyncio.sleep(0.2)
        first_batch.set()
        return await asyncio.gather(*tasks)

    answers = asyncio.run(submit_all())
    admitter.close()
    assert sum(sizes) == 20 and len(sizes) < 20
    assert all(a.created for a in answers) and len({a.job_id for a in answers}) == 20
    assert all(a.body.startswith(b'{"id":"' + a.job_id.encode()) for a in answers)
    with factory() as db:
        assert len(db.scalars(select(Job.id)).all()) == 20
    assert len(queued_ids(redis, prefix=QUEUE_PREFIX)) == 20
    engine.dispose()


def test_a_batch_that_fails_whole_answers_each_submission_with_the_error(settings, redis, monkeypatch):
    engine, factory = sessions(settings)

    def down(asked, **kw):
        raise ConnectionError("the database is gone")

    monkeypatch.setattr(admission, "admit_many", down)
    admitter = Admitter(settings, factory, redis, RenderedJobs(), needs={})

    async def submit_all():
        return await asyncio.gather(*(admitter.admit(admission.Submission(spec(), ALICE)) for _ in range(3)),
                                    return_exceptions=True)

    answers = asyncio.run(submit_all())
    admitter.close()
    assert [type(a) for a in answers] == [ConnectionError] * 3
    engine.dispose()


def test_a_bug_one_spec_trips_fails_that_submission_alone(settings, redis, monkeypatch):
    engine, factory = sessions(settings)
    real = jobs.new_job

    def new_job(spec, **kw):
        if spec.name == "boom":
            raise RuntimeError("a bug")
        return real(spec, **kw)

    monkeypatch.setattr(jobs, "new_job", new_job)
    with factory() as db:
        before, boom, after = admission.admit_many([admission.Submission(spec(), ALICE),
                                                    admission.Submission(spec(name="boom"), ALICE),
                                                    admission.Submission(spec(), BOB)],
                                                   db=db, redis=redis, settings=settings)
    assert isinstance(boom, RuntimeError) and before[1] is True and after[1] is True
    assert sorted(queued_ids(redis, prefix=QUEUE_PREFIX)) == sorted([before[0].id, after[0].id])
    engine.dispose()
