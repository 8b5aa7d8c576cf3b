"""The fleet key on bundles and shared layers: exported signed, imported and loaded only signed.

The attack of issue #22: a bundle whose ``kernel.so`` was replaced and whose ``entry.json`` was re-hashed
verifies by content. With a key it is refused by its signature (exit 4); without one, ``--sha256`` pins it out.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile

import pytest
from precompile_fixtures import jitwarm

from jitwarm.cache import CacheError, KernelCache
from jitwarm.cache.signing import UntrustedEntry, key_id

KEY = "fleet-key-0123456789abcdef"
OTHER_KEY = "another-fleet-key-0123456789"
DESC = {"kind": "trust-test", "n": 1}
GOOD_SO = b"\x7fELF good kernel " * 64
EVIL_SO = b"\x7fELF library with a constructor " * 64


def _build(staging):
    (staging / "kernel.so").write_bytes(GOOD_SO)
    (staging / "kernel.so").chmod(0o755)
    (staging / "meta.json").write_text('{"n": 1}')


@pytest.fixture
def origin(tmp_path, monkeypatch):
    """A node's cache holding one entry (an executable kernel.so), and the fleet key set in this process."""
    monkeypatch.setenv("JITWARM_TRUST_KEY", KEY)
    cache = KernelCache(root=tmp_path / "origin", layers=())
    return cache, cache.get_or_build(DESC, _build)


def _members(path) -> dict[str, bytes]:
    with tarfile.open(path) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar if m.isreg()}


def _write_tar(path, members: dict[str, bytes]) -> None:
    with tarfile.open(path, "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o555 if name.endswith(".so") else 0o444
            tar.addfile(info, io.BytesIO(data))


def _tamper(bundle, key: str, out):
    """The attack: kernel.so replaced, entry.json re-hashed to match; the signature file left as it was."""
    members = _members(bundle)
    base = f"v1/entries/{key[:2]}/{key}"
    members[f"{base}/kernel.so"] = EVIL_SO
    doc = json.loads(members[f"{base}/entry.json"])
    for rec in doc["files"]:
        if rec["path"] == "kernel.so":
            rec["size"], rec["sha256"] = len(EVIL_SO), hashlib.sha256(EVIL_SO).hexdigest()
    members[f"{base}/entry.json"] = json.dumps(doc, indent=1, sort_keys=True).encode()
    _write_tar(out, members)
    return out


def _published(root) -> list:
    return list(root.glob("v1/entries/*/*"))


def test_export_signs_each_entry_beside_it_and_import_checks_it(tmp_path, origin):
    cache, entry = origin
    bundle = cache.export_bundle([entry.key], tmp_path / "kernels.tar")
    members = _members(bundle)
    sig = json.loads(members[f"v1/signatures/{entry.key[:2]}/{entry.key}.json"])
    assert sig["key_id"] == key_id(KEY.encode()) and len(sig["hmac"]) == 64
    names = list(members)
    assert names.index(f"v1/entries/{entry.key[:2]}/{entry.key}/entry.json") == len(names) - 2  # manifest, then sig

    dest = KernelCache(root=tmp_path / "node", layers=())
    assert dest.import_bundle(bundle).imported == (entry.key,)
    assert dest.lookup(entry.key).file("kernel.so").read_bytes() == GOOD_SO


def test_the_rehashed_bundle_is_refused_under_a_key_and_by_its_pin_without_one(tmp_path, origin, monkeypatch):
    cache, entry = origin
    bundle = cache.export_bundle([entry.key], tmp_path / "kernels.tar")
    digest = hashlib.sha256(bundle.read_bytes()).hexdigest()
    evil = _tamper(bundle, entry.key, tmp_path / "evil.tar")

    dest = KernelCache(root=tmp_path / "node", layers=())
    with pytest.raises(UntrustedEntry, match=f"entry {entry.key} of bundle .*evil.tar: its signature does not "
                                             "verify") as refused:
        dest.import_bundle(evil)
    assert refused.value.exit_code == 4 and not _published(tmp_path / "node")

    monkeypatch.delenv("JITWARM_TRUST_KEY")  # no key: content hashes pass it, the pin does not
    unkeyed = KernelCache(root=tmp_path / "unkeyed", layers=())
    with pytest.raises(CacheError, match=f"not the pinned {digest}"):
        unkeyed.import_bundle(evil, sha256=digest)
    assert not _published(tmp_path / "unkeyed")
    assert unkeyed.import_bundle(evil).imported == (entry.key,)  # what the pin is for: unpinned, it verifies


def test_unsigned_or_other_key_bundles_are_refused_under_a_key(tmp_path, origin, monkeypatch):
    cache, entry = origin
    monkeypatch.delenv("JITWARM_TRUST_KEY")
    unsigned = KernelCache(root=tmp_path / "origin", layers=()).export_bundle([entry.key], tmp_path / "u.tar")
    assert not [n for n in _members(unsigned) if "signatures" in n]
    monkeypatch.setenv("JITWARM_TRUST_KEY", OTHER_KEY)
    other = KernelCache(root=tmp_path / "origin", layers=()).export_bundle([entry.key], tmp_path / "o.tar.gz")

    monkeypatch.setenv("JITWARM_TRUST_KEY", KEY)
    for bundle, why in ((unsigned, "is not signed, and a fleet key is configured"), (other, "signed with another key")):
        with pytest.raises(UntrustedEntry, match=why):
            KernelCache(root=tmp_path / "node", layers=()).import_bundle(bundle)
        assert not _published(tmp_path / "node")


def test_cli_import_of_the_rehashed_bundle_is_one_line_exit_4(tmp_path, origin):
    cache, entry = origin
    evil = _tamper(cache.export_bundle([entry.key], tmp_path / "kernels.tar"), entry.key, tmp_path / "evil.tar")
    proc = jitwarm("import", "--cache-dir", str(tmp_path / "node"), str(evil), env={"JITWARM_TRUST_KEY": KEY})
    assert proc.returncode == 4, proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("jitwarm: error: ") and f"entry {entry.key} of bundle" in line and "does not verify" in line
    assert not _published(tmp_path / "node")


def _layer(tmp_path, bundle, name="layer"):
    """A shared layer made the documented way: ``tar xf bundle.tar -C /opt/layer``."""
    layer = tmp_path / name
    layer.mkdir()
    with tarfile.open(bundle) as tar:
        tar.extractall(layer, filter="fully_trusted")
    return layer


def test_a_shared_layer_serves_only_signed_entries_under_a_key(tmp_path, origin, monkeypatch):
    cache, entry = origin
    signed = _layer(tmp_path, cache.export_bundle([entry.key], tmp_path / "kernels.tar"))
    evil = _layer(tmp_path, _tamper(tmp_path / "kernels.tar", entry.key, tmp_path / "evil.tar"), "evil")
    monkeypatch.delenv("JITWARM_TRUST_KEY")
    unsigned = _layer(tmp_path, KernelCache(root=tmp_path / "origin", layers=()).export_bundle(
        [entry.key], tmp_path / "u.tar"), "unsigned")

    def node(layer, **kw):
        return KernelCache(root=tmp_path / f"node-{layer.name}", layers=[layer], allow_shared=True, **kw)

    assert node(unsigned).lookup(entry.key).path.is_relative_to(unsigned)  # no key: content is the check
    monkeypatch.setenv("JITWARM_TRUST_KEY", KEY)
    assert node(signed).lookup(entry.key).path.is_relative_to(signed)
    for layer, why in ((evil, "its signature does not verify"), (unsigned, "is not signed")):
        with pytest.raises(UntrustedEntry, match=f"entry {entry.key} of shared layer {layer}.*{why}"):
            node(layer).lookup(entry.key)  # what the hook calls (precompile/hook.py) before any dlopen
        with pytest.raises(UntrustedEntry):
            node(layer).get_or_build(DESC, _build)
    # A layer only this user (or root) can write is as trusted as the node's own root.
    assert KernelCache(root=tmp_path / "mine", layers=[unsigned]).lookup(entry.key) is not None


def test_cli_verify_of_an_untrusted_shared_layer_is_exit_4(tmp_path, origin):
    cache, entry = origin
    cache.export_bundle([entry.key], tmp_path / "kernels.tar")
    evil = _layer(tmp_path, _tamper(tmp_path / "kernels.tar", entry.key, tmp_path / "evil.tar"), "evil")
    env = {"JITWARM_TRUST_KEY": KEY, "JITWARM_CACHE_PATH": str(evil), "JITWARM_ALLOW_SHARED": "1"}
    proc = jitwarm("verify", "--all", "--cache-dir", str(tmp_path / "node"), env=env)
    assert proc.returncode == 4, (proc.stdout, proc.stderr)
    assert f"entry {entry.key} of shared layer {evil}" in proc.stderr and proc.stderr.count("\n") == 1


def test_the_hook_refuses_a_shared_layers_unsigned_entry_before_loading_anything(tmp_path, monkeypatch):
    """The plan's entries planted in a shared layer, unsigned: the hook's lookup raises, no load is tried.

    The device is a stand-in (no GPU, no torch); the entries' files are not kernels, which does not matter:
    nothing reaches the loader (``dispatch.ensure_loaded`` is replaced by a recorder to show it).
    """
    from types import SimpleNamespace

    from precompile_fixtures import TINY

    from jitwarm.kernels import dispatch
    from jitwarm.kernels.artifacts import artifact
    from jitwarm.precompile import CaptureHook, ServingConfig, WarmPlan

    plan = WarmPlan.build(ServingConfig.from_args(TINY))
    layer = tmp_path / "layer"
    planter = KernelCache(root=layer, layers=())
    for spec in plan.specs:
        planter.get_or_build(artifact(spec).description, _build)
    loads = []
    monkeypatch.setattr(dispatch, "ensure_loaded",
                        lambda spec, **kw: loads.append(spec) or SimpleNamespace(preload=lambda: None))
    device = SimpleNamespace(target="cpu", synchronize=lambda: None)

    def hook():
        cache = KernelCache(root=tmp_path / "node", layers=[layer], allow_shared=True)
        return CaptureHook(plan, cache=cache, device=device, policy="strict")

    unkeyed = hook()
    assert unkeyed().loaded == len(plan.specs) and len(loads) == len(plan.specs)  # no key: loaded (the control)
    unkeyed.close()
    loads.clear()
    monkeypatch.setenv("JITWARM_TRUST_KEY", KEY)
    keyed = hook()  # a new process's cache: the layer's entries come from this host's stamps, checked all the same
    with pytest.raises(UntrustedEntry, match=f"of shared layer {layer} is not signed"):
        keyed()
    assert loads == [] and not keyed.ready
