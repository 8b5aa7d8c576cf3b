"""The clean node ``jitwarm capture`` starts a server on: private, empty cache directories, and their census.

A capture stores what the start wrote into each JIT library's cache. A unit already in the caller's cache is one the
start hits, not one it compiles, and a pod that lacks it compiles it again: so the server gets a private ``TMPDIR``,
a private cache root of its own, and every library variable the caller set (or that the library needs to leave the
caller's home) pointed under one private folder. Units are recorded relative to their library's root (their
``under`` names the server), so the private folder never reaches a record, and ``prestart`` restores each unit where
the pod's server looks.

``HOME`` and ``XDG_CACHE_HOME`` stay the caller's: the model a line names by its hub id is cached under them
(``HF_HOME``'s default), and so are the user's site-packages and credentials; every cache jitwarm captures has a
variable of its own that moves it instead. vLLM leaves the paths it derives from them out of its compile key
(``envs.py`` ``compile_factors``: "location-only derived paths"), and ``VLLM_CACHE_ROOT`` too.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from jitwarm.cache import settings
from jitwarm.kernels import kinds
from jitwarm.kernels.libraries.jit_caches.census import snapshot


def roots(room: Any, env: Mapping[str, str]) -> dict[str, Path | None]:
    """Where each library's cache is in a server of ``room`` started with ``env`` (None: off)."""
    dirs = room.cache_dirs(env)
    return {k.family: k.resolve(env, dirs) for k in kinds.caches()}


def private_env(room: Any, base: Mapping[str, str], root: Path) -> tuple[dict[str, str], dict[str, Path]]:
    """``base`` with every library cache of ``room``'s server under ``root`` (see the module docstring).

    A variable set empty (a cache turned off) stays so. Returns the environment and the libraries whose cache is
    still outside ``root`` (none that jitwarm knows: each has a variable).
    """
    env, tmp = dict(base), root / "tmp"
    tmp.mkdir(mode=0o700)
    env["TMPDIR"] = str(tmp)  # Inductor's default, $TMPDIR/torchinductor_$USER, and what else writes to /tmp
    # the server's own cache root first, always private; then the variables beside it and each library's own
    library_variables = kinds.cache_variables()
    own, *beside = room.CACHE_VARIABLES
    if base.get(own) != "":
        env[own] = str(root / own.lower())
    for var in (*beside, *library_variables.values()):
        if base.get(var):  # set by the caller (the pod sets it too): its cache moves, set as before
            env[var] = str(root / var.lower())
    outside = {}
    for name, where in roots(room, env).items():
        if where is not None and not where.is_relative_to(root):
            var = library_variables.get(name)
            if var is None:
                outside[name] = where
                continue
            env[var] = str(root / var.lower())
    outside.update({name: where for name, where in roots(room, env).items()
                    if where is not None and not where.is_relative_to(root) and name not in outside})
    return env, outside


def _families(env: Mapping[str, str]) -> list[str]:
    """The libraries a recording in ``env`` captures (``JITWARM_RECORD_CACHES``; the plugin says a bad one)."""
    with settings.scoped_env({"JITWARM_RECORD_CACHES": env.get("JITWARM_RECORD_CACHES")}):
        try:
            asked = settings.record_caches()
        except settings.SettingError:
            asked = None
    every = [k.family for k in kinds.caches()]
    return every if asked is None else [name for name in every if name in asked]


def census(room: Any, env: Mapping[str, str]) -> dict[str, int]:
    """The complete units each recorded library holds now in a server of ``room`` with ``env``."""
    dirs = room.cache_dirs(env)
    return {name: len(taken.units) for name, taken in snapshot(_families(env), environ=env, dirs=dirs).items()}


def unrecorded(room: Any, env: Mapping[str, str], records: Iterable[Mapping[str, Any]]) -> list[str]:
    """``library unit`` of each unit the libraries hold that no ``jit_cache`` record names.

    Triton's own directory is left out: while jitwarm's plugin serves Triton (``TRITON_CACHE_MANAGER``), what is
    there is not the recorder's to store.
    """
    recorded = {(r["library"], r["unit"]) for r in records if r["kind"] == "jit_cache"}
    dirs = room.cache_dirs(env)
    names = [name for name in _families(env) if name != "triton"]
    return [f"{name} {unit}" for name, taken in snapshot(names, environ=env, dirs=dirs).items()
            for unit in taken.units if (name, unit) not in recorded]


def store_beside(room: Any, env: Mapping[str, str], cache: Any) -> list[dict[str, Any]]:
    """Store the units each library wrote outside its root, and return their records (units of no server).

    Inductor writes its precompiled headers under ``$TMPDIR/torchinductor_<user>`` whatever
    ``TORCHINDUCTOR_CACHE_DIR`` says (codecache.py ``_HEADER_DIR``): an sglang start, whose Inductor root is
    ``$SGLANG_CACHE_DIR/inductor`` (srt/environ.py:2308-2336), puts its header there. Recorded under no server,
    the restore puts each where the library's own default is on the node, which is where the library looks.
    Where that folder is inside the root (vLLM's Inductor), the root's census has the units already: none here.
    """
    from jitwarm.kernels.libraries.jit_caches.backend import store
    from jitwarm.kernels.libraries.jit_caches.census import beside
    from jitwarm.precompile.manifest import unit_record

    taken = beside(_families(env), environ=env, dirs=room.cache_dirs(env))
    return [unit_record(store(snap.library, snap.root, unit, files, cache))
            for snap in taken.values() for unit, files in snap.units.items()]
