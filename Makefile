# The course's entry points. Each target creates the environment (.venv) first if it is missing.
#   make lab                 open the course: JupyterLab at the course's root, showing the README (its links open the notebooks)
#   make test                every check on the CPU: lint, exercises in sync, tests, notebooks (what CI runs)
#   make test-lab            the lab as a participant sees it, in headless Chromium (part of make test too)
#   make check LESSON=01     check your completed exercise for one lesson: one line per TODO
#   make hint LESSON=06 TODO=5   the next hint for one TODO (three levels: the idea, the steps, nearly the code)
#   make notebooks [LESSON=01]  instructors: run the notebooks (nbval), with each notebook's time
#   make grade DIR=submissions/  instructors: every participant's exercises checked, one table (and a CSV)
#   make mutants [LESSON=03] instructors: the plausible mistakes each TODO's tests must catch (tests/mutants/)
#   make test-gpu            instructors on a GPU node: every lesson with NCCL on the GPUs, against the CPU
#   make test-floor          every lesson at 2 ranks under the oldest supported torch (.venv-floor), against .venv
#   make exercises           regenerate exercises/ from solutions/ (maintainers)
#   make outputs LESSON=02   re-execute a notebook in place, quiet before each timing (maintainers)

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
LESSON ?= 01
# JupyterLab refuses to start as root (a container, a CI machine) unless told that it is on purpose.
LAB_FLAGS := $(if $(filter 0,$(shell id -u)),--allow-root,)

# PyTorch: the release the whole course is tested on (requirements.txt gives the supported range), in the
# build this machine can use. On Linux, PyPI's wheel is the CUDA build (gigabytes of GPU libraries): it is
# what a machine with an NVIDIA GPU gets; without one we install the CPU build (a local wheel or mirror
# first, then PyTorch's CPU index). macOS and Windows wheels are CPU builds already. Override with
# `make setup TORCH_BUILD=cpu` (or cuda).
TORCH_VERSION := 2.13.0
TORCH_FLOOR   := 2.11.0
CPU_INDEX     := https://download.pytorch.org/whl/cpu
TORCH_BUILD   ?= $(if $(filter Linux,$(shell uname -s)),$(if $(shell nvidia-smi -L 2>/dev/null),cuda,cpu),default)

# $(call install_torch,PIP,VERSION): the CPU build where TORCH_BUILD=cpu, else PyPI's default build.
define install_torch
	@echo "installing torch $(2), $(TORCH_BUILD) build"
	if [ "$(TORCH_BUILD)" = cpu ]; then \
	  $(1) install --quiet "torch==$(2)+cpu" 2>/dev/null \
	  || $(1) install --quiet "torch==$(2)+cpu" --extra-index-url $(CPU_INDEX) \
	  || $(1) install --quiet "torch==$(2)"; \
	else $(1) install --quiet "torch==$(2)"; fi
endef

.PHONY: setup lab test-lab test lint check hint grade notebooks outputs mutants test-gpu test-floor exercises clean

$(VENV)/.installed: requirements.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(call install_torch,$(BIN)/pip,$(TORCH_VERSION))
	$(BIN)/pip install --quiet -r requirements.txt
	$(BIN)/python -c "import torch; print('torch', torch.__version__, '(CUDA)' if torch.version.cuda else '(CPU)')"
	touch $@

setup: $(VENV)/.installed

# The lab serves the whole course, so that the README (the map of the course, rendered: utils/course/lab_settings)
# opens first and its links reach notebooks/, solutions/ and exercises/. The README is the lab's default page, so the
# address the lab prints (to copy into a browser elsewhere: a container, an ssh tunnel) opens it too, not only the
# browser the lab opens itself. slurm/jupyterlab.sh starts the lab the same way on a compute node.
LAB_SETTINGS := --LabApp.app_settings_dir=$(CURDIR)/utils/course/lab_settings --LabApp.default_url=/lab/tree/README.md
lab: setup
	$(BIN)/jupyter lab $(LAB_FLAGS) $(LAB_SETTINGS)

# The lab as a participant uses it, in a real browser (headless Chromium: tests/test_browser.py), and the command above
# (tests/test_lab.py); both are part of make test too. The screenshots and each notebook's time go to runs/browser/.
test-lab: setup
	CUDA_VISIBLE_DEVICES= $(BIN)/python -m pytest tests/test_lab.py tests/test_browser.py

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# CPU only, even on a GPU node: the notebooks' committed outputs were made on CPU with gloo, and the
# tests compare against them (CUDA_VISIBLE_DEVICES= hides the GPUs from every process started here).
# TEST_WORKERS pytest processes share the tests (pytest-xdist); a test file or a notebook stays on one of them
# (--dist loadscope), so its module fixtures and its kernel are its own, and the longest files start first
# (tests/harness/session_plugin.py). Two fill a 2-core machine: the launches spend much of their time waiting.
# TEST_WORKERS=0 runs everything in one stream, in file order.
TEST_WORKERS ?= 2
test: lint
	$(BIN)/python -m utils.course.make_exercises --check
	CUDA_VISIBLE_DEVICES= $(BIN)/python -m pytest tests/ notebooks/ --nbval --durations=30 \
		$(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder,)

# Instructors: run the notebooks only (all, or LESSON=NN), each as a learner would, against its committed outputs.
notebooks: setup
	CUDA_VISIBLE_DEVICES= $(BIN)/python -m pytest --nbval \
		$(if $(filter command line,$(origin LESSON)),notebooks/$(LESSON)_*.ipynb,notebooks/)

# Maintainers: a notebook's committed outputs, made again (utils/course/refresh_notebook.py); then `make notebooks`.
ifneq ($(filter outputs,$(MAKECMDGOALS)),)
ifneq ($(origin LESSON),command line)
$(error name the notebook: make outputs LESSON=02)
endif
endif
outputs: setup
	$(BIN)/python -m utils.course.refresh_notebook notebooks/$(LESSON)_*.ipynb

# Instructors: DIR holds one folder per participant with their exercise files (utils/course/grade.py).
grade: setup
	@test -n "$(DIR)" || { echo "name the submissions folder: make grade DIR=submissions/"; exit 2; }
	@$(BIN)/python -m utils.course.grade $(DIR)

hint: setup
	@$(BIN)/python -m utils.course.hints $(LESSON) $(TODO)

check: setup
	@# pytest's own report is silenced; tests/harness/todo_report.py prints one line per TODO and a count. The tests that
	@# submit Slurm jobs are left out (on a login node they would queue on the real cluster): they check the
	@# sbatch files, not the TODOs, and `pytest -m slurm` runs them. Every launch forks warm ranks, the first one
	@# too (COURSE_FIRST_LAUNCH_WARM, tests/harness/launch.py): what is checked is the TODOs, which torchrun does not change,
	@# and `make test` runs each script under torchrun itself. Launches that need torchrun's agent still use it.
	@COURSE_FIRST_LAUNCH_WARM=1 CUDA_VISIBLE_DEVICES= $(BIN)/python -m pytest tests/test_$(LESSON)_*.py --target exercises -qq --tb=no -rN \
		-o addopts="" -p no:warnings -m "not slurm" || true

# Before a workshop, and for every new or changed TODO: each mistake in tests/mutants/ must fail its TODO's
# check (and no other), and TODOs 1..k done must show "k of N". Slow: it runs a lesson's tests per mutant.
mutants: setup
	CUDA_VISIBLE_DEVICES= $(BIN)/python -m tests.mutants $(if $(filter command line,$(origin LESSON)),--lesson $(LESSON),)
	CUDA_VISIBLE_DEVICES= $(BIN)/python -m tests.mutants --partial-credit $(if $(filter command line,$(origin LESSON)),--lesson $(LESSON),)

test-gpu: setup
	$(BIN)/python -m tests.harness.gpu_check

# The oldest torch the course supports, in its own environment: every lesson's script at 2 ranks on the CPU,
# losses compared with the same runs under .venv's torch.
.venv-floor/.installed:
	test -x .venv-floor/bin/python || $(PYTHON) -m venv .venv-floor
	$(call install_torch,.venv-floor/bin/pip,$(TORCH_FLOOR))
	.venv-floor/bin/pip install --quiet numpy datasets tqdm tensorboard psutil
	touch $@

test-floor: setup .venv-floor/.installed
	CUDA_VISIBLE_DEVICES= .venv-floor/bin/python -m tests.harness.floor_check --reference $(BIN)/python

exercises: setup
	$(BIN)/python -m utils.course.make_exercises

clean:
	rm -rf runs checkpoints metrics .pytest_cache .ruff_cache
