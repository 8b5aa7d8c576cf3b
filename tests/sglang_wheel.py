"""The real sglang wheel of the room's VERSION (0.5.23) for the oracle tests, installed without its dependencies.

sglang's own requirements (torch 2.14.1, flashinfer, CUDA kernels: several GB) cannot be installed here, and
need not be: the modules the oracle calls (argument parsing and resolution hooks, the runtime context, the
decode CUDA-graph runner, the model runner class, ragged verify) import with the small pure-Python or
small-wheel packages below, found by trial (install sglang alone, import, add what the import asks for,
repeat). Versions are pinned; where sglang pins a package (transformers, tokenizers, compressed-tensors,
openai, sentencepiece) its pin is used. The interpreter's own torch (2.13 CPU) stands in for sglang's.

torchvision cannot be installed next to that torch, and ``sglang.srt.configs`` imports it on the way to
the runner (``srt/multimodal/internvl_utils.py:5``: ``import torchvision.transforms as T``), only to build
image transforms later. :data:`TORCHVISION_STUB` is a package in the target directory that makes every
``torchvision.*`` import succeed and every use raise, so nothing can silently compute with it.
"""

from __future__ import annotations

from pathlib import Path

from wheels import import_env, install_once

from jitwarm.precompile.servers.sglang import VERSION as SGLANG_VERSION  # the release the sglang room mirrors

#: What the oracle's imports need, beside the interpreter's torch, numpy and typing_extensions.
PACKAGES = (
    f"sglang=={SGLANG_VERSION}", "transformers==5.19.0", "tokenizers==0.23.2", "compressed-tensors==0.18.0",
    "openai==2.8.0", "sentencepiece==0.2.1", "aiohappyeyeballs==2.7.1", "aiohttp==3.14.5", "aiosignal==1.4.0",
    "annotated_doc==0.0.7", "annotated_types==0.8.0", "anyio==4.16.0", "attrs==26.1.0",
    "certifi==2026.10.19.post1", "click==8.5.1", "dill==0.4.1", "distro==1.9.0", "einops==0.8.2",
    "fastapi==0.165.0", "frozenlist==1.8.0", "gguf==0.19.0", "h11==0.16.0", "httpcore2==2.16.2", "httpx==0.28.1",
    "httpx2==2.16.2", "huggingface_hub==2.4.0", "idna==3.20", "ipython==9.18.1", "loguru==0.7.3",
    "msgspec==0.23.0", "multidict==7.2.1", "opentelemetry-api==1.45.2", "orjson==3.13.0",
    "partial_json_parser==0.2.1.1.post7", "pillow==13.0.0", "propcache==0.5.4", "psutil==7.2.2",
    "pybase64==1.5.1", "pydantic==2.14.4", "pydantic_core==2.50.5", "pyyaml==6.0.4", "pyzmq==27.3.0",
    "regex==2026.11.19", "requests==2.34.2", "safetensors==0.8.0", "setproctitle==1.3.8", "sniffio==1.3.1",
    "starlette==1.10.0", "tqdm==4.70.1", "traitlets==5.16.1", "truststore==0.10.5", "typing_inspection==0.4.5",
    "urllib3==2.8.0", "uvicorn==0.54.0", "yarl==1.25.1",
)

TORCHVISION_STUB = '''\
"""Stand-in for torchvision in jitwarm's sglang test env: every torchvision.* imports, every use raises."""
import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+jitwarm.stub"


class _Stub:
    def __init__(self, name):
        self._name = name

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Stub(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name}: torchvision is a stub in jitwarm's sglang test env")

    def __mro_entries__(self, bases):
        return (object,)


class _StubModule(types.ModuleType):
    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Stub(f"{self.__name__}.{attr}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Finder())
'''


def install() -> dict[str, str]:
    """Install the wheel and :data:`PACKAGES` once per machine (tests/wheels.py); return the env to import it.

    The returned variables go on top of the caller's environment (``{**os.environ, **env}``): ``PYTHONPATH``
    puts the install first, and Hugging Face libraries are kept offline (nothing here downloads a model).

    Raises
    ------
    WheelUnavailable
        pip is missing, cannot reach the index, or fails; the message carries pip's last error line.

    """
    target = install_once(f"sglang-{SGLANG_VERSION}", PACKAGES, "sglang/__init__.py", finish=_stub_torchvision)
    return {**import_env(target), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def _stub_torchvision(staging: Path) -> None:
    """Write :data:`TORCHVISION_STUB` as the install's ``torchvision`` package."""
    (staging / "torchvision").mkdir()
    (staging / "torchvision" / "__init__.py").write_text(TORCHVISION_STUB, encoding="utf-8")
