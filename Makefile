# The two commands a newcomer needs: `make demo` and `make test`. Both set themselves up.
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test test-fast lint typecheck docs format bench clean

setup:
	@bash scripts/setup.sh

demo: setup
	$(VENV)/bin/bucketrl up

test: setup
	$(PY) -m pytest -q

test-fast: setup
	$(PY) -m pytest -q -m "not slow and not vllm and not browser"

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check bucketrl tests bench

# The type checker over bucketrl/ (settings: [tool.mypy] in pyproject.toml).
typecheck: setup
	$(VENV)/bin/mypy --config-file pyproject.toml

# The docs site, strictly: a broken link or anchor fails.
docs: setup
	$(VENV)/bin/mkdocs build --strict -d build/site

format: setup
	$(VENV)/bin/ruff format bucketrl tests bench
	$(VENV)/bin/ruff check --fix .

bench: setup
	$(PY) bench/proxy_load.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
