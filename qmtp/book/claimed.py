"""What lemon-mlx-engine's model card and reports claim, as typed values with their sources (`qmtp.book.claims` checks
them against the chapters). A module of data with no imports from the rest of the book, so the cost model
(`qmtp.book.throughput`) can read the reported acceptance without importing the checks, which import it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Claim:
    key: str
    text: str
    value: object
    source: str  # where the claim comes from, in words
    cite: tuple[str, ...] = ()  # the same sources as keys of book/references.bib
    real_model: bool = False  # a claim about the real model's numbers: judged only on the real model


CLAIMS = {
    c.key: c
    for c in (
        Claim("fixes_needed", "without the +1 norm shift and the conv1d layout fix the output is incoherent", None,
              "lemon-mlx-engine's model card; mlx-lm models/qwen3_5.py (sanitize: the +1 shift and moveaxis(2, 1))",
              ("lemonmlx", "mlxlm")),
        Claim("double_shift", "re-converting an MLX checkpoint shifts the norms a second time and breaks it", None,
              "lemon-mlx-engine's convert shifts the norms unconditionally", ("lemonmlx",)),
        Claim("variant_sizes_gb", "4/6/8-bit conversions weigh about 20, 28 and 36 GB", {4: 20, 6: 28, 8: 36},
              "lemon-mlx-engine's model card, table of variants", ("lemonmlx",)),
        Claim("head_size_gb", "the MTP head is about 0.5 GB", 0.5, "lemon-mlx-engine's model card", ("lemonmlx",)),
        Claim("acceptance_n_draft_2", "about 78% of drafts accepted at n_draft=2", 0.78,
              "lemon-mlx-engine report (June 2026); 0.76-0.80 in several engines",
              ("lemonmlx", "vllmmlx245", "llamacpp22673"), real_model=True),
        Claim("acceptance_n_draft_3", "about 59% at n_draft=3", 0.59, "lemon-mlx-engine report (June 2026)",
              ("lemonmlx",), real_model=True),
        Claim("crippled_head", "a conversion that drops the head's routed experts cripples its drafting "
              "(acceptance 0 in an earlier engine)", None, "earlier lemon-mlx-engine conversions", ("lemonmlx",)),
        Claim("bf16_head", "keep the MTP head in bf16: quantizing it costs acceptance", None, "lemon-mlx-engine's model card",
              ("lemonmlx",), real_model=True),
        Claim("speedup_moe", "MTP gives 1.1x to 1.4x on A3B MoE models", (1.1, 1.4),
              "vllm-mlx PR #245, llama.cpp PR #22673, kyuz0/amd-strix-halo-vllm-toolboxes issue #53",
              ("vllmmlx245", "llamacpp22673", "kyuz0strix53"), real_model=True),
        Claim("speedup_radeon_890m", "26.1 tok/s plain vs 27.3 with MTP on a Radeon 890M", (26.1, 27.3),
              "lemon-mlx-engine report", ("lemonmlx",), real_model=True),
        Claim("rocm_6bit_fault", "a ROCm build of MLX returns garbage from 6-bit quantized matmuls", 6,
              "NripeshN/mlx, mlx/backend/rocm/quantized/qmm.hip", ("nripeshmlxrocm",)),
    )
}
