"""VerifyLayout: the host-side ragged verify layout that chooses a kernel specialization."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, repr=False)
class VerifyLayout:
    """Tokens verified per request slot (each at least 1), as the runner holds them on the host.

    Planning and dispatch both read it (sglang's ``RaggedVerifyLayout`` carries the same ``verify_lens_cpu``),
    so a kernel is never chosen from data read back from the device.

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
        runs: list[list[int]] = []
        for n in self.verify_lens:
            if runs and runs[-1][0] == n:
                runs[-1][1] += 1
            else:
                runs.append([n, 1])
        return "+".join(f"[{n}]*{count}" for n, count in runs)
