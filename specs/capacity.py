"""KV-cache capacity: what a fraction of device memory leaves after weights and activations,
the way vLLM sizes its cache."""

from __future__ import annotations

from specs.hardware import HardwareSpec
from specs.model import ModelSpec

GiB = 1024**3

# vLLM's defaults for the profiling pass: one forward over max_num_batched_tokens tokens spread over
# max_num_seqs sequences (max_num_batched_tokens defaults to max(max_model_len, 2048)).
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
DEFAULT_MAX_NUM_SEQS = 256
# Sampling holds about three fp32 [num_seqs, vocab] tensors at once: logits, probabilities and
# log-probabilities.
_LOGITS_COPIES = 3
_LOGITS_DTYPE_BYTES = 4


def estimate_activation_reserve(model: ModelSpec, tp: int = 1,
                             max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
                             max_num_seqs: int = DEFAULT_MAX_NUM_SEQS) -> int:
    """Peak activation memory of vLLM's profiling forward pass, summed over the `tp` devices.

    Derivation (per device, T = max_num_batched_tokens tokens, dtype d bytes). Layers run one after
    another and free their intermediates, so the peak is inside one layer. Alive throughout a layer:
    the residual stream and the normalised hidden states, 2*h per token. On top of that, the larger
    of the attention step (the fused qkv output plus the attention output, (q + 2kv)/tp + q/tp) and
    the MLP step (OPT: fc1 output and its activation, 2f/tp; Llama: the fused gate_up output and
    the SiLU*up product, 3f/tp; MoE: that for each of a token's experts, `_mlp_width`). So the
    transformer peak is T * d * (2h + max(attn, mlp)).
    Logits are computed only for the last token of each sequence, in fp32, for max_num_seqs
    sequences; the vocabulary is sharded across devices but gathered for sampling, so every device
    holds _LOGITS_COPIES full [max_num_seqs, vocab] fp32 tensors.
    """
    h = model.hidden_size
    attn_width = (model.q_size + 2 * model.kv_size + model.q_size) // tp
    mlp_width = _mlp_width(model) // tp
    per_token = model.dtype_bytes * (2 * h + max(attn_width, mlp_width))
    hidden_peak = max_num_batched_tokens * per_token
    logits = min(max_num_seqs, max_num_batched_tokens) * model.vocab_size * _LOGITS_DTYPE_BYTES
    return tp * (hidden_peak + _LOGITS_COPIES * logits)


def _mlp_width(model: ModelSpec) -> int:
    """Widest MLP intermediate one token holds: OPT 2f, SwiGLU 3f; a MoE layer 3 * (k routed experts'
    widths + the shared experts' width), a leading dense layer 3f."""
    if model.arch == "opt":
        return 2 * model.intermediate_size
    dense = 3 * model.intermediate_size if model.num_layers > model.num_moe_layers else 0
    moe = 3 * (model.experts_per_token * model.moe_intermediate_size + model.shared_expert_intermediate_size)
    return max(dense, moe)


def expert_weight_bytes(model: ModelSpec) -> int:
    """The routed experts' weights, all MoE layers (0 for a dense model)."""
    return model.num_moe_layers * model.num_experts * model.expert_params * model.dtype_bytes


def rank_weight_bytes(model: ModelSpec, expert_shards: int = 1) -> int:
    """Weights one data-parallel rank's GPUs hold when the routed experts are spread over
    `expert_shards` ranks (vLLM's DP for MoE: attention and dense layers replicated per rank, the
    experts split over all ranks' GPUs); `model.weight_bytes` itself at 1."""
    if expert_shards < 1:
        raise ValueError(f"expert_shards must be >= 1, got {expert_shards}")
    if expert_shards == 1:
        return model.weight_bytes
    experts = expert_weight_bytes(model)
    return model.weight_bytes - experts + experts // expert_shards


def kv_capacity_tokens(model: ModelSpec, hardware: HardwareSpec, tp: int = 1,
                       gpu_memory_utilization: float = 0.9,
                       activation_reserve_bytes: int | None = None, expert_shards: int = 1) -> int:
    """Token slots of KV cache left after weights and activations, summed over `tp` devices.

    capacity bytes = gpu_memory_utilization * memory_bytes * tp - weight_bytes - activation reserve,
    where the reserve defaults to `estimate_activation_reserve(model, tp)` (see there). Each token slot
    costs `model.kv_bytes_per_token` (sharded across devices under tensor parallelism).
    `expert_shards` > 1: these tp devices are one data-parallel rank of an MoE model whose experts are
    spread over that many ranks (`rank_weight_bytes`).
    Raises ValueError when the weights and activations leave no room.
    """
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    reserve = activation_reserve_bytes
    if reserve is None:
        reserve = estimate_activation_reserve(model, tp)
    usable = gpu_memory_utilization * hardware.memory_bytes * tp
    weights = rank_weight_bytes(model, expert_shards)
    free = usable - weights - reserve
    if free < model.kv_bytes_per_token:
        raise ValueError(
            f"{model.name} does not fit on {tp} x {hardware.name}: weights {weights / GiB:.1f} GiB"
            f" + activations {reserve / GiB:.2f} GiB exceed {usable / GiB:.1f} GiB usable"
            f" (gpu_memory_utilization={gpu_memory_utilization}); use a larger tp or device")
    return int(free // model.kv_bytes_per_token)


def kv_capacity_blocks(model: ModelSpec, hardware: HardwareSpec, block_size: int = 16, tp: int = 1,
                       gpu_memory_utilization: float = 0.9,
                       activation_reserve_bytes: int | None = None, expert_shards: int = 1) -> int:
    """Whole KV blocks of `block_size` tokens that fit (see `kv_capacity_tokens`)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    tokens = kv_capacity_tokens(model, hardware, tp, gpu_memory_utilization, activation_reserve_bytes,
                                expert_shards)
    return tokens // block_size

