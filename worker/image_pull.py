"""One attempt's pull of its image, as the control plane sees it: the registry login it lends for the pull, the
pull's progress as the job's pending reason, and the digest the attempt runs (issue 44).

A login is asked for only when the registry is reached (a cached digest reference asks nothing), through the
worker protocol's `image-login` call (service/images/calls.py): the job owner's own login for that registry,
else the owner's team's, and only for an attempt this worker runs. It reaches skopeo as an --authfile written
0600 into <secrets dir>/image-auth/ (0700; the secrets dir is never shown to a job) and removed after the pull:
never an argument (ps), never the environment, never a file under the data dir.
"""

import base64
import json
import logging
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

from service.images import calls  # noqa: F401 (a database worker runs the image calls in-process: registered)
from service.settings import Settings
from worker import control as worker_control
from worker.image_box import CHECK_TIMEOUT_S
from worker.images import Image, ImageUnavailable
from worker.lease import Lease

log = logging.getLogger(__name__)
SAY_EVERY_S = 2.0  # the pending reason is written at most this often while a pull goes on
REFUSED_WORDS = ("unauthorized", "authentication required", "requested access to the resource is denied",
                 "denied:")


class ForJob:
    """The pull of one attempt's image (one node of it): what the control plane lends and learns."""

    def __init__(self, control: worker_control.Control, settings: Settings, *, job_id: str, attempt: int,
                 node_rank: int = 0, lease: Lease | None = None):
        self.control, self.settings, self.lease = control, settings, lease
        self.ref = {"job_id": job_id, "attempt": attempt, "node_rank": node_rank}
        self.login: dict | None = None  # the image-login answer, once asked
        self._said_at = -float("inf")

    @classmethod
    def of(cls, settings: Settings, lease: Lease | None) -> "ForJob | None":
        """The attempt's pull, reaching the control plane as its lease does (the API, or the database)."""
        if lease is None:
            return None
        control = lease.control  # the supervisor's, which its lease renews through
        return cls(control, settings, job_id=lease.job_id, attempt=lease.attempt, node_rank=lease.node_rank,
                   lease=lease)

    def ask_login(self) -> dict:
        """The login for the job's image's registry (username null: none is stored)."""
        if self.login is None:
            try:
                self.login = self.control.call("image-login", self.ref) or {}
            except worker_control.Unreachable as exc:
                raise ImageUnavailable(f"the image's registry login could not be asked for: {exc}") from None
            except worker_control.Refused as exc:
                raise ImageUnavailable(f"the control plane refused the image's registry login: {exc.detail}") from None
        return self.login

    @contextmanager
    def authfile(self, registry: str) -> Iterator[str | None]:
        """The path of skopeo's --authfile for this pull, holding the lent login (None: the owner has none). The
        file is gone when the block ends, however it ends."""
        login = self.ask_login()
        if not login.get("username"):
            yield None
            return
        folder = self.settings.resolved_secrets_dir / "image-auth"
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(folder, 0o700)
        fd, path = tempfile.mkstemp(prefix="auth-", suffix=".json", dir=folder)  # 0600, O_EXCL
        try:
            token = base64.b64encode(f"{login['username']}:{login['password']}".encode()).decode()
            with os.fdopen(fd, "w") as out:
                json.dump({"auths": {registry: {"auth": token}}}, out)
            yield path
        finally:
            os.unlink(path)

    def refused(self, reference: str, registry: str, words: str) -> str | None:
        """The job's message when the registry refused the pull for want of a (good) login; None otherwise."""
        if not any(w in words.lower() for w in REFUSED_WORDS):
            return None
        login = self.login or {}
        owner = login.get("owner", "the job's owner")
        if login.get("username"):
            return (f"image {reference}: the registry {registry} refused the login of {login['whose']} (username "
                    f"{login['username']}): set it again with `trainjobs registry login {registry}` ({words})")
        return (f"image {reference}: the registry {registry} asks for a login, and none is stored for {owner} or "
                f"{owner}'s team: `trainjobs registry login {registry} --username U --password-stdin` ({words})")

    def say(self, phase: str, *, now: bool = False) -> None:
        """The job's pending reason, at most every SAY_EVERY_S (`now`: whatever the last was); best effort."""
        if self.lease is not None:
            self.lease.tick()  # the pull is progress: its lease keeps being renewed however long it takes
        if not now and time.monotonic() - self._said_at < SAY_EVERY_S:
            return
        self._said_at = time.monotonic()
        try:
            self.control.call("phase", {**self.ref, "phase": phase})
        except (worker_control.Unreachable, worker_control.Refused) as exc:
            log.warning("job %s: its phase %r was not written: %s", self.ref["job_id"], phase, exc)

    def pulled(self, image: Image) -> None:
        """The digest the attempt runs, as a job event; best effort (the pull itself went well). The start check
        follows (image_box.check: the image's python3 imports its torch, up to CHECK_TIMEOUT_S on a cold image):
        the lease is kept through it."""
        if self.lease is not None:
            self.lease.tick(busy_s=CHECK_TIMEOUT_S)
        try:
            self.control.call("image-pulled", {**self.ref, "digest": image.digest, "pulled_s": image.pulled_s})
        except (worker_control.Unreachable, worker_control.Refused) as exc:
            log.warning("job %s: image %s's digest %s was not recorded: %s", self.ref["job_id"], image.reference,
                        image.digest, exc)
