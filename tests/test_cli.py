"""The jitwarm CLI end to end in subprocesses: exit codes, repair, bundles, one-line errors."""

import json
import shutil

import pytest
from precompile_fixtures import SMALL, TINY, jitwarm, json_out


@pytest.fixture
def cache_copy(prestarted, tmp_path):
    root, _ = prestarted
    copy = tmp_path / "cache"
    shutil.copytree(root, copy)
    return copy


def so_files(root):
    return sorted(root.glob("v1/entries/*/*/*.so"))


def overwrite(path, data):
    """Rewrite a sealed (read-only) entry file as its owner could: entries are 0o444, not immutable."""
    path.chmod(0o644)
    path.write_bytes(data)


def test_status_of_a_complete_plan(prestarted):
    root, _ = prestarted
    proc = jitwarm("status", *SMALL, "--cache-dir", str(root), "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert (data["present"], data["missing"], data["corrupt"], data["complete"]) == (7, 0, 0, True)
    assert data["size_bytes"] > 0


def test_status_of_an_empty_cache_lists_missing(tmp_path):
    proc = jitwarm("status", *TINY, "--cache-dir", str(tmp_path / "c"))
    assert proc.returncode == 5  # not ready: status is a readiness check
    assert "0/3 present, 3 missing" in proc.stdout and proc.stdout.count("  missing: ") == 3


def test_verify_exits_4_on_corruption_repair_quarantines_and_warm_rebuilds(cache_copy):
    victim = so_files(cache_copy)[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    overwrite(victim, bytes(data))
    proc = jitwarm("verify", *SMALL, "--cache-dir", str(cache_copy), "--repair")
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert "1 corrupt" in proc.stdout and "corrupt (quarantined)" in proc.stderr
    assert list(cache_copy.glob("v1/quarantine/*"))
    repaired = jitwarm("warm", *SMALL, "--cache-dir", str(cache_copy), "--json")
    assert repaired.returncode == 0, repaired.stderr
    assert json.loads(repaired.stdout)["totals"] == {"built": 1, "hit": 6, "waited": 0, "failed": 0}
    assert jitwarm("verify", *SMALL, "--cache-dir", str(cache_copy)).returncode == 0


def test_a_corrupt_entry_is_reported_once_with_its_reason(cache_copy):
    victim = so_files(cache_copy)[0]
    overwrite(victim, b"flipped")
    for argv in (["verify"], ["verify", "--repair"]):
        proc = jitwarm(*argv, *SMALL, "--cache-dir", str(cache_copy))
        about = [line for line in proc.stderr.splitlines() if victim.parent.name in line]
        assert proc.returncode == 4 and len(about) == 1, proc.stderr  # not the cache's log line, then ours
        assert about[0].startswith("jitwarm: corrupt (") and "size 7" in about[0]
    overwrite(so_files(cache_copy)[0], b"flipped")
    status = jitwarm("status", *SMALL, "--cache-dir", str(cache_copy))
    assert status.returncode == 4 and status.stderr == "" and "  corrupt: " in status.stdout


def test_verify_all_checks_every_entry(cache_copy):
    overwrite(so_files(cache_copy)[-1], b"truncated")
    proc = jitwarm("verify", *TINY, "--all", "--cache-dir", str(cache_copy), "--json")
    assert proc.returncode == 4
    data = json.loads(proc.stdout)
    assert data["ok"] == 6 and len(data["corrupt"]) == 1


def test_export_then_prestart_from_bundle_builds_nothing(prestarted, tmp_path):
    root, _ = prestarted
    bundle = tmp_path / "kernels.tar"
    proc = jitwarm("export", *SMALL, "--cache-dir", str(root), str(bundle))
    assert proc.returncode == 0, proc.stderr
    assert "exported 7 entries" in proc.stdout
    fresh = tmp_path / "elsewhere" / "cache"
    ready = jitwarm("prestart", *SMALL, "--cache-dir", str(fresh), "--bundle", str(bundle), "--json")
    assert ready.returncode == 0, ready.stderr
    data = json_out(ready)
    assert data["ready"] and data["totals"] == {"built": 0, "hit": 7, "waited": 0, "failed": 0}


def test_prestart_offline_says_it_does_not_consult_the_remote_tier(prestarted, tmp_path):
    """--offline reads the bundle and the local cache only, and says so (issue #31): here the remote is a port
    nothing listens on, and the node is ready from its bundle all the same."""
    root, _ = prestarted
    bundle = tmp_path / "kernels.tar"
    assert jitwarm("export", *SMALL, "--cache-dir", str(root), str(bundle)).returncode == 0
    ready = jitwarm("prestart", *SMALL, "--cache-dir", str(tmp_path / "node"), "--bundle", str(bundle), "--offline",
                    "--remote", "redis://:s3cret@127.0.0.1:9/0")
    assert ready.returncode == 0, ready.stderr
    assert "--offline: the remote tier redis://:***@127.0.0.1:9/0 is not consulted" in ready.stderr
    assert "s3cret" not in ready.stderr


def test_import_command_and_corrupt_bundle_exit_4(prestarted, tmp_path):
    root, _ = prestarted
    bundle = tmp_path / "k.tar"
    assert jitwarm("export", *SMALL, "--cache-dir", str(root), str(bundle)).returncode == 0
    proc = jitwarm("import", str(bundle), "--cache-dir", str(tmp_path / "a"), "--json")
    assert proc.returncode == 0 and len(json.loads(proc.stdout)["imported"]) == 7
    data = bytearray(bundle.read_bytes())
    at = data.index(b"\x7fELF") + 4000  # inside the first shared library's bytes
    data[at] ^= 0xFF
    bundle.write_bytes(bytes(data))
    bad = jitwarm("import", str(bundle), "--cache-dir", str(tmp_path / "b"))
    assert bad.returncode == 4 and bad.stderr.startswith("jitwarm: error: ") and bad.stderr.count("\n") == 1
    assert not list((tmp_path / "b").glob("v1/entries/*/*"))


def test_prune_by_size(cache_copy):
    proc = jitwarm("prune", "--max-bytes", "1", "--cache-dir", str(cache_copy), "--json")
    assert proc.returncode == 0, proc.stderr
    assert len(json.loads(proc.stdout)["removed"]) == 7
    assert not so_files(cache_copy)


@pytest.mark.parametrize("argv, code, message", [
    (["warm", *TINY, "--jobs", "0"], 2, "invalid --jobs '0': an integer from 1 to 1024"),
    (["import", "/no/such/bundle.tar"], 2, "bundle /no/such/bundle.tar does not exist"),
    (["prune"], 2, "prune needs --max-bytes"),
    (["prune", "--max-bytes", "lots"], 2, "invalid size 'lots'"),
    (["export", *TINY, "out.tar"], 5, "is not complete"),
    (["warm", "--cuda-graph-max-bs", "-1"], 2, "--cuda-graph-max-bs must be a positive integer"),
    (["frobnicate"], 2, "invalid choice: 'frobnicate'"),
])
def test_user_errors_are_one_line_with_exit_code(tmp_path, argv, code, message):
    proc = jitwarm(*argv, "--cache-dir", str(tmp_path / "c")) if argv[0] != "frobnicate" else jitwarm(*argv)
    assert proc.returncode == code
    assert proc.stderr.startswith("jitwarm: error: ") and proc.stderr.count("\n") == 1
    assert message in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("argv, message", [
    (["prestart", "--tp", "2", "--"], "no server command line after --"),  # `-- $SERVER` with SERVER unset
    (["capture", "--"], "no server command line after --"),
    (["plan", "--tp", "2", "python", "-m", "sglang.launch_server"], "put the server's command line after --"),
    (["prestart", "--sha256", "a" * 64, *TINY], "--sha256 pins the bundle given with --bundle"),
    (["warm", "--remote-prefix", "", *TINY], "--remote-prefix is empty"),
    (["import", "/proc/self/mem"], "is a kernel interface, not a file"),
    (["import", "b" * 5000 + ".tar"], "a path longer than a filesystem takes"),
    (["warm", "--cache-dir", "/tmp/" + "c" * 300, *TINY], "a path longer than a filesystem takes"),
    (["warm", "--cache-dir", "/proc/jitwarm-cache", *TINY], "cannot create the cache root /proc/jitwarm-cache"),
    (["prestart", "--cache-dir", "/proc/jitwarm-cache", *TINY], "pass --cache-dir DIR"),
])
def test_the_operators_rough_edges_are_one_line_and_exit_2(argv, message):
    """Issue #31's N10 and newcomer's items: each used to be silent, a traceback, exit 1 or exit 4."""
    proc = jitwarm(*argv)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("jitwarm: error: ") and proc.stderr.count("\n") == 1
    assert message in proc.stderr, proc.stderr


def test_export_json_prints_one_json_object(tmp_path, prestarted):
    root, _ = prestarted
    proc = jitwarm("export", *SMALL, "--cache-dir", str(root), "--json", str(tmp_path / "b.tar"))
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["entries"] == 7 and len(out["sha256"]) == 64 and out["path"] == str(tmp_path / "b.tar")


def test_bad_environment_value_is_a_usage_error(tmp_path):
    proc = jitwarm("warm", *TINY, "--cache-dir", str(tmp_path), env={"JITWARM_JOBS": "many"})
    assert proc.returncode == 2 and "JITWARM_JOBS" in proc.stderr and proc.stderr.count("\n") == 1


def test_warm_progress_lines_and_bar():
    import io

    from precompile_fixtures import plan_of

    from jitwarm.precompile.warming import Progress, SpecResult

    stream = io.StringIO()
    progress = Progress(3, stream=stream, bar=False)
    progress.start_time -= 130  # as if the first build had taken 2m10s
    for spec in plan_of(TINY).specs:
        progress.update(SpecResult(spec, "built", 1.5))
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("jitwarm: [1/3] built ") and lines[-1].startswith("jitwarm: [3/3]")
    assert "(elapsed 2m10s, eta 4m20s)" in lines[0]  # the mean per spec so far, times the specs left
    assert "elapsed 2m10s)" in lines[-1] and "eta" not in lines[-1]
    bar = io.StringIO()
    progress = Progress(2, stream=bar, bar=True)
    progress.update(SpecResult(plan_of(TINY).specs[0], "hit"))
    assert "\r" in bar.getvalue() and "1/2" in bar.getvalue() and "elapsed 0s, eta 0s" in bar.getvalue()


SERVER_WITHOUT_GRAPHS = ["--", "python", "-m", "sglang.launch_server", "--model-path", "/models/x",
                         "--disable-cuda-graph"]


@pytest.mark.parametrize("command", ["plan", "warm", "status", "verify", "prestart"])
def test_a_server_that_captures_no_graphs_has_nothing_to_warm(tmp_path, command):
    cache = [] if command == "plan" else ["--cache-dir", str(tmp_path / "c")]
    proc = jitwarm(command, "--target", "cpu", *cache, *SERVER_WITHOUT_GRAPHS)
    assert proc.returncode == 0, proc.stderr  # an init container sharing the server's template must not block it
    said = ("jitwarm: nothing to warm: the plan is empty (--disable-cuda-graph): the server captures no decode CUDA "
            "graphs")
    # said once; plan adds that a start still fills the server's JIT caches, which capture records
    assert proc.stderr.splitlines() == [said + (proc.stderr.strip()[len(said):] if command == "plan" else "")]
    assert ("`jitwarm capture -- SERVER LINE` records them" in proc.stderr) is (command == "plan")
    probe = jitwarm(command, "--target", "cpu", "--json", *cache, *SERVER_WITHOUT_GRAPHS)
    assert probe.returncode == 0 and json.loads(probe.stdout)


def test_export_of_a_plan_without_graphs_is_a_usage_error(tmp_path):
    proc = jitwarm("export", "--target", "cpu", "--cache-dir", str(tmp_path / "c"), str(tmp_path / "k.tar"),
                   *SERVER_WITHOUT_GRAPHS)
    assert proc.returncode == 2 and "nothing to export" in proc.stderr and proc.stderr.count("\n") == 1
    assert not (tmp_path / "k.tar").exists()


def test_verify_all_needs_no_plan_and_with_one_reports_the_missing_specs(tmp_path):
    root = str(tmp_path / "c")
    bare = jitwarm("verify", "--all", "--cache-dir", root, "--json")  # no --target, no --gpu-memory-mb: no plan
    assert bare.returncode == 0, bare.stderr
    assert json.loads(bare.stdout) == {"ok": 0, "corrupt": [], "missing": [], "repaired": False}
    planned = jitwarm("verify", "--all", *TINY, "--cache-dir", root)
    assert planned.returncode == 5, planned.stderr  # not ready: the plan's 3 specs are not there
    assert "0 entries, 0 corrupt, 3 missing" in planned.stdout and planned.stderr.count("jitwarm: missing: ") == 3


def test_a_manifest_with_plan_modifiers_stays_manifest_only(tmp_path):
    manifest = tmp_path / "server.jsonl"
    manifest.write_text(json.dumps({"v": 1, "kind": "triton", "kernel": "server_kernels:fill_lens", "target": "cpu",
                                    "specialization": "{}"}) + "\n")
    for flags in (["--ladder-source", "builtin"], ["--ragged-verify-mode", "compact"], ["--target", "cpu"]):
        proc = jitwarm("plan", "--manifest", str(manifest), *flags, "--json")  # no --gpu-memory-mb demanded
        assert proc.returncode == 0, (flags, proc.stderr)
        assert json.loads(proc.stdout)["totals"]["specs"] == 1
    both = jitwarm("plan", "--manifest", str(manifest), *TINY, "--json")  # model flags ask for our families too
    assert both.returncode == 0 and json.loads(both.stdout)["totals"]["specs"] == 4
