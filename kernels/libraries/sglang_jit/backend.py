"""The server's own sglang ``load_jit`` modules (kind ``sglang_jit``): keyed, built and looked up by sglang.

A spec is one recorded ``load_jit`` call (module name, recording arch, the call as JSON, sglang's version and
arch); its description is what sglang's own build key hashes, computed by sglang (:mod:`.child`), so our key
changes exactly when sglang's does (docs/kernels.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
import uuid
from importlib import metadata, util
from pathlib import Path
from typing import Any

from filelock import FileLock

from jitwarm.cache import files
from jitwarm.cache.errors import JitwarmError
from jitwarm.kernels.backend import Facts, LoadError, SpecError
from jitwarm.kernels.libraries.sglang_jit import child
from jitwarm.kernels.spec import KernelSpec
from jitwarm.kernels.target import Target, TargetError

name = "sglang_jit"
#: Layout of this backend's entries; part of every description.
FORMAT = "jitwarm-sglang-jit/1"
MANIFEST = "sglang_jit.json"
DEPS_FILE = "sgl_deps.json"  # compile/cache.py:72
MODULE_PREFIX = "sgl_kernel_jit_"  # compile/spec.py:20, BuildSpec.module_name (:55-57)
_ARCH = re.compile(r"([0-9]+)\.([0-9])([a-z]*)")  # ArchInfo.target_name (utils/arch.py:33-35)


def _parse(spec: KernelSpec) -> tuple[dict[str, Any], child.Arch, str]:
    """The spec's call, arch and sglang version, after checking the spec and that the installed sglang recorded it."""
    if spec.backend != name:
        raise SpecError(f"{spec.id}: not an {name} spec")
    params = spec.params_dict
    unknown = set(params) - {"call", "sglang", "arch"}
    if unknown or not isinstance(params.get("call"), str):
        raise SpecError(f"{spec.family}: an {name} spec has params call, sglang and arch (got {sorted(params)})")
    try:
        call = json.loads(params["call"])
        target = Target.parse(spec.target)
    except (ValueError, TargetError) as exc:
        raise SpecError(f"{spec.family}: {exc}") from None
    args = call.get("args") if isinstance(call, dict) else None
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise SpecError(f"{spec.family}: the recorded call has no list of string args")
    if spec.family != MODULE_PREFIX + "_".join(args):
        raise SpecError(f"{spec.family}: load_jit{tuple(args)} names module {MODULE_PREFIX + '_'.join(args)}")
    if not target.is_cuda:
        raise SpecError(f"{spec.family}: target {spec.target}: sglang JIT modules are built for a CUDA arch")
    major, minor, suffix = *divmod(int(spec.target[3:]), 10), None
    if "arch" in params:
        found = _ARCH.fullmatch(str(params["arch"]))
        if found is None or f"sm_{found[1]}{found[2]}" != spec.target:
            raise SpecError(f"{spec.family}: arch {params['arch']!r} is not sglang's name of a {spec.target} target")
        major, minor, suffix = int(found[1]), int(found[2]), found[3]
    recorded, installed = str(params.get("sglang", "")), installed_sglang()
    if recorded != installed:
        raise SpecError(f"{spec.family}: recorded with sglang {recorded or '(unknown)'}, but sglang {installed} is "
                        "installed here; record the manifest again with this sglang")
    return call, (major, minor, suffix), installed


def installed_sglang() -> str:
    """The version of the sglang importable here (package metadata; nothing is imported); SpecError if none."""
    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        where = "is importable but has no package metadata" if util.find_spec("sglang") else "is not importable here"
        raise SpecError(f"sglang {where}: the {name} backend builds with the server's own sglang "
                        "(install the server's sglang into this environment)") from None


def description(spec: KernelSpec, facts: Facts | None = None) -> dict[str, Any]:
    """Return the cache description of ``spec`` (``facts`` unused: sglang fingerprints its compilers).

    Raises
    ------
    SpecError
        A malformed spec; sglang missing or not the recorded version; ``load_jit`` rejects the call.
    ToolchainError
        nvcc, the CUDA runtime or the host compiler is not where sglang looks, or sglang's loader does not answer.

    """
    call, arch, sglang = _parse(spec)
    signature = child.env_signature()
    found = _descriptions.get((spec, signature))
    if found is None:
        found = _described(spec, call, sglang, child.describe(arch, call, signature))
        _descriptions[spec, signature] = found
    return json.loads(json.dumps(found))  # a copy: callers may not change the memo


def _described(spec: KernelSpec, call: dict[str, Any], sglang: str, key: dict[str, Any]) -> dict[str, Any]:
    """The description of ``spec`` from the parts of sglang's build key (:func:`.child.sglang_key`)."""
    key = dict(key)
    if key.get("module") != spec.family:
        raise SpecError(f"{spec.family}: sglang names this call's module {key.get('module')!r}")
    return {"format": FORMAT, "module": spec.family, "target": spec.target, "arch": key.pop("arch"),
            "sglang": sglang, "call": call, "sglang_key": key}


_descriptions: dict[tuple[KernelSpec, tuple[Any, ...]], dict[str, Any]] = {}


def build(spec: KernelSpec, staging: Path, described: dict[str, Any] | None = None) -> None:
    """Build ``spec`` with sglang's ``load_jit`` in a fresh interpreter; its leaf to ``staging``; CompileError."""
    staging = Path(staging)
    call, arch, _ = _parse(spec)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=".sglang-", dir=staging) as tmp:
        root = Path(tmp) / "jit"
        result = child.build(spec.family, arch, call, root)
        leaf = result["leaf"]
        (staging / leaf).parent.mkdir(parents=True)
        (root / leaf).rename(staging / leaf)
    doc = {"format": FORMAT, "spec": spec.to_json(), "leaf": leaf, "library": f"{spec.family}.so",
           "target_tag": result["key"]["target_tag"], "build_key": result["key"]["build_key"],
           "driver": result["driver"], "build_seconds": round(time.perf_counter() - start, 3)}
    (staging / MANIFEST).write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n", encoding="utf-8")


def store(spec: KernelSpec, leaf: Path, key: dict[str, Any], cache: Any) -> None:
    """Store the leaf a server's ``load_jit`` published as ``spec``'s entry, as :func:`build` would have made it.

    ``leaf`` is ``<cache root>/<tag>/<module>/build-<key>/deps-<key>`` (cache.py:322-325,451) and ``key`` the
    parts of sglang's build key of the call, as sglang computed them in that process (:func:`.child.sglang_key`):
    a leaf whose key is not the recorded call's is refused, and one a replay would key otherwise is stored under
    a key no replay looks up (capture's check then says it is missing).

    Raises
    ------
    SpecError
        The spec is not this leaf's, or the installed sglang did not record it.
    jitwarm.cache.UntrustedPath
        A file or folder of the leaf is another user's or writable by others (unless ``JITWARM_ALLOW_SHARED=1``).
    jitwarm.cache.BuildError, jitwarm.cache.CacheError, OSError
        The copy failed, or the check refused it.

    """
    from jitwarm.cache import key_of
    from jitwarm.kernels.artifacts import Artifact
    from jitwarm.kernels.libraries.jit_caches.backend import check_source

    call, _, sglang = _parse(spec)
    described = _described(spec, call, sglang, key)
    rel = "/".join(Path(leaf).parts[-4:])
    if rel.split("/")[:3] != [key["target_tag"], spec.family, f"build-{key['build_key']}"]:
        raise SpecError(f"{spec.family}: the leaf {leaf} is not under the build sglang keyed for the call")
    root = Path(leaf).parents[3]
    files = tuple(sorted(p.relative_to(root).as_posix() for p in Path(leaf).rglob("*") if p.is_file()))
    check_source(root, files)  # a leaf another user planted is not shipped to every node

    def capture(staging: Path) -> None:
        for name in files:
            dest = staging / name
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(root / name, dest)
            dest.chmod((root / name).stat().st_mode & 0o555 | 0o600)
        doc = {"format": FORMAT, "spec": spec.to_json(), "leaf": rel, "library": f"{spec.family}.so",
               "target_tag": key["target_tag"], "build_key": key["build_key"], "driver": "captured",
               "build_seconds": None}
        (staging / MANIFEST).write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n", encoding="utf-8")

    Artifact(spec, described, key_of(described)).get_or_build(cache, capture=capture)


def check(spec: KernelSpec, staging: Path) -> dict[str, Any]:
    """Check what :func:`build` wrote, without a device, and return its manifest; LoadError if it is wrong."""
    root = Path(staging)
    try:
        doc = json.loads((root / MANIFEST).read_text(encoding="utf-8"))
        leaf = str(doc["leaf"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise LoadError(f"{spec.family}: {root} has no readable {MANIFEST}: {exc}") from None
    if doc.get("format") != FORMAT or doc.get("spec") != spec.to_json() or doc.get("library") != f"{spec.family}.so":
        raise LoadError(f"{spec.family}: {root / MANIFEST} describes another spec than {spec.id}")
    # <target tag>/<module>/build-<build key>/deps-<deps key>: cache.py:17-21,322-325,451
    parts = leaf.split("/")
    if (len(parts) != 4 or parts[1:3] != [spec.family, f"build-{doc.get('build_key')}"]
            or parts[0] != doc.get("target_tag") or not re.fullmatch(r"deps-[0-9a-f]{16}", parts[3])):
        raise LoadError(f"{spec.family}: {MANIFEST} names leaf {leaf!r}, not one of this module's sglang leaves")
    try:
        with (root / leaf / f"{spec.family}.so").open("rb") as f:
            elf = f.read(4) == b"\x7fELF"
        deps = json.loads((root / leaf / DEPS_FILE).read_bytes())
    except (OSError, ValueError) as exc:
        raise LoadError(f"{spec.family}: leaf {leaf} is incomplete: {exc}") from None
    if not elf:
        raise LoadError(f"{spec.family}: {leaf}/{spec.family}.so is not a shared library (no ELF header)")
    if not isinstance(deps, list) or not deps or not all(isinstance(d, list) and len(d) == 3 for d in deps):
        raise LoadError(f"{spec.family}: {leaf}/{DEPS_FILE} is not sglang's dependency list")
    return doc


class SglangCacheDirError(JitwarmError, OSError):
    """sglang's JIT cache directory cannot be created, locked or written (exit 1); the message names it."""


def cache_root() -> Path:
    """The JIT cache root sglang uses: its ``cache_root()`` when loaded, else ``$SGLANG_JIT_CACHE_DIR`` or default."""
    loaded = sys.modules.get("sglang.kernels.jit.utils.compile.cache")
    if loaded is not None:
        return Path(loaded.cache_root())
    return Path(os.path.expanduser(os.environ.get("SGLANG_JIT_CACHE_DIR") or "~/.cache/sglang/jit"))  # noqa: PTH111 - never raises, as sglang's own


def materialize(spec: KernelSpec, entry: Any, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Put ``entry``'s leaf into sglang's JIT cache (default :func:`cache_root`); return its library's path.

    A complete leaf there is kept; otherwise the checked files are staged and renamed into place under sglang's
    build lock, so its lock-free loader sees the leaf whole or not at all.

    Raises
    ------
    LoadError
        The entry is not this spec's or under another sglang key, or a file of it is unreadable or differs.
    SglangCacheDirError
        sglang's cache directory cannot be written (the entry is kept).

    """
    doc = check(spec, Path(entry.path))
    described = entry.description.get("sglang_key", {})
    if (described.get("target_tag"), described.get("build_key")) != (doc["target_tag"], doc["build_key"]):
        raise LoadError(f"{spec.family}: built as sglang {doc['target_tag']}/build-{doc['build_key']} but described "
                        f"as {described.get('target_tag')}/build-{described.get('build_key')}: the environment "
                        "changed between describing and building")
    leaf = Path(cache_dir if cache_dir is not None else cache_root()) / doc["leaf"]
    try:
        # A complete leaf is kept: sglang publishes only whole leaves, its fast path takes no lock (loader.py:135).
        if _complete(leaf, doc):
            return leaf / doc["library"]
        leaf.parent.mkdir(parents=True, exist_ok=True)
        # sglang's own build lock: flock on <scope>/.lock, never unlinked (loader.py:40,247-267)
        with FileLock(leaf.parent / ".lock", thread_local=False, preserve_lock_file=True):
            if not _complete(leaf, doc):
                _place(spec, entry, doc["leaf"], leaf)
    except OSError as exc:
        raise SglangCacheDirError(f"{spec.family}: cannot write sglang's JIT cache {leaf.parents[3]}: {exc}") from exc
    return leaf / doc["library"]


def _place(spec: KernelSpec, entry: Any, rel_leaf: str, leaf: Path) -> None:
    """Under sglang's lock: the leaf staged beside ``leaf``, an incomplete one there set aside, then renamed."""
    staging = leaf.parent / f".staging-jitwarm-{uuid.uuid4().hex}"
    try:
        _copy_leaf(spec, entry, rel_leaf, staging)
        if leaf.exists():  # incomplete: sglang would skip it, and never publish over it (cache.py:536-543)
            broken = leaf.parent / f".broken-{uuid.uuid4().hex}"
            leaf.rename(broken)
            shutil.rmtree(broken, ignore_errors=True)
        staging.rename(leaf)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _complete(leaf: Path, doc: dict[str, Any]) -> bool:
    """Whether sglang's lookup finds ``leaf`` whole, besides its re-hash (cache.py:392-403)."""
    return (leaf / DEPS_FILE).is_file() and (leaf / doc["library"]).is_file()


def _copy_leaf(spec: KernelSpec, entry: Any, leaf: str, staging: Path) -> None:
    """Copy the entry's files of ``leaf`` into ``staging``, durable, each checked against its sha256 first."""
    for record in (r for r in entry.records if r.path.startswith(leaf + "/")):
        try:
            data = (Path(entry.path) / record.path).read_bytes()
        except OSError as exc:  # the entry's side: LoadError, so the cache discards and rebuilds it
            raise LoadError(f"{spec.family}: cannot read {record.path} of its cache entry: {exc}") from exc
        if hashlib.sha256(data).hexdigest() != record.sha256:
            raise LoadError(f"{spec.family}: {record.path} does not match its cache entry (sha256 differs)")
        dest = staging / record.path[len(leaf) + 1:]
        dest.parent.mkdir(parents=True, exist_ok=True)
        files.write_atomic(dest, data, mode=0o755 if dest.suffix == ".so" else 0o644)


def load(spec: KernelSpec, entry: Any) -> SglangJitKernel:
    """Materialize ``entry`` into the server's sglang JIT cache and return its kernel (errors: :func:`materialize`)."""
    return SglangJitKernel(spec, materialize(spec, entry))


class SglangJitKernel:
    """A recorded sglang JIT module, present in sglang's cache (a ``LoadedKernel``)."""

    def __init__(self, spec: KernelSpec, library: Path) -> None:
        self.spec = spec
        self.library = library
        self._module: Any = None

    def preload(self) -> int:
        """Load the module with the recorded ``load_jit`` (a hit) on a device of the spec's arch; 0 without CUDA.

        RuntimeError on another arch, where the call would compile (arch.py:104-128).
        """
        try:
            import torch
        except ImportError:
            return 0
        if not torch.cuda.is_available():
            return 0
        if self._module is None:
            call, arch, _ = _parse(self.spec)
            if torch.cuda.get_device_capability() != arch[:2]:
                raise RuntimeError(f"{self.spec.family}: recorded for {self.spec.target}, but this device is "
                                   f"sm_{''.join(map(str, torch.cuda.get_device_capability()))}")
            from sglang.kernels.jit.utils import load_jit

            args, kwargs = child.call_arguments(call)
            self._module = load_jit(*args, **kwargs)
        return 1

    def run(self, *args: Any) -> None:
        """The server launches its own kernels; jitwarm only makes them present and loaded."""
        raise TypeError(f"{self.spec.family}: a recorded sglang JIT module is launched by the server, not by jitwarm")

    def __repr__(self) -> str:
        return f"SglangJitKernel({self.spec.family}@{self.spec.target})"
