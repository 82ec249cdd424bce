"""meshlm's subpackages form layers: each imports only from layers below it, so none of them is held together by
function-local imports and any layer can be read, tested and replaced without the ones above it.

Bottom to top (a unit is a subpackage of meshlm or a top-level module):

    errors, lazy, files, faults   one-line input errors; lazy package attributes; files written whole or not
                     at all; fault injection points for the recovery tests (MESHLM_INJECT_FAULT)
    ties             tied weights of any nn.Module
    model            the single-device model, its shapes and FLOPs, the HF format of its weights
    parallel         the mesh and the strategies (LoRA and freezing, tp, cp, pp, dp/ZeRO), their options
                     (parallel/options.py, not the run config), step timers and process-group set-up
    checkpoint       a ParallelModel's state in DCP folders
    config           the run config; `model.init_from` reads an HF directory (model) or a checkpoint's record
    data             sources, tokenizer, token shards, the sampler
    observe          metrics, memory, MFU, rank aggregation, doctor
    plan             the memory / step-time / cost model and the layout search
    train            the loop and its pieces
    api, convert, launch, testing   library entry points, `meshlm convert`, `meshlm launch` around torchrun's
                     agent, the spawned-rank helper
    check            `meshlm check`: a run's shrunken CPU replica (it reads runs and checkpoints as convert does
                     and trains as api does) run against one process
    cli              the `meshlm` command
    meshlm           the package's own __init__ (lazy names of everything)

Every import counts, whether at module level, inside a function or under TYPE_CHECKING.
"""

from __future__ import annotations

import ast
import io
import itertools
import tokenize
from pathlib import Path

import meshlm

PACKAGE = Path(meshlm.__file__).parent
LAYERS: list[tuple[str, ...]] = [
    ("errors", "lazy", "files", "faults"),
    ("ties",),
    ("model",),
    ("parallel",),
    ("checkpoint",),
    ("config",),
    ("data",),
    ("observe",),
    ("plan",),
    ("train",),
    ("api", "convert", "launch", "testing"),
    ("check",),
    ("cli",),
    ("meshlm",),
]
RANK = {unit: i for i, units in enumerate(LAYERS) for unit in units}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def unit(module: str) -> str:
    """'meshlm.parallel.engine' -> 'parallel', 'meshlm.config' -> 'config', 'meshlm' -> 'meshlm'."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def imported_modules(source: str, name: str, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, module) of every meshlm import in the source of module `name`, `from meshlm import x` as
    meshlm.x and relative imports resolved."""
    package = name if is_package else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if base == "meshlm" or node.module is None:  # `from meshlm import x`, `from . import x`: modules
                found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
            else:
                found.append((node.lineno, base))
    return [(line, module) for line, module in found if module == "meshlm" or module.startswith("meshlm.")]


def unit_edges() -> dict[tuple[str, str], list[str]]:
    """(importer unit, imported unit) -> 'file:line' of each import crossing units."""
    edges: dict[tuple[str, str], list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        importer = unit(module_name(path))
        for line, module in imported_modules(path.read_text(), module_name(path), path.name == "__init__.py"):
            if unit(module) != importer:
                edges.setdefault((importer, unit(module)), []).append(f"{path.relative_to(PACKAGE.parent)}:{line}")
    return edges


def find_cycle(edges: set[tuple[str, str]]) -> list[str] | None:
    """A cycle of the directed graph as [a, b, ..., a], or None."""
    succ: dict[str, list[str]] = {}
    for a, b in edges:
        succ.setdefault(a, []).append(b)
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return [*path[path.index(node) :], node]
        if node in done:
            return None
        for nxt in sorted(succ.get(node, [])):
            if (cycle := visit(nxt, [*path, node])) is not None:
                return cycle
        done.add(node)
        return None

    for start in sorted(succ):
        if (cycle := visit(start, [])) is not None:
            return cycle
    return None


def test_every_unit_has_a_layer() -> None:
    units = {unit(module_name(path)) for path in PACKAGE.rglob("*.py")}
    assert units - set(RANK) == set(), "add the new module or subpackage to LAYERS (and the docstring)"


def test_package_graph_is_acyclic() -> None:
    assert find_cycle(set(unit_edges())) is None


def upward_imports(edges: dict[tuple[str, str], list[str]]) -> list[str]:
    """'file:line: a imports b' for each import of a unit from the same or a higher layer."""
    return [
        f"{where}: {a} imports {b}" for (a, b), sites in sorted(edges.items()) for where in sites if RANK[a] <= RANK[b]
    ]


def test_each_layer_imports_only_layers_below() -> None:
    assert upward_imports(unit_edges()) == []


def test_upward_import_is_refused() -> None:
    """The layer check is sharp: the engine importing the run config (what it did before ParallelOptions), or
    two units of one layer importing each other, is reported; the reverse direction is not."""
    assert upward_imports({("parallel", "config"): ["meshlm/parallel/engine.py:25"]}) == [
        "meshlm/parallel/engine.py:25: parallel imports config"
    ]
    assert upward_imports({("errors", "lazy"): ["meshlm/errors.py:1"]}) != []
    assert upward_imports({("config", "parallel"): ["meshlm/config.py:18"]}) == []


def test_find_cycle_finds_one() -> None:
    """The cycle check is sharp: the cycle this layering removed (config → model → checkpoint → parallel →
    config) is found, and edges that only go down are not one."""
    removed = {("config", "model"), ("model", "checkpoint"), ("checkpoint", "parallel"), ("parallel", "config")}
    cycle = find_cycle(removed)
    assert cycle is not None and cycle[0] == cycle[-1] and set(cycle) == {"config", "model", "checkpoint", "parallel"}
    assert find_cycle({("config", "model"), ("parallel", "model"), ("config", "parallel")}) is None


def test_imports_are_parsed_function_local_and_relative() -> None:
    """A function-local, a TYPE_CHECKING and a relative import count like module-level ones."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from meshlm.train import trainer\n"
        "def f():\n    from meshlm.config import load_config\n    from . import llama\n    from .. import lora\n"
    )
    found = sorted(m for _, m in imported_modules(source, "meshlm.model.hf"))
    assert found == ["meshlm.config", "meshlm.lora", "meshlm.model.llama", "meshlm.train"]
    assert [m for _, m in imported_modules("from . import timers", "meshlm.parallel", is_package=True)] == [
        "meshlm.parallel.timers"
    ]


MAX_MODULE_LINES, MAX_FUNCTION_LINES = 600, 80  # readable in one sitting; split by meaning past these
NOT_CODE = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}


def code_lines(text: str) -> set[int]:
    """The line numbers that hold code: a docstring (of the module, a class or a function), a comment or a
    blank line is not code, so explaining costs nothing against the caps; any other string is, every line of
    it (a multi-line literal is data the code carries)."""
    tree = ast.parse(text)
    docstrings: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and ast.get_docstring(
            node, clean=False
        ):
            doc = node.body[0]
            docstrings.update(range(doc.lineno, doc.end_lineno + 1))
    lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type not in NOT_CODE:
            lines.update(range(token.start[0], token.end[0] + 1))
    return lines - docstrings


def oversized(root: Path) -> list[str]:
    """Modules over MAX_MODULE_LINES code lines and functions over MAX_FUNCTION_LINES (code_lines: docstrings,
    comments and blank lines aside)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        code = code_lines(text)
        if len(code) > MAX_MODULE_LINES:
            found.append(f"{path.relative_to(root.parent)}: {len(code)} code lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = len([n for n in code if node.lineno <= n <= node.end_lineno])
                if lines > MAX_FUNCTION_LINES:
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name}: {lines} code lines")
    return found


def test_no_module_or_function_is_oversized() -> None:
    assert oversized(PACKAGE) == []


def test_the_caps_count_code_lines(tmp_path: Path) -> None:
    """Docstrings, comments and blank lines are free; code and multi-line string literals count. Mutations:
    counting physical lines (as before) reports the documented function and module that fit; skipping every
    string token lets the function whose 81st line is a literal's pass."""

    def statements(n: int) -> str:  # n code lines, each followed by a blank line, one with a comment
        return "".join(f"    x{i} = {i}  # a comment\n\n" for i in range(n))

    doc = '    """' + "A docstring line.\n" * 50 + '    """\n'
    module_doc = '"""A module docstring\n' + "of many lines.\n" * 30 + '"""\n\n'
    big = tmp_path / "meshlm"
    big.mkdir()
    at_cap = f"def f():\n{doc}    # only a comment\n{statements(MAX_FUNCTION_LINES - 1)}"
    (big / "fits.py").write_text(module_doc + at_cap)
    (big / "over.py").write_text(f"def g():\n{doc}{statements(MAX_FUNCTION_LINES)}")
    (big / "literal.py").write_text(f'def h():\n{statements(MAX_FUNCTION_LINES - 2)}    text = """one\ntwo"""\n')
    module = "".join(f"x{i} = {i}\n" for i in range(MAX_MODULE_LINES - 1)) + '"""not a docstring: code"""\n'
    (big / "full.py").write_text(module_doc + "# a comment\n\n" + module)
    (big / "long.py").write_text(module_doc + module + "x = 0\n")
    assert oversized(big) == [
        f"meshlm/literal.py:1 h: {MAX_FUNCTION_LINES + 1} code lines",
        f"meshlm/long.py: {MAX_MODULE_LINES + 1} code lines",
        f"meshlm/over.py:1 g: {MAX_FUNCTION_LINES + 1} code lines",
    ]


PARALLEL = PACKAGE / "parallel"


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and (
        (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
        or (isinstance(node.test, ast.Attribute) and node.test.attr == "TYPE_CHECKING")
    )


def run_time_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement that can run: module-level and function-local ones, not those under
    `if TYPE_CHECKING:` (never executed; they only name types for the type checker)."""
    found: list[ast.Import | ast.ImportFrom] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        if _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        stack.extend(ast.iter_child_nodes(node))
    return found


def parallel_module_edges(root: Path = PARALLEL) -> dict[tuple[str, str], list[str]]:
    """(importer, imported) -> 'file:line' for each run-time import between two modules of meshlm/parallel
    (`root`): a module imports the module it names, or for `from package import name` the submodule `name`
    where there is one."""
    top = root.parent.parent
    modules = {module_name_under(path, top): path for path in sorted(root.rglob("*.py"))}
    edges: dict[tuple[str, str], list[str]] = {}
    for importer, path in modules.items():
        package = importer if path.name == "__init__.py" else importer.rpartition(".")[0]
        for node in run_time_imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for target in targets:
                if target in modules and target != importer:
                    edges.setdefault((importer, target), []).append(f"{path.relative_to(top)}:{node.lineno}")
    return edges


def module_name_under(path: Path, top: Path) -> str:
    parts = list(path.relative_to(top).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_import_circle_inside_the_parallel_layer() -> None:
    """No circle among the modules of meshlm/parallel/, function-local imports included: each strategy's folder,
    the contract below them and the engine above them can be read and loaded in one order. Imports under
    `if TYPE_CHECKING:` are left out: they never run, so they cannot make one module's loading wait on
    another's, and annotations may name a type from a module that imports this one (tp/moe.py annotates the
    TPState of tp/sharding.py, which builds its MoE layers). Main at 22133da failed this with plan.py ->
    (function-local) plans.py -> plan.py, one loop of 15 modules that all reached each other (engine.py too,
    counting TYPE_CHECKING imports): plan, plans, strategies, runtime, probe, the strategies' modules."""
    edges = parallel_module_edges()
    cycle = find_cycle(set(edges))
    where = [f"{a} -> {b}: {edges[a, b][0]}" for a, b in itertools.pairwise(cycle)] if cycle else []
    assert cycle is None, "\n".join(where)


def test_the_parallel_circle_check_is_sharp(tmp_path: Path) -> None:
    """A function-local import closing a loop is a circle; the same import under TYPE_CHECKING is not, and
    `from package import module` is an edge to the module."""
    root = tmp_path / "meshlm" / "parallel"
    (root / "tp").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "tp" / "__init__.py").write_text("")
    (root / "contract.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from meshlm.parallel.tp import rules\n"
    )
    (root / "tp" / "rules.py").write_text("from meshlm.parallel import contract\n")
    assert find_cycle(set(parallel_module_edges(root))) is None
    (root / "contract.py").write_text("def f():\n    from meshlm.parallel.tp import rules\n")
    cycle = find_cycle(set(parallel_module_edges(root)))
    assert cycle is not None and set(cycle) == {"meshlm.parallel.contract", "meshlm.parallel.tp.rules"}


TORCH_FREE = [
    "meshlm.parallel.contract",
    "meshlm.parallel.strategies",
    *(f"meshlm.parallel.{folder}.strategy" for folder in ("tp", "cp", "ep", "pp", "dp", "transforms")),
    "meshlm.parallel.tp.sizes",
]


def test_the_contract_and_every_strategy_class_import_without_torch() -> None:
    """The size rules run in `meshlm plan` and the run config's validation, which start without torch: the
    contract, the ordered list and each folder's strategy module import none (their mechanics are imported
    when a strategy checks a model or applies). Fails if, say, tp/strategy.py imports torch at its top."""
    import subprocess
    import sys

    code = f"import sys; import {', '.join(TORCH_FREE)}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False", f"importing {TORCH_FREE} imported torch"
