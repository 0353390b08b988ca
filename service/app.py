"""`uvicorn service.app:app`: the app built from the environment's settings."""

from service.main import create_app

app = create_app()
