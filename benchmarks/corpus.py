"""The benchmarks' text: real English that needs no download (``serving.make_dataset``'s
windows, ``compare.workload``'s prompts)."""

from __future__ import annotations

from pathlib import Path


def corpus_text() -> str:
    """Real English text that needs no download: the module docstrings of Python's standard
    library, read from the source files (parsed, never imported)."""
    import ast
    import sysconfig

    docs = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        if doc and len(doc) > 200:
            docs.append(doc)
    return "\n\n".join(docs)
