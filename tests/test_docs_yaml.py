"""The Kubernetes YAML in the docs runs as written (issue #31): every ```yaml block is whole manifests that parse,
every volume a container mounts is declared, a ``JITWARM_CONFIG`` file is mounted from a ConfigMap that holds it (and
parses as jitwarm's config), each server container requests its GPUs, every ``JITWARM_*`` variable is one jitwarm
reads, and each init container's jitwarm command line parses as the CLI parses it.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import pytest
import yaml

from jitwarm.cache import settings
from jitwarm.precompile.cli import build_parser
from jitwarm.precompile.config import read_config_file
from jitwarm.precompile.flags import split_server_argv

ROOT = Path(__file__).resolve().parents[1]
BLOCKS = [(path.relative_to(ROOT), block) for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
          for block in re.findall(r"```yaml\n(.*?)```", path.read_text(), re.S)]


def test_the_docs_hold_kubernetes_yaml():
    assert len(BLOCKS) >= 3


@pytest.mark.parametrize("where, block", BLOCKS, ids=[f"{p}#{i}" for i, (p, _) in enumerate(BLOCKS)])
def test_each_yaml_block_is_whole_manifests_that_run_as_written(where, block):
    docs = [d for d in yaml.safe_load_all(block) if d is not None]
    assert docs and all({"apiVersion", "kind", "metadata"} <= set(d) for d in docs), where
    maps = {d["metadata"]["name"]: d.get("data", {}) for d in docs if d["kind"] == "ConfigMap"}
    pods = [d for d in docs if d["kind"] == "Pod"]
    assert pods, where
    from jitwarm.precompile.servers import plugins
    from jitwarm.precompile.servers.sglang import plugin as sglang_plugin
    from jitwarm.precompile.servers.vllm import plugin as vllm_plugin

    known = {*settings.ENV_VARS.values(), plugins.CONFIG_ENV, plugins.MANIFEST_ENV, plugins.RECORD_ENV,
             plugins.TRITON_CACHE_ENV, sglang_plugin.ENABLE_ENV, vllm_plugin.ENABLE_ENV}
    for pod in pods:
        volumes = {v["name"]: v for v in pod["spec"].get("volumes", [])}
        for init in pod["spec"].get("initContainers", []):
            _check_mounts(init, volumes)
            argv = [*init.get("command", []), *init.get("args", [])]
            assert argv[0] == "jitwarm", init["name"]
            own, server = split_server_argv(argv[1:])
            assert server, "the init container plans from the server's own line, after --"
            build_parser().parse_args(own)  # a flag the CLI does not take fails here
        for container in pod["spec"]["containers"]:
            mounts = _check_mounts(container, volumes)
            assert int(container["resources"]["limits"]["nvidia.com/gpu"]) >= 1, container["name"]
            env = {e["name"]: e.get("value") for e in container.get("env", [])}
            assert {name for name in env if name.startswith("JITWARM_")} <= known, env
            if "JITWARM_CONFIG" in env:
                path = Path(env["JITWARM_CONFIG"])
                mount = next((m for m in mounts if path.parent == Path(m["mountPath"])), None)
                assert mount is not None, f"nothing mounts {path.parent} for JITWARM_CONFIG"
                source = volumes[mount["name"]].get("configMap", {}).get("name")
                assert source in maps and path.name in maps[source], f"no ConfigMap holds {path.name}"
                with tempfile.NamedTemporaryFile("w", suffix=".toml") as f:
                    f.write(maps[source][path.name])
                    f.flush()
                    read_config_file(f.name)  # jitwarm reads it as written


def _check_mounts(container: dict, volumes: dict) -> list[dict]:
    mounts = container.get("volumeMounts", [])
    assert all(m["name"] in volumes for m in mounts), f"{container['name']} mounts an undeclared volume"
    return mounts
