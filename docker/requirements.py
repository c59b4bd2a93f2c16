"""fedderm's runtime requirements, read from pyproject.toml, for the Docker images.

    python requirements.py pyproject.toml            # print a pip requirements file
    python requirements.py --check pyproject.toml    # exit 1 unless every one is installed

The images are built on Flower's official images, which already contain ``flwr``; the
``simulation`` extra (Ray) is only for Flower's simulation runtime and is left out.  Every other
requirement is exactly ``[project].dependencies``, and ``flwr``'s version range still applies: pip
(and ``--check``) verify that the image's flwr satisfies it.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import tomllib

SIMULATION_ONLY_EXTRAS = {"flwr": {"simulation"}}


def requirements(pyproject: str | Path) -> list[str]:
    """``[project].dependencies`` of ``pyproject``, minus the simulation-only extras."""
    deps = tomllib.loads(Path(pyproject).read_text())["project"]["dependencies"]
    out = []
    for dep in deps:
        m = re.match(r"^\s*([A-Za-z0-9_.-]+)\s*(\[[^\]]*\])?\s*(.*)$", dep)
        name, extras, rest = m.group(1), m.group(2), m.group(3)
        if extras:
            kept = [
                e.strip()
                for e in extras[1:-1].split(",")
                if e.strip() and e.strip() not in SIMULATION_ONLY_EXTRAS.get(name.lower(), set())
            ]
            extras = f"[{','.join(kept)}]" if kept else ""
        out.append(f"{name}{extras or ''}{rest}".strip())
    return out


def check(reqs: list[str]) -> list[str]:
    """The requirements not satisfied by what is installed (empty: all are)."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.requirements import Requirement

    missing = []
    for line in reqs:
        req = Requirement(line)
        try:
            have = version(req.name)
        except PackageNotFoundError:
            missing.append(f"{line}: not installed")
            continue
        if not req.specifier.contains(have, prereleases=True):
            missing.append(f"{line}: {have} installed")
    return missing


def main(argv: list[str]) -> int:
    verify = "--check" in argv
    paths = [a for a in argv if a != "--check"]
    reqs = requirements(paths[0] if paths else "pyproject.toml")
    if verify:
        missing = check(reqs)
        for m in missing:
            print(f"unsatisfied: {m}", file=sys.stderr)
        return 1 if missing else 0
    print("\n".join(reqs))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
