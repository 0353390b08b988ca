"""Alembic migrations; `trainjobs db upgrade` runs them (service/migrate.py)."""
