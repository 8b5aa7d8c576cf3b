"""An ``s3://`` bundle is read under the same header bounds as a file, against a real S3-protocol server
(moto_server on loopback): a header bomb in the object is exit 4 with one line under a 512 MiB address space."""

from __future__ import annotations

import pytest
from test_hardening4_bundle import bomb_header, import_limited, nothing_imported, refused, zeros_gz

from jitwarm.cache import KernelCache

pytest.importorskip("boto3")
pytest.importorskip("moto")
pytest_plugins = ["s3_fixtures"]


def test_a_header_bomb_in_the_bucket_is_refused_as_it_is_parsed(bucket, tmp_path):
    bomb = tmp_path / "bomb.tar.gz"
    zeros_gz(bomb, bomb_header("GNU long name", 1 << 30), 1024)
    bucket.write("bundles/bomb.tar.gz", bomb.read_bytes())
    url = f"s3://{bucket.name}/bundles/bomb.tar.gz"
    proc = import_limited(url, tmp_path / "root")
    refused(proc, f"refusing bundle {url}", "claims a GNU long name")
    nothing_imported(tmp_path / "root")


def test_a_good_bundle_in_the_bucket_imports_under_the_same_cap(bucket, tmp_path):
    origin = KernelCache(root=tmp_path / "origin", layers=())
    entry = origin.get_or_build({"kind": "hardening4-s3"}, lambda s: (s / "kernel.so").write_bytes(b"\x7fELF"))
    url = f"s3://{bucket.name}/bundles/good.tar.gz"
    origin.export_bundle_to_store([entry.key], url)
    proc = import_limited(url, tmp_path / "root")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "root" / "v1" / "entries" / entry.key[:2] / entry.key / "kernel.so").is_file()
