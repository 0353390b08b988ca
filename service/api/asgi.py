"""`uvicorn service.api.asgi:app`: the app built from the environment's settings."""

import gc

from service.api.app import create_app
from service.undumpable import make_undumpable

make_undumpable()  # its environment holds the database URL; on one machine jobs may run with its uid
app = create_app()

# NOTE: everything made so far (the modules, the app, its routes and schemas: most of the heap) lives as long as
# the process. Frozen, the cyclic collector never walks it again: its full collections were pauses of tens of
# ms every few seconds under load, the API's p99 (at 50 connections, /healthz: 118-134 ms → 34-38 ms; measured
# in bench/README.md "Fifth pass"). Here, not in create_app: a test process builds hundreds of apps.
gc.collect()
gc.freeze()
