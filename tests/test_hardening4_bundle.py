"""A bundle's headers are bounded before ``tarfile`` reads them, its structure is checked before a byte is written,
and an export killed mid-write leaves nothing the next one does not sweep; each refusal has its twin beside it.

Memory is bounded for real: the importer runs in a subprocess under ``RLIMIT_AS`` (the ``resource`` module) and a
bomb must end in exit 4 with one line, not ``MemoryError``.
"""

from __future__ import annotations

import io
import json
import os
import resource
import struct
import subprocess
import sys
import tarfile
import time
import zlib
from pathlib import Path

import pytest
from precompile_fixtures import jitwarm

from jitwarm.cache import BuildError, KernelCache
from jitwarm.cache.bundle_headers import MAX_DEPTH, MAX_MEMBERS
from jitwarm.cache.locks import this_host
from jitwarm.cache.signing import UntrustedEntry

#: Address space for the importing process: a little over what the CLI itself maps, far under a bomb's claim.
LIMIT = 512 << 20
KEY = "fleet-key-0123456789abcdef"
DESC = {"kind": "hardening4-bundle", "n": 1}


def _build(staging: Path) -> None:
    (staging / "kernel.so").write_bytes(b"\x7fELF kernel " * 64)
    (staging / "kernel.so").chmod(0o755)
    (staging / "secret.bin").write_bytes(b"private compile")
    (staging / "secret.bin").chmod(0o600)


def import_limited(bundle: Path | str, root: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``jitwarm import BUNDLE`` in a subprocess whose address space is capped at :data:`LIMIT`."""
    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (LIMIT, LIMIT))

    return subprocess.run([sys.executable, "-m", "jitwarm.precompile", "import", str(bundle), "--cache-dir",
                           str(root)], capture_output=True, text=True, timeout=600, preexec_fn=cap,
                          env={**os.environ, **(env or {})})


def refused(proc: subprocess.CompletedProcess, *words: str) -> None:
    assert proc.returncode == 4, proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    for word in words:
        assert word in proc.stderr, proc.stderr


def nothing_imported(root: Path) -> None:
    entries = root / "v1" / "entries"
    assert not entries.exists() or not any(entries.rglob("entry.json"))
    staging = root / "v1" / "staging"
    assert not staging.exists() or not any(staging.iterdir())


@pytest.fixture
def exported(tmp_path):
    """A good bundle of one entry, and its key."""
    cache = KernelCache(root=tmp_path / "origin", layers=())
    entry = cache.get_or_build(DESC, _build)
    return cache.export_bundle([entry.key], tmp_path / "good.tar.gz"), entry.key


def zeros_gz(path: Path, head: bytes, zero_mib: int) -> None:
    """A .tar.gz of ``head`` then ``zero_mib`` MiB of zeros as one gzip member (a stream reads only the first).

    Each MiB is deflated once: after a full flush the compressor starts afresh, so every MiB's bytes are equal.
    """
    block = bytes(1 << 20)
    deflate = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    first = deflate.compress(head) + deflate.flush(zlib.Z_FULL_FLUSH)
    one = deflate.compress(block) + deflate.flush(zlib.Z_FULL_FLUSH)
    crc = zlib.crc32(head)
    for _ in range(zero_mib):
        crc = zlib.crc32(block, crc)
    with path.open("wb") as f:
        f.write(b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x02\xff" + first)
        for _ in range(zero_mib):
            f.write(one)
        f.write(deflate.flush(zlib.Z_FINISH))
        f.write(struct.pack("<II", crc, (len(head) + zero_mib * len(block)) & 0xFFFFFFFF))


def bomb_header(kind: str, size: int) -> bytes:
    info = tarfile.TarInfo("././@LongLink" if kind == "GNU long name" else "././@PaxHeader")
    info.type = tarfile.GNUTYPE_LONGNAME if kind == "GNU long name" else tarfile.XHDTYPE
    info.size = size
    return info.tobuf(format=tarfile.GNU_FORMAT if kind == "GNU long name" else tarfile.USTAR_FORMAT)


@pytest.mark.parametrize("kind", ["GNU long name", "PAX header"])
def test_a_header_bomb_is_refused_at_its_header_with_memory_flat(tmp_path, kind):
    """1 GiB claimed by the first header, under a 512 MiB address space: exit 4 and one line (it was MemoryError)."""
    bomb = tmp_path / "bomb.tar.gz"
    zeros_gz(bomb, bomb_header(kind, 1 << 30), 1024)
    assert bomb.stat().st_size < (8 << 20)
    start = time.monotonic()
    proc = import_limited(bomb, tmp_path / "root")
    refused(proc, f"refusing bundle {bomb}", "claims a", "nothing was imported")
    assert time.monotonic() - start < 60  # the header alone is read: about a second on a loaded box
    nothing_imported(tmp_path / "root")


def test_a_good_bundle_imports_under_the_same_memory_cap(tmp_path, exported):
    bundle, key = exported
    proc = import_limited(bundle, tmp_path / "root")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "root" / "v1" / "entries" / key[:2] / key / "kernel.so").is_file()


def _raw_tar(path: Path, names: list[str], data: dict[str, bytes] | None = None) -> None:
    """A tar of ``names`` (a name ending in ``/``: a folder), written header by header (fast for many)."""
    data = data or {}
    with path.open("wb") as f:
        for name in names:
            info = tarfile.TarInfo(name.rstrip("/"))
            body = data.get(name, b"")
            info.type = tarfile.DIRTYPE if name.endswith("/") else tarfile.REGTYPE
            info.size, info.mode = (0, 0o755) if name.endswith("/") else (len(body), 0o444)
            f.write(info.tobuf(format=tarfile.PAX_FORMAT))
            f.write(body + bytes(-len(body) % 512))
        f.write(bytes(1024))


def test_one_member_past_the_cap_is_refused_from_the_headers_alone(tmp_path):
    """50,001 headers: exit 4 naming the cap, before any member is written (a 400,000-member bundle took 213 s)."""
    bundle = tmp_path / "many.tar"
    _raw_tar(bundle, [f"v1/d{i}/" for i in range(MAX_MEMBERS + 1)])
    start = time.monotonic()
    proc = import_limited(bundle, tmp_path / "root")
    refused(proc, f"beyond {MAX_MEMBERS} members")
    assert time.monotonic() - start < 120  # about 3 s on a loaded 2-core box
    nothing_imported(tmp_path / "root")


def _entry_members(key: str, files: dict[str, bytes]) -> tuple[list[str], dict[str, bytes]]:
    base = f"v1/entries/{key[:2]}/{key}"
    names = [f"{base}/{rel}" for rel in files]
    return names, {f"{base}/{rel}": data for rel, data in files.items()}


@pytest.mark.parametrize("case", ["deep", "name of 100,000 characters", "file where a folder goes",
                                  "folder where a file goes"])
def test_structural_problems_are_the_bundles_exit_4_not_a_write_error(tmp_path, case):
    key = "ab" + "0" * 62
    if case == "deep":
        files = {"/".join(["d"] * (MAX_DEPTH + 1)) + "/f": b"x"}
        words = (f"deeper than {MAX_DEPTH} folders",)
    elif case == "name of 100,000 characters":
        files = {"n" * 100_000: b"x"}
        words = ("claims a PAX header",)
    elif case == "file where a folder goes":
        files = {"a/b": b"x", "a": b"y"}
        words = ("is a file where earlier members put a folder",)
    else:
        files = {"a": b"y", "a/b": b"x"}
        words = ("lies under a file of an earlier member",)
    names, data = _entry_members(key, files)
    bundle = tmp_path / "bad.tar"
    _raw_tar(bundle, names, data)
    refused(import_limited(bundle, tmp_path / "root"), f"refusing bundle {bundle}", *words)
    nothing_imported(tmp_path / "root")


def test_a_killed_exports_temporary_is_swept_by_the_next_export(tmp_path, exported):
    """The temporary of an export that was SIGKILLed (its process is gone) is removed; a live one's stays."""
    _, key = exported
    dead = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    dead.kill()
    dead.wait()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        target = tmp_path / "out.tar"
        left = tmp_path / f".out.tar.{this_host()}~{dead.pid}~0badc0de.tmp"
        kept = tmp_path / f".out.tar.{this_host()}~{live.pid}~0badc0de.tmp"
        left.write_bytes(b"x" * 4096)
        kept.write_bytes(b"x" * 4096)
        KernelCache(root=tmp_path / "origin", layers=()).export_bundle([key], target)
        assert target.is_file() and not left.exists() and kept.exists()
    finally:
        live.kill()
        live.wait()


def test_a_hard_link_in_staging_is_refused_and_the_file_outside_keeps_its_mode(tmp_path):
    outside = tmp_path / "outside.so"
    outside.write_bytes(b"\x7fELF not the cache's")
    outside.chmod(0o644)

    def link_in(staging: Path) -> None:
        os.link(outside, staging / "kernel.so")

    cache = KernelCache(root=tmp_path / "root", layers=())
    with pytest.raises(BuildError, match="other hard link"):
        cache.get_or_build({"kind": "hardlink"}, link_in)
    assert outside.stat().st_mode & 0o777 == 0o644
    assert cache.lookup(cache.key({"kind": "hardlink"})) is None
    assert cache.get_or_build({"kind": "copied"}, lambda s: (s / "kernel.so").write_bytes(outside.read_bytes()))


def _widen(bundle: Path, out: Path) -> None:
    """The attack: every member's mode rewritten 0444/0555, the signature left as it was."""
    with tarfile.open(bundle) as src, tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as dst:
        for m in src:
            data = src.extractfile(m).read() if m.isreg() else None
            m.mode = 0o555 if m.mode & 0o111 else 0o444
            dst.addfile(m, io.BytesIO(data) if data is not None else None)


def test_a_signed_bundles_widened_mode_does_not_verify(tmp_path, monkeypatch):
    monkeypatch.setenv("JITWARM_TRUST_KEY", KEY)
    origin = KernelCache(root=tmp_path / "origin", layers=())
    entry = origin.get_or_build(DESC, _build)
    bundle = origin.export_bundle([entry.key], tmp_path / "signed.tar")
    widened = tmp_path / "widened.tar"
    _widen(bundle, widened)
    with pytest.raises(UntrustedEntry, match="does not verify"):
        KernelCache(root=tmp_path / "victim", layers=()).import_bundle(widened)
    nothing_imported(tmp_path / "victim")
    proc = jitwarm("import", str(widened), "--cache-dir", str(tmp_path / "victim2"), env={"JITWARM_TRUST_KEY": KEY})
    refused(proc, "does not verify")


@pytest.mark.parametrize("shared", [False, True])
def test_a_signed_bundle_keeps_its_private_file_private(tmp_path, monkeypatch, shared):
    """The twin: untouched, it imports, the private file stored 0400 (a shared root: group-readable, as before)."""
    monkeypatch.setenv("JITWARM_TRUST_KEY", KEY)
    origin = KernelCache(root=tmp_path / "origin", layers=())
    entry = origin.get_or_build(DESC, _build)
    bundle = origin.export_bundle([entry.key], tmp_path / "signed.tar")
    victim = KernelCache(root=tmp_path / "victim", layers=(), allow_shared=shared)
    assert victim.import_bundle(bundle).imported == (entry.key,)
    mode = victim.lookup(entry.key).file("secret.bin").stat().st_mode & 0o777
    assert mode == (0o444 if shared else 0o400)


def test_a_signature_without_a_version_still_verifies(tmp_path, monkeypatch):
    """Entries signed before private files were signed: the old signature still verifies (docs/cache.md)."""
    from jitwarm.cache import signing

    monkeypatch.setenv("JITWARM_TRUST_KEY", KEY)
    origin = KernelCache(root=tmp_path / "origin", layers=())
    entry = origin.get_or_build(DESC, _build)
    bundle = origin.export_bundle([entry.key], tmp_path / "signed.tar")
    old = tmp_path / "old.tar"
    sig_name = f"v1/signatures/{entry.key[:2]}/{entry.key}.json"
    with tarfile.open(bundle) as src, tarfile.open(old, "w", format=tarfile.PAX_FORMAT) as dst:
        manifest = None
        for m in src:
            data = src.extractfile(m).read()
            if m.name.endswith("/entry.json"):
                manifest = data
            if m.name == sig_name:
                data = json.dumps({"key_id": signing.key_id(KEY.encode()), "hmac": signing._mac_v1(
                    KEY.encode(), entry.key, manifest, ["kernel.so"])}).encode()
                m.size = len(data)
            dst.addfile(m, io.BytesIO(data))
    assert KernelCache(root=tmp_path / "victim", layers=()).import_bundle(old).imported == (entry.key,)


def test_unpack_stream_applies_the_same_header_bounds(tmp_path, exported):
    """``unpack_stream`` (what an ``s3://`` bundle is read with) applies the same header bounds as it parses."""
    from jitwarm.cache.bundle import unpack_stream
    from jitwarm.cache.errors import CacheError

    raw = io.BytesIO(bomb_header("PAX header", 1 << 30) + bytes(4096))
    with pytest.raises(CacheError, match="claims a PAX header"):
        unpack_stream(raw, "s3://b/k.tar", tmp_path / "staging", max_file_bytes=1 << 30, max_bytes=1 << 34)
