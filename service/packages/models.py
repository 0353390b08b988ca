"""packages: a user's uploaded working directories, by owner and content digest (the file is stored once)."""

from datetime import datetime

from sqlalchemy import BigInteger, Integer, String
from sqlalchemy.orm import Mapped, mapped_column

from service.db import Base, UTCDateTime, utcnow


class Package(Base):
    __tablename__ = "packages"

    owner: Mapped[str] = mapped_column(String(64), primary_key=True)
    digest: Mapped[str] = mapped_column(String(71), primary_key=True)  # sha256:<64 hex>
    size: Mapped[int] = mapped_column(BigInteger)  # the .tar.gz
    files: Mapped[int] = mapped_column(Integer)
    unpacked_bytes: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
