"""Stand-in for the sgl-kernel CPU build in jitwarm's sglang test server: importable, one function real.

What it replaces: sgl-kernel's CPU wheel, which is not on PyPI. With ``SGLANG_USE_CPU_ENGINE=1`` sglang imports
CPU names from it at module load (``srt/mem_cache/allocation.py:45-46`` and the KV-move and speculative modules).
Only ``assign_req_to_token_pool_cpu`` is called on a plain start (``allocation.py:746``, on every allocation); the
others are names a start imports and never calls, so each raises if it ever is. This package registers no
``torch.ops.sgl_kernel`` op: sglang's ``cpu_has_amx_support()`` (``srt/utils/common.py:354-372``) stays False and
rmsnorm, silu and rope take their torch-native paths (the AMX gate plugin beside it adds only the two attention ops).
"""

from __future__ import annotations

import torch

__version__ = "0.0.0+jitwarm.stand_in"


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor, out_cache_loc: torch.Tensor,
                                 pool_len: int) -> None:
    """Write each request's new KV slots into its row: ``req_to_token[r, start:end] = out_cache_loc[...]``."""
    taken = 0
    for r, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True):
        req_to_token[r, start:end] = out_cache_loc[taken:taken + end - start]
        taken += end - start


def _never_called(name: str):
    def placeholder(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name}: jitwarm's test stand-in has only assign_req_to_token_pool_cpu")
    placeholder.__name__ = name
    return placeholder


#: The other CPU names a start imports (KV move, speculative decoding: ``srt/speculative/``, ``srt/mem_cache/``).
for _name in ("assign_draft_cache_locs_contiguous_cpu", "assign_extend_cache_locs_cpu",
              "build_tree_kernel_efficient_cpu", "copy_all_layer_kv_cache_cpu", "fill_accept_out_cache_loc_cpu",
              "fill_bonus_tokens_cpu", "verify_tree_greedy_cpu"):
    globals()[_name] = _never_called(_name)
