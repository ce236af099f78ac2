"""What the seed's model card and reports claim, as data, each with where it comes from.

The book checks these against measurement (chapter 7 tabulates them). Only claims live here; every
measured value is computed by the chapter that shows it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Claim:
    key: str
    text: str
    value: object
    source: str


CLAIMS = {
    c.key: c
    for c in (
        Claim("variant_sizes_gb", "4/6/8-bit conversions weigh about 20, 28 and 36 GB", {4: 20, 6: 28, 8: 36},
              "the seed's model card, table of variants"),
        Claim("head_size_gb", "the MTP head is about 0.5 GB", 0.5, "the seed's model card"),
        Claim("acceptance_n_draft_2", "about 78% of drafts accepted at n_draft=2", 0.78,
              "lemon-mlx-engine report (June 2026); 0.76-0.80 in several engines"),
        Claim("acceptance_n_draft_3", "about 59% at n_draft=3", 0.59, "lemon-mlx-engine report (June 2026)"),
        Claim("speedup_moe", "MTP gives 1.1x to 1.4x on A3B MoE models", (1.1, 1.4),
              "vllm-mlx PR #245, llama.cpp PR #22673, kyuz0/amd-strix-halo-vllm-toolboxes issue #53"),
        Claim("speedup_radeon_890m", "26.1 tok/s plain vs 27.3 with MTP on a Radeon 890M", (26.1, 27.3),
              "lemon-mlx-engine report"),
    )
}
