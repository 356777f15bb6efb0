# The two commands a new user runs (see README.md):
#   make demo   set up, then package the embedded example for every target, serve it, show numbers
#   make test   set up, then run ruff, mypy and the whole test suite (what CI runs)
#
# Set-up is an isolated virtualenv (no system site-packages) holding exactly the versions in
# requirements/lock.txt, installed without dependency resolution (--no-deps) and then checked
# with `uv pip check`: a package missing from the lock fails set-up, it is never fetched
# silently (uv pip check covers what installed packages require, requirements/check_extras.py
# what edgekit's own extras require). Mosquitto comes from Debian for the OTA tests.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
LOCK   := requirements/lock.txt
SUDO   := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
# The lock pins torch 2.13.0+cpu for CPython 3.11 on x86_64 Linux: on PyPI torch is a CUDA build.
# Where /opt/wheels (a folder of local wheels) exists it is searched for it; elsewhere pass
# TORCH_FIND_LINKS=https://download.pytorch.org/whl/cpu/torch (or any folder holding that wheel).
TORCH_FIND_LINKS ?= $(wildcard /opt/wheels)
UV_FLAGS := --python $(BIN)/python $(if $(TORCH_FIND_LINKS),--find-links $(TORCH_FIND_LINKS))

.PHONY: setup system-deps demo test test-fast lint bench lock clean deb

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: $(LOCK) pyproject.toml | $(BIN)/python
	@start=$$(date +%s); \
	$(BIN)/python -m pip install -q --disable-pip-version-check "$$(grep -E '^uv==' $(LOCK) | cut -d' ' -f1)" && \
	$(BIN)/uv pip install -q $(UV_FLAGS) --no-deps -r $(LOCK) && \
	$(BIN)/uv pip install -q $(UV_FLAGS) --no-deps -e . && \
	$(BIN)/uv pip check --python $(BIN)/python && \
	$(BIN)/python requirements/check_extras.py all dev && \
	echo "set-up: $(VENV) from $(LOCK) in $$(( $$(date +%s) - start )) s"
	touch $@

setup: $(VENV)/.installed

# mosquitto: the OTA tests' broker; lintian: tests/packaging/test_deb.py checks the .deb with it
system-deps:
	@missing=""; \
	command -v mosquitto >/dev/null || [ -x /usr/sbin/mosquitto ] || missing="$$missing mosquitto"; \
	command -v lintian >/dev/null || missing="$$missing lintian"; \
	if [ -n "$$missing" ]; then \
		$(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq $$missing; \
	fi

demo: setup
	$(BIN)/python examples/demo.py

lint: setup
	$(BIN)/python -m ruff check .
	$(BIN)/python -m mypy edgekit device_agents

# the hardware-in-the-loop scenarios on the virtual board (root, Linux: netns, pty, cgroup, tmpfs);
# its report (Markdown, JSON, plots) lands in HIL_REPORT
HIL_REPORT ?= .hil-report

test: setup system-deps lint
	$(BIN)/python -m pytest -q
	$(BIN)/python -m pytest -q -p no:cacheprovider hil/ --lg-env hil/boards/virtual.yaml --report $(HIL_REPORT)

# the edit loop: everything but the conversions marked slow
test-fast: setup system-deps
	$(BIN)/python -m pytest -q -m "not slow"

# the device agent's Debian package into dist/ (packaging/debian/README.md; DEB_ARCH=arm64 cross-builds)
deb: setup
	UV=$(BIN)/uv sh packaging/debian/build.sh dist

bench: setup
	$(BIN)/python -m bench

# Refresh the lock after changing pyproject.toml: one universal resolution for CPython 3.10-3.12
# (uv's --universal writes environment markers where versions differ by Python or platform).
lock: | $(BIN)/python
	$(BIN)/python -m pip install -q --disable-pip-version-check "$$(grep -E '^uv==' $(LOCK) | cut -d' ' -f1)"
	cp $(LOCK) $(LOCK).new  # uv keeps the pins it finds in its output file unless they must move
	$(BIN)/uv pip compile pyproject.toml --extra all --extra dev --universal --python-version 3.10 \
		$(if $(TORCH_FIND_LINKS),--find-links $(TORCH_FIND_LINKS)) --no-header --quiet -o $(LOCK).new
	( echo "# The exact versions the suite is tested with. Refresh: make lock (uv pip compile --universal, CPython 3.10-3.12)."; \
	  echo "# Tested: CPython 3.11 on x86_64 Linux. Install: make setup, or"; \
	  echo "#   pip install -c requirements/lock.txt -e '.[all,dev]'"; cat $(LOCK).new ) > $(LOCK)
	rm -f $(LOCK).new

clean:
	rm -rf $(VENV) .edgekit-demo .pytest_cache
