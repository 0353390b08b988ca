"""A reservation on a shared worker holds named devices (issue 30: "a reservation holds specific devices; backfill
uses the rest"): the best-linked set among those free now and those its soonest-ending jobs free, shown in the
reasons users read; the worker keeps backfill off them and gives the gang exactly them. Pure snapshots of
service/scheduling/policy.py on real machines' topologies (tests/fixtures/topo), then the scheduler's pass
(service/jobs/assigner.py: its assignments and holds) on both databases.
"""

from dataclasses import replace
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from rich.console import Console

from service.api.app import create_app
from service.cli import pool as cli_pool
from service.db import make_engine, make_sessionmaker
from service.jobs import assigner, lifecycle, queue
from service.jobs import service as jobs
from service.jobs.models import Job
from service.scheduling import assign, placement
from service.scheduling import service as scheduling
from service.scheduling.placement import Device, Level, Link, Machine, cpu_machine, machine_from_topo
from service.scheduling.policy import Node, plan
from service.workers import holds
from service.workers import service as workers
from tests.conftest import QUEUE_PREFIX, admin_token, mlp_spec
from tests.test_scheduler_policy import DAY, NOW, reason, running, snapshot, started, waiting
from trainjobs.spec import JobSpec
from trainjobs.states import JobStatus
from worker import devices as worker_devices

TOPO = Path(__file__).parent / "fixtures" / "topo"
GPUS = tuple(Device(i, f"GPU-{i:04x}") for i in range(8))
# Two sockets of four GPUs, PIX pairs (0-1, 2-3, 4-5, 6-7), NODE within a socket, SYS across.
PCIE = machine_from_topo("pcie", (TOPO / "pcie_4x4_dual_socket.txt").read_text(), GPUS)
NV = Link(Level.NV, 4)
# A board of two NVLink islands of four (0-3, 4-7), joined across sockets only.
ISLANDS = Machine("islands", "cuda", GPUS, {(a, b): NV if (a < 4) == (b < 4) else Link(Level.SYS)
                                            for a in range(8) for b in range(8) if a != b})


def shared(node_id: str, machine: Machine, held: dict[str, set[int]]) -> Node:
    """A shared 8-GPU worker of `machine`'s topology whose jobs hold `held` (job -> devices)."""
    busy = set().union(*held.values())
    free = frozenset(d.index for d in machine.devices) - busy
    return Node(node_id, "cuda", len(machine.devices), running=min(held) if held else None, room=len(free),
                machine=replace(machine, id=node_id), free_devices=free,
                held={job: frozenset(d) for job, d in held.items()})


def ends_in(job_id: str, worker: str, slots: int, seconds: float):
    """A job on `worker` whose timeout ends `seconds` from now."""
    return running(job_id, "carol", (worker,), slots=slots, started=NOW - 100, timeout_s=100 + seconds)


def gang(slots: int = 4) -> object:
    return waiting("gang", "alice", slots=slots, nodes=2, submitted=NOW - 1000)


# -- which devices a reservation holds (pure) --------------------------------------------------------------------


def test_a_reservation_holds_one_socket_of_a_pcie_machine_and_backfill_gets_the_other_socket():
    # w1: GPUs 0-2 end in 100 s, 4-5 in a day; 3, 6, 7 are free. The gang's 4 GPUs are free first at +100 s,
    # among 0-3, 6, 7: one socket (0-3) is the set whose worst link is NODE; any with 6 or 7 crosses sockets.
    w1 = shared("w1", PCIE, {"a": {0, 1, 2}, "b": {4, 5}})
    w2 = shared("w2", PCIE, {"c": set(range(8))})
    snap = snapshot([gang(), waiting("small", "bob", submitted=NOW - 10, timeout_s=DAY),
                     waiting("triple", "dave", slots=3, submitted=NOW - 5, timeout_s=DAY)],
                    [ends_in("a", "w1", 3, 100), ends_in("b", "w1", 2, DAY), ends_in("c", "w2", 8, 200)], [w1, w2])
    result = plan(snap)
    [reservation] = result.reservations
    assert reservation.devices == {"w1": (0, 1, 2, 3), "w2": (0, 1, 2, 3)}
    assert result.kept["w1"] == {"gang": (0, 1, 2, 3)}
    # Of w1's free GPUs only 3 is held: 6 and 7 stay open, so a 1-GPU job backfills there; a 3-GPU one cannot.
    assert started(result) == {"small": ["w1"]}
    assert reason(result, "gang") == "needs 2 nodes: reserved, 0 of 2 held (GPUs 0-3 on w1, GPUs 0-3 on w2)"
    assert "reserved for job gang (needs 2 nodes) holding GPUs 0-3 on w1" in reason(result, "triple")
    # What the worker's own pick would have been without the reservation: GPU 3, the one the gang waits for.
    assert placement.choose(w1.machine, set(w1.free_devices), 1) == (3,)


def test_a_reservation_holds_the_nvlink_island_that_the_soonest_ending_job_completes():
    # Free: 0, 4, 5. 6-7 end in 50 s (completing the island 4-7), 1-3 in 1,000 s: the gang holds 4-7 from +50 s.
    w1 = shared("w1", ISLANDS, {"pair": {6, 7}, "three": {1, 2, 3}})
    w2 = shared("w2", ISLANDS, {})
    snap = snapshot([gang()], [ends_in("pair", "w1", 2, 50), ends_in("three", "w1", 3, 1000)], [w2, w1])
    [reservation] = plan(snap).reservations
    assert reservation.workers == ["w2", "w1"] and reservation.held == 1
    assert reservation.devices == {"w1": (4, 5, 6, 7), "w2": (0, 1, 2, 3)}
    assert reservation.fill_at == NOW + 50


def test_a_filled_reservation_starts_the_gang_on_exactly_its_devices_and_the_rest_stay_open():
    w1 = shared("w1", ISLANDS, {"x": {0}})  # island 0-3 broken by x: the gang's 4 are the island 4-7
    w2 = shared("w2", ISLANDS, {"y": {4, 5}})  # island 4-7 broken: 0-3
    snap = snapshot([gang(), waiting("small", "bob", submitted=NOW - 10, timeout_s=DAY)],
                    [ends_in("x", "w1", 1, DAY), ends_in("y", "w2", 2, DAY)], [w1, w2])
    result = plan(snap)
    assert started(result) == {"gang": ["w1", "w2"], "small": ["w2"]}  # best fit: w2 has 2 left, w1 3
    assert result.kept == {"w1": {"gang": (4, 5, 6, 7)}, "w2": {"gang": (0, 1, 2, 3)}}
    assert placement.choose(ISLANDS, {0, 1, 2, 3, 6, 7} - {0, 1, 2, 3}, 1) == (6,)  # what w2 gives small


def test_a_forming_gang_holds_named_devices_on_the_worker_it_waits_for():
    w2 = shared("w2", PCIE, {"b": {0}})
    forming = running("gang", "alice", ("w1",), slots=4, nodes=2, started=NOW - 5, timeout_s=DAY,
                      need=gang().need)
    result = plan(snapshot([waiting("small", "bob", submitted=NOW - 10, timeout_s=DAY)], [forming,
                           ends_in("b", "w2", 1, DAY)], [shared("w1", PCIE, {"gang": {0, 1, 2, 3}}), w2]))
    assert result.kept["w2"] == {"gang": (4, 5, 6, 7)}  # one socket; the other's three stay for others
    assert "w1" not in result.kept  # the gang's node there runs: its devices are held, not kept
    assert started(result) == {"small": ["w1"]}  # best fit: w1 has 4 free, w2 7


def test_a_worker_without_known_devices_reserves_a_count_as_before():
    w1 = replace(shared("w1", PCIE, {"a": {0, 1, 2, 3, 4}}), machine=None, free_devices=None, held={})
    snap = snapshot([gang()], [ends_in("a", "w1", 5, 100), ends_in("c", "w2", 8, 200)],
                    [w1, shared("w2", PCIE, {"c": set(range(8))})])
    result = plan(snap)
    [reservation] = result.reservations
    assert "w1" not in reservation.devices and reservation.devices["w2"] == (0, 1, 2, 3)
    assert reason(result, "gang").startswith("needs 2 nodes: reserved, 0 of 2 held (4 GPUs on w1, GPUs 0-3 on w2)")


# -- the scheduler's view of a worker's devices, from its row -----------------------------------------------------


def test_a_gpu_workers_row_carries_its_links_and_the_scheduler_rebuilds_the_same_machine():
    rows = worker_devices.as_rows(PCIE)
    assert rows[0]["links"] == {"1": "PIX", "2": "NODE", "3": "NODE", "4": "SYS", "5": "SYS", "6": "SYS", "7": "SYS"}
    rebuilt = scheduling.machine_of("w1", "cuda", rows)
    assert all(rebuilt.link(a, b) == PCIE.link(a, b) for a in range(8) for b in range(8) if a != b)
    assert [d.numa_node for d in rebuilt.devices] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_a_cpu_workers_slots_link_by_numa_node_as_the_worker_links_them():
    cpu = cpu_machine("w1", range(8), {0: range(4), 1: range(4, 8)}, slots=4)
    rebuilt = scheduling.machine_of("w1", "cpu", worker_devices.as_rows(cpu))
    assert all(rebuilt.link(a, b) == cpu.link(a, b) for a in range(4) for b in range(4) if a != b)
    held = {0: ("job-a", 0)}
    fields = scheduling.devices_of("w1", "cpu", worker_devices.as_rows(cpu), held)
    assert fields["free_devices"] == frozenset({1, 2, 3}) and fields["held"] == {"job-a": frozenset({0})}
    assert scheduling.devices_of("w1", "cpu", None, held) == {}  # a worker of an earlier version: counts only


# -- the worker keeps backfill off them, and the gang gets exactly them (both databases) -----------------------------


def gpu_spec(name: str, nproc: int, *, nnodes: int = 1, timeout_s: float = DAY) -> JobSpec:
    return JobSpec.model_validate(mlp_spec(name=name, timeout_s=timeout_s,
                                           resources={"nnodes": nnodes, "nproc_per_node": nproc, "device": "cuda"}))


def run_on(db, job_id: str, worker: str, devices: list[int]) -> int:
    """Claim the job on `worker` holding `devices`, as the scheduler's pass and the worker's claim do."""
    assert holds.take(db, worker_id=worker, job_id=job_id, node_rank=0, devices=devices)
    attempt, _ = lifecycle.claim(db, job_id=job_id, worker=worker, lease_s=600)
    holds.bind(db, worker_id=worker, job_id=job_id, node_rank=0, attempt=attempt)
    assert lifecycle.start_running(db, job_id=job_id, attempt=attempt, detail="ranks launched")
    db.commit()
    return attempt


def end(db, job_id: str, attempt: int, worker: str) -> None:
    assert lifecycle.finish_node(db, job_id=job_id, attempt=attempt, node_rank=0, status=JobStatus.SUCCEEDED,
                                 summary=None, error=None, exit_code=0)
    holds.release(db, worker_id=worker, job_id=job_id)
    db.commit()


def two_pcie_workers(db, busy: list[tuple[str, int, float, str, list[int]]]) -> dict[str, tuple[str, int]]:
    """Shared workers w1 and w2 of the PCIe machine, and jobs (name, GPUs, timeout, worker, devices) running on
    them: name -> (job id, attempt)."""
    for w in ("w1", "w2"):
        workers.register(db, worker_id=w, host=w, address="10.0.0.1", device="cuda", slots=8,
                         memory_bytes=80 * 2**30, host_memory_bytes=2**40, labels={}, max_jobs=8,
                         devices=worker_devices.as_rows(replace(PCIE, id=w)))
    db.commit()
    out = {}
    for name, n, timeout_s, worker, devices in busy:
        job_id = jobs.create(db, spec=gpu_spec(name, n, timeout_s=timeout_s)).id
        db.commit()
        out[name] = job_id, run_on(db, job_id, worker, devices)
    return out


def enqueued(redis, *job_ids: str) -> None:
    for job_id in job_ids:
        queue.enqueue(redis, prefix=QUEUE_PREFIX, job_id=job_id, priority="normal", timeout_s=DAY)


def one_pass(sessions, redis, settings) -> assigner.Report:
    with sessions() as db:
        return assigner.run_pass(db, redis, settings, cache={})


# w1: GPUs 0-2 end in 600 s, 4-5 in a day, 3, 6 and 7 are free; w2: all 8 end in 1,200 s.
BUSY = [("soon", 3, 600, "w1", [0, 1, 2]), ("long", 2, DAY, "w1", [4, 5]), ("full", 8, 1200, "w2", list(range(8)))]


def test_backfill_on_a_reserved_worker_never_takes_a_reserved_gpu_and_the_gang_then_gets_them(settings, redis):
    settings = settings.model_copy(update={"reserve_after_s": 0.0})
    engine = make_engine(settings.database_url)
    sessions = make_sessionmaker(engine)
    try:
        with sessions() as db:
            running_jobs = two_pcie_workers(db, BUSY)
            the_gang = jobs.create(db, spec=gpu_spec("gang", 4, nnodes=2)).id
            smalls = [jobs.create(db, spec=gpu_spec(f"small{i}", 1)).id for i in range(3)]
            db.commit()
        enqueued(redis, the_gang, *smalls)

        report = one_pass(sessions, redis, settings)
        assert report.plan.reservations[0].devices == {"w1": (0, 1, 2, 3), "w2": (0, 1, 2, 3)}
        # GPUs 6 and 7 are open; 3 is the gang's: the third small job waits.
        assert sorted(p.job_id for p in report.assigned) == sorted(smalls[:2])
        assert {p.worker_id for p in report.assigned} == {"w1"}
        assert sorted(d for p in report.assigned for d in p.devices) == [6, 7]
        with sessions() as db:
            taken = holds.held(db, worker_id="w1")
            assert sorted(d for d, (job, _) in taken.items() if job in smalls) == [6, 7]
            assert 3 not in taken
            # The pass's plan, from the rows alone, says the same to the job left waiting.
            why = db.get(Job, smalls[2]).pending_reason
            assert "reserved for job " + the_gang + " (needs 2 nodes) holding GPUs 0-3 on w1" in why, why

            end(db, *running_jobs["soon"], "w1")
            end(db, *running_jobs["full"], "w2")
        report = one_pass(sessions, redis, settings)
        [gang_node] = [p for p in report.assigned if p.job_id == the_gang]
        assert gang_node.devices == (0, 1, 2, 3)  # node 0 on exactly the devices held for it
        with sessions() as db:
            taken = holds.held(db, worker_id=gang_node.worker_id)
        assert sorted(d for d, (job, _) in taken.items() if job == the_gang) == [0, 1, 2, 3]
    finally:
        engine.dispose()


@pytest.mark.parametrize("let", [True, False])
def test_a_job_that_ends_before_the_reservation_fills_may_take_its_devices(settings, redis, let):
    # Only GPU 3 of w1 is free and it is the gang's: a job the reservation lets (ends before the gang's GPUs do)
    # takes it; one that would outlast that waits.
    settings = settings.model_copy(update={"reserve_after_s": 0.0})
    engine = make_engine(settings.database_url)
    sessions = make_sessionmaker(engine)
    try:
        with sessions() as db:
            two_pcie_workers(db, [("soon", 3, 3000, "w1", [0, 1, 2]), ("long", 4, DAY, "w1", [4, 5, 6, 7]),
                                  ("full", 8, DAY, "w2", list(range(8)))])
            the_gang = jobs.create(db, spec=gpu_spec("gang", 4, nnodes=2)).id
            small = jobs.create(db, spec=gpu_spec("small", 1, timeout_s=60 if let else 2 * DAY)).id
            db.commit()
        enqueued(redis, the_gang, small)
        report = one_pass(sessions, redis, settings)
        assert [(p.job_id, p.worker_id, p.devices) for p in report.assigned] == ([(small, "w1", (3,))] if let else [])
        with sessions() as db:
            assert [d for d, (job, _) in holds.held(db, worker_id="w1").items() if job == small] == ([3] if let else [])
    finally:
        engine.dispose()


def test_the_queue_shows_which_devices_a_reservation_holds(settings, redis):
    settings = settings.model_copy(update={"reserve_after_s": 0.0})
    engine = make_engine(settings.database_url)
    try:
        with make_sessionmaker(engine)() as db:
            two_pcie_workers(db, BUSY)
            the_gang = jobs.create(db, spec=gpu_spec("gang", 4, nnodes=2)).id
            db.commit()
        with TestClient(create_app(settings)) as client:
            client.headers["Authorization"] = f"Bearer {admin_token(settings)}"
            queue = client.get("/v1/queue").json()
        [reserved] = queue["reservations"]
        assert (reserved["job_id"], reserved["held"]) == (the_gang, 0)
        assert reserved["devices"] == {"w1": [0, 1, 2, 3], "w2": [0, 1, 2, 3]}
        [place] = queue["jobs"]
        assert place["reason"] == "needs 2 nodes: reserved, 0 of 2 held (GPUs 0-3 on w1, GPUs 0-3 on w2)"
    finally:
        engine.dispose()


def test_trainjobs_queue_prints_the_devices_a_reservation_holds(monkeypatch):
    out = Console(markup=False, record=True, width=200)
    monkeypatch.setattr(cli_pool, "console", out)
    cli_pool.show_queue({"policy": "fair", "waiting": 1, "others_waiting": 0, "others_ahead": 0, "jobs": [],
                         "you": {"user": "alice", "team": None, "usage_device_hours": 0.0, "share": 0.0},
                         "reservations": [{"job_id": "g1", "workers": 2, "held": 0,
                                           "fill_by": "2026-12-07T01:00:00+00:00",
                                           "deadline": "2026-12-09T01:00:00+00:00",
                                           "devices": {"w1": [0, 1, 2, 3], "w2": [4, 5, 6, 7]}}]})
    assert ("reservation: 0 of 2 workers held for job g1, devices 0,1,2,3 on w1, devices 4,5,6,7 on w2, filled by "
            "2026-12-07 01:00:00") in out.export_text()


def test_the_pass_gives_a_job_its_kept_devices_while_healthy_and_keeps_every_other_job_off_them():
    kept = {"gang": (0, 1, 2, 3), "forming": (6,)}
    assert assign.pick(PCIE, set(range(8)), 4, "gang", kept, {}) == (0, 1, 2, 3)
    small = assign.pick(PCIE, set(range(8)), 1, "small", kept, {})
    assert small is not None and not set(small) & {0, 1, 2, 3, 6}
    assert assign.pick(PCIE, {3, 6}, 1, "small", kept, {}) is None  # only kept devices are free: it waits
    let = {"short": {0, 1, 2, 3}}  # a job that ends before the gang's devices free up
    assert assign.pick(PCIE, {3, 6}, 1, "short", kept, let) == (3,)
    # A kept GPU that turned unhealthy is not given: the gang gets the best healthy set, still not 6.
    sick = replace(PCIE, devices=tuple(replace(d, healthy=d.index != 2) for d in PCIE.devices))
    got = assign.pick(sick, set(range(8)), 4, "gang", kept, {})
    assert got is not None and len(got) == 4 and not set(got) & {2, 6}
