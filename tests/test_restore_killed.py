"""A process killed part-way leaves nothing the next one does not clear (issue #31, N9).

A real ``jitwarm prestart`` restoring a 256 MiB Inductor unit is SIGKILLed while it writes the unit's temporary
beside the destination (stopped there by the test, with the unit's bytes written and neither fsync nor rename
done); the temporary is there, then the next restore removes it, places the unit whole, and leaves no
``.jitwarm-*`` behind. A temporary of another host (a shared filesystem) or of a live process is never
touched. The same holds for what a process keeps in $TMPDIR until it exits (:func:`.process_scratch`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jit_cache_trees as trees
import pytest

from jitwarm.cache import KernelCache, locks
from jitwarm.cache.locks import this_host
from jitwarm.kernels.libraries.jit_caches.backend import store
from jitwarm.kernels.libraries.jit_caches.census import library
from jitwarm.kernels.libraries.jit_caches.restore import sweep
from jitwarm.precompile.manifest import append_records, unit_record

SIZE = 256 << 20


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob(".jitwarm-*"))


#: ``jitwarm`` that stops itself (SIGSTOP) when the restore first syncs a file it wrote: the temporary is whole
#: and not yet renamed. Polling for it raced a restore that finished between two polls on a busy box.
STOPS_MID_RESTORE = """
import os, signal, sys, types
from jitwarm.kernels.libraries.jit_caches import restore
from jitwarm.precompile.cli import main

def fsync(fd):
    os.kill(os.getpid(), signal.SIGSTOP)
    os.fsync(fd)

restore.os = types.SimpleNamespace(**{**vars(os), "fsync": fsync})
sys.exit(main(sys.argv[1:]))
"""


def prestart(manifest: Path, cache: Path, dst: Path, *, stop: bool = False) -> subprocess.Popen:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(dst), "JITWARM_CACHE_DIR": str(cache)}
    program = ["-c", STOPS_MID_RESTORE] if stop else ["-m", "jitwarm"]
    return subprocess.Popen([sys.executable, *program, "prestart", "--manifest", str(manifest), "--offline"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def stopped(pid: int) -> bool:
    """Whether ``pid`` is stopped by a signal (its state in /proc/<pid>/stat)."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        return f.read().rpartition(")")[2].split()[0] == "T"


def test_a_sigkilled_restore_leaves_only_what_the_next_restore_clears(tmp_path):
    src, dst, cache_dir = tmp_path / "src", tmp_path / "dst", tmp_path / "cache"
    trees.write(src / "ha" / "chabig.main.cpp", "extern \"C\" void kernel() {}")
    with open(trees.write(src / "ha" / "chabig.main.so", trees.ELF), "ab") as f:
        f.truncate(SIZE)  # sparse to write, whole to read: the restore copies and hashes every byte
    lib = library("inductor")
    manifest = tmp_path / "m.jsonl"
    append_records(manifest, [unit_record(store(lib, src, unit, files, KernelCache(root=cache_dir)))
                              for unit, files in lib.present(src).items()])
    proc = prestart(manifest, cache_dir, dst, stop=True)
    deadline = time.monotonic() + 120
    while proc.poll() is None and not stopped(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert proc.poll() is None and stopped(proc.pid), proc.communicate()
    proc.kill()
    proc.communicate()
    assert leftovers(dst), "SIGKILLed in the middle of the restore, it left no temporary"
    assert not (dst / "ha" / "chabig.main.so").exists()  # never half a unit where Inductor looks

    again = prestart(manifest, cache_dir, dst)
    out, err = again.communicate(timeout=120)
    assert again.returncode == 0, err
    assert leftovers(dst) == []
    assert (dst / "ha" / "chabig.main.so").stat().st_size == SIZE


def test_another_hosts_or_a_live_processs_temporaries_are_left_alone(tmp_path):
    folder = tmp_path / "d"
    folder.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    mine_dead = f".jitwarm-x.so~{this_host()}~{int(dead.stdout)}~abcd1234.tmp"
    mine_alive = f".jitwarm-y.so~{this_host()}~{os.getpid()}~abcd1234.tmp"
    theirs = f".jitwarm-z.so~another-host~{int(dead.stdout)}~abcd1234.tmp"
    for name in (mine_dead, mine_alive, theirs):
        (folder / name).write_bytes(b"part of a unit")
    (folder / f".jitwarm-stage~{this_host()}~{int(dead.stdout)}~ef").mkdir()  # a killed rename-mode stage
    assert sorted(sweep(folder)) == sorted([mine_dead, f".jitwarm-stage~{this_host()}~{int(dead.stdout)}~ef"])
    assert sorted(p.name for p in folder.iterdir()) == sorted([mine_alive, theirs])


@pytest.mark.parametrize("user", ["triton manager", "dlopen links"])
def test_the_scratch_of_a_killed_process_is_removed_by_the_next_of_this_host(user, tmp_path, monkeypatch):
    """What a process keeps in $TMPDIR until it exits stays when it is killed: the copies jitwarm's Triton manager
    hands Triton (a server in a crash loop filled $TMPDIR with them), the links a rebuilt library is dlopened
    through. The next process of this host to make its own removes those of dead processes, and only those: a
    live process's, another host's on a shared $TMPDIR, and a link planted under such a name, stay."""
    from jitwarm.kernels import tvm_backend
    from jitwarm.kernels.libraries.triton import cache as triton_cache

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(locks, "_swept", set())  # this test process swept $TMPDIR before, when it was another
    prefix = "jitwarm-triton-" if user == "triton manager" else "jitwarm-dlopen-"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True).stdout.strip()
    stale, live, other = (tmp_path / f"{prefix}{host}~{pid}~x1" for host, pid in (
        (this_host(), dead), (this_host(), os.getppid()), ("another-host", dead)))
    for folder in (stale, live, other):
        folder.mkdir()
        (folder / "kernel.so").write_bytes(b"\x7fELF")
    victim = tmp_path / "victim"  # a link named as a dead process's scratch is not followed
    victim.mkdir()
    (victim / "keep").write_bytes(b"")
    planted = tmp_path / f"{prefix}{this_host()}~{dead}~planted"
    planted.symlink_to(victim)
    if user == "triton manager":
        made = triton_cache.CacheManager("ab" * 32)._scratch_dir()
    else:  # a library file replaced after it was opened: the next dlopen goes through a link
        monkeypatch.setattr(tvm_backend, "_opened", {})
        monkeypatch.setattr(tvm_backend, "_links", [])
        library = tmp_path / "entry" / "kernel.so"
        library.parent.mkdir()
        library.write_bytes(b"one")
        assert tvm_backend._dlopen_name(str(library)) == str(library)
        (tmp_path / "entry" / "rebuilt.so").write_bytes(b"two")
        (tmp_path / "entry" / "rebuilt.so").replace(library)
        made = Path(tvm_backend._dlopen_name(str(library))).parent
    assert not stale.exists() and live.exists() and other.exists()
    assert planted.is_symlink() and (victim / "keep").exists()
    assert made.parent == tmp_path and made.name.startswith(f"{prefix}{this_host()}~{os.getpid()}~")
