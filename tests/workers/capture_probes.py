"""Inside a capture of the plugin workers: a real JIT compile of each library the seals watch, and its outcome.

The GPU is faked, as everywhere in those workers: :func:`capturing` makes ``torch.cuda.is_current_stream_capturing``
(and ``is_initialized``) answer True for the block, as a real capture's stream would; Triton's driver is the
target-only stub (``gpu_stub``: its compiles run to sm_90 binaries, nothing launches). The compiles are real:
Triton's JIT, torch.compile's Inductor (imported before the captures, as in a server that compiles), and, in an
sglang process, sglang's ``load_jit`` (``clamp_position``, stopped by ``SGLANG_CRASH_ON_JIT_COMPILE`` where it
would run nvcc). Each probe compiles something new, so every one reaches its compiler.
"""

from __future__ import annotations

import contextlib

import gpu_stub
import torch
import triton
import triton.language as tl

CAPTURING = [False]
OUTCOMES: list[dict] = []


@triton.jit
def add_one(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)


def install() -> None:
    """The faked capture state, Triton's target-only driver, and Inductor imported."""
    import torch._inductor.compile_fx  # noqa: F401 - a server that compiles has imported it before it captures

    torch.cuda.is_initialized = lambda: CAPTURING[0]
    torch.cuda.is_current_stream_capturing = lambda: CAPTURING[0]
    gpu_stub.install()


@contextlib.contextmanager
def capturing():
    CAPTURING[0] = True
    try:
        yield
    finally:
        CAPTURING[0] = False


def probe(where: str, *, load_jit: bool) -> None:
    """Compile one new kernel of each library; record ``ran``, ``refused: <what>`` or the error, per library."""
    from jitwarm.precompile import CompileDuringCaptureError

    n = len({o["where"] for o in OUTCOMES})
    probes = [("triton", lambda: add_one.warmup(torch.float32, 1024, BLOCK=2 ** (5 + n), grid=(1,))),
              ("inductor", lambda: torch.compile(lambda x: x * (n + 2) + 1, dynamic=False)(torch.ones(4)))]
    if load_jit:
        probes.append(("load_jit", _load_jit))
    for name, run in probes:
        try:
            run()
            outcome = "ran"
        except Exception as exc:  # noqa: BLE001 - recorded: the test says what it expected
            refusal = _refusal(exc, CompileDuringCaptureError)
            text = str(exc)
            if refusal is not None:
                outcome = "refused: " + str(refusal).split(" would be compiled")[0]
            elif "SGLANG_CRASH_ON_JIT_COMPILE" in text:
                outcome = "sglang's own refusal (SGLANG_CRASH_ON_JIT_COMPILE)"
            else:
                outcome = f"{type(exc).__name__}: {text.splitlines()[0][:300] if text else ''}"
        OUTCOMES.append({"where": where, "probe": name, "outcome": outcome})


def _refusal(exc: BaseException, refused: type) -> BaseException | None:
    """The seal's refusal in ``exc``: itself, or wrapped (Inductor raises it as ``InductorError.inner_exception``)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, refused):
            return exc
        seen.add(id(exc))
        exc = getattr(exc, "inner_exception", None) or exc.__cause__ or exc.__context__
    return None


def _load_jit() -> None:
    from sglang.kernels.jit.utils import override_jit_cuda_arch
    from sglang.kernels.ops.attention import clamp_position

    with override_jit_cuda_arch(9, 0):
        clamp_position._jit_clamp_position_module(torch.int32)
