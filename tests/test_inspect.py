"""``jitwarm inspect BUNDLE``: each entry's family, size, fingerprint and where it would land here, read without
importing anything (text and ``--json``); a file that is no bundle is refused as an import refuses it."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

from precompile_fixtures import jitwarm, json_out
from test_bundle_manifest import UNITS, node, staged  # noqa: F401 - the fixture

from jitwarm.cache import KernelCache


def exported(staged_, tmp_path: Path) -> Path:
    manifest, cache_dir, _ = staged_
    bundle = tmp_path / "kernels.tar.gz"
    assert jitwarm("export", "--manifest", str(manifest), "--cache-dir", str(cache_dir), str(bundle)).returncode == 0
    return bundle


def test_inspect_lists_each_unit_with_its_size_fingerprint_and_destination_here(staged, tmp_path):  # noqa: F811
    bundle = exported(staged, tmp_path)
    env = node(tmp_path, "node")
    proc = jitwarm("inspect", "--json", str(bundle), env=env)
    assert proc.returncode == 0, proc.stderr
    doc = json_out(proc)
    assert doc["entries"] == UNITS == len(doc["units"]) and doc["about"] is True
    here = Path(env["TORCHINDUCTOR_CACHE_DIR"])
    with tarfile.open(bundle) as tar:  # the sizes are the entries' stored files, entry.json included
        sizes = {}
        for m in tar.getmembers():
            if m.name.startswith("v1/entries/"):
                key = m.name.split("/")[3]
                sizes[key] = sizes.get(key, 0) + m.size
    for unit in doc["units"]:
        assert unit["family"] == "inductor" and unit["size"] == sizes[unit["key"]] > 0
        assert {"torch", "cxx", "arch"} <= set(unit["fingerprint"])
        assert unit["here"] == str(here / unit["unit"])
    assert doc["made"]["environment"]["TORCHINDUCTOR_CACHE_DIR"] == staged[2]["TORCHINDUCTOR_CACHE_DIR"]
    assert not Path(env["JITWARM_CACHE_DIR"]).exists() and not here.exists()  # nothing imported, nothing placed

    text = jitwarm("inspect", str(bundle), env=env)
    assert text.returncode == 0, text.stderr
    assert f"bundle {bundle}: {UNITS} entries" in text.stdout and f"its manifest names {UNITS} records" in text.stdout
    assert text.stdout.count("  inductor ") == UNITS and text.stdout.count(f"here: {here}/") == UNITS
    assert "fingerprint: arch=" in text.stdout


def test_inspect_says_an_older_bundle_carries_no_manifest(staged, tmp_path):  # noqa: F811
    _, cache_dir, _ = staged
    keys = [p.name for p in (cache_dir / "v1" / "entries").glob("*/*")]
    old = KernelCache(cache_dir).export_bundle(keys, tmp_path / "old.tar")
    proc = jitwarm("inspect", str(old))
    assert proc.returncode == 0, proc.stderr
    assert "no manifest" in proc.stdout and proc.stdout.count("  inductor ") == UNITS


def test_inspect_refuses_what_is_no_bundle(tmp_path):
    junk = tmp_path / "junk.tar"
    junk.write_bytes(b"not a tar at all" * 100)
    bad = jitwarm("inspect", str(junk))
    assert bad.returncode == 4 and bad.stderr.startswith("jitwarm: error: cannot read bundle"), bad.stderr
    assert bad.stderr.count("\n") == 1
    missing = jitwarm("inspect", str(tmp_path / "nope.tar"))
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    link = tmp_path / "link.tar"
    with tarfile.open(link, "w") as tar:
        info = tarfile.TarInfo("v1/entries/ab/" + "ab" * 32 + "/x")
        info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(info)
    linked = jitwarm("inspect", "--json", str(link))
    assert linked.returncode == 4 and "symbolic link" in linked.stderr
    assert json.loads(linked.stdout or "null") is None  # no document on a refusal: the error is on stderr
