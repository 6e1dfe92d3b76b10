# The two commands a fresh machine needs (see README.md):
#   make demo   set up everything, then train examples/train_digits.py on 2 processes, torch then TensorFlow
#   make test   set up everything, then run the test suite in two lanes (LANES=0: one after another)
.PHONY: setup demo test test-unit lint bench

#: pytest-xdist workers for make test: each test file whole in one lane (tests/conftest.py)
LANES ?= 2

setup:
	bash scripts/setup.sh

demo: setup
	.venv/bin/hvdp run -np 2 --framework torch examples/train_digits.py
	.venv/bin/hvdp run -np 2 --framework tensorflow examples/train_digits.py

test: setup
	.venv/bin/python -m pytest tests -n $(LANES) --dist loadfile

test-unit: setup
	.venv/bin/python -m pytest tests -m "unit and not slow" -n 2

lint: setup
	.venv/bin/ruff check hvdp tests examples
	.venv/bin/mypy hvdp

bench: setup
	.venv/bin/hvdp bench --quick
