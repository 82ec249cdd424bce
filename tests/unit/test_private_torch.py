"""The private torch APIs meshlm relies on are the table in docs/architecture.md ("Private torch APIs"), and
only those: each row resolves in the installed torch, and a scan of meshlm/ finds exactly the table's names.

The scan reads every module's syntax tree (function-local imports included) and counts as private torch:
  * a name reached from `torch` with a segment that starts with one underscore (`torch._foreach_norm`,
    `dist.distributed_c10d._world.pg_map`, `from torch.utils._pytree import tree_map`,
    `hasattr(torch, "_grouped_mm")`), named by its whole dotted path;
  * an attribute, or a string constant, that is a private attribute of an nn.Module, a Tensor or an
    UntypedStorage (`module._parameters`, `p._version`, `vars(module)` keys such as "_modules"), named in the
    table as `torch.nn.Module._parameters` and compared by the attribute's name: the receiver's type is not
    known statically. meshlm's own private names must therefore not reuse those names (none does; a clash
    fails here, naming the file and line).

Mutations: a `torch._foreach_add_` call added to meshlm/parallel/dp/gradients.py fails the scan test ("not in the
table ... gradients.py"); a row deleted from the table fails it the other way; a misspelt row
(`torch._foreach_nrom`) fails the lookup test."""

from __future__ import annotations

import ast
import importlib
import re
from collections import defaultdict
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
SECTION = "## Private torch APIs"

# Classes whose private attributes meshlm may read off an object, with an instance to look them up on
# (nn.Module sets its tables in __init__, so the class alone does not have them).
OBJECTS = {
    "torch.nn.Module": lambda: nn.Linear(1, 1),
    "torch.Tensor": lambda: torch.zeros(1, requires_grad=True),
    "torch.UntypedStorage": lambda: torch.zeros(1).untyped_storage(),
}


def _private(segment: str) -> bool:
    return segment.startswith("_") and not (segment.startswith("__") and segment.endswith("__"))


def object_attributes() -> dict[str, str]:
    """Every private attribute of OBJECTS' instances -> the first class (in OBJECTS' order) that has it."""
    owners: dict[str, str] = {}
    for cls, make in OBJECTS.items():
        for attr in dir(make()):
            if _private(attr):
                owners.setdefault(attr, cls)
    return owners


def documented() -> list[str]:
    """The first cell (one `code` span) of every row of the doc's table."""
    text = DOC.read_text()
    assert SECTION in text, f"{DOC}: no section {SECTION!r}"
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([^`]+)` \|", section, flags=re.M)


def resolve(name: str) -> object:
    """The object a dotted name denotes in the installed torch: the longest importable module, then
    attributes; an OBJECTS class's private attribute is looked up on an instance."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for i, attr in enumerate(parts[cut:], start=cut):
            owner = ".".join(parts[:i])
            obj = getattr(OBJECTS[owner]() if owner in OBJECTS else obj, attr)
        return obj
    raise ImportError(name)


class _Scan(ast.NodeVisitor):
    def __init__(self, path: Path, owners: dict[str, str], found: dict[str, set[str]]) -> None:
        self.path, self.owners, self.found = path, owners, found
        self.aliases: dict[str, str] = {}  # local name -> dotted torch path

    def add(self, name: str, node: ast.AST) -> None:
        self.found[name].add(f"{self.path.relative_to(ROOT)}:{node.lineno}")

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name.split(".")[0] == "torch":
                self.aliases[alias.asname or "torch"] = alias.name if alias.asname else "torch"
                if any(_private(s) for s in alias.name.split(".")):
                    self.add(alias.name, node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if (node.module or "").split(".")[0] != "torch":
            return
        for alias in node.names:
            path = f"{node.module}.{alias.name}"
            self.aliases[alias.asname or alias.name] = path
            if any(_private(s) for s in path.split(".")):
                self.add(path, node)

    def _torch_path(self, node: ast.expr) -> str | None:
        chain = []
        while isinstance(node, ast.Attribute):
            chain.append(node.attr)
            node = node.value
        if isinstance(node, ast.Name) and node.id in self.aliases:
            return ".".join([self.aliases[node.id], *reversed(chain)])
        return None

    def visit_Attribute(self, node: ast.Attribute) -> None:
        path = self._torch_path(node)
        if path is not None:  # the whole chain, once (its inner links are not visited)
            if any(_private(s) for s in path.split(".")):
                self.add(path, node)
            return
        if node.attr in self.owners:
            self.add(f"{self.owners[node.attr]}.{node.attr}", node)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Name) and func.id in ("getattr", "hasattr") and len(node.args) >= 2:
            path, attr = self._torch_path(node.args[0]), node.args[1]
            if (
                path is not None
                and isinstance(attr, ast.Constant)
                and isinstance(attr.value, str)
                and _private(attr.value)
            ):
                self.add(f"{path}.{attr.value}", node)
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, str) and node.value in self.owners:
            self.add(f"{self.owners[node.value]}.{node.value}", node)


def scan() -> dict[str, set[str]]:
    """Private torch name -> the places in meshlm/ that use it."""
    owners, found = object_attributes(), defaultdict(set)
    for path in sorted((ROOT / "meshlm").rglob("*.py")):
        _Scan(path, owners, found).visit(ast.parse(path.read_text(), str(path)))
    return dict(found)


def _key(name: str) -> str:
    """What the scan can tell apart: an OBJECTS attribute by its name alone, anything else by its path."""
    owner, _, attr = name.rpartition(".")
    return f"<object>.{attr}" if owner in OBJECTS else name


def test_every_documented_private_api_exists_in_this_torch() -> None:
    names = documented()
    assert names, f"{DOC}: the table under {SECTION!r} is empty"
    missing = []
    for name in names:
        try:
            resolve(name)
        except (ImportError, AttributeError) as e:
            missing.append(f"{name} ({type(e).__name__}: {e})")
    assert not missing, f"torch {torch.__version__} lacks: {missing}"


def test_the_table_is_what_meshlm_uses() -> None:
    used = scan()
    table = {_key(name) for name in documented()}
    by_key: dict[str, set[str]] = defaultdict(set)
    for name, places in used.items():
        by_key[_key(name)] |= places
    undocumented = {key: sorted(places) for key, places in by_key.items() if key not in table}
    unused = sorted(table - set(by_key))
    assert not undocumented, f"private torch APIs used by meshlm/ but not in the table of {DOC}: {undocumented}"
    assert not unused, f"rows of the table in {DOC} that meshlm/ no longer uses: {unused}"
