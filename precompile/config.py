"""ServingConfig, and where its values come from (:func:`from_namespace`): a TOML file, the server's line, flags."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from jitwarm.cache.errors import UsageError
from jitwarm.cache.files import read_file_stat
from jitwarm.kernels import BUILDABLE, DTYPES, ModelDims, Target, TargetError
from jitwarm.kernels.backend import refusal as backend_refusal
from jitwarm.kernels.target import local_gpus
from jitwarm.precompile import servers
from jitwarm.precompile.flags import GIVEN_AS, ConfigError, FlagParser, add_serving_flags, aliases, split_server_argv

#: Largest batch size accepted: a million-entry ladder would take minutes and gigabytes to enumerate.
MAX_BATCH_SIZE = 4096


def local_target() -> str:
    """Return the local GPU's arch as ``sm_XY`` (via nvidia-smi, no torch import), else ``cpu``."""
    gpus = local_gpus()
    return gpus[0].arch if gpus else "cpu"


def local_gpu_memory_mb() -> int | None:
    """Return the smallest local GPU's memory in MiB (as sglang's ``get_device_memory_capacity``), or None."""
    return min((gpu.memory_mb for gpu in local_gpus()), default=0) or None


# The checked fields by kind: the kinds in _LIMITS are positive ints up to their limit.
_KINDS = {
    "batch": ("graph_max_bs",), "bs_list": ("graph_bs",),
    "flag": ("no_graphs", "no_decode_graphs", "no_graph_padding", "dp_attention"),
    "draft": ("draft_tokens", "draft_steps", "draft_topk"),
    "count": ("max_requests", "head_dim", "num_q_heads", "num_kv_heads"),
    "parallel": ("tp", "dp", "attn_dp"), "memory": ("gpu_memory_mb",),
    "text": ("model_path", "model_architecture"),
}
_LIMITS = {"batch": MAX_BATCH_SIZE, "count": 1 << 20, "draft": 64, "parallel": 1024, "memory": 16 << 20}


#: ServingConfig's fields that say where a value came from, not what the server is: no TOML key or flag sets them.
_NOT_SETTINGS = ("mode_from_env", "given_as")


@dataclass(frozen=True)
class ServingConfig:
    """The server settings that decide the capture ladder, plus the model dims and build targets.

    The settings carry jitwarm's own names, each the concept every server has in its own words: a room's
    ``parse_argv`` maps its flags onto them and its ``FIELD_FLAGS`` names its flag back in messages. ``graph_*``: the
    decode CUDA graphs (the largest batch, the explicit batch sizes, a per-phase JSON, all off, decode off, padding
    off: every size captured); ``draft_*``: speculative decoding (algorithm, tokens verified per request, steps,
    top-k); ``max_requests``: the request pool; ``tp``, ``dp``, ``attn_dp``, ``dp_attention``: the parallel
    layout; ``gpu_memory_mb``: the device memory the server sizes its default from.

    None means "not given" (the server's default); ``server_options``: the room's own settings. Construction takes
    the room's defaults and validates: :class:`ConfigError` lists every problem, the server's own rejections too.
    """

    graph_max_bs: int | None = None
    graph_bs: tuple[int, ...] | None = None
    graph_config: str | None = None  # a JSON object, kept as canonical JSON text (as server_options)
    no_graphs: bool = False
    no_decode_graphs: bool = False
    no_graph_padding: bool = False
    draft_algorithm: str | None = None
    draft_tokens: int | None = None
    draft_steps: int | None = None
    draft_topk: int | None = None
    max_requests: int | None = None
    tp: int = 1
    dp: int = 1
    attn_dp: int = 1
    dp_attention: bool = False
    gpu_memory_mb: int | None = None
    ragged_verify_mode: str | None = None
    ladder_source: str = "auto"
    model_path: str | None = None
    model_architecture: str | None = None  # config.json's "architectures", when the path is not local
    head_dim: int = ModelDims.head_dim  # the model dims are ModelDims' fields (``model``)
    rope_dim: int = ModelDims.rope_dim
    num_q_heads: int = ModelDims.num_q_heads
    num_kv_heads: int = ModelDims.num_kv_heads
    compress_ratios: tuple[int, ...] = ModelDims.compress_ratios
    dtype: str = ModelDims.dtype
    backends: tuple[str, ...] = ("tvm_ffi",)
    targets: tuple[str, ...] | None = None
    server: str = servers.DEFAULT
    server_options: str | None = None
    mode_from_env: bool = field(default=False, compare=False, repr=False)
    #: field -> the jitwarm flag that set it, as typed (messages name it; else :meth:`flag_of` asks the room)
    given_as: Mapping[str, str] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        room = self.room
        for name, value in (room.defaults(self) if room else {}).items():
            set_(name, value)
        problems = _check_types(self)
        if problems:  # report the value problems of the well-typed fields with them, then stop
            self.validate(problems)
        if self.graph_bs is not None:
            set_("graph_bs", tuple(sorted(set(self.graph_bs))))
        for name in ("graph_config", "server_options"):
            if isinstance(getattr(self, name), Mapping):
                set_(name, json.dumps(getattr(self, name), sort_keys=True))
        if self.draft_algorithm is not None:
            set_("draft_algorithm", self.draft_algorithm.upper())
        set_("compress_ratios", tuple(sorted(set(self.compress_ratios))))
        set_("backends", tuple(dict.fromkeys(self.backends)))
        set_("targets", tuple(dict.fromkeys(self.targets if self.targets is not None else (local_target(),))))
        self.validate()

    @property
    def room(self) -> servers.ServerAdapter | None:
        """The server room of ``server`` (None for a name no room has: :meth:`validate` says so)."""
        return servers.adapter(self.server) if self.server in servers.ROOMS else None

    def validate(self, problems: Sequence[str] = ()) -> None:
        """Raise :class:`ConfigError` listing ``problems`` and every problem found here, or return."""
        problems = list(problems)
        room = self.room
        if room is None:
            problems.append(f"unknown server {self.server!r}; choose from {', '.join(servers.ROOMS)}")
        elif self.ladder_source not in room.LADDER_SOURCES:
            problems.append(f"unknown --ladder-source {self.ladder_source!r}; choose from "
                            f"{', '.join(room.LADDER_SOURCES)}")
        if not _is_int(self.rope_dim) or self.rope_dim < 2 or self.rope_dim % 2:
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
        if room is not None:
            problems += room.check(self, resolve=not problems)
        if problems:
            raise ConfigError(problems)

    def flag_of(self, name: str) -> str:
        """The flag a message names for field ``name``: as typed, else the server's own, else jitwarm's."""
        own = self.room.FIELD_FLAGS if self.room is not None else {}
        return (self.given_as or {}).get(name) or own.get(name) or "--" + name.replace("_", "-")

    @property
    def model(self) -> ModelDims:
        """The model dims the kernel families specialize on."""
        return ModelDims(**{f.name: getattr(self, f.name) for f in fields(ModelDims)})

    def to_json(self) -> dict[str, Any]:
        """Return the config as a JSON-able dict (the keys a TOML file takes; unset ones omitted)."""
        data = {f.name: (list(v) if isinstance(v := getattr(self, f.name), tuple) else v)
                for f in fields(self) if f.name not in _NOT_SETTINGS}
        for name in ("graph_config", "server_options"):
            if data[name] is not None:
                data[name] = json.loads(data[name])
        return {k: v for k, v in data.items() if v is not None}

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], source: str = "config") -> ServingConfig:
        """Build from a mapping of field names (dashes or underscores, or aliases); unknown keys are an error."""
        return cls(**fields_of(data, source))

    @classmethod
    def from_toml(cls, path: str | Path) -> ServingConfig:
        """Build from a TOML file whose top-level keys (or ``[jitwarm]`` table) are field or flag names."""
        return cls(**read_config_file(path))

    @classmethod
    def from_args(cls, argv: Sequence[str] | None = None) -> ServingConfig:
        """Build from jitwarm's flags, then optionally ``--`` and the server's command line (``--config`` first)."""
        own, server = split_server_argv(sys.argv[1:] if argv is None else argv)
        parser = FlagParser(prog="jitwarm", add_help=False)
        add_serving_flags(parser)
        ns, rest = parser.parse_known_args(own)
        if rest:
            raise ConfigError([f"unrecognized arguments: {' '.join(rest)} (put the server's command line after --)"])
        return from_namespace(ns, server)


def _check_types(cfg: ServingConfig) -> list[str]:
    """Type and range problems of the fields, one message each."""
    problems = []
    for kind, name in ((kind, name) for kind, names in _KINDS.items() for name in names):
        value, flag = getattr(cfg, name), cfg.flag_of(name)
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
            elif bad := [b for b in value if not _is_int(b) or not 1 <= b <= MAX_BATCH_SIZE]:
                problems.append(f"{flag} needs positive batch sizes up to {MAX_BATCH_SIZE}, got {bad[:5]}")
        elif not _is_int(value) or value < 1:
            problems.append(f"{flag} must be a positive integer, got {value!r}")
        elif value > _LIMITS[kind]:
            problems.append(f"{flag} {value} is larger than any real server (at most {_LIMITS[kind]})")
    for name, flag in (("draft_algorithm", cfg.flag_of("draft_algorithm")), ("ragged_verify_mode", "mode"),
                       ("dtype", "--dtype"), ("ladder_source", "--ladder-source"), ("server", "server")):
        value = getattr(cfg, name)
        if value is not None and not isinstance(value, str):
            problems.append(f"{flag} must be a string, got {value!r}")
    if cfg.server_options is not None:
        problems.extend(_option_problems(cfg))
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


def _option_problems(cfg: ServingConfig) -> list[str]:
    """``server_options`` must be a JSON object whose keys are settings of the config's room."""
    options = cfg.server_options
    try:
        options = servers.json_object(options) if isinstance(options, str) else options
    except ValueError as exc:
        return [f"server_options is not a JSON object: {str(exc).splitlines()[0]}"]
    if not isinstance(options, Mapping):
        return [f"server_options must be a table of the server's settings, got {type(options).__name__}"]
    known = cfg.room.OPTIONS if cfg.room else {}
    return [f"server_options: {cfg.server} has no setting {name!r}" for name in options if name not in known]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_names(value: Any) -> bool:
    return isinstance(value, (tuple, list)) and all(isinstance(v, str) for v in value)


# -- where the values come from ------------------------------------------------------------------------

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

#: Largest TOML config file read (a real one is a few hundred bytes).
MAX_CONFIG_BYTES = 1 << 20

def read_config_file(path: str | Path) -> dict[str, Any]:
    """Return the fields a TOML file (its top level, or its ``[jitwarm]`` table) sets; ConfigError if it cannot."""
    try:
        # Follow a link the operator gave (a ConfigMap is one); then no blocking (a FIFO planted where the file
        # should be), a regular file of bounded size (/dev/zero is not a config).
        raw, _ = read_file_stat(os.path.realpath(path), MAX_CONFIG_BYTES)
    except OSError as exc:
        raise ConfigError([f"cannot read --config {path}: {exc.strerror or exc}"]) from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise ConfigError([f"--config {path} is not valid TOML: {str(exc).splitlines()[0]}"]) from None
    table = data.get("jitwarm", data)
    if not isinstance(table, dict):
        raise ConfigError([f"--config {path}: [jitwarm] must be a table, got {type(table).__name__}"])
    return fields_of(table, source=str(path))


def fields_of(data: Mapping[str, Any], source: str) -> dict[str, Any]:
    """Map config keys (dashes or underscores, :func:`.flags.aliases`) to field names; unknown keys are an error.

    One setting under two of its names (``tp`` and ``tp_size``) is an error too: which would win is not obvious.
    """
    known = {f.name for f in fields(ServingConfig)} - set(_NOT_SETTINGS)
    values, unknown, raw_keys = {}, [], {}
    for raw_key, value in data.items():
        key = str(raw_key).replace("-", "_")
        key = aliases().get(key, key)
        if key not in known:
            unknown.append(raw_key)
            continue
        if key in raw_keys:
            raise ConfigError([f"{source}: {raw_keys[key]!r} and {raw_key!r} both set {key}; give one"])
        raw_keys[key] = raw_key
        if key in ("backends", "targets") and isinstance(value, str):
            value = [value]
        values[key] = tuple(value) if isinstance(value, list) else value
    if unknown:
        raise ConfigError([f"{source}: unknown key {k!r}" for k in unknown])
    return values


#: The fields jitwarm's own flags set (every one but the model path, the room and its options).
_FLAG_FIELDS = tuple(f.name for f in fields(ServingConfig)
                     if f.name not in ("model_path", "server", "server_options", *_NOT_SETTINGS))


def serving_flags_given(ns: argparse.Namespace, server_argv: Sequence[str] | None = None) -> bool:
    """Whether a server line, a config file or a flag beyond --target/--backend describes a server."""
    return server_argv is not None or bool(getattr(ns, "config", None)) or any(
        getattr(ns, name, None) is not None for name in _FLAG_FIELDS if name not in ("targets", "backends"))


def from_namespace(ns: argparse.Namespace, server_argv: Sequence[str] | None = None) -> ServingConfig:
    """Build a config from parsed flags: the TOML file (if any), then the server's line, then the flags."""
    values: dict[str, Any] = {}
    if getattr(ns, "config", None):
        values.update(read_config_file(ns.config))
    if server_argv is not None:
        try:
            room = servers.adapter_for(server_argv)
            values.update(_fields(room.parse_argv(server_argv)), server=room.NAME)
        except UsageError as exc:
            raise ConfigError([str(exc)]) from None
    values.update(_fields({name: getattr(ns, name, None) for name in _FLAG_FIELDS}))
    return ServingConfig(**values, given_as=getattr(ns, GIVEN_AS, None))


def _fields(values: Mapping[str, Any]) -> dict[str, Any]:
    """The values that are set (not None), lists as tuples."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in values.items() if v is not None}

