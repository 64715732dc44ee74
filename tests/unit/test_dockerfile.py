"""One source of truth for the install: ``docker/Dockerfile`` installs through
``scripts/setup_env.sh gpu`` (the README's GPU install) and nothing else, and the versions that
the Dockerfile, the setup script, the README's profile table, ``setup.py``,
``constraints/cpu.txt`` and ``scripts/gpu_check.sh`` each state agree."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = (REPO / "docker" / "Dockerfile").read_text()
SETUP_ENV = (REPO / "scripts" / "setup_env.sh").read_text()
README = (REPO / "README.md").read_text()


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(instruction, arguments) of the Dockerfile, continuation lines joined, comments dropped."""
    lines = [line for line in DOCKERFILE.splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n\s*", " ", "\n".join(lines))
    return [tuple(line.split(None, 1)) for line in joined.splitlines() if line.strip()]


def setup_extras() -> dict[str, list[str]]:
    """``EXTRAS`` of setup.py, read without running it."""
    for node in ast.parse((REPO / "setup.py").read_text()).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "EXTRAS":
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py has no EXTRAS")


def readme_profile(profile: str) -> tuple[str, str]:
    """(Python version, 'what it pins' cell) of ``profile``'s row in the README table."""
    match = re.search(rf"^\| `{profile}` \| ([\d.]+) \| [^|]+ \| ([^|]+) \|$", README, re.M)
    assert match, f"README's install-profile table has no `{profile}` row"
    return match.group(1), match.group(2).strip()


def requirement_set(reqs: list[str]) -> set[str]:
    """Canonical ``name[extras]specifier`` of every requirement that has a version."""
    out = set()
    for text in reqs:
        req = Requirement(text)
        if req.specifier:
            extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
            out.add(f"{canonicalize_name(req.name)}{extras}{req.specifier}")
    return out


def locked() -> dict[str, str]:
    """Name -> version of constraints/cpu.txt."""
    lines = (REPO / "constraints" / "cpu.txt").read_text().splitlines()
    pairs = (line.split("==") for line in lines if "==" in line and not line.startswith("#"))
    return {canonicalize_name(name): version.strip() for name, version in pairs}


def test_dockerfile_installs_only_through_the_gpu_profile_of_setup_env():
    runs = [args for instr, args in dockerfile_instructions() if instr == "RUN"]
    assert [r for r in runs if "scripts/setup_env.sh gpu" in r], runs
    assert not [r for r in runs if re.search(r"pip\d?\s+install|uv\s+pip", r)], (
        "install packages in scripts/setup_env.sh, not in the Dockerfile"
    )
    assert "-e \"$extras\"" in SETUP_ENV and "extras='.[gpu,test]'" in SETUP_ENV


def test_readme_gpu_install_is_the_same_script():
    assert "`bash scripts/setup_env.sh gpu`" in README
    assert "pip install -e '.[gpu]'`" not in README


def test_base_image_is_pinned_nvidia_pytorch():
    (base,) = re.findall(r"^ARG BASE_IMAGE=(\S+)$", DOCKERFILE, re.M)
    assert re.fullmatch(r"nvcr\.io/nvidia/pytorch:\d\d\.\d\d-py3", base), base
    assert ("FROM", "${BASE_IMAGE}") in dockerfile_instructions()


def test_python_version_agrees_everywhere():
    (docker_python,) = re.findall(r"^ARG PYTHON_VERSION=([\d.]+)$", DOCKERFILE, re.M)
    (gpu_python,) = re.findall(r"^\s*gpu\) python_version=([\d.]+) ", SETUP_ENV, re.M)
    (cpu_python,) = re.findall(r"^\s*cpu\) python_version=([\d.]+) ", SETUP_ENV, re.M)
    check_python = re.findall(r"--python-version ([\d.]+)", (REPO / "scripts" / "gpu_check.sh").read_text())
    assert docker_python == gpu_python == readme_profile("gpu")[0] == check_python[0]
    assert cpu_python == readme_profile("cpu")[0]


def test_readme_profile_pins_are_setup_pys():
    extras = setup_extras()
    gpu = [p.replace(" ", "") for p in readme_profile("gpu")[1].split(", ")]
    assert requirement_set(gpu) == requirement_set(extras["gpu"])
    cpu_cell = readme_profile("cpu")[1].split(";")[0].replace(" (+cpu)", "")
    cpu = ["==".join(p.split(" ")) for p in cpu_cell.split(", ")]
    assert requirement_set(cpu) == requirement_set(extras["cpu"])
    lock = locked()
    for text in extras["cpu"]:
        req = Requirement(text)
        if req.specifier:  # the extra's pins are the lock's (torch's lock carries +cpu)
            assert lock[canonicalize_name(req.name)].split("+")[0] == str(req.specifier)[2:], text


def test_gpu_check_wheels_are_locked():
    script = (REPO / "scripts" / "gpu_check.sh").read_text()
    names = re.search(r"^WHEELS=\(([^)]*)\)", script, re.M | re.S).group(1).split()
    assert "megatron-core" in names
    lock = locked()
    assert [n for n in names if canonicalize_name(n) not in lock] == []
