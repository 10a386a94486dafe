"""The files, classes, functions and attributes the architecture guide names exist where it says."""

from __future__ import annotations

import ast
import fnmatch
import functools
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GUIDES = [ROOT / "docs" / "architecture.md", ROOT / "fiberserve" / "kernels" / "README.md"]
PYTHON = [*sorted((ROOT / "fiberserve").rglob("*.py")), *sorted((ROOT / "tests").rglob("*.py"))]
CPP = sorted((ROOT / "fiberserve" / "kernels" / "csrc").rglob("*.[ch]*"))
FILE_SUFFIXES = (".py", ".cpp", ".h", ".md", ".sh", ".toml")


def spans(guide: Path) -> list[str]:
    """The guide's code spans, with a call's arguments dropped (``Program.invoke(fiber, flight)``)."""
    return [re.sub(r"\(.*\)$", "", span) for span in re.findall(r"`([^`\n]+)`", guide.read_text())]


@functools.cache
def python_names() -> tuple[dict[str, set[str]], set[str]]:
    """Each class's members (methods, class attributes, ``self.x`` set in its methods, enum members and fields),
    and every other name the sources define or spell as a string."""
    members: dict[str, set[str]] = {}
    names: set[str] = set()
    for path in PYTHON:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                own = members.setdefault(node.name, set())
                for inner in ast.walk(node):
                    if isinstance(inner, ast.FunctionDef | ast.AsyncFunctionDef):
                        own.add(inner.name)
                    elif isinstance(inner, ast.Name) and isinstance(inner.ctx, ast.Store):
                        own.add(inner.id)
                    elif isinstance(inner, ast.Attribute) and isinstance(inner.ctx, ast.Store):
                        own.add(inner.attr)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names.add(node.value)
            elif isinstance(node, ast.ImportFrom):
                names.update(alias.asname or alias.name for alias in node.names)
    return members, names


@functools.cache
def cpp_names() -> set[str]:
    """The names the C++ sources define: functions, types, macros."""
    text = "\n".join(path.read_text() for path in CPP)
    defined = re.findall(r"\b(?:struct|class|enum(?:\s+class)?|using|#define)\s+(\w+)", text)
    registered = re.findall(r'm\.def\(\s*"(\w+)\(', text)
    return set(defined) | set(registered) | set(re.findall(r"\b(\w+)\s*\([^;{)]*\)\s*(?:const\s*)?\{", text))


def existing(span: str) -> Path | None:
    """A path relative to the repository, to ``fiberserve/``, ``fiberserve/kernels/`` or its ``csrc/``, or a file
    name in the repository's top folder or somewhere under ``fiberserve/`` or ``tests/``."""
    bases = [ROOT, ROOT / "fiberserve", ROOT / "fiberserve" / "kernels", ROOT / "fiberserve" / "kernels" / "csrc"]
    if "/" in span:
        return next((base / span for base in bases if (base / span).exists()), None)
    if (ROOT / span).exists():
        return ROOT / span
    return next((path for folder in ("fiberserve", "tests") for path in (ROOT / folder).rglob(span)), None)


def functions_in(path: Path) -> set[str]:
    return {node.name for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.FunctionDef)}


@pytest.mark.parametrize("guide", GUIDES, ids=lambda path: path.name)
def test_what_a_guide_names_exists(guide):
    members, names = python_names()
    native = cpp_names()
    missing = []
    for span in spans(guide):
        if " " in span or "<" in span or span.startswith(("-", "{")):
            continue  # a phrase, a flag, a schema or a pattern, not a name
        if span.startswith("/"):  # a route
            if span not in names:
                missing.append(span)
        elif "::" in span:  # tests: a file and a test's name, or a pattern of names
            file, _, pattern = span.partition("::")
            path = existing(file)
            if path is None or not fnmatch.filter(functions_in(path), pattern):
                missing.append(span)
        elif span.endswith(FILE_SUFFIXES) or "/" in span:
            if not existing(span):
                missing.append(span)
        elif re.fullmatch(r"[A-Za-z_]\w*(\.\w+)+", span):
            owner, _, member = span.rpartition(".")
            owner = owner.rpartition(".")[2]
            found = member in members.get(owner, set()) or (owner in ("kernels", "torch") and member in names)
            if not found:
                missing.append(span)
        elif re.fullmatch(r"[A-Za-z_]\w*", span) and span not in names | native and not importlib.util.find_spec(span):
            missing.append(span)
    assert missing == [], missing
