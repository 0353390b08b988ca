"""The root of the one error hierarchy: what went wrong in words, and the field at fault.

The control plane adds its own kinds (service/errors.py) and maps them all to HTTP in one place; the
SDK raises trainjobs.client.APIError with the API's answer.
"""


class TrainjobsError(Exception):
    """Base of every error trainjobs raises on purpose; `status_code` is its HTTP answer."""

    status_code = 400
    headers: dict[str, str] | None = None

    def __init__(self, message: str, *, field: str | None = None):
        super().__init__(message)
        self.message = message
        self.field = field


class InvalidRequest(TrainjobsError):
    status_code = 422


class NotFound(TrainjobsError):
    """Not found, or not the caller's: the API answers both the same."""

    status_code = 404
