from trainjobs.rank_output import install

install()  # before torch loads: a logging handler made at import time writes through the prefixed stream too

from worker.train.main import main  # noqa: E402 - after install()

main()
