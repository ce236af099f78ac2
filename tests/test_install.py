"""The install story holds: no mlx in the base package, the ROCm install leaves MLX alone, the docs say so."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parent.parent


def _project():
    with open(REPO / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]


def _mlx_names(requirements):
    """Distribution names among `requirements` that belong to MLX (mlx, mlx-cpu, mlx-lm, ...)."""
    names = (Requirement(r).name.lower().replace("_", "-") for r in requirements)
    return sorted(n for n in names if n == "mlx" or n.startswith("mlx-"))


def test_base_and_book_and_test_name_no_mlx_backend():
    project = _project()
    extras = project["optional-dependencies"]
    assert _mlx_names(project["dependencies"]) == []
    assert _mlx_names(extras["book"]) == []
    # mlx-lm is the parity reference; on Linux it requires no mlx wheel (only on macOS)
    test_extra = [r for r in _mlx_names(extras["test"]) if r != "mlx-lm"]
    assert test_extra == []
    for backend in ("cpu", "cuda", "metal"):
        assert "mlx" in _mlx_names(extras[backend]), backend


def test_mlx_lm_asks_for_mlx_only_on_macos():
    """`.[book,test]` pulls mlx-lm; it must not drag an mlx wheel onto a Linux ROCm machine."""
    from importlib import metadata

    try:
        requires = metadata.requires("mlx-lm") or []
    except metadata.PackageNotFoundError:
        pytest.skip("mlx-lm is not installed")
    for r in requires:
        req = Requirement(r)
        if req.name.lower() == "mlx" and req.marker is not None:
            linux = req.marker.evaluate({"platform_system": "Linux", "sys_platform": "linux", "extra": ""})
            assert not linux, f"mlx-lm requires {r!r} on Linux"
        elif req.name.lower() == "mlx":
            pytest.fail(f"mlx-lm requires {r!r} unconditionally")


@pytest.mark.slow
def test_rocm_install_dry_run_installs_no_mlx(tmp_path):
    try:
        import setuptools  # noqa: F401  (the build backend, used without isolation)
    except ImportError:
        pytest.skip("setuptools is not installed, so pip cannot build qmtp offline (--no-build-isolation)")
    report = tmp_path / "r.json"
    cmd = [
        sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--no-build-isolation",
        "--disable-pip-version-check", "--report", str(report), "-e", f"{REPO}[book,test]",
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"pip dry run failed:\n{run.stdout}\n{run.stderr}"
    installs = json.loads(report.read_text())["install"]
    names = [item["metadata"]["name"] for item in installs]
    assert not [n for n in names if n.lower().startswith("mlx")], names


def test_readme_and_ci_name_the_commands():
    readme = (REPO / "README.md").read_text()
    for command in ("make book", "make test", "make rocm-venv",
                    "python3 -m venv --system-site-packages .venv && .venv/bin/pip install -e '.[book,test]'"):
        assert command in readme, command
    ci = REPO / ".ci" / "run"
    assert "make test" in ci.read_text()
    assert ci.stat().st_mode & 0o111, ".ci/run is not executable"
