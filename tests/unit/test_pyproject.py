"""Install metadata: what ComfyUI-Manager and the Comfy Registry read from ``[tool.comfy]``, and the
packages a ``pip install`` ships."""
import re
from pathlib import Path
from urllib.parse import urlparse

import pytest
from packaging.specifiers import SpecifierSet

tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def test_requires_comfyui_keeps_the_floor_and_admits_todays_comfyui(pyproject):
    admitted = SpecifierSet(pyproject["tool"]["comfy"]["requires-comfyui"])
    for version in ("0.3.64", "0.3.75", "0.33.0", "0.38.1", "1.0.0"):
        assert version in admitted, version
    assert "0.3.63" not in admitted


def test_icon_is_a_file_of_this_repository_within_the_registrys_limits(pyproject):
    url = pyproject["tool"]["comfy"]["Icon"]
    repository = urlparse(pyproject["project"]["urls"]["Repository"]).path.strip("/")
    match = re.fullmatch(rf"https://raw\.githubusercontent\.com/{re.escape(repository)}/main/(.+)", url)
    assert match, f"Icon must be a raw URL into {repository}: {url}"
    icon = REPO / match.group(1)
    assert icon.suffix in (".svg", ".png", ".jpg", ".gif") and icon.is_file(), icon
    width, height = (int(re.search(rf'{side}="(\d+)"', icon.read_text()).group(1)) for side in ("width", "height"))
    assert width <= 800 and height <= 400


def test_every_package_of_the_source_tree_is_installed(pyproject):
    """The package list is explicit (the repository root is the package): a subpackage left out of it
    is missing from every wheel, and its imports fail only after a pip install."""
    packages = {".".join(("sdopt", *init.parent.relative_to(REPO).parts)) for init in REPO.rglob("__init__.py")
                if not any(part.startswith(".") or part in ("tests", "build") for part in init.relative_to(REPO).parts)}
    assert packages == set(pyproject["tool"]["setuptools"]["packages"])


def test_requirements_txt_is_the_projects_dependency_list(pyproject):
    """ComfyUI-Manager and the Comfy Registry install requirements.txt, pip the [project] list."""
    lines = [line.strip() for line in (REPO / "requirements.txt").read_text().splitlines()]
    assert [line for line in lines if line and not line.startswith("#")] == pyproject["project"]["dependencies"]
