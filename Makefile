# The two commands a new user runs (see README.md):
#   make demo   set up, then package the embedded example for every target, serve it, show numbers
#   make test   set up, then run ruff and the whole test suite (what CI runs)
#
# Set-up is a virtualenv in .venv that can see the system's site-packages (so an environment
# that already has the SDKs installs nothing twice) plus Mosquitto from Debian for the OTA tests.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
SUDO   := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: setup system-deps demo test lint bench clean

$(BIN)/python:
	$(PYTHON) -m venv --system-site-packages $(VENV)

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	# onnx2tf imports tf_keras, whose metadata requires the full `tensorflow` (~600 MB more,
	# beside tensorflow-cpu); it runs on tensorflow-cpu, so install it without dependencies.
	$(BIN)/python -m pip install -q --no-deps 'tf-keras==2.21.*'
	touch $@

setup: $(VENV)/.installed

system-deps:
	@if ! command -v mosquitto >/dev/null && [ ! -x /usr/sbin/mosquitto ]; then \
		$(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq mosquitto; \
	fi

demo: setup
	$(BIN)/python examples/demo.py

# python -m: with --system-site-packages, tools the system already has get no script in $(BIN)
lint: setup
	$(BIN)/python -m ruff check .
	$(BIN)/python -m mypy edgekit device_agents

test: setup system-deps lint
	$(BIN)/python -m pytest -q

bench: setup
	$(BIN)/python -m bench

clean:
	rm -rf $(VENV) .edgekit-demo .pytest_cache
