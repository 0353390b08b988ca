"""Every call of the worker protocol, registered by importing this module: the API's router serves them, and a
worker that holds the database's URL runs them in-process (worker/control.py DatabaseControl)."""

from service.images import calls as image_calls  # noqa: F401
from service.runners import assign_calls, attempt_calls, ship_calls  # noqa: F401
