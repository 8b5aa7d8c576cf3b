"""Bundles in the object store: ``export s3://...`` streams a multipart upload, ``import`` reads the body as a stream.

Against a real S3-protocol server (moto_server on loopback); the faults come from a proxy in front of it.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
import time

import pytest
from precompile_fixtures import TINY_FAST, jitwarm
from remote_fixtures import free_port
from s3_fixtures import faulty_store
from workers.cache_harness import artifact_bytes, cache_for, desc, make_builder

from jitwarm.cache import CacheError, KernelCache
from jitwarm.cache.errors import UsageError
from jitwarm.cache.remote import s3_bundle
from jitwarm.cache.remote.s3_bundle import BundleStoreError
from jitwarm.cache.signing import UntrustedEntry

pytest.importorskip("boto3")
pytest.importorskip("moto")
pytest_plugins = ["s3_fixtures"]

KEY = "fleet-key-0123456789abcdef"


@pytest.fixture
def origin(tmp_path):
    """A cache holding three entries (each two files)."""
    cache = cache_for(tmp_path / "origin")
    return cache, [cache.get_or_build(desc(n), make_builder(tmp_path / "c", n)).key for n in range(3)]


def _url(bucket, name: str = "kernels.tar") -> str:
    return f"s3://{bucket.name}/bundles/{name}"


def _published(root) -> list:
    return sorted(p.name for p in root.glob("v1/entries/*/*"))


def test_export_streams_to_the_store_and_import_reads_it_back_with_its_pin(bucket, tmp_path, origin):
    cache, keys = origin
    digest = cache.export_bundle_to_store(keys, _url(bucket))
    body = bucket.client.get_object(Bucket=bucket.name, Key="bundles/kernels.tar")["Body"].read()
    assert digest == hashlib.sha256(body).hexdigest()  # what sha256sum of a download prints
    with tarfile.open(fileobj=io.BytesIO(body)) as tar:
        assert tar.getnames()[0] == "bundle.json"

    dest = cache_for(tmp_path / "node")
    with pytest.raises(CacheError, match=f"has sha256 {digest}, not the pinned {'0' * 64}"):
        dest.import_bundle(_url(bucket), sha256="0" * 64)
    assert _published(tmp_path / "node") == [] and not (tmp_path / "node" / "v1" / "staging").exists()
    report = dest.import_bundle(_url(bucket), sha256=digest.upper())
    assert report.imported == tuple(sorted(keys)) and dest.verify().clean
    assert dest.lookup(keys[1]).file("kernel.bin").read_bytes() == artifact_bytes(1)


def test_a_large_bundle_goes_up_in_parts_and_a_gzip_one_round_trips(bucket, tmp_path, monkeypatch):
    monkeypatch.setattr(s3_bundle, "PART_BYTES", 5 << 20)  # S3's smallest part: three of them, not 64 MiB each
    big = b"".join(hashlib.sha256(str(i).encode()).digest() for i in range((11 << 20) // 32))  # incompressible
    cache = cache_for(tmp_path / "origin")
    key = cache.get_or_build(desc(7), make_builder(tmp_path / "c", 7, extra={"big.bin": big})).key
    digest = cache.export_bundle_to_store([key], _url(bucket))
    head = bucket.client.head_object(Bucket=bucket.name, Key="bundles/kernels.tar")
    assert head["ETag"].strip('"').endswith("-3") and head["ContentLength"] > 11 << 20  # a 3-part upload
    assert cache_for(tmp_path / "a").import_bundle(_url(bucket), sha256=digest).imported == (key,)

    cache.export_bundle_to_store([key], _url(bucket, "kernels.tar.gz"))
    body = bucket.read("bundles/kernels.tar.gz")
    assert body[:2] == b"\x1f\x8b"
    got = cache_for(tmp_path / "b")
    assert got.import_bundle(_url(bucket, "kernels.tar.gz")).imported == (key,)
    assert got.lookup(key).file("big.bin").read_bytes() == big


@pytest.fixture
def proxied(bucket, monkeypatch):
    """A proxy in front of the store, breaking requests for ``bundles/`` when told to; short timeouts."""
    yield from faulty_store(bucket, monkeypatch, "/bundles/")


@pytest.mark.parametrize("fault", [403, 500, "truncated", "down"], ids=str)
def test_each_store_fault_on_import_names_it_and_imports_nothing(bucket, tmp_path, origin, proxied, monkeypatch,
                                                                  fault):
    cache, keys = origin
    cache.export_bundle_to_store(keys, _url(bucket))
    if fault == "down":
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    else:
        proxied.fault = fault
    said = {403: "HTTP 403 AccessDenied", 500: "HTTP 500 InternalError", "truncated": "after|cut short",
            "down": "Could not connect"}[fault]
    with pytest.raises(BundleStoreError, match=f"cannot read bundle {_url(bucket)}: .*({said})") as failed:
        cache_for(tmp_path / "node").import_bundle(_url(bucket))
    assert failed.value.exit_code == 1 and "\n" not in str(failed.value)
    assert _published(tmp_path / "node") == [] and not (tmp_path / "node" / "v1" / "staging").exists()
    if fault != "down":
        proxied.fault = None
        with pytest.raises(UsageError, match=f"bundle {_url(bucket, 'none.tar')} does not exist"):
            cache_for(tmp_path / "node").import_bundle(_url(bucket, "none.tar"))


def test_a_bundle_read_that_trickles_ends_at_its_deadline_and_imports_nothing(bucket, tmp_path, origin, proxied,
                                                                              monkeypatch):
    cache, keys = origin
    cache.export_bundle_to_store(keys, _url(bucket))
    proxied.fault = "trickle"
    monkeypatch.setenv("JITWARM_REMOTE_MIN_RATE", "5000")
    started = time.monotonic()
    with pytest.raises(BundleStoreError, match=f"cannot read bundle {_url(bucket)}: slower than "
                                               "JITWARM_REMOTE_MIN_RATE=5000 bytes/s") as failed:
        cache_for(tmp_path / "node").import_bundle(_url(bucket))
    assert time.monotonic() - started < 15 and failed.value.exit_code == 1 and "\n" not in str(failed.value)
    assert _published(tmp_path / "node") == [] and not (tmp_path / "node" / "v1" / "staging").exists()


def test_a_store_fault_on_export_leaves_no_object_and_no_upload(bucket, tmp_path, origin, proxied, monkeypatch):
    cache, keys = origin
    monkeypatch.setattr(s3_bundle, "PART_BYTES", 5 << 20)
    big = b"".join(hashlib.sha256(str(i).encode()).digest() for i in range((6 << 20) // 32))
    keys.append(cache.get_or_build(desc(8), make_builder(tmp_path / "c", 8, extra={"big.bin": big})).key)
    proxied.fault = 403
    with pytest.raises(BundleStoreError, match=f"cannot write bundle {_url(bucket)}: .*HTTP 403"):
        cache.export_bundle_to_store(keys, _url(bucket))
    assert "Contents" not in bucket.client.list_objects_v2(Bucket=bucket.name, Prefix="bundles/")
    assert not bucket.client.list_multipart_uploads(Bucket=bucket.name).get("Uploads")


def test_a_signed_bundle_in_the_store_is_checked_like_a_file(bucket, tmp_path, origin, monkeypatch):
    cache, keys = origin
    monkeypatch.setenv("JITWARM_TRUST_KEY", KEY)
    cache = KernelCache(root=tmp_path / "origin", layers=())
    cache.export_bundle_to_store(keys, _url(bucket))
    assert KernelCache(root=tmp_path / "ok", layers=()).import_bundle(_url(bucket)).imported == tuple(sorted(keys))

    # The attack, in the bucket: one file replaced and its entry.json re-hashed; the signature left as it was.
    with tarfile.open(fileobj=io.BytesIO(bucket.read("bundles/kernels.tar"))) as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar if m.isreg()}
    base = f"v1/entries/{keys[0][:2]}/{keys[0]}"
    members[f"{base}/kernel.bin"] = evil = b"planted"
    doc = json.loads(members[f"{base}/entry.json"])
    doc["files"] = [{**r, "size": len(evil), "sha256": hashlib.sha256(evil).hexdigest()} if r["path"] == "kernel.bin"
                    else r for r in doc["files"]]
    members[f"{base}/entry.json"] = json.dumps(doc, indent=1, sort_keys=True).encode()
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o444
            tar.addfile(info, io.BytesIO(data))
    bucket.write("bundles/kernels.tar", out.getvalue())
    with pytest.raises(UntrustedEntry, match=f"entry {keys[0]} of bundle {_url(bucket)}: its signature does not"):
        KernelCache(root=tmp_path / "node", layers=()).import_bundle(_url(bucket))
    assert _published(tmp_path / "node") == []


def test_cli_export_and_prestart_through_the_store(bucket, tmp_path):
    root, url = tmp_path / "origin", _url(bucket)
    assert jitwarm("warm", *TINY_FAST, "--cache-dir", str(root), "--jobs", "1").returncode == 0
    export = jitwarm("export", *TINY_FAST, "--cache-dir", str(root), url)
    digest = hashlib.sha256(bucket.read("bundles/kernels.tar")).hexdigest()
    assert export.returncode == 0 and f"to {url} (sha256 {digest})" in export.stdout, export.stderr

    refused = jitwarm("prestart", *TINY_FAST, "--offline", "--cache-dir", str(tmp_path / "a"), "--bundle", url,
                      "--sha256", "0" * 64)
    assert refused.returncode == 4 and f"has sha256 {digest}, not the pinned" in refused.stderr, refused.stderr
    assert _published(tmp_path / "a") == []
    ready = jitwarm("prestart", *TINY_FAST, "--offline", "--json", "--cache-dir", str(tmp_path / "b"), "--bundle",
                    url, "--sha256", digest)
    assert ready.returncode == 0, ready.stderr
    assert json.loads(ready.stdout.strip().splitlines()[-1])["bundle"]["imported"] == 3

    missing = jitwarm("import", "--cache-dir", str(tmp_path / "c"), _url(bucket, "none.tar"))
    assert missing.returncode == 2 and missing.stderr.strip() == f"jitwarm: error: bundle {_url(bucket, 'none.tar')} " \
                                                                  "does not exist"
    down = jitwarm("import", "--cache-dir", str(tmp_path / "c"), url,
                   env={"AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}"})
    [line] = down.stderr.strip().splitlines()
    assert down.returncode == 1 and line.startswith(f"jitwarm: error: cannot read bundle {url}: "), down.stderr
    assert _published(tmp_path / "c") == []
