"""Where a webhook may point (TRAINJOBS_WEBHOOK_ALLOW), so a webhook is not a way into the network (SSRF).

By default only globally routable addresses: loopback, link-local (169.254.169.254, the cloud metadata
service, among them), private networks, shared, multicast and reserved ranges are refused. The allow-list
adds hosts (`hooks.internal`, `*.corp.example`) and networks (`10.0.0.0/8`, `127.0.0.1`). A host name is
checked by what it resolves to, when the webhook is made and again before every POST, and the POST goes to
the address that was checked (not to a second lookup), so a name that rebinds to an inner address is refused.
"""

import ipaddress
import socket
from dataclasses import dataclass
from functools import lru_cache

import httpx

from service.errors import InvalidRequest

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class Refused(InvalidRequest):
    """A URL the policy refuses: a 422 naming `url` at creation, a failed try (never sent) at delivery."""

    def __init__(self, message: str):
        super().__init__(message, field="url")


@dataclass(frozen=True)
class Policy:
    hosts: frozenset[str]  # exact names, or suffixes written "*.example.com"
    networks: tuple[Network, ...]

    def names(self, host: str) -> bool:
        host = host.lower().rstrip(".")
        return any(host == h or (h.startswith("*.") and host.endswith(h[1:])) for h in self.hosts)

    def admits(self, address: Address) -> bool:
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped  # ::ffff:127.0.0.1 is loopback
        return any(address in n for n in self.networks) or address.is_global and not address.is_multicast


@lru_cache
def policy_of(allow: str) -> Policy:
    """TRAINJOBS_WEBHOOK_ALLOW's comma-separated entries: each a network (CIDR or one address) or a host."""
    hosts, networks = set(), []
    for entry in (e.strip() for e in allow.split(",")):
        if not entry:
            continue
        try:
            networks.append(ipaddress.ip_network(entry, strict=False))
        except ValueError:
            hosts.add(entry.lower().rstrip("."))
    return Policy(frozenset(hosts), tuple(networks))


def parse(url: str) -> httpx.URL:
    """An http(s) URL with a host, or a 422 naming url."""
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError, ValueError) as exc:
        raise Refused(f"url is not a URL: {exc}") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise Refused("url must be an http:// or https:// URL with a host")
    return parsed


def resolve(url: httpx.URL, policy: Policy) -> list[Address]:
    """The addresses of the URL's host, every one admitted by the policy (else Refused); [] for a host the
    allow-list names (its addresses are the operator's to vouch for: the POST then goes by name)."""
    host = url.host
    try:
        literal = ipaddress.ip_address(host)
    except ValueError:
        literal = None
    if literal is None and policy.names(host):
        return []
    if literal is not None:
        found = [literal]
    else:
        try:
            infos = socket.getaddrinfo(host, url.port or (443 if url.scheme == "https" else 80),
                                       type=socket.SOCK_STREAM)
        except (OSError, ValueError) as exc:  # ValueError: an IDNA error, a NUL in the name
            raise Refused(f"url's host {host!r} does not resolve ({exc})") from None
        found = list(dict.fromkeys(ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos))
    refused = [a for a in found if not policy.admits(a)]
    if refused:
        raise Refused(f"url's host {host!r} is {refused[0]}, which webhooks may not reach (loopback, link-local, "
                      "private and metadata addresses are refused unless TRAINJOBS_WEBHOOK_ALLOW names them)")
    return found


def check(url: str, allow: str) -> httpx.URL:
    """A URL the policy admits now (a webhook's, when it is made), or Refused (a 422 naming url)."""
    parsed = parse(url)
    resolve(parsed, policy_of(allow))
    return parsed
