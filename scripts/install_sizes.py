"""What each way of installing kvreuse puts on disk, measured from this environment without installing anything.

A distribution's size is the sum of the files its RECORD lists that exist (importlib.metadata), so .pyc files
written later count where RECORD names them and not otherwise. An install's size is that of the closure of its
requirements: each requirement's distribution as installed here, then its own requirements whose markers hold on
this machine (with the extras asked for), recursively. Of kvreuse itself (an editable install) only the embedded
model its build puts into the package counts, in every row. A requirement that holds but is not installed here has
no size: it is listed under "not here" (and xgrammar's requirements are not followed, since `make run` installs it
with --no-deps; `pip install '.[structured]'` follows them, to triton).
torch is the CPU wheel this environment holds.

    .venv/bin/python scripts/install_sizes.py     (Python 3.11+: tomllib)
"""

from __future__ import annotations

import importlib.metadata as md
from pathlib import Path

import tomllib
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"
PROJECT = "kvreuse"
NO_DEPS = ("xgrammar", "apache-tvm-ffi")  # the Makefile's --no-deps wheels
EMBEDDED = PYPROJECT.parent / "kvreuse" / "embedded"  # the build puts the default model's GGUF here
MOVED = ("cluster", "redis", "events", "bench")  # required before the extras existed


def installed() -> dict[str, md.Distribution]:
    found: dict[str, md.Distribution] = {}
    for dist in md.distributions():
        found.setdefault(canonicalize_name(dist.metadata["Name"]), dist)
    return found


def size_of(dist: md.Distribution) -> int:
    total = 0
    for file in dist.files or ():
        path = Path(dist.locate_file(file))
        if path.is_file():
            total += path.stat().st_size
    return total


def holds(req: Requirement, extras: set[str]) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate({**default_environment(), "extra": extra}) for extra in extras or {""})


class Closure:
    """The distributions a set of requirements installs, followed through what is installed here."""

    def __init__(self, dists: dict[str, md.Distribution], project: dict):
        self.dists, self.project = dists, project
        self.names: set[str] = set()
        self.missing: set[str] = set()
        self.followed: set[tuple[str, frozenset]] = set()

    def add(self, text: str, follow: bool = True) -> Closure:
        req = Requirement(text)
        name = canonicalize_name(req.name)
        if name == PROJECT:  # a self-referencing extra: its requirements, not the package
            for extra in req.extras:
                for item in self.project["optional-dependencies"][extra]:
                    self.add(item)
            return self
        dist = self.dists.get(name)
        if dist is None:
            self.missing.add(name)
            return self
        self.names.add(name)
        key = (name, frozenset(req.extras))
        if follow and key not in self.followed:
            self.followed.add(key)
            for item in dist.requires or ():
                if holds(Requirement(item), set(req.extras)):
                    self.add(item)
        return self


def base(dists: dict, project: dict) -> Closure:
    closure = Closure(dists, project)
    for item in project["dependencies"]:
        closure.add(item)
    return closure


def installs(dists: dict, project: dict) -> dict[str, Closure]:
    plain = base(dists, project)
    before = base(dists, project).add(f"{PROJECT}[{','.join(MOVED)}]")
    run = base(dists, project)
    for name in NO_DEPS:
        run.add(name, follow=False)
    test = base(dists, project).add(f"{PROJECT}[test,gemma3]")
    for name in NO_DEPS:
        test.add(name, follow=False)
    structured = base(dists, project).add(f"{PROJECT}[structured]")
    return {"pip install . (before: ray, redis, pyzmq, matplotlib required)": before,
            "pip install . (now)": plain, "pip install '.[structured]'": structured, "make run": run,
            "make test": test}


def mb(size: int) -> str:
    return f"{size / 1e6:,.0f}"


def main() -> None:
    dists = installed()
    sizes = {name: size_of(dist) for name, dist in dists.items()}
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    rows = installs(dists, project)
    model = sum(path.stat().st_size for path in EMBEDDED.glob("*.gguf"))
    print(f"kvreuse's embedded model: {mb(model)} MB, in every row")
    print("| install | distributions | MB on disk | not here (no size) |")
    print("|---|---:|---:|---|")
    for label, closure in rows.items():
        total = model + sum(sizes[n] for n in closure.names)
        print(f"| {label} | {len(closure.names)} | {mb(total)} | {', '.join(sorted(closure.missing)) or '-'} |")
    plain = rows["pip install . (now)"].names
    print("\n| extra | adds distributions | adds MB |")
    print("|---|---:|---:|")
    for extra in (*MOVED, "gemma3", "test"):
        added = base(dists, project).add(f"{PROJECT}[{extra}]").names - plain
        print(f"| {extra} | {len(added)} | {mb(sum(sizes[n] for n in added))} |")
    print("\nLargest in `make test` beyond `make run`:",
          ", ".join(f"{n} {mb(sizes[n])} MB" for n in sorted(rows["make test"].names - rows["make run"].names,
                                                              key=lambda n: -sizes[n])[:6]))


if __name__ == "__main__":
    main()
