"""The restore receipt: prestart writes where it placed each family, and a server's plugin that looks elsewhere (or
at a directory of the same name that is not the one written) names both paths: a warning in its log and ledger,
an error under ``JITWARM_STRICT=1``. Real prestarts and a real plugin start (tests/workers/receipt_worker.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from precompile_fixtures import WORKERS, jitwarm
from test_bundle_manifest import UNITS, node, staged  # noqa: F401 - the fixture

from jitwarm.kernels.libraries.jit_caches import receipt


@pytest.fixture
def restored(staged, tmp_path):  # noqa: F811
    """A node restored by ``prestart --manifest``: (its environment, the receipt's JSON)."""
    manifest, cache_dir, _ = staged
    env = node(tmp_path, "node")
    proc = jitwarm("prestart", "--manifest", str(manifest), "--cache-dir", str(cache_dir), "--offline", env=env)
    assert proc.returncode == 0, proc.stderr
    dest = env["TORCHINDUCTOR_CACHE_DIR"]
    assert f"jitwarm: inductor: {UNITS} unit(s) in {dest} (placed {UNITS}" in proc.stderr
    assert f"jitwarm: restore receipt: {cache_dir / receipt.RECEIPT}" in proc.stderr
    env["JITWARM_CACHE_DIR"] = str(cache_dir)  # where the receipt is: the server's cache root
    return env, json.loads((cache_dir / receipt.RECEIPT).read_text())


def test_prestart_writes_what_it_placed_and_where(restored):
    env, doc = restored
    fam = doc["families"]["inductor"]
    assert fam["root"] == env["TORCHINDUCTOR_CACHE_DIR"] and fam["placed"] == UNITS and fam["under"] == ""
    assert len(fam["files"]) == UNITS and all((Path(fam["root"]) / rel).is_file() for rel in fam["files"])
    assert doc["v"] == receipt.VERSION and doc["pid"] > 0


def start(env: dict[str, str], **more: str) -> tuple[dict, str]:
    """A plugin's start and ledger report in a process of ``env``: (its JSON line, its log)."""
    proc = subprocess.run([sys.executable, str(WORKERS / "receipt_worker.py")], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **env, **more})
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def test_a_server_that_looks_where_the_units_are_says_nothing(restored, tmp_path):
    env, _ = restored
    out, log = start(env, JITWARM_LEDGER=str(tmp_path / "ledger.json"))
    assert out["error"] is None and out["ledger"]["restored_elsewhere"] == []
    assert "jitwarm: restore: " not in log


def test_a_server_whose_library_looks_elsewhere_names_both_paths(restored, tmp_path):
    env, doc = restored
    placed, elsewhere = env["TORCHINDUCTOR_CACHE_DIR"], str(tmp_path / "server-tmp" / "torchinductor_root")
    out, log = start(env, TORCHINDUCTOR_CACHE_DIR=elsewhere, JITWARM_LEDGER=str(tmp_path / "ledger.json"))
    assert out["error"] is None  # a warning by default: the server starts
    assert out["ledger"]["restored_elsewhere"] == [{"family": "inductor", "placed_in": placed, "looks_in": elsewhere,
                                                    "found": 0, "restored": UNITS}]
    said = [line for line in log.splitlines() if "jitwarm: restore: inductor: " in line]
    assert said and all(placed in line and elsewhere in line for line in said), log
    assert log.count("WARNING jitwarm: restore: inductor") == 2  # at the start, and again with the ledger's report


def test_a_directory_of_the_same_name_that_is_not_the_one_written_is_named(restored, tmp_path):
    """Two containers' ``/tmp/torchinductor_root``: one path, two directories. The server finds none of the units."""
    env, _ = restored
    placed = Path(env["TORCHINDUCTOR_CACHE_DIR"])
    shutil.move(placed, tmp_path / "the-init-containers")
    placed.mkdir()
    out, log = start(env, JITWARM_LEDGER=str(tmp_path / "ledger.json"))
    gone = out["ledger"]["restored_elsewhere"]
    assert [(g["placed_in"], g["looks_in"], g["found"]) for g in gone] == [(str(placed), str(placed), 0)]
    assert f"this server looks there but finds 0 of them: {placed} here is not the directory" in log


def test_under_strict_a_restore_elsewhere_stops_the_start(restored, tmp_path):
    env, _ = restored
    elsewhere = str(tmp_path / "server-tmp")
    out, _ = start(env, TORCHINDUCTOR_CACHE_DIR=elsewhere, JITWARM_STRICT="1",
                   JITWARM_LEDGER=str(tmp_path / "ledger.json"))
    kind, message = out["error"]
    assert kind == "RestoredElsewhere" and env["TORCHINDUCTOR_CACHE_DIR"] in message and elsewhere in message
    assert "JITWARM_STRICT=1" in message


def test_a_family_restored_under_another_server_is_not_this_ones(tmp_path):
    doc = {"v": 1, "families": {"inductor": {"root": str(tmp_path / "a"), "under": "sglang", "files": ["x/y.py"]}}}
    assert receipt.elsewhere(doc, {}, "vllm", {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "b")}) == []
    found = receipt.elsewhere(doc, {}, "sglang", {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "b")})
    assert [(f.placed_in, f.looks_in) for f in found] == [(str(tmp_path / "a"), str(tmp_path / "b"))]
    assert receipt.read(tmp_path) is None  # none written: nothing to check
    (tmp_path / receipt.RECEIPT).write_text("{not json")
    assert receipt.read(tmp_path) is None
