"""Placement prefers a worker that has the job's image (issue 44, a soft preference): the worker says which images
it has unpacked (worker/images.py `cached`: digests and the references they were pulled by), its heartbeat sends
them when they change, the API keeps them on its row, and the scheduler's snapshot hands them to the plan (the
plan's own choice: tests/test_scheduler_policy.py)."""

import threading

from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from service.scheduling import live
from service.settings import Settings
from tests.test_worker_join import INVENTORY, as_worker, join, join_token
from worker import images
from worker.inventory import probe, start_heartbeat

DIGEST = "ab" * 32


def test_a_worker_names_the_images_it_has_unpacked_by_digest_and_by_the_references_it_pulled(tmp_path):
    settings = Settings(data_dir=tmp_path)
    assert images.cached(settings) == []
    cache = tmp_path / "image-cache"
    (cache / DIGEST / "rootfs").mkdir(parents=True)
    (cache / ("cd" * 32)).mkdir()  # a pull that never finished: no rootfs
    for reference in ("registry.example.com/team/train:2025-11", "registry.example.com/team/train:2025-11",
                      "registry.example.com/team/train:latest"):
        images._remember(cache / f"{DIGEST}.refs", reference)
    assert (cache / f"{DIGEST}.refs").read_text().count("2025-11") == 1
    assert images.cached(settings) == ["registry.example.com/team/train:2025-11",
                                       "registry.example.com/team/train:latest", f"sha256:{DIGEST}"]


class Beats:
    """A control that records what each beat says."""

    def __init__(self):
        self.sent, self.done = [], threading.Event()

    def register(self, inventory: dict) -> None:
        pass

    def beat(self, **beat) -> bool:
        self.sent.append(beat["images"])
        if len(self.sent) >= 4:
            self.done.set()
        return True

    def remove(self, worker_id: str) -> None:
        pass


def test_the_heartbeat_sends_the_images_only_when_they_change(tmp_path):
    settings = Settings(data_dir=tmp_path, worker_slots=1, worker_device="cpu")
    have = iter([["a"], ["a"], ["a", "b"], ["a", "b"], ["a", "b"]])
    control = Beats()
    stop = start_heartbeat(control, offer=probe(settings, name="w-1"), every_s=0.05, draining=lambda: False,
                           images=lambda: next(have, ["a", "b"]))
    assert control.done.wait(10)
    stop()
    assert control.sent[:4] == [["a"], None, ["a", "b"], None]


def test_the_images_a_heartbeat_names_reach_the_scheduler_s_snapshot(client, settings):
    mine = as_worker(join(client, join_token(client), "gpu-7").json()["credential"])
    assert client.post("/v1/worker/register", json={"worker_id": "gpu-7-1", **INVENTORY},
                       headers=mine).status_code == 204
    named = ["registry.example.com/team/train:2025-11", f"sha256:{DIGEST}"]
    beat = client.post("/v1/worker/tick", json={"heartbeat": {"worker_id": "gpu-7-1", "images": named}},
                       headers=mine)
    assert beat.status_code == 200 and beat.json()["heartbeat"] == {"registered": True}
    again = client.post("/v1/worker/heartbeat", json={"worker_id": "gpu-7-1"}, headers=mine)  # unchanged: kept
    assert again.status_code == 200
    engine = create_engine(settings.resolved_database_url)
    with Session(engine) as db:
        [node], _ = live.live_nodes(db, lost_after_s=60)
    engine.dispose()
    assert node.id == "gpu-7-1" and node.images == frozenset(named)
    too_long = client.post("/v1/worker/heartbeat", json={"worker_id": "gpu-7-1", "images": ["x" * 601]},
                           headers=mine)
    assert too_long.status_code == 422 and "images" in too_long.text
