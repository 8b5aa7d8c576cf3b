"""What a real server's start wrote into its caches, judged by files: the evidence the real-server tests compare.

A start that compiles writes compiled artifacts into its libraries' caches; a restored start that compiles nothing
writes none. :func:`files_under` lists every file under a node's cache roots with its size, :func:`compiled` picks
the compiled artifacts among them.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

#: Lock files: written by every start, compiling or not.
NOT_COMPILED = ("/locks/",)
#: What is a compiled artifact: Inductor's modules and their C++ (.py/.cpp/.so), its precompiled headers and FX and
#: AOTAutograd entries, vLLM's compile tree and model inspection.
COMPILED_SUFFIXES = (".so", ".cpp", ".py", ".gch", ".h", ".json")


def files_under(node: Path, roots: Iterable[Path]) -> dict[str, int]:
    """Every file under ``roots`` (those that are folders), named relative to ``node``, with its size."""
    found = {}
    for root in roots:
        for path in root.rglob("*") if root.is_dir() else ():
            if path.is_file():
                found[str(path.relative_to(node))] = path.stat().st_size
    return found


def compiled(files: Iterable[str]) -> list[str]:
    """The compiled artifacts among ``files`` (see :data:`COMPILED_SUFFIXES`)."""
    return sorted(f for f in files if not any(part in f for part in NOT_COMPILED)
                  and (f.endswith(COMPILED_SUFFIXES) or "/fxgraph/" in f or "/aotautograd/" in f))
