"""The runners domain's calls of the worker protocol, registered by importing this module (a domain above this one
registers its own: service/images/calls.py); the API's router serves them, and a worker that holds the database's
URL runs them in-process (worker/control.py DatabaseControl)."""

from service.runners import assign_calls, attempt_calls, node_calls, ship_calls, tick_calls  # noqa: F401
