"""One meaning per name (issue #50): no name is defined at the top level of two modules of meshlm.

A name defined twice either means one thing twice (keep one definition, in the lowest layer both modules may
import, tests/unit/test_layers.py, and import it) or two things under one name (rename one to say what it is).
Importing a name is not defining it. Exempt: `main` (each command's entry point) and dunders (`__all__`,
`__getattr__`, `__version__`: each module's own by Python's rules).

Mutations: define `GiB = 2**30` again in meshlm/observe/calibration.py (as it was before this test) and
`test_no_name_is_defined_in_two_modules` fails naming GiB, meshlm.observe.bandwidth and meshlm.observe.calibration.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import meshlm

PACKAGE = Path(meshlm.__file__).parent


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def bound_names(target: ast.expr) -> list[str]:
    """The names an assignment target binds (`a, (b, c) = ...` binds a, b and c; `x.y = ...` binds none)."""
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, ast.Starred):
        return bound_names(target.value)
    if isinstance(target, ast.Tuple | ast.List):
        return [name for element in target.elts for name in bound_names(element)]
    return []


def defined_names(body: list[ast.stmt]) -> set[str]:
    """The names a module body defines: functions, classes, assignments and for/with targets, also inside a
    top-level if, for, while, try or with (module level still); imports excluded."""
    names: set[str] = set()
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(name for target in node.targets for name in bound_names(target))
        elif isinstance(node, ast.AnnAssign | ast.AugAssign):
            names.update(bound_names(node.target))
        elif isinstance(node, ast.If | ast.For | ast.While | ast.With):
            if isinstance(node, ast.For):
                names.update(bound_names(node.target))
            if isinstance(node, ast.With):
                names.update(
                    name for item in node.items if item.optional_vars for name in bound_names(item.optional_vars)
                )
            names |= defined_names(node.body) | defined_names(getattr(node, "orelse", []))
        elif isinstance(node, ast.Try):
            blocks = [node.body, node.orelse, node.finalbody, *(handler.body for handler in node.handlers)]
            names |= set().union(*(defined_names(block) for block in blocks))
    return names


def exempt(name: str) -> bool:
    return name == "main" or (name.startswith("__") and name.endswith("__"))


def definitions() -> dict[str, set[str]]:
    """name -> the modules of meshlm that define it at the top level."""
    where: dict[str, set[str]] = defaultdict(set)
    for path in sorted(PACKAGE.rglob("*.py")):
        for name in defined_names(ast.parse(path.read_text(), str(path)).body):
            if not exempt(name):
                where[name].add(module_name(path))
    return where


def test_no_name_is_defined_in_two_modules() -> None:
    twice = {name: mods for name, mods in definitions().items() if len(mods) > 1}
    assert not twice, (
        "defined at the top level of more than one module (rename one to say what it is, or keep one definition "
        "in the lower module and import it): "
        + "; ".join(f"{name} in {', '.join(sorted(mods))}" for name, mods in sorted(twice.items()))
    )


def test_the_scan_sees_every_kind_of_definition() -> None:
    """The walker itself: each kind of top-level binding is found, imports and function bodies are not."""
    source = (
        "import os\nfrom x import y\ndef f():\n    inner = 1\nclass C: pass\na, (b, *c) = 1, (2, 3)\nd: int = 1\n"
        "e += 1\nif os:\n    g = 1\nelse:\n    h = 1\ntry:\n    i = 1\nexcept ImportError:\n    j = None\n"
        "with open('x') as k:\n    m = 1\nfor n in ():\n    pass\nobj.attr = 1\n"
    )
    found = defined_names(ast.parse(source).body)
    assert found == {"f", "C", "a", "b", "c", "d", "e", "g", "h", "i", "j", "k", "m", "n"}
