"""Start real sglang 0.5.23 with ``--disable-cuda-graph`` up to its ready point and see when the ledger is written.

Usage: ``python sglang_ready_worker.py OUT.json``, with ``SGLANG_PLUGINS=jitwarm`` and ``JITWARM_LEDGER`` set.
sglang's own ``load_plugins()`` registers jitwarm's plugin through its entry point. The worker then publishes a
real ``ServerArgs(disable_cuda_graph=True)`` as a scheduler does and calls sglang's own
``Scheduler.init_all_cuda_graphs`` (scheduler.py:1122, called unconditionally by ``init_model_worker`` at :1146),
which calls ``TpModelWorker.init_cuda_graphs`` (tp_worker.py:433) and the model runner's ``init_cuda_graphs``
(model_runner.py:1170, hooked by the plugin), whose whole body runs: ``capture_cuda_graphs``
(cuda_graph_setup.py:391) builds the eager runner and captures nothing.

Faked, because a CPU box has neither:

- the GPU: tensors sglang asks for on ``cuda`` are made on the host (:class:`HostTensorsForCuda`), and the
  runner's forward stream (``torch.cuda.Stream()``, model_runner.py:469) is None;
- the TP group (a GroupCoordinator in a server): one rank, no PCIe-IPC communicator.

Not faked but not built whole: the scheduler, its TP worker and the model runner are sglang's classes made
without their ``__init__`` (which loads a model onto a GPU), given only the attributes this path reads (each
says where a server sets it). The model is an empty ``torch.nn.Module`` with the ``shared_experts_config``
sglang's loader gives a model class without fusion hooks (loader.py:292,311).

A spy around ``jitwarm.precompile.ledger.report_after_capture`` (it calls through) notes, when the plugin reports,
the call stack, whether the ledger file exists yet, and what sglang's ``init_cuda_graphs`` body has left on the
runner. OUT.json holds those notes and the runner's state afterwards.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import types
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

#: The runner attributes ``ModelRunner.init_cuda_graphs`` sets from its capture (model_runner.py:1200-1209).
SET_BY_INIT_CUDA_GRAPHS = ("eager_runner", "prefill_cuda_graph_runner", "decode_cuda_graph_runner",
                           "decode_cuda_graph_captured", "graph_memory_usage", "graph_time_usage")


class HostTensorsForCuda(TorchFunctionMode):
    """Fake #1, the GPU: a tensor sglang asks for on ``cuda`` is made on the host (the CPU torch cannot make it)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


class FakeTPGroup:
    """Fake #2, the TP group (a GroupCoordinator in a server): one rank, no PCIe-IPC all-reduce."""

    world_size = 1
    pcie_ipc_comm = None  # read by the eager runner's warmup (base_runner.py:357)

    def barrier(self) -> None:
        pass


def publish_disabled_server_args():
    """Publish ``ServerArgs(disable_cuda_graph=True)`` for the scheduler role, its CUDA-graph config resolved."""
    from sglang.srt.arg_groups.cuda_graph_hook import handle_cuda_graph_config
    from sglang.srt.runtime_context import get_exec, publish
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs(model_path="dummy", device="cuda", disable_cuda_graph=True)
    # "dummy" is sglang's no-model path: its pipeline returns before the model steps (pipeline.py:105-109), one
    # of which is handle_cuda_graph_config (pipeline.py:191); it is called here as the pipeline would.
    server_args.resolve_once()
    handle_cuda_graph_config(server_args)
    publish(server_args, role="scheduler")  # as run_scheduler_process does (scheduler.py:6327)
    config = get_exec().graph.cuda_graph_config
    return server_args, {"decode": str(config.decode.backend), "prefill": str(config.prefill.backend)}


def model_runner(server_args):
    """sglang's ModelRunner without its __init__, with what the fully disabled path of init_cuda_graphs reads."""
    from sglang.srt.kv_canary.api import install_canary
    from sglang.srt.layers.moe.utils import resolve_shared_experts_config
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    runner = object.__new__(ModelRunner)
    runner.server_args = server_args
    runner.device = "cuda"
    runner.gpu_id = 0
    runner.is_draft_worker = False
    runner.is_generation = True
    runner.spec_algorithm = SpeculativeAlgorithm.from_string(None)  # no speculative decoding
    runner.max_running_requests = 4      # from the memory pool's sizing in a server
    runner.max_total_num_tokens = 64
    runner.model_config = types.SimpleNamespace(is_encoder_decoder=False, quantization=None)
    runner.model = torch.nn.Module()
    runner.model.shared_experts_config = resolve_shared_experts_config(type(runner.model), None, None)
    runner.forward_stream = None  # the GPU's stream; read only with symmetric memory on (cuda_graph_setup.py:528)
    runner.canary_manager = install_canary(server_args=server_args, model_runner=runner)  # None: canary off
    return runner


def scheduler(runner):
    """sglang's Scheduler and TpModelWorker without their __init__: one TP worker, no draft worker."""
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.managers.tp_worker import TpModelWorker

    worker = object.__new__(TpModelWorker)
    worker._model_runner, worker.model_runner_list = runner, [runner]  # tp_worker.py:316, :487
    sched = object.__new__(Scheduler)
    sched.tp_worker, sched.draft_worker = worker, None
    return sched


def runner_state(runner) -> dict:
    """What init_cuda_graphs has left on the runner: for each attribute it sets, a short description or None."""
    state = {}
    for name in SET_BY_INIT_CUDA_GRAPHS:
        if not hasattr(runner, name):
            state[name] = None
            continue
        value = getattr(runner, name)
        state[name] = repr(value) if isinstance(value, (bool, dict, type(None))) else type(value).__name__
    state["prefill_runner_is_eager_runner"] = (getattr(runner, "prefill_cuda_graph_runner", None) is not None
                                               and runner.prefill_cuda_graph_runner is runner.eager_runner)
    return state


def spy_on_the_ledger(runner, ledger_path: Path, seen: list) -> None:
    """Note the stack, the file and the runner each time the plugin reports the ledger; then report it."""
    from jitwarm.precompile import ledger

    report = ledger.report_after_capture

    def spy(*args, **kwargs):
        frame, stack = sys._getframe(1), []
        while frame is not None:
            stack.append(f"{frame.f_globals.get('__name__')}.{frame.f_code.co_qualname}")
            frame = frame.f_back
        seen.append({"stack": stack, "ledger_existed": ledger_path.exists(),
                     "runner": runner_state(runner)})
        return report(*args, **kwargs)

    ledger.report_after_capture = spy


def main() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="LOG %(name)s %(levelname)s %(message)s")
    out_path, ledger_path = Path(sys.argv[1]), Path(os.environ["JITWARM_LEDGER"])
    from sglang.srt.plugins import load_plugins

    load_plugins()  # discovers the jitwarm entry point from the installed metadata, then applies the hooks
    from sglang.srt.runtime_context import get_parallel

    server_args, backends = publish_disabled_server_args()
    runner = model_runner(server_args)
    sched = scheduler(runner)
    seen: list = []
    spy_on_the_ledger(runner, ledger_path, seen)
    before = {"ledger_existed": ledger_path.exists(), "runner": runner_state(runner)}
    with HostTensorsForCuda(), get_parallel().override(tp_group=FakeTPGroup()):
        sched.init_all_cuda_graphs()
    result = {"pid": os.getpid(), "cuda_graph_config": backends, "before": before, "reports": seen,
              "after": {"ledger_existed": ledger_path.exists(), "runner": runner_state(runner)}}
    out_path.write_text(json.dumps(result, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
