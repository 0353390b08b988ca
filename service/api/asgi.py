"""`uvicorn service.api.asgi:app`: the app built from the environment's settings."""

from service.api.app import create_app

app = create_app()
