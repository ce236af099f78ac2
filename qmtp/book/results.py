"""Measurements the chapters save, so that chapter 8 can set them beside the claims without measuring again.

Each chapter ends with `results.save("02_fixes", path, {...})`: plain JSON values, written atomically into
a folder of their own for every model (the folder's name carries a digest of the model's config and
safetensors headers, so the bundled model's figures and a real checkpoint's never mix). Chapter 8 reads
them back with `results.load`; a chapter that has not run yet for this model is a clear error naming it.

Where: `$QMTP_RESULTS` if set; else `_build/qmtp-results` in the book's folder (the nearest folder above
the working directory that holds `_toc.yml`: jupyter-book runs each chapter in its own folder, and
chapters run in the order of their file names); else `~/.cache/qmtp/results`.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from ..checkpoint import hash_headers, write_atomic
from ..errors import QmtpError

ENV = "QMTP_RESULTS"


class MissingResultsError(QmtpError):
    """A chapter's results were asked for before that chapter ran on this model."""


def root(start: Path | None = None) -> Path:
    """The folder that holds every model's results (see the module docstring)."""
    if os.environ.get(ENV):
        return Path(os.environ[ENV]).expanduser()
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / "_toc.yml").is_file():
            return folder / "_build" / "qmtp-results"
    return Path.home() / ".cache" / "qmtp" / "results"


def model_key(path) -> str:
    """`<folder name>-<12 hex digits>`: sha256 of config.json and every safetensors header of the model."""
    path = Path(path)
    digest = hashlib.sha256((path / "config.json").read_bytes())
    hash_headers(digest, path.glob("*.safetensors"))
    return f"{path.name}-{digest.hexdigest()[:12]}"


def folder(path, start: Path | None = None) -> Path:
    return root(start) / model_key(path)


def save(chapter: str, path, values: dict, start: Path | None = None) -> Path:
    """Write `values` (JSON-able) as `chapter`'s results for the model at `path`; returns the file.

    Written to a temporary name and renamed, so a reader never sees half a file.
    """
    target = folder(path, start) / f"{chapter}.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(target, (json.dumps({"chapter": chapter, "model": str(path), "values": values}, indent=1,
                                     default=_plain) + "\n").encode())
    return target


def load(chapter: str, path, start: Path | None = None) -> dict:
    """`chapter`'s saved results for the model at `path`."""
    target = folder(path, start) / f"{chapter}.json"
    if not target.is_file():
        raise MissingResultsError(f"{target}: no results of chapter {chapter} for this model; run that chapter "
                                  f"first (the book build runs the chapters in order)")
    return json.loads(target.read_text())["values"]


def _plain(value):
    """numpy scalars and arrays as JSON numbers and lists."""
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")
