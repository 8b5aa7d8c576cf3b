"""Source lines of the three folders at git revisions: raw, code, docstring, comment and blank, and the floor.

Counts ``wc -l`` lines of ``cache/``, ``kernels/`` and ``precompile/`` (Python only). "code" leaves out
docstrings, comments and blank lines; "statements" counts logical lines of code. The floor is what the same
statements would take with every docstring on one line and only the blank lines PEP 8 asks for (two before a
top-level definition, one before a method): a line count under it means removing statements.
usage: python bench/lines.py [REV ...]   (default: HEAD; a revision is anything ``git show`` takes)
"""

from __future__ import annotations

import ast
import io
import subprocess
import sys
import tokenize

from harness import ROOT

FOLDERS = ("cache", "kernels", "precompile")
COLUMNS = ("modules", "raw", "code", "statements", "docstring", "comment", "blank", "floor")


def sources(rev: str) -> dict[str, str]:
    """The text of every ``.py`` file of the three folders at ``rev``, by path."""
    listed = subprocess.run(["git", "ls-tree", "-r", "--name-only", rev, "--", *FOLDERS], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout.split()
    return {path: subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, check=True, capture_output=True,
                                 text=True).stdout for path in listed if path.endswith(".py")}


def count(text: str) -> dict[str, int]:
    """The columns of one module."""
    tree = ast.parse(text)
    doc: set[int] = set()
    docstrings = methods = 0
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                doc.update(range(first.lineno, first.end_lineno + 1))
                docstrings += 1
        if isinstance(node, ast.ClassDef):
            methods += sum(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) for n in node.body)
    defs = sum(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) for n in tree.body)
    rest = [line.strip() for i, line in enumerate(text.splitlines(), 1) if i not in doc]
    blank = rest.count("")
    comment = sum(line.startswith("#") for line in rest)
    tokens = tokenize.generate_tokens(io.StringIO(text).readline)
    statements = sum(token.type == tokenize.NEWLINE for token in tokens) - docstrings
    return {"modules": 1, "raw": len(rest) + len(doc), "code": len(rest) - blank - comment,
            "statements": statements, "docstring": len(doc), "comment": comment, "blank": blank,
            "floor": statements + docstrings + 2 * max(defs - 1, 0) + methods}


def main() -> int:
    revs = sys.argv[1:] or ["HEAD"]
    print(f"{'revision':<12} {'folder':<11}" + "".join(f"{c:>11}" for c in COLUMNS))
    for rev in revs:
        totals = dict.fromkeys(COLUMNS, 0)
        by_folder: dict[str, dict[str, int]] = {}
        for path, text in sources(rev).items():
            row = by_folder.setdefault(path.split("/")[0], dict.fromkeys(COLUMNS, 0))
            for column, value in count(text).items():
                row[column] += value
                totals[column] += value
        for folder, row in [*sorted(by_folder.items()), ("total", totals)]:
            print(f"{rev[:12]:<12} {folder:<11}" + "".join(f"{row[c]:>11}" for c in COLUMNS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
