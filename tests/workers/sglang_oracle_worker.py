"""Run sglang's own functions (jitwarm.precompile.servers.sglang.native, and sglang_parser_oracle for the command
line) against the installed sglang for a whole request at once (one import).

stdin: ``{"grid": [inputs, ...], "argv": [[arg, ...], ...], "cli": [request, ...]}``. argv[1]: the file to write
the answer to (not stdout: an import may print there), one JSON object with ``{"ok": answer}`` or
``{"error": message}`` per grid entry and per argv, main()'s exit code, stdout and stderr per cli request,
the parser's flag table, and the process state before and after the grid (resolve() must restore it).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: sglang_parser_oracle

def _attempt(fn, arg):
    try:
        return {"ok": fn(arg)}
    except ValueError as exc:
        return {"error": str(exc)}


def _process_state():
    """What a scoped resolve() must restore: env vars it sets, the active context, the functions it swaps."""
    from sglang.srt import runtime_context
    from sglang.srt.arg_groups import memory_hook, speculative_hook

    return {
        "env": {k: os.environ.get(k) for k in ("SGLANG_RAGGED_VERIFY_MODE",
                                                "SGLANG_TEST_RAGGED_VERIFY_FORCE_UNIFORM_CAPTURE")},
        "context": id(runtime_context.get_context()),
        "published": runtime_context.get_context()._server_args is not None,
        "memory": id(memory_hook.get_device_memory_capacity),
        "handlers": [id(getattr(speculative_hook, name)) for name in ("_handle_dspark", "_handle_eagle_family")],
    }


def _running_defaults() -> dict[str, list[int]]:
    """For each speculative handler, the source lines that declare max_running_requests=48."""
    import inspect

    from sglang.srt.arg_groups import speculative_hook

    from jitwarm.precompile.servers.sglang import native as sglang_native

    found = {}
    for name in sglang_native._SPEC_HANDLERS:
        lines, start = inspect.getsourcelines(getattr(speculative_hook, name))
        found[name] = [start + i for i, line in enumerate(lines) if "max_running_requests=48" in line]
    return found


def main() -> None:
    request = json.load(sys.stdin)
    import sglang_parser_oracle

    from jitwarm.precompile.servers.sglang import native as sglang_native

    os.environ["SGLANG_RAGGED_VERIFY_MODE"] = "cap-accept"  # resolve() must put this back, not unset it
    before = _process_state()
    grid = [_attempt(sglang_native.resolve, inputs) for inputs in request.get("grid", [])]
    after = _process_state()
    del os.environ["SGLANG_RAGGED_VERIFY_MODE"]  # parse_argv reads it: the command lines bring their own
    argv = [_attempt(sglang_parser_oracle.parse_argv, args) for args in request.get("argv", [])]
    cli = []
    for item in request.get("cli", []):
        stdin, out, err = sys.stdin, io.StringIO(), io.StringIO()
        sys.stdin = io.StringIO(item)
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = sglang_native.main()
        finally:
            sys.stdin = stdin
        cli.append({"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()})
    answer = {"version": sglang_native.installed_version(), "grid": grid, "argv": argv, "cli": cli,
              "flags": sglang_parser_oracle.flag_table(), "state_before": before, "state_after": after,
              "running_defaults": _running_defaults()}
    Path(sys.argv[1]).write_text(json.dumps(answer), encoding="utf-8")


if __name__ == "__main__":
    main()
