"""The bundled tiny model: its shape, its card, and the figures the issue asks for, measured here."""

import json
import subprocess
import sys
import warnings

import pytest

import qmtp
from qmtp.book import evaluate
from qmtp.tiny import card
from qmtp.loading import BUNDLED_MODEL

pytestmark = pytest.mark.skipif(not (BUNDLED_MODEL / "model.safetensors").exists(), reason="no bundled model")


@pytest.fixture(scope="module")
def model():
    return qmtp.load()


def test_same_architecture_at_toy_widths(model):
    c = model.config
    assert (c.num_experts, c.num_experts_per_tok) == (256, 8)
    assert c.layer_types == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"]
    assert c.partial_rotary_factor < 1 and c.shared_expert_intermediate_size > 0
    assert model.mtp is not None and model.mtp.has_routed_experts
    assert model.mtp.layers[0].mlp.experts.gate_proj.weight.shape[0] == 256
    size = sum(f.stat().st_size for f in BUNDLED_MODEL.iterdir())
    assert size < 25e6


def test_shipped_in_the_released_layout():
    ckpt = qmtp.Checkpoint(BUNDLED_MODEL)
    config = json.loads((BUNDLED_MODEL / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_moe" and config["text_config"]["model_type"] == "qwen3_5_moe_text"
    assert all(n.startswith(("model.language_model.", "mtp.", "lm_head.")) for n in ckpt.names())
    assert {i.dtype for i in ckpt.infos.values()} == {"BF16"}
    assert ckpt.infos["model.language_model.layers.0.linear_attn.conv1d.weight"].shape[1] == 1
    assert "model.language_model.layers.0.mlp.experts.gate_up_proj" in ckpt
    assert qmtp.load().fixes_applied == ("norm", "conv")


def test_card_is_rendered_from_the_measurements():
    measurements = json.loads((BUNDLED_MODEL / "measurements.json").read_text())
    training = json.loads((BUNDLED_MODEL / "training.json").read_text())
    assert (BUNDLED_MODEL / "MODEL_CARD.md").read_text() == card.render(BUNDLED_MODEL, measurements, training)


def test_acceptance_at_one_draft_is_at_least_0_6(model):
    prompts = evaluate.heldout_prompts(model, 2)
    result = evaluate.acceptance(model, prompts, n_draft=2, max_tokens=40)
    assert result["rate"] >= 0.6, result


def test_text_needs_the_norm_fix(model):
    texts = evaluate.heldout_texts(3)
    fixed = evaluate.text_metrics(model, texts)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        unshifted = evaluate.text_metrics(qmtp.load(fixes=("conv",)), texts)
    assert fixed.accuracy > 0.5 and unshifted.accuracy < fixed.accuracy / 2


def test_chat_reports_the_acceptance_teacher_forcing_predicts(model):
    prompt = "Once upon a time, a little fox named"
    # --temperature 0: chat samples as the model's generation_config.json says; the walk below is greedy
    result = subprocess.run([sys.executable, "-m", "qmtp", "chat", "--raw", "--use-mtp", "--n-draft", "2", "--prompt", prompt,
                             "--max-tokens", "40", "--temperature", "0"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    reported = float(result.stderr.split("acceptance ")[1].split(" ")[0])
    plain = qmtp.generate(model, prompt, max_tokens=40)
    assert result.stdout == prompt + plain.text + "\n"  # streamed step by step, the same text in the end
    predicted = evaluate.predicted_acceptance(model, plain.prompt_tokens, plain.tokens)
    # the walk and the run agree draft for draft; only the last step, cut by the end of text, may differ
    assert abs(reported - predicted["rate"]) <= 1.5 / predicted["proposed"] + 0.005


def test_the_chained_trained_head_drafts_deeper_than_the_one_it_replaced(model):
    previous = evaluate.previous_head(model)
    assert previous is not None, "the bundled model keeps its previous head"
    prompts = evaluate.heldout_prompts(model, 2)
    new = evaluate.acceptance(model, prompts, n_draft=3, max_tokens=40)["per_position"]
    old = evaluate.acceptance(model, prompts, n_draft=3, max_tokens=40, head=previous)["per_position"]
    assert new[1] > old[1] + 0.1, (new, old)
    assert new[0] >= old[0] - 0.02, (new, old)


def test_the_previous_head_drafts_losslessly(model):
    prompt = evaluate.heldout_prompts(model, 1)[0]
    plain = qmtp.generate(model, prompt, max_tokens=30).tokens
    assert qmtp.generate(model, prompt, max_tokens=30, n_draft=4,
                         engine=qmtp.Engine(head=evaluate.previous_head(model))).tokens == plain


# ---- its chat format (issue 26 item 6) ----------------------------------------------------------------------
def test_it_ships_its_familys_chat_format(model):
    from pathlib import Path

    from qmtp import chat

    template = (Path(__file__).parent / "templates" / "qwen_family.jinja").read_text()
    assert model.tokenizer.chat_template == template  # the template tests/test_chat.py checks against transformers
    tok = model.tokenizer
    ids = {text: tok.encode(text) for text in ("<|im_start|>", "<|im_end|>", "<think>", "</think>")}
    assert all(len(i) == 1 and i[0] < model.config.vocab_size for i in ids.values()), ids
    assert chat.end_ids(model) == {ids["<|im_end|>"][0], tok.eos_id}
    assert qmtp.Sampling.of_model(model) == qmtp.Sampling(temperature=1.0, top_p=0.95, top_k=20, presence_penalty=1.5)


def test_it_answers_in_turn_and_ends_its_turn(model):
    """Greedy replies to held-out requests: with thinking on each thinks, closes its think block and answers; in
    both modes most end at an end id (`<|im_end|>` or `<|endoftext|>`: the card counts which) before 300 tokens
    (a 14M-parameter model can fall into a loop of sums, as on plain text, so not every one)."""
    from qmtp import chat

    for thinking in (True, False):
        ended = 0
        for messages in evaluate.chat_prompts(8):
            out = qmtp.generate(model, messages=messages, enable_thinking=thinking, max_tokens=300)
            thought, answer = chat.split_thinking(out.text, opened=thinking)
            assert answer.strip() and bool(thought.strip()) == thinking and "<think>" not in out.text, out.text
            ended += out.finish_reason == "end"
        assert ended >= 6, (thinking, ended)


def test_chat_acceptance_at_one_draft_is_at_least_0_6(model):
    rows = evaluate.chat_acceptance(model, evaluate.chat_prompts(2), n_draft=2, max_tokens=40,
                                    samplers={"greedy": {}})
    assert all(r["rate"] >= 0.6 for r in rows), rows


def test_chat_uses_the_template_without_raw():
    prompt = "Where is the red ball?"
    result = subprocess.run([sys.executable, "-m", "qmtp", "chat", "--prompt", prompt, "--thinking=false",
                             "--max-tokens", "60", "--use-mtp", "--n-draft", "3"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() and "<|im_" not in result.stdout, result.stdout
