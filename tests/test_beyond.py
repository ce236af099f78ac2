"""Chapter 9's helpers (qmtp.book.beyond) and the N-machine cost models it builds on (qmtp.book.throughput, section
5; qmtp.book.cost_model): the layout matches qmtp.parallel's blocks, the fit table is the smallest N that fits, the
family's third-party members are sized from their configs, the calibrated several-machine model is the one-machine
cost model at N = 1 and adds each all_sum exactly as MLX's backend for the link sums, only links that exist between
machines of one kind are priced, the how-to's hostfiles and commands are the ones qmtp and mlx.launch accept, and
the token comparison finds a difference. Arithmetic only: no ranks are started here (tests/test_distributed.py and
the chapter itself run them)."""

import re
from pathlib import Path

import pytest

from qmtp import sizes
from qmtp.book import beyond, published
from qmtp.book.throughput import (
    Machine,
    parallel_head_seconds,
    parallel_pass_seconds,
)
from qmtp.config import QWEN36_35B_A3B as REAL
from qmtp.parallel import ExpertShard

ROOT = Path(__file__).resolve().parents[1]
REPORT = sizes.sizes(REAL, 4, mtp_bits=None)  # the head in bf16, as the book converts it
MACHINE = Machine(published.M3_ULTRA.bandwidth)


@pytest.mark.parametrize("ranks", [1, 2, 4, 8])
def test_blocks_are_the_experts_each_rank_holds(ranks):
    E = REAL.num_experts
    got = beyond.blocks(E, ranks)
    want = [ExpertShard(None, r, ranks, E).rows for r in range(ranks)]  # (first, stop) as the loader uses them
    assert got == [(first, stop - 1) for first, stop in want]
    held = [e for first, last in got for e in range(first, last + 1)]
    assert held == list(range(E))  # every expert on exactly one rank


def test_blocks_refuse_experts_that_do_not_split():
    with pytest.raises(ValueError):
        beyond.blocks(256, 3)


def test_layout_rows_are_per_rank_bytes():
    rows = beyond.layout_rows(REPORT, REAL.num_experts, unit=1)
    for row in rows:
        assert row["per rank"] == sizes.per_rank_bytes(REPORT, row["ranks"])
        assert row["of one process"] == pytest.approx(row["per rank"] / rows[0]["per rank"])
    shares = [r["of one process"] for r in rows]
    assert shares == sorted(shares, reverse=True) and shares[-1] > 1 / 8  # the replicated part stays


@pytest.mark.parametrize("runtime", [False, True])
def test_fit_rows_give_the_smallest_n_that_fits(runtime):
    from qmtp.book import budget

    machines = (16, 32, 64, 128, 192)
    rows = beyond.fit_rows(REAL, machines, runtime=runtime)
    assert [r["width"] for r in rows] == ["bf16", "8-bit", "6-bit", "4-bit"]
    for row, bits in zip(rows, (16, 8, 6, 4)):
        report = sizes.sizes(REAL, bits, mtp_bits=None, router_bits=16 if bits == 16 else 8)
        if bits != 16:  # the book's conversions: head in bf16 (budget.stored_bytes)
            assert report.total_bytes == budget.stored_bytes(REAL, bits)
        assert row["whole GB"] == report.total_bytes / beyond.GB
        room = budget.RUNTIME_GB * 2**30 if runtime else 0
        for m in machines:
            n = row[f"{m} GB"]
            if n is None:
                assert sizes.per_rank_bytes(report, 8) + room > m * 2**30
                continue
            assert sizes.per_rank_bytes(report, n) + room <= m * 2**30
            if n > 1:
                assert sizes.per_rank_bytes(report, n // 2) + room > m * 2**30
    # more memory never needs more machines
    for row in rows:
        cells = [row[f"{m} GB"] or 99 for m in machines]
        assert cells == sorted(cells, reverse=True)


# ---- the cost model with a link's latency (issue 27 item 7) -----------------------------------------------
@pytest.mark.parametrize("ranks", [2, 4, 8])
@pytest.mark.parametrize("latency", [50e-6, 300e-6])
def test_each_pass_pays_one_all_sum_per_moe_layer(ranks, latency):
    L = REAL.num_hidden_layers
    for n in (1, 3):
        slow = parallel_pass_seconds(REAL, REPORT, n, ranks, MACHINE, latency)
        free = parallel_pass_seconds(REAL, REPORT, n, ranks, MACHINE, 0.0)
        assert slow - free == pytest.approx(L * latency, rel=1e-9)  # the same for a pass of 1 or 3 tokens
    head = parallel_head_seconds(REAL, REPORT, ranks, MACHINE, latency) - parallel_head_seconds(
        REAL, REPORT, ranks, MACHINE, 0.0)
    assert head == pytest.approx(latency, rel=1e-9)  # the head's one MoE layer


def test_link_texts_do_not_call_the_latency_a_memory_access():
    bib = (ROOT / "book" / "references.bib").read_text()
    entry = bib[bib.index("@misc{geerling2025rdma"):]
    entry = entry[: entry.index("\n}")]
    assert "memory access latency" not in entry
    for k in published.MACHINE_LINKS:
        assert "memory access latency" not in k.where and "all_sum" in k.where


# ---- the family's members ------------------------------------------------------------------------------------
def test_members_are_sized_from_their_configs():
    rows = {r["member"]: r for r in beyond.member_rows(bits=4, unit=1)}
    for member, config, _ in beyond.members():
        report = sizes.sizes(config, 4, mtp_bits=None)
        for n in (1, 2, 4, 8):
            key = f"{n} rank" + ("" if n == 1 else "s")
            assert rows[member][key] == sizes.per_rank_bytes(report, n)
    big = published.QWEN35_397B_A17B
    assert (big.num_experts, big.num_experts_per_tok, big.num_hidden_layers, big.hidden_size) == (512, 10, 60, 4096)
    assert big.layer_types.count("full_attention") == 15  # every fourth layer, rebuilt for 60 layers
    wide = published.THIRD_PARTY_CONFIGS[1]
    assert wide.other.shared_expert_intermediate_size == 4096 and "1024" in wide.disagreement
    assert all(c.source in published.sources() for c in published.THIRD_PARTY_CONFIGS if c.source)
    # the 1024 reading counts closer to the 17 B active of the name than the 4096 one
    active = {m: sizes.parameter_counts(c)["active"] for m, c, _ in beyond.members()}
    wide_key = next(m for m in active if "shared expert 4096" in m)
    assert abs(active["397B-A17B"] / 1e9 - 17) < abs(active[wide_key] / 1e9 - 17)


def test_fit_table_holds_every_member_at_every_width():
    rows = beyond.fit_table(machines_gb=(128, 256), widths=(16, 4))
    assert {r["member"] for r in rows} == {m for m, _, _ in beyond.members()}
    big = next(r for r in rows if r["member"] == "397B-A17B" and r["width"] == "4-bit")
    assert big["128 GB"] == 2 and big["256 GB"] == 1


# ---- several machines, calibrated ---------------------------------------------------------------------------
def test_one_machine_is_the_calibrated_cost_model():
    """On one machine the several-machine model is cost_model's prediction for the calibrating run, every width."""
    from qmtp.book import cost_model

    c, fit = cost_model.fitted_without(None)
    for kind in beyond.KINDS:
        row = next(r for r in cost_model.rows() if r.key == kind.calibrating)
        cal = beyond.Calibrated.of(kind, "35B-A3B", REAL)
        got = beyond.speeds(cal, 1, None)
        for n, tps in got.items():
            assert tps == pytest.approx(cost_model.predicted_tps(row, n, c, fit, own=False), rel=1e-9)
        assert got[1] == pytest.approx(row.plain_tps, rel=1e-9)  # plain decoding: the published figure


@pytest.mark.parametrize("backend, ranks, steps", [("ring", 2, 2), ("ring", 4, 6), ("jaccl", 2, 1), ("jaccl", 4, 1),
                                                   ("mpi", 2, 1), ("mpi", 4, 2), ("ring", 1, 0)])
def test_all_sum_steps_follow_the_backend(backend, ranks, steps):
    assert beyond.all_sum_steps(backend, ranks)[0] == steps
    with pytest.raises(KeyError):
        beyond.all_sum_steps("nccl", 2)


def test_each_pass_pays_its_all_sums_over_the_link():
    from dataclasses import replace

    from qmtp.book import cost_model

    c, _ = cost_model.fitted_without(None)
    kind = beyond.KINDS[1]
    cal = beyond.Calibrated.of(kind, "35B-A3B", REAL)
    for key in kind.links:
        link = next(k for k in published.MACHINE_LINKS if k.key == key)
        free = replace(link, seconds=0.0, bandwidth_bits=1e30)
        for ranks in (2, 4):
            for n in (1, 3):
                extra = beyond.step_seconds(cal, n, ranks, link, c) - beyond.step_seconds(cal, n, ranks, free, c)
                want = (REAL.num_hidden_layers * beyond.all_sum_seconds(link, ranks, beyond.expert_output_bytes(REAL, n))
                        + (n - 1) * beyond.all_sum_seconds(link, ranks, beyond.expert_output_bytes(REAL, 1)))
                assert extra == pytest.approx(want, rel=1e-6)
                steps, _ = beyond.all_sum_steps(beyond.BACKEND_OF[key], ranks)
                assert want >= (REAL.num_hidden_layers + n - 1) * steps * link.seconds


def test_only_links_that_exist_between_such_machines():
    """Thunderbolt RDMA (JACCL) is macOS's: only between Macs; every link is priced only for the machines it was
    measured between, by a backend MLX has for it."""
    for k in published.MACHINE_LINKS:
        assert beyond.BACKEND_OF[k.key] in beyond.BACKENDS
        if beyond.BACKEND_OF[k.key] == "jaccl":
            assert k.measured_on == "M3 Ultra" and "Thunderbolt" in k.name
    for kind in beyond.KINDS:
        for key in kind.links:
            link = next(k for k in published.MACHINE_LINKS if k.key == key)
            assert link.measured_on in kind.name
    strix = beyond.KINDS[1]
    assert not any(beyond.BACKEND_OF[k] == "jaccl" for k in strix.links)


def test_another_member_is_calibrated_by_its_own_figure_or_by_layers():
    from qmtp.book import cost_model

    mac, strix = beyond.KINDS
    own = beyond.Calibrated.of(mac, "122B-A10B", published.QWEN35_122B_A10B)
    row = next(r for r in cost_model.rows() if r.key == "vllm_mlx_m3_ultra_122b")
    assert own.overhead == cost_model.calibrate(row).overhead
    big = beyond.Calibrated.of(strix, "397B-A17B", published.QWEN35_397B_A17B)
    base = next(r for r in cost_model.rows() if r.key == strix.calibrating)
    assert big.overhead == pytest.approx(cost_model.calibrate(base).overhead * 60 / 40)
    check = beyond.overhead_transfer_check()
    assert check["scale"] == 48 / 40 and check["published"] == row.plain_tps
    assert abs(check["scaled error"]) < abs(check["unscaled error"])  # what the chapter says of the rule


def test_cluster_rows_list_only_what_fits():
    from qmtp.book import budget

    strix = beyond.KINDS[1]
    rows = beyond.cluster_rows(strix)
    assert not [r for r in rows if r["member"] == "397B-A17B" and r["machines"] == 1]  # 236 GB on a 128 GB box
    for r in rows:
        assert budget.fits(r["GB each"] * beyond.GB, strix.memory_gb)
        cells = [k for k, v in r.items() if isinstance(v, dict)]
        assert cells == (["one machine"] if r["machines"] == 1 else list(strix.links))
        for key in cells:
            assert r[key]["best"] >= r[key]["plain"]
    says = beyond.verdicts([(strix, rows)])
    assert says["rdma_within"] in ("within", "beyond") and says["rdma_ratio"] > 0
    one = {r["member"]: r["one machine"]["best"] for r in rows if r["machines"] == 1}
    beaten = [(r["member"], r["machines"], key) for r in rows if r["machines"] > 1 and r["member"] in one
              for key in strix.links if key not in beyond.RDMA and r[key]["best"] >= one[r["member"]]]
    assert (says["tcp"] == "is slower on several in every case") == (not beaten)
    assert says["tcp_except"].count(" machines over ") == len(beaten)


# ---- the how-to ----------------------------------------------------------------------------------------------
def test_the_howtos_hostfiles_and_commands_are_what_qmtp_and_mlx_accept(tmp_path):
    import json

    from qmtp import launch
    from qmtp.cli import build_parser

    ring = beyond.hostfile([("a", "10.0.0.1"), ("b", "10.0.0.2")])
    path = tmp_path / "hosts.json"
    path.write_text(json.dumps(ring))
    assert launch.hostfile_hosts(path) == 2
    cmd = launch.command(["-m", "qmtp", "chat", "M"], hostfile=path)
    assert cmd[cmd.index("--backend") + 1] == "ring" and "--hostfile" in cmd
    mesh = beyond.hostfile([("a", "10.0.0.1"), ("b", "10.0.0.2")], rdma=[[None, "rdma_en2"], ["rdma_en2", None]])
    assert mesh["backend"] == "jaccl" and mesh["hosts"][1]["rdma"] == ["rdma_en2", None]
    with pytest.raises(ValueError):
        beyond.hostfile([("a", "1"), ("b", "2")], rdma=[["x", None], [None, "y"]])
    jaccl = beyond.jaccl_command("M", "macs.json", "--use-mtp", "--n-draft", "4", "--prompt", "hi")
    assert jaccl[jaccl.index("--backend") + 1] == "jaccl" and f"{launch.RANKS_ENV}=1" in jaccl
    chat_args = jaccl[jaccl.index("qmtp") + 1:]
    args = build_parser().parse_args(chat_args)  # the command as the CLI really has it
    assert args.command == "chat" and args.n_draft == 4 and args.prompt == "hi"
    assert set(beyond.backends_here()) == {"ring", "jaccl", "mpi", "nccl"} and beyond.backends_here()["ring"]


def test_the_chapter_has_no_notes_to_its_author():
    text = (ROOT / "notebooks" / "09_beyond.py").read_text()
    for note in ("could not be read at their source", "Section 5 of", "when this chapter was written"):
        assert note not in text


# ---- the live check's bookkeeping ----------------------------------------------------------------------------
def _live(tokens_rank1):
    ref = {"1/0.0": [1, 2, 3], "3/0.8": [4, 5, 6]}
    return ref, {"ranks": [{"rank": 0, "tokens": dict(ref)}, {"rank": 1, "tokens": tokens_rank1}]}


def test_compare_finds_the_first_difference():
    ref, live = _live({"1/0.0": [1, 2, 3], "3/0.8": [4, 9, 6]})
    rows = beyond.compare(live, ref)
    assert len(rows) == 4
    bad = [r for r in rows if not r["equal"]]
    assert len(bad) == 1 and bad[0]["rank"] == 1 and bad[0]["n_draft"] == 3 and bad[0]["first difference"] == 1
    assert bad[0]["sampling"] == "temperature 0.8"
    ref, live = _live({"1/0.0": [1, 2], "3/0.8": [4, 5, 6]})  # one token short
    short = [r for r in beyond.compare(live, ref) if not r["equal"]]
    assert len(short) == 1 and short[0]["first difference"] == 2


def test_memory_rows_are_shares_of_the_single_process():
    live = {"alone": {"held": 256, "weights_bytes": 100, "peak_rss": 1000},
            "ranks": [{"rank": r, "ranks": 2, "held": 128, "weights_bytes": 54, "peak_rss": 1100} for r in (0, 1)]}
    rows = beyond.memory_rows(live, unit=1)
    assert rows[0]["weights / one"] == 1.0
    assert [r["weights / one"] for r in rows[1:]] == [0.54, 0.54]
    assert [r["RSS / one"] for r in rows[1:]] == [1.1, 1.1]
