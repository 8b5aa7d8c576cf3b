"""The start-up ledger: what a served start still compiled, per family, by each library's own signal.

Real things: Inductor's ``torch.compile`` on the CPU in a child process whose cache ``prestart`` restored (its
``counters["inductor"]``); Triton's real JIT for sm_90 through jitwarm's cache manager, on a driver that only
reports that target (the mock, ``workers/gpu_stub.py``); the sglang 0.5.23 wheel's ``load_plugins()`` and loader,
with the device module and the TP group mocked as in ``test_sglang_plugin.py`` and ``ModelRunner.init_cuda_graphs``
a stand-in that captures through sglang's own backends (its body needs a model); the families without a hit
signal as trees in their library's layout (``jit_cache_trees.py``). The child processes all start at once.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import jit_cache_trees
import pytest
from precompile_fixtures import jitwarm

from jitwarm.kernels import kinds
from jitwarm.precompile import ledger

WORKER = Path(__file__).with_name("workers") / "ledger_worker.py"
WORKERS = str(WORKER.parent)
INDUCTOR_ENV = {"TORCHINDUCTOR_COMPILE_THREADS": "1", "JITWARM_RECORD_CACHES": "inductor"}
TRITON_ENV = {"PYTHONPATH": os.pathsep.join([WORKERS, os.environ.get("PYTHONPATH", "")]),
              "TRITON_DEFAULT_FP_FUSION": "1", "SERVER_KERNELS_BUCKETS": "1"}  # fill_lens BLOCK 1, scaled_copy


def private_caches(root: Path) -> dict[str, str]:
    """Every family's cache variable pointed under ``root``: other processes' compiles in the box's default caches
    (~/.triton/cache, /tmp/torchinductor_<user>) are not this start's."""
    return jit_cache_trees.env_for(root)


@pytest.fixture
def own_caches(monkeypatch, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("caches")
    for var, path in private_caches(root).items():
        monkeypatch.setenv(var, path)
    return root


def start(*args: str, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(WORKER), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, **env})


def answer(proc: subprocess.Popen) -> tuple[dict, str]:
    out, err = proc.communicate(timeout=1800)  # a cold torch.compile takes about a minute on a quiet box
    assert proc.returncode == 0, err[-4000:]
    return json.loads(out.strip().splitlines()[-1]), err


@pytest.fixture(scope="module")
def starts(request, tmp_path_factory) -> dict:
    """Every child start of this module, begun together; name -> (its JSON answer, its stderr)."""
    tmp = tmp_path_factory.mktemp("ledger")
    manifest, cache, own, restored = tmp / "m.jsonl", tmp / "cache", tmp / "own", tmp / "restored"
    caches = private_caches(tmp / "caches")
    # Inductor keeps its precompiled headers in $TMPDIR/torchinductor_<user> whatever TORCHINDUCTOR_CACHE_DIR says
    # (torch/_inductor/codecache.py, _HEADER_DIR): the children's own $TMPDIR, not the box's.
    caches["TMPDIR"] = str(tmp / "tmpdir")
    Path(caches["TMPDIR"]).mkdir()
    triton_env = {**caches, **TRITON_ENV, "JITWARM_CACHE_DIR": str(tmp / "triton-cache")}
    inductor_cold = start("inductor", "record", str(manifest), str(cache),
                          env={**caches, **INDUCTOR_ENV, "TORCHINDUCTOR_CACHE_DIR": str(own)})
    triton = start("triton", env=triton_env)
    sglang = None
    try:
        sglang_env = request.getfixturevalue("sglang_env")
    except pytest.skip.Exception:
        sglang_env = None
    if sglang_env is not None:
        jit_cache_trees.tilelang(tmp / "tilelang", key="restored")  # a unit prestart would have put there
        base = {k: v for k, v in os.environ.items() if not k.startswith(("JITWARM_", "SGLANG_"))}
        sglang = subprocess.Popen(
            [sys.executable, str(WORKER), "sglang"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**base, **sglang_env, "PYTHONPATH": os.pathsep.join([sglang_env["PYTHONPATH"], WORKERS]),
                 "SGLANG_PLUGINS": "jitwarm", "PYTHONWARNINGS": "ignore", "JITWARM_CACHE_DIR": str(tmp / "sgl"),
                 "TILELANG_CACHE_DIR": str(tmp / "tilelang"), "SGLANG_JIT_CACHE_DIR": str(tmp / "sgl-jit"),
                 "SGLANG_CACHE_DIR": str(tmp / "sglang-cache"), "JITWARM_LEDGER": str(tmp / "ledger.json")})
    runs = {"inductor_cold": answer(inductor_cold)}
    witnessed = {name: witnessed_start(tmp, name, own, Path(caches["TMPDIR"]), caches) for name in ("hit", "gone")}
    ready = jitwarm("prestart", "--manifest", str(manifest), "--cache-dir", str(cache), "--offline",
                    env={"TORCHINDUCTOR_CACHE_DIR": str(restored)})
    assert ready.returncode == 0, ready.stderr
    inductor_warm = start("inductor", "serve", env={**caches, **INDUCTOR_ENV, "TORCHINDUCTOR_CACHE_DIR": str(restored)})
    runs["triton"] = answer(triton)
    runs["inductor_warm"] = answer(inductor_warm)
    if sglang is not None:
        runs["sglang"] = answer(sglang)
    for name, (proc, node) in witnessed.items():
        runs[name] = {**node, "answer": answer(proc)[0], "witness": (node["home"] / "witness.log").read_text()
                      .splitlines()}
    runs["tmp"] = tmp
    return runs


#: A g++ first on PATH that logs each call, then runs the real one as it was called: argv[0] "g++" and PATH
#: without this folder, so the compiler finds itself where it is and ``g++ -v`` (which Inductor keys its ISA
#: probes and precompiled headers on: cpp_builder.py ``get_compiler_version_info``) says what it says without it.
WITNESS = """#!/bin/bash
printf '%s\\n' "$*" >> "$JITWARM_TEST_WITNESS"
PATH="${PATH#"${0%/*}:"}" exec -a g++ g++ "$@"
"""


def witnessed_start(tmp: Path, name: str, cache: Path, tmpdir: Path, caches: dict[str, str]) -> tuple:
    """A start of ``f`` on a copy of the cold run's Inductor cache and $TMPDIR, with a g++ on PATH that logs each
    call and runs the real one: ``hit`` as it was, ``gone`` without the precompiled header and the graph's ``.so``.
    """
    home = tmp / name
    node = {"home": home, "cache": home / "cache", "tmpdir": home / "tmpdir", "ledger": home / "ledger.json"}
    shutil.copytree(cache, node["cache"], symlinks=True)
    shutil.copytree(tmpdir, node["tmpdir"], symlinks=True)
    [gch] = node["tmpdir"].glob("torchinductor_*/precompiled_headers/*.h.gch")
    [so] = node["cache"].glob("*/*.main.so")  # the FX graph's kernel (the probes' .so are beside it)
    node.update(gch=gch, so=so)
    if name == "gone":
        gch.unlink()
        so.unlink()
    (home / "bin").mkdir()
    wrapper = home / "bin" / "g++"
    wrapper.write_text(WITNESS)
    wrapper.chmod(0o755)
    env = {**caches, **INDUCTOR_ENV, "TORCHINDUCTOR_CACHE_DIR": str(node["cache"]), "TMPDIR": str(node["tmpdir"]),
           "PATH": f"{home / 'bin'}{os.pathsep}{os.environ['PATH']}", "JITWARM_LEDGER": str(node["ledger"]),
           "JITWARM_TEST_WITNESS": str(home / "witness.log")}
    env.pop("JITWARM_RECORD_CACHES")
    return start("inductor", "hit", env=env), node


def test_a_restored_inductor_cache_is_served_and_a_different_function_is_compiled_by_its_key(starts):
    cold = starts["inductor_cold"][0]["ledger"]["families"]["inductor"]
    assert cold["served"] == 0 and cold["compiled"] >= 1
    assert cold["present_at_start"] == 0
    [cold_key] = [k for k in cold["keys"] if k.startswith("fxgraph ")]  # the FX graph key it wrote
    (warm, err) = starts["inductor_warm"]
    inductor = warm["ledger"]["families"]["inductor"]
    assert inductor["served"] == 1 and inductor["compiled"] >= 1  # f from the restored cache; g compiled now
    assert inductor["present_at_start"] >= 3 and inductor["root"] == str(starts["tmp"] / "restored")
    [key] = [k for k in inductor["keys"] if k.startswith("fxgraph ")]
    assert key.startswith("fxgraph f") and key != cold_key  # g's graph, not the restored one
    assert warm["ledger"]["compiled_after_restore"] == [
        {"family": "inductor", "keys": inductor["keys"], "present_at_start": inductor["present_at_start"]}]
    line = next(x for x in warm["lines"] if x.startswith("jitwarm: ledger: inductor compiled "))
    assert key in line and str(starts["tmp"] / "restored") in line
    assert f"jitwarm: ledger: inductor: served from cache 1, compiled now {inductor['compiled']} (" in warm["lines"][0]


def compiles(witness: list[str]) -> list[str]:
    """The witness's lines that compiled: an output named (``-o``), not a preprocessing (``-E``) or a question."""
    return [line for line in witness if " -o " in f" {line} " and " -E " not in f" {line} "]


def outputs(lines: list[str]) -> set[str]:
    return {line.split(" -o ", 1)[1].split()[0] for line in lines}


def test_a_hit_whose_precompiled_header_and_so_are_gone_is_counted_by_what_it_wrote_and_ran(starts):
    """The FX graph hit (Inductor counts no miss) ran g++ for the header and the kernel: the ledger says so, with
    the evidence a g++ on PATH that logs each call saw, and the files that came back."""
    gone = starts["gone"]
    count = gone["answer"]["ledger"]["families"]["inductor"]
    assert count["served"] == 1  # Inductor's own counters: a hit, no miss
    ran = compiles(gone["witness"])
    assert outputs(ran) == {str(gone["gch"]), str(gone["so"])}, gone["witness"]
    assert gone["gch"].is_file() and gone["so"].is_file()  # written again
    assert count["compiler_runs"] == len(ran) >= 2
    assert count["compiler_probes"] == len(gone["witness"]) - len(ran) > 0  # --version, -v, -E: not compiles
    assert set(count["compiler_outputs"]) == outputs(ran)
    header, code = f"precompiled_headers/{gone['gch'].name.split('.')[0]}", f"{gone['so'].parent.name}/" + (
        gone["so"].name.split(".")[0])
    assert count["written"] == 2 and set(count["keys"]) == {header, code}
    assert count["compiled"] == max(2, len(ran)) and gone["answer"]["ledger"]["compiled"] == count["compiled"]
    assert gone["answer"]["ledger"]["unattributed"]["compiler_runs"] == 0  # every g++ was Inductor's
    warning = next(x for x in gone["answer"]["lines"] if x.startswith("jitwarm: ledger: inductor compiled "))
    assert header in warning and code in warning
    written = json.loads(gone["ledger"].read_text())
    assert written["phase"] == "ready" and written["families"]["inductor"] == count


def test_a_hit_with_everything_in_place_runs_no_compile_and_the_gate_passes(starts):
    """The control: the same start on the same files, nothing removed. g++ still runs (Inductor asks its version
    and preprocesses its header's include at every start): probes, and not one compile."""
    hit = starts["hit"]
    count = hit["answer"]["ledger"]["families"]["inductor"]
    assert (count["served"], count["compiled"], count["written"], count["compiler_runs"]) == (1, 0, 0, 0)
    assert hit["witness"] and compiles(hit["witness"]) == []
    assert count["compiler_probes"] == len(hit["witness"])
    assert hit["answer"]["ledger"]["compiled"] == 0
    gate = jitwarm("ledger", str(hit["ledger"]), "--require-zero")
    assert gate.returncode == 0, gate.stderr
    assert gate.stdout.splitlines()[-1] == f"jitwarm: ledger: {hit['ledger']}: compiled 0 in all (ready)"


def test_the_ledger_command_fails_the_gate_on_a_start_that_compiled(starts):
    gone = starts["gone"]
    gate = jitwarm("ledger", str(gone["ledger"]), "--require-zero")
    assert gate.returncode == 1, gate.stderr
    lines = gate.stdout.splitlines()
    assert len([x for x in lines if x.startswith("jitwarm: ledger: ") and ": served from cache" in x]) >= 1
    inductor = next(x for x in lines if x.startswith("jitwarm: ledger: inductor: "))
    assert "2 unit(s) written" in inductor and "compiler run(s)" in inductor
    assert any(x.startswith("jitwarm: ledger: inductor compiled ") for x in lines)  # the warning after the families
    assert jitwarm("ledger", str(gone["ledger"])).returncode == 0  # no gate asked: it only prints
    as_json = json.loads(jitwarm("ledger", str(gone["ledger"]), "--json").stdout)
    assert as_json["compiled"] >= 2 and as_json["families"]["inductor"] == as_json["compiled"]
    stop = json.loads(ledger.stop_path(gone["ledger"]).read_text())  # written again when the process exited
    assert stop["phase"] == "stop" and stop["after_ready"]["compiled"] == 0
    assert stop["families"]["inductor"]["compiled"] == as_json["compiled"]


@pytest.mark.parametrize("content", [None, "", "{}", "[1, 2]", '{"families": [], "compiled": 0}', "\x00\xff"])
def test_the_ledger_command_refuses_what_is_no_ledger_in_one_line(tmp_path, content):
    path = tmp_path / "ledger.json"
    if content is not None:
        path.write_text(content, encoding="latin-1")
    proc = jitwarm("ledger", str(path), "--require-zero")
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.splitlines()) == 1 and proc.stderr.startswith("jitwarm: error: "), proc.stderr
    assert str(path) in proc.stderr


@pytest.mark.parametrize(("argv", "expected"), [
    (["g++", "--version"], ("g++", False, None)), (["g++", "-v"], ("g++", False, None)),
    (["g++", "a.hpp", "-E", "-o", "a.i"], ("g++", False, "a.i")),
    (["/usr/bin/x86_64-linux-gnu-g++-12", "a.cpp", "-shared", "-o", "a.so"],
     ("x86_64-linux-gnu-g++-12", True, "a.so")),
    (["nvcc", "-c", "k.cu", "-o", "k.o"], ("nvcc", True, "k.o")), (["ptxas", "--version"], ("ptxas", False, None)),
    (["ninja", "-C", "build"], ("ninja", True, None)), (["ninja", "-t", "compdb"], ("ninja", False, None)),
    (["clang++-17", "-print-resource-dir"], ("clang++-17", False, None)), (["openssl", "sha512", "x"], None),
    (["python3", "-c", "g++"], None), ([], None)])
def test_a_compiler_run_is_a_compile_unless_it_only_asks_or_preprocesses(argv, expected):
    from jitwarm.kernels.libraries.jit_caches.compilers import classify

    assert classify(argv) == expected


@pytest.mark.parametrize(("served", "uncached", "written", "rewritten", "runs", "compiled"), [
    (12, 12, 12, 12, 0, 0),  # sglang's CPU graphs: 12 served, 12 lowered again and their wrappers; none compiled
    (2, 0, 2, 2, 0, 0),  # hits that wrote their wrappers anew
    (0, 1, 3, 3, 0, 2),  # more wrappers than hits and bypasses: the others were written by a compile
    (2, 0, 3, 2, 0, 1),  # wrappers and a kernel: the kernel compiled
    (2, 0, 2, 2, 1, 1),  # and a compiler ran: at least that compiled
    (None, 0, 2, 2, 0, 2),  # no hit signal: no unit is excused
])
def test_a_unit_a_start_writes_without_compiling_is_no_compile(served, uncached, written, rewritten, runs, compiled):
    """A wrapper is written again by a hit and by a graph Inductor's cache does not take: excused up to those."""
    from jitwarm.kernels.libraries.jit_caches import inductor
    from jitwarm.kernels.libraries.jit_caches.units import FamilyCount

    units = [f"{n:02}/c{n:02}" for n in range(written)]
    count = FamilyCount("inductor", "counters", served, 0, uncached=uncached).witnessed(units, runs, 0, (), rewritten)
    assert (count.compiled, count.written, count.rewritten, count.uncached) == (compiled, written, rewritten, uncached)
    assert {k: count.as_json()[k] for k in ("rewritten", "uncached")} == {"rewritten": rewritten, "uncached": uncached}
    assert ("not cacheable" in count.line()) == bool(uncached)
    assert inductor.wrapper(("ab/cab.py",)) and not inductor.wrapper(("ab/cab.cpp", "ab/cab.py", "ab/cab.so"))
    assert not inductor.wrapper(("fxgraph/ab/fab/entry",)) and not inductor.wrapper(())


def test_the_tap_counts_a_real_compilers_runs_by_the_family_that_started_them(tmp_path):
    """g++ started from a frame of a module named as Inductor's (its package prefix) is Inductor's; one started
    from here is unattributed; a shell's command line is read as its words; the spawn's own errors still raise."""
    import types

    from jitwarm.kernels.libraries.jit_caches import compilers

    tap = compilers.watching()
    (c0, p0, _) = tap.counts()
    source = tmp_path / "a.cpp"
    source.write_text("int f() { return 1; }\n")
    inductor = types.ModuleType("torch._inductor.jitwarm_test")
    exec("import subprocess\ndef run(argv, **kw):\n    return subprocess.run(argv, check=True, **kw)\n",
         inductor.__dict__)
    inductor.run(["g++", "-c", str(source), "-o", str(tmp_path / "a.o")])
    subprocess.run("g++ --version >/dev/null", shell=True, check=True)
    subprocess.run(["g++", "-c", str(source), "-o", str(tmp_path / "b.o")], check=True)
    with pytest.raises(FileNotFoundError):
        subprocess.run(["g++-no-such-compiler", "--version"])
    (c1, p1, out) = tap.counts()
    assert (c1 - c0) == {"inductor": 1, "": 1} and (p1 - p0) == {"": 1}
    assert str(tmp_path / "a.o") in out["inductor"] and (tmp_path / "a.o").is_file()


def test_jitwarms_triton_manager_counts_what_it_compiled_and_what_it_served(starts):
    result = starts["triton"][0]
    cold = result["cold"]["families"]["triton"]
    assert cold["signal"] == "jitwarm's Triton cache manager"
    assert (cold["served"], cold["compiled"]) == (0, 2)
    assert sorted(k.split()[0] for k in cold["keys"]) == ["fill_lens", "scaled_copy"]
    both = result["ledger"]["families"]["triton"]  # the reloaded kernels' compiles: each found in the cache
    assert (both["served"], both["compiled"], both["keys"]) == (2, 2, cold["keys"])
    assert result["ledger"]["compiled"] == 2
    assert "jitwarm: ledger: triton: served from cache 2, compiled now 2 (jitwarm's Triton cache manager)" in (
        result["lines"][1])


def test_the_sglang_plugin_writes_the_ledger_after_the_last_capture(starts):
    if "sglang" not in starts:
        pytest.skip("the sglang wheel is not installable here")
    result, err = starts["sglang"]
    assert [name for name, _ in result["captured"]] == ["full", "breakable", "tc_piecewise"]
    written = json.loads((starts["tmp"] / "ledger.json").read_text())
    families = written["families"]
    assert list(families) == sorted(kinds.ledger_families())
    assert (families["load_jit"]["served"], families["load_jit"]["compiled"]) == (1, 1)
    assert families["load_jit"]["keys"] == ["sgl_kernel_jit_new build-4567"]
    assert families["load_jit"]["present_at_start"] == 1  # the build published before the start
    tilelang = families["tilelang"]
    assert tilelang["served"] is None and tilelang["compiled"] == 1 and tilelang["present_at_start"] == 1
    assert tilelang["keys"] == ["0.1.12/linux-x86_64/kernels/compiled-in-capture"]
    assert families["triton"]["signal"] == "jitwarm's Triton cache manager"  # the plugin set the manager
    assert written["compiled"] == 2
    logged = [x.split(" ", 3)[3] for x in err.splitlines() if x.startswith("LOG jitwarm.ledger ")]
    assert len(logged) == len(kinds.ledger_families()) + 2, logged  # one line per family, a warning per family that
    load_jit, tilelang = logged[-2:]                         # compiled although units of it were there
    assert load_jit.startswith("jitwarm: ledger: load_jit compiled 1 although 1 unit(s) of load_jit were present "
                               "at start") and "sgl_kernel_jit_new build-4567" in load_jit
    assert tilelang.startswith("jitwarm: ledger: tilelang compiled 1 although 1 unit(s) of tilelang were "
                               "present at start") and "compiled-in-capture" in tilelang
    assert [w["family"] for w in written["compiled_after_restore"]] == ["load_jit", "tilelang"]
    # the lines come after the last graph: the hook ran around sglang's (stand-in) init_cuda_graphs
    assert "Applied 1 hook(s) to sglang.srt.model_executor.model_runner.ModelRunner.init_cuda_graphs" in err


def test_a_family_without_a_hit_signal_is_counted_from_the_new_units_in_its_cache(own_caches):
    root = own_caches / "deep_gemm"
    jit_cache_trees.deep_gemm(root, digest="0restored")
    start_snapshot = ledger.Ledger()
    jit_cache_trees.deep_gemm(root, digest="1compiled")
    (root / "cache" / "sm90_fp8_gemm_1d2d.2torn").mkdir()  # a compile not committed: no unit yet
    (root / "cache" / "sm90_fp8_gemm_1d2d.2torn" / "kernel.cu").write_text("// no cubin, no .committed yet")
    count = start_snapshot.report().family("deep_gemm")
    assert (count.served, count.compiled, count.present) == (None, 1, 1)
    assert count.keys == ("cache/sm90_fp8_gemm_1d2d.1compiled",)
    assert count.line().startswith("jitwarm: ledger: deep_gemm: compiled now 1, served from cache unknown (no hit "
                                   f"signal: counted from the new units in {root}, 1 unit(s) there at start)")


@pytest.mark.parametrize("where", ["a directory", "under a file", "unwritable"])
def test_a_ledger_path_that_cannot_be_written_is_one_warning_and_the_start_goes_on(own_caches, monkeypatch, tmp_path,
                                                                                     caplog, where):
    blocker = tmp_path / "file"
    blocker.write_text("")
    path = {"a directory": tmp_path, "under a file": blocker / "ledger.json",
            "unwritable": Path("/proc/ledger.json")}[where]
    monkeypatch.setenv("JITWARM_LEDGER", str(path))
    with caplog.at_level(logging.WARNING, logger="jitwarm"):
        report = ledger.report_after_capture(ledger.Ledger())
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith(f"jitwarm: ledger not written to JITWARM_LEDGER={path}: ")
    assert report.compiled == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # no temporary left behind


@pytest.mark.parametrize("kind", ["fifo", "link to a file", "link to /dev/null", "device"])
def test_a_ledger_path_that_is_no_regular_file_is_never_replaced(own_caches, monkeypatch, tmp_path, caplog, kind):
    """``JITWARM_LEDGER`` is treated like an export target (issue #31, N6): a FIFO, a device or a link there gets
    one warning and stays what it was (the rename used to replace it, ``/dev/null`` itself when run as root)."""
    path, target = tmp_path / "ledger.json", tmp_path / "real.json"
    target.write_text("theirs")
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "device":
        if os.geteuid() != 0:
            pytest.skip("making a device node needs root")
        os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 3))  # a /dev/null of our own
    else:
        path.symlink_to(target if kind == "link to a file" else Path("/dev/null"))
    before = path.lstat()
    monkeypatch.setenv("JITWARM_LEDGER", str(path))
    with caplog.at_level(logging.WARNING, logger="jitwarm"):
        ledger.report_after_capture(ledger.Ledger())
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "left as it is" in warnings[0], warnings
    after = path.lstat()
    assert (after.st_ino, after.st_mode) == (before.st_ino, before.st_mode) and target.read_text() == "theirs"


def test_the_ledger_file_is_written_whole_and_the_capture_hook_reports_the_same(own_caches, monkeypatch, tmp_path):
    from jitwarm.precompile import CaptureHook, WarmPlan

    root = own_caches / "tilelang"
    monkeypatch.setenv("JITWARM_LEDGER", str(tmp_path / "ledger.json"))
    monkeypatch.setattr(ledger, "_process", None)  # this process's ledger starts with the hook
    hook = CaptureHook(WarmPlan.empty(), device=SimpleNamespace(target="cpu", synchronize=lambda: None),
                       barrier=lambda: None)
    try:
        assert hook.ledger is ledger.begin()
        jit_cache_trees.tilelang(root, key="compiled-now")
        report = ledger.report_after_capture()
        assert hook.ledger_report() == report
    finally:
        hook.close()
    written = json.loads((tmp_path / "ledger.json").read_text())
    assert written == {**report.as_json(), "phase": "ready"} and written["pid"] == os.getpid()
    assert written["families"]["tilelang"]["keys"] == ["0.1.12/linux-x86_64/kernels/compiled-now"]
    assert written["compiled_after_restore"] == []  # nothing of tilelang was there at start
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_importing_the_ledger_imports_no_library():
    code = ("import json, sys, jitwarm.precompile.ledger; "
            "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'triton', 'tvm_ffi', "
            "'sglang'})))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True,
                          cwd=WORKERS)
    assert json.loads(proc.stdout) == []


def test_a_vllm_compile_after_restore_is_named_by_the_cache_key_factor_that_differs(own_caches):
    """vLLM's tree laid by hand in its layout (``jit_cache_trees.vllm_compile``; the wheel writes one in
    ``test_vllm_caches.py``): a start whose config hash differs writes a new hash directory, named with that factor."""
    tree = jit_cache_trees.home(own_caches, "vllm_compile") / "torch_compile_cache"
    jit_cache_trees.vllm_compile(tree, digest="0restored0")  # config_hash "c0"
    start_snapshot = ledger.Ledger()
    new = tree / "1compiled1" / "rank_0_0" / "backbone"
    jit_cache_trees.write(new / "cache_key_factors.json", json.dumps(
        {"env": {"VLLM_TARGET_DEVICE": "cuda"}, "config_hash": "c9", "code_hash": "c1", "compiler_hash": "c2"}))
    jit_cache_trees.write(new / "computation_graph.py", "#")
    report = start_snapshot.report()
    count = report.family("vllm_compile")
    assert (count.served, count.compiled, count.present) == (None, 1, 1)  # vLLM's counter is not imported here
    assert count.keys == ("1compiled1/rank_0_0/backbone (vllm:config_hash 'c0' (now 'c9'))",)
    assert report.warnings()[0].startswith("jitwarm: ledger: vllm_compile compiled 1 although 1 unit(s) of "
                                           f"vllm_compile were present at start in {tree}: 1compiled1/")


def test_the_ledger_reads_only_the_rooms_public_names():
    """#21 review: no layout of a library in the ledger, no private name of another module imported by it."""
    import ast

    tree = ast.parse(Path(ledger.__file__).read_text())
    imported = [alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                and (node.module or "").startswith("jitwarm") for alias in node.names]
    assert imported and not [name for name in imported if name.startswith("_")]
    from jitwarm.kernels.libraries.jit_caches.inductor import graph_keys

    assert graph_keys(["fxgraph/q3/fq3abc/e1", "3f9a0c1b2d/rank_0_0/inductor_cache/fxgraph/z1/fz1def/e2",
                       "aotautograd/ae/x"]) == ["fq3abc", "fz1def"]
