"""A worker's container images (spec.image): pulled without a daemon, unpacked once, shared read-only by its jobs.

Why skopeo and umoci: the registry-native pair that enroot, Podman's rootless stack and OpenSUSE's builders use;
skopeo speaks the OCI distribution API (tokens, redirects, mirrors) and copies an image into an OCI layout on
disk; umoci unpacks that layout's layers, whiteouts included, into a root filesystem, refusing a member that would
land outside it. No Docker engine, no root needed.

The cache is <data_dir>/image-cache/<manifest digest hex>/ (rootfs/ and the image's config.json), content-addressed:
a tag is resolved to its digest first (one manifest read), a digest reference needs no registry at all once
pulled. Each entry has <hex>.pull, held by the lane that pulls it (a second lane naming the same image waits and
then finds it there: one pull per machine), and <hex>.lock, held shared by every attempt that uses it (from before
its pull until its box closes) and taken by eviction only without waiting, so an image in use is never removed
under a job. Last use and size are <hex>.used and
<hex>.bytes, as in worker/packages.py; past TRAINJOBS_IMAGE_CACHE_BYTES the least recently used unused entries go.

NOTE: unpacked with --rootless even by a root worker: device nodes and ownership in a layer are not made on the
host (a hostile image's 0666 block device would be a job's door to the disk); a job only reads the rootfs.
NOTE: the worker's own registry logins are never used (skopeo's --no-creds, or --authfile): a private image is
pulled with its job owner's login (or the owner's team's), which the control plane lends for that pull alone
(the `image-login` call, service/images/calls.py); it is written 0600 into a folder of the secrets dir, which no
job is shown, and removed once the pull is done (worker/image_pull.py).
"""

import fcntl
import hashlib
import ipaddress
import json
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from service.images.service import registry_of
from service.settings import Settings
from trainjobs.spec import IMAGES_LABEL
from worker.packages import evict_lru

if TYPE_CHECKING:
    from worker.image_pull import ForJob

log = logging.getLogger(__name__)
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
TOOLS = ("skopeo", "umoci")
LOOPBACK_NAMES = ("localhost",)
SKOPEO_FATAL = re.compile(r'level=fatal msg="(.*)"$')
CACHED_MAX = 1024  # images a worker reports having (its heartbeat's bound)
PROGRESS_POLL_S = 0.5  # how often a pull's bytes are counted (the job hears of them every SAY_EVERY_S)
ARCH = {"x86_64": "amd64", "aarch64": "arm64", "ppc64le": "ppc64le", "s390x": "s390x"}.get(platform.machine(),
                                                                                           platform.machine())


class ImageUnavailable(Exception):
    """The image could not be pulled or unpacked here (its words); retried as an outage would be."""


class ImageUnusable(Exception):
    """The image lacks what a rank needs ("image has no python3", "torch missing in the image"); final."""


def why_not() -> str | None:
    """Why this worker cannot run images; None when it can."""
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed on this worker"
    return None


def labels(sandbox_on: bool) -> dict[str, str]:
    """trainjobs.io/images=on where jobs with an image run here (it also takes the sandbox: the image is its /)."""
    return {IMAGES_LABEL: "on" if sandbox_on and why_not() is None else "off"}


@dataclass
class Image:
    """One image as an attempt uses it: its unpacked root, its config's environment, held shared until released."""

    reference: str
    digest: str  # sha256:<hex> of the manifest the reference names
    rootfs: Path
    env: dict[str, str] = field(default_factory=dict)  # the image config's Env
    workdir: str = ""  # the image config's WorkingDir
    pulled_s: float | None = None  # seconds this attempt spent pulling and unpacking; None: found in the cache
    lock_fd: int | None = None
    cwd: str | None = None  # where a job of the user's own code starts in it (image_box.check: its WorkingDir)

    @property
    def path(self) -> str:
        return self.env.get("PATH") or DEFAULT_PATH

    @property
    def entry(self) -> Path:
        return self.rootfs.parent

    def release(self) -> None:
        """The attempt is over: the image may be evicted again."""
        if self.lock_fd is not None:
            os.close(self.lock_fd)
            self.lock_fd = None


def is_loopback(registry: str) -> bool:
    host = registry.rsplit(":", 1)[0].strip("[]") if registry.count(":") <= 1 else registry.strip("[]")
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def insecure(settings: Settings, reference: str) -> bool:
    """Whether to pull `reference` without TLS: only a registry the operator listed, and only on loopback."""
    registry = registry_of(reference)
    listed = {r.strip() for r in settings.image_insecure_registries.split(",") if r.strip()}
    if registry not in listed:
        return False
    if not is_loopback(registry):
        log.warning("image_insecure_registries names %s, which is not on loopback: pulled with TLS all the same",
                    registry)
        return False
    return True


def split_digest(reference: str) -> tuple[str, str | None]:
    """(name without tag or digest, sha256:<hex> or None)."""
    name, _, digest = reference.partition("@")
    last = name.rsplit("/", 1)
    if ":" in last[-1]:
        name = name[: len(name) - len(last[-1]) + last[-1].index(":")]
    return name, digest or None


class ImageCache:
    """This worker's unpacked images (<data_dir>/image-cache)."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.root = settings.data_dir / "image-cache"
        self.max_bytes = settings.image_cache_bytes

    def get(self, reference: str, job: "ForJob | None" = None) -> Image:
        """The image, pulled and unpacked unless this machine has it; held shared until Image.release(). `job`:
        the attempt it is for (its owner's registry login, its pending reason, its digest recorded); without
        one, the registry is asked anonymously."""
        if (why := why_not()) is not None:
            raise ImageUnavailable(f"this worker cannot run images: {why}")
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o755)
        _, pinned = split_digest(reference)
        if pinned is not None and (self.root / pinned.removeprefix("sha256:") / "rootfs").is_dir():
            # A pinned image it has: no registry, no login (unless evicted before it is held: pulled after all).
            image = self._hold(reference, pinned, lambda final: self._logged_in(reference, job, final))
        else:
            image = self._logged_in(reference, job)
        if job is not None:
            job.pulled(image)
        return image

    def _logged_in(self, reference: str, job: "ForJob | None", final: Path | None = None):
        """With the job's login (an authfile while the block runs): resolved, then held from the cache or pulled;
        or, given `final`, its pull alone (a float or None, as _pull_once)."""
        with job.authfile(registry_of(reference)) if job is not None else nullcontext() as auth:
            if final is not None:
                return self._pull_once(reference, split_digest(reference)[1], final, job=job, auth=auth,
                                       manifest=None)
            digest, manifest = self.resolve(reference, job, auth)
            return self._hold(reference, digest, lambda final: self._pull_once(reference, digest, final, job=job,
                                                                                 auth=auth, manifest=manifest))

    def _hold(self, reference: str, digest: str, pull) -> Image:
        """The entry of `digest`, held shared (pulled first by `pull` where it is missing)."""
        name = digest.removeprefix("sha256:")
        final = self.root / name
        fd = os.open(self.root / f"{name}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        pulled_s = None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # in use from here on: eviction passes it by
            if not (final / "rootfs").is_dir():
                pulled_s = pull(final)
            (self.root / f"{name}.used").touch()
            _remember(self.root / f"{name}.refs", reference)
        except BaseException:
            os.close(fd)
            raise
        config = json.loads((final / "config.json").read_text())
        env = dict(item.split("=", 1) for item in (config.get("Env") or []) if "=" in item)
        self.evict(keep=name)
        return Image(reference, digest, final / "rootfs", env, workdir=config.get("WorkingDir") or "",
                     pulled_s=pulled_s, lock_fd=fd)

    def _pull_once(self, reference: str, digest: str, final: Path, *, job: "ForJob | None", auth: str | None,
                   manifest: bytes | None) -> float | None:
        """Pull under <hex>.pull: another lane pulling the same image is waited for, and its copy used (None)."""
        fd = os.open(self.root / f"{final.name}.pull", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            self._wait_turn(fd, reference, job)
            if (final / "rootfs").is_dir():
                return None
            started = time.monotonic()
            self._pull(reference, digest, final, job=job, auth=auth, manifest=manifest)
            return time.monotonic() - started
        finally:
            os.close(fd)

    @staticmethod
    def _wait_turn(fd: int, reference: str, job: "ForJob | None") -> None:
        """The pull lock, waited for while another lane pulls the image: the job told so and its lease kept (a
        large image's pull outlasts a lease many times over)."""
        if job is None:
            fcntl.flock(fd, fcntl.LOCK_EX)
            return
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                job.say(f"waiting for image {reference}: another job on this worker is pulling it")
                time.sleep(PROGRESS_POLL_S)

    def resolve(self, reference: str, job: "ForJob | None" = None, auth: str | None = None
                ) -> tuple[str, bytes | None]:
        """The manifest digest `reference` names now (its own, or the registry's answer for its tag), and the
        manifest where it was read."""
        _, digest = split_digest(reference)
        if digest is not None:
            return digest, None
        raw = self._inspect(reference, reference, job, auth)
        return "sha256:" + hashlib.sha256(raw).hexdigest(), raw

    def _inspect(self, target: str, reference: str, job: "ForJob | None", auth: str | None) -> bytes:
        """The raw manifest `target` names (a tag's, or a digest's)."""
        creds = ["--authfile", auth] if auth else ["--no-creds"]
        return self._run(["skopeo", "inspect", "--raw", *creds, *self._tls(reference, "--"), f"docker://{target}"],
                         reference, job, text=False)

    def _tls(self, reference: str, prefix: str) -> list[str]:
        return [f"{prefix}tls-verify=false"] if insecure(self.settings, reference) else []

    def _pull(self, reference: str, digest: str, final: Path, *, job: "ForJob | None", auth: str | None,
              manifest: bytes | None) -> None:
        """skopeo copy (by digest: what was resolved is what is unpacked), then umoci unpack, then in place."""
        name, _ = split_digest(reference)
        temp = self.root / f".pull-{final.name}-{os.getpid()}-{os.urandom(4).hex()}"
        try:
            temp.mkdir()
            total = self._layer_bytes(reference, f"{name}@{digest}", manifest, job, auth) if job else None
            creds = ["--src-authfile", auth] if auth else ["--src-no-creds"]
            of = f" of {_mb(total)} MB" if total else ""
            self._watched(["skopeo", "copy", "--quiet", *creds, *self._tls(reference, "--src-"),
                           f"docker://{name}@{digest}", f"oci:{temp / 'layout'}:image"], reference, job,
                          lambda: f"pulling image {reference}: {_mb(_bytes_under(temp / 'layout'))} MB{of}")
            entry = temp / "entry"
            entry.mkdir()
            unpacking = f"unpacking image {reference}" + (f" ({_mb(total)} MB)" if total else "")
            self._watched(["umoci", "raw", "unpack", "--rootless", "--image", f"{temp / 'layout'}:image",
                           str(entry / "rootfs")], reference, job, lambda: unpacking)
            (entry / "config.json").write_text(json.dumps(image_config(temp / "layout")))
            os.chmod(entry, 0o755)
            os.chmod(entry / "rootfs", 0o755)
            size = sum(os.lstat(os.path.join(top, f)).st_size for top, _, files in os.walk(entry / "rootfs")
                       for f in files)
            (self.root / f"{final.name}.bytes").write_text(str(size))
            os.rename(entry, final)
            log.info("image %s (%s) pulled and unpacked: %d bytes", reference, digest, size)
        finally:
            shutil.rmtree(temp, ignore_errors=True)

    def _layer_bytes(self, reference: str, pinned: str, manifest: bytes | None, job: "ForJob",
                     auth: str | None) -> int | None:
        """What the pull will read (this platform's layers and config, as its manifest says); None: unknown."""
        try:
            if manifest is None:
                manifest = self._inspect(pinned, reference, job, auth)
            found = json.loads(manifest)
            if "manifests" in found:  # an index: this platform's entry
                mine = next((m for m in found["manifests"] if m.get("platform", {}).get("os") == "linux"
                             and m.get("platform", {}).get("architecture") == ARCH), None)
                if mine is None:
                    return None
                name, _ = split_digest(pinned)
                return self._layer_bytes(reference, f"{name}@{mine['digest']}", None, job, auth)
            return sum(int(part["size"]) for part in [found["config"], *found["layers"]])
        except (ImageUnavailable, ValueError, KeyError, TypeError):
            return None

    def _watched(self, argv: list[str], reference: str, job: "ForJob | None", saying: Callable[[], str]) -> None:
        """`argv` run to its end, what `saying()` says (its bytes so far) told the job as it goes: written at most
        every SAY_EVERY_S, and the attempt's lease kept however long a large image takes. Bounded by
        image_pull_timeout_s; its stderr in a file (a pipe left unread could fill and stall it)."""
        if job is None:
            self._run(argv, reference, None)
            return
        deadline = time.monotonic() + self.settings.image_pull_timeout_s
        job.say(saying(), now=True)
        with tempfile.TemporaryFile() as errors, subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=errors,
                                                                  env=self._env()) as proc:
            while True:
                try:
                    proc.wait(PROGRESS_POLL_S)
                    break
                except subprocess.TimeoutExpired:
                    if time.monotonic() > deadline:
                        proc.kill()
                        proc.wait()
                        raise ImageUnavailable(f"image {reference}: {argv[0]} took more than image_pull_timeout_s="
                                               f"{self.settings.image_pull_timeout_s:g}s") from None
                    job.say(saying())
            if proc.returncode != 0:
                errors.seek(0)
                raise self._failed(argv, reference, job, errors.read())

    def _env(self) -> dict[str, str]:
        return {"PATH": os.environ.get("PATH", DEFAULT_PATH), "HOME": str(self.root)}

    def _run(self, argv: list[str], reference: str, job: "ForJob | None", *, text: bool = True):
        try:
            done = subprocess.run(argv, capture_output=True, timeout=self.settings.image_pull_timeout_s,
                                  env=self._env())
        except subprocess.TimeoutExpired:
            raise ImageUnavailable(f"image {reference}: {argv[0]} took more than image_pull_timeout_s="
                                   f"{self.settings.image_pull_timeout_s:g}s") from None
        if done.returncode != 0:
            raise self._failed(argv, reference, job, done.stderr)
        return done.stdout.decode() if text else done.stdout

    def _failed(self, argv: list[str], reference: str, job: "ForJob | None", stderr: bytes) -> ImageUnavailable:
        """The job's words for a failed skopeo or umoci: its last line, and what to do where a login is missing."""
        words = (stderr.decode(errors="replace").strip().splitlines() or ["?"])[-1]
        if (said := SKOPEO_FATAL.search(words)) is not None:  # logrus's line: its message alone
            words = said[1].replace('\\"', '"')
        words = words[:500]
        if job is not None and argv[0] == "skopeo" and (said := job.refused(reference, registry_of(reference), words)):
            return ImageUnavailable(said)
        return ImageUnavailable(f"image {reference}: {argv[0]} {argv[1]} failed: {words}")

    def evict(self, keep: str | None = None) -> list[str]:
        gone = evict_lru(self.root, max_bytes=self.max_bytes, keep=keep, remove=self._remove)
        if gone:
            log.info("image cache over %d bytes: evicted %s", self.max_bytes, gone)
        return gone

    def _remove(self, name: str) -> bool:
        """Remove an unused image; False while an attempt holds it (or a lane pulls it)."""
        fd = os.open(self.root / f"{name}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            doomed = self.root / f".evict-{name}-{os.urandom(4).hex()}"
            try:
                os.rename(self.root / name, doomed)
            except OSError:
                return False
            shutil.rmtree(doomed, ignore_errors=True)
            (self.root / f"{name}.refs").unlink(missing_ok=True)
            return True
        finally:
            os.close(fd)


def cached(settings: Settings) -> list[str]:
    """The images this worker has unpacked, as the scheduler's pass matches them to a job's `image` (issue 44):
    each one's sha256 digest and the references it was pulled by."""
    root, found = settings.data_dir / "image-cache", set()
    try:
        entries = list(root.iterdir())
    except FileNotFoundError:
        return []
    for entry in entries:
        if len(entry.name) == 64 and (entry / "rootfs").is_dir():
            found.add(f"sha256:{entry.name}")
            try:
                found.update(line for line in (root / f"{entry.name}.refs").read_text().splitlines() if line)
            except OSError:
                pass
    return sorted(found)[:CACHED_MAX]


def _remember(path: Path, reference: str) -> None:
    """`reference` among those an entry was pulled by (lanes append at once: whole lines, O_APPEND)."""
    try:
        if reference in path.read_text().splitlines():
            return
    except FileNotFoundError:
        pass
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, f"{reference}\n".encode())
    finally:
        os.close(fd)


def image_config(layout: Path) -> dict:
    """The image config's "config" (Env, WorkingDir, ...) of the one image in an OCI layout."""
    def blob(digest: str) -> dict:
        algo, _, hexdigest = digest.partition(":")
        return json.loads((layout / "blobs" / algo / hexdigest).read_text())

    manifest = blob(json.loads((layout / "index.json").read_text())["manifests"][0]["digest"])
    return blob(manifest["config"]["digest"]).get("config") or {}


def _bytes_under(folder: Path) -> int:
    """The bytes of the files under `folder` (a layout skopeo is writing: its blobs, and the one it streams)."""
    total = 0
    for top, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.lstat(os.path.join(top, name)).st_size
            except FileNotFoundError:  # renamed into place meanwhile
                pass
    return total


def _mb(n: int | None) -> str:
    return "?" if n is None else f"{n / 1e6:.1f}" if n < 10e6 else f"{n / 1e6:.0f}"


def pull(settings: Settings, reference: str) -> Image:
    return ImageCache(settings).get(reference)
