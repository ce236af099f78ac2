"""The bundled model's chat format, as tooling: the tokens and files `chat_format` adds, the grown vocabulary, the
conversations it is fine-tuned on (rendered as the prompts it will be given), and the fine-tune stage end to end."""

import json
import random
import shutil
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from conftest import trunk_logits
import qmtp
from qmtp import chat
from qmtp.tiny import chat_corpus, chat_format, train
from qmtp.tokenizer import Tokenizer

CHAT_TOKENS = [text for text, _ in chat_format.CHAT_TOKENS]


@pytest.fixture(scope="module")
def plain_dir(tmp_path_factory):
    """A tokenizer trained on plain text only (the bundled one before its chat format)."""
    from qmtp import tokenizer as tok
    from qmtp.tiny import bpe, corpus

    directory = tmp_path_factory.mktemp("plain")
    tok.save(bpe.train_bpe((t for _, t in corpus.iter_documents(400)), vocab_size=400), directory)
    return directory


def test_extending_adds_the_chat_tokens_after_the_last_id_and_once(plain_dir, tmp_path):
    before = Tokenizer.from_dir(plain_dir)
    extended = chat_format.extend_tokenizer(plain_dir, tmp_path / "a")
    assert [extended.token_to_id(t) for t in CHAT_TOKENS] == list(range(before.vocab_size, before.vocab_size + 4))
    text = "Once upon a time, 7 + 5 = 12."
    assert extended.encode(text) == before.encode(text)  # ordinary text keeps its ids
    again = chat_format.extend_tokenizer(tmp_path / "a", tmp_path / "b")
    assert again.vocab_size == extended.vocab_size
    assert (tmp_path / "a" / "tokenizer.json").read_text() == (tmp_path / "b" / "tokenizer.json").read_text()
    specials = {t.content: t.special for t in extended.backend.get_added_tokens_decoder().values()}
    assert specials == {"<|endoftext|>": True, "<|im_start|>": True, "<|im_end|>": True,
                        "<think>": False, "</think>": False}  # as Qwen's tokenizer marks them


def test_extended_folder_ends_replies_and_samples_as_the_release(plain_dir, tmp_path):
    tok = chat_format.extend_tokenizer(plain_dir, tmp_path)
    generation = json.loads((tmp_path / chat.GENERATION_CONFIG).read_text())
    assert generation["eos_token_id"] == [tok.token_to_id("<|im_end|>"), tok.eos_id]
    assert tok.end_ids == {tok.token_to_id("<|im_end|>"), tok.eos_id}
    sampling = qmtp.Sampling.from_generation_config(generation)
    assert sampling == qmtp.Sampling(temperature=1.0, top_p=0.95, top_k=20, min_p=0.0, presence_penalty=1.5)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=True)
    assert [tok.id_to_token(i) for i in prompt[:1]] == ["<|im_start|>"] and tok.token_to_id("<think>") in prompt


def test_growing_the_vocabulary_keeps_every_old_row():
    config = qmtp.ModelConfig(vocab_size=50, **dict(train.QUICK, num_hidden_layers=4, num_experts=4, num_experts_per_tok=2))
    model = qmtp.Model(config)
    train.initialise(model, 0)
    tokens = mx.array([[1, 2, 3, 4]])
    before = np.array(trunk_logits(model, tokens))
    chat_format.grow_vocabulary(model, 54)
    after = np.array(trunk_logits(model, tokens))
    assert model.config.vocab_size == 54 and after.shape[-1] == 54
    assert np.allclose(after[..., :50], before, atol=1e-5)  # old ids score and read as before
    new_rows = np.array(model.embed_tokens.weight[50:])
    assert len({tuple(r) for r in new_rows.round(6)}) == 4  # the new tokens start apart
    old_norm = np.linalg.norm(np.array(model.embed_tokens.weight[:50]), axis=1).mean()
    assert np.linalg.norm(new_rows, axis=1).mean() < old_norm  # near the mean row, not a large random one


def test_conversations_are_seeded_and_streams_differ():
    assert chat_corpus.conversations(5, 0) == chat_corpus.conversations(5, 0)
    assert chat_corpus.conversations(5, 0) != chat_corpus.conversations(5, 0, "heldout")
    thinking = [t for _, t in chat_corpus.conversations(400, 0)]
    assert 0.4 < sum(thinking) / len(thinking) < 0.6


@pytest.mark.parametrize("index", range(12))
def test_a_conversation_renders_as_the_prompt_it_answers_then_the_reply(index):
    """What the model is trained on continues exactly the prompt `generate(messages=..., enable_thinking=...)`
    renders, thinking on or off: otherwise it would learn a format it is never asked in."""
    template = chat_format.TEMPLATE_SOURCE.read_text()
    messages, thinking = chat_corpus.conversation(random.Random(index))
    trained = chat.render(template, messages, add_generation_prompt=False)
    prompt = chat.render(template, messages[:-1], add_generation_prompt=True, enable_thinking=thinking)
    reply = messages[-1]
    assert trained.startswith(prompt)
    rest = trained[len(prompt):]
    assert rest.endswith(reply["content"] + "<|im_end|>\n")
    if thinking:
        assert rest.startswith(reply["reasoning_content"] + "\n</think>\n\n")
    else:
        assert rest == reply["content"] + "<|im_end|>\n"


@pytest.mark.slow
def test_chat_stage_grows_the_model_and_resumes_exactly(tmp_path):
    base = tmp_path / "base"
    subprocess.run([sys.executable, "-m", "qmtp.tiny.train", str(base), "--quick", "--steps", "2", "--export", str(base / "export")],
                   check=True, capture_output=True)
    source = base / "export"
    common = ["--chat", "--from", source, "--steps", 4, "--documents", 300, "--length", 64]

    def run(out, *extra):
        result = subprocess.run([sys.executable, "-m", "qmtp.tiny.train", str(out), *map(str, common), *map(str, extra)],
                                capture_output=True, text=True)
        assert result.returncode == 0, result.stderr[-2000:]
        return result

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run(straight, "--save-every", 2, "--export", straight / "export")
    run(resumed, "--stop-after", 3)
    assert "resuming from step 3" in run(resumed, "--export", resumed / "export").stdout
    a, b = (mx.load(str(out / json.loads((out / "latest.json").read_text())["state"] / "weights.safetensors"))
            for out in (straight, resumed))
    assert all(np.array_equal(np.array(a[k]), np.array(b[k])) for k in a)
    old, new = qmtp.load(source), qmtp.load(straight / "export")
    assert new.config.vocab_size == old.config.vocab_size + 4 == new.tokenizer.vocab_size
    assert new.tokenizer.chat_template == chat_format.TEMPLATE_SOURCE.read_text()
    before = json.loads((straight / "before.json").read_text())
    assert set(before) == {"plain_trunk", "plain_head", "chat_trunk", "chat_head"}
    out = qmtp.generate(new, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, n_draft=2)
    assert out.stats.generated >= 1


@pytest.mark.parametrize("index", range(8))
def test_only_the_reply_the_model_writes_counts(plain_dir, tmp_path, index):
    """The fine-tune's loss weights: 1 on the last reply after its generation prompt up to `<|im_end|>`, 0 on
    the rest, so with thinking off the empty think block (the prompt's) is never a target."""
    tok = chat_format.extend_tokenizer(plain_dir, tmp_path)
    messages, thinking = chat_corpus.conversation(random.Random(index))
    [(ids, weights)] = train.reply_weights(tok, [(messages, thinking)])
    written = tok.decode([i for i, w in zip(ids, weights) if w])
    reply = messages[-1]
    expected = (reply["reasoning_content"] + "\n</think>\n\n" if thinking else "") + reply["content"] + "<|im_end|>"
    assert written == expected
    assert "0" not in "".join(map(str, weights)).strip("0")  # one run of written tokens, nothing after it
    assert sum(weights) == len(tok.encode(expected))


def test_the_chat_stream_weighs_plain_text_whole_and_conversations_by_their_reply(plain_dir, tmp_path):
    tok = chat_format.extend_tokenizer(plain_dir, tmp_path)
    tokens, weights = train.chat_stream(tok, 0, 20, 20)
    assert tokens.shape == weights.shape and set(np.unique(weights)) == {0, 1}
    starts = np.flatnonzero(tokens == tok.token_to_id("<|im_start|>"))
    assert len(starts) and not weights[starts].any()  # turn openings are always the prompt's
    ends = np.flatnonzero(tokens == tok.token_to_id("<|im_end|>"))
    assert weights[ends].sum() == 20  # one written <|im_end|> per conversation: its last reply's
