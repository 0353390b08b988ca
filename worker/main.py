"""`trainjobs worker`: an RQ worker serving gang node tasks it fits, then its own queue, where the control plane's
scheduler puts the jobs it assigns to this worker (worker/dispatch.py); registered in the workers table with a
heartbeat; SIGTERM hands its job back."""

import argparse
import logging
import os
import signal
import socket
import time
from collections.abc import Callable
from datetime import timedelta

from redis import Redis
from redis.exceptions import RedisError
from rq import Worker
from rq.exceptions import StopRequested
from rq.serializers import JSONSerializer
from rq.utils import now

import worker.agent  # preloaded: each forked work-horse starts with it imported
from service.db import make_engine, make_sessionmaker
from service.jobs.queue import GANG, GuardedJob, kick, worker_queue_name
from service.redis_auth import warn_if_open
from service.settings import get_settings
from service.storage import check_store
from service.undumpable import make_undumpable
from trainjobs.runenv import PREEMPT_SIGNAL
from worker import control, images, processes, sandbox
from worker.agent import request_preemption
from worker.dispatch import FittingQueue, Taker
from worker.inventory import DiskWatch, probe, start_heartbeat
from worker.sandbox import REDIS_AUTH_LABEL
from worker.tick import SOCKET_ENV, Relay

log = logging.getLogger(__name__)
NO_API = ("trainjobs worker: give it the API to join: --api URL with --join-token T (or TRAINJOBS_WORKER_API and "
          "TRAINJOBS_JOIN_TOKEN_FILE); an admin makes the token with `trainjobs worker-token create`. A worker holds "
          "no database URL (docs/operations/deployment.md). One that writes the database itself, on a machine that "
          "runs no one else's code, needs TRAINJOBS_WORKER_DATABASE=1")
RESTART_MAX_S = 5.0  # the longest wait between two starts of the worker loop after an outage
_stop_signals: list[int] = []  # shutdown signals that came before RQ's loop took them over (PreemptingWorker)


def catch_stop_early() -> None:
    """Until RQ's loop starts, a SIGTERM or SIGINT is remembered (its bootstrap then stops), not fatal: a worker
    stopped while it starts (the database registered it, RQ not yet) leaves cleanly, deregistered, status 0."""
    _stop_signals.clear()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda signum, frame: _stop_signals.append(signum))


class PreemptingWorker(Worker):
    """RQ's worker, whose shutdown also hands the running job back to the queue (graceful preemption).

    RQ's warm shutdown (the first SIGTERM or SIGINT) stops taking jobs and waits for the current one;
    here it also sends PREEMPT_SIGNAL to the work-horse, whose supervisor has the ranks checkpoint and
    exit and records the job as queued again. A second signal is passed on too: the supervisor then stops
    the ranks at once (and still hands the job back). A third is RQ's cold shutdown: it SIGKILLs the
    horse; torchrun dies with it (PDEATHSIG) and takes the ranks down, the job's lease then expires.
    """

    _hard_stop_asked = False
    draining = False  # shutting down: the workers table says so

    in_lane = False  # one lane of a shared worker (Lanes): its work-horses die with it

    def bootstrap(self, *args, **kwargs) -> None:
        # NOTE: RQ installs its handlers after bootstrap (which registers in Redis). First here, then the signals
        # that came before (catch_stop_early): a stop at any moment of the start is RQ's warm shutdown.
        self._install_signal_handlers()
        if _stop_signals:
            self.request_stop(_stop_signals[0], None)  # not busy: raises StopRequested, nothing registered
        super().bootstrap(*args, **kwargs)

    def setup_work_horse_signals(self) -> None:
        super().setup_work_horse_signals()
        if self.in_lane:  # the worker killed: its lanes die, their horses (and through them the ranks) too
            processes.die_with_parent(signal.SIGKILL)
        # NOTE: in the horse right after fork, before the job function runs: no request is lost or fatal.
        signal.signal(PREEMPT_SIGNAL, request_preemption)

    def request_stop(self, signum, frame) -> None:
        self.draining = True
        self._tell_horse()
        super().request_stop(signum, frame)

    def request_force_stop(self, signum, frame) -> None:
        # RQ ignores a signal within 1 s of the first (a pool and a terminal may both send one): so do we.
        echo = self._shutdown_requested_date and now() - self._shutdown_requested_date < timedelta(seconds=1)
        if self.horse_pid and not echo and not self._hard_stop_asked:
            self._hard_stop_asked = True
            self.log.warning("Worker %s: stopping the running job now; a third signal kills the work-horse", self.name)
            self._tell_horse()
            return
        super().request_force_stop(signum, frame)

    def maintain_heartbeats(self, job, execution) -> None:
        # NOTE: RQ's monitor of a running horse gives up on the first Redis error, and its worker quits with the
        # job still running in the horse. The job's truth is the database (its lease): RQ's bookkeeping waits.
        try:
            super().maintain_heartbeats(job, execution)
        except RedisError as exc:
            self.log.warning("Worker %s: Redis is out of reach (%s); the running job goes on", self.name, exc)

    def unsubscribe(self) -> None:
        # NOTE: RQ sends UNSUBSCRIBE, then stops its listener thread (redis-py's stop() joins without a bound).
        # If the listener reads the reply before the stop (a busy machine), it waits again, now for a first
        # subscription, for up to RQ's 60 s: a worker that took a minute to leave. Stop first, then unsubscribe:
        # the reply wakes the listener, which then sees the stop and closes the connection itself.
        thread = self.pubsub_thread
        if not thread:
            return
        self.log.info("Worker %s: unsubscribing from channel %s", self.name, self.pubsub_channel_name)
        thread.stop(timeout=0)  # clears its running flag; never waits here
        try:
            self.pubsub.unsubscribe()
        except RedisError:  # the listener saw the stop first and closed the connection (CI: a broken pipe), or
            pass  # Redis is gone: either way there is nothing left to leave
        finally:
            thread.join(timeout=2)
            if thread.is_alive():  # the reply never came (Redis gone): a daemon thread, it dies with the process
                self.log.warning("Worker %s: the pubsub listener did not stop; leaving it", self.name)
            else:
                self.pubsub.close()
            self.pubsub_thread = None

    def _tell_horse(self) -> None:
        if self.horse_pid:
            try:
                os.kill(self.horse_pid, PREEMPT_SIGNAL)
            except ProcessLookupError:  # it just ended
                pass


def main(burst: bool = False, *, slots: int | None = None, device: str | None = None,
         labels: list[str] | None = None, address: str | None = None, api: str | None = None,
         join_token: str | None = None) -> None:
    """Flags override the environment (TRAINJOBS_WORKER_SLOTS, _DEVICE, _LABELS, _ADDRESS), then detection."""
    # First: this process and its work-horses (forks) hold the database and Redis URLs, and the ranks of an
    # entrypoint job are their descendants with the same uid (service/undumpable.py).
    catch_stop_early()
    if not make_undumpable():
        logging.getLogger(__name__).warning("could not make the worker undumpable: jobs of its uid can read "
                                            "its environment (the database URL) from /proc")
    for key, value in (("SLOTS", slots), ("DEVICE", device), ("ADDRESS", address), ("API", api),
                       ("JOIN_TOKEN", join_token)):
        if value is not None:
            os.environ[f"TRAINJOBS_WORKER_{key}"] = str(value)
    if labels:
        os.environ["TRAINJOBS_WORKER_LABELS"] = ",".join([os.environ.get("TRAINJOBS_WORKER_LABELS", ""), *labels])
    get_settings.cache_clear()  # the work-horses read the same, through the environment
    settings = get_settings()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    runner = control.runner_name()  # before the default name below: a joined machine's name in the pool
    name = os.environ.get("TRAINJOBS_WORKER_NAME") or f"{socket.gethostname()}-{os.getpid()}"
    os.environ["TRAINJOBS_WORKER_NAME"] = name
    # Issue 42: a worker that joins through the API registers and beats there, with a credential of its own; one
    # that writes the database itself (its URL where tenants' code runs) only when asked for by name.
    if not settings.worker_api and not settings.worker_database:
        raise SystemExit(NO_API)
    own = control.joined(settings, runner=runner) if settings.worker_api else None
    os.environ.pop("TRAINJOBS_WORKER_JOIN_TOKEN", None)  # spent: not for the work-horses
    support = sandbox.detect(settings)
    try:
        sandbox.check_start(settings, support)
    except sandbox.SandboxUnavailable as exc:
        raise SystemExit(f"trainjobs worker: {exc}") from None
    check_store(settings, who="worker")  # issue 31: a store configured but unusable stops the start, naming it
    redis_open = warn_if_open(settings, who="worker", log=log)
    if redis_open and settings.sandbox == "required":
        raise SystemExit("trainjobs worker: TRAINJOBS_SANDBOX=required, but Redis answers without a password: any "
                         "job that reaches it could write to the queue (give it one: TRAINJOBS_REDIS_PASSWORD_FILE)")
    sandbox.set_current(support)  # each work-horse inherits it
    log.log(logging.INFO if support.on else logging.WARNING, "worker %s: %s", name, support.describe())
    offer = probe(settings, name=name, labels={**support.labels(), REDIS_AUTH_LABEL: "none" if redis_open else
                                               "password"})
    worker.agent.offer = offer  # each work-horse inherits it (gang endpoints, busy slots)
    engine = sessions = None  # a joined worker holds no database URL: it reaches the database through the API
    if own is None:
        engine = make_engine(settings.resolved_database_url, application_name=name)  # the sweeper ends frozen ones'
        # NOTE: a forked work-horse must never use (or close) the pooled connections it inherited.
        os.register_at_fork(after_in_child=lambda: engine.dispose(close=False))
        sessions = make_sessionmaker(engine)
    disk = DiskWatch(settings)
    FittingQueue.taker = Taker(sessions, offer, settings, pressure=disk.pressure)
    redis = Redis.from_url(settings.redis_url)
    # The gang's node tasks first, then what the scheduler assigned to this worker (all its lanes share its queue).
    queues = [FittingQueue(n, connection=redis, serializer=JSONSerializer, job_class=GuardedJob)
              for n in (f"{settings.queue_prefix}-{GANG}", worker_queue_name(settings.queue_prefix, offer.id))]
    current: list[PreemptingWorker] = []

    def make_worker(rq_name: str = name) -> PreemptingWorker:
        current[:] = [PreemptingWorker(queues, connection=redis, serializer=JSONSerializer, name=rq_name,
                                       queue_class=FittingQueue, job_class=GuardedJob)]
        return current[0]

    # Issue 42: the work-horses' ships and leases, and the heartbeat, go to the API as one tick (worker/tick.py);
    # its socket is made before the lanes are forked, its threads start after.
    relay = Relay(own, window_s=settings.poll_s) if own is not None else None
    if relay is not None:
        os.environ[SOCKET_ENV] = relay.path
    lanes = None
    if offer.max_jobs > 1:  # forked before the heartbeat's thread starts: a fork copies no lock a thread holds
        log.info("worker %s runs up to %d jobs at once, each on devices of its own", name, offer.max_jobs)
        lanes = Lanes(offer.max_jobs, lambda i: serve(lambda: make_worker(f"{name}.{i}"), burst=burst), burst=burst)
        if _stop_signals:  # stopped while it started: its lanes stop too
            lanes.forward(_stop_signals[0], None)

    def draining() -> bool:
        return lanes.draining if lanes else bool(current) and current[0].draining

    def revoked(_why: str) -> None:  # as a shutdown: its jobs handed back, checkpointed, then it stops
        os.kill(os.getpid(), signal.SIGTERM)

    if relay is not None:
        relay.start()
    stop_heartbeat = start_heartbeat(relay or sessions, offer=offer, every_s=settings.heartbeat_s, draining=draining,
                                     pressure=disk.pressure, on_revoked=revoked,
                                     images=lambda: images.cached(settings))
    try:
        kick(redis, prefix=settings.queue_prefix)  # registered: the scheduler's next pass may assign it jobs now
    except RedisError:
        pass
    try:
        if lanes is None:
            serve(make_worker, burst=burst)
        else:
            lanes.wait()
    finally:
        stop_heartbeat()
        if relay is not None:
            relay.stop()
        if engine is not None:
            engine.dispose()


class Lanes:
    """A shared worker's lanes (issue 30): one forked process per job it may run at once, each an RQ worker loop
    with its own work-horse. They all listen to the worker's own queue, each job on the devices the scheduler held
    for it (service/workers/holds.py), and take gang node tasks one at a time (worker/dispatch.py `Taker.taking`);
    this process keeps the worker's heartbeat.

    A shutdown signal goes to every lane: each hands its job back (RQ's warm shutdown, PreemptingWorker), a second
    stops them now. A lane dies with this process (PDEATHSIG): kill -9 the worker and its lanes go too, their
    jobs' leases run out and the sweeper gives the jobs to other workers. A lane that ends on its own (a crash) is
    started again, unless the worker is shutting down.
    """

    RESTART_S = 1.0

    def __init__(self, count: int, serve_lane: Callable[[int], None], *, burst: bool):
        self.serve_lane, self.burst = serve_lane, burst
        self.pids: dict[int, int] = {}  # pid -> lane
        self.draining = False
        signal.signal(signal.SIGTERM, self.forward)
        signal.signal(signal.SIGINT, self.forward)
        for i in range(count):
            if not self.draining:  # a stop while they start: the rest never do
                self._start(i)

    def wait(self) -> None:
        """Until every lane ended (a shutdown, or with burst empty queues)."""
        while self.pids:
            try:
                pid, status = os.wait()
            except ChildProcessError:
                return
            except InterruptedError:
                continue
            lane = self.pids.pop(pid, None)
            if lane is None:
                continue
            if not (self.draining or self.burst or status == 0):
                log.warning("lane %d (pid %d) ended (status %d); starting it again", lane, pid, status)
                time.sleep(self.RESTART_S)
                self._start(lane)

    def _start(self, lane: int) -> None:
        pid = os.fork()
        if pid:
            self.pids[pid] = lane
            return
        code = 0
        try:
            catch_stop_early()  # first: the parent's handler (forward) would signal this lane's siblings
            processes.die_with_parent(signal.SIGKILL)
            PreemptingWorker.in_lane = True
            self.serve_lane(lane)
        except BaseException:  # noqa: BLE001 - a lane's crash: logged, and the worker starts it again
            log.exception("lane %d failed", lane)
            code = 1
        finally:
            logging.shutdown()
            os._exit(code)

    def forward(self, signum, frame) -> None:
        self.draining = True
        for pid in list(self.pids):
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass


def serve(make_worker: Callable[[], PreemptingWorker], *, burst: bool) -> None:
    """Run RQ's worker loop until a shutdown (or, with burst, empty queues).

    RQ quits its loop on any error outside its dequeue (Redis gone between two calls, restarted empty):
    then the loop starts again, once Redis answers and any job still running in a work-horse has ended.
    A pool must not shrink by one worker per Redis outage.
    """
    wait, rq_worker = 1.0, None
    while True:
        try:
            rq_worker = make_worker()  # RQ names its connection in Redis here: an outage may still be on
            rq_worker.work(burst=burst, with_scheduler=False)
        except RedisError as exc:  # its start, or its teardown (deregistering in Redis), failed too
            log.warning("worker loop: Redis is out of reach (%s)", exc)
        except StopRequested:
            return
        if rq_worker is None:  # never started: Redis was out of reach from the first
            time.sleep(wait)
            wait = min(RESTART_MAX_S, wait * 2)
            continue
        if burst or rq_worker.draining:
            return
        _wait_for_horse(rq_worker.horse_pid)
        log.warning("the worker loop ended on an outage; starting it again in %.0fs", wait)
        try:
            time.sleep(wait)
            rq_worker.connection.delete(rq_worker.key)  # its stale registration (RQ refuses a live name twice)
        except RedisError:
            pass
        except StopRequested:  # a shutdown signal while it waited (RQ's handler of the loop that ended)
            return
        if rq_worker.draining:
            return
        wait = min(RESTART_MAX_S, wait * 2)


def _wait_for_horse(pid: int) -> None:
    while pid:
        try:
            if os.waitpid(pid, os.WNOHANG)[0]:
                return
        except ChildProcessError:
            return
        time.sleep(1.0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="worker.main", description="a trainjobs worker")
    add_offer_flags(parser)
    parser.add_argument("--burst", action="store_true", help="exit when the queues are empty")
    return parser.parse_args(argv)


def add_offer_flags(parser: argparse.ArgumentParser) -> None:
    """--slots, --device, --label, --address: what this worker offers, overriding what it detects."""
    parser.add_argument("--slots", type=int, help="processes (CPU) or GPUs (CUDA) a job may use here")
    parser.add_argument("--device", choices=["cpu", "cuda"])
    parser.add_argument("--label", action="append", metavar="K=V", help="a label jobs select with resources.selector")
    parser.add_argument("--address", help="how other nodes reach this one (a gang's rendezvous)")
    parser.add_argument("--api", metavar="URL", help="join the pool through this API: registration and heartbeat "
                        "go there with this machine's own credential (TRAINJOBS_WORKER_API)")
    parser.add_argument("--join-token", metavar="T", help="an admin's join token (trainjobs worker-token create), "
                        "exchanged once for the credential (TRAINJOBS_WORKER_JOIN_TOKEN)")


if __name__ == "__main__":
    args = parse_args()
    main(burst=args.burst, slots=args.slots, device=args.device, labels=args.label, address=args.address,
         api=args.api, join_token=args.join_token)
