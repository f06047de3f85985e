"""Print edgerev's runtime requirements from pyproject.toml, one per line, without torch.

Used by deploy/Dockerfile.jetson: NVIDIA's image ships its own PyTorch build, which pip must never replace, so
edgerev is installed with ``--no-deps`` and these requirements are installed beside it. The list is read from
pyproject.toml (core dependencies plus the ``runtime`` extra, ONNX Runtime for verifying exports) so that it
cannot drift from the package's own.

    python3 deploy/runtime_requirements.py [pyproject.toml] > requirements.txt
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import tomllib

EXTRAS = ("runtime",)
KEPT_FROM_THE_BASE_IMAGE = ("torch",)


def requirement_name(requirement: str) -> str:
    """The distribution name of a PEP 508 requirement string, normalized (PEP 503)."""
    name = re.split(r"[\s<>=!~;\[(@]", requirement.strip(), maxsplit=1)[0]
    return re.sub(r"[-_.]+", "-", name).lower()


def runtime_requirements(pyproject: Path) -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    requirements = list(project["dependencies"])
    for extra in EXTRAS:
        requirements += project.get("optional-dependencies", {}).get(extra, [])
    return [r for r in requirements if requirement_name(r) not in KEPT_FROM_THE_BASE_IMAGE]


def main(argv: list[str]) -> int:
    path = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parent.parent / "pyproject.toml"
    print("\n".join(runtime_requirements(path)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
