"""One error hierarchy; service/main.py maps it to HTTP in one place."""


class TrainjobsError(Exception):
    """Base of every error the control plane raises on purpose."""

    status_code = 400

    def __init__(self, message: str, *, field: str | None = None):
        super().__init__(message)
        self.message = message
        self.field = field


class JobNotFound(TrainjobsError):
    status_code = 404

    def __init__(self, job_id: str):
        super().__init__(f"job {job_id!r} not found", field="job_id")


class ArtifactNotFound(TrainjobsError):
    status_code = 404


class InvalidTransition(TrainjobsError):
    status_code = 409


class IdempotencyConflict(TrainjobsError):
    """An Idempotency-Key reused with another spec: the client's retry is not the request it first made."""

    status_code = 409

    def __init__(self, job_id: str):
        super().__init__(f"this Idempotency-Key already made job {job_id} from another spec; use a new key",
                         field="Idempotency-Key")


class InvalidRequest(TrainjobsError):
    status_code = 422
