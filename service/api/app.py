"""The app factory: routers, error handlers, and the sweeper and the webhooks' delivery loop started with the app."""

import logging
import re
import threading
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from redis import Redis
from starlette.exceptions import HTTPException as StarletteHTTPException

from service.api import invalid
from service.api.admitter import Admitter
from service.api.events import router as events_router
from service.api.health import router as health_router
from service.api.loop_reads import UNREACHABLE as LOOP_UNREACHABLE
from service.api.loop_reads import LoopReads
from service.api.middleware import BodyLimit, RefuseNul
from service.api.plan import router as plan_router
from service.api.prometheus import install as install_prometheus
from service.api.strict_json import refuse_non_finite
from service.api.sweeper import Sweeper
from service.artifacts.router import router as artifacts_router
from service.auth import tokens
from service.auth.cache import PrincipalCache
from service.auth.deps import current_principal
from service.auth.router import router as auth_router
from service.dashboard.router import router as dashboard_router
from service.db import UNREACHABLE, make_engine, make_private_dir, make_sessionmaker
from service.errors import TrainjobsError, responses
from service.images.router import router as images_router  # before runners.router: its calls are served there
from service.jobs.bodies import RenderedJobs
from service.jobs.router import router as jobs_router
from service.logs.router import router as logs_router
from service.metrics.charts import RenderedCharts
from service.metrics.router import router as metrics_router
from service.packages.router import router as packages_router
from service.redis_auth import warn_if_open
from service.runners import credentials
from service.runners.router import admin_router as worker_admin_router
from service.runners.router import router as worker_router
from service.scheduling.router import router as scheduling_router
from service.settings import Settings, get_settings
from service.storage import check_store
from service.sweeps.router import router as sweeps_router
from service.webhooks.delivery import Deliverer
from service.webhooks.router import router as webhooks_router
from service.workers.router import router as workers_router

log = logging.getLogger(__name__)


@asynccontextmanager
async def lifespan(app: FastAPI):
    settings = app.state.settings
    app.state.store = check_store(settings, who="api")  # issue 31: a store configured but unusable stops the start
    if settings.auth:
        with app.state.sessionmaker() as db:
            if tokens.bootstrap_admin(db, settings):
                log.warning("first start: an admin token was written to %s (mode 0600)", settings.admin_token_file)
    if settings.join_token_file is not None:  # issue 42: the operator's join token (a compose file's workers join)
        accept_join_token(app, settings.join_token_file)
    warn_if_open(settings, who="API", log=log)  # an unreachable Redis is the sweeper's to wait for, not the start's
    sweeper = Sweeper(app.state.settings, app.state.sessionmaker, app.state.redis,
                      on_collect=getattr(app.state, "count_collected", None), needs=app.state.job_needs)
    thread = threading.Thread(target=sweeper.run, name="sweeper", daemon=True)
    thread.start()
    deliverer = Deliverer(settings, app.state.sessionmaker)  # webhooks: every API process delivers its share
    delivering = threading.Thread(target=deliverer.run, name="webhooks", daemon=True)
    delivering.start()
    app.state.loop_reads = LoopReads.for_url(settings.resolved_database_url)  # this loop's own connections
    yield
    if app.state.loop_reads is not None:
        await app.state.loop_reads.close()
        app.state.loop_reads = None
    app.state.admitter.close()
    sweeper.stop.set()
    deliverer.stop.set()
    deliverer.wake.set()
    thread.join(timeout=5)
    delivering.join(timeout=5)
    app.state.redis.close()
    app.state.engine.dispose()


def accept_join_token(app: FastAPI, path: Path) -> None:
    """The join token in `path` is accepted from now on (stored as a hash once; one an admin revoked stays
    revoked). A missing or malformed file stops the start, naming it: a pool whose workers cannot join is no pool."""
    try:
        secret = path.read_text()
    except OSError as exc:
        raise RuntimeError(f"TRAINJOBS_JOIN_TOKEN_FILE {path}: {exc.strerror or exc}") from None
    with app.state.sessionmaker() as db:
        if credentials.ensure_join_token(db, secret=secret, created_by="TRAINJOBS_JOIN_TOKEN_FILE") is None:
            raise RuntimeError(f"TRAINJOBS_JOIN_TOKEN_FILE {path} holds no join token: write tjj_ and 32 or more "
                               "random characters into it (echo \"tjj_$(openssl rand -hex 32)\")")
        db.commit()


def allowed_methods(app: FastAPI, path: str) -> str:
    """Every method the documented routes accept on this path, for a 405's Allow header."""
    methods: set[str] = set()
    for template, item in app.openapi()["paths"].items():
        if re.fullmatch(re.sub(r"\\{[^/]+?\\}", "[^/]+", re.escape(template)), path):
            methods |= {m.upper() for m in item}
    return ", ".join(sorted(methods))


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    make_private_dir(settings.data_dir)  # 0700 where new
    app = FastAPI(title="trainjobs", version="0.1.0", lifespan=lifespan)
    app.state.settings = settings
    app.state.engine = make_engine(settings.resolved_database_url)
    app.state.sessionmaker = make_sessionmaker(app.state.engine)
    app.state.redis = Redis.from_url(settings.redis_url, socket_timeout=5, socket_connect_timeout=5)
    app.state.principals = PrincipalCache(app.state.redis, f"{settings.queue_prefix}:auth:epoch")
    app.state.runners = {}  # worker credentials seen lately (service/runners/router.py)
    app.state.job_bodies = RenderedJobs()
    app.state.job_needs = {}  # job id → scheduling.Req: put by admission, read by this process's sweeper
    app.state.admitter = Admitter(settings, app.state.sessionmaker, app.state.redis, app.state.job_bodies,
                                  app.state.job_needs)  # its thread starts with the first submission
    app.state.charts = RenderedCharts()
    app.state.loop_reads = None  # until the lifespan starts (service/api/loop_reads.py)

    @app.exception_handler(TrainjobsError)
    async def _trainjobs_error(_request: Request, exc: TrainjobsError) -> JSONResponse:
        return JSONResponse(status_code=exc.status_code, content={"detail": exc.message, "field": exc.field},
                            headers=exc.headers)

    app.add_exception_handler(RequestValidationError, invalid.answer)  # 400 for no JSON; "did you mean"

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        headers = dict(exc.headers or {})
        if exc.status_code == 405:  # Starlette names only the first matching route's methods
            headers["Allow"] = allowed_methods(app, request.url.path) or headers.get("Allow", "")
        return JSONResponse(status_code=exc.status_code, content={"detail": exc.detail}, headers=headers)

    async def _database_unreachable(_request: Request, exc: Exception) -> JSONResponse:
        log.warning("database unreachable: %s", exc.__class__.__name__)
        return JSONResponse(status_code=503, headers={"Retry-After": "2"},
                            content={"detail": "the database is unreachable; try again shortly"})

    # An outage is the service's, not a bug: a 503 a client retries.
    for unreachable in (*UNREACHABLE, *LOOP_UNREACHABLE):
        app.add_exception_handler(unreachable, _database_unreachable)

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=exc)
        return JSONResponse(status_code=500, content={"detail": "internal error (a bug: please report it)"})

    app.include_router(health_router)  # /healthz and /readyz stay open
    app.include_router(dashboard_router)  # the page is open: the /v1 calls it makes carry the token
    # Every /v1 route needs a token, whether or not its own signature asks for the principal, and takes only
    # finite numbers in its body (strict JSON).
    for router in (jobs_router, metrics_router, logs_router, artifacts_router, plan_router, events_router,
                   auth_router, workers_router, scheduling_router, webhooks_router, sweeps_router,
                   worker_admin_router, images_router):
        app.include_router(router, dependencies=[Depends(current_principal), Depends(refuse_non_finite)],
                           responses=responses(401, 422))
    # The worker protocol (issue 42): a worker's own credential, checked by each route (a join token for /join);
    # a user's token is no worker's.
    app.include_router(worker_router, dependencies=[Depends(refuse_non_finite)], responses=responses(401, 403, 422))
    # A package's body is a .tar.gz streamed to disk under its own cap (service/packages/service.py): no JSON.
    app.include_router(packages_router, dependencies=[Depends(current_principal)], responses=responses(401, 422))
    install_prometheus(app)
    # A worker's tick carries its attempts' batches (service/runners/tick_calls.py): the worker routes have a cap of
    # their own, the rest of the API max_body_bytes.
    worker = lambda scope: scope["path"].startswith("/v1/worker/")  # noqa: E731
    app.add_middleware(BodyLimit, max_bytes=settings.worker_max_body_bytes, exempt=lambda scope: not worker(scope))
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes,  # outermost: before anything reads a body
                       exempt=lambda scope: worker(scope) or scope["method"] == "PUT" and
                       scope["path"].startswith("/v1/packages/"))
    app.add_middleware(RefuseNul)
    return app
