"""The built-in corpus: English documentation that ships inside every Python installation.

pydoc's help topics (the language reference, ~0.5 MB) and the docstrings of the standard
library (~1.7 MB), read with `ast` rather than by importing modules (importing runs code:
`antigravity` opens a browser).  No download, so the main job runs on a fresh machine; the text
depends on the Python version, which the resume fingerprint records.

`packages` adds the docstrings of installed packages the same way (e.g. torch 2.13's 1,700
modules, 5 MB): a second English corpus the size of a small book collection, for checking a
recipe on text other than the one it was tuned on.  Their versions join the fingerprint.
"""
from __future__ import annotations

import ast
import functools
import os
import sysconfig
from typing import Iterator

# Test suites, the IDLE app, tool demos and vendored code: code more than prose.
_SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3",
              "turtledemo", "ensurepip", "__pycache__", "tkinter", "pydoc_data"}


def _prose(text: str) -> list[str]:
    """Paragraphs of a docstring, without doctest lines (code, not English)."""
    paras, block = [], []
    for line in text.split("\n"):
        s = line.strip()
        if not s or s.startswith((">>>", "...")):
            if block:
                paras.append(" ".join(block))
                block = []
            continue
        block.append(s)
    if block:
        paras.append(" ".join(block))
    return paras


def _stdlib_files() -> list[str]:
    return _python_files(sysconfig.get_paths()["stdlib"])


def package_dir(name: str) -> str:
    """The directory of installed top-level package `name`, found without importing it."""
    import importlib.util

    from data_prep.errors import PrepError

    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec else []
    if not locations:
        raise PrepError(f"corpus.packages: {name!r} is not an installed package (a directory "
                        f"of modules) in this Python; install it or drop it from the list")
    return locations[0]


def package_version(name: str) -> str:
    """The installed distribution's version for the resume fingerprint ('' if unknown)."""
    import importlib.metadata

    for dist in importlib.metadata.packages_distributions().get(name, [name]):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return ""


def _python_files(root: str) -> list[str]:
    files = []
    for dirpath, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS and not d.startswith("."))
        files.extend(os.path.join(dirpath, n) for n in sorted(names) if n.endswith(".py"))
    return files


def builtin_documents(include_topics: bool = True, include_docstrings: bool = True,
                      packages: tuple = ()) -> Iterator[list[str]]:
    """Documents as lists of paragraphs: one per pydoc topic, one per stdlib module, one per
    module of each of `packages`.  The corpus is small and fixed (a few MB), so it is parsed
    once per process and kept: bert-prep reads it twice (tokenizer training, then
    tokenization)."""
    return iter(_documents(include_topics, include_docstrings, tuple(packages)))


@functools.lru_cache(maxsize=2)
def _documents(include_topics: bool, include_docstrings: bool, packages: tuple) -> tuple:
    return tuple(_parse(include_topics, include_docstrings, packages))


def _module_docstrings(path: str) -> list[str]:
    """The prose paragraphs of every docstring in one module ([] if it does not parse)."""
    try:
        with open(path, "rb") as f:
            tree = ast.parse(f.read())
    except (SyntaxError, ValueError, OSError):
        return []  # a file this Python cannot parse (e.g. a Python 2 leftover)
    doc: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            text = ast.get_docstring(node)
            if text:
                doc.extend(_prose(text))
    return doc


def _parse(include_topics: bool, include_docstrings: bool,
           packages: tuple = ()) -> Iterator[list[str]]:
    if include_topics:
        from pydoc_data.topics import topics
        for key in sorted(topics):
            doc = _prose(topics[key])
            if doc:
                yield doc
    files = _stdlib_files() if include_docstrings else []
    for name in packages:
        files.extend(_python_files(package_dir(name)))
    for path in files:
        doc = _module_docstrings(path)
        if doc:
            yield doc
