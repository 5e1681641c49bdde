# The course's entry points. Each target creates the environment (.venv) first if it is missing.
#   make lab                 open the course: JupyterLab on the notebooks
#   make test                every check on the CPU: lint, exercises in sync, tests, notebooks (what CI runs)
#   make check LESSON=01     check your completed exercise for one lesson: one line per TODO
#   make test-gpu            instructors on a GPU node: every lesson with NCCL on the GPUs, against the CPU
#   make exercises           regenerate exercises/ from solutions/ (maintainers)

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
LESSON ?= 01
# JupyterLab refuses to start as root (a container, a CI machine) unless told that it is on purpose.
LAB_FLAGS := $(if $(filter 0,$(shell id -u)),--allow-root,)

.PHONY: setup lab test lint check test-gpu exercises clean

$(VENV)/.installed: requirements.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet -r requirements.txt
	touch $@

setup: $(VENV)/.installed

lab: setup
	$(BIN)/jupyter lab $(LAB_FLAGS) notebooks/

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# CPU only, even on a GPU node: the notebooks' committed outputs were made on CPU with gloo, and the
# tests compare against them (CUDA_VISIBLE_DEVICES= hides the GPUs from every process started here).
test: lint
	$(BIN)/python -m utils.make_exercises --check
	CUDA_VISIBLE_DEVICES= $(BIN)/python -m pytest tests/ notebooks/ --nbval

check: setup
	@# pytest's own report is silenced; tests/todo_report.py prints one line per TODO and a count
	@CUDA_VISIBLE_DEVICES= $(BIN)/python -m pytest tests/test_$(LESSON)_*.py --target exercises -qq --tb=no -rN \
		-o addopts="" -p no:warnings || true

test-gpu: setup
	$(BIN)/python -m tests.gpu_check

exercises: setup
	$(BIN)/python -m utils.make_exercises

clean:
	rm -rf runs checkpoints metrics .pytest_cache .ruff_cache
