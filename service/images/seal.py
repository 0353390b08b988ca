"""The registry passwords at rest: AES-256-GCM under a key in the service's secrets dir, never in the database.

Why AES-GCM (the `cryptography` package's AESGCM): authenticated, so a sealed value copied onto another row, or
altered, does not open; each value is bound to its row (its owner, registry and username) as associated data.
A database dump alone yields no password. The key is made once, by whichever process needs it first (the API, or
a worker that holds the database's URL and shares the secrets dir), as the admin token is: 0600 in the 0700
secrets dir, which no job is shown.
"""

import base64
import os
import secrets
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from service.auth.tokens import write_secret
from service.errors import TrainjobsError
from service.settings import Settings

KEY_FILE = "registry-credentials.key"
NONCE_BYTES = 12


class SealBroken(TrainjobsError):
    """A stored login that does not open with this service's key (the key file replaced, or the row altered)."""

    status_code = 409


def key_path(settings: Settings) -> Path:
    return settings.resolved_secrets_dir / KEY_FILE


def _key(settings: Settings) -> bytes:
    """The key, made on first use. Written aside and linked into place, so two processes making it at once
    agree on one (the second's link fails and it reads the first's)."""
    path = key_path(settings)
    if not path.is_file():
        aside = path.with_name(f".{KEY_FILE}.{os.getpid()}.{secrets.token_hex(4)}")
        write_secret(aside, base64.b64encode(AESGCM.generate_key(bit_length=256)).decode())
        try:
            os.link(aside, path)
        except FileExistsError:
            pass
        finally:
            aside.unlink()
    return base64.b64decode(path.read_text().strip())


def seal(settings: Settings, plain: str, *, bound_to: str) -> bytes:
    nonce = os.urandom(NONCE_BYTES)
    return nonce + AESGCM(_key(settings)).encrypt(nonce, plain.encode(), bound_to.encode())


def unseal(settings: Settings, sealed: bytes, *, bound_to: str) -> str:
    try:
        plain = AESGCM(_key(settings)).decrypt(sealed[:NONCE_BYTES], sealed[NONCE_BYTES:], bound_to.encode())
    except (InvalidTag, ValueError):
        raise SealBroken(f"a stored registry login ({bound_to}) does not open with the key in {key_path(settings)}: "
                         "the key was replaced; set the login again") from None
    return plain.decode()
