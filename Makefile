# make demo: set up .venv, start the stack on SQLite + Redis, run the example DDP job end to end.
# make test: set up .venv, make sure Redis and PostgreSQL are up, run the tests.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# The CPU build that lies on disk on these machines; on a GPU machine pass a CUDA build, e.g.
# make TORCH="torch==2.13.0 --index-url <your CUDA wheel index>"
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed

.PHONY: demo test print-test-workers print-test-redis-password-file up services lint bench clean docs docs-build screenshots

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[worker,dev,docs,frameworks]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/trainjobs demo examples/ddp-mlp.json

# pytest-xdist workers for `make test` (tests/conftest.py gives each its own database and Redis db). The tests
# marked `alone` assert wall-clock bounds that hold on a quiet machine: they run afterwards, one at a time. The
# parallel pass lists its 25 slowest tests (where to look when the suite nears its 30 minutes).
TEST_WORKERS ?= 2
# The tests' Redis asks for a password, as the service's should (scripts/ensure-services.sh starts it on 6380 and
# keeps its password in this file); a TRAINJOBS_TEST_REDIS_URL the caller sets wins.
TEST_REDIS_PASSWORD_FILE ?= /var/lib/redis/trainjobs-test.password

test: $(STAMP) services
	export TRAINJOBS_TEST_REDIS_URL="$${TRAINJOBS_TEST_REDIS_URL:-redis://:$$(cat $(TEST_REDIS_PASSWORD_FILE))@127.0.0.1:6380/15}"; \
	$(PY) -m pytest -n $(TEST_WORKERS) -m "not alone" --durations=25; parallel=$$?; \
	$(PY) -m pytest -m alone; alone=$$?; \
	[ $$parallel = 0 ] && [ $$alone = 0 ]

# The dashboard's pictures in the docs (docs/images/), taken by the browser test that drives it, so they show what
# the code draws today: a live stack, headless Chromium, the jobs list, a job's page, the queue and the workers.
screenshots: $(STAMP) services
	export TRAINJOBS_TEST_REDIS_URL="$${TRAINJOBS_TEST_REDIS_URL:-redis://:$$(cat $(TEST_REDIS_PASSWORD_FILE))@127.0.0.1:6380/15}"; \
	TRAINJOBS_SCREENSHOTS=docs/images $(PY) -m pytest -q tests/test_dashboard.py -k "running_job_live or queue_page"

print-test-workers:
	@echo $(TEST_WORKERS)

print-test-redis-password-file:
	@echo $(TEST_REDIS_PASSWORD_FILE)

services:
	TRAINJOBS_TEST_REDIS_PASSWORD_FILE=$(TEST_REDIS_PASSWORD_FILE) ./scripts/ensure-services.sh

up: $(STAMP)
	$(VENV)/bin/trainjobs up

lint: $(STAMP)
	$(VENV)/bin/ruff check trainjobs service worker tests bench

bench: $(STAMP) services
	$(PY) bench/throughput.py
	$(PY) bench/claim_latency.py
	$(PY) bench/strategies.py
	$(PY) bench/lost_worker.py
	$(PY) bench/polling.py
	$(PY) bench/auth.py
	$(PY) bench/scheduler_sim.py
	$(PY) bench/device_sim.py
	$(PY) bench/watch.py
	$(PY) bench/sandbox.py
	$(PY) bench/job_writes.py

# The documentation site (mkdocs.yml): `docs` serves it with live reload, `docs-build` builds it into site/ with
# --strict (a broken link or a missing page fails). The Reference is generated from the code at each build.
DOCS_ADDR ?= 127.0.0.1:8001

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve --dev-addr $(DOCS_ADDR)

docs-build: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) trainjobs-data
