"""`trainjobs up --registry`: an image registry on this machine, for jobs' own images (issue 44, "one machine stays
one command").

Debian's `docker-registry` (the CNCF distribution registry) serves the OCI distribution API on a loopback address,
storing under `<data dir>/registry`; the stack's workers pull from it without TLS (it is added to
TRAINJOBS_IMAGE_INSECURE_REGISTRIES, which takes loopback registries only). Loopback only, and with no login: a
registry anyone on the network could push to would let them replace a job's image.
"""

import shutil
import time
from pathlib import Path

import httpx

from service.settings import is_loopback

DEFAULT = "127.0.0.1:5000"
READY_S = 30.0


class RegistryUnavailable(Exception):
    """The local registry cannot be served here (its program missing, an address not on loopback)."""


def check(address: str) -> tuple[str, int]:
    """`host:port` of a loopback address, else RegistryUnavailable naming what is wrong."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise RegistryUnavailable(f"--registry {address!r}: give host:port (e.g. {DEFAULT})")
    if not is_loopback(host):
        raise RegistryUnavailable(f"--registry {address!r}: a local registry listens on loopback only (it has no "
                                  "login nor TLS: anyone who reaches it could replace a job's image)")
    if shutil.which("docker-registry") is None:
        raise RegistryUnavailable("--registry needs Debian's docker-registry (apt-get install docker-registry) and, "
                                  "to pull, skopeo and umoci")
    return host, int(port)


def config(data_dir: Path, address: str) -> Path:
    """The registry's config file in `<data dir>/registry` (its blobs beside it)."""
    home = data_dir / "registry"
    (home / "store").mkdir(parents=True, exist_ok=True)
    path = home / "config.yml"
    path.write_text(f"version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {home / 'store'}"
                    f"\n  delete:\n    enabled: true\nhttp:\n  addr: {address}\n")
    return path


def command(config_file: Path) -> list[str]:
    return ["docker-registry", "serve", str(config_file)]


def wait_ready(address: str, alive, timeout: float = READY_S) -> None:
    """Until the registry answers `/v2/` (`alive()` raises once its process died)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive()
        try:
            if httpx.get(f"http://{address}/v2/", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RegistryUnavailable(f"the registry at {address} did not answer in {timeout:.0f}s")


def insecure_with(current: str, address: str) -> str:
    """TRAINJOBS_IMAGE_INSECURE_REGISTRIES with the local registry among them."""
    names = [n for n in current.split(",") if n.strip()]
    return ",".join(names if address in names else [*names, address])


def push_hint(address: str) -> str:
    return (f"image registry {address} (no login, loopback only): push with `skopeo copy --dest-tls-verify=false "
            f"oci:DIR:TAG docker://{address}/NAME:TAG` (or docker-archive:FILE.tar), then submit \"image\": "
            f"\"{address}/NAME:TAG\"")

