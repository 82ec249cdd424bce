"""One door into ParallelModel (issue #50): the library's `meshlm.parallelize` and meshlm's trainer build it through
the same function, and its constructor takes the model, the mesh, the options, the plan, the loss and the
adaptation (every option of the engine declared in meshlm.parallel.options, none a parameter of its own).

Mutations: a second `ParallelModel(...)` anywhere in meshlm/ (the trainer's own, as before) fails the first test;
an option back as a constructor parameter (`n_micro`, `fused_loss`...) fails the second."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import meshlm
from meshlm.parallel import engine
from meshlm.train import startup

PACKAGE = Path(meshlm.__file__).parent


def calls_of(name: str) -> list[tuple[str, str]]:
    """(file, enclosing function) of every call of `name` (a bare name or an attribute) in meshlm/."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for function in [node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)]:
            for node in ast.walk(function):
                if isinstance(node, ast.Call):
                    func = node.func
                    called = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
                    if called == name:
                        found.append((str(path.relative_to(PACKAGE)), function.name))
        top_level = [n for n in tree.body if not isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)]
        for statement in top_level:
            for node in ast.walk(statement):
                if isinstance(node, ast.Call) and getattr(node.func, "id", None) == name:
                    found.append((str(path.relative_to(PACKAGE)), "<module>"))
    return found


def test_parallel_model_is_built_in_one_place() -> None:
    assert calls_of("ParallelModel") == [("parallel/engine.py", "parallelize")]
    assert meshlm.parallelize is engine.parallelize  # the library's door
    assert startup.parallelize is engine.parallelize  # the trainer's (build_parallel_model calls it)
    assert ("train/startup.py", "build_parallel_model") in calls_of("parallelize")


def test_the_constructor_takes_the_model_mesh_options_plan_loss_and_adaptation() -> None:
    params = list(inspect.signature(engine.ParallelModel.__init__).parameters)
    assert params == ["self", "model", "mesh", "options", "plan", "loss", "adaptation"]
    assert len(params) - 1 <= 7  # issue #50's bound (it counted 13, without self)
