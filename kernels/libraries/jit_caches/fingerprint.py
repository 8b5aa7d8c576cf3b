"""What a captured unit's library keyed it on that the node must match: package, compiler and driver versions, arch.

A cache copied to a node where one of these differs is copied "successfully" and never hit (modelexpress #560,
dynamo #10119 and #10695). A unit carries its library's items as recorded; a restore compares them with the
node's (:func:`differing`). A value that cannot be found is ``absent``.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

from jitwarm.kernels.target import local_gpus

ABSENT = "absent"
#: item -> the distribution names that may provide it (the first installed one counts).
PACKAGES = {"torch": ("torch",), "triton": ("triton",), "tilelang": ("tilelang",),
            "deep_gemm": ("sgl-deep-gemm", "deep_gemm", "deep-gemm"), "flashinfer": ("flashinfer-python", "flashinfer"),
            "sglang": ("sglang",), "vllm": ("vllm",)}
ITEMS = (*PACKAGES, "cutlass-dsl", "nvcc", "cxx", "arch", "driver")


def node(items: Iterable[str], target: str | None = None) -> dict[str, str]:
    """The node's value of each item; ``target`` stands for the arch where no GPU can be asked (``--target``)."""
    return {item: value(item, target) for item in items}


def value(item: str, target: str | None = None) -> str:
    """The node's value of one item: a distribution's version, a compiler's ``--version`` line, arch or driver."""
    if item in PACKAGES:
        return package_version(PACKAGES[item])
    if item == "cutlass-dsl":
        return _cutlass_dsl()
    if item == "nvcc":
        return _compiler(_nvcc(), "nvcc")
    if item == "cxx":
        return _compiler(os.environ.get("CXX") or "c++", "c++")
    if item == "arch":
        return gpu_arch() or target or "cpu"
    if item == "driver":
        return _driver()
    raise ValueError(f"unknown fingerprint item {item!r}; known: {', '.join(ITEMS)}")


def differing(recorded: Mapping[str, str], here: Mapping[str, str]) -> tuple[str, str, str] | None:
    """The first item whose recorded value is not the node's: ``(item, recorded, node)``; None when all match."""
    for item in sorted(recorded):
        if item in here and recorded[item] != here[item]:
            return item, recorded[item], here[item]
    return None


#: An item ``<library>:env:<NAME>`` is the environment variable NAME as that library read it (JSON).
ENV_MARK = ":env:"


def remedy(item: str, recorded: str, here: str) -> str:
    """How to make this node match the unit's ``recorded`` value of ``item`` (it has ``here``), in one clause.

    An environment variable is named with its value: the fix is in the pod's environment, not in its image
    (vLLM hashes ``VLLM_PLUGINS`` into its compile key, ``envs.py`` ``compile_factors``).
    """
    if ENV_MARK in item:
        library, name = item.split(ENV_MARK, 1)[0], item.split(ENV_MARK, 1)[1]
        setting = _env_setting(name, recorded)
        return (f"{library} hashes the environment variable {name} into its key: {setting} as at capture in this "
                "node's environment, or capture again with this node's value")
    if item in PACKAGES:
        return (f"install {item} {recorded} here as at capture (the server's image), or capture again in this "
                "node's image")
    if item in ("nvcc", "cxx", "cutlass-dsl"):
        return f"give this node the capture's {item} ({recorded}), or capture again in this node's image"
    if item == "arch":
        return (f"restore it on a {recorded} node (where no GPU can be asked, --target {recorded}), or capture "
                "again on this node's GPU")
    if item == "driver":
        return f"run it on driver {recorded} as at capture, or capture again on this node's driver"
    return f"capture again where {item} is {here!r}, as on this node"


def _env_setting(name: str, recorded: str) -> str:
    """``set NAME=value`` for a recorded JSON value that is the variable's text, else how to set it."""
    import json

    try:
        value = json.loads(recorded)
    except ValueError:
        value = recorded
    if value is None:
        return f"unset {name}"
    if isinstance(value, str):
        return f"set {name}={value}"
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return f"set {name}={','.join(value)}"
    return f"set {name} so that it reads {recorded}"


@functools.cache
def package_version(names: tuple[str, ...]) -> str:
    """The version of the first installed distribution of ``names``, or ``absent``."""
    from importlib.metadata import PackageNotFoundError, version

    for name in names:
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return ABSENT


@functools.lru_cache(maxsize=1)
def _cutlass_dsl() -> str:
    """Every ``nvidia-cutlass-dsl*`` distribution as ``name==version``: the CUDA variant is in the name."""
    from importlib.metadata import distributions

    found = sorted({f"{d.metadata['Name']}=={d.version}" for d in distributions()
                    if str(d.metadata.get("Name") or "").lower().startswith("nvidia-cutlass-dsl")})
    return ",".join(found) or ABSENT


def _nvcc() -> str:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and (Path(home) / "bin" / "nvcc").is_file():
        return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc") or "nvcc"


@functools.lru_cache(maxsize=8)
def _compiler(exe: str, name: str) -> str:
    """The line of ``exe --version`` that names the release, or ``absent``."""
    from jitwarm.kernels.backend import ToolchainError, version_lines

    try:
        lines = version_lines(exe, name, timeout_s=30.0)
    except ToolchainError:
        return ABSENT
    return next((line for line in lines if "release" in line), lines[0])


@functools.lru_cache(maxsize=1)
def gpu_arch() -> str | None:
    """The GPU's ``sm_XY``: from torch when it has initialized CUDA in this process, else nvidia-smi; else None."""
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_initialized():
                major, minor = torch.cuda.get_device_capability()
                return f"sm_{major}{minor}"
        except Exception:  # noqa: BLE001 - a broken CUDA stack answers "no GPU", as nvidia-smi's absence does
            pass
    gpus = local_gpus()
    return gpus[0].arch if gpus else None


@functools.lru_cache(maxsize=1)
def _driver() -> str:
    gpus = local_gpus()
    if gpus:
        return gpus[0].driver
    try:  # "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  ..."
        line = Path("/proc/driver/nvidia/version").read_text().splitlines()[0]
        return next(part for part in line.split() if part[:1].isdigit() and "." in part)
    except (OSError, IndexError, StopIteration):
        return ABSENT
