VENV ?= .venv
PY := $(VENV)/bin/python
# One stamp per set of extras: the demo's (what it imports), then dev's (the demo's plus the test tools).
DEMO_STAMP := $(VENV)/.towerflow-demo
DEV_STAMP := $(VENV)/.towerflow-dev

.PHONY: demo test test-packages setup clean

setup: $(DEV_STAMP)

$(DEMO_STAMP): pyproject.toml tools/setup_venv.sh
	bash tools/setup_venv.sh $(VENV) demo
	touch $@

# dev's extras hold demo's, so a dev setup is a demo setup too.
$(DEV_STAMP): pyproject.toml tools/setup_venv.sh
	bash tools/setup_venv.sh $(VENV) dev
	touch $@ $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	$(PY) -m towerflow demo $(DEMO_ARGS)

# The Debian packages the tests run (Slurm, munge, Open MPI, etcd, Redis: tools/install_schedulers.sh),
# installed before the tests, never by them: at once when none is missing; as root with apt-get, the
# missing ones within the script's bound; elsewhere it says what is missing and the tests needing it skip.
test-packages:
	bash tools/install_schedulers.sh || echo "make: the tests that need the missing packages will skip"

# After the packages, the checks (seconds): the layer contract of pyproject.toml, then ruff; then every
# test, on TEST_WORKERS pytest-xdist workers (the tests of the namespace hosts and the real schedulers stay
# on one of them: tests/conftest.py). The suite's processes spend most of it starting torch, so
# two workers keep two cores busy; launches hold their ports until they end (cluster/ports.py), so
# the workers' clusters do not take each other's. TEST_WORKERS=0 runs everything in one process.
TEST_WORKERS ?= 2
test: $(DEV_STAMP) test-packages
	$(VENV)/bin/lint-imports --no-cache
	$(VENV)/bin/ruff check src tests benchmarks examples tools
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadgroup --durations=20

clean:
	rm -rf $(VENV) build src/*.egg-info
