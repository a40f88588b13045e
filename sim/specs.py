"""Hardware and model specifications, and the KV-cache capacity they leave.

A `HardwareSpec` holds public datasheet peaks for one accelerator; a `ModelSpec` holds the shapes of
one transformer. Together they give the analytic cost model its inputs and the simulator its number
of KV-cache blocks (`kv_capacity_blocks`), the way vLLM sizes its cache: a fraction of device memory,
minus the weights, minus the activation peak of a profiling forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 1024**3
MiB = 1024**2
_TERA = 1e12
_GIGA = 1e9


@dataclass(frozen=True)
class HardwareSpec:
    """One accelerator's peak numbers (per device).

    peak_flops: dense fp16/bf16 tensor-core FLOP/s (no sparsity).
    mem_bandwidth: HBM bandwidth, B/s.
    memory_bytes: device memory as CUDA reports it (nvidia-smi "Total"); vLLM's
        `gpu_memory_utilization` is a fraction of this.
    interconnect_bandwidth: GPU<->GPU bandwidth per direction (NVLink), B/s, used for the
        tensor-parallel all-reduce.
    pcie_bandwidth: host<->device bandwidth per direction, B/s, used for KV swap.
    """

    name: str
    peak_flops: float
    mem_bandwidth: float
    memory_bytes: int
    interconnect_bandwidth: float
    pcie_bandwidth: float


@dataclass(frozen=True)
class ModelSpec:
    """Shapes of a decoder-only transformer; enough to count parameters, bytes and FLOPs.

    arch "opt": learned positions, LayerNorm (weight + bias), biases on every linear, 2-matrix ReLU MLP.
    arch "llama": rotary positions (no parameters), RMSNorm (weight only), no biases, 3-matrix
    SwiGLU MLP, grouped-query attention when num_kv_heads < num_heads.
    """

    name: str
    arch: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position: int
    dtype_bytes: int = 2
    tied_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.arch not in ("opt", "llama"):
            raise ValueError(f"{self.name}: arch must be 'opt' or 'llama', got {self.arch!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.name}: num_heads {self.num_heads} is not a multiple of "
                             f"num_kv_heads {self.num_kv_heads}")

    # --- parameter counts -------------------------------------------------------------------------

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def attn_params_per_layer(self) -> int:
        """q, k, v and output projections (with biases for OPT)."""
        h = self.hidden_size
        weights = h * self.q_size + 2 * h * self.kv_size + self.q_size * h
        biases = self.q_size + 2 * self.kv_size + h if self.arch == "opt" else 0
        return weights + biases

    @property
    def mlp_params_per_layer(self) -> int:
        """fc1/fc2 with biases (OPT) or gate/up/down without biases (Llama)."""
        h, f = self.hidden_size, self.intermediate_size
        if self.arch == "opt":
            return 2 * h * f + f + h
        return 3 * h * f

    @property
    def norm_params_per_layer(self) -> int:
        """Two norms per layer: LayerNorm has weight and bias, RMSNorm only a weight."""
        return 2 * self._norm_params

    @property
    def params_per_layer(self) -> int:
        return self.attn_params_per_layer + self.mlp_params_per_layer + self.norm_params_per_layer

    @property
    def embedding_params(self) -> int:
        """Token embeddings plus, for OPT, learned positions (OPT offsets positions by 2)."""
        tokens = self.vocab_size * self.hidden_size
        positions = (self.max_position + 2) * self.hidden_size if self.arch == "opt" else 0
        return tokens + positions

    @property
    def lm_head_params(self) -> int:
        """Separate output projection; zero when tied to the token embeddings."""
        return 0 if self.tied_embeddings else self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        return (self.embedding_params + self.num_layers * self.params_per_layer
                + self._norm_params + self.lm_head_params)  # + final norm

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """Key and value of one token across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def _norm_params(self) -> int:
        return 2 * self.hidden_size if self.arch == "opt" else self.hidden_size


# --- shipped hardware -----------------------------------------------------------------------------
# Sources: NVIDIA A100 datasheet (312 TFLOPS bf16 dense; 1,555 GB/s for 40GB, 2,039 GB/s for 80GB
# SXM4; NVLink 3 600 GB/s total = 300 GB/s per direction; PCIe Gen4 x16 64 GB/s total = 32 GB/s per
# direction). NVIDIA H100 datasheet, SXM5 (989 TFLOPS bf16 dense, 1,979 with sparsity; 3.35 TB/s;
# NVLink 4 900 GB/s total = 450 per direction; PCIe Gen5 x16 128 GB/s total = 64 per direction).
# NVIDIA H200 datasheet, SXM (same compute as H100; 4.8 TB/s; "141 GB"; NVLink 900 GB/s; PCIe Gen5).
# Memory sizes are nvidia-smi totals: A100 40GB 40960 MiB, A100 80GB 81920 MiB, H100 80GB HBM3
# 81559 MiB, H200 143771 MiB (the "141 GB" of the datasheet).

HARDWARE: dict[str, HardwareSpec] = {
    "a100-40gb": HardwareSpec("a100-40gb", 312 * _TERA, 1555 * _GIGA, 40960 * MiB, 300 * _GIGA, 32 * _GIGA),
    "a100-80gb": HardwareSpec("a100-80gb", 312 * _TERA, 2039 * _GIGA, 81920 * MiB, 300 * _GIGA, 32 * _GIGA),
    "h100-sxm": HardwareSpec("h100-sxm", 989 * _TERA, 3350 * _GIGA, 81559 * MiB, 450 * _GIGA, 64 * _GIGA),
    "h200": HardwareSpec("h200", 989 * _TERA, 4800 * _GIGA, 143771 * MiB, 450 * _GIGA, 64 * _GIGA),
}

_HARDWARE_ALIASES = {
    "a100": "a100-40gb", "a100-sxm4-40gb": "a100-40gb", "a100-40g": "a100-40gb",
    "a100-sxm4-80gb": "a100-80gb", "a100-80g": "a100-80gb",
    "h100": "h100-sxm", "h100-80gb": "h100-sxm", "h100-sxm5": "h100-sxm", "h100-80gb-hbm3": "h100-sxm",
    "h200-sxm": "h200", "h200-141gb": "h200",
}

# --- shipped models -------------------------------------------------------------------------------
# Shapes from each model's published config.json (OPT: Zhang et al. 2022, Table 1; LLaMA: Touvron et
# al. 2023; Llama 3: Meta's release; SmolLM2: HuggingFaceTB/SmolLM2-135M).

MODELS: dict[str, ModelSpec] = {
    m.name: m
    for m in [
        ModelSpec("opt-13b", "opt", 40, 5120, 40, 40, 128, 20480, 50272, 2048, tied_embeddings=True),
        ModelSpec("opt-66b", "opt", 64, 9216, 72, 72, 128, 36864, 50272, 2048, tied_embeddings=True),
        ModelSpec("opt-175b", "opt", 96, 12288, 96, 96, 128, 49152, 50272, 2048, tied_embeddings=True),
        ModelSpec("llama-7b", "llama", 32, 4096, 32, 32, 128, 11008, 32000, 2048),
        ModelSpec("llama-13b", "llama", 40, 5120, 40, 40, 128, 13824, 32000, 2048),
        ModelSpec("llama-3-8b", "llama", 32, 4096, 32, 8, 128, 14336, 128256, 8192),
        ModelSpec("llama-3-70b", "llama", 80, 8192, 64, 8, 128, 28672, 128256, 8192),
        # Llama 3.1: the same shapes as Llama 3, with a 128K context (max_position_embeddings 131072)
        ModelSpec("llama-3.1-8b", "llama", 32, 4096, 32, 8, 128, 14336, 128256, 131072),
        ModelSpec("llama-3.1-70b", "llama", 80, 8192, 64, 8, 128, 28672, 128256, 131072),
        ModelSpec("smollm2-135m", "llama", 30, 576, 9, 3, 64, 1536, 49152, 8192, tied_embeddings=True),
    ]
}

_MODEL_ALIASES = {
    "meta-llama-3-8b": "llama-3-8b", "llama3-8b": "llama-3-8b",
    "meta-llama-3-70b": "llama-3-70b", "llama3-70b": "llama-3-70b",
    "meta-llama-3.1-8b": "llama-3.1-8b", "llama3.1-8b": "llama-3.1-8b", "llama-3.1-8b-instruct": "llama-3.1-8b",
    "meta-llama-3.1-70b": "llama-3.1-70b", "llama3.1-70b": "llama-3.1-70b",
    "llama-1-7b": "llama-7b", "llama-1-13b": "llama-13b",
}


def _normalize(name: str) -> str:
    """Lower-case, drop an org prefix ("facebook/opt-13b") and vendor word, unify separators."""
    key = name.strip().lower().rsplit("/", 1)[-1]
    key = key.replace("_", "-").replace(" ", "-")
    return key.removeprefix("nvidia-")


def get_hardware(name: str) -> HardwareSpec:
    """Look up a shipped hardware spec by name or alias, case-insensitively."""
    key = _normalize(name)
    key = _HARDWARE_ALIASES.get(key, key)
    if key not in HARDWARE:
        raise ValueError(f"unknown hardware {name!r}; known: {', '.join(sorted(HARDWARE))}")
    return HARDWARE[key]


def get_model(name: str) -> ModelSpec:
    """Look up a shipped model spec by name or alias ("facebook/opt-13b"), case-insensitively."""
    key = _normalize(name)
    key = _MODEL_ALIASES.get(key, key)
    if key not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}")
    return MODELS[key]


# --- KV-cache capacity ----------------------------------------------------------------------------

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
    the SiLU*up product, 3f/tp). So the transformer peak is T * d * (2h + max(attn, mlp)).
    Logits are computed only for the last token of each sequence, in fp32, for max_num_seqs
    sequences; the vocabulary is sharded across devices but gathered for sampling, so every device
    holds _LOGITS_COPIES full [max_num_seqs, vocab] fp32 tensors.
    """
    h, f = model.hidden_size, model.intermediate_size
    attn_width = (model.q_size + 2 * model.kv_size + model.q_size) // tp
    mlp_width = (2 * f if model.arch == "opt" else 3 * f) // tp
    per_token = model.dtype_bytes * (2 * h + max(attn_width, mlp_width))
    hidden_peak = max_num_batched_tokens * per_token
    logits = min(max_num_seqs, max_num_batched_tokens) * model.vocab_size * _LOGITS_DTYPE_BYTES
    return tp * (hidden_peak + _LOGITS_COPIES * logits)


def kv_capacity_tokens(model: ModelSpec, hardware: HardwareSpec, tp: int = 1,
                       gpu_memory_utilization: float = 0.9,
                       activation_reserve_bytes: int | None = None) -> int:
    """Token slots of KV cache left after weights and activations, summed over `tp` devices.

    capacity bytes = gpu_memory_utilization * memory_bytes * tp - weight_bytes - activation reserve,
    where the reserve defaults to `estimate_activation_reserve(model, tp)` (see there). Each token slot
    costs `model.kv_bytes_per_token` (sharded across devices under tensor parallelism).
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
    free = usable - model.weight_bytes - reserve
    if free < model.kv_bytes_per_token:
        raise ValueError(
            f"{model.name} does not fit on {tp} x {hardware.name}: weights {model.weight_bytes / GiB:.1f} GiB"
            f" + activations {reserve / GiB:.2f} GiB exceed {usable / GiB:.1f} GiB usable"
            f" (gpu_memory_utilization={gpu_memory_utilization}); use a larger tp or device")
    return int(free // model.kv_bytes_per_token)


def kv_capacity_blocks(model: ModelSpec, hardware: HardwareSpec, block_size: int = 16, tp: int = 1,
                       gpu_memory_utilization: float = 0.9,
                       activation_reserve_bytes: int | None = None) -> int:
    """Whole KV blocks of `block_size` tokens that fit (see `kv_capacity_tokens`)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    tokens = kv_capacity_tokens(model, hardware, tp, gpu_memory_utilization, activation_reserve_bytes)
    return tokens // block_size

