"""The built-in corpus: English documentation that ships inside every Python installation.

pydoc's help topics (the language reference, ~0.5 MB) and the docstrings of the standard
library (~1.7 MB), read with `ast` rather than by importing modules (importing runs code:
`antigravity` opens a browser).  No download, so the main job runs on a fresh machine; the text
depends on the Python version, which the resume fingerprint records.
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
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for dirpath, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS and not d.startswith("."))
        files.extend(os.path.join(dirpath, n) for n in sorted(names) if n.endswith(".py"))
    return files


def builtin_documents(include_topics: bool = True,
                      include_docstrings: bool = True) -> Iterator[list[str]]:
    """Documents as lists of paragraphs: one per pydoc topic, one per stdlib module.  The
    corpus is small and fixed (~2 MB), so it is parsed once per process and kept: bert-prep
    reads it twice (tokenizer training, then tokenization)."""
    return iter(_documents(include_topics, include_docstrings))


@functools.lru_cache(maxsize=2)
def _documents(include_topics: bool, include_docstrings: bool) -> tuple:
    return tuple(_parse(include_topics, include_docstrings))


def _parse(include_topics: bool, include_docstrings: bool) -> Iterator[list[str]]:
    if include_topics:
        from pydoc_data.topics import topics
        for key in sorted(topics):
            doc = _prose(topics[key])
            if doc:
                yield doc
    if include_docstrings:
        for path in _stdlib_files():
            try:
                with open(path, "rb") as f:
                    tree = ast.parse(f.read())
            except (SyntaxError, ValueError, OSError):
                continue  # a file this Python cannot parse (e.g. a Python 2 leftover)
            doc: list[str] = []
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                     ast.AsyncFunctionDef)):
                    text = ast.get_docstring(node)
                    if text:
                        doc.extend(_prose(text))
            if doc:
                yield doc
