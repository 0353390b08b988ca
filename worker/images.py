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
NOTE: no registry credentials yet (issue 44: per user or team, stored by the service): skopeo is told to use
none, so the worker's own login is never lent to whichever job names a private image.
"""

import fcntl
import hashlib
import ipaddress
import json
import logging
import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from service.settings import Settings
from trainjobs.spec import IMAGES_LABEL
from worker.packages import evict_lru

log = logging.getLogger(__name__)
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
TOOLS = ("skopeo", "umoci")
LOOPBACK_NAMES = ("localhost",)


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
    workdir: str = ""
    pulled_s: float | None = None  # seconds this attempt spent pulling and unpacking; None: found in the cache
    lock_fd: int | None = None

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


def registry_of(reference: str) -> str:
    """The registry host[:port] of a reference, as Docker reads it (the first part, when it looks like a host)."""
    first, sep, _ = reference.partition("/")
    if sep and ("." in first or ":" in first or first == "localhost"):
        return first
    return "docker.io"


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

    def get(self, reference: str) -> Image:
        """The image, pulled and unpacked unless this machine has it; held shared until Image.release()."""
        if (why := why_not()) is not None:
            raise ImageUnavailable(f"this worker cannot run images: {why}")
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o755)
        digest = self.resolve(reference)
        name = digest.removeprefix("sha256:")
        final = self.root / name
        fd = os.open(self.root / f"{name}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        pulled_s = None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # in use from here on: eviction passes it by
            if not (final / "rootfs").is_dir():
                pulled_s = self._pull_once(reference, digest, final)
            (self.root / f"{name}.used").touch()
        except BaseException:
            os.close(fd)
            raise
        config = json.loads((final / "config.json").read_text())
        env = dict(item.split("=", 1) for item in (config.get("Env") or []) if "=" in item)
        self.evict(keep=name)
        return Image(reference, digest, final / "rootfs", env, config.get("WorkingDir") or "", pulled_s, fd)

    def _pull_once(self, reference: str, digest: str, final: Path) -> float | None:
        """Pull under <hex>.pull: another lane pulling the same image is waited for, and its copy used (None)."""
        fd = os.open(self.root / f"{final.name}.pull", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if (final / "rootfs").is_dir():
                return None
            started = time.monotonic()
            self._pull(reference, digest, final)
            return time.monotonic() - started
        finally:
            os.close(fd)

    def resolve(self, reference: str) -> str:
        """The manifest digest `reference` names now: its own, or the registry's answer for its tag."""
        _, digest = split_digest(reference)
        if digest is not None:
            return digest
        tls = ["--tls-verify=false"] if insecure(self.settings, reference) else []
        raw = self._run(["skopeo", "inspect", "--raw", "--no-creds", *tls, f"docker://{reference}"], reference,
                        text=False)
        return "sha256:" + hashlib.sha256(raw).hexdigest()

    def _pull(self, reference: str, digest: str, final: Path) -> None:
        """skopeo copy (by digest: what was resolved is what is unpacked), then umoci unpack, then in place."""
        name, _ = split_digest(reference)
        temp = self.root / f".pull-{final.name}-{os.getpid()}-{os.urandom(4).hex()}"
        try:
            temp.mkdir()
            tls = ["--src-tls-verify=false"] if insecure(self.settings, reference) else []
            self._run(["skopeo", "copy", "--quiet", "--src-no-creds", *tls, f"docker://{name}@{digest}",
                       f"oci:{temp / 'layout'}:image"], reference)
            entry = temp / "entry"
            entry.mkdir()
            self._run(["umoci", "raw", "unpack", "--rootless", "--image", f"{temp / 'layout'}:image",
                       str(entry / "rootfs")], reference)
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

    def _run(self, argv: list[str], reference: str, *, text: bool = True):
        try:
            done = subprocess.run(argv, capture_output=True, timeout=self.settings.image_pull_timeout_s,
                                  env={"PATH": os.environ.get("PATH", DEFAULT_PATH), "HOME": str(self.root)})
        except subprocess.TimeoutExpired:
            raise ImageUnavailable(f"image {reference}: {argv[0]} took more than image_pull_timeout_s="
                                   f"{self.settings.image_pull_timeout_s:g}s") from None
        if done.returncode != 0:
            words = done.stderr.decode(errors="replace").strip().splitlines()
            raise ImageUnavailable(f"image {reference}: {argv[0]} {argv[1]} failed: {(words or ['?'])[-1][:500]}")
        return done.stdout.decode() if text else done.stdout

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
            return True
        finally:
            os.close(fd)


def image_config(layout: Path) -> dict:
    """The image config's "config" (Env, WorkingDir, ...) of the one image in an OCI layout."""
    def blob(digest: str) -> dict:
        algo, _, hexdigest = digest.partition(":")
        return json.loads((layout / "blobs" / algo / hexdigest).read_text())

    manifest = blob(json.loads((layout / "index.json").read_text())["manifests"][0]["digest"])
    return blob(manifest["config"]["digest"]).get("config") or {}


def pull(settings: Settings, reference: str) -> Image:
    return ImageCache(settings).get(reference)
