# qmtp: `make book` builds the workbook into _build/html, `make test` runs the tests.
# Both create .venv on first use and reinstall only when requirements.txt or pyproject.toml change.
# The book is read offline: what its pages load (MathJax, the widget manager) is vendored by `make vendor`.

PYTHON ?= python3
VENV   := .venv
VPY    := $(VENV)/bin/python
VPIP   := $(VPY) -m pip
STAMP  := $(VENV)/.installed
# written by `make rocm-venv`: this venv uses the machine's own MLX build, so never install requirements.txt
# (its `cpu` extra, and the `peer` extra's mlx-vlm, would put an mlx wheel in front of that build)
ROCM_MARK := $(VENV)/.rocm

# the book root is the repository root (_config.yml and _toc.yml live here)
BOOK_BUILD := $(VENV)/bin/jupyter-book build --all -W -n --keep-going .

.PHONY: venv vendor book test test-deps openblas browser-test rocm-venv

venv: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	if [ -f $(ROCM_MARK) ]; then \
	  $(VPIP) install -e '.[book,test,serve]'; \
	else \
	  $(VPIP) install -r requirements.txt; \
	fi
	touch $@

# What the pages load, pinned in book/vendor/package-lock.json and served from _static (html_static_path
# in _config.yml), so a reader without network sees formulas and the explorer. npm ci reads only the npm
# registry; the copy is assembled beside the old one and swapped in, so a failed copy leaves no half tree.
VENDOR       := book/vendor
VENDOR_STAMP := $(VENDOR)/static/.installed

vendor: $(VENDOR_STAMP)

$(VENDOR_STAMP): $(VENDOR)/package.json $(VENDOR)/package-lock.json
	@tools/apt-need.sh npm npm "to vendor MathJax and the widget manager for the book"
	npm ci --prefix $(VENDOR) --ignore-scripts --no-audit --no-fund
	rm -rf $(VENDOR)/static.new && mkdir -p $(VENDOR)/static.new/html-manager
	cp -r $(VENDOR)/node_modules/mathjax/es5 $(VENDOR)/static.new/mathjax
	cd $(VENDOR)/node_modules/@jupyter-widgets/html-manager/dist && \
	  cp embed.js embed.js.LICENSE.txt *.woff *.woff2 *.ttf *.eot *.svg ../../../../static.new/html-manager/
	rm -rf $(VENDOR)/static && mv $(VENDOR)/static.new $(VENDOR)/static
	touch $@

# jupyter-cache keys a notebook's outputs on its code only, not on QMTP_MODEL: when the model the book
# runs against changes, drop the cached outputs so every chapter executes again.
MODEL_STAMP := _build/.qmtp_model

book: venv vendor openblas
	@mkdir -p _build; \
	if [ "$$(cat $(MODEL_STAMP) 2>/dev/null)" != "$${QMTP_MODEL:-}" ]; then \
	  echo "QMTP_MODEL changed: clearing _build/.jupyter_cache"; rm -rf _build/.jupyter_cache; \
	fi; \
	printf '%s' "$${QMTP_MODEL:-}" > $(MODEL_STAMP)
	$(BOOK_BUILD)

# pytest's exit status is passed through unchanged: 5 ("no tests collected") fails this target too.
# The notebooks are part of the tests: once any notebooks/*.py exists, the book (which executes every
# notebook and turns each warning into an error) is built as well, and then a headless browser reads every
# page of it offline (tests/test_browser.py; its first, pre-book run skips itself). Before that there is
# nothing to run.
# The suite runs on TEST_JOBS workers (pytest-xdist, one test file per worker so that a module's fixtures are built
# once), then the tests marked `alone` on their own: the full-size ones need nearly all of a 24 GB machine's memory,
# which a second worker would take (they would skip, saying so, rather than fail).
TEST_JOBS ?= $(shell n=$$(getconf _NPROCESSORS_ONLN 2>/dev/null || echo 2); [ $$n -gt 4 ] && n=4; echo $$n)

test: venv test-deps
	$(VPY) -m pytest -q -n $(TEST_JOBS) --dist loadfile -m "not alone"
	$(VPY) -m pytest -q -m alone
	@if ls notebooks/*.py >/dev/null 2>&1; then \
	  $(MAKE) --no-print-directory book && $(MAKE) --no-print-directory browser-test; \
	else \
	  echo "no notebooks/*.py yet: skipping the book build"; \
	fi

# The extras only the tests need: `browser` (Playwright, driving Debian's chromium: Playwright never
# downloads a browser here), `serve` (the web stack of `qmtp serve`) and `peer` (mlx-vlm, the peer engine;
# pip warns and goes on if the extra is not defined). A ROCm venv skips `peer`, whose mlx-vlm would pull an mlx wheel over the machine's build.
TEST_EXTRAS_STAMP := $(VENV)/.test-extras

test-deps: $(TEST_EXTRAS_STAMP) openblas
	@tools/apt-need.sh /usr/bin/chromium chromium "for the browser test (tests/test_browser.py)"

# MLX's Linux CPU wheel multiplies with netlib's reference BLAS; qmtp loads the machine's OpenBLAS for it
# (qmtp.blas), which the chapters' speed measurements assume. Optional: without it qmtp says so and goes on.
OPENBLAS := /usr/lib/$(shell uname -m)-linux-gnu/openblas-pthread/libblas.so.3
openblas:
	@if [ "$$(uname)" = Linux ] && [ ! -f $(ROCM_MARK) ]; then \
	  tools/apt-need.sh $(OPENBLAS) libopenblas0-pthread "for MLX's matrix products on the CPU (qmtp.blas)" \
	    || echo "going on with the MLX wheel's reference BLAS"; \
	fi

$(TEST_EXTRAS_STAMP): $(STAMP) pyproject.toml
	if [ -f $(ROCM_MARK) ]; then \
	  $(VPIP) install -e '.[browser,serve]'; \
	else \
	  $(VPIP) install -e '.[browser,peer,serve]'; \
	fi
	touch $@

# Reads the book already in _build/html (run `make book` first); screenshots go to _build/screenshots.
browser-test: test-deps
	QMTP_BOOK_HTML=_build/html QMTP_SCREENSHOTS=_build/screenshots $(VPY) -m pytest -q tests/test_browser.py

# A machine with an existing MLX build (ROCm): the venv sees the system site-packages, and the install
# names no backend extra. The base package does not depend on mlx, so pip never replaces that build.
rocm-venv:
	@if [ -f $(VENV)/pyvenv.cfg ] && ! grep -qi '^include-system-site-packages *= *true' $(VENV)/pyvenv.cfg; then \
	  echo "$(VENV) exists without --system-site-packages: remove it first (rm -rf $(VENV))"; exit 1; \
	fi
	test -x $(VPY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	touch $(ROCM_MARK)
	$(VPIP) install -e '.[book,test,serve]'
	touch $(STAMP)
