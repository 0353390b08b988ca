"""Sweeps (issue 17): the sampler and the early-stopping rules (pure), submission checks and owner isolation on
both databases, and grid, ASHA and cancel on the real stack with tiny CPU trials."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError
from sqlalchemy import create_engine, func, select
from sqlalchemy.orm import Session

from service.jobs.models import Job
from tests.conftest import mlp_spec
from tests.helpers import count_jobs, module_stack, processes_of, wait_for
from tests.test_auth import make_token
from trainjobs.errors import InvalidRequest
from trainjobs.stopping import Point, asha_stops, median_stops, rungs
from trainjobs.sweep import Asha, Median, SweepSpec, check, trial_parameters, trial_spec

ONE = {"nnodes": 1, "nproc_per_node": 1, "device": "cpu"}


def sweep_body(**overrides) -> dict:
    body = {"name": "lr-study", "spec": mlp_spec(resources=ONE),
            "parameters": {"optimizer.lr": {"values": [0.001, 0.01, 0.1]}, "train.seed": {"values": [0, 1]}},
            "method": "grid", "parallel": 2, "metric": {"name": "loss", "goal": "minimize"}}
    body.update(overrides)
    return body


# --- pure: the sampler ----------------------------------------------------------------------------------------

def test_a_grid_is_every_combination_in_order_the_last_parameter_fastest():
    sweep = SweepSpec.model_validate(sweep_body())
    assert sweep.total_trials == 6
    assert [trial_parameters(sweep, i) for i in range(6)] == [
        {"optimizer.lr": lr, "train.seed": s} for lr in (0.001, 0.01, 0.1) for s in (0, 1)]
    with pytest.raises(IndexError):
        trial_parameters(sweep, 6)
    assert SweepSpec.model_validate(sweep_body(max_trials=4)).total_trials == 4


def test_a_random_draw_depends_only_on_the_seed_and_the_trial_number():
    params = {"optimizer.lr": {"distribution": "log_uniform", "min": 1e-4, "max": 1e-1},
              "train.max_steps": {"distribution": "int_uniform", "min": 5, "max": 9},
              "optimizer.weight_decay": {"distribution": "uniform", "min": 0, "max": 0.1},
              "train.seed": {"values": [0, 1, 2]}}
    sweep = SweepSpec.model_validate(sweep_body(method="random", parameters=params, max_trials=50, seed=7))
    draws = [trial_parameters(sweep, i) for i in range(50)]
    assert draws == [trial_parameters(sweep, i) for i in range(50)]  # again, in any order: the same
    assert draws[3] == trial_parameters(sweep, 3)
    assert all(1e-4 <= d["optimizer.lr"] <= 1e-1 and 0 <= d["optimizer.weight_decay"] <= 0.1 for d in draws)
    assert {d["train.max_steps"] for d in draws} <= set(range(5, 10)) and len({d["train.seed"] for d in draws}) == 3
    small = sum(d["optimizer.lr"] < 1e-2 for d in draws)  # log-uniform: two decades of three below 1e-2
    assert 20 <= small <= 45
    other = SweepSpec.model_validate(sweep_body(method="random", parameters=params, max_trials=50, seed=8))
    assert trial_parameters(other, 0) != draws[0]


def test_a_trial_is_the_base_spec_changed_named_and_tagged():
    sweep = SweepSpec.model_validate(sweep_body(spec=mlp_spec(tags=["team=a"])))
    spec = trial_spec(sweep, sweep_id="ab" * 10, index=3, params=trial_parameters(sweep, 3))
    assert spec.optimizer.lr == 0.01 and spec.train.seed == 1 and spec.name == "lr-study-3"
    assert spec.tags == ["team=a", f"sweep:{'ab' * 10}"]


@pytest.mark.parametrize("parameters, field, says", [
    ({"optimizer.lrr": {"values": [1]}}, "parameters.optimizer.lrr", "not a field"),
    ({"optimizer.lr": {"values": [0.1, -1]}}, "parameters.optimizer.lr", "greater than"),
    ({"optimizer.lr": {"distribution": "uniform", "min": 0.1, "max": 20}}, "parameters.optimizer.lr", "20"),
    ({"train.max_steps": {"values": ["many"]}}, "parameters.train.max_steps", "integer"),
])
def test_a_path_or_value_the_spec_refuses_is_named(parameters, field, says):
    sweep = SweepSpec.model_validate(sweep_body(method="random", parameters=parameters, max_trials=3))
    with pytest.raises(InvalidRequest) as refused:
        check(sweep)
    assert refused.value.field == field and says in refused.value.message


def test_what_a_sweep_itself_refuses():
    lr = {"distribution": "log_uniform", "min": 1e-4, "max": 1e-2}
    for body, says in ((sweep_body(parameters={"optimizer.lr": lr}), "grid search needs values"),
                       (sweep_body(max_trials=7), "more than the grid's 6"),
                       (sweep_body(parameters={"optimizer.lr": {**lr, "min": 0}}), "log_uniform needs min > 0"),
                       (sweep_body(max_trials=1001), "less than or equal to 1000"),
                       (sweep_body(early_stopping={"type": "asha", "min_steps": 5, "reduction_factor": 1}),
                        "greater than or equal to 2")):
        with pytest.raises(ValidationError, match=says):
            SweepSpec.model_validate(body)
    late = SweepSpec.model_validate(sweep_body(early_stopping={"type": "median", "min_steps": 20}))
    with pytest.raises(InvalidRequest, match="below spec.train.max_steps"):
        check(late)
    with pytest.raises(InvalidRequest, match="eval_every"):
        check(SweepSpec.model_validate(sweep_body(metric={"name": "eval_loss"})))


def test_the_example_sweep_is_valid():
    example = yaml.safe_load((Path(__file__).resolve().parent.parent / "examples" / "sweep-lr.yaml").read_text())
    check(SweepSpec.model_validate(example))


# --- pure: early stopping -------------------------------------------------------------------------------------

def series(*values_by_trial, every: int = 5, start: float = 0.0) -> dict[str, list[Point]]:
    """Trial t's points at steps 5, 10, ...; trial t reports its step k at time start + t + k (later trials later)."""
    return {f"t{t}": [Point((k + 1) * every, v, start + t + k) for k, v in enumerate(values)]
            for t, values in enumerate(values_by_trial)}


def test_asha_rungs_grow_by_the_reduction_factor_below_max_steps():
    assert rungs(Asha(type="asha", min_steps=5, reduction_factor=3), 100) == [5, 15, 45]
    assert rungs(Asha(type="asha", min_steps=5, reduction_factor=2), 20) == [5, 10]


def test_asha_keeps_the_first_at_a_rung_and_stops_a_later_trial_outside_the_top_third():
    rule = Asha(type="asha", min_steps=5, reduction_factor=3)
    s = series([1.0, 0.8, 0.6], [2.0, 1.9], [0.9, 0.7], [3.0])
    stops = asha_stops(s, running={"t0", "t1", "t2", "t3"}, rule=rule, max_steps=100, goal="minimize")
    assert set(stops) == {"t1", "t3"}  # t1 worse than t0's 1.0 at rung 5; t3 the worst of four
    assert "rung 5" in stops["t1"] and "outside the top 1/3" in stops["t1"]
    # Alone at a rung, a trial goes on whatever its value; a trial judged by those before it only
    assert asha_stops(series([5.0]), running={"t0"}, rule=rule, max_steps=100, goal="minimize") == {}
    assert asha_stops(series([0.5], [2.0]), running={"t0"}, rule=rule, max_steps=100, goal="minimize") == {}
    # maximize: the larger values win
    up = asha_stops(series([1.0], [2.0], [0.5]), running={"t1", "t2"}, rule=rule, max_steps=100, goal="maximize")
    assert set(up) == {"t2"}


def test_asha_never_stops_the_trial_holding_the_best_value():
    rule = Asha(type="asha", min_steps=5, reduction_factor=2)
    # t1 was worse at rung 5 but holds the best value since (0.1 at step 10)
    s = series([1.0, 0.9], [1.5, 0.1])
    assert asha_stops(s, running={"t0", "t1"}, rule=rule, max_steps=100, goal="minimize") == {}


def test_median_stops_a_trial_worse_than_the_others_running_averages():
    rule = Median(type="median", min_steps=10, min_trials=2)
    s = series([1.0, 0.8, 0.6], [1.0, 0.9, 0.7], [3.0, 2.9])
    assert set(median_stops(s, running={"t2"}, rule=rule, goal="minimize")) == {"t2"}
    assert median_stops(series([1.0, 0.9], [3.0, 2.9]), running={"t1"}, rule=rule, goal="minimize") == {}  # 1 other
    early = series([1.0, 0.8], [1.0, 0.9], [3.0])  # t2 before min_steps
    assert median_stops(early, running={"t2"}, rule=rule, goal="minimize") == {}


# --- the API on both databases ---------------------------------------------------------------------------------

def jobs_of(settings, sweep_id: str) -> int:
    engine = create_engine(settings.resolved_database_url)
    with Session(engine) as db:
        n = db.scalar(select(func.count()).select_from(Job).where(Job.sweep_id == sweep_id))
    engine.dispose()
    return n


def test_a_bad_parameter_path_is_a_422_naming_it_and_makes_no_job(client, settings):
    before = count_jobs(settings.database_url)
    for parameters, field in (({"optimizer.lrr": {"values": [0.1]}}, "parameters.optimizer.lrr"),
                              ({"optimizer.lr": {"values": [0.1, 11]}}, "parameters.optimizer.lr")):
        refused = client.post("/v1/sweeps", json=sweep_body(parameters=parameters))
        assert refused.status_code == 422 and refused.json()["field"] == field, refused.text
    grid = client.post("/v1/sweeps", json=sweep_body(parameters={
        "optimizer.lr": {"distribution": "uniform", "min": 0.1, "max": 0.2}}))
    assert grid.status_code == 422 and "grid search needs values" in str(grid.json()["detail"])
    assert count_jobs(settings.database_url) == before
    assert client.get("/v1/sweeps").json()["items"] == []


def test_a_sweep_makes_parallel_trials_as_ordinary_jobs_and_cancels_them(client, settings):
    made = client.post("/v1/sweeps", json=sweep_body())
    assert made.status_code == 201, made.text
    sweep = made.json()
    assert sweep["status"] == "running" and sweep["trials"] == {
        "total": 6, "made": 2, "queued": 2, "starting": 0, "running": 0, "succeeded": 0, "failed": 0,
        "cancelled": 0, "stopped_early": 0}
    trials = client.get(f"/v1/sweeps/{sweep['id']}/trials").json()["data"]
    assert [(t["index"], t["params"], t["status"]) for t in trials] == [
        (0, {"optimizer.lr": 0.001, "train.seed": 0}, "queued"),
        (1, {"optimizer.lr": 0.001, "train.seed": 1}, "queued")]
    job = client.get(f"/v1/jobs/{trials[1]['job_id']}").json()
    assert job["sweep_id"] == sweep["id"] and job["sweep_trial"] == 1 and job["name"] == "lr-study-1"
    assert job["spec"]["train"]["seed"] == 1 and f"sweep:{sweep['id']}" in job["spec"]["tags"]
    client.post("/v1/jobs", json=mlp_spec(name="not-a-trial"))
    listed = client.get("/v1/jobs", params={"sweep": sweep["id"]}).json()["items"]
    assert [j["id"] for j in listed] == [t["job_id"] for t in reversed(trials)]
    assert [s["id"] for s in client.get("/v1/sweeps").json()["items"]] == [sweep["id"]]

    cancelled = client.post(f"/v1/sweeps/{sweep['id']}/cancel").json()
    assert cancelled["status"] == "cancelled" and cancelled["trials"]["cancelled"] == 2
    assert client.post(f"/v1/sweeps/{sweep['id']}/cancel").status_code == 200  # again: the same answer
    assert jobs_of(settings, sweep["id"]) == 2  # no trial made after the cancel


def test_a_restarted_or_racing_controller_makes_trial_n_once(client, settings, redis):
    from sqlalchemy.exc import IntegrityError

    from service.sweeps import controller
    from service.sweeps import service as sweeps

    sweep = client.post("/v1/sweeps", json=sweep_body(parallel=3)).json()
    engine = create_engine(settings.resolved_database_url)
    with Session(engine) as db:
        row = sweeps.visible(db, sweep_id=sweep["id"], principal=_admin())
        for _ in range(2):  # passes again, as after a restart: the same three trials
            controller.advance(db, redis, settings, row)
        first = db.scalar(select(Job).where(Job.sweep_id == sweep["id"], Job.sweep_trial == 0))
        again = controller.admission.admit(first.spec, db=db, redis=redis, settings=settings, principal=_admin(),
                                           idempotency_key=f"sweep:{sweep['id']}:0",
                                           trial=controller.Trial(sweep["id"], 0, {}))
        assert again == (first, False)  # a pass that died after the commit: the key finds the trial made
        twin = Job(**{c.name: getattr(first, c.name) for c in Job.__table__.columns if c.name != "version"})
        twin.id, twin.idempotency_key = "f" * 20, None
        db.add(twin)
        with pytest.raises(IntegrityError):  # and the unique (sweep_id, sweep_trial) below it
            db.commit()
    engine.dispose()
    assert jobs_of(settings, sweep["id"]) == 3


def _admin():
    from service.auth.tokens import Principal

    return Principal(user="admin", role="admin", token_id=None, can_run_entrypoints=True)


def test_another_users_sweep_is_a_404_and_an_admin_sees_all(client, settings):
    alice = {"Authorization": f"Bearer {make_token(settings, 'alice')}"}
    bob = {"Authorization": f"Bearer {make_token(settings, 'bob')}"}
    sweep = client.post("/v1/sweeps", json=sweep_body(parallel=1), headers=alice).json()
    assert sweep["owner"] == "alice"
    for method, path in (("GET", ""), ("GET", "/trials"), ("POST", "/cancel")):
        assert client.request(method, f"/v1/sweeps/{sweep['id']}{path}", headers=bob).status_code == 404
    assert client.get("/v1/sweeps", headers=bob).json()["items"] == []
    assert client.get(f"/v1/sweeps/{sweep['id']}", headers=alice).json()["status"] == "running"
    assert [s["id"] for s in client.get("/v1/sweeps").json()["items"]] == [sweep["id"]]  # the admin
    trial = client.get(f"/v1/sweeps/{sweep['id']}/trials").json()["data"][0]
    assert client.get(f"/v1/jobs/{trial['job_id']}").json()["owner"] == "alice"  # the trial is alice's job


# --- the real stack: three one-process workers, the controller every 0.3 s ---------------------------------------

# The workers start once the API is up (worker_args): all at once overran the 30 s start on a busy machine.
stack = module_stack("sweeps", workers=3, worker_args=["--slots", "1"], sweep_s=0.3)


def wait_sweep(api, sweep_id: str, timeout: float = 180) -> dict:
    def ended():
        sweep = api.get(f"/v1/sweeps/{sweep_id}").json()
        return sweep if sweep["status"] != "running" else None

    return wait_for(ended, timeout, interval=0.5, what=f"sweep {sweep_id} to end")


def cli(stack, *argv: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRAINJOBS_API_URL=stack.api_url, TRAINJOBS_TOKEN=stack.token)
    return subprocess.run([sys.executable, "-m", "service.cli", *argv], env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.fixture(scope="module")
def grid(stack, tmp_path_factory) -> dict:
    """A grid of 3 learning rates × 2 seeds, 2 at a time, submitted from a YAML file by `trainjobs sweep`, and
    how many trials were ever queued or running at once while it ran."""
    body = sweep_body(spec=mlp_spec(resources=ONE, train={"max_steps": 10, "log_every": 5}))
    path = tmp_path_factory.mktemp("grid") / "grid.yaml"
    path.write_text(yaml.safe_dump(body))
    made = cli(stack, "sweep", str(path), "--json")
    assert made.returncode == 0, made.stdout + made.stderr
    sweep_id, most = json.loads(made.stdout)["id"], 0
    with stack.client(timeout=10) as api:
        def ended():
            nonlocal most
            now = api.get(f"/v1/sweeps/{sweep_id}").json()
            most = max(most, sum(now["trials"][k] for k in ("queued", "starting", "running")))
            return now if now["status"] != "running" else None

        done = wait_for(ended, 240, interval=0.3, what="the grid sweep to end")
        return {"sweep": done, "most_at_once": most, "trials": api.get(f"/v1/sweeps/{sweep_id}/trials").json()["data"]}


def test_a_grid_of_three_rates_by_two_seeds_runs_six_trials_two_at_a_time_and_names_the_best(grid, stack):
    done, trials = grid["sweep"], grid["trials"]
    assert done["status"] == "succeeded" and done["trials"]["succeeded"] == 6 and done["trials"]["made"] == 6
    assert grid["most_at_once"] <= 2  # never more than `parallel` trials queued or running
    assert sorted((t["params"]["optimizer.lr"], t["params"]["train.seed"]) for t in trials) == \
        [(lr, s) for lr in (0.001, 0.01, 0.1) for s in (0, 1)]
    assert all(t["steps"] == 10 and t["best"] is not None and t["last"] is not None for t in trials)
    best = min(trials, key=lambda t: t["best"])
    assert done["best"]["job_id"] == best["job_id"] and done["best"]["best"] == best["best"]

    shown = cli(stack, "sweep-status", done["id"])
    assert shown.returncode == 0, shown.stderr
    assert "succeeded" in shown.stdout and f"trial {best['index']}" in shown.stdout
    rows = [ln for ln in shown.stdout.splitlines() if best["job_id"] in ln]
    assert rows and shown.stdout.index(best["job_id"]) < min(shown.stdout.index(t["job_id"]) for t in trials
                                                               if t is not best)  # best first
    listed = cli(stack, "list", "--sweep", done["id"], "--json")
    assert sorted(j["id"] for j in json.loads(listed.stdout)["items"]) == sorted(t["job_id"] for t in trials)
    assert done["id"] in cli(stack, "sweeps").stdout


def test_asha_stops_losing_trials_early_and_never_the_best(api):
    spec = mlp_spec(resources=ONE, train={"max_steps": 36, "log_every": 2},
                    fault_injection={"sleep_per_step_s": 0.1, "rank": 0})
    body = sweep_body(spec=spec, method="random", max_trials=9, parallel=3, seed=3,
                      parameters={"optimizer.lr": {"distribution": "log_uniform", "min": 1e-4, "max": 0.3}},
                      early_stopping={"type": "asha", "min_steps": 6, "reduction_factor": 2})
    sweep = api.post("/v1/sweeps", json=body).json()
    done = wait_sweep(api, sweep["id"])
    trials = api.get(f"/v1/sweeps/{sweep['id']}/trials").json()["data"]
    stopped = [t for t in trials if t["reason"] == "stopped_early"]
    assert done["status"] == "succeeded" and len(trials) == 9 and stopped, trials
    assert done["trials"]["stopped_early"] == len(stopped) and done["trials"]["failed"] == 0
    assert all(t["status"] == "cancelled" and t["steps"] < 36 for t in stopped)
    assert {t["status"] for t in trials if t not in stopped} == {"succeeded"}
    assert done["best"]["reason"] is None and done["best"]["status"] == "succeeded"
    job = api.get(f"/v1/jobs/{stopped[0]['job_id']}").json()
    assert job["status"] == "cancelled" and job["reason"] == "stopped_early" and job["error"] is None


def test_the_example_sweep_stops_a_losing_trial_early_and_keeps_the_best_running(api):
    """examples/sweep-lr.yaml as it is, cut to its first 3 trials and cancelled once one is stopped early (the rest
    would only take time). Its trials once trained 300 steps in ~1 s, ended before the controller saw them at a
    rung, and the example stopped none."""
    example = yaml.safe_load((Path(__file__).resolve().parent.parent / "examples" / "sweep-lr.yaml").read_text())
    sweep_id = api.post("/v1/sweeps", json={**example, "max_trials": 3}).json()["id"]

    def one_stopped():
        trials = api.get(f"/v1/sweeps/{sweep_id}/trials").json()["data"]
        stopped = [t for t in trials if t["reason"] == "stopped_early" and t["status"] == "cancelled"]
        return (stopped, trials) if stopped else None

    stopped, trials = wait_for(one_stopped, 180, interval=0.5, what="a trial stopped early")
    assert api.post(f"/v1/sweeps/{sweep_id}/cancel").json()["status"] == "cancelled"
    assert stopped[0]["steps"] < example["spec"]["train"]["max_steps"], stopped
    # NOTE: the sweep's `best` is by the latest value, which a trial stopped at an earlier rung may still hold; what
    # ASHA keeps is a trial it did not stop (test_asha_stops_losing_trials_early_and_never_the_best pins the rule).
    kept = [t for t in trials if t["reason"] is None and t["status"] in ("starting", "running", "succeeded")]
    assert kept, trials
    live = ("queued", "starting", "running")
    wait_for(lambda: not any(api.get(f"/v1/sweeps/{sweep_id}").json()["trials"][k] for k in live), 60,
             what="the cancelled trials to end")  # the module's workers free for the next test


def test_a_sweep_whose_trials_finish_between_two_looks_keeps_every_finished_trial(api):
    """Trials that train in well under a second, faster than the controller looks: a stop that comes once a trial
    reported its last step stops nothing (its supervisor lets it end), so no finished trial is ever discarded
    as stopped early (the example sweep once lost its second best that way)."""
    spec = mlp_spec(resources=ONE, train={"max_steps": 24, "log_every": 2})
    body = sweep_body(spec=spec, method="random", max_trials=6, parallel=3, seed=5,
                      parameters={"optimizer.lr": {"distribution": "log_uniform", "min": 1e-4, "max": 0.3}},
                      early_stopping={"type": "asha", "min_steps": 4, "reduction_factor": 2})
    sweep = api.post("/v1/sweeps", json=body).json()
    done = wait_sweep(api, sweep["id"])
    trials = api.get(f"/v1/sweeps/{sweep['id']}/trials").json()["data"]
    assert done["status"] == "succeeded" and len(trials) == 6
    for trial in trials:
        job = api.get(f"/v1/jobs/{trial['job_id']}").json()
        if trial["steps"] == 24:  # finished its work: succeeded, with its summary, whatever stop came after
            assert job["status"] == "succeeded" and job["summary"] and job["reason"] is None, job
        else:
            assert job["status"] == "cancelled" and job["reason"] == "stopped_early", job
    assert done["trials"]["succeeded"] == sum(t["steps"] == 24 for t in trials)


def test_cancelling_a_sweep_leaves_no_trial_running(api):
    spec = mlp_spec(resources=ONE, train={"max_steps": 10_000_000, "log_every": 5})
    sweep = api.post("/v1/sweeps", json=sweep_body(spec=spec, parallel=2)).json()

    def running():
        trials = api.get(f"/v1/sweeps/{sweep['id']}/trials").json()["data"]
        return trials if [t["status"] for t in trials] == ["running", "running"] else None

    trials = wait_for(running, 90, what="two running trials")
    cancelled = api.post(f"/v1/sweeps/{sweep['id']}/cancel").json()
    assert cancelled["status"] == "cancelled"

    def ended():
        now = api.get(f"/v1/sweeps/{sweep['id']}/trials").json()["data"]
        return now if all(t["status"] == "cancelled" for t in now) else None

    after = wait_for(ended, 60, what="every trial cancelled")
    assert len(after) == 2 and all(t["reason"] is None for t in after)  # the user's cancel, not early stopping
    assert all(processes_of(t["job_id"]) == [] for t in trials)
    assert api.get(f"/v1/sweeps/{sweep['id']}").json()["trials"]["made"] == 2


def test_the_dashboard_lists_sweeps_and_shows_the_trials_sorted_by_the_metric_and_a_scatter(grid, stack):
    import shutil

    from playwright.sync_api import expect, sync_playwright

    from tests.test_dashboard import ARTIFACTS, CHROMIUM

    if not shutil.which(CHROMIUM):
        pytest.fail(f"{CHROMIUM} is missing: apt-get install -y chromium (never `playwright install`)")
    trials = sorted(grid["trials"], key=lambda t: t["best"])
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True)
        page = browser.new_page(viewport={"width": 1360, "height": 900})
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.goto(f"{stack.api_url}/")
        page.fill("#token-input", stack.token)
        page.click("#token-form button[type=submit]")
        expect(page.locator("#token-set")).to_be_visible()
        page.click("header nav a[data-nav=sweeps]")
        row = page.locator(f"#sweeps-table tbody tr[data-sweep='{grid['sweep']['id']}']")
        expect(row).to_contain_text("lr-study")
        expect(row).to_contain_text("6/6")
        row.locator("a").click()
        expect(page.locator("#sweep-status")).to_have_text("succeeded")
        expect(page.locator("#sweep-best")).to_contain_text(f"trial {trials[0]['index']}")
        body = page.locator("#trials-table tbody tr")
        expect(body).to_have_count(6)
        expect(body.nth(0)).to_have_attribute("data-trial", str(trials[0]["index"]))  # best first
        expect(body.nth(5)).to_have_attribute("data-trial", str(trials[-1]["index"]))
        page.click("#trials-sort")
        expect(body.nth(0)).to_have_attribute("data-trial", str(trials[-1]["index"]))  # worst first
        expect(page.locator("#sweep-scatter circle")).to_have_count(6)
        page.select_option("#scatter-param", "train.seed")
        expect(page.locator("#sweep-scatter text.axis")).to_have_text("train.seed")
        expect(page.locator("#sweep-scatter circle")).to_have_count(6)
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=ARTIFACTS / "dashboard-sweep.png", full_page=True)
        page.click("#sweep-jobs")  # the jobs list, filtered to the sweep's trials (?sweep=)
        expect(page.locator("#filter-sweep")).to_have_value(grid["sweep"]["id"])
        expect(page.locator("#jobs-table tbody tr")).to_have_count(6)
        browser.close()
    assert errors == []
