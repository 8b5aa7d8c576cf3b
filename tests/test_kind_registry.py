"""A JIT library is one module plus one line of the registry (``kernels/kinds.py``), and then jitwarm plans,
records, restores, counts and seals it with no other edit.

The fake library below is a whole library room: where its cache resolves (its own variable), what a complete unit
is, and how it is sealed inside capture. The test adds the one registry line and watches the library flow through
the recorder, the manifest, ``jitwarm plan``, ``jitwarm prestart`` (the restore), the ledger, the seal and the
private environment ``jitwarm capture`` gives a server.
"""

from __future__ import annotations

import json
import sys
import types

import pytest

FAKE_LIBRARY = '''
"""A fake JIT library's cache (``FAKE_JIT_CACHE_DIR``): a unit is one ``<name>.bin`` file."""

from __future__ import annotations

from pathlib import Path

from jitwarm.kernels.kinds import named
from jitwarm.kernels.libraries.jit_caches.census import bind
from jitwarm.kernels.libraries.jit_caches.units import Library, expand, tree_files

SEALED = []


def resolve(environ):
    return Path(environ["FAKE_JIT_CACHE_DIR"]) if environ.get("FAKE_JIT_CACHE_DIR") else expand("~/.fake_jit")


def units(root):
    return {rel: (rel,) for rel in tree_files(root) if rel.endswith(".bin")}


def seal(refuse):
    SEALED.append(refuse)
    return "fake_jit compile", SEALED.clear


LIBRARY = Library(*named("fake_jit"), resolve, units, ("arch",), unit_is_dir=False)
name, description, build, check, load = bind(LIBRARY)
'''


@pytest.fixture
def fake_library(tmp_path, monkeypatch):
    """The fake library's module on the path, and its one line added to the registry."""
    from jitwarm.kernels import kinds

    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "fake_jit_library.py").write_text(FAKE_LIBRARY)
    monkeypatch.syspath_prepend(str(tmp_path / "lib"))
    line = kinds.cache("fake_jit", where="fake_jit_library", variable="FAKE_JIT_CACHE_DIR",
                       spawners=("fake_jit_library.",), seals=True, sealed="fake_jit compile")
    monkeypatch.setattr(kinds, "KINDS", (*kinds.KINDS, line))  # the one registry line
    for var in ("FAKE_JIT_CACHE_DIR", "JITWARM_RECORD_CACHES", "JITWARM_STRICT", "JITWARM_LEDGER"):
        monkeypatch.delenv(var, raising=False)
    yield line
    sys.modules.pop("fake_jit_library", None)


def test_a_fake_library_flows_through_record_plan_restore_ledger_and_seal(fake_library, tmp_path, monkeypatch,
                                                                          capsys):
    from jitwarm.cache import KernelCache
    from jitwarm.kernels import kinds
    from jitwarm.precompile import ledger, record
    from jitwarm.precompile.cli import main
    from jitwarm.precompile.guard import ThirdPartySeal
    from jitwarm.precompile.manifest import read_manifest, spec_of, unit_record
    from jitwarm.precompile.servers import plugins

    assert kinds.kind("fake_jit") is fake_library and kinds.kind("fake_jit_cache") is fake_library
    assert "fake_jit" in kinds.ledger_families() and kinds.cache_variables()["fake_jit"] == "FAKE_JIT_CACHE_DIR"

    # record: a run writes one unit into the library's cache; the recorder stores it and appends its record
    source, cache_dir, manifest = tmp_path / "run-cache", tmp_path / "jitwarm", tmp_path / "m.jsonl"
    source.mkdir()
    monkeypatch.setenv("FAKE_JIT_CACHE_DIR", str(source))
    watched = ledger.Ledger()
    with record(manifest, KernelCache(cache_dir)) as recorder:
        (source / "gemm.bin").write_bytes(b"compiled by the fake library")
    assert recorder.captured == {"fake_jit": 1}
    (rec,) = read_manifest(manifest)
    assert (rec["kind"], rec["library"], rec["unit"]) == ("jit_cache", "fake_jit", "gemm.bin")
    spec = spec_of(rec)
    assert spec.backend == "fake_jit_cache" and unit_record(spec) == rec  # the record's spec, both directions

    # ledger: the start that wrote the unit compiled it, counted from the library's new units
    count = watched.report().family("fake_jit")
    assert (count.compiled, count.keys) == (1, ("gemm.bin",))

    # plan: the manifest's unit is a spec of the plan
    assert main(["plan", "--manifest", str(manifest), "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert any("fake_jit_cache" in json.dumps(s) for s in planned["specs"]), planned["specs"]

    # restore: prestart places the unit where the library resolves its cache in this environment
    target = tmp_path / "pod-cache"
    monkeypatch.setenv("FAKE_JIT_CACHE_DIR", str(target))
    assert main(["prestart", "--manifest", str(manifest), "--cache-dir", str(cache_dir), "--offline"]) == 0
    assert (target / "gemm.bin").read_bytes() == b"compiled by the fake library"
    assert "fake_jit: 1 unit(s) in" in capsys.readouterr().err

    # seal: the guard seals it inside capture, and the plugins' line names it
    seal = ThirdPartySeal(mode="warn", when=lambda: False)
    try:
        assert "fake_jit compile" in seal.install()
        assert len(sys.modules["fake_jit_library"].SEALED) == 1
    finally:
        seal.remove()
    assert sys.modules["fake_jit_library"].SEALED == []
    assert "fake_jit compile" in plugins.seal_line("vllm") and "sglang load_jit" not in plugins.seal_line("vllm")


def test_a_fake_librarys_variable_is_made_private_for_a_capture(fake_library, tmp_path, monkeypatch):
    """``jitwarm capture`` moves the new library's cache under its private folder, as every library's."""
    from jitwarm.precompile import capture_node, servers

    monkeypatch.setenv("FAKE_JIT_CACHE_DIR", str(tmp_path / "callers"))
    root = tmp_path / "private"
    root.mkdir()
    env, outside = capture_node.private_env(servers.adapter("vllm"), dict(__import__("os").environ), root)
    assert env["FAKE_JIT_CACHE_DIR"] == str(root / "fake_jit_cache_dir")
    assert "fake_jit" not in outside
    assert capture_node.roots(servers.adapter("sglang"), env)["fake_jit"] == root / "fake_jit_cache_dir"


def test_every_registered_kind_answers_its_contract():
    """Each kind of the registry: its backend imports and provides the backend contract, a JIT cache kind has its
    Library named as registered, a record kind converts, a seal returns ``(name, undo)`` or None."""
    from jitwarm.kernels import kinds

    for kind in kinds.KINDS:
        module = kind.backend()
        for name in ("description", "build", "check", "load"):
            assert callable(getattr(module, name)), (kind.name, name)
        if kind.is_cache:
            assert (kind.library().name, kind.library().kind) == (kind.family, kind.name)
            assert kind.record == "jit_cache"
        else:
            assert kind.library() is None and kind.resolve({}) is None and kind.signal() is None
        if kind.record:
            assert kind.record_problem({"kind": kind.record}) is not None  # a record without its fields
        else:
            assert kind.record_of(types.SimpleNamespace()) is None
    assert [k.sealed for k in kinds.seals()] == ["tvm-ffi build and load", "Triton compile", "Inductor compile"]
