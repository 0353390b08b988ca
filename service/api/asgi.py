"""`uvicorn service.api.asgi:app`: the app built from the environment's settings."""

from service.api.app import create_app
from service.undumpable import make_undumpable

make_undumpable()  # its environment holds the database URL; on one machine jobs may run with its uid
app = create_app()
