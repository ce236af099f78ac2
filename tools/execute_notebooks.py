"""Execute the book's notebooks on several processes into the build's jupyter-cache, before `jupyter-book build`.

myst-nb (execution mode `cache`) executes each notebook the build finds missing from `_build/.jupyter_cache`,
one after another, and a chapter runs mostly on one core. This script fills that cache beforehand, N notebooks
at a time, doing for each one what myst-nb's cache client (`myst_nb.core.execute.cache`) would do in the
build: the same reading of the .ipynb (so the same cache key: jupyter-cache hashes the code cells and the
kernelspec), the same configuration (read from _config.yml through jupyter-book, with the notebook's own
`mystnb` metadata on top), the notebook's folder as working directory, and the environment this script runs
in, which is the build's (make runs both). The build then finds every notebook cached and executes none.

Left to the build: notebooks whose execution mode is not `cache` (the pages that read what the chapters
saved are `force`: they must run after the chapters, in every build) and those `execute.exclude_patterns`
excludes.

A notebook is cached only once it ran cleanly; a failure is reported with the notebook's name and error, and
its traceback is recorded in the cache's project as myst-nb records it. The workers only execute; this
process alone writes to the cache, one notebook at a time.

Usage: .venv/bin/python tools/execute_notebooks.py [--jobs N]    (run from anywhere; exit status 1 if any
notebook failed, 0 when everything is cached)
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import re
import signal
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from pathlib import Path, PurePosixPath

import nbformat
from jupyter_book.config import get_final_config
from jupyter_cache import get_cache
from jupyter_cache.base import CacheBundleIn
from jupyter_cache.cache.db import NbProjectRecord
from jupyter_cache.executors.utils import single_nb_execution
from myst_nb.core.config import NbParserConfig
from sphinx_external_toc.parsing import parse_toc_yaml

ROOT = Path(__file__).resolve().parents[1]  # the book root: _config.yml and _toc.yml


def book_config() -> NbParserConfig:
    """myst-nb's configuration as `jupyter-book build` gives it (its `nb_*` settings from _config.yml)."""
    sphinx_config, _ = get_final_config(
        user_yaml=ROOT / "_config.yml", sourcedir=ROOT,
        cli_config={"external_toc_path": "_toc.yml", "latex_individualpages": False})
    config = NbParserConfig(**{k[3:]: v for k, v in sphinx_config.items() if k.startswith("nb_")})
    # as myst_nb.sphinx_ext does: an empty cache path is the one beside the html output, _build/.jupyter_cache
    return config.copy(execution_cache_path=config.execution_cache_path or str(ROOT / "_build" / ".jupyter_cache"))


def notebooks() -> list[Path]:
    """The .ipynb files of _toc.yml, in its order (any other page, a MyST text notebook too, is the build's)."""
    found = [ROOT / f"{docname}.ipynb" for docname in parse_toc_yaml(ROOT / "_toc.yml")]
    return [path for path in found if path.is_file()]


def read(path: Path, config: NbParserConfig) -> tuple[nbformat.NotebookNode, NbParserConfig]:
    """The notebook as myst-nb reads it (kernel aliases applied), and the configuration its metadata gives it."""
    notebook = nbformat.reads(path.read_text(encoding="utf8"), as_version=4)
    kernel = notebook.metadata.get("kernelspec", {}).get("name")
    for pattern, alias in (config.kernel_rgx_aliases or {}).items():
        if kernel is not None and re.fullmatch(pattern, kernel):
            notebook.metadata["kernelspec"]["name"] = alias
            break
    overrides = dict(notebook.metadata.get(config.metadata_key, {}))
    overrides.pop("output_folder", None)
    return notebook, config.copy(**overrides)


def left_to_build(path: Path, config: NbParserConfig) -> str | None:
    """Why the build, not this script, runs (or skips) the notebook; None when this script runs it."""
    if config.execution_mode != "cache":
        return f"execution_mode {config.execution_mode}"
    if any(PurePosixPath(path.as_posix()).match(p) for p in config.execution_excludepatterns):
        return "excluded by execute.exclude_patterns"
    if config.execution_in_temp:
        return "run_in_temp is not done here"
    return None


def execute(path: Path, notebook: nbformat.NotebookNode, config: NbParserConfig) -> dict:
    """Run in a worker: execute `notebook` as myst-nb's cache client does, in its own folder."""
    print(f"  executing {path.name}", flush=True)
    result = single_nb_execution(notebook, cwd=str(path.parent), timeout=config.execution_timeout,
                                 allow_errors=config.execution_allow_errors, meta_override=True)
    if result.err is not None:  # the error itself may not pickle: its text does
        return {"notebook": None, "seconds": result.time, "error": f"{type(result.err).__name__}: {result.err}",
                "traceback": result.exc_string}
    return {"notebook": result.nb, "seconds": result.time, "error": None, "traceback": None}


@contextlib.contextmanager
def uninterrupted():
    """Hold off Ctrl-C and SIGTERM while a notebook is written into the cache (record and file together)."""
    signals = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)


def default_jobs() -> int:
    return max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", "-j", type=int, default=default_jobs(),
                        help="notebooks executed at once (default: the cores, at most 4)")
    jobs = max(1, parser.parse_args().jobs)

    config = book_config()
    cache = get_cache(config.execution_cache_path)
    todo = []
    for path in notebooks():
        notebook, nb_config = read(path, config)
        reason = left_to_build(path, nb_config)
        if reason:
            print(f"  {path.name}: left to the build ({reason})")
            continue
        try:
            record = cache.match_cache_notebook(notebook)
        except KeyError:
            todo.append((path, notebook, nb_config))
        else:
            print(f"  {path.name}: cached (ID={record.pk})")
    if not todo:
        print("execute_notebooks: every notebook is cached")
        return 0

    # staged as myst-nb stages a notebook it executes (an earlier traceback cleared)
    for path, _, _ in todo:
        NbProjectRecord.remove_tracebacks([cache.add_nb_to_project(str(path)).pk], cache.db)
    # longest first, by the last run recorded for the same file (toc order where none is): the last to start
    # are then the short ones, and the workers finish close together
    last_run = {r.uri: (r.data or {}).get("execution_seconds") or 0 for r in cache.list_cache_records()}
    todo.sort(key=lambda item: -last_run.get(str(item[0]), 0))

    print(f"execute_notebooks: {len(todo)} notebook(s) to execute, {min(jobs, len(todo))} at a time, into "
          f"{config.execution_cache_path}", flush=True)
    start = time.perf_counter()
    failed = run(todo, min(jobs, len(todo)), cache)
    print(f"execute_notebooks: {len(todo) - len(failed)} of {len(todo)} executed in "
          f"{time.perf_counter() - start:.0f} s", flush=True)
    if failed:
        print(f"execute_notebooks: FAILED: {', '.join(failed)} (not cached)", file=sys.stderr)
        return 1
    return 0


def run(todo: list, jobs: int, cache) -> list[str]:
    """Execute `todo` on `jobs` worker processes, caching each notebook as it succeeds; the names that failed.

    A notebook is handed to a worker only when one is free, so after Ctrl-C (which interrupts the running
    notebooks as well: they share the terminal's process group) none is left waiting to start."""
    failed: list[str] = []
    queue = iter(todo)
    # spawn: the workers start clean, holding no copy of this process's cache database connection
    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        running = {}

        def start_next():
            item = next(queue, None)
            if item is not None:
                running[pool.submit(execute, *item)] = item[0]

        for _ in range(jobs):
            start_next()
        done = 0
        while running:
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in finished:
                path = running.pop(future)
                done += 1
                if not store(cache, path, future, f"[{done}/{len(todo)}]"):
                    failed.append(path.name)
                start_next()
    return failed


def store(cache, path: Path, future, progress: str) -> bool:
    """Cache a notebook that ran cleanly; report one that did not and record its traceback. True if cached."""
    try:
        result = future.result()
    except Exception as exc:  # the worker itself failed (its kernel died, say), not a cell
        result = {"error": f"{type(exc).__name__}: {exc}", "traceback": f"{type(exc).__name__}: {exc}"}
    if result["error"] is not None:
        NbProjectRecord.set_traceback(str(path), result["traceback"], cache.db)
        print(f"{progress} {path.name}: FAILED, not cached\n{result['error']}", file=sys.stderr, flush=True)
        return False
    with uninterrupted():
        record = cache.cache_notebook_bundle(
            CacheBundleIn(result["notebook"], str(path), data={"execution_seconds": result["seconds"]}),
            check_validity=False, overwrite=True)
    print(f"{progress} {path.name}: executed in {result['seconds']:.1f} s, cached (ID={record.pk})", flush=True)
    return True


if __name__ == "__main__":
    sys.exit(main())
