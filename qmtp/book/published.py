"""The field, as published: MTP measurements of Qwen3.5/3.6-35B-A3B made by others, each with its source.

Nothing here was measured by this book. Every row is a figure someone else published, typed as they gave it
and labelled as published wherever it is shown; `checked` says whether the figure was read at its source
when this module was written (a row not checked there is shown "as reported in" its source). Chapter 8 sets
each row beside the bytes-only model of `qmtp.book.throughput` (`predict`), which prices a step by the bytes it
reads at the row's memory bandwidth; `qmtp.book.cost_model` calibrates each machine by its plain figure and
predicts every row of `FIELD` and `FAMILY` (the family's other members) out of sample. `RELATIVE` holds gains
published without tokens/s, shown beside the model and never priced.

**One draft-length convention.** `n_draft` counts the tokens one trunk pass verifies, the trunk's own
included (1 = plain decoding, 2 = one draft of the head). Other engines count drafts only:

    n_draft = lemon-mlx-engine's --n-draft = mlx-vlm's block_size
            = llama.cpp's --spec-draft-n-max + 1 = vLLM's num_speculative_tokens + 1        (`to_n_draft`)

**Acceptance** is the engines' "acceptance rate": drafts accepted over drafts proposed. When every step
proposes all n_draft - 1 drafts (as llama.cpp and vLLM do at a fixed length), a step emits on average

    tau = 1 + (n_draft - 1) * acceptance

tokens, which is what the cost model needs; `predict` prices a row by the one prediction every page uses,
`throughput.machine_prediction`, which turns it into one per-position rate giving the same tau
(`throughput.rates_for`), and assumes the reported rates where the source gives none.

**Memory bandwidth** is the peak of the memory that holds the weights, computed from its bus width and
transfer rate (vendor specifications): `bus_bits / 8 * megatransfers per second`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..config import QWEN36_35B_A3B, ModelConfig
from .throughput import GB, HEAD_BITS

ENGINE_DRAFT_COUNTS = {
    # engine: (its option, what it counts, how to get this book's n_draft from it)
    "qmtp": ("n_draft", "tokens per trunk pass, the trunk's own included", 0),
    "lemon-mlx-engine": ("--n-draft", "tokens per trunk pass, the trunk's own included", 0),
    "mlx-vlm": ("block_size", "tokens per trunk pass, the trunk's own included", 0),
    "llama.cpp": ("--spec-draft-n-max", "drafts per step", 1),
    "vLLM": ("num_speculative_tokens", "drafts per step", 1),
}


def to_n_draft(engine: str, value: int) -> int:
    """This book's n_draft for an engine's own draft-length option (`ENGINE_DRAFT_COUNTS`)."""
    if engine not in ENGINE_DRAFT_COUNTS:
        raise KeyError(f"no draft-length convention known for {engine!r}: {sorted(ENGINE_DRAFT_COUNTS)}")
    return value + ENGINE_DRAFT_COUNTS[engine][2]


def from_n_draft(engine: str, n_draft: int) -> int:
    """The value of an engine's draft-length option that verifies `n_draft` tokens per trunk pass."""
    return n_draft - to_n_draft(engine, 0)


def conversion_table(n_drafts=range(1, 6)) -> list[dict]:
    """One row per engine: its draft-length option and the value of it that gives each n_draft."""
    rows = []
    for engine, (option, counts, _) in ENGINE_DRAFT_COUNTS.items():
        row = {"engine": engine, "option": option, "counts": counts}
        row.update({f"n_draft={n}": from_n_draft(engine, n) for n in n_drafts})
        rows.append(row)
    return rows


@dataclass(frozen=True)
class Memory:
    """The memory that holds the weights, as the vendor specifies it."""

    name: str
    bus_bits: int
    megatransfers: int  # per second, per pin

    @property
    def bandwidth(self) -> float:
        """Peak bandwidth in bytes per second."""
        return self.bus_bits / 8 * self.megatransfers * 1e6


M3_ULTRA = Memory("LPDDR5-6400, 1024-bit", 1024, 6400)
STRIX_HALO = Memory("LPDDR5X-8000, 256-bit", 256, 8000)  # Ryzen AI Max+ 395 / Radeon 8060S
STRIX_POINT = Memory("LPDDR5X-7500, 128-bit", 128, 7500)  # Ryzen AI 300 / Radeon 890M
RTX_3060_LAPTOP = Memory("GDDR6 14 Gbps, 192-bit", 192, 14000)
A100_80GB = Memory("HBM2e, 5120-bit", 5120, 3186)
M2_ULTRA = Memory("LPDDR5-6400, 1024-bit", 1024, 6400)  # Apple quotes 800 GB/s
M4_PRO = Memory("LPDDR5X-8533, 256-bit", 256, 8533)  # Apple quotes 273 GB/s
UNNAMED = Memory("not named by the source", 0, 0)  # bandwidth 0: nothing can price a run on it


@dataclass(frozen=True)
class Published:
    """One published measurement: plain decoding against MTP on one machine, one request at a time."""

    key: str
    engine: str
    hardware: str
    memory: Memory
    model: str  # the checkpoint as the source names it
    bits: int  # the trunk's width, for the cost model
    engine_draft: int | None  # the engine's own draft-length value; None: not stated in the source
    acceptance: float | tuple[float, float] | None  # as the source gives it (a range as (low, high))
    plain_tps: float
    mtp_tps: float
    context: int  # tokens in the cache while decoding, about (prompt + half the output)
    source: str  # bib key in book/references.bib
    url: str
    checked: bool  # the figures were read at the source when this row was written
    conditions: tuple[str, ...] = ()  # keys of `CONDITIONS` the source reports
    where: str = ""  # where in the source the figures are
    convention: str = ""  # whose draft-length convention engine_draft follows (`ENGINE_DRAFT_COUNTS`); "": engine's
    member: str = "35B-A3B"  # the family member measured (`MEMBERS`); the cost model prices only members it has a config of

    @property
    def n_draft(self) -> int | None:
        return None if self.engine_draft is None else to_n_draft(self.convention or self.engine, self.engine_draft)

    @property
    def speedup(self) -> float:
        return self.mtp_tps / self.plain_tps

    @property
    def acceptance_mid(self) -> float | None:
        a = self.acceptance
        return (a[0] + a[1]) / 2 if isinstance(a, tuple) else a

    @property
    def bandwidth(self) -> float:
        return self.memory.bandwidth


# Why a published row and the cost model can part (the book says which applies to each row). Conditions a
# source reports are listed in its row; the last two are the book's own reading when the source reports none.
CONDITIONS = {
    "partial_offload": "part of the weights sit in system memory, read at its own, lower bandwidth, and the "
                       "source does not say which part, so no one bandwidth prices a pass",
    "long_context": "a long prompt: each pass also reads and attends over a long KV cache, a cost that grows with "
                    "the tokens a verify pass holds",
    "compute_bound_verify": "a pass over several tokens costs clearly more than its bytes (the verify pass is "
                            "compute-bound)",
    "engine_overhead": "a pass's time is mostly a fixed cost (kernel launches, synchronisation, sampling), paid "
                       "once per step and shared by the tokens a step yields, which raises the speedup above what the "
                       "bytes alone predict (`throughput.overhead_effect`)",
    "batching": "the engine drops MTP when it batches requests; the row is one request at a time",
    "assumed": "the source gives no draft length or no acceptance, so the prediction assumes them",
    "other_member": "another member of the family: priced with that member's config where this book has one "
                    "(third-party values, `MEMBERS`), not at all where it has none",
    "dense": "a dense model: a verify pass reads the same weights as a plain one, so the union of experts that "
             "decides the MoE's cost does not arise",
    "no_hardware": "the source does not name the machine, so no bandwidth or memory prices the run",
    "unreported": "the source reports nothing the cost model leaves out; a verify pass that costs more than its "
                  "bytes (compute-bound, what chapter 6 measures at the real widths on the machine that builds "
                  "this book) would part them this way",
}
ABOVE = ("engine_overhead",)  # conditions that make a published speedup exceed the memory-bound prediction
BELOW = ("partial_offload", "long_context", "compute_bound_verify")  # and those that make it fall short
LOW_SHARE = 0.5  # plain decoding below half the bandwidth bound: a pass is mostly fixed cost


FIELD = (
    Published("vllm_mlx_m3_ultra", "vllm-mlx", "Apple M3 Ultra", M3_ULTRA, "Qwen3.5-35B-A3B-4bit (MLX)", 4,
              1, (0.79, 0.80), 73.7, 85.9, 300, "vllmmlx245",
              "https://github.com/waybarrios/vllm-mlx/pull/245", True, ("batching",),
              "pull request description, benchmark table for Qwen3.5-35B-A3B-4bit (one draft: the head predicts "
              "the token after next)", "vLLM"),
    Published("rocm_vllm_strix_halo_128", "vLLM (ROCm fork)", "AMD Strix Halo", STRIX_HALO,
              "Intel/Qwen3.5-35B-A3B-int4-AutoRound", 4, None, None, 62.9, 87.2, 192, "rocmvllm933",
              "https://github.com/ROCm/vllm/pull/933", True, (),
              "pull request description, headline table, 128 tokens in / 128 out", "vLLM"),
    Published("rocm_vllm_strix_halo_4096", "vLLM (ROCm fork)", "AMD Strix Halo", STRIX_HALO,
              "Intel/Qwen3.5-35B-A3B-int4-AutoRound", 4, None, None, 61.1, 57.6, 4160, "rocmvllm933",
              "https://github.com/ROCm/vllm/pull/933", True, ("long_context",),
              "pull request description, headline table, 4096 tokens in / 128 out", "vLLM"),
    Published("vllm_strix_halo_awq_1", "vLLM", "AMD Strix Halo", STRIX_HALO,
              "cyankiwi/Qwen3.6-35B-A3B-AWQ-4bit", 4, 1, None, 24.6, 28.2, 402, "kyuz0strix53",
              "https://github.com/kyuz0/amd-strix-halo-vllm-toolboxes/issues/53", True, ("engine_overhead",),
              "comment of 2026-07-28, single-stream table (274-token prompt, 256 tokens out)"),
    Published("vllm_strix_halo_awq_4", "vLLM", "AMD Strix Halo", STRIX_HALO,
              "cyankiwi/Qwen3.6-35B-A3B-AWQ-4bit", 4, 4, None, 24.6, 31.2, 402, "kyuz0strix53",
              "https://github.com/kyuz0/amd-strix-halo-vllm-toolboxes/issues/53", True, ("engine_overhead",),
              "comment of 2026-07-28, single-stream table, its best draft length"),
    *(Published(f"llama_cpp_3060_laptop_{d}", "llama.cpp", "RTX 3060 Laptop, partial offload",
                RTX_3060_LAPTOP, "Qwen3.6-35B-A3B (GGUF)", 4, d, acc, 22.92, tps, 512, "llamacpp22673",
                "https://github.com/ggml-org/llama.cpp/pull/22673", False, ("partial_offload",),
                "pull request thread, a sweep of 1 to 4 drafts")
      for d, acc, tps in ((1, 0.884, 27.58), (2, 0.815, 29.39), (3, 0.713, 27.78), (4, 0.642, 26.09))),
    Published("llama_cpp_strix_halo_vulkan", "llama.cpp (Vulkan)", "AMD Strix Halo", STRIX_HALO,
              "Qwen3.6-35B-A3B-MTP-UD-Q8_K_XL (GGUF)", 8, 2, None, 45.5, 51.0, 512, "sacco2026strix",
              "https://dev.to/agustinsacco/frontier-logic-at-local-speed-the-2026-strix-halo-ultimate-benchmark-suite-2cdf",
              True, (), "results table (the 35B MoE row) and its llama-server configuration, --spec-draft-n-max 2",
              "llama.cpp"),
    Published("llama_cpp_a100", "llama.cpp", "NVIDIA A100-80GB", A100_80GB,
              "Qwen3.6-35B-A3B Hi-Fi MTP runtime (GGUF, Q4_K_M)", 4, 4, 0.76, 133.61, 198.96, 256, "fraqtl2026hifi",
              "https://huggingface.co/fraQtl/Qwen3.6-35B-A3B-Hi-Fi-MTP-runtime", True, (),
              "model card, measured numbers (50 prompts, 3 seeds, greedy); --spec-draft-n-max 4 with "
              "--spec-draft-n-min 1, so a step may propose fewer than 4 drafts"),
    Published("vllm_mlx_m2_ultra_8bit", "vllm-mlx", "Apple M2 Ultra", M2_ULTRA, "Qwen3.5-35B-A3B-8bit (MLX)", 8,
              None, None, 53.0, 71.5, 512, "vllmmlx170", "https://github.com/waybarrios/vllm-mlx/issues/170",
              False, ("batching",), "issue thread, as summarised in this project's reference notes (section 11): "
              "53.0 -> 71.5 tok/s, 1.35x; draft length and acceptance not given", "vLLM"),
    Published("lemon_radeon_890m", "lemon-mlx-engine", "AMD Radeon 890M", STRIX_POINT,
              "Qwen3.6-35B-A3B (MLX conversion)", 4, None, None, 26.1, 27.3, 512, "lemonmlx",
              "https://github.com/lemonade-sdk/lemon-mlx-engine", False, (),
              "the engine's reports (June 2026), which do not tie this run to a draft length or an acceptance; the "
              "trunk's width (4 bits) is assumed"),
)

# The family's other members in the published runs (section 11 of the project's reference notes). The 122B-A10B
# is priced with its config (`MEMBERS`, third-party values agreed by several copies); the dense 27B rows are kept,
# unpriced: no config of the 27B is readable here, and one of the two names no machine.
FAMILY = (
    Published("vllm_mlx_m3_ultra_122b", "vllm-mlx", "Apple M3 Ultra", M3_ULTRA, "Qwen3.5-122B-A10B-4bit (MLX)", 4,
              1, None, 46.4, 52.0, 300, "vllmmlx245", "https://github.com/waybarrios/vllm-mlx/pull/245", False,
              ("batching", "other_member"), "the same benchmark table as the 35B-A3B row, as summarised in this "
              "project's reference notes (section 11); one draft, as for the 35B", "vLLM", "122B-A10B"),
    Published("mlx_lm_990_m4_pro_27b", "mlx-lm (PR 990)", "Apple M4 Pro", M4_PRO, "Qwen3.5-27B-4bit (MLX)", 4, None,
              0.806, 15.3, 23.3, 512, "mlxlm990", "https://github.com/ml-explore/mlx-lm/pull/990", False,
              ("other_member", "dense"), "pull request description, as summarised in this project's reference "
              "notes (section 11); the draft length is not given there", "", "27B (dense)"),
    Published("mlx_vlm_1167_27b", "mlx-vlm", "machine not named", UNNAMED, "Qwen3.6-27B-4bit (MLX)", 4, 3, 0.82, 34.96, 60.67,
              512, "mlxvlm", "https://github.com/Blaizzy/mlx-vlm/pull/1167", False,
              ("other_member", "dense", "no_hardware"), "pull request 1167, as summarised in this project's "
              "reference notes (section 11): block 3, 82.0% of drafts accepted; the machine is not named", "", "27B (dense)"),
)


@dataclass(frozen=True)
class Relative:
    """A published gain with no tokens/s to calibrate a machine by: shown beside the model, never priced."""

    key: str
    engine: str
    hardware: str
    gain: tuple[float, float]  # MTP over plain decoding, low and high, as the source gives them
    source: str
    url: str
    where: str


RELATIVE = (
    Relative("ik_llama_cpu", "ik_llama.cpp", "CPU only", (1.65, 1.65), "ikllama1815",
             "https://github.com/ikawrakow/ik_llama.cpp/pull/1815",
             "pull request 1815, as summarised in this project's reference notes (section 11): +65% CPU-only"),
    Relative("ik_llama_cuda", "ik_llama.cpp", "NVIDIA GPU (CUDA)", (1.10, 1.20), "ikllama1815",
             "https://github.com/ikawrakow/ik_llama.cpp/pull/1815",
             "the same pull request: +10-20% on CUDA"),
)


def member_config(member: str) -> ModelConfig | None:
    """The config the cost model prices a family member with, or None where this book has none."""
    return MEMBERS.get(member)


# The 122B-A10B's shape (section 11: no primary config.json readable here; values agreed by several third-party
# copies): the 35B's layout with a wider hidden size, 48 layers, wider experts and twice the linear value heads.
QWEN35_122B_A10B = replace(QWEN36_35B_A3B, hidden_size=3072, num_hidden_layers=48, layer_types=[],
                           moe_intermediate_size=1024, shared_expert_intermediate_size=1024, num_attention_heads=32,
                           linear_num_value_heads=64)
MEMBERS = {"35B-A3B": QWEN36_35B_A3B, "122B-A10B": QWEN35_122B_A10B}

# The 397B-A17B's shape (section 11: no primary config.json readable here): hidden 4096, 60 layers, 32 query / 2 KV
# heads of 256, 512 experts top-10 of width 1024, linear attention 16 key / 64 value heads of 128, one MTP layer.
# Its shared expert is 1024 wide in THUDM/slime's model script and most copies, 4096 in one test fixture
# (Megatron-Bridge): 1024 here, the 4096 reading beside it (`QWEN35_397B_A17B_WIDE_SHARED`).
QWEN35_397B_A17B = replace(QWEN36_35B_A3B, hidden_size=4096, num_hidden_layers=60, layer_types=[], num_experts=512,
                           num_experts_per_tok=10, moe_intermediate_size=1024, shared_expert_intermediate_size=1024,
                           num_attention_heads=32, linear_num_value_heads=64)
QWEN35_397B_A17B_WIDE_SHARED = replace(QWEN35_397B_A17B, shared_expert_intermediate_size=4096, layer_types=[])


@dataclass(frozen=True)
class ThirdPartyConfig:
    """A family member's shape from copies other than Qwen's own config.json, with what they disagree on."""

    member: str
    config: ModelConfig
    named: tuple[float, float]  # billions of parameters, total and active, as the member's name gives them
    source: str  # bib key
    url: str
    where: str
    disagreement: str = ""  # what the copies disagree on, and which reading `config` takes
    other: ModelConfig | None = None  # the config under the other reading


THIRD_PARTY_CONFIGS = (
    ThirdPartyConfig("122B-A10B", QWEN35_122B_A10B, (122, 10), "", "",
                     "the values several third-party copies agree on, as the project's reference notes (section 11) "
                     "record them; they name no copy, so none is cited"),
    ThirdPartyConfig("397B-A17B", QWEN35_397B_A17B, (397, 17), "slime397b",
                     "https://github.com/THUDM/slime/blob/main/scripts/models/qwen3.5-397B-A17B.sh",
                     "THUDM/slime's model script (num-layers 60, hidden-size 4096, 512 experts, top-10, "
                     "moe-ffn-hidden-size 1024, moe-shared-expert-intermediate-size 1024), with the values most "
                     "copies agree on (reference notes, section 11)",
                     "the shared expert: 1024 wide in slime's script and most copies, 4096 in one test fixture "
                     "(Megatron-Bridge); 1024 is used", QWEN35_397B_A17B_WIDE_SHARED),
)

# ---- links between machines: the latency of one small all_sum (chapter 9's cost model) --------------------------
@dataclass(frozen=True)
class Link:
    """A published latency of one transfer between two machines (`measured_on` names which), as the source states
    it. `bound`: "at most" where the source gives an upper bound ("< 50 us"), "about" where it gives a round figure."""

    key: str
    name: str
    seconds: float
    bound: str
    source: str  # bib key in book/references.bib
    url: str
    checked: bool
    where: str
    measured_on: str = "M3 Ultra"  # the machines (a `Memory` name of chapter 9) the latency was measured between
    bandwidth_bits: float | None = None  # bits per second the source measured over the link; None: not published
    medium: str = ""  # the cable and adapters between the machines, as the source names them


LINKS = (
    Link("rdma_thunderbolt5", "RDMA over Thunderbolt 5 (MLX's JACCL backend)", 50e-6, "at most", "geerling2025rdma",
         "https://www.jeffgeerling.com/blog/2025/15-tb-vram-on-mac-studio-rdma-over-thunderbolt-5", True,
         "blog post of 2025-12-18, introduction: RDMA over Thunderbolt 5 cuts the latency of a transfer between "
         "the machines \"from 300us down to < 50us\", on four M3 Ultra Mac "
         "Studios (read in the archive.is copy of the page); used here as the latency of one all_sum per MoE "
         "layer, between Macs only"),
    Link("tcp_between_macs", "TCP between Macs (before RDMA)", 300e-6, "about", "geerling2025rdma",
         "https://www.jeffgeerling.com/blog/2025/15-tb-vram-on-mac-studio-rdma-over-thunderbolt-5", True,
         "the same sentence: the latency of a transfer between the same Macs over TCP/IP, which RDMA replaces; "
         "used here as the latency of one all_sum per MoE layer, between Macs only"),
)


# Between Strix Halo machines (Linux): TCP over Ethernet, and RDMA over Converged Ethernet (RoCE v2) on a NIC that
# offers it. Thunderbolt RDMA is macOS's alone (Apple's RDMA over Thunderbolt, MLX's JACCL): none here.
STRIX_HALO_LINKS = (
    Link("tcp_strix_halo_1gbe", "TCP over 1 GbE", 74e-6, "about", "kyuz0rdma",
         "https://github.com/kyuz0/amd-strix-halo-vllm-toolboxes/blob/main/rdma_cluster/setup_guide.md", True,
         "setup guide, section 5.3, the expected output of its Ethernet-against-RDMA comparison script between two "
         "Framework Desktop (Strix Halo, 128 GB) boards: \"Ethernet (1G LAN) 0.074 ms, 0.94 Gbps\"; used here as "
         "the time of one step of an all_sum", "Strix Halo", 0.94e9, "the boards' 1 GbE LAN"),
    Link("tcp_strix_halo_100gbe", "TCP over 100 GbE", 68e-6, "about", "kyuz0rdma",
         "https://github.com/kyuz0/amd-strix-halo-vllm-toolboxes/blob/main/rdma_cluster/setup_guide.md", True,
         "the same table: \"Ethernet (RoCE NIC) 0.068 ms, 55.70 Gbps\", TCP over an Intel E810 100 GbE card in "
         "each board's PCIe x4 slot, a DAC cable between them; used here as the time of one step of an all_sum",
         "Strix Halo", 55.70e9, "Intel E810-CQDA1 100 GbE cards, QSFP28 DAC cable, PCIe x4"),
    Link("roce_strix_halo", "RoCE v2 over 100 GbE (RDMA)", 5.23e-6, "about", "kyuz0rdma",
         "https://github.com/kyuz0/amd-strix-halo-vllm-toolboxes/blob/main/rdma_cluster/setup_guide.md", True,
         "the same table: \"RDMA (RoCE) 5.23 us, 50.64 Gbps\" over the same cards (RCCL's transport in the "
         "guide's vLLM cluster); used here as the time of one step of an all_sum", "Strix Halo", 50.64e9,
         "Intel E810-CQDA1 100 GbE cards (RoCE v2, in-kernel irdma driver), QSFP28 DAC cable"),
)
MACHINE_LINKS = LINKS + STRIX_HALO_LINKS  # every link chapter 9 prices, each between the machines it was measured on
THUNDERBOLT_5_BITS = 80e9  # Thunderbolt 5's symmetric rate per direction (USB4 version 2.0): the Mac links' bound


def sources() -> set[str]:
    """Every bib key a published figure here rests on."""
    return ({r.source for r in FIELD + FAMILY} | {r.source for r in RELATIVE} | {k.source for k in MACHINE_LINKS}
            | {c.source for c in THIRD_PARTY_CONFIGS if c.source})


# ---- the cost model's view of a row -------------------------------------------------------------------------
ASSUMED_N_DRAFT = 2  # for a row whose source does not give its draft length: one draft, the head's own depth
# Conditions under which the cost model cannot price a row at all: with part of the weights in system memory,
# a pass reads some bytes at the GPU's bandwidth and the rest at the system memory's, and without the split
# (which the source does not give) no single bandwidth prices the row.
NOT_COMPARABLE = ("partial_offload",)


@dataclass(frozen=True)
class Prediction:
    row: Published
    n_draft: int
    acceptance: float | None  # the row's (its midpoint for a range); None: the reported rates were assumed
    assumed: tuple[str, ...]  # which of n_draft and acceptance the source did not give
    tokens_per_pass: float
    plain_bound_tps: float  # bandwidth / bytes of a plain pass: the most plain decoding can reach
    speedup: float  # the cost model's, memory-bound (no fixed cost per pass)
    plain_share: float  # published plain tokens/s over the bound
    reasons: tuple[str, ...] = field(default=())  # keys of CONDITIONS that explain a gap

    @property
    def comparable(self) -> bool:
        """Whether the cost model can price this row at all (`NOT_COMPARABLE`)."""
        return not set(self.row.conditions) & set(NOT_COMPARABLE)


AGREES = 0.10  # the prediction and the published speedup "agree" within 10% of the published one


def predict(row: Published, config: ModelConfig = QWEN36_35B_A3B) -> Prediction:
    """The cost model at the row's bandwidth, width, context, draft length and acceptance, by the one prediction
    every page uses (`throughput.machine_prediction`: head in bf16, acceptance by `throughput.rates_for`). A draft
    length the source does not give is assumed (`ASSUMED_N_DRAFT`); an acceptance it does not give is the
    reported one. `reasons` names the `CONDITIONS` that explain a gap between the two speedups, in the direction
    of the gap."""
    from .throughput import machine_prediction, total, trunk_pass_bytes
    from ..sizes import sizes

    assumed = []
    n = row.n_draft
    if n is None:
        n, assumed = ASSUMED_N_DRAFT, assumed + ["n_draft"]
    a = row.acceptance_mid
    if a is None:
        assumed.append("acceptance")
    p = machine_prediction(row.bandwidth, n, bits=row.bits, context=row.context, acceptance=a, config=config)
    report = sizes(config, row.bits, mtp_bits=HEAD_BITS)
    plain_bytes = total(trunk_pass_bytes(config, report, 1, row.context, config.num_experts_per_tok))
    bound = row.bandwidth / plain_bytes
    share = row.plain_tps / bound
    reasons = []
    if abs(row.speedup - p.speedup) > AGREES * row.speedup:
        above = row.speedup > p.speedup
        reasons = [c for c in row.conditions if c in (ABOVE if above else BELOW)]
        if above and share < LOW_SHARE and "engine_overhead" not in reasons:
            reasons.append("engine_overhead")
        if not above and not reasons:
            reasons.append("unreported")
        if assumed:
            reasons.append("assumed")
    return Prediction(row, n, a, tuple(assumed), p.tokens_per_pass, bound, p.speedup, share, tuple(reasons))


def agrees(p: Prediction) -> bool:
    """The cost model's speedup within `AGREES` of the published one, on a row it can price."""
    return p.comparable and abs(p.row.speedup - p.speedup) <= AGREES * p.row.speedup


def explain(p: Prediction) -> str:
    """Whether the cost model and the published speedup agree and, if not, why (or why the row cannot be
    priced); and why the published plain speed is where it is against the bandwidth bound."""
    speed = f"plain decoding ran at {p.plain_share:.0%} of the bandwidth bound"
    if not p.comparable:
        why = "; ".join(CONDITIONS[c] for c in p.row.conditions if c in NOT_COMPARABLE)
        return (f"not comparable: {why}. Against the bound of the GPU's memory alone, plain decoding ran at "
                f"{p.plain_share:.0%} of it (weights partly in system memory).")
    if agrees(p):
        head = "agrees within 10%"
    else:
        head = "published above the model" if p.row.speedup > p.speedup else "published below the model"
    missing = " or ".join("draft length" if a == "n_draft" else a for a in p.assumed)
    parts = [head] + [f"the source gives no {missing}, so the prediction assumes {'them' if len(p.assumed) > 1 else 'it'}" if r == "assumed" else
                      CONDITIONS[r] for r in p.reasons]
    if p.plain_share < LOW_SHARE:
        speed += " (a pass is mostly fixed cost)"
    return "; ".join(parts) + ". " + speed[0].upper() + speed[1:] + "."


def acceptance_shown(row: Published, p: Prediction) -> str:
    """The acceptance a row is priced with, as the table shows it: the source's, or the reported rates."""
    acc = row.acceptance
    if isinstance(acc, tuple):
        return f"{acc[0]:.2f}-{acc[1]:.2f}"
    if acc is not None:
        return f"{acc:.3f}"
    return "reported rates (assumed)"


def field_table(config: ModelConfig = QWEN36_35B_A3B) -> list[dict]:
    """FIELD beside the cost model, one dict per row (for the book's table); "predicted speedup" is None on a row
    the cost model cannot price (`NOT_COMPARABLE`)."""
    rows = []
    for r in FIELD:
        p = predict(r, config)
        rows.append({
            "key": r.key, "engine": r.engine, "hardware": r.hardware, "GB/s": r.bandwidth / GB,
            "n_draft": f"{p.n_draft}" + (" (assumed)" if "n_draft" in p.assumed else ""),
            "acceptance": acceptance_shown(r, p),
            "plain tok/s": r.plain_tps, "MTP tok/s": r.mtp_tps, "published speedup": r.speedup,
            "predicted speedup": p.speedup if p.comparable else None, "comparable": p.comparable,
            "plain bound tok/s": p.plain_bound_tps, "plain share": p.plain_share,
            "context": r.context, "source": r.source, "url": r.url, "checked": r.checked,
            "why": explain(p), "prediction": p,
        })
    return rows


# ---- the field under load: several requests decoded at once (chapter 11) -----------------------------------------
@dataclass(frozen=True)
class UnderLoad:
    """A published figure of MTP (or of plain decoding beside it) with several requests decoded at once, as the
    source gives it. `tps`: setting ("plain", "MTP, 4 requests", ...) -> tokens/s, aggregate over the requests;
    `ratio`: setting -> (low, high) as the source gives it; `acceptance`: setting -> drafts accepted over
    proposed. `mtp_kept`: whether the engine keeps drafting with more than one request."""

    key: str
    engine: str
    hardware: str
    model: str
    requests: int | None  # None: any number above one
    tps: dict = field(default_factory=dict)
    ratio: dict = field(default_factory=dict)
    acceptance: dict = field(default_factory=dict)
    mtp_kept: bool = True
    source: str = ""  # bib key in book/references.bib
    url: str = ""
    checked: bool = False  # the figures were read at the source (here: in the thread's text) when written
    where: str = ""


UNDER_LOAD = (
    UnderLoad("vllm_mlx_m3_ultra_8", "vllm-mlx", "Apple M3 Ultra", "Qwen3.5-35B-A3B-4bit (MLX)", 8,
              tps={"plain": 302.3, "MTP switched on": 307.3}, mtp_kept=False, source="vllmmlx245",
              url="https://github.com/waybarrios/vllm-mlx/pull/245", checked=True,
              where="pull request description, benchmark table for Qwen3.5-35B-A3B-4bit: at 8 concurrent requests "
                    "MTP is skipped (\"MTP auto-disables when batch > 1\"), 307.3 tok/s against the 302.3 of the "
                    "server without it; one request: 73.7 -> 85.9 tok/s (`FIELD`)"),
    UnderLoad("llama_cpp_4_slots", "llama.cpp (b10310)", "machine not named", "model not named", 4,
              ratio={"4 slots with MTP over 1 slot with MTP": (1.97, 1.97)}, source="unsloth8172",
              url="https://github.com/unslothai/unsloth/pull/8172", checked=True,
              where="pull request 8172 (Unsloth Studio), the comment that replaces the one-slot clamp: \"on b10310 "
                    "four slots with MTP measured 1.97x the batch throughput of one, and still beat four without "
                    "it\"; the clamp had been added for a draft-acceptance collapse above one slot (#7717)"),
    UnderLoad("omlx_batched_depth_1", "oMLX", "machine not named", "Qwen3.6", 4,
              acceptance={"one stream": 0.61, "batched": 0.56}, source="omlx3265",
              url="https://github.com/jundot/omlx/issues/3265", checked=False,
              where="as summarised in this project's reference notes (section 11): batched depth-1 MTP keeps ~56% "
                    "acceptance (61% one stream)"),
    UnderLoad("omlx_flash_next_4", "oMLX (batched MTP, #3265)", "Apple M3 Ultra", "Qwen3.8-Flash-Next oQ4e-mtp", 4,
              ratio={"per request, batched MTP (depth 5) over plain batching": (1.70, 1.90)}, source="omlx3265",
              url="https://github.com/jundot/omlx/issues/1550", checked=True,
              where="issue 1550, a comment of 2026-09-09 on the change #3265: 26-32 tok/s per session at 4-way "
                    "concurrency, depth 5, greedy, \"roughly 70-90% above the pure-batching baseline\""),
    UnderLoad("omlx_rowwise_m3_ultra", "oMLX (row-wise batched MTP)", "Apple M3 Ultra", "model not named", 4,
              tps={"plain batched, 2 requests": 65.2, "MTP, 2 requests": 53.3, "plain batched, 4 requests": 86.5,
                   "MTP, 4 requests": 52.5}, mtp_kept=False, source="omlx3569",
              url="https://github.com/jundot/omlx/issues/3569", checked=True,
              where="issue 3569, a comment quoting the docstring of `batch_generator._rowwise_batch_mtp_enabled`: "
                    "row-wise MTP 53.3/52.5 tok/s aggregate at batch 2/4 against 65.2/86.5 for standard batched "
                    "decode, so the opt-in stays off and MTP runs on single-row steps only"),
    UnderLoad("mlx_lm_990_server", "mlx-lm (PR 990)", "any", "Qwen3.5/3.6", None, mtp_kept=False, source="mlxlm990",
              url="https://github.com/ml-explore/mlx-lm/pull/990", checked=False,
              where="as summarised in this project's reference notes (section 11): its server turns MTP off while "
                    "batching"),
    UnderLoad("replayssm_b300", "vLLM with ReplaySSM", "NVIDIA B300", "hybrid SSM models, NVFP4", 16,
              ratio={"speculative (4 drafts) over plain": (1.87, 1.96)}, source="vllm49232",
              url="https://github.com/vllm-project/vllm/issues/49232", checked=False,
              where="RFC 49232 and its pull requests (as summarised in this project's reference notes, section 11): "
                    "vLLM's native path keeps one state snapshot per draft token, whose cost grows with the draft, "
                    "\"which is why the native path can fall below plain standard decode at serving batch\" (PR "
                    "49847); replaying cached inputs instead reaches 1.87-1.96x with 4 drafts"),
)
