"""KernelSpec, ModelDims, VerifyLayout and TokenMap: what one compiled kernel specialization is, what chooses it."""

from __future__ import annotations

import functools
import hashlib
import itertools
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

DTYPES = ("float32", "bfloat16")

ParamValue = int | str


@dataclass(frozen=True)
class ModelDims:
    """Model dimensions the kernel families specialize on (illustrative defaults, docs/kernels.md)."""

    head_dim: int = 128
    rope_dim: int = 64
    num_q_heads: int = 16
    num_kv_heads: int = 1
    compress_ratios: tuple[int, ...] = (4, 128)
    dtype: str = "bfloat16"


@dataclass(frozen=True, repr=False)
class VerifyLayout:
    """Tokens verified per request slot (each at least 1), as the runner holds them on the host.

    Planning and dispatch both read it (as sglang's ``verify_lens_cpu``): nothing is read back from the device.

    Examples
    --------
    >>> layout = VerifyLayout((3,) * 104 + (2,) * 24)
    >>> layout.uniform, layout.max_len, layout.num_tokens, layout.slots
    (False, 3, 360, 128)

    """

    verify_lens: tuple[int, ...]
    uniform: bool = field(init=False)
    max_len: int = field(init=False)
    num_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        lens = tuple(int(n) for n in self.verify_lens)
        if not lens:
            raise ValueError("verify_lens is empty: a layout needs at least one request slot")
        if min(lens) < 1:
            raise ValueError(f"verify_lens has a length below 1 ({min(lens)}): each request verifies its anchor")
        object.__setattr__(self, "verify_lens", lens)
        object.__setattr__(self, "uniform", min(lens) == max(lens))
        object.__setattr__(self, "max_len", max(lens))
        object.__setattr__(self, "num_tokens", sum(lens))

    @property
    def slots(self) -> int:
        """Number of request slots (rows of the plan)."""
        return len(self.verify_lens)

    def __repr__(self) -> str:
        return f"VerifyLayout({self.run_length()})"

    def run_length(self) -> str:
        """Render ``verify_lens`` run-length encoded, e.g. ``[3]*104+[2]*24``."""
        return "+".join(f"[{n}]*{len(list(run))}" for n, run in itertools.groupby(self.verify_lens))


class TokenMap(NamedTuple):
    """One batch's ragged layout and compression plan, int32 tensors: the plan kernel's output (docs/kernels.md)."""

    cu_lens: Any
    token_req: Any
    token_pos: Any
    token_out_row: Any
    num_out: Any
    uniform: Any


def max_out_rows(layout: VerifyLayout, ratio: int) -> int:
    """Return the most rows a batch with ``layout`` can write, whatever its prefixes: ``sum(ceil(L / r))``."""
    if ratio < 1:
        raise ValueError(f"ratio must be at least 1, got {ratio}")
    return sum(-(-n // ratio) for n in layout.verify_lens)


@dataclass(frozen=True)
class KernelSpec:
    """One kernel specialization: the unit that is compiled, cached, loaded and dispatched (params sorted by name).

    Examples
    --------
    >>> s = KernelSpec("plan", "tvm_ffi", "cpu", {"ratio": 4, "threads": 128})
    >>> s.id
    'plan/tvm_ffi/cpu/ratio=4,threads=128'
    >>> KernelSpec.from_json(s.to_json()) == s
    True

    """

    family: str
    backend: str
    target: str
    params: tuple[tuple[str, ParamValue], ...] = field(default=())

    def __init__(self, family: str, backend: str, target: str,
                 params: Mapping[str, ParamValue] | tuple[tuple[str, ParamValue], ...] = ()) -> None:
        items = params.items() if isinstance(params, Mapping) else params
        for name, value in items:
            if isinstance(value, bool) or not isinstance(value, (int, str)):
                raise TypeError(f"spec param {name}={value!r} must be an int or a str")
        object.__setattr__(self, "family", family)
        object.__setattr__(self, "backend", backend)
        object.__setattr__(self, "target", target)
        object.__setattr__(self, "params", tuple(sorted(items)))

    def __getitem__(self, name: str) -> ParamValue:
        """Return the value of param ``name``."""
        for key, value in self.params:
            if key == name:
                return value
        raise KeyError(f"{self.family} spec has no param {name!r}")

    @property
    def params_dict(self) -> dict[str, ParamValue]:
        """The params as a plain dict."""
        return dict(self.params)

    @functools.cached_property
    def id(self) -> str:
        """``family/backend/target/k=v,...``; a value too long or odd for one line is ``#`` and 12 hex of its sha256."""
        args = ",".join(f"{k}={_readable(v)}" for k, v in self.params)
        return f"{self.family}/{self.backend}/{self.target}/{args}"

    def to_json(self) -> dict[str, Any]:
        """Return a JSON-able dict; :meth:`from_json` inverts it."""
        return {"family": self.family, "backend": self.backend, "target": self.target,
                "params": self.params_dict}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> KernelSpec:
        """Rebuild a spec from :meth:`to_json` output."""
        return cls(data["family"], data["backend"], data["target"], dict(data["params"]))


_SEPARATORS = re.compile(r"[,=/ ]")


def _readable(value: ParamValue) -> str:
    text = str(value)
    if len(text) <= 64 and (type(value) is int or (text.isprintable() and not _SEPARATORS.search(text))):
        return text
    return "#" + hashlib.sha256(text.encode()).hexdigest()[:12]
