"""The shape of the code, counted from its syntax tree: few long functions, few logprobs types.

A function over ``LONG`` lines in ``services/`` or ``kernels/*.py`` must be listed below with the
reason it stays one function; at most ``MAX_LONG`` such functions (the flag tables, one
``add_argument`` call per flag, are not counted). ``python tests/test_code_shape.py`` prints the
counts.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LONG = 80  # lines, decorators excluded, docstring included
MAX_LONG = 5
MAX_LOGPROBS_TYPES = 3

# (path, qualified name) -> why it stays one function
FLAG_TABLES = {
    ("services/worker/server.py", "add_args"): "the worker's flags, one add_flag call each",
    ("services/router/server.py", "add_args"): "the router's flags, one add_flag call each",
}
ALLOWED_LONG = {
    ("kernels/triton_attention.py", "_paged_attention_kernel"):
        "a @triton.jit body: one GPU program, its loads, online softmax and stores in order; "
        "Triton inlines helpers anyway, and the body has never run on a GPU here to re-test it",
    ("kernels/triton_attention.py", "triton_paged_attention"):
        "the launcher: checks and the grid of the kernel above, argument for argument; split "
        "only together with the kernel, on a GPU that runs it",
    ("kernels/triton_int4.py", "triton_int4_linear"):
        "the int4 GEMM's Triton launcher and its layout checks, likewise unrun without a GPU",
}


def _functions(path: Path):
    """(qualified name, lines) of every function and method in ``path``."""
    tree = ast.parse(path.read_text(), str(path))

    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                yield name, child.end_lineno - child.lineno + 1
                yield from walk(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, prefix + child.name + ".")

    # NOTE: a method is named Class.method; FLAG_TABLES / ALLOWED_LONG use the same names
    yield from walk(tree, "")


def _sources():
    for path in sorted((ROOT / "services").rglob("*.py")):
        if "/pb/" not in path.as_posix():
            yield path
    yield from sorted((ROOT / "kernels").glob("*.py"))


def long_functions() -> dict[tuple[str, str], int]:
    """(path, qualified name) -> lines, for every function over LONG lines."""
    found = {}
    for path in _sources():
        rel = path.relative_to(ROOT).as_posix()
        for name, lines in _functions(path):
            if lines > LONG:
                found[(rel, name)] = lines
    return found


def logprobs_dataclasses() -> list[str]:
    """``path:Class`` of every dataclass in services/ whose name says it holds logprobs."""
    found = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and "logprob" in node.name.lower() and any(
                    "dataclass" in ast.unparse(d) for d in node.decorator_list):
                found.append(f"{path.relative_to(ROOT).as_posix()}:{node.name}")
    return found


def test_long_functions_are_few_and_each_has_a_reason():
    found = long_functions()
    unlisted = sorted(set(found) - set(FLAG_TABLES) - set(ALLOWED_LONG))
    assert not unlisted, (f"functions over {LONG} lines with no reason in tests/"
                          f"test_code_shape.py: {[(k, found[k]) for k in unlisted]}")
    assert len(ALLOWED_LONG) <= MAX_LONG


def test_every_listed_function_is_still_long():
    found = long_functions()
    stale = sorted((set(FLAG_TABLES) | set(ALLOWED_LONG)) - set(found))
    assert not stale, f"listed as long but now <= {LONG} lines (or gone): drop them: {stale}"


def test_logprobs_have_at_most_three_types():
    types = logprobs_dataclasses()
    assert len(types) <= MAX_LOGPROBS_TYPES, types


def test_no_two_logprobs_modules_in_one_tier():
    """The process tier (router, scheduler, worker) and the shared tier each name at most one
    module ``logprobs.py``."""
    services = ROOT / "services"
    process = [p for p in services.rglob("logprobs.py")
               if p.relative_to(services).parts[0] in ("router", "scheduler", "worker")]
    shared = list((services / "common").rglob("logprobs.py"))
    assert len(process) <= 1 and len(shared) <= 1, process + shared


if __name__ == "__main__":
    for (path, name), lines in sorted(long_functions().items(), key=lambda kv: -kv[1]):
        why = FLAG_TABLES.get((path, name)) or ALLOWED_LONG.get((path, name)) or "UNLISTED"
        print(f"{lines:4d}  {path}:{name}  ({why})")
    print("logprobs dataclasses:", logprobs_dataclasses())
