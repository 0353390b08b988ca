"""The app factory: routers, error handlers, and the sweeper started with the app."""

import logging
import threading
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from redis import Redis

from service.artifacts.router import router as artifacts_router
from service.db import make_engine, make_sessionmaker
from service.errors import TrainjobsError
from service.events import router as events_router
from service.health import router as health_router
from service.jobs.router import router as jobs_router
from service.logs.router import router as logs_router
from service.metrics.router import router as metrics_router
from service.plan_router import router as plan_router
from service.prometheus import install as install_prometheus
from service.settings import Settings, get_settings
from service.sweeper import Sweeper

log = logging.getLogger(__name__)


@asynccontextmanager
async def lifespan(app: FastAPI):
    sweeper = Sweeper(app.state.settings, app.state.sessionmaker, app.state.redis)
    thread = threading.Thread(target=sweeper.run, name="sweeper", daemon=True)
    thread.start()
    yield
    sweeper.stop.set()
    thread.join(timeout=5)
    app.state.redis.close()
    app.state.engine.dispose()


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    app = FastAPI(title="trainjobs", version="0.1.0", lifespan=lifespan)
    app.state.settings = settings
    app.state.engine = make_engine(settings.resolved_database_url)
    app.state.sessionmaker = make_sessionmaker(app.state.engine)
    app.state.redis = Redis.from_url(settings.redis_url, socket_timeout=5, socket_connect_timeout=5)

    @app.exception_handler(TrainjobsError)
    async def _trainjobs_error(_request: Request, exc: TrainjobsError) -> JSONResponse:
        return JSONResponse(status_code=exc.status_code, content={"detail": exc.message, "field": exc.field})

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=exc)
        return JSONResponse(status_code=500, content={"detail": "internal error (a bug: please report it)"})

    for router in (health_router, jobs_router, metrics_router, logs_router, artifacts_router, plan_router,
                   events_router):
        app.include_router(router)
    install_prometheus(app)
    return app
