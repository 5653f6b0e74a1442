# Two entry points: `make serve` and `make test`. Both create .venv when missing and install
# torch first (a CPU build on these machines) so that the project's torch range is already met
# and nothing pulls a multi-GB CUDA build.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_VERSION ?= 2.13.0
CONFIG ?= configs/local.yaml
# NIXL build (pyproject extras): cu12 here and on CUDA 12 hosts, cu13 on CUDA 13 ones (NIXL=cu13)
NIXL ?= cu12

.PHONY: install serve test clean

$(VENV)/.installed-$(NIXL): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==$(TORCH_VERSION)
	$(PIP) install -q -e '.[test,$(NIXL)]'
	touch $@

install: $(VENV)/.installed-$(NIXL)

serve: install
	$(VENV)/bin/glm53-serve up --config $(CONFIG)

test: install
	$(PY) -m pytest -q -ra

clean:
	rm -rf $(VENV) build *.egg-info
