"""Stragglers (issue 18): the built-in runtime reports each rank's own step time once per log window (one small
all_gather, no collective per step); the supervisor names a rank that stays well above the others."""

import pytest
from sqlalchemy import create_engine, select

from service.jobs.models import JobEvent
from tests.conftest import mlp_spec
from tests.helpers import module_stack, wait_terminal

stack = module_stack("stragglers")


def straggler_events(url: str, job_id: str) -> list[str]:
    engine = create_engine(url)
    try:
        with engine.connect() as db:
            return list(db.execute(select(JobEvent.detail).where(JobEvent.job_id == job_id,
                                                                  JobEvent.kind == "straggler")).scalars())
    finally:
        engine.dispose()


@pytest.mark.alone  # step times: an even job's ranks stay within 1.3x of each other
def test_a_rank_slowed_on_purpose_is_named_and_an_even_job_gets_no_warning(api, stack, postgres_url):
    train = {"max_steps": 60, "log_every": 5, "seed": 0}
    slowed = api.post("/v1/jobs", json=mlp_spec(name="slowed", train=train, fault_injection={
        "sleep_per_step_s": 0.02, "rank": 1})).json()["id"]
    even = api.post("/v1/jobs", json=mlp_spec(name="even", train=train)).json()["id"]
    slowed, even = wait_terminal(api, slowed), wait_terminal(api, even)
    assert slowed["status"] == even["status"] == "succeeded"

    [warning] = slowed["warnings"]
    assert warning["kind"] == "straggler" and warning["rank"] == 1 and warning["attempt"] == 1
    assert "rank 1 is a straggler" in warning["message"] and "3 log windows in a row" in warning["message"]
    assert straggler_events(postgres_url, slowed["id"]) == [warning["message"]]
    series = api.get(f"/v1/jobs/{slowed['id']}/metrics").json()["series"]
    per_rank = {s["name"]: s["values"] for s in series if s["name"].startswith("step_time_s/rank")}
    assert set(per_rank) == {"step_time_s/rank0", "step_time_s/rank1"} and len(per_rank["step_time_s/rank1"]) == 12
    assert min(per_rank["step_time_s/rank1"]) >= 0.02 > max(per_rank["step_time_s/rank0"])

    assert even["warnings"] == [] and straggler_events(postgres_url, even["id"]) == []
