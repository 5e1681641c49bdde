# The course's entry points. Each target creates the environment (.venv) first if it is missing.
#   make lab                 open the course: JupyterLab on the notebooks
#   make test                every check: lint, exercises in sync, tests, notebooks (what CI runs)
#   make check LESSON=01     check your completed exercise for one lesson
#   make exercises           regenerate exercises/ from solutions/ (maintainers)

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
LESSON ?= 01

.PHONY: setup lab test lint check exercises clean

$(VENV)/.installed: requirements.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet -r requirements.txt
	touch $@

setup: $(VENV)/.installed

lab: setup
	$(BIN)/jupyter lab notebooks/

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: lint
	$(BIN)/python -m utils.make_exercises --check
	$(BIN)/python -m pytest tests/ notebooks/ --nbval

check: setup
	@# pytest's own report is silenced (-qq, --tb=no, -p no:terse summary); tests/todo_report.py prints one line per TODO
	@$(BIN)/python -m pytest tests/test_$(LESSON)_*.py --target exercises -qq --tb=no -rN -o addopts="" -p no:warnings \
		|| true

exercises: setup
	$(BIN)/python -m utils.make_exercises

clean:
	rm -rf runs checkpoints metrics .pytest_cache .ruff_cache
