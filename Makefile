# kvstage set-up and entry points. Every target creates or reuses the virtual environment in
# .venv at the repository root; nothing needs to be installed by hand.
#
#   make demo   install everything (once), then run the PD demo (examples/pd_demo.py)
#   make test   install everything (once), then run the whole test suite
#   make bench  the benchmark (also installs matplotlib for its plots), results into docs/bench
#   make venv   only the installation

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check
STAMP  := $(VENV)/.kvstage-installed
REQS   := requirements/torch.txt requirements/nixl.txt requirements/base.txt pyproject.toml
# Debian packages the Mooncake engine links against, and iproute2 for the multi-host tests.
APT_PACKAGES := libibverbs1 libnuma1 iproute2

PYTEST_ARGS ?=
DEMO_ARGS ?=
BENCH_ARGS ?=

.PHONY: venv test demo bench apt clean

venv: $(STAMP)

apt:
	@missing=""; for p in $(APT_PACKAGES); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "install ok installed" || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = "0" ]; then \
	    echo "installing Debian packages:$$missing"; \
	    (apt-get install -y -q $$missing || (apt-get update -q && apt-get install -y -q $$missing)) >/dev/null; \
	  else \
	    echo "missing Debian packages:$$missing (run as root, or install them: apt-get install$$missing)"; exit 1; \
	  fi; \
	fi

$(STAMP): $(REQS) | apt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q -r requirements/torch.txt
	$(PIP) install -q -r requirements/nixl.txt
	$(PIP) install -q --no-deps nixl==1.5.1
	$(PIP) install -q -r requirements/base.txt
	$(PIP) install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

test: apt $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

demo: apt $(STAMP)
	$(PY) examples/pd_demo.py $(DEMO_ARGS)

bench: apt $(STAMP)
	$(PIP) install -q -r requirements/bench.txt
	$(PY) examples/bench.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
