"""ServingConfig: the server settings that decide which CUDA graphs get captured, plus model dims and targets.

The capture settings carry the names of the sglang release the sglang room mirrors (``--cuda-graph-max-bs-decode``,
``--tp-size``, ...) and come from jitwarm's flags, from the server's own command line after ``--`` (read by the
room that recognises it, :mod:`jitwarm.precompile.servers`), from a TOML file (those three:
:mod:`jitwarm.precompile.config_sources`), or from an sglang ``ServerArgs`` object inside a server.
Construction checks them with the room's built-in rules, and keeps that resolution for
:mod:`jitwarm.precompile.shapes`, which resolves the ladder only when something it depends on was not known here.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from jitwarm.cache.errors import UsageError
from jitwarm.kernels import BUILDABLE, DTYPES, ModelDims, Target, TargetError
from jitwarm.kernels.backend import refusal as backend_refusal
from jitwarm.precompile.servers.sglang import rules as sglang_rules
from jitwarm.precompile.servers.sglang.argv import graph_config_object

MODES = sglang_rules.VERIFY_MODES
MODE_ENV = "SGLANG_RAGGED_VERIFY_MODE"
LADDER_SOURCES = ("auto", "builtin", "sglang")

#: Largest batch size, draft-token count and parallel size accepted: larger is not a real server, and a
#: million-entry ladder would take minutes and gigabytes to enumerate.
MAX_BATCH_SIZE = 4096
MAX_DRAFT_TOKENS = 64
MAX_PARALLEL = 1024
MAX_GPU_MEMORY_MB = 16 << 20  # 16 TiB

class ConfigError(UsageError, ValueError):
    """A serving config or flag is invalid (exit 2); ``problems`` holds one message per problem."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        super().__init__("; ".join(self.problems))

    def __reduce__(self) -> tuple[type, tuple[object, ...]]:
        return (type(self), (self.problems,))


@functools.cache
def _local_gpus() -> tuple[tuple[str, str], ...]:
    """``(compute_cap, memory.total)`` of every GPU, from one nvidia-smi run per process (no torch import)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return ()
    try:
        out = subprocess.run([smi, "--query-gpu=compute_cap,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return ()
    rows = (tuple(v.strip() for v in line.split(",")) for line in out.splitlines() if line.strip())
    return tuple(row for row in rows if len(row) == 2)


def local_target() -> str:
    """Return the local GPU's arch as ``sm_XY`` (via nvidia-smi, no torch import), else ``cpu``."""
    try:
        major, minor = _local_gpus()[0][0].split(".")
        return f"sm_{int(major)}{int(minor)}"
    except (IndexError, ValueError):
        return "cpu"


def local_gpu_memory_mb() -> int | None:
    """Return the smallest local GPU's memory in MiB (as sglang's ``get_device_memory_capacity``), or None."""
    try:
        return min(int(float(memory)) for _, memory in _local_gpus()) or None
    except ValueError:
        return None


# Field -> (kind, flag used in messages). Kinds: "count" a positive int; "count0" zero or positive;
# "flag" a bool; "bs_list" a list of batch sizes.
_CHECKS: dict[str, tuple[str, str]] = {
    "cuda_graph_max_bs_decode": ("batch", "--cuda-graph-max-bs-decode"),
    "cuda_graph_bs_decode": ("bs_list", "--cuda-graph-bs-decode"),
    "disable_cuda_graph": ("flag", "--disable-cuda-graph"),
    "disable_decode_cuda_graph": ("flag", "--disable-decode-cuda-graph"),
    "disable_cuda_graph_padding": ("flag", "--disable-cuda-graph-padding"),
    "speculative_num_draft_tokens": ("draft", "--speculative-num-draft-tokens"),
    "speculative_num_steps": ("draft", "--speculative-num-steps"),
    "speculative_eagle_topk": ("draft", "--speculative-eagle-topk"),
    "max_running_requests": ("count", "--max-running-requests"),
    "tp_size": ("parallel", "--tp-size"),
    "dp_size": ("parallel", "--dp-size"),
    "attn_dp_size": ("parallel", "--attn-dp-size"),
    "enable_dp_attention": ("flag", "--enable-dp-attention"),
    "gpu_memory_mb": ("memory", "--gpu-memory-mb"),
    "head_dim": ("count", "--head-dim"),
    "model_path": ("text", "--model-path"),
    "model_architecture": ("text", "--model-architecture"),
    "num_q_heads": ("count", "--num-q-heads"),
    "num_kv_heads": ("count", "--num-kv-heads"),
}
_LIMITS = {"batch": MAX_BATCH_SIZE, "count": 1 << 20, "draft": MAX_DRAFT_TOKENS, "parallel": MAX_PARALLEL,
           "memory": MAX_GPU_MEMORY_MB}


@dataclass(frozen=True)
class ServingConfig:
    """The server settings that decide the capture ladder, plus the model dims and build targets.

    Capture fields are sglang's own, of the release ``VERSION`` (``--cuda-graph-max-bs-decode`` is
    ``cuda_graph_max_bs_decode``); None means "not given", so sglang's default applies (the default max batch
    comes from the device memory, ``gpu_memory_mb``, read from the local GPU when there is one). Construction
    normalises lists, reads ``SGLANG_RAGGED_VERIFY_MODE`` when no mode is given, and validates:
    :class:`ConfigError` lists every problem, including combinations sglang itself rejects.

    Examples
    --------
    >>> cfg = ServingConfig(cuda_graph_max_bs_decode=128, speculative_algorithm="DSPARK",
    ...                     speculative_num_draft_tokens=6, ragged_verify_mode="compact", targets=("cpu",))
    >>> cfg.model.compress_ratios
    (4, 128)

    """

    cuda_graph_max_bs_decode: int | None = None
    cuda_graph_bs_decode: tuple[int, ...] | None = None
    cuda_graph_config: str | None = None  # the --cuda-graph-config JSON object, as canonical JSON text
    disable_cuda_graph: bool = False
    disable_decode_cuda_graph: bool = False
    disable_cuda_graph_padding: bool = False
    speculative_algorithm: str | None = None
    speculative_num_draft_tokens: int | None = None
    speculative_num_steps: int | None = None
    speculative_eagle_topk: int | None = None
    max_running_requests: int | None = None
    tp_size: int = 1
    dp_size: int = 1
    attn_dp_size: int = 1
    enable_dp_attention: bool = False
    gpu_memory_mb: int | None = None
    ragged_verify_mode: str | None = None
    ladder_source: str = "auto"
    model_path: str | None = None  # the server's --model-path: a local checkpoint's config.json names its architecture
    model_architecture: str | None = None  # what config.json's "architectures" says, when the path is not local
    head_dim: int = ModelDims.head_dim  # the model dims default to ModelDims' (one place for them)
    rope_dim: int = ModelDims.rope_dim
    num_q_heads: int = ModelDims.num_q_heads
    num_kv_heads: int = ModelDims.num_kv_heads
    compress_ratios: tuple[int, ...] = ModelDims.compress_ratios
    dtype: str = ModelDims.dtype
    backends: tuple[str, ...] = ("tvm_ffi",)
    targets: tuple[str, ...] | None = None
    mode_from_env: bool = field(default=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        if self.ragged_verify_mode is None:
            env_mode = os.environ.get(MODE_ENV)
            set_("ragged_verify_mode", env_mode if env_mode is not None else "static")
            set_("mode_from_env", env_mode is not None)
        problems = _check_types(self)
        if problems:  # report the value problems of the well-typed fields with them, then stop
            self.validate(problems)
        if self.cuda_graph_bs_decode is not None:
            set_("cuda_graph_bs_decode", tuple(sorted(set(self.cuda_graph_bs_decode))))
        if isinstance(self.cuda_graph_config, Mapping):
            set_("cuda_graph_config", json.dumps(self.cuda_graph_config, sort_keys=True))
        if self.speculative_algorithm is not None:
            set_("speculative_algorithm", self.speculative_algorithm.upper())
        set_("compress_ratios", tuple(sorted(set(self.compress_ratios))))
        set_("backends", tuple(dict.fromkeys(self.backends)))
        if self.targets is None:
            set_("targets", (local_target(),))
        set_("targets", tuple(dict.fromkeys(self.targets)))
        self.validate()

    def validate(self, problems: Sequence[str] = ()) -> None:
        """Raise :class:`ConfigError` listing every problem (``problems`` found before, then these), or return."""
        problems = list(problems)
        if self.ladder_source not in LADDER_SOURCES:
            problems.append(f"unknown --ladder-source {self.ladder_source!r}; choose from {', '.join(LADDER_SOURCES)}")
        if not isinstance(self.rope_dim, int) or isinstance(self.rope_dim, bool) or self.rope_dim < 2 \
                or self.rope_dim % 2:
            problems.append(f"--rope-dim must be a positive even integer, got {self.rope_dim!r}")
        elif _is_int(self.head_dim) and self.rope_dim > self.head_dim:
            problems.append(f"--rope-dim {self.rope_dim} is larger than --head-dim {self.head_dim}")
        if self.dtype not in DTYPES:
            problems.append(f"unknown --dtype {self.dtype!r}; choose from {', '.join(DTYPES)}")
        backends = self.backends if _is_names(self.backends) else ()
        targets = self.targets if _is_names(self.targets) else ()
        if not self.backends:
            problems.append(f"no --backend given; choose from {', '.join(BUILDABLE)}")
        for backend in backends:
            if (refused := backend_refusal(backend, "build", flag="--backend")) is not None:
                problems.append(refused)
        if not self.targets:
            problems.append("no --target given; use cpu or a CUDA arch such as sm_90")
        for target in targets:
            try:
                Target.parse(target)
            except TargetError as exc:
                problems.append(f"--target: {exc}")
        source = f" (from {MODE_ENV})" if self.mode_from_env else ""
        if not isinstance(self.ragged_verify_mode, str):
            pass  # reported by the type checks
        elif self.ragged_verify_mode not in MODES and not (self.mode_from_env and not self.uses_verify_mode):
            # sglang reads the variable only where an algorithm could use it (ragged_verify.py:19-27).
            problems.append(f"unknown ragged verify mode {self.ragged_verify_mode!r}{source}; choose from "
                            f"{', '.join(MODES)}")
        elif not problems:
            try:
                sglang_rules.normalize_algorithm(self.speculative_algorithm)
                self._check_ladder()
            except sglang_rules.ResolutionError as exc:
                problems.append(str(exc))
        if problems:
            raise ConfigError(problems)

    def _check_ladder(self) -> None:
        """Resolve with the built-in rules (sglang refuses what they refuse) and keep the answer for the plan.

        Where the ladder reads the device memory and none is given, it is checked on an 80 GiB device and the
        answer is not kept: :func:`jitwarm.precompile.shapes.resolve_ladder` resolves it for the real one.
        """
        inputs = self.rule_inputs()
        if inputs["gpu_memory_mb"] is None and sglang_rules.reads_memory(inputs):
            inputs["gpu_memory_mb"] = 80 * 1024
        object.__setattr__(self, "_resolution", (inputs, sglang_rules.resolve(inputs)))

    def builtin_resolution(self, inputs: Mapping[str, Any]) -> dict[str, Any] | None:
        """The built-in rules' answer that construction computed, if it was for exactly ``inputs``; else None."""
        kept = getattr(self, "_resolution", None)
        return kept[1] if kept is not None and kept[0] == dict(inputs) else None

    @property
    def uses_verify_mode(self) -> bool:
        """True when sglang reads the verify mode: with any speculative algorithm (spec_info.py:249-253)."""
        return self.speculative_algorithm is not None

    @property
    def model(self) -> ModelDims:
        """The model dims the kernel families specialize on."""
        return ModelDims(head_dim=self.head_dim, rope_dim=self.rope_dim, num_q_heads=self.num_q_heads,
                         num_kv_heads=self.num_kv_heads, compress_ratios=self.compress_ratios,
                         dtype=self.dtype)

    @property
    def speculative(self) -> bool:
        """True when a speculative algorithm is set (draft tokens alone do not switch sglang's ladder)."""
        return self.speculative_algorithm is not None

    def rule_inputs(self, gpu_memory_mb: int | None = None) -> dict[str, Any]:
        """The raw settings :func:`jitwarm.precompile.sglang_rules.resolve` takes."""
        inputs = {name: getattr(self, name) for name in sglang_rules.INPUT_KEYS
                  if name not in ("kv_capacity", "gpu_memory_mb", "cuda_graph_config")}
        inputs["kv_capacity"] = None  # profiled by the server at start-up: a plan assumes it cuts nothing
        inputs["cuda_graph_bs_decode"] = list(self.cuda_graph_bs_decode) if self.cuda_graph_bs_decode else None
        inputs["cuda_graph_config"] = json.loads(self.cuda_graph_config) if self.cuda_graph_config else None
        inputs["gpu_memory_mb"] = gpu_memory_mb if gpu_memory_mb is not None else self.gpu_memory_mb
        inputs["ragged_verify_mode"] = self.ragged_verify_mode if self.ragged_verify_mode in MODES else "static"
        return inputs

    def to_json(self) -> dict[str, Any]:
        """Return the config as a JSON-able dict (the keys a TOML config file takes; unset ones omitted)."""
        data = {f.name: (list(v) if isinstance(v := getattr(self, f.name), tuple) else v)
                for f in fields(self) if f.name != "mode_from_env"}
        if data["cuda_graph_config"] is not None:
            data["cuda_graph_config"] = json.loads(data["cuda_graph_config"])
        return {k: v for k, v in data.items() if v is not None}

    # -- construction from files, flags, command lines and sglang's own ServerArgs ---------------------

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], source: str = "config") -> ServingConfig:
        """Build from a mapping with field names (dashes or underscores, or aliases); unknown keys are an error."""
        from jitwarm.precompile.config_sources import fields_of

        return cls(**fields_of(data, source))

    @classmethod
    def from_toml(cls, path: str | Path) -> ServingConfig:
        """Build from a TOML file whose top-level keys (or ``[jitwarm]`` table) are field or flag names."""
        from jitwarm.precompile.config_sources import read_config_file

        return cls(**read_config_file(path))

    @classmethod
    def from_server_args(cls, server_args: Any, **overrides: Any) -> ServingConfig:
        """Build from an sglang ``ServerArgs`` inside the server: its raw capture settings, as given.

        The verify mode is read from the environment, as sglang does; model dims, backends and targets
        come from ``overrides`` (e.g. a jitwarm TOML file).
        """
        inputs = {name: getattr(server_args, name) for name in sglang_rules.INPUT_KEYS
                  if name in SERVER_ARGS_FIELDS and hasattr(server_args, name)}
        if isinstance(getattr(server_args, "model_path", None), str):
            inputs["model_path"] = server_args.model_path
        return cls(**{**{k: tuple(v) if isinstance(v, list) else v for k, v in inputs.items() if v is not None},
                      **overrides})

    @classmethod
    def from_args(cls, argv: Sequence[str] | None = None) -> ServingConfig:
        """Build from command-line flags.

        ``argv`` holds jitwarm's own flags (sglang's names), then optionally ``--`` and the server's command
        line; an argv that is a server command line (it starts with a launcher a server room recognises, such
        as ``python -m sglang.launch_server`` or ``sglang serve``, or names ``--model-path``) is read as one.
        ``--config FILE`` is read first.
        """
        from jitwarm.precompile.config_sources import from_flags

        return from_flags(argv)


#: The ServingConfig fields that are sglang ServerArgs fields of the same name (the server's capture settings).
SERVER_ARGS_FIELDS = (frozenset(sglang_rules.INPUT_KEYS) - {"gpu_memory_mb", "ragged_verify_mode", "kv_capacity"}
                      | {"model_path"})


def _check_types(cfg: ServingConfig) -> list[str]:
    """Type and range problems of the fields, one message each (before anything else looks at them)."""
    problems = []
    for name, (kind, flag) in _CHECKS.items():
        value = getattr(cfg, name)
        if value is None:
            continue
        if kind == "text":
            if not isinstance(value, str) or not value.strip():
                problems.append(f"{flag} must be a non-empty string, got {value!r}")
        elif kind == "flag":
            if not isinstance(value, bool):
                problems.append(f"{flag} must be true or false, got {value!r}")
        elif kind == "bs_list":
            if not isinstance(value, (tuple, list)) or not value:
                problems.append(f"{flag} needs a list of positive batch sizes, got {value!r}")
            elif len(value) > MAX_BATCH_SIZE:
                problems.append(f"{flag} lists {len(value)} sizes; at most {MAX_BATCH_SIZE}")
            else:
                bad = [b for b in value if not _is_int(b) or not 1 <= b <= MAX_BATCH_SIZE]
                if bad:
                    problems.append(f"{flag} needs positive batch sizes up to {MAX_BATCH_SIZE}, got {bad[:5]}")
        elif not _is_int(value) or value < 1:
            problems.append(f"{flag} must be a positive integer, got {value!r}")
        elif value > _LIMITS[kind]:
            problems.append(f"{flag} {value} is larger than any real server (at most {_LIMITS[kind]})")
    for name, flag in (("speculative_algorithm", "--speculative-algorithm"), ("ragged_verify_mode", "mode"),
                       ("dtype", "--dtype"), ("ladder_source", "--ladder-source")):
        value = getattr(cfg, name)
        if value is not None and not isinstance(value, str):
            problems.append(f"{flag} must be a string, got {value!r}")
    if cfg.cuda_graph_config is not None:
        problems.extend(_check_graph_config(cfg.cuda_graph_config))
    ratios = cfg.compress_ratios
    if not isinstance(ratios, (tuple, list)) or not ratios:
        problems.append(f"--compress-ratios needs a list of positive integers, got {ratios!r}")
    elif bad := [r for r in ratios if not _is_int(r) or r < 1]:
        problems.append(f"--compress-ratios needs positive integers, got {bad}")
    for name, flag in (("backends", "--backend"), ("targets", "--target")):
        value = getattr(cfg, name)
        if value is not None and not _is_names(value):
            problems.append(f"{flag} needs names (strings), got {value!r}")
    return problems


def _check_graph_config(value: Any) -> list[str]:
    """Problems of a --cuda-graph-config value (a JSON object, or its text)."""
    if isinstance(value, str):
        try:
            value = graph_config_object(value)
        except ValueError as exc:
            return [f"--cuda-graph-config is not a JSON object: {str(exc).splitlines()[0]}"]
    if not isinstance(value, Mapping):
        return [f"--cuda-graph-config must be a JSON object, got {type(value).__name__}"]
    decode = value.get("decode", {})
    if not isinstance(decode, Mapping):
        return ["--cuda-graph-config: decode must be an object"]
    problems = []
    if "max_bs" in decode and (not _is_int(decode["max_bs"]) or not 1 <= decode["max_bs"] <= MAX_BATCH_SIZE):
        problems.append(f"--cuda-graph-config decode.max_bs must be a batch size up to {MAX_BATCH_SIZE}")
    if "bs" in decode and (not isinstance(decode["bs"], list) or not decode["bs"] or len(decode["bs"]) > MAX_BATCH_SIZE
                           or any(not _is_int(b) or not 1 <= b <= MAX_BATCH_SIZE for b in decode["bs"])):
        problems.append(f"--cuda-graph-config decode.bs must be a list of batch sizes up to {MAX_BATCH_SIZE}")
    return problems


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_names(value: Any) -> bool:
    return isinstance(value, (tuple, list)) and all(isinstance(v, str) for v in value)


