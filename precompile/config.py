"""ServingConfig: the serving flags (sglang's names) that decide which CUDA graphs get captured."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from jitwarm.kernels import BACKENDS, DTYPES, ModelDims, is_valid_target

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

MODES = ("static", "cap-accept", "compact")
MODE_ENV = "SGLANG_RAGGED_VERIFY_MODE"


class ConfigError(ValueError):
    """A serving config or flag is invalid; ``problems`` holds one message per problem."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        super().__init__("; ".join(self.problems))


def local_target() -> str:
    """Return the local GPU's arch as ``sm_XY`` (via nvidia-smi, no torch import), else ``cpu``."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "cpu"
    try:
        out = subprocess.run([smi, "--query-gpu=compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
        major, minor = out.split()[0].split(".")
        return f"sm_{int(major)}{int(minor)}"
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return "cpu"


@dataclass(frozen=True)
class ServingConfig:
    """The serving flags that decide the capture ladder, plus the model dims and build targets.

    Field names follow sglang's flags (``--cuda-graph-max-bs`` is ``cuda_graph_max_bs``). Construction
    normalises lists (sorted, duplicates dropped) and resolves defaults; :meth:`validate` (called by
    every constructor here) raises :class:`ConfigError` with one message per problem.

    Examples
    --------
    >>> cfg = ServingConfig(cuda_graph_max_bs=128, speculative_num_draft_tokens=6,
    ...                     ragged_verify_mode="compact", targets=("cpu",))
    >>> cfg.max_bs, cfg.model.compress_ratios
    (128, (4, 128))

    """

    cuda_graph_max_bs: int = 128
    cuda_graph_bs: tuple[int, ...] | None = None
    disable_cuda_graph_padding: bool = False
    speculative_num_draft_tokens: int = 0
    max_running_requests: int | None = None
    ragged_verify_mode: str | None = None
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
            set_("ragged_verify_mode", env_mode or "static")
            set_("mode_from_env", bool(env_mode))
        if self.cuda_graph_bs is not None:
            set_("cuda_graph_bs", tuple(sorted(set(self.cuda_graph_bs))))
        set_("compress_ratios", tuple(sorted(set(self.compress_ratios))))
        set_("backends", tuple(dict.fromkeys(self.backends)))
        if self.targets is None:
            set_("targets", (local_target(),))
        set_("targets", tuple(dict.fromkeys(self.targets)))
        self.validate()

    def validate(self) -> None:
        """Raise :class:`ConfigError` listing every problem, or return None."""
        problems: list[str] = []

        def positive(name: str, value: int | None, flag: str) -> None:
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                problems.append(f"{flag} must be a positive integer, got {value!r}")

        positive("cuda_graph_max_bs", self.cuda_graph_max_bs, "--cuda-graph-max-bs")
        positive("max_running_requests", self.max_running_requests, "--max-running-requests")
        for name in ("head_dim", "num_q_heads", "num_kv_heads"):
            positive(name, getattr(self, name), "--" + name.replace("_", "-"))
        if not isinstance(self.speculative_num_draft_tokens, int) or self.speculative_num_draft_tokens < 0:
            problems.append("--speculative-num-draft-tokens must be 0 (no speculative decoding) or positive, "
                            f"got {self.speculative_num_draft_tokens!r}")
        if self.cuda_graph_bs is not None:
            bad = [b for b in self.cuda_graph_bs if not isinstance(b, int) or b < 1]
            if bad or not self.cuda_graph_bs:
                problems.append(f"--cuda-graph-bs needs positive batch sizes, got {bad or 'an empty list'}")
        if not isinstance(self.rope_dim, int) or self.rope_dim < 2 or self.rope_dim % 2:
            problems.append(f"--rope-dim must be a positive even integer, got {self.rope_dim!r}")
        elif isinstance(self.head_dim, int) and self.rope_dim > self.head_dim:
            problems.append(f"--rope-dim {self.rope_dim} is larger than --head-dim {self.head_dim}")
        bad_ratios = [r for r in self.compress_ratios if not isinstance(r, int) or r < 1]
        if bad_ratios or not self.compress_ratios:
            problems.append(f"--compress-ratios needs positive integers, got {bad_ratios or 'an empty list'}")
        if self.dtype not in DTYPES:
            problems.append(f"unknown --dtype {self.dtype!r}; choose from {', '.join(DTYPES)}")
        for backend in self.backends:
            if backend not in BACKENDS:
                problems.append(f"unknown --backend {backend!r}; choose from {', '.join(BACKENDS)}")
        for target in self.targets:
            if not is_valid_target(target):
                problems.append(f"unknown --target {target!r}; use cpu or a CUDA arch such as sm_90 (>= sm_75)")
        mode = self.ragged_verify_mode
        source = f" (from {MODE_ENV})" if self.mode_from_env else ""
        if mode not in MODES:
            problems.append(f"unknown --ragged-verify-mode {mode!r}{source}; choose from {', '.join(MODES)}")
        elif mode != "static" and self.speculative_num_draft_tokens == 0:
            problems.append(f"--ragged-verify-mode {mode}{source} needs speculative decoding "
                            "(--speculative-num-draft-tokens > 0)")
        if mode == "compact" and self.disable_cuda_graph_padding:
            problems.append("--ragged-verify-mode compact cannot be used with --disable-cuda-graph-padding "
                            "(sglang rejects it)")
        if problems:
            raise ConfigError(problems)

    @property
    def model(self) -> ModelDims:
        """The model dims the kernel families specialize on."""
        return ModelDims(head_dim=self.head_dim, rope_dim=self.rope_dim, num_q_heads=self.num_q_heads,
                         num_kv_heads=self.num_kv_heads, compress_ratios=self.compress_ratios,
                         dtype=self.dtype)

    @property
    def speculative(self) -> bool:
        """True when speculative decoding is on (draft tokens > 0)."""
        return self.speculative_num_draft_tokens > 0

    @property
    def max_bs(self) -> int:
        """Largest captured batch size: the explicit list's max, else the max bs, cut at max running."""
        top = max(self.cuda_graph_bs) if self.cuda_graph_bs else self.cuda_graph_max_bs
        return min(top, self.max_running_requests or top)

    def to_json(self) -> dict[str, Any]:
        """Return the config as a JSON-able dict (the keys a TOML config file takes)."""
        return {f.name: (list(v) if isinstance(v := getattr(self, f.name), tuple) else v)
                for f in fields(self) if f.name != "mode_from_env"}

    # -- construction from files and flags ---------------------------------------------------------

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], source: str = "config") -> ServingConfig:
        """Build from a mapping with field names (dashes or underscores); unknown keys are an error."""
        known = {f.name for f in fields(cls)} - {"mode_from_env"}
        values, unknown = {}, []
        for raw_key, value in data.items():
            key = raw_key.replace("-", "_")
            singular = {"backend": "backends", "target": "targets"}.get(key, key)
            if singular not in known:
                unknown.append(raw_key)
                continue
            if singular in ("backends", "targets") and isinstance(value, str):
                value = [value]
            values[singular] = tuple(value) if isinstance(value, list) else value
        if unknown:
            raise ConfigError([f"{source}: unknown key {k!r}" for k in unknown])
        return cls(**values)

    @classmethod
    def from_toml(cls, path: str | Path) -> ServingConfig:
        """Build from a TOML file whose top-level keys are field or flag names."""
        try:
            with Path(path).open("rb") as fh:
                data = tomllib.load(fh)
        except OSError as exc:
            raise ConfigError([f"cannot read --config {path}: {exc.strerror}"]) from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError([f"--config {path} is not valid TOML: {exc}"]) from None
        return cls.from_mapping(data.get("jitwarm", data), source=str(path))

    @classmethod
    def from_args(cls, argv: Sequence[str] | None = None) -> ServingConfig:
        """Build from command-line flags (sglang's names); ``--config FILE`` is read first."""
        parser = _FlagParser(prog="jitwarm", add_help=False)
        add_serving_flags(parser)
        ns, rest = parser.parse_known_args(argv)
        if rest:
            raise ConfigError([f"unrecognized arguments: {' '.join(rest)}"])
        return from_namespace(ns)


class _FlagParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors raise ConfigError instead of printing usage and exiting."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError([message])


def add_serving_flags(parser: argparse.ArgumentParser) -> None:
    """Add the serving, model and build-target flags to ``parser`` (all default to None: unset)."""
    g = parser.add_argument_group("serving (sglang's flag names)")
    g.add_argument("--config", metavar="FILE.toml", help="read these settings from a TOML file first")
    g.add_argument("--cuda-graph-max-bs", type=int, metavar="N")
    g.add_argument("--cuda-graph-bs", type=int, nargs="+", metavar="BS", help="explicit capture batch sizes")
    g.add_argument("--disable-cuda-graph-padding", action="store_true", default=None)
    g.add_argument("--speculative-num-draft-tokens", type=int, metavar="N", help="0: no speculative decoding")
    g.add_argument("--max-running-requests", type=int, metavar="N")
    g.add_argument("--ragged-verify-mode", metavar="MODE", help=f"{' | '.join(MODES)} (env {MODE_ENV})")
    m = parser.add_argument_group("model dims")
    m.add_argument("--head-dim", type=int)
    m.add_argument("--rope-dim", type=int)
    m.add_argument("--num-q-heads", type=int)
    m.add_argument("--num-kv-heads", type=int)
    m.add_argument("--compress-ratios", type=int, nargs="+", metavar="R")
    m.add_argument("--dtype", metavar="DTYPE", help=" | ".join(DTYPES))
    b = parser.add_argument_group("build")
    b.add_argument("--backend", dest="backends", action="append", metavar="NAME",
                   help=f"{' | '.join(BACKENDS)}; repeat for several (default tvm_ffi)")
    b.add_argument("--target", dest="targets", action="append", metavar="ARCH",
                   help="cpu | sm_90 | sm_100 | ...; repeat for several (default: the local GPU, else cpu)")


_FLAG_FIELDS = ("cuda_graph_max_bs", "cuda_graph_bs", "disable_cuda_graph_padding",
                "speculative_num_draft_tokens", "max_running_requests", "ragged_verify_mode", "head_dim",
                "rope_dim", "num_q_heads", "num_kv_heads", "compress_ratios", "dtype", "backends", "targets")


def from_namespace(ns: argparse.Namespace) -> ServingConfig:
    """Build a config from parsed flags: the TOML file (if any) first, then every flag that was given."""
    base = ServingConfig.from_toml(ns.config) if getattr(ns, "config", None) else None
    given = {name: getattr(ns, name) for name in _FLAG_FIELDS if getattr(ns, name, None) is not None}
    given = {k: tuple(v) if isinstance(v, list) else v for k, v in given.items()}
    if base is None:
        return ServingConfig(**given)
    if "ragged_verify_mode" in given:
        given["mode_from_env"] = False
    elif base.mode_from_env:
        given["ragged_verify_mode"] = None  # re-resolved from the environment
    return replace(base, **given)
