"""Which of jitwarm's kernel families the served model runs, from its architecture as vLLM's registry names it.

jitwarm's families (the compress plan, the compressor and the fused norm_rope) are DeepSeek-V4's. vLLM picks its
model class by the checkpoint's ``architectures`` (``model_executor/models/registry.py``); the DeepSeek-V4 ones
are :data:`DSV4_ARCHITECTURES`. ``--model-architecture`` wins; else a local checkpoint's ``config.json`` (read
bounded, never a FIFO) decides; a hub id whose name says DeepSeek-V4 is taken as one; any other model is
unknown and gets every family, since a family skipped that the model does run would compile inside capture.
"""

from __future__ import annotations

import errno
import re
from pathlib import Path

from jitwarm.cache import files
from jitwarm.cache.errors import UsageError
from jitwarm.precompile.servers import ModelFamilies

#: vLLM's DeepSeek-V4 classes (model_executor/models/registry.py:99, :383-389, :676-679, :718): the target, its
#: multimodal and 4.1 variants, the DSpark drafts and the MTP draft.
DSV4_ARCHITECTURES = frozenset({"DeepseekV4ForCausalLM", "DeepseekV4ForConditionalGeneration",
                                "DeepseekV41ForCausalLM", "DSparkDraftModel", "DSparkDeepseekV4ForCausalLM",
                                "DeepSeekV4MTPModel"})
#: Largest config.json read (a real one is a few KiB).
MAX_CONFIG_BYTES = 4 << 20
_DSV4_NAME = re.compile(r"deepseek[-_ .]?v4|(?<![a-z0-9])dsv4", re.IGNORECASE)


class ModelConfigError(UsageError):
    """The local checkpoint's config.json cannot be read or is malformed (exit 2)."""


def model_families(families: tuple[str, ...], model_path: str | None,
                   architecture: str | None = None) -> ModelFamilies:
    """Decide which of ``families`` a vLLM server of this model runs: every one for DeepSeek-V4, none otherwise.

    Raises
    ------
    ModelConfigError
        ``model_path`` is a local directory whose config.json is unreadable, not JSON, or names its
        architectures wrongly.

    """
    if architecture is not None:
        return _decided(families, architecture, f"architecture {architecture} (--model-architecture, or the "
                                                "server's own model config)")
    if model_path is None:
        return ModelFamilies(families, (), None, "no model given: every family planned")
    if Path(model_path).is_dir():
        names = _architectures(Path(model_path) / "config.json")
        if names:
            found = next((n for n in names if n in DSV4_ARCHITECTURES), names[0])
            return _decided(families, found, f"architectures {names} in {model_path}/config.json")
        return ModelFamilies(families, (), None, f"{model_path} names no architecture: every family planned "
                                                 "(--model-architecture NAME decides)")
    if _DSV4_NAME.search(model_path):
        return ModelFamilies(families, (), "DeepseekV4ForCausalLM", f"{model_path} is not a local path; its name "
                             "says DeepSeek-V4: every family planned")
    return ModelFamilies(families, (), None, f"{model_path} is not a local checkpoint and its name does not say "
                                             "DeepSeek-V4: architecture unknown, every family planned "
                                             "(--model-architecture NAME skips the families it does not run)")


def _decided(families: tuple[str, ...], architecture: str, where: str) -> ModelFamilies:
    if architecture in DSV4_ARCHITECTURES:
        return ModelFamilies(families, (), architecture, f"{where}: DeepSeek-V4, every family planned")
    return ModelFamilies((), families, architecture,
                         f"{where}: not DeepSeek-V4, which alone runs {', '.join(families)}: skipped")


def _architectures(path: Path) -> list[str]:
    """The ``architectures`` a local config.json lists ([] when there is no file or it names none)."""
    try:
        doc = files.read_json(path, MAX_CONFIG_BYTES)
    except FileNotFoundError:
        return []
    except OSError as exc:
        why = "it is not a regular file" if exc.errno in (errno.EINVAL, errno.ELOOP) else exc.strerror or str(exc)
        raise ModelConfigError(f"cannot read the model's {path}: {why}") from None
    except ValueError as exc:
        raise ModelConfigError(f"the model's {path} is not valid JSON: {str(exc).splitlines()[0][:200]}") from None
    names = doc.get("architectures") if isinstance(doc, dict) else None
    if names is None:
        return []
    if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
        raise ModelConfigError(f"the model's {path}: \"architectures\" must be a list of names, got {names!r:.200}")
    return names
