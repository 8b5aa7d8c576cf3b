"""Which of jitwarm's kernel families the served model runs, from its architecture as the server's classes name it.

The families are DeepSeek-V4's; each room names its DeepSeek-V4 classes (``DSV4_ARCHITECTURES``). An unknown
model gets every family: a family skipped that the model does run would compile inside capture.
"""

from __future__ import annotations

import errno
import re
from collections.abc import Set
from pathlib import Path

from jitwarm.cache import files
from jitwarm.cache.errors import UsageError
from jitwarm.precompile.servers import ModelFamilies

#: Largest config.json read (a real one is a few KiB; one with a quantization table some hundred KiB).
MAX_CONFIG_BYTES = 4 << 20
#: A hub id or path whose name says DeepSeek-V4 (deepseek-ai/DeepSeek-V4-Flash, org/deepseek_v4-base, /models/dsv4).
_DSV4_NAME = re.compile(r"deepseek[-_ .]?v4|(?<![a-z0-9])dsv4", re.IGNORECASE)
_UNKNOWN = "architecture unknown, every family planned (--model-architecture NAME decides)"


def model_families(families: tuple[str, ...], model_path: str | None, architecture: str | None,
                   dsv4: Set[str]) -> ModelFamilies:
    """Decide which of ``families`` a server of this model runs: every one for DeepSeek-V4 (``dsv4``), none else.

    ``architecture`` wins; else a local checkpoint's config.json decides, then a hub id whose name says DeepSeek-V4.
    Raises a UsageError for a local config.json that is unreadable, too large, not a JSON object, or whose
    ``architectures`` is not a list of names.
    """
    if architecture is not None:
        return _decided(families, architecture, dsv4, f"architecture {architecture} (--model-architecture, or "
                                                      "the server's own model config)")
    if model_path is None:
        return ModelFamilies(families, (), None, "no model given: every family planned")
    local = Path(model_path)
    if local.is_dir():
        names = _local_architectures(local / "config.json")
        if not names:
            what = "has no config.json" if names is None else "has a config.json that names no architectures"
            return ModelFamilies(families, (), None, f"{model_path} {what}: {_UNKNOWN}")
        found = next((n for n in names if n in dsv4), names[0])
        return _decided(families, found, dsv4, f"architectures {names} in {model_path}/config.json")
    if local.exists():
        return ModelFamilies(families, (), None, f"{model_path} is a file, not a checkpoint directory: {_UNKNOWN}")
    if _DSV4_NAME.search(model_path):
        return ModelFamilies(families, (), "DeepseekV4ForCausalLM",
                             f"{model_path} is not a local path; its name says DeepSeek-V4: every family planned "
                             "(--model-architecture NAME says otherwise)")
    return ModelFamilies(families, (), None, f"{model_path} is not a local path and its name does not say "
                                             f"DeepSeek-V4: {_UNKNOWN}")


def _decided(families: tuple[str, ...], architecture: str, dsv4: Set[str], where: str) -> ModelFamilies:
    """Every family for a DeepSeek-V4 architecture, none for any other."""
    if architecture in dsv4:
        return ModelFamilies(families, (), architecture, f"{where}: DeepSeek-V4, every family planned")
    return ModelFamilies((), families, architecture,
                         f"{where}: not DeepSeek-V4, which alone runs {', '.join(families)}: skipped")


def _local_architectures(path: Path) -> list[str] | None:
    """The ``architectures`` of a local config.json ([] when it names none); None when there is no such file."""
    try:
        doc = files.read_json(path, MAX_CONFIG_BYTES)
    except FileNotFoundError:
        return None
    except OSError as exc:
        why = "it is not a regular file" if exc.errno in (errno.EINVAL, errno.ELOOP) else exc.strerror or str(exc)
        raise UsageError(f"cannot read the model's {path}: {why}") from None
    except ValueError as exc:
        raise UsageError(f"the model's {path} is not valid JSON: {str(exc).splitlines()[0][:200]}") from None
    if not isinstance(doc, dict):
        raise UsageError(f"the model's {path} is not a JSON object")
    names = doc.get("architectures", [])
    if names is None:
        return []
    if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
        raise UsageError(f"the model's {path}: \"architectures\" must be a list of names, got {names!r:.200}")
    return names
