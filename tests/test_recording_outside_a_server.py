"""A recording made outside any server, where sglang is installed, records where the library really wrote and is
restored where the library looks in the restoring environment (issue #31).

The recorder's load_jit wrapper imported sglang's loader wherever sglang was importable, and importing sglang
redirects the process's JIT caches under ``SGLANG_CACHE_DIR`` (srt/environ.py:2308-2320): the recording took
itself for an sglang server, its Inductor units went to ``~/.cache/sglang/inductor`` and were stored ``"under":
"sglang"``. Here a plain process with the real sglang 0.5.23 wheel importable records one Inductor module written
where Inductor writes by default (``$TMPDIR/torchinductor_<user>``), without importing sglang, and a restore with
another ``TMPDIR`` puts it there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from precompile_fixtures import jitwarm

RECORD = """
import json, sys
from pathlib import Path
from jitwarm.cache import KernelCache
from jitwarm.precompile import record
with record(sys.argv[1], KernelCache(sys.argv[2])) as recorder:
    root = Path(sys.argv[3])
    (root / "ha").mkdir(parents=True)
    (root / "ha" / "chamod.main.cpp").write_text("extern")
    (root / "ha" / "chamod.main.so").write_bytes(b"\\x7fELF" + bytes(60))
print(json.dumps({"under": recorder.under, "sglang": "sglang" in sys.modules}))
"""


def test_a_plain_process_records_inductors_own_directory_not_sglangs(tmp_path, sglang_env):
    import getpass

    tmp_a, tmp_b = tmp_path / "tmp-a", tmp_path / "tmp-b"
    tmp_a.mkdir()
    inductor = tmp_a / f"torchinductor_{getpass.getuser()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHINDUCTOR_", "SGLANG_", "JITWARM_RECORD"))}
    env.update(sglang_env, TMPDIR=str(tmp_a), HOME=str(tmp_path / "home"), JITWARM_RECORD_CACHES="inductor")
    proc = subprocess.run([sys.executable, "-c", RECORD, str(tmp_path / "m.jsonl"), str(tmp_path / "cache"),
                           str(inductor)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.splitlines()[-1])
    assert seen == {"under": "", "sglang": False}  # the recorder imported nothing of sglang's: its caches stay put
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [(r["library"], r["unit"], r["under"]) for r in records] == [("inductor", "ha/chamod", "")]
    tmp_b.mkdir()
    restored = jitwarm("prestart", "--manifest", str(tmp_path / "m.jsonl"), "--cache-dir", str(tmp_path / "cache"),
                       "--offline", env={"TMPDIR": str(tmp_b), "HOME": str(tmp_path / "home")})
    assert restored.returncode == 0, restored.stderr
    assert (tmp_b / f"torchinductor_{getpass.getuser()}" / "ha" / "chamod.main.so").is_file()
    assert not (tmp_path / "home" / ".cache" / "sglang").exists()
