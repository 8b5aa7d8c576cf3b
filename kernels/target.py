"""Target: where a kernel runs, ``cpu`` or one CUDA arch (``sm_90``); and the node's GPUs, probed once."""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Any, NamedTuple

from jitwarm.cache.errors import UsageError

#: nvcc 13 compiles nothing older (sm_70 is "Unsupported gpu architecture").
MIN_CUDA_ARCH = 75
_CUDA = re.compile(r"sm_([0-9]{2,3})")  # [0-9], not \d: "sm_٩٠" (Arabic-Indic digits) is not an arch
_ARCH_SPECIFIC = re.compile(r"sm_([0-9]{2,3})a")


class TargetError(UsageError, ValueError):
    """A target name that is neither ``cpu`` nor a supported ``sm_XY`` (exit 2); the message says what to use."""


@dataclass(frozen=True)
class Target:
    """A build target: ``cpu`` or ``sm_XY`` (``XY`` >= 75)."""

    name: str

    @classmethod
    def parse(cls, text: Any) -> Target:
        """Return the target ``text`` names; TargetError for anything but ``cpu`` or ``sm_XY`` from sm_75.

        ``sm_XYa`` is refused too: no device reports it, so a plan for it never matches at capture.
        """
        if not isinstance(text, str):
            raise TargetError(f"target must be a string such as 'sm_90' or 'cpu', got {text!r}")
        if text == "cpu":
            return cls(text)
        if specific := _ARCH_SPECIFIC.fullmatch(text):
            raise TargetError(f"target {text!r}: use sm_{specific[1]}; the device reports sm_{specific[1]}, "
                              f"and its builds already use the arch-specific features (Triton compiles sm_"
                              f"{specific[1]}a code for it)")
        cuda = _CUDA.fullmatch(text)
        if cuda is None or int(cuda[1]) < MIN_CUDA_ARCH:
            raise TargetError(f"unknown target {text!r}; use cpu or a CUDA arch such as sm_90 (>= sm_{MIN_CUDA_ARCH})")
        return cls(text)

    @classmethod
    def of_device(cls, device: Any) -> Target:
        """The target of a torch device: ``cpu``, or ``sm_XY`` from its compute capability; TargetError otherwise."""
        import torch

        device = torch.device(device)
        if device.type == "cpu":
            return cls("cpu")
        if device.type == "cuda":
            major, minor = torch.cuda.get_device_capability(device)
            return cls(f"sm_{major}{minor}")
        raise TargetError(f"no kernel target for device {device} (cpu or cuda)")

    @property
    def is_cuda(self) -> bool:
        """True for an ``sm_XY`` target."""
        return self.name != "cpu"

    @property
    def arch(self) -> int | None:
        """The CUDA arch number (``sm_90`` is 90), None for ``cpu``."""
        return None if self.name == "cpu" else int(self.name[3:])

    def __str__(self) -> str:
        return self.name


class Gpu(NamedTuple):
    """One GPU as nvidia-smi reports it: ``sm_XY``, its memory in MiB and the driver's version."""

    arch: str
    memory_mb: int
    driver: str


@functools.cache
def local_gpus() -> tuple[Gpu, ...]:
    """Every GPU of this node, from one nvidia-smi run per process (no torch import); () without one."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return ()
    try:
        out = subprocess.run([smi, "--query-gpu=compute_cap,memory.total,driver_version",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30,
                             check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return ()
    gpus = []
    for line in out.splitlines():
        try:
            cap, memory, driver = (v.strip() for v in line.split(","))
            major, minor = cap.split(".")
            gpus.append(Gpu(f"sm_{int(major)}{int(minor)}", int(float(memory)), driver))
        except ValueError:  # a row nvidia-smi could not fill ("[N/A]"): not a GPU we can use
            continue
    return tuple(gpus)
