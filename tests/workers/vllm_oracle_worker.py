"""Answer the vLLM oracle's whole grid in one process: vLLM's own functions (``servers.vllm.native``) per config.

Usage: ``python vllm_oracle_worker.py OUT.json`` with ``{"grid": [inputs, ...]}`` on stdin; writes
``{"version", "seconds", "grid": [{"ok": resolution} | {"error": message}, ...]}``. The wheel must be importable
(``tests/vllm_wheel.py``); vLLM is imported once, by the first config.
"""

from __future__ import annotations

import json
import sys
import time


def vllm_reads(parser, args: list[str]) -> dict:
    """The capture settings vLLM's own serve parser reads from ``args`` (the api_server's: ``--model M ...``).

    ``make_arg_parser`` (entrypoints/common/cli_args.py) on a ``FlexibleArgumentParser``; then the merges
    ``create_engine_config`` and ``create_speculative_config`` make of the flags and the JSON configs, by hand
    (engine/arg_utils.py:2834-2849, :2108-2119: they need a model), with vLLM's own refusals.
    """
    try:
        ns = parser.parse_args(args)
    except SystemExit as exc:
        return {"error": f"argparse exit {exc.code}"}
    cc = ns.compilation_config
    out = {"model_path": ns.model, "max_num_seqs": ns.max_num_seqs, "max_num_batched_tokens": ns.max_num_batched_tokens,
           "tensor_parallel_size": ns.tensor_parallel_size, "optimization_level": int(ns.optimization_level),
           "enforce_eager": bool(ns.enforce_eager), "performance_mode": ns.performance_mode,
           "enable_chunked_prefill": ns.enable_chunked_prefill, "max_model_len": ns.max_model_len,
           "cudagraph_mode": cc.cudagraph_mode.name if cc.cudagraph_mode is not None else None}
    for key in ("cudagraph_capture_sizes", "max_cudagraph_capture_size"):
        flag, inner = getattr(ns, key), getattr(cc, key)
        if flag is not None and inner is not None:
            return {"error": f"{key} and compilation_config.{key} are mutually exclusive"}
        out[key] = flag if flag is not None else inner
    spec = dict(ns.speculative_config or {})
    if ns.spec_tokens is not None:
        if "num_speculative_tokens" in spec:
            return {"error": "--spec-tokens and --speculative-config['num_speculative_tokens'] are mutually exclusive"}
        spec["num_speculative_tokens"] = ns.spec_tokens
    out["num_speculative_tokens"] = spec.get("num_speculative_tokens") or 0
    return {"ok": out}


def main() -> int:
    from jitwarm.precompile.servers.vllm import native

    request = json.loads(sys.stdin.read())
    started = time.monotonic()
    answers = []
    for inputs in request["grid"]:
        try:
            answers.append({"ok": native.resolve(inputs)})
        except ValueError as exc:
            answers.append({"error": str(exc)})
    seconds = time.monotonic() - started
    with native._device(143771, 90):  # the parser's defaults read the device (DeviceConfig)
        from vllm.entrypoints.common.cli_args import make_arg_parser
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        parser = make_arg_parser(FlexibleArgumentParser())
        argv = [vllm_reads(parser, args) for args in request.get("argv", [])]
    with open(sys.argv[1], "w", encoding="utf-8") as out:
        json.dump({"version": native.installed_version(), "seconds": seconds, "grid": answers, "argv": argv}, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
