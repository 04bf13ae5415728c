"""docs/architecture.md's import rules, held against the code: every import of every module
(those inside functions too), resolved to the project's packages."""

import ast
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROJECT = ("bert_pretrain", "data_prep")


def modules():
    """{module name: source path} of the project's packages."""
    found = {}
    for top in PROJECT:
        for folder, _, files in os.walk(os.path.join(REPO, top)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    parts = os.path.relpath(path, REPO)[:-3].split(os.sep)
                    if parts[-1] == "__init__":
                        parts = parts[:-1]
                    found[".".join(parts)] = path
    return found


def imports(module: str, path: str) -> set:
    """Absolute names of everything `module` imports (relative imports resolved)."""
    package = module.split(".") if path.endswith("__init__.py") else module.split(".")[:-1]
    names = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            names.add(base)
            names |= {f"{base}.{alias.name}" for alias in node.names}  # `from . import x`
    return names


@pytest.fixture(scope="module")
def graph():
    mods = modules()
    return {m: {n for n in imports(m, p) if n.split(".")[0] in PROJECT and n in mods}
            for m, p in mods.items()}


def unit(module: str) -> str:
    """The room a module lives in: a package of bert_pretrain, or one top-level module."""
    parts = module.split(".")
    if parts[0] == "data_prep":
        return "data_prep"
    return ".".join(parts[:2])


def offenders(graph, source_prefix, forbidden) -> list:
    return sorted(f"{m} -> {n}" for m, targets in graph.items() if m.startswith(source_prefix)
                  for n in targets if any(n == f or n.startswith(f + ".") for f in forbidden))


def test_the_model_imports_only_torch_and_itself():
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    mods = modules()
    bad = []
    for m, path in mods.items():
        if not m.startswith("bert_pretrain.model"):
            continue
        for name in imports(m, path):
            top = name.split(".")[0]
            if top in stdlib or top == "torch" or name.startswith("bert_pretrain.model") \
                    or not name:
                continue
            bad.append(f"{m} -> {name}")
    assert not bad, bad


def test_components_import_no_tool_fine_tuning_or_trainer(graph):
    assert not offenders(graph, "bert_pretrain.components", [
        "bert_pretrain.tools", "bert_pretrain.finetune", "bert_pretrain.trainer",
        "bert_pretrain.train", "bert_pretrain.config"])


def test_tools_import_no_fine_tuning_or_trainer(graph):
    assert not offenders(graph, "bert_pretrain.tools", [
        "bert_pretrain.finetune", "bert_pretrain.trainer", "bert_pretrain.train",
        "bert_pretrain.config"])


def test_fine_tuning_imports_no_trainer(graph):
    assert not offenders(graph, "bert_pretrain.finetune", [
        "bert_pretrain.trainer", "bert_pretrain.train"])


def test_data_prep_uses_only_the_cli_helpers_progress_bars_lock_disk_test_and_tables(graph):
    used = {n for m, targets in graph.items() if m.startswith("data_prep")
            for n in targets if n.startswith("bert_pretrain")}
    assert used <= {"bert_pretrain.cli_errors", "bert_pretrain.components.progress",
                    "bert_pretrain.components.folder_lock",
                    "bert_pretrain.components.disk_space",
                    "bert_pretrain.components.table_files", "bert_pretrain.components"}, used


def test_cli_errors_knows_no_commands_schemas(graph):
    assert not graph["bert_pretrain.cli_errors"], graph["bert_pretrain.cli_errors"]


def test_no_two_rooms_import_each_other(graph):
    """Between the packages (and top-level modules), imports run one way: no circle."""
    edges = {}
    for m, targets in graph.items():
        for n in targets:
            a, b = unit(m), unit(n)
            if a != b:
                edges.setdefault(a, set()).add(b)
    seen, stack = set(), []

    def visit(node):
        if node in stack:
            raise AssertionError(" -> ".join(stack[stack.index(node):] + [node]))
        if node in seen:
            return
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            visit(nxt)
        stack.pop()
        seen.add(node)

    for node in sorted(edges):
        visit(node)
