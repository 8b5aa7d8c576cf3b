"""The plugin tests' scenario runner: one worker script per scenario, all forked from one import of the server.

Each scenario is the worker as its own process in the eyes of the server and of jitwarm (its own environment,
argv, stderr, exit and atexit); what they share is the server's import, done once before the forks
(``workers/zygote.py`` says why that is sound). Used by tests/test_sglang_plugin.py and tests/test_vllm_plugin.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

ZYGOTE = Path(__file__).resolve().parent / "workers" / "zygote.py"


def probes(result: dict) -> dict[str, dict[str, str]]:
    """A ``--probe`` scenario's outcomes (``workers/capture_probes.py``): where -> library -> outcome."""
    out: dict[str, dict[str, str]] = {}
    for o in result["probes"]:
        out.setdefault(o["where"], {})[o["probe"]] = o["outcome"]
    return out


def run_scenarios(worker: Path, scenarios: Mapping[str, tuple[dict, Sequence[str]]], base_env: Mapping[str, str],
                  preload: Sequence[str], tmp_path_factory, toml: str, plugin_logger: str,
                  timeout: float) -> dict[str, tuple[dict, list[str]]]:
    """Run ``worker OUT.json *flags`` for every scenario; name -> (its result, its lines from ``plugin_logger``).

    ``scenarios``: name -> (environment on top of ``base_env``, flags); ``{tmp}`` in a value is the scenario's own
    directory, which holds ``jitwarm.toml`` (``toml``), its cache and its stderr. A scenario that exits non-zero
    fails the caller with the end of its stderr.
    """
    jobs, tmps = [], {}
    for name, (env, flags) in scenarios.items():
        tmp = tmps[name] = tmp_path_factory.mktemp(name)
        (tmp / "jitwarm.toml").write_text(toml)
        jobs.append({"argv": [str(tmp / "result.json"), *flags], "stderr": str(tmp / "stderr.txt"),
                     "env": {**base_env, "JITWARM_CACHE_DIR": str(tmp / "cache"),
                             **{k: v.format(tmp=tmp) for k, v in env.items()}}})
    spec = tmp_path_factory.mktemp("zygote") / "jobs.json"
    spec.write_text(json.dumps({"preload": list(preload), "worker": str(worker), "jobs": jobs}))
    proc = subprocess.run([sys.executable, str(ZYGOTE), str(spec)], env=dict(base_env), capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-6000:]
    codes = json.loads(proc.stdout.strip().splitlines()[-1])
    results = {}
    for (name, tmp), code in zip(tmps.items(), codes, strict=True):
        stderr = (tmp / "stderr.txt").read_text()
        assert code == 0, f"{name}: exit {code}: {stderr[-6000:]}"
        result = json.loads((tmp / "result.json").read_text())
        result["log"] = [line for line in stderr.splitlines() if line.startswith("LOG ")]
        result["tmp"] = str(tmp)
        results[name] = result, [line for line in result["log"] if line.startswith(f"LOG {plugin_logger} ")]
    return results
