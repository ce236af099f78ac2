"""`make book` installs what the chapters compare against (mlx-vlm, the `peer` extra), so no built page says a
tool is missing; the base package and the ROCm venv stay free of it (its mlx wheel would replace a ROCm build)."""

import re
from pathlib import Path

from packaging.requirements import Requirement

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parent.parent


def _requirements_extras():
    lines = [line.strip() for line in (REPO / "requirements.txt").read_text().splitlines()]
    installs = [line for line in lines if line and not line.startswith("#")]
    assert installs == [installs[0]] and installs[0].startswith("-e ."), installs
    return set(re.search(r"\[(.*)\]", installs[0]).group(1).split(","))


def test_requirements_install_the_peer_engines_with_the_book():
    assert {"cpu", "book", "test", "peer"} <= _requirements_extras()


def test_peer_stays_out_of_the_base_install():
    with open(REPO / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    peer_names = {Requirement(r).name for r in project["optional-dependencies"]["peer"]}
    assert "mlx-vlm" in peer_names
    assert not peer_names & {Requirement(r).name for r in project["dependencies"]}


def test_the_rocm_venv_installs_no_peer():
    makefile = (REPO / "Makefile").read_text()
    rocm_installs = re.findall(r"\$\(VPIP\) install -e '\.\[([^\]]*)\]'", makefile)
    assert rocm_installs, "the Makefile installs no extras"
    # every install line of the Makefile that names extras without `peer` is a ROCm branch; the one with `peer`
    # is guarded by the ROCm mark
    venv_rule = makefile.split("$(STAMP): requirements.txt pyproject.toml", 1)[1].split("\n\n", 1)[0]
    assert "if [ -f $(ROCM_MARK) ]" in venv_rule and "-r requirements.txt" in venv_rule
    rocm_branch = venv_rule.split("else", 1)[0]
    assert "peer" not in rocm_branch and "requirements.txt" not in rocm_branch
    rocm_target = makefile.split("\nrocm-venv:", 1)[1]
    assert "peer" not in rocm_target.split("\n\n", 1)[0]
