"""Sphinx extension: the built book reads offline and opens without console errors.

- refuses to build without the vendored MathJax and widget manager (`make vendor`), instead of writing pages
  that show raw TeX and no explorer;
- drops sphinx-thebe's scripts: jupyter-book always loads the extension, thebe is switched off here (nothing
  can run a kernel from a downloaded page), and under Sphinx 7.4 its inline config script is emitted twice,
  a SyntaxError ("THEBE_JS_URL has already been declared") on every page;
"""

from __future__ import annotations

from pathlib import Path

from sphinx.errors import ConfigError

VENDOR_DIR = "book/vendor/static"
VENDORED = ("mathjax/tex-mml-chtml.js", "html-manager/embed.js")


def _check_vendored(app):
    if VENDOR_DIR not in app.config.html_static_path:
        raise ConfigError(f"html_static_path lacks {VENDOR_DIR}: the pages would load MathJax from a CDN")
    missing = [name for name in VENDORED if not Path(app.confdir, VENDOR_DIR, name).is_file()]
    if missing:
        raise ConfigError(f"{VENDOR_DIR} lacks {', '.join(missing)}: run `make vendor` (npm ci in book/vendor)")


def _is_thebe(script) -> bool:
    return "sphinx-thebe" in str(script.filename or "") or "THEBE_JS_URL" in script.attributes.get("body", "")


def _drop_thebe(app, pagename, templatename, context, doctree):
    scripts = context.get("script_files")
    if scripts is not None:
        scripts[:] = [s for s in scripts if not _is_thebe(s)]
    styles = context.get("css_files")
    if styles is not None:
        styles[:] = [s for s in styles if "sphinx-thebe" not in str(s.filename)]


def setup(app):
    app.connect("builder-inited", _check_vendored)
    # after sphinx-thebe and myst-nb have added theirs (default priority 500)
    app.connect("html-page-context", _drop_thebe, priority=900)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
