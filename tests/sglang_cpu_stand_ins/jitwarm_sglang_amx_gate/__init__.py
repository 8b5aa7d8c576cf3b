"""Test-only sglang plugin: opens sglang's CPU graph runner (its capture ladder) on a CPU without AMX.

What it replaces: an AMX CPU with sgl-kernel's CPU build. ``--device cpu --enable-torch-compile`` makes sglang's
``CPUGraphRunner`` compile one graph per decode batch size, the CPU form of the CUDA-graph ladder jitwarm captures
and restores. Two gates keep it shut on this project's CPUs:

1. the runner calls ``attn_backend.init_cpu_graph_state`` (``srt/model_executor/cpu_graph_runner.py:680``), which
   only the ``intel_amx`` attention backend has, and sglang turns ``intel_amx`` into ``torch_native`` on a platform
   without AMX (``srt/arg_groups/overrides.py:1301-1310``; ``has_amx`` needs AMX tiles in hardware);
2. the runner registers fake kernels for about 55 ``sgl_kernel::`` ops and fails on the first that does not exist
   (``cpu_graph_runner.py:153-155, 171+``).

:func:`register` (an ``sglang.srt.plugins`` entry point, loaded beside jitwarm's in every sglang process) says the
platform has AMX through sglang's own ``override_platform``, defines the two attention ops ``IntelAMXAttnBackend``
calls (``decode_attention_cpu``, ``extend_attention_cpu``) in plain torch, and every other op name the runner
needs as a placeholder that raises if called (none is: ``convert_weight_packed`` stays undefined, so the layers
keep their torch-native paths). On an AMX host with sgl-kernel's CPU build none of this is needed.
"""

from __future__ import annotations

import torch

#: The ops ``register_fake_ops`` gives fake kernels to (cpu_graph_runner.py:171-612), besides the two defined here.
PLACEHOLDERS = (
    "apply_multidimensional_rope_cpu", "apply_rotary_pos_emb_cpu", "biased_grouped_topk_cpu", "bmm_cpu",
    "causal_conv1d_fwd_cpu", "causal_conv1d_update_cpu", "chunk_gated_delta_rule_cpu",
    "fp8_per_tensor_scaled_mm_cpu", "fp8_scaled_mm_cpu", "fused_add_layernorm_cpu", "fused_add_rmsnorm_cpu",
    "fused_dual_residual_rmsnorm_cpu", "fused_experts_cpu", "fused_gdn_gating_cpu", "fused_input_proj_cpu",
    "fused_linear_sigmoid_mul", "fused_moe_router_cpu", "fused_qk_gemma_rmsnorm_cpu",
    "fused_qk_gemma_rmsnorm_with_gate_cpu", "fused_qk_rmsnorm_apply_from_stats_cpu", "fused_qk_rmsnorm_cpu",
    "fused_qk_rmsnorm_sumsq_cpu", "fused_qkvzba_split_reshape_cat_contiguous_cpu",
    "fused_qkvzba_split_reshape_cat_cpu", "fused_rmsnorm_gated_cpu", "fused_sigmoid_gating_delta_rule_update_cpu",
    "fused_sigmoid_mul_cpu", "gelu_and_mul_cpu", "gelu_tanh_and_mul_cpu", "gemma3_rmsnorm_cpu",
    "gemma4_rmsnorm_cpu", "gemma_fused_add_rmsnorm_cpu", "gemma_rmsnorm_cpu", "grouped_topk_cpu",
    "int4_scaled_mm_cpu", "int8_scaled_mm_cpu", "int8_scaled_mm_with_quant", "l2norm_cpu", "layernorm_cpu",
    "multimodal_rotary_embedding_cpu", "mxfp4_scaled_mm_cpu", "per_token_quant_int8_cpu", "qkv_proj_with_rope",
    "qkv_proj_with_rope_fused_weight", "rmsnorm_cpu", "rotary_embedding_cpu", "shared_expert_cpu",
    "shm_allgather", "shm_allreduce", "silu_and_mul_cpu", "topk_sigmoid_cpu", "topk_softmax_cpu",
    "weight_packed_linear",
)
#: The two ops' schemas, argument for argument as ``IntelAMXAttnBackend`` passes them
#: (``srt/layers/attention/intel_amx_backend.py``: ``forward_extend``, ``forward_decode``).
DECODE = ("decode_attention_cpu(Tensor query, Tensor(a!) k_cache, Tensor(b!) v_cache, float k_scale, float v_scale, "
          "Tensor(c!) output, Tensor? key, Tensor? value, Tensor loc, Tensor(d!) attn_logits, Tensor req_to_token, "
          "Tensor req_pool_indices, Tensor seq_lens, float sm_scale, float logit_cap, bool is_cross_attention, "
          "int sliding_window, Tensor? encoder_lens, Tensor? sinks) -> ()")
EXTEND = ("extend_attention_cpu(Tensor q_extend, Tensor? k_extend, Tensor? v_extend, Tensor(a!) o_extend, "
          "Tensor k_buffer, Tensor v_buffer, float k_scale, float v_scale, Tensor req_to_token, "
          "Tensor req_pool_indices, Tensor seq_lens, Tensor extend_seq_lens, Tensor extend_start_loc, "
          "int max_len_extend, float sm_scale, float logit_cap, bool is_cross_attention, int sliding_window, "
          "Tensor? encoder_lens, Tensor? sinks, Tensor? tree_mask, bool is_causal) -> ()")

_library: torch.library.Library | None = None


def register() -> None:
    """The ``sglang.srt.plugins`` entry point: the platform says AMX, the ops the runner needs exist."""
    global _library
    from sglang.srt.runtime_context import override_platform

    override_platform(has_amx=True).install()
    if _library is not None or hasattr(torch.ops.sgl_kernel, "decode_attention_cpu"):
        return
    _library = torch.library.Library("sgl_kernel", "DEF")
    _library.define(DECODE)
    _library.impl("decode_attention_cpu", _decode, "CPU")
    _library.define(EXTEND)
    _library.impl("extend_attention_cpu", _extend, "CPU")
    for name in PLACEHOLDERS:
        _library.define(f"{name}(Tensor x) -> ()")
        _library.impl(name, _placeholder(name), "CPU")


def _placeholder(name: str):
    def never_called(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel::{name}: a placeholder of jitwarm's test plugin (no AMX kernels)")
    return never_called


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float,
            cap: float) -> torch.Tensor:
    """Softmax attention of ``q`` [T, H, D] over ``k``/``v`` [L, Hkv, D] where ``visible`` [T, L]; float32."""
    group = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(group, dim=1), v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,lhd->htl", q.float(), k) * scale
    if cap > 0:
        scores = cap * torch.tanh(scores / cap)
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("htl,lhd->thd", scores.softmax(dim=-1), v)


def _decode(query, k_cache, v_cache, k_scale, v_scale, output, key, value, loc, attn_logits, req_to_token,
            req_pool_indices, seq_lens, sm_scale, logit_cap, is_cross_attention, sliding_window, encoder_lens,
            sinks) -> None:
    """One new token per request: write its K/V at ``loc``, then attend over the request's rows."""
    if key is not None and value is not None:
        k_cache[loc] = key.to(k_cache.dtype)
        v_cache[loc] = value.to(v_cache.dtype)
    for b in range(query.shape[0]):
        rows = req_to_token[req_pool_indices[b], :seq_lens[b]].long()
        visible = torch.ones(1, rows.numel(), dtype=torch.bool)
        out = _attend(query[b:b + 1], k_cache[rows], v_cache[rows], visible, sm_scale, logit_cap)
        output[b] = out[0].to(output.dtype)


def _extend(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, k_scale, v_scale, req_to_token,
            req_pool_indices, seq_lens, extend_seq_lens, extend_start_loc, max_len_extend, sm_scale, logit_cap,
            is_cross_attention, sliding_window, encoder_lens, sinks, tree_mask, is_causal) -> None:
    """Prefill: the new tokens' K/V are in the buffers already (set_kv_buffer); causal over prefix and new."""
    for b in range(seq_lens.shape[0]):
        total, new, start = int(seq_lens[b]), int(extend_seq_lens[b]), int(extend_start_loc[b])
        rows = req_to_token[req_pool_indices[b], :total].long()
        positions = torch.arange(total - new, total).unsqueeze(1)
        visible = torch.arange(total).unsqueeze(0) <= positions if is_causal else torch.ones(new, total,
                                                                                              dtype=torch.bool)
        out = _attend(q_extend[start:start + new], k_buffer[rows], v_buffer[rows], visible, sm_scale, logit_cap)
        o_extend[start:start + new] = out.to(o_extend.dtype)
