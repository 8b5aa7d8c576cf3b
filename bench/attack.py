"""Attack round 2 (issue #20): the real CLI against hostile argv, environment, files, another user, a full disk
and SIGKILLs; prints one table of outcomes. Not a test: a bounded survey (under 5 minutes on 2 cores).

Each case runs ``python -m jitwarm ...`` in a subprocess with its own timeout, in temp dirs only (and loopback),
and is classified: ``good`` (the documented exit code and, for a usage error, one ``jitwarm: error:`` line on
stderr), or bad: ``traceback``, ``wrong-code``, ``hang`` (past its timeout), ``multi-line`` (a usage error of more
than one stderr line), ``bad-json`` (stdout under ``--json`` that is not one JSON document). Kills: a warm is
SIGKILLed mid-build, then ``verify --all`` must find nothing corrupt (exit 0) and no staged file may be
published. As root, the ``jwtest`` account plays the other user and a 256 KiB tmpfs the full disk.

usage: python bench/attack.py [--kills 6] [--jobs 2] [--only SUBSTRING]  (bad outcomes are listed on stderr as found)
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import random
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

OTHER = "jwtest"
# 3 specs, one per family, on the host (tests/precompile_fixtures.py's TINY); FAST builds Triton's interpreter
# kernels (one small file each), SMALL is the C++ plan the issue names for kills.
TINY = ["--cuda-graph-bs", "1", "--compress-ratios", "4", "--head-dim", "64", "--rope-dim", "32",
        "--num-q-heads", "2", "--dtype", "float32", "--target", "cpu"]
FAST = [*TINY, "--backend", "triton"]
SMALL = ["--cuda-graph-max-bs-decode", "4", "--speculative-algorithm", "DSPARK", "--speculative-num-draft-tokens",
         "2", "--ragged-verify-mode", "compact", "--target", "cpu"]
SERVER = ["--", "python", "-m", "sglang.launch_server", "--model-path", "m"]
PLAN_COMMANDS = ["plan", "warm", "status", "verify", "prestart", "export"]
BAD_NUMBERS = ["0", "-1", "1e400", "nan", "inf", "", "٣", "２", "99999999999999999999", "0x10", "1_0", "1e3x"]
ENV_VARS = ["JITWARM_CACHE_DIR", "JITWARM_CACHE_PATH", "JITWARM_LOCK_DIR", "JITWARM_ALLOW_SHARED", "JITWARM_REMOTE",
            "JITWARM_REMOTE_PREFIX", "JITWARM_REMOTE_REQUIRED", "JITWARM_REMOTE_LEASE_S", "JITWARM_REMOTE_MAX_BYTES",
            "JITWARM_BUNDLE_MAX_FILE_BYTES", "JITWARM_BUNDLE_MAX_BYTES", "JITWARM_PRUNE_GRACE_S", "JITWARM_JOBS",
            "JITWARM_STRICT", "JITWARM_CONFIG", "JITWARM_MANIFEST", "JITWARM_TRITON_CACHE"]
BAD_ENV_VALUES = ["nan", "٣", "maybe", "x" * 5000, "redis://127.0.0.1:0/0"]


@dataclass
class Case:
    group: str
    name: str
    argv: list[str]
    codes: tuple[int, ...] = (2,)  # the documented exit codes this input may give
    env: dict[str, str] = field(default_factory=dict)
    timeout: float = 30.0
    user: str | None = None  # run as this user (root only)
    cwd: str | None = None


@dataclass
class Outcome:
    case: Case
    verdict: str
    code: int | None
    detail: str


def run_cli(argv, env=None, timeout=30.0, user=None, cwd=None):
    """Run the real CLI; return (code or None on a hang, stdout, stderr)."""
    preexec = None
    if user is not None:
        record = pwd.getpwnam(user)

        def preexec():
            os.setgid(record.pw_gid)
            os.setgroups([])
            os.setuid(record.pw_uid)
    full_env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", **(env or {})}
    if user is not None:
        full_env["HOME"] = "/nonexistent"
    proc = subprocess.Popen([sys.executable, "-m", "jitwarm", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, env=full_env, cwd=cwd or "/tmp", preexec_fn=preexec,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return None, out.decode(errors="replace"), err.decode(errors="replace")
    return proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")


def other_user_can_run() -> bool:
    """Whether the other user can start this interpreter at all (a venv under root's 0700 home: not)."""
    return os.access(sys.executable, os.X_OK) and all(
        p.stat().st_mode & 0o005 == 0o005 for p in Path(sys.executable).resolve().parents)


def classify(case: Case) -> Outcome:
    outcome = judge(case)
    if outcome.verdict != "good":  # as found: a survey cut short still shows what it found
        print(f"  {outcome.verdict:<11} {outcome.code!s:>4}  {case.group}: {case.name}: {outcome.detail}",
              file=sys.stderr, flush=True)
    return outcome


def judge(case: Case) -> Outcome:
    code, out, err = run_cli(case.argv, case.env, case.timeout, case.user, case.cwd)
    last = err.strip().splitlines()[-1:] or [""]
    if code is None:
        return Outcome(case, "hang", None, f"> {case.timeout:.0f} s")
    if "Traceback" in err:
        return Outcome(case, "traceback", code, err.strip().splitlines()[-1][:160])
    if code not in case.codes:
        return Outcome(case, "wrong-code", code, f"want {case.codes}: {last[0][:150]}")
    if code == 2 and (err.count("\n") != 1 or not err.startswith("jitwarm: error: ")):
        return Outcome(case, "multi-line", code, " | ".join(err.strip().splitlines())[:200])
    if "--json" in case.argv and "--" not in case.argv[:case.argv.index("--json")] and out.strip():
        try:
            json.loads(out)
        except ValueError:
            return Outcome(case, "bad-json", code, out.strip()[:160])
    return Outcome(case, "good", code, last[0][:120])


# -- hostile files -------------------------------------------------------------------------------------------

def hostile_files(base: Path) -> dict[str, str]:
    """name -> path of files no reader should hang on, crash on or trust."""
    files = {}
    d = base / "files"
    d.mkdir()
    os.mkfifo(d / "fifo")
    files["fifo"] = str(d / "fifo")
    (d / "link-to-fifo").symlink_to(d / "fifo")
    files["symlink-to-fifo"] = str(d / "link-to-fifo")
    files["dev-zero"] = "/dev/zero"
    files["proc-self-mem"] = "/proc/self/mem"
    files["directory"] = str(d)
    files["missing"] = str(d / "missing")
    files["dangling-link"] = str(d / "dangling")
    (d / "dangling").symlink_to(d / "nowhere")
    for name, content in {
        "empty": b"", "binary": bytes(range(256)) * 64, "nul": b"\0" * 1000, "latin1": b"\xff\xfe caf\xe9\n",
        "huge-line": b"x" * (5 << 20), "deep-json": b"[" * 200000 + b"\n", "deep-toml": b"a = " + b"[" * 100000,
        "deep-dict": b"{\"a\":" * 100000 + b"1" + b"}" * 100000 + b"\n",
        "truncated-json": b'{"v": 1, "kind": "triton", "kern', "bom": b"\xef\xbb\xbf{}\n",
        "many-lines": b"\n" * (2 << 20),
    }.items():
        (d / name).write_bytes(content)
        files[name] = str(d / name)
    unreadable = d / "unreadable"
    unreadable.write_text("x = 1\n")
    unreadable.chmod(0)
    files["unreadable"] = str(unreadable)
    return files


MANIFEST_RECORDS = {
    "v-true": {"v": True, "kind": "triton", "kernel": "a:b", "target": "cpu", "specialization": "{}"},
    "v-float": {"v": 1.0, "kind": "triton", "kernel": "a:b", "target": "cpu", "specialization": "{}"},
    "v-huge": {"v": 10 ** 400, "kind": "triton", "kernel": "a:b", "target": "cpu", "specialization": "{}"},
    "kind-unknown": {"v": 1, "kind": "cuda", "kernel": "a:b", "target": "cpu"},
    "kind-list": {"v": 1, "kind": ["triton"], "kernel": "a:b", "target": "cpu"},
    "target-number": {"v": 1, "kind": "triton", "kernel": "a:b", "target": 90, "specialization": "{}"},
    "target-bad": {"v": 1, "kind": "triton", "kernel": "a:b", "target": "sm_٩٠", "specialization": "{}"},
    "target-empty": {"v": 1, "kind": "triton", "kernel": "a:b", "target": "", "specialization": "{}"},
    "kernel-no-colon": {"v": 1, "kind": "triton", "kernel": "os", "target": "cpu", "specialization": "{}"},
    "kernel-missing-module": {"v": 1, "kind": "triton", "kernel": "no_such_mod_xyz:k", "target": "cpu",
                              "specialization": "{}"},
    "kernel-os-system": {"v": 1, "kind": "triton", "kernel": "os:system", "target": "cpu", "specialization": "{}"},
    "kernel-dotted-attack": {"v": 1, "kind": "triton", "kernel": "..:..", "target": "cpu", "specialization": "{}"},
    "spec-not-json": {"v": 1, "kind": "triton", "kernel": "json:dumps", "target": "cpu", "specialization": "{{{"},
    "spec-deep": {"v": 1, "kind": "triton", "kernel": "json:dumps", "target": "cpu",
                  "specialization": "[" * 100000},
    "spec-list": {"v": 1, "kind": "triton", "kernel": "json:dumps", "target": "cpu", "specialization": "[1, 2]"},
    "sglang-call-empty": {"v": 1, "kind": "sglang_jit", "module": "m", "target": "cpu", "call": {}},
    "sglang-call-bad": {"v": 1, "kind": "sglang_jit", "module": "m", "target": "cpu",
                        "call": {"args": 5, "cpp_files": "x"}},
    "sglang-module-path": {"v": 1, "kind": "sglang_jit", "module": "../../etc/passwd", "target": "cpu",
                           "call": {"args": [], "cpp_files": ["/etc/passwd"]}},
    "record-list": [1, 2, 3],
    "record-string": "triton",
}


def manifest_files(base: Path) -> dict[str, str]:
    d = base / "manifests"
    d.mkdir()
    out = {}
    for name, record in MANIFEST_RECORDS.items():
        path = d / f"{name}.jsonl"
        path.write_text(json.dumps(record) + "\n")
        out[name] = str(path)
    good = json.dumps(MANIFEST_RECORDS["kernel-missing-module"])
    (d / "torn-only").write_text('{"v": 1, "ki')
    out["torn-only"] = str(d / "torn-only")
    (d / "bad-middle").write_text(good + "\n{oops\n" + good + "\n")
    out["bad-middle"] = str(d / "bad-middle")
    (d / "world-writable").write_text(good + "\n")
    (d / "world-writable").chmod(0o666)
    out["world-writable"] = str(d / "world-writable")
    return out


def bundle_files(base: Path) -> dict[str, str]:
    d = base / "bundles"
    d.mkdir()
    out = {}

    def tar(name, members):
        path = d / name
        with tarfile.open(path, "w") as t:
            for info, data in members:
                t.addfile(info, None if data is None else __import__("io").BytesIO(data))
        out[name] = str(path)

    def member(name, data=b"x", kind=tarfile.REGTYPE, link=""):
        info = tarfile.TarInfo(name)
        info.type, info.linkname = kind, link
        info.size = len(data) if kind == tarfile.REGTYPE else 0
        return info, (data if kind == tarfile.REGTYPE else None)

    tar("absolute.tar", [member("/tmp/jitwarm-attack-escaped")])
    tar("dotdot.tar", [member("../../escaped")])
    tar("symlink.tar", [member("v1/entries/ab/abc", kind=tarfile.SYMTYPE, link="/etc")])
    tar("hardlink.tar", [member("v1/x", kind=tarfile.LNKTYPE, link="/etc/passwd")])
    tar("device.tar", [member("v1/dev", kind=tarfile.CHRTYPE)])
    tar("fifo.tar", [member("v1/fifo", kind=tarfile.FIFOTYPE)])
    tar("junk-entry.tar", [member("v1/entries/zz/zzzz/entry.json", b"{")])
    tar("no-members.tar", [])
    huge = tarfile.TarInfo("v1/entries/aa/aaaa/kernel.so")
    huge.size = 1 << 40  # claims a terabyte: the header alone, then EOF
    path = d / "size-lie.tar"
    with open(path, "wb") as f:
        f.write(huge.tobuf())
    out["size-lie.tar"] = str(path)
    (d / "truncated.tar").write_bytes(Path(out["junk-entry.tar"]).read_bytes()[:700])
    out["truncated.tar"] = str(d / "truncated.tar")
    (d / "gzip-junk.tar").write_bytes(b"\x1f\x8b\x08" + os.urandom(4000))
    out["gzip-junk.tar"] = str(d / "gzip-junk.tar")
    return out


# -- the cases -----------------------------------------------------------------------------------------------

def argv_cases(base: Path) -> list[Case]:
    cases = []
    cache = ["--cache-dir", str(base / "argv-cache")]
    for command in PLAN_COMMANDS:
        extra = [str(base / "out.tar")] if command == "export" else []
        # the serving flags share plan's parser: every bad number there, the cache flags' own under each command
        flags = ("--cuda-graph-max-bs-decode", "--tp-size") if command == "plan" else ("--jobs", "--timeout")
        for flag in flags:
            for value in BAD_NUMBERS if command == "plan" else BAD_NUMBERS[1:12:2]:
                cases.append(Case("argv", f"{command} {flag} {value!r}",
                                  [command, *TINY, *cache, flag, value, *extra]))
        cases += [
            Case("argv", f"{command} unknown flag", [command, *TINY, *cache, "--bogus", *extra]),
            Case("argv", f"{command} --cache-dir ''", [command, *TINY, "--cache-dir", "", *extra]),
            Case("argv", f"{command} --config ''", [command, *TINY, *cache, "--config", "", *extra]),
            Case("argv", f"{command} --manifest ''", [command, *cache, "--target", "cpu", "--manifest", "", *extra]),
            Case("argv", f"{command} --target ''", [command, *cache, "--target", "", *extra]),
            Case("argv", f"{command} --json bad flag", [command, *TINY, *cache, "--json", "--tp-size", "x", *extra]),
            Case("argv", f"{command} --remote bad port", [command, *TINY, *cache, "--remote",
                                                          "redis://127.0.0.1:0/0", *extra]),
            Case("argv", f"{command} --remote-prefix junk", [command, *TINY, *cache, "--remote-prefix", "a b/c",
                                                             *extra]),
            Case("argv", f"{command} huge bs list", [command, *cache, "--target", "cpu", "--cuda-graph-bs-decode",
                                                     *map(str, range(1, 30000)), *extra]),
        ]
    sglang_bad = [["--tp-size", "x"], ["--tp-size", "٢"], ["--dp-size", "0"], ["--tp-size", "-2"],
                  ["--cuda-graph-max-bs", "nan"], ["--cuda-graph-max-bs", "1e400"], ["--cuda-graph-bs", "1", "x"],
                  ["--cuda-graph-bs", *map(str, range(1, 30000))], ["--speculative-num-draft-tokens", "-1"],
                  ["--speculative-num-draft-tokens", "99999999999999999999"], ["--speculative-algorithm", "X"],
                  ["--cuda-graph-config", "{" * 50000], ["--cuda-graph-config", '{"decode": {"bs": [1e400]}}'],
                  ["--cuda-graph-config", '{"decode": {"bs": [NaN]}}'], ["--cuda-graph-config", "[]"],
                  ["--mem-fraction-static", "nan"], ["--max-running-requests", "0"], ["--tp-size"],
                  ["--attn-dp-size", "٣", "--enable-dp-attention", "--tp-size", "4"],
                  ["--tp-size", "3", "--dp-size", "2", "--enable-dp-attention"],
                  ["--model-path", ""], ["--page-size", "0"], ["--json-model-override-args", "{" * 50000],
                  ["--speculative-algorithm", "EAGLE", "--speculative-eagle-topk", "0"], ["\udcff"]]
    for bad in sglang_bad:
        cases.append(Case("argv", "sglang " + " ".join(bad)[:50], ["plan", "--target", "cpu", *SERVER, *bad]))
        if len(cases) % 3 == 0:  # a third of them through status --json too
            cases.append(Case("argv", "status sglang " + " ".join(bad)[:43],
                              ["status", "--target", "cpu", *cache, "--json", *SERVER, *bad]))
    for command, argv in (("prune", ["--max-bytes"]), ("prune", ["--older-than"])):
        for value in ["", "٣d", "1e400", "nan", "-1", "1 x", "9" * 400]:
            cases.append(Case("argv", f"{command} {argv[0]} {value!r}", [command, *cache, *argv, value]))
    cases += [Case("argv", "import no args", ["import", *cache]),
              Case("argv", "import two bundles", ["import", *cache, "a.tar", "b.tar"]),
              Case("argv", "export no path", ["export", *TINY, *cache]),
              # never /dev/null or /dev/full themselves: before round 2's fix, root's export replaced the device
              Case("argv", "export onto a FIFO", ["export", *TINY, *cache, str(base / "files" / "fifo")],
                   codes=(2, 5)),
              Case("argv", "export onto a link to a FIFO", ["export", *TINY, *cache,
                                                            str(base / "files" / "link-to-fifo")], codes=(2, 5)),
              Case("argv", "no command", [], codes=(2,)),
              Case("argv", "unknown command", ["frobnicate"]),
              Case("argv", "non-utf8 argv", ["plan", "--target", "cpu", "--model-architecture", "\udcff"],
                   codes=(0, 2))]
    return cases


def env_cases(base: Path, files: dict[str, str]) -> list[Case]:
    """Each variable under a command that reads it (a setting is read only where it is used)."""
    cases = []
    cache = ["--cache-dir", str(base / "env-cache")]
    redis = ["--remote", "redis://127.0.0.1:6390/0"]  # loopback; down or up, a bad setting fails first
    readers = {"JITWARM_JOBS": ["warm", *FAST, *cache], "JITWARM_PRUNE_GRACE_S": ["prune", *cache],
               "JITWARM_BUNDLE_MAX_BYTES": ["import", *cache, str(base / "bundles" / "junk-entry.tar")],
               "JITWARM_BUNDLE_MAX_FILE_BYTES": ["import", *cache, str(base / "bundles" / "junk-entry.tar")],
               "JITWARM_REMOTE": ["status", *FAST, *cache, "--remote"],
               "JITWARM_ALLOW_SHARED": ["status", *FAST, *cache],
               **{v: ["status", *FAST, *cache, *redis] for v in ("JITWARM_REMOTE_PREFIX", "JITWARM_REMOTE_REQUIRED",
                                                                   "JITWARM_REMOTE_LEASE_S",
                                                                   "JITWARM_REMOTE_MAX_BYTES")},
               "JITWARM_CACHE_DIR": ["status", *FAST], "JITWARM_CACHE_PATH": ["status", *FAST, *cache],
               "JITWARM_LOCK_DIR": ["warm", *FAST, *cache]}
    for var, argv in readers.items():
        for value in BAD_ENV_VALUES:
            if var in ("JITWARM_CACHE_DIR", "JITWARM_LOCK_DIR", "JITWARM_CACHE_PATH") and value != "x" * 5000:
                continue  # any short string is a relative path: fine
            valid = var == "JITWARM_REMOTE_PREFIX" and value in ("nan", "maybe")  # a fine namespace: not ready
            cases.append(Case("env", f"{var}={value[:12]!r}", argv, codes=(2, 5) if valid else (2,),
                              env={var: value}))
    for var in ("JITWARM_CACHE_DIR", "JITWARM_CACHE_PATH", "JITWARM_LOCK_DIR"):
        for kind in ("fifo", "symlink-to-fifo", "dev-zero", "binary", "proc-self-mem"):
            cases.append(Case("env", f"{var}={kind}", readers[var], codes=(2,), env={var: files[kind]}))
    return cases


def file_cases(base: Path, files: dict[str, str], manifests: dict[str, str], bundles: dict[str, str]) -> list[Case]:
    cases = []
    cache = ["--cache-dir", str(base / "file-cache")]
    for kind, path in files.items():
        cases.append(Case("files", f"--config {kind}", ["plan", "--config", path, "--target", "cpu"]))
        cases.append(Case("files", f"--manifest {kind}", ["plan", "--manifest", path, "--target", "cpu"],
                          codes=(0, 2) if kind in ("empty", "many-lines") else (2,)))
        cases.append(Case("files", f"import {kind}", ["import", *cache, path], codes=(2, 4)))  # 4: corrupt
        cases.append(Case("files", f"sglang --model-path dir with config.json {kind}", []))  # filled below
        model = base / "models" / kind
        model.mkdir(parents=True)
        if kind not in ("missing",):
            (model / "config.json").symlink_to(path)
        cases[-1].argv = ["plan", "--target", "cpu", "--", "python", "-m", "sglang.launch_server", "--model-path",
                          str(model)]
        cases[-1].codes = (0, 2)
    for name, path in manifests.items():
        codes = (1, 2) if name.startswith("kernel-") or name.startswith("spec-") or name.startswith("sglang-") \
            else (2,)
        if name == "torn-only":
            codes = (0, 2)
        cases.append(Case("manifest", f"warm --manifest {name}", ["warm", "--manifest", path, "--target", "cpu",
                                                                  *cache, "--json"], codes=codes, timeout=60))
        cases.append(Case("manifest", f"status --manifest {name}", ["status", "--manifest", path, "--target", "cpu",
                                                                    *cache, "--json"], codes=(*codes, 5)))
    for name, path in bundles.items():
        cases.append(Case("bundle", f"import {name}", ["import", *cache, path, "--json"], codes=(2, 4)))
        if name in ("absolute.tar", "symlink.tar", "size-lie.tar"):  # and a few through prestart --json
            cases.append(Case("bundle", f"prestart --bundle {name}", ["prestart", *FAST, *cache, "--bundle", path,
                                                                      "--json"], codes=(2, 4)))
    return cases


def other_user_cases(base: Path) -> list[Case]:
    """Root meets files another user owns; the other user meets root's cache."""
    if os.geteuid() != 0:
        return []
    try:
        other = pwd.getpwnam(OTHER)
    except KeyError:
        return []
    d = base / "other"
    d.mkdir()
    d.chmod(0o755)
    theirs = d / "theirs"
    theirs.mkdir()
    good = json.dumps(MANIFEST_RECORDS["kernel-missing-module"]) + "\n"
    (theirs / "m.jsonl").write_text(good)
    (theirs / "c.toml").write_text("cuda_graph_max_bs = 4\n")
    (theirs / "cache").mkdir()
    (theirs / "locks").mkdir()
    for p in [theirs, *theirs.iterdir()]:
        os.chown(p, other.pw_uid, other.pw_gid)
    ours = d / "ours"
    ours.mkdir()
    ours.chmod(0o755)
    our_cache = ours / "cache"
    run_cli(["warm", *FAST, "--cache-dir", str(our_cache)], timeout=120)
    cache = ["--cache-dir", str(base / "other-run-cache")]
    return [
        Case("other-user", "root: --manifest theirs", ["warm", "--manifest", str(theirs / "m.jsonl"), "--target",
                                                       "cpu", *cache]),
        Case("other-user", "root: status --manifest theirs", ["status", "--manifest", str(theirs / "m.jsonl"),
                                                              "--target", "cpu", *cache]),
        Case("other-user", "root: --config theirs", ["plan", "--config", str(theirs / "c.toml"), "--target", "cpu"],
             codes=(0, 2)),
        Case("other-user", "root: --cache-dir theirs", ["status", *FAST, "--cache-dir", str(theirs / "cache")]),
        Case("other-user", "root: JITWARM_LOCK_DIR theirs", ["warm", *FAST, *cache],
             env={"JITWARM_LOCK_DIR": str(theirs / "locks")}),
        Case("other-user", "root: JITWARM_CACHE_PATH theirs", ["status", *FAST, *cache], codes=(2, 5),
             env={"JITWARM_CACHE_PATH": str(theirs / "cache")}),
        Case("other-user", "them: warm into root's cache", ["warm", *FAST, "--cache-dir", str(our_cache)],
             codes=(0, 1, 2), user=OTHER),
        Case("other-user", "them: status root's cache", ["status", *FAST, "--cache-dir", str(our_cache)],
             codes=(0, 2, 5), user=OTHER),
        Case("other-user", "them: verify --all root's cache", ["verify", "--all", "--cache-dir", str(our_cache)],
             codes=(0, 2), user=OTHER),
        Case("other-user", "them: verify --repair root's cache", ["verify", "--all", "--repair", "--cache-dir",
                                                                  str(our_cache)], codes=(0, 1, 2), user=OTHER),
        Case("other-user", "them: prune root's cache", ["prune", "--max-bytes", "0", "--cache-dir", str(our_cache)],
             codes=(0, 1, 2), user=OTHER),
        Case("other-user", "them: export root's cache", ["export", *FAST, "--cache-dir", str(our_cache),
                                                         str(d / "them.tar")], codes=(1, 2), user=OTHER),
        Case("other-user", "them: no writable home", ["warm", *FAST], codes=(1, 2), user=OTHER,
             env={"XDG_CACHE_HOME": ""}),
        Case("other-user", "them: 0000 cache dir", ["status", *FAST, "--cache-dir", str(d / "locked" / "c")],
             codes=(1, 2, 5), user=OTHER),
    ]


def prepare_locked(base: Path) -> None:
    locked = base / "other" / "locked"
    if (base / "other").exists():
        locked.mkdir()
        locked.chmod(0)


# -- full disk and kills -------------------------------------------------------------------------------------

def full_disk(base: Path) -> list[Outcome]:
    """warm, export and import on a 256 KiB tmpfs: a one-line exit 1 (or 2), nothing half-written left."""
    if os.geteuid() != 0:
        return []
    mnt = base / "tmpfs"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        return []
    outcomes = []
    try:
        (mnt / "ballast").write_bytes(b"\0" * (200 << 10))  # what is left holds a few small entries at most
        cases = [Case("full-disk", "warm SMALL into full tmpfs", ["warm", *SMALL, "--cache-dir", str(mnt / "c")],
                      codes=(1,), timeout=240),
                 Case("full-disk", "warm FAST json into full tmpfs", ["warm", *FAST, "--cache-dir", str(mnt / "c"),
                                                                      "--json"], codes=(0, 1), timeout=120),
                 Case("full-disk", "export to full tmpfs", ["export", *FAST, "--cache-dir", str(base / "kill-0"),
                                                            str(mnt / "k.tar")], codes=(1, 5), timeout=60)]
        for case in cases:
            outcome = classify(case)
            outcomes.append(outcome)
        # nothing half-written: verify --all on what is there is 0, staging holds nothing
        verify = classify(Case("full-disk", "verify --all after full disk", ["verify", "--all", "--cache-dir",
                                                                            str(mnt / "c")], codes=(0,)))
        outcomes.append(verify)
        staged = [p for p in (mnt / "c").glob("v1/staging/*")]
        outcomes.append(Outcome(verify.case, "good" if not staged else "corrupt", 0, f"staging: {len(staged)}"))
        left = [p for p in mnt.iterdir() if p.name not in ("ballast", "c")]
        outcomes.append(Outcome(Case("full-disk", "no partial bundle left", []), "good" if not left else "corrupt",
                                0, " ".join(p.name for p in left)))
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)
    return outcomes


def kills(base: Path, count: int) -> list[Outcome]:
    """SIGKILL warm at random moments mid-build, then verify --all: exit 0 (nothing corrupt) every time."""
    rng = random.Random(20)
    outcomes = []
    for i in range(count):
        plan = SMALL if i % 3 == 2 else FAST
        root = base / f"kill-{i % 3}"
        env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
        proc = subprocess.Popen([sys.executable, "-m", "jitwarm", "warm", *plan, "--cache-dir", str(root),
                                 "--jobs", "2"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                                cwd="/tmp", start_new_session=True)
        time.sleep(rng.uniform(0.3, 3.0 if plan is FAST else 8.0))
        os.killpg(proc.pid, signal.SIGKILL)  # the warm and its build workers, as an OOM kill of the pod would
        proc.wait()
        case = Case("kill", f"SIGKILL #{i} then verify --all", ["verify", "--all", "--cache-dir", str(root)],
                    codes=(0,))
        outcomes.append(classify(case))
    # and the warm after the kills finishes what they left, every spec verified
    for i in range(min(count, 3)):
        plan = SMALL if i == 2 else FAST
        outcomes.append(classify(Case("kill", f"warm after kills #{i}", ["warm", *plan, "--cache-dir",
                                                                         str(base / f"kill-{i}")],
                                      codes=(0,), timeout=240)))
    return outcomes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=6)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--only", default="", help="run only cases whose group or name contains this")
    args = parser.parse_args()
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="jitwarm-attack-") as tmp:
        base = Path(tmp)
        base.chmod(0o755)
        files = hostile_files(base)
        cases = [*argv_cases(base), *env_cases(base, files),
                 *file_cases(base, files, manifest_files(base), bundle_files(base)), *other_user_cases(base)]
        prepare_locked(base)
        cases = [c for c in cases if (args.only in c.group or args.only in c.name)
                 and (c.user is None or other_user_can_run())]
        with ThreadPoolExecutor(args.jobs) as pool:
            outcomes = list(pool.map(classify, cases))
        if not args.only or args.only in "kill":
            outcomes += kills(base, args.kills)
        if not args.only or args.only in "full-disk":
            outcomes += full_disk(base)
        if (base / "other" / "locked").exists():
            (base / "other" / "locked").chmod(0o700)
    escaped = [p for p in (Path("/tmp/jitwarm-attack-escaped"),) if p.exists()]
    groups: dict[str, dict[str, int]] = {}
    for o in outcomes:
        groups.setdefault(o.case.group, {}).setdefault(o.verdict, 0)
        groups[o.case.group][o.verdict] += 1
    verdicts = ["good", "traceback", "wrong-code", "hang", "multi-line", "bad-json", "corrupt"]
    print(f"{'group':<12}{'cases':>7}" + "".join(f"{v:>12}" for v in verdicts))
    for group, counts in groups.items():
        print(f"{group:<12}{sum(counts.values()):>7}" + "".join(f"{counts.get(v, 0):>12}" for v in verdicts))
    total = {v: sum(c.get(v, 0) for c in groups.values()) for v in verdicts}
    print(f"{'all':<12}{len(outcomes):>7}" + "".join(f"{total[v]:>12}" for v in verdicts))
    print(f"escaped files: {len(escaped)}; {time.monotonic() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
