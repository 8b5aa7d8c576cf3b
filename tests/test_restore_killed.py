"""A restore killed part-way leaves nothing the next restore does not clear (issue #31, N9).

A real ``jitwarm prestart`` restoring a 256 MiB Inductor unit is SIGKILLed while it writes the unit's temporary
beside the destination; the temporary is there, then the next restore removes it, places the unit whole, and
leaves no ``.jitwarm-*`` behind. A temporary of another host (a shared filesystem) or of a live process is never
touched.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import jit_cache_trees as trees

from jitwarm.cache import KernelCache
from jitwarm.cache.locks import this_host
from jitwarm.kernels.libraries.jit_caches.backend import store
from jitwarm.kernels.libraries.jit_caches.census import library
from jitwarm.kernels.libraries.jit_caches.restore import sweep
from jitwarm.precompile.manifest import append_records, unit_record

SIZE = 256 << 20


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob(".jitwarm-*"))


def prestart(manifest: Path, cache: Path, dst: Path) -> subprocess.Popen:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(dst), "JITWARM_CACHE_DIR": str(cache)}
    return subprocess.Popen([sys.executable, "-m", "jitwarm", "prestart", "--manifest", str(manifest), "--offline"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_sigkilled_restore_leaves_only_what_the_next_restore_clears(tmp_path):
    src, dst, cache_dir = tmp_path / "src", tmp_path / "dst", tmp_path / "cache"
    trees.write(src / "ha" / "chabig.main.cpp", "extern \"C\" void kernel() {}")
    with open(trees.write(src / "ha" / "chabig.main.so", trees.ELF), "ab") as f:
        f.truncate(SIZE)  # sparse to write, whole to read: the restore copies and hashes every byte
    lib = library("inductor")
    manifest = tmp_path / "m.jsonl"
    append_records(manifest, [unit_record(store(lib, src, unit, files, KernelCache(root=cache_dir)))
                              for unit, files in lib.present(src).items()])
    proc = prestart(manifest, cache_dir, dst)
    deadline = time.monotonic() + 60
    while not leftovers(dst) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    proc.kill()
    proc.communicate()
    assert leftovers(dst), "the restore finished before it could be killed in the middle"
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
