# qmtp: `make book` builds the workbook into _build/html, `make test` runs the tests.
# Both create .venv on first use and reinstall only when requirements.txt or pyproject.toml change.

PYTHON ?= python3
VENV   := .venv
VPY    := $(VENV)/bin/python
VPIP   := $(VPY) -m pip
STAMP  := $(VENV)/.installed
# written by `make rocm-venv`: this venv uses the machine's own MLX build, so never install requirements.txt
# (its `cpu` extra would put an mlx wheel in front of that build)
ROCM_MARK := $(VENV)/.rocm

# the book root is the repository root (_config.yml and _toc.yml live here)
BOOK_BUILD := $(VENV)/bin/jupyter-book build --all -W -n --keep-going .

.PHONY: venv book test rocm-venv

venv: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	if [ -f $(ROCM_MARK) ]; then \
	  $(VPIP) install -e '.[book,test]'; \
	else \
	  $(VPIP) install -r requirements.txt; \
	fi
	touch $@

# jupyter-cache keys a notebook's outputs on its code only, not on QMTP_MODEL: when the model the book
# runs against changes, drop the cached outputs so every chapter executes again.
MODEL_STAMP := _build/.qmtp_model

book: venv
	@mkdir -p _build; \
	if [ "$$(cat $(MODEL_STAMP) 2>/dev/null)" != "$${QMTP_MODEL:-}" ]; then \
	  echo "QMTP_MODEL changed: clearing _build/.jupyter_cache"; rm -rf _build/.jupyter_cache; \
	fi; \
	printf '%s' "$${QMTP_MODEL:-}" > $(MODEL_STAMP)
	$(BOOK_BUILD)

# pytest's exit status is passed through unchanged: 5 ("no tests collected") fails this target too.
# The notebooks are part of the tests: once any notebooks/*.py exists, the book (which executes every
# notebook and turns each warning into an error) is built as well. Before that there is nothing to run.
test: venv
	$(VPY) -m pytest -q
	@if ls notebooks/*.py >/dev/null 2>&1; then \
	  $(MAKE) --no-print-directory book; \
	else \
	  echo "no notebooks/*.py yet: skipping the book build"; \
	fi

# A machine with an existing MLX build (ROCm): the venv sees the system site-packages, and the install
# names no backend extra. The base package does not depend on mlx, so pip never replaces that build.
rocm-venv:
	@if [ -f $(VENV)/pyvenv.cfg ] && ! grep -qi '^include-system-site-packages *= *true' $(VENV)/pyvenv.cfg; then \
	  echo "$(VENV) exists without --system-site-packages: remove it first (rm -rf $(VENV))"; exit 1; \
	fi
	test -x $(VPY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	touch $(ROCM_MARK)
	$(VPIP) install -e '.[book,test]'
	touch $(STAMP)
