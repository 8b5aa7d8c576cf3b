"""Record the server's own JIT kernels as a run compiles them: every Triton specialization, every load_jit module.

``record(path)`` (or ``JITWARM_RECORD=path`` in a server with the jitwarm sglang plugin) chains Triton's
``knobs.runtime.jit_cache_hook`` (Triton calls it before each compile a process has not done yet, with the
kernel and its own serialized specialization data) and, when sglang is importable, sees every ``load_jit``
call from inside sglang's loader; each new kernel is appended to the manifest at ``path``
(:mod:`jitwarm.precompile.manifest`). Nothing runs on a hit: Triton calls the hook only where it would
compile (or read its disk cache), a ``load_jit`` module is looked up once per process by its caller, and a
kernel already recorded by this process is a set lookup. ``jitwarm warm --manifest path`` builds them ahead
of time.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from jitwarm.precompile.manifest import VERSION, append_records, record_id

log = logging.getLogger("jitwarm.record")

_LOADER = "sglang.kernels.jit.utils.compile.loader"


class Recorder:
    """An active recording into one manifest; :meth:`stop` (or leaving the ``with`` block) ends it."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.recorded = 0
        self._seen: set[str] = set()
        self._lock = threading.Lock()
        self._undo: list[Callable[[], None]] = []

    def add(self, record: Mapping[str, Any]) -> None:
        """Append ``record`` unless this process recorded it already (never raises: a recording is a side job).

        A record counts as recorded only once its append succeeded: after a failed one (a full disk) the next
        time Triton or ``load_jit`` hands it over, it is appended again.
        """
        rid = record_id(record)
        with self._lock:
            if rid in self._seen:
                return
        try:
            added = append_records(self.path, [record])
        except (OSError, ValueError) as exc:  # ManifestError is a ValueError: an untrusted or bad manifest
            log.warning("jitwarm: cannot record %s into %s: %s", record.get("kernel") or record.get("module"),
                        self.path, exc)
            return
        with self._lock:
            self._seen.add(rid)
            self.recorded += added

    def start(self) -> Recorder:
        """Install the Triton hook and the load_jit wrapper (whichever of the two can be imported here)."""
        self._hook_triton()
        self._wrap_load_jit()
        return self

    def stop(self) -> None:
        """Remove what :meth:`start` installed."""
        while self._undo:
            self._undo.pop()()

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _hook_triton(self) -> None:
        try:
            from triton import knobs
        except ImportError:
            return
        runtime = knobs.runtime
        previous = runtime.jit_cache_hook

        def jit_cache_hook(*, key: Any, repr: str, fn: Any, compile: dict[str, Any], **kwargs: Any) -> Any:
            self.add(triton_record(fn.module, fn.name, repr, compile["specialization_data"]))
            return previous(key=key, repr=repr, fn=fn, compile=compile, **kwargs) if previous else None

        runtime.jit_cache_hook = jit_cache_hook
        self._undo.append(lambda: setattr(runtime, "jit_cache_hook", previous))

    def _wrap_load_jit(self) -> None:
        """Record every ``load_jit`` call from inside sglang's loader, whoever imported ``load_jit`` by name.

        sglang's kernel modules bind ``load_jit`` when they are imported (219 call sites in the sglang release
        the room mirrors, :data:`jitwarm.precompile.servers.sglang.VERSION`; most imported by the scheduler
        before ``load_plugins()`` runs), so wrapping the function would miss them.
        Every call constructs a ``BuildSpec`` through the loader's module global (compile/loader.py:115), with
        ``load_jit``'s own frame one level up holding the call's arguments: that is where this records, hit
        or miss. (Under ``SGLANG_JIT_LOG_RESOURCE_USAGE``, HIP or SAIL, load_jit has rewritten its flags or
        sources by then: records made so are for that mode.)
        """
        import importlib
        import inspect

        try:
            loader = importlib.import_module(_LOADER)
        except ImportError:
            return  # no sglang here: Triton only
        original = loader.BuildSpec
        defaults = {name: p.default for name, p in inspect.signature(loader.load_jit).parameters.items()
                    if p.kind is inspect.Parameter.KEYWORD_ONLY}

        def build_spec(*args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1)
            if caller.f_code.co_name == "load_jit":
                seen = caller.f_locals
                given = {k: seen[k] for k, default in defaults.items() if k in seen and seen[k] != default}
                self.add(sglang_record(tuple(seen.get("args", ())), given))
            return original(*args, **kwargs)

        loader.BuildSpec = build_spec
        self._undo.append(lambda: setattr(loader, "BuildSpec", original))


def triton_record(module: str, qualname: str, repr_: str, specialization: str) -> dict[str, Any]:
    """The record of one Triton specialization, from what Triton hands its ``jit_cache_hook``."""
    from importlib.metadata import version

    target = json.loads(specialization).get("target", {})
    return {"v": VERSION, "kind": "triton", "kernel": f"{module}:{qualname}", "name": repr_,
            "target": f"sm_{target.get('arch')}" if target.get("backend") == "cuda" else str(target),
            "triton": version("triton"), "specialization": specialization}


def sglang_record(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The record of one ``load_jit(*args, **kwargs)`` call, with the arch sglang builds it for now."""
    from importlib.metadata import version

    from sglang.kernels.jit.utils import get_jit_cuda_arch

    arch = get_jit_cuda_arch()
    call = {"args": [str(a) for a in args], **{k: _plain(v) for k, v in sorted(kwargs.items())}}
    module = "sgl_kernel_jit_" + "_".join(call["args"])  # BuildSpec.module_name (compile/spec.py:55-57)
    return {"v": VERSION, "kind": "sglang_jit", "module": module, "target": f"sm_{arch.major}{arch.minor}",
            "arch": {"major": arch.major, "minor": arch.minor, "suffix": getattr(arch, "suffix", "")},
            "sglang": version("sglang"), "call": call}


def _plain(value: Any) -> Any:
    """A load_jit argument as JSON (tuples of strings are lists; anything else its str)."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def record(path: str | Path) -> Recorder:
    """Start recording every JIT kernel this process compiles into the manifest at ``path``.

    Examples
    --------
    >>> with record("server.jsonl"):      # doctest: +SKIP
    ...     run_the_server_warmup()

    """
    return Recorder(path).start()
