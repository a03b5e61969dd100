VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.towerflow-installed

.PHONY: demo test setup clean

setup: $(STAMP)

$(STAMP): pyproject.toml tools/setup_venv.sh
	bash tools/setup_venv.sh $(VENV)
	touch $@

demo: $(STAMP)
	$(PY) -m towerflow demo $(DEMO_ARGS)

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider

clean:
	rm -rf $(VENV) build src/*.egg-info
