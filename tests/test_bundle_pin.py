"""`prestart --bundle F --sha256 DIGEST`: a pinned bundle file, refused before anything is imported."""

from __future__ import annotations

import hashlib
import json

from precompile_fixtures import TINY_FAST, jitwarm


def test_export_reports_the_digest_prestart_pins(tmp_path):
    root, bundle = tmp_path / "origin", tmp_path / "kernels.tar"
    assert jitwarm("warm", *TINY_FAST, "--cache-dir", str(root), "--jobs", "1").returncode == 0
    export = jitwarm("export", *TINY_FAST, "--cache-dir", str(root), str(bundle))
    digest = hashlib.sha256(bundle.read_bytes()).hexdigest()  # what sha256sum prints
    assert export.returncode == 0 and f"(sha256 {digest})" in export.stdout, export.stdout

    wrong = "0" * 64
    refused = jitwarm("prestart", *TINY_FAST, "--offline", "--cache-dir", str(tmp_path / "a"), "--bundle", str(bundle),
                      "--sha256", wrong)
    assert refused.returncode == 4, refused.stderr
    [line] = refused.stderr.strip().splitlines()
    assert line.startswith("jitwarm: error: ") and f"has sha256 {digest}, not the pinned {wrong}" in line
    assert not list((tmp_path / "a").glob("v1/entries/*/*"))  # nothing imported

    pinned = jitwarm("prestart", *TINY_FAST, "--offline", "--json", "--cache-dir", str(tmp_path / "b"), "--bundle",
                     str(bundle), "--sha256", digest.upper())
    assert pinned.returncode == 0, pinned.stderr
    report = json.loads(pinned.stdout.strip().splitlines()[-1])
    assert report["bundle"]["supplied"] == 3 and report["bundle"]["imported"] == 3, report

    bad = jitwarm("prestart", *TINY_FAST, "--cache-dir", str(tmp_path / "c"), "--bundle", str(bundle),
                  "--sha256", "abc")
    assert bad.returncode == 2 and "64 hex digits" in bad.stderr and bad.stderr.count("\n") <= 2
