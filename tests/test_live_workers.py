"""The live workers as the plan sees them (service/scheduling/live.py): read as columns, each worker's parsed
machine kept between passes, and never stale: a device turned unhealthy, a hold taken or given back and a worker
draining show in the next snapshot. On both databases.
"""

from datetime import timedelta

from sqlalchemy import update

from service.db import make_engine, make_sessionmaker, utcnow
from service.scheduling import live
from service.workers import holds
from service.workers import service as workers
from service.workers.models import Worker

GIB = 2**30


def rows(unhealthy: frozenset[int] = frozenset()) -> list[dict]:
    """Eight GPUs as worker/devices.py as_rows gives them: two NVLink islands of four."""
    return [{"index": d, "uuid": f"GPU-{d:04x}", "memory_bytes": 80 * GIB, "healthy": d not in unhealthy,
             "numa_node": d // 4, "cores": [], "reason": "Xid 79" if d in unhealthy else None,
             "links": {str(o): "NV4" if o // 4 == d // 4 else "SYS" for o in range(8) if o != d}} for d in range(8)]


def register(db, worker_id: str, *, max_jobs: int = 8) -> None:
    workers.register(db, worker_id=worker_id, host=worker_id, address="10.0.0.1", device="cuda", slots=8,
                     memory_bytes=80 * GIB, host_memory_bytes=None, labels={"zone": "a"}, max_jobs=max_jobs,
                     devices=rows())


def nodes_of(db) -> dict:
    nodes, claiming = live.live_nodes(db, lost_after_s=60.0)
    return {n.id: n for n in nodes}, claiming


def test_a_device_turned_unhealthy_and_holds_taken_or_given_back_show_in_the_next_snapshot(db_url):
    engine = make_engine(db_url)
    with make_sessionmaker(engine)() as db:
        register(db, "w1")
        register(db, "w2")
        db.commit()
        first, claiming = nodes_of(db)
        assert first["w1"].room == 8 and first["w1"].free_devices == frozenset(range(8)) and not claiming
        assert first["w1"].machine.link(0, 1).level.name == "NV" and first["w1"].labels == {"zone": "a"}

        db.execute(update(Worker).where(Worker.id == "w1").values(devices=rows(frozenset({3}))))
        assert holds.take(db, worker_id="w2", job_id="j1", node_rank=0, devices=[0, 1])
        db.commit()
        second, claiming = nodes_of(db)
        assert second["w1"].room == 7 and second["w1"].free_devices == frozenset(range(8)) - {3}
        assert not second["w1"].machine.devices[3].healthy
        assert second["w2"].room == 6 and second["w2"].free_devices == frozenset(range(2, 8))
        assert second["w2"].held == {"j1": frozenset({0, 1})} and claiming == {"j1"}

        holds.release_pending(db, worker_id="w2", job_id="j1", node_rank=0)
        db.commit()
        third, claiming = nodes_of(db)
        assert third["w2"] == first["w2"] and not claiming  # as it was: the first pass's parse, kept
    engine.dispose()


def test_draining_lost_and_pressed_workers_take_nothing_but_their_holds_still_count(db_url):
    engine = make_engine(db_url)
    with make_sessionmaker(engine)() as db:
        for w in ("busy", "drains", "full", "lost", "single"):
            register(db, w, max_jobs=1 if w == "single" else 8)
        assert holds.take(db, worker_id="drains", job_id="j2", node_rank=0, devices=[5])
        db.execute(update(Worker).where(Worker.id == "drains").values(state="draining"))
        db.execute(update(Worker).where(Worker.id == "full").values(pressure="disk below 10 GiB"))
        db.execute(update(Worker).where(Worker.id == "lost").values(last_seen=utcnow() - timedelta(hours=1)))
        db.execute(update(Worker).where(Worker.id == "single").values(current_job="j3"))
        db.commit()
        nodes, claiming = nodes_of(db)
    engine.dispose()
    assert sorted(nodes) == ["busy", "single"]
    assert claiming == {"j2"}  # being claimed on a worker that drains: the plan must not place it again
    single = nodes["single"]
    assert single.room is None and single.running == "j3" and single.machine is None and single.free_slots == 0
