# The two commands a newcomer needs: `make demo` and `make test`. Both set themselves up.
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test test-fast test-order mutation-check lock durations lint typecheck docs format bench clean

setup:
	@bash scripts/setup.sh

demo: setup
	$(VENV)/bin/bucketrl up

# The suite on two workers: most tests wait on sockets, subprocesses and long-polls, so two share the two cores well;
# tests marked `alone` get the machine to themselves (docs/testing.md). PYTEST_WORKERS=0 runs it in one process.
# Every run prints its 40 slowest tests and writes each test's time to build/test-times.json.
PYTEST_WORKERS ?= 2
PYTEST = $(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=40 --durations-min=1
FAST = not slow and not vllm and not browser and not containers
ORDER_SEED ?= $(shell date +%s)

test: setup
	$(PYTEST)

# The inner loop (under 5 minutes): every test not marked slow, vllm, browser or containers.
test-fast: setup
	$(PYTEST) -m "$(FAST)"

# The suite in a random order (ORDER_SEED=N repeats one): shared fixtures must not make tests depend on their order.
test-order: setup
	$(PYTEST) -p random_order --random-order-bucket=global --random-order-seed=$(ORDER_SEED)

# Each patch under tests/mutations/ breaks a behaviour; its test must then fail (scripts/mutation_check.py).
mutation-check: setup
	$(PY) scripts/mutation_check.py

# Re-resolve locks/dev.txt, the images' locks and the GPU wheels' versions from pyproject.toml (scripts/lock.py).
lock: setup
	$(PY) scripts/lock.py

# Each test module's seconds from the last run's build/test-times.json to tests/durations.json, which make test reads
# to hand the longest modules out first (tests/support/schedule.py). Refresh it after a full run.
durations: setup
	$(PY) scripts/test_durations.py

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check bucketrl tests bench scripts

# The type checker over bucketrl/ (settings: [tool.mypy] in pyproject.toml).
typecheck: setup
	$(VENV)/bin/mypy --config-file pyproject.toml

# The docs site, strictly: a broken link or anchor fails.
docs: setup
	$(VENV)/bin/mkdocs build --strict -d build/site

format: setup
	$(VENV)/bin/ruff format bucketrl tests bench scripts
	$(VENV)/bin/ruff check --fix .

bench: setup
	$(PY) bench/proxy_load.py

clean:
	rm -rf $(VENV) .venv-sky .pytest_cache build *.egg-info
