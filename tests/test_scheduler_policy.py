"""The pool's scheduling decision (service/scheduling/policy.py), pure: snapshots in, what a user would see out."""

import math

import pytest

from service.scheduling.policy import (
    Account,
    Node,
    Running,
    Settings,
    Snapshot,
    Team,
    Waiting,
    decayed,
    order,
    plan,
)
from service.workers.fit import Need

NOW = 10_000.0
DEFAULTS = Settings()
DAY = 86_400.0


def waiting(job_id: str, owner: str = "alice", *, priority: str = "normal", spec_priority: str | None = None,
            submitted: float = 0.0, queued: float | None = None, slots: int = 1, nodes: int = 1,
            timeout_s: float = 3600.0, not_before: float | None = None) -> Waiting:
    return Waiting(job_id, owner, priority, spec_priority or priority, submitted,
                   submitted if queued is None else queued, Need("cuda", slots, None, None, nodes=nodes), timeout_s,
                   not_before)


def running(job_id: str, owner: str, workers: tuple[str, ...], *, priority: str = "normal", slots: int = 1,
            started: float = 0.0, timeout_s: float = 3600.0, nodes: int | None = None, preemptible: bool = True,
            preempt_requested: bool = False, need: Need | None = None) -> Running:
    return Running(job_id, owner, priority, slots, nodes or len(workers), started, timeout_s, workers, need,
                   preemptible=preemptible, preempt_requested=preempt_requested)


def node(node_id: str, slots: int = 1, running_job: str | None = None) -> Node:
    return Node(node_id, "cuda", slots, running=running_job)


def snapshot(waiting_jobs=(), running_jobs=(), nodes=(), *, usage=None, accounts=None, teams=None,
             settings: Settings = DEFAULTS, now: float = NOW) -> Snapshot:
    return Snapshot(now, list(waiting_jobs), list(running_jobs), list(nodes), usage or {}, accounts or {},
                    teams or {}, settings)


def ids(jobs: list[Waiting]) -> list[str]:
    return [j.id for j in jobs]


def reason(result, job_id: str) -> str | None:
    return result.place(job_id).reason


def started(result) -> dict[str, list[str]]:
    return {p.job_id: p.workers for p in result.order if p.workers}


# -- order ---------------------------------------------------------------------------------------------------


def test_high_goes_before_normal_before_low_whatever_the_usage():
    snap = snapshot([waiting("low", "light", priority="low", submitted=1),
                     waiting("normal", "light", submitted=2),
                     waiting("high", "heavy", priority="high", submitted=3)], usage={"heavy": 1e9})
    assert ids(order(snap)) == ["high", "normal", "low"]


def test_the_user_with_less_usage_goes_first():
    snap = snapshot([waiting("a1", "alice", submitted=1), waiting("b1", "bob", submitted=2)],
                    usage={"alice": 500.0, "bob": 100.0})
    assert ids(order(snap)) == ["b1", "a1"]


def test_a_burst_of_one_user_interleaves_with_another_users_jobs():
    # Issue 16's scenario: A submits 6 jobs, then B 2; B's first starts before A's third.
    jobs = [waiting(f"a{i}", "alice", submitted=i) for i in range(1, 7)]
    jobs += [waiting("b1", "bob", submitted=10), waiting("b2", "bob", submitted=11)]
    assert ids(order(snapshot(jobs))) == ["a1", "b1", "a2", "b2", "a3", "a4", "a5", "a6"]


def test_teams_share_first_then_the_teams_users():
    accounts = {"v1": Account(team="vision"), "v2": Account(team="vision"), "n1": Account(team="nlp")}
    snap = snapshot([waiting("v1-job", "v1", submitted=1), waiting("v2-job", "v2", submitted=2),
                     waiting("n1-job", "n1", submitted=3)],
                    usage={"v1": 100.0, "v2": 0.0, "n1": 50.0}, accounts=accounts)
    # vision has used 100, nlp 50: nlp's user first, though v2 alone has used nothing; then v2 before v1.
    assert ids(order(snap)) == ["n1-job", "v2-job", "v1-job"]
    result = plan(snap)
    assert result.team_shares == {"vision": 100.0, "nlp": 50.0}
    assert result.shares["v2"] == 0.0


def test_one_owners_jobs_start_in_submission_order():
    snap = snapshot([waiting("third", submitted=3), waiting("first", submitted=1), waiting("second", submitted=2)])
    assert ids(order(snap)) == ["first", "second", "third"]


def test_fifo_policy_ignores_usage_but_keeps_priority():
    snap = snapshot([waiting("heavy-old", "heavy", submitted=1), waiting("light-new", "light", submitted=2),
                     waiting("low-first", "light", priority="low", submitted=0)],
                    usage={"heavy": 1e9}, settings=Settings(policy="fifo"))
    assert ids(order(snap)) == ["heavy-old", "light-new", "low-first"]


# -- ties ----------------------------------------------------------------------------------------------------


def test_same_usage_goes_by_submission_then_by_id():
    snap = snapshot([waiting("b-late", "bob", submitted=5), waiting("a-early", "alice", submitted=4)],
                    usage={"alice": 10.0, "bob": 10.0})
    assert ids(order(snap)) == ["a-early", "b-late"]
    snap = snapshot([waiting("j2", "bob", submitted=4), waiting("j1", "alice", submitted=4)])
    assert ids(order(snap)) == ["j1", "j2"]


# -- decay ---------------------------------------------------------------------------------------------------


def test_decayed_halves_every_half_life():
    week = 7 * DAY
    assert decayed(100.0, 0, week) == 100.0
    assert decayed(100.0, week, week) == pytest.approx(50.0)
    assert decayed(100.0, 2 * week, week) == pytest.approx(25.0)
    assert decayed(100.0, -5, week) == 100.0  # a clock step back never adds usage
    assert decayed(100.0, week, 0) == 100.0  # no half-life: no decay


def test_a_user_whose_usage_is_old_ranks_as_if_light():
    week = 7 * DAY
    old_heavy = decayed(1_000_000.0, 60 * DAY, week)  # a month of heavy use, two months ago
    recent_light = decayed(10_000.0, DAY, week)
    assert old_heavy < recent_light
    snap = snapshot([waiting("recent", "recent", submitted=1), waiting("old", "old", submitted=2)],
                    usage={"old": old_heavy, "recent": recent_light})
    assert ids(order(snap)) == ["old", "recent"]


# -- weights -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("heavy_usage", "first"), [(100.0, "w2"), (190.0, "w2"), (210.0, "w1")])
def test_a_weight_2_user_goes_ahead_of_a_weight_1_user_below_twice_the_usage(heavy_usage, first):
    snap = snapshot([waiting("w1", "one", submitted=1), waiting("w2", "two", submitted=2)],
                    usage={"one": 100.0, "two": heavy_usage}, accounts={"two": Account(weight=2.0)})
    assert order(snap)[0].id == first
    assert plan(snap).shares["two"] == pytest.approx(heavy_usage / 2)


def test_a_team_weight_divides_the_teams_usage():
    accounts = {"v": Account(team="vision"), "n": Account(team="nlp")}
    snap = snapshot([waiting("n-job", "n", submitted=1), waiting("v-job", "v", submitted=2)],
                    usage={"v": 300.0, "n": 200.0}, accounts=accounts, teams={"vision": Team(weight=2.0)})
    assert ids(order(snap)) == ["v-job", "n-job"]  # vision 300 ÷ 2 = 150 < nlp 200


# -- quotas --------------------------------------------------------------------------------------------------


def test_over_team_quota_waits_naming_the_quota_and_others_behind_it_start():
    accounts = {"v1": Account(team="vision"), "v2": Account(team="vision"), "n1": Account(team="nlp")}
    snap = snapshot([waiting("v2-job", "v2", submitted=1), waiting("n1-job", "n1", submitted=2)],
                    [running("v1-job", "v1", ("w1",))], [node("w1", running_job="v1-job"), node("w2")],
                    accounts=accounts, teams={"vision": Team(max_slots=1)}, usage={"n1": 1e6})
    result = plan(snap)
    assert reason(result, "v2-job") == "over team quota vision: 1/1 slots in use, needs 1"
    assert started(result) == {"n1-job": ["w2"]}


def test_a_quota_counts_the_jobs_this_plan_starts():
    accounts = {"v1": Account(team="vision")}
    snap = snapshot([waiting("first", "v1", submitted=1), waiting("second", "v1", submitted=2)], [],
                    [node("w1"), node("w2")], accounts=accounts, teams={"vision": Team(max_slots=1)})
    result = plan(snap)
    assert started(result) == {"first": ["w1"]}
    assert reason(result, "second") == "over team quota vision: 1/1 slots in use, needs 1"


def test_over_user_quota_waits_naming_the_user():
    snap = snapshot([waiting("more", "alice", slots=8)], [running("held", "alice", ("w1",), slots=8)],
                    [node("w1", 8, "held"), node("w2", 8)], accounts={"alice": Account(max_slots=8)})
    assert reason(plan(snap), "more") == "over user quota alice: 8/8 slots in use, needs 8"


# -- reservations --------------------------------------------------------------------------------------------


def gang_pool(*, gang_queued: float, small_timeout_s: float, w2_live: bool = True) -> Snapshot:
    """w1 free, w2 busy for 7,100 s more (its job's timeout); a 2-node gang and a lighter user's 1-node job wait."""
    nodes = [node("w1", 8)] + ([node("w2", 8, "busy")] if w2_live else [])
    busy = [running("busy", "carol", ("w2",), slots=8, started=NOW - 100, timeout_s=7200.0)] if w2_live else []
    return snapshot([waiting("gang", "alice", slots=8, nodes=2, submitted=gang_queued),
                     waiting("small", "bob", slots=8, submitted=NOW - 1, timeout_s=small_timeout_s)],
                    busy, nodes, usage={"alice": 1e6})


def test_a_gang_waiting_past_reserve_after_reserves_the_workers_that_free_first():
    result = plan(gang_pool(gang_queued=NOW - 301, small_timeout_s=10 * 3600))
    [reservation] = result.reservations
    assert reservation.job_id == "gang"
    assert sorted(reservation.workers) == ["w1", "w2"]
    assert (reservation.held, reservation.fill_at) == (1, NOW + 7100)
    assert reservation.deadline == NOW - 301 + DEFAULTS.reserve_after_s + DEFAULTS.reserve_deadline_s
    assert reason(result, "gang").startswith("needs 2 nodes: reserved, 1 of 2 held")
    # The long 1-node job does not take the reserved free worker, and says why.
    assert started(result) == {}
    assert "reserved for job gang (needs 2 nodes)" in reason(result, "small")
    assert "backfill needs a timeout that ends before it fills" in reason(result, "small")


def test_a_job_that_ends_before_the_reservation_fills_backfills_a_reserved_worker():
    result = plan(gang_pool(gang_queued=NOW - 301, small_timeout_s=3600))
    assert result.reservations[0].fill_at == NOW + 7100
    assert started(result) == {"small": ["w1"]}  # it ends by NOW + 3600, before the fill
    assert reason(result, "gang").startswith("needs 2 nodes: reserved, 1 of 2 held")


def test_before_reserve_after_a_gang_reserves_nothing():
    result = plan(gang_pool(gang_queued=NOW - 100, small_timeout_s=10 * 3600))
    assert result.reservations == []
    assert started(result) == {"small": ["w1"]}


def test_a_reservation_that_cannot_be_filled_is_not_made():
    # w2 is lost: one live worker cannot hold a 2-node gang, so w1 is not held for it.
    result = plan(gang_pool(gang_queued=NOW - 10_000, small_timeout_s=10 * 3600, w2_live=False))
    assert result.reservations == []
    assert reason(result, "gang").startswith("needs 2 nodes that fit, 1 live worker(s) do")
    assert started(result) == {"small": ["w1"]}


def test_a_filled_reservation_starts_the_gang_before_jobs_ahead_of_it_in_the_order():
    snap = snapshot([waiting("small", "bob", slots=8, submitted=NOW - 1),
                     waiting("gang", "alice", slots=8, nodes=2, submitted=NOW - 400)],
                    [], [node("w1", 8), node("w2", 8)], usage={"alice": 1e6})
    assert ids(order(snap)) == ["small", "gang"]
    result = plan(snap)
    assert started(result) == {"gang": ["w1", "w2"]}
    assert result.for_worker("w1") == ["gang"] and result.for_worker("w2") == ["gang"]


def test_a_forming_gang_holds_the_free_workers_it_still_needs():
    forming = running("forming", "alice", ("w1",), slots=8, nodes=2, need=Need("cuda", 8, None, None, nodes=2))
    snap = snapshot([waiting("small", "bob")], [forming], [node("w1", 8, "forming"), node("w2", 8)])
    result = plan(snap)
    assert started(result) == {}
    assert "joining the forming gang of job forming" in reason(result, "small")


# -- best fit ------------------------------------------------------------------------------------------------


def test_a_small_job_takes_the_small_worker_and_leaves_the_big_one():
    snap = snapshot([waiting("one-gpu", submitted=1), waiting("eight-gpu", submitted=2, slots=8)], [],
                    [node("big", 8), node("small", 1)])
    assert started(plan(snap)) == {"one-gpu": ["small"], "eight-gpu": ["big"]}


def test_a_job_no_worker_fits_says_which_and_why():
    snap = snapshot([waiting("eight", slots=8)], [], [node("w1", 1)])
    assert reason(plan(snap), "eight") == "no live worker fits (w1: 1 slot(s), needs 8)"


# -- preemption ----------------------------------------------------------------------------------------------


def preempt_pool(*victims: Running, high: Waiting | None = None, nodes: list[Node] | None = None,
                 usage: dict | None = None, settings: Settings = DEFAULTS) -> Snapshot:
    high = high or waiting("urgent", "bob", priority="high", submitted=NOW - 61)
    nodes = nodes or [node(w, r.slots, r.id) for r in victims for w in r.workers]
    return snapshot([high], list(victims), nodes, usage=usage, settings=settings)


def old_low(job_id: str, worker: str, owner: str = "alice", **kw) -> Running:
    return running(job_id, owner, (worker,), **{"priority": "low", "started": NOW - 1000, **kw})


def test_a_high_job_preempts_a_low_one_that_ran_min_runtime():
    result = plan(preempt_pool(old_low("low", "w1")))
    assert [(p.victim, p.for_job) for p in result.preemptions] == [("low", "urgent")]
    assert result.preemptions[0].detail == "preempted by job urgent (priority high, owner bob), which waited 61s"
    assert reason(result, "urgent").startswith("waiting for a free worker: 1 fit, 1 busy")


def test_no_preemption_before_preempt_after():
    high = waiting("urgent", "bob", priority="high", submitted=NOW - 30)
    assert plan(preempt_pool(old_low("low", "w1"), high=high)).preemptions == []


@pytest.mark.parametrize("victim", [
    running("peer", "alice", ("w1",), priority="high", started=NOW - 1000),  # not strictly lower
    old_low("pinned", "w1", preemptible=False),
    old_low("young", "w1", started=NOW - 599),  # not yet min_runtime_s
])
def test_no_preemption_of_an_equal_priority_unpreemptible_or_young_job(victim):
    assert plan(preempt_pool(victim)).preemptions == []


def test_a_normal_job_preempts_nobody_even_when_aged_to_high():
    # Preemption compares the priority the job was submitted with, not the one aging gave it.
    aged = waiting("aged", "bob", priority="high", spec_priority="normal", submitted=NOW - 10_000)
    result = plan(preempt_pool(old_low("low", "w1"), high=aged))
    assert result.preemptions == []
    assert ids(order(preempt_pool(old_low("low", "w1"), high=aged))) == ["aged"]


def test_a_normal_job_is_a_victim_too():
    result = plan(preempt_pool(running("normal", "alice", ("w1",), started=NOW - 1000)))
    assert [p.victim for p in result.preemptions] == ["normal"]


def test_the_fewest_victims_one_gang_rather_than_two_singles():
    gang = running("gang", "alice", ("w1", "w2"), priority="low", slots=8, started=NOW - 1000)
    singles = [old_low("s3", "w3", slots=8), old_low("s4", "w4", slots=8)]
    high = waiting("urgent", "bob", priority="high", submitted=NOW - 61, slots=8, nodes=2)
    result = plan(preempt_pool(gang, *singles, high=high))
    assert [p.victim for p in result.preemptions] == ["gang"]


def test_the_most_over_share_victim_goes_first():
    victims = [old_low("light-job", "w1", owner="light"), old_low("heavy-job", "w2", owner="heavy")]
    result = plan(preempt_pool(*victims, usage={"light": 10.0, "heavy": 10_000.0}))
    assert [p.victim for p in result.preemptions] == ["heavy-job"]


def test_no_victims_when_even_all_candidates_would_not_free_a_fit():
    # A 2-node high job; only w1's job may be preempted (w2's is high too): preempting it alone frees no fit.
    victims = [old_low("low", "w1", slots=8), running("peer", "carol", ("w2",), priority="high", slots=8)]
    high = waiting("urgent", "bob", priority="high", submitted=NOW - 61, slots=8, nodes=2)
    assert plan(preempt_pool(*victims, high=high)).preemptions == []


def test_a_victim_already_asked_to_stop_counts_as_freeing_its_worker():
    victims = [old_low("leaving", "w1", preempt_requested=True), old_low("staying", "w2")]
    assert plan(preempt_pool(*victims)).preemptions == []


def test_a_high_job_over_its_quota_preempts_nobody():
    snap = preempt_pool(old_low("low", "w1"))
    snap = Snapshot(NOW, snap.waiting, snap.running, snap.nodes, accounts={"bob": Account(max_slots=0)})
    result = plan(snap)
    assert result.preemptions == []
    assert reason(result, "urgent") == "over user quota bob: 0/0 slots in use, needs 1"


def test_preemption_off_with_an_infinite_preempt_after():
    assert plan(preempt_pool(old_low("low", "w1"), settings=Settings(preempt_after_s=math.inf))).preemptions == []


# -- reasons and for_worker ----------------------------------------------------------------------------------


def test_reasons_say_what_a_job_waits_behind():
    snap = snapshot([waiting("hi", "carol", priority="high", submitted=5), waiting("a1", "alice", submitted=1),
                     waiting("a2", "alice", submitted=2), waiting("b1", "bob", submitted=3)],
                    [running("busy", "dave", ("w1",))], [node("w1", running_job="busy")], usage={"bob": 1e6})
    result = plan(snap)
    assert [p.job_id for p in result.order] == ["hi", "a1", "a2", "b1"]
    assert [p.position for p in result.order] == [1, 2, 3, 4]
    assert reason(result, "hi") == "waiting for a free worker: 1 fit, 1 busy"
    assert reason(result, "a2") == ("waiting for a free worker: 1 fit, 1 busy; behind 1 higher-priority job(s), "
                                    "1 earlier job(s) of yours")
    assert reason(result, "b1") == ("waiting for a free worker: 1 fit, 1 busy; behind 1 higher-priority job(s), "
                                    "2 job(s) of users with less usage")
    # Estimated starts, from the running job's timeout: each holds the worker for its own timeout after.
    # "busy" (started at 0, timeout 3600) is past its timeout: w1 is expected free now.
    assert [p.estimated_start for p in result.order] == [NOW, NOW + 3600, NOW + 7200, NOW + 10800]


def test_a_retry_in_backoff_waits_and_says_until_when():
    snap = snapshot([waiting("retry", not_before=NOW + 30)], [], [node("w1")])
    result = plan(snap)
    assert started(result) == {}
    assert reason(result, "retry") == "retry backoff until 1970-01-01T02:47:10+00:00"


def test_a_worker_is_offered_only_the_jobs_assigned_to_it():
    snap = snapshot([waiting("a", submitted=1), waiting("b", submitted=2, slots=8), waiting("c", submitted=3)],
                    [], [node("w8", 8), node("w1", 1)])
    result = plan(snap)
    assert result.for_worker("w1") == ["a"]
    assert result.for_worker("w8") == ["b"]
    assert result.for_worker("gone") == []
    assert result.place("c").workers == [] and result.place("missing") is None


def test_a_gang_over_its_quota_reserves_no_workers():
    # vision may hold 16 slots and holds 8: its 16-slot gang would be over, so w1 and w2 must not idle for it
    # (both free, a reservation would be "filled" with a fill time of now, and nothing could backfill).
    accounts = {"v1": Account(team="vision"), "n1": Account(team="nlp")}
    snap = snapshot([waiting("gang", "v1", slots=8, nodes=2, submitted=NOW - 400),
                     waiting("small", "n1", slots=8, submitted=NOW - 1, timeout_s=600)],
                    [running("other", "v1", ("w3",), slots=8, started=NOW - 100, timeout_s=DAY)],
                    [node("w1", 8), node("w2", 8), node("w3", 8, "other")],
                    accounts=accounts, teams={"vision": Team(max_slots=16)})
    result = plan(snap)
    assert result.reservations == []
    assert reason(result, "gang") == "over team quota vision: 8/16 slots in use, needs 16"
    assert started(result) == {"small": ["w1"]}


def test_two_high_jobs_preempt_two_victims_in_one_plan():
    # One victim frees one worker: it counts as freeing for the first high job only, so the second preempts
    # its own victim now rather than a hand-back later.
    snap = snapshot([waiting("h1", "bob", priority="high", submitted=NOW - 120),
                     waiting("h2", "bob", priority="high", submitted=NOW - 100)],
                    [old_low("l1", "w1"), old_low("l2", "w2", owner="carol")],
                    [node("w1", 1, "l1"), node("w2", 1, "l2")], usage={"alice": 100.0})
    result = plan(snap)
    assert [(p.victim, p.for_job) for p in result.preemptions] == [("l1", "h1"), ("l2", "h2")]


def test_a_victim_already_asked_to_stop_frees_a_worker_for_one_high_job_only():
    snap = snapshot([waiting("h1", "bob", priority="high", submitted=NOW - 120),
                     waiting("h2", "bob", priority="high", submitted=NOW - 100)],
                    [old_low("leaving", "w1", preempt_requested=True), old_low("staying", "w2")],
                    [node("w1", 1, "leaving"), node("w2", 1, "staying")])
    assert [(p.victim, p.for_job) for p in plan(snap).preemptions] == [("staying", "h2")]


def low_gang_and_a_high_job(*, gang_queued: float, high_timeout_s: float) -> Snapshot:
    """A low 2-node gang reserved w1 (free) and w2 (a low job on it); a high 1-node job waits."""
    return snapshot([waiting("gang", "alice", priority="low", slots=8, nodes=2, submitted=gang_queued),
                     waiting("urgent", "bob", priority="high", slots=8, submitted=NOW - 120,
                             timeout_s=high_timeout_s)],
                    [running("lowrun", "carol", ("w2",), priority="low", slots=8, started=NOW - 1000,
                             timeout_s=7200)],
                    [node("w1", 8), node("w2", 8, "lowrun")])


def test_a_high_job_is_not_held_behind_a_young_low_gangs_reservation():
    # The gang's deadline is 48 h after its reservation began: the day-long high job ends well before it.
    result = plan(low_gang_and_a_high_job(gang_queued=NOW - 400, high_timeout_s=DAY))
    assert [r.job_id for r in result.reservations] == ["gang"]
    assert started(result) == {"urgent": ["w1"]}
    assert result.preemptions == []


def test_a_high_job_that_would_end_after_the_gangs_deadline_takes_no_reserved_worker():
    # The gang has waited 47 h: a day-long job on its worker would push it past its deadline (48 h + 300 s),
    # so the high job waits, and preempts nothing: the one victim it could take frees a reserved worker.
    result = plan(low_gang_and_a_high_job(gang_queued=NOW - 47 * 3600, high_timeout_s=DAY))
    assert started(result) == {}
    assert result.preemptions == []
    assert "reserved for job gang (needs 2 nodes)" in reason(result, "urgent")
    # A high job short enough to end before the deadline still goes first.
    result = plan(low_gang_and_a_high_job(gang_queued=NOW - 47 * 3600, high_timeout_s=3600))
    assert started(result) == {"urgent": ["w1"]}


def test_a_job_of_the_gangs_own_priority_only_backfills_whatever_its_timeout():
    snap = snapshot([waiting("gang", "alice", slots=8, nodes=2, submitted=NOW - 400),
                     waiting("peer", "bob", slots=8, submitted=NOW - 120, timeout_s=3 * 3600)],
                    [running("busy", "carol", ("w2",), slots=8, started=NOW - 1000, timeout_s=7200)],
                    [node("w1", 8), node("w2", 8, "busy")])
    result = plan(snap)
    assert started(result) == {}  # 3 h ends after the fill (NOW + 6,200 s): no backfill
    assert "reserved for job gang" in reason(result, "peer")


def test_with_max_reservations_each_gang_reserves_its_own_workers_oldest_first():
    # Two 2-node gangs on four workers: the older takes the two that free first, the younger the other two,
    # and each fills on its own; a third gang finds none left and reserves nothing yet.
    busy = [running(f"b{i}", "carol", (f"w{i}",), slots=8, started=NOW - 100, timeout_s=t)
            for i, t in ((1, 1000.0), (2, 2000.0), (3, 3000.0))]
    snap = snapshot([waiting("young", "alice", slots=8, nodes=2, submitted=NOW - 400),
                     waiting("old", "bob", slots=8, nodes=2, submitted=NOW - 900),
                     waiting("third", "dave", slots=8, nodes=2, submitted=NOW - 350)],
                    busy, [node("w1", 8, "b1"), node("w2", 8, "b2"), node("w3", 8, "b3"), node("w4", 8)],
                    settings=Settings(max_reservations=3))
    result = plan(snap)
    assert [(r.job_id, sorted(r.workers), r.held, r.fill_at) for r in result.reservations] == [
        ("old", ["w1", "w4"], 1, NOW + 900), ("young", ["w2", "w3"], 0, NOW + 2900)]
    assert reason(result, "old").startswith("needs 2 nodes: reserved, 1 of 2 held")
    assert reason(result, "young").startswith("needs 2 nodes: reserved, 0 of 2 held")
    assert not reason(result, "third").startswith("needs 2 nodes: reserved")
    # By default only the oldest reserves.
    default = plan(Snapshot(snap.now, snap.waiting, snap.running, snap.nodes))
    assert [r.job_id for r in default.reservations] == ["old"]


# -- a job's container image (issue 44) ------------------------------------------------------------------------


def test_a_job_naming_an_image_goes_to_a_worker_that_has_it_and_never_waits_for_one():
    image = "registry.example.com/team/train:2025-11"
    pinned = "registry.example.com/team/train@sha256:" + "ab" * 32

    def in_image(job_id: str, ref: str | None) -> Waiting:
        job = waiting(job_id, submitted=float(len(job_id)))
        return Waiting(**{**job.__dict__, "need": Need("cuda", 1, None, None, image=ref)})

    # w-a fits best (fewest slots left after); w-c has the image by tag, w-d by the digest it resolved to
    nodes = [node("w-a", 1), Node("w-b", "cuda", 2), Node("w-c", "cuda", 2, images=frozenset({image})),
             Node("w-d", "cuda", 4, images=frozenset({"sha256:" + "ab" * 32}))]
    result = plan(snapshot([in_image("j-image", image), in_image("j-pinned", pinned), in_image("j-plain", None)],
                           nodes=nodes))
    assert started(result) == {"j-image": ["w-c"], "j-pinned": ["w-d"], "j-plain": ["w-a"]}
    nobody = plan(snapshot([in_image("j-image", image)], nodes=[node("w-a", 1), Node("w-b", "cuda", 2)]))
    assert started(nobody) == {"j-image": ["w-a"]}  # no worker has it: best fit, at once
