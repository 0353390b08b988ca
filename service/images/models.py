"""registry_credentials: a user's or a team's login to one container registry (issue 44), its password sealed."""

from datetime import datetime

from sqlalchemy import LargeBinary, String
from sqlalchemy.orm import Mapped, mapped_column

from service.db import Base, UTCDateTime, utcnow


class RegistryCredential(Base):
    """One login: `scope` "user" or "team", `owner` the user's or the team's name. A job's pull uses its owner's
    own login for the image's registry, else its owner's team's (service/images/service.py login_for)."""

    __tablename__ = "registry_credentials"

    scope: Mapped[str] = mapped_column(String(8), primary_key=True)  # user | team
    owner: Mapped[str] = mapped_column(String(64), primary_key=True)
    # the registry's host[:port], as a reference names it ("registry" is SQLAlchemy's word for its class registry)
    host: Mapped[str] = mapped_column("registry", String(255), primary_key=True)
    username: Mapped[str] = mapped_column(String(255))
    # nonce + AES-GCM ciphertext of the password (service/images/seal.py): never readable through the API
    sealed: Mapped[bytes] = mapped_column(LargeBinary)
    set_by: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
