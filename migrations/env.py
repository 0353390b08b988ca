from alembic import context

from service.db import make_engine
from service.models import Base

config = context.config
target_metadata = Base.metadata


def run_migrations() -> None:
    url = config.attributes.get("url") or config.get_main_option("sqlalchemy.url")
    engine = make_engine(url)
    with engine.connect() as connection:
        context.configure(
            connection=connection,
            target_metadata=target_metadata,
            render_as_batch=url.startswith("sqlite"),
            compare_type=True,
        )
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


run_migrations()
