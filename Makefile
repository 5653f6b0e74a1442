# Two entry points: `make serve` and `make test`. Both create .venv when missing and install
# torch first (a CPU build on these machines) so that the project's torch range is already met
# and nothing pulls a multi-GB CUDA build.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_VERSION ?= 2.13.0
CONFIG ?= configs/local.yaml

.PHONY: install serve test clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==$(TORCH_VERSION)
	$(PIP) install -q -e '.[test]'
	touch $@

install: $(VENV)/.installed

serve: install
	$(VENV)/bin/glm53-serve up --config $(CONFIG)

test: install
	$(PY) -m pytest -q -ra

clean:
	rm -rf $(VENV) build *.egg-info
