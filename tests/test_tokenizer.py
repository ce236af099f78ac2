"""Tests for qmtp.tokenizer and qmtp.tiny.bpe: BPE training, save/load, round trips, eos lookup, errors."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tokenizers
from tokenizers import decoders, normalizers, pre_tokenizers

from qmtp.tiny import corpus
from qmtp.errors import CheckpointError, UsageError
from qmtp.tiny.bpe import train_bpe
from qmtp.tokenizer import EOS_TOKEN, Tokenizer, save

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def texts():
    return [text for _, text in corpus.iter_documents(1500, seed=0)]


@pytest.fixture(scope="module")
def trained(texts):
    return train_bpe(texts, vocab_size=512)


@pytest.fixture(scope="module")
def tok(trained):
    return Tokenizer(trained)


def test_train_shape(trained):
    assert trained.get_vocab_size() == 512
    assert trained.token_to_id(EOS_TOKEN) == 0
    # every byte is in the alphabet, so nothing is ever unknown
    vocab = trained.get_vocab()
    assert all(ch in vocab for ch in pre_tokenizers.ByteLevel.alphabet())


def test_common_words_are_single_tokens(tok):
    for word in (" the", " was", " is", " and", " said"):
        assert len(tok.encode(word)) == 1, word


def test_round_trip_corpus(tok):
    sample = [t for _, t in corpus.generate(300, seed=99)]
    for text in sample:
        assert tok.decode(tok.encode(text)) == text
    joined = f"\n{EOS_TOKEN}".join(sample[:20])
    ids = tok.encode(joined)
    assert ids.count(tok.eos_id) == 19
    assert tok.decode(ids) == joined


@pytest.mark.parametrize(
    "text",
    ["", " ", "  leading spaces", "tabs\tand\r\nCRLF\n\n", "naïve café — 日本語 🦊", "x" * 500, "3 + 4 = 7"],
)
def test_round_trip_arbitrary(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_decode_accepts_numpy_ints(tok):
    np = pytest.importorskip("numpy")
    ids = tok.encode("The fox ran.")
    assert tok.decode(np.array(ids, dtype=np.int64)) == "The fox ran."


def test_properties(tok):
    assert tok.vocab_size == 512
    assert tok.eos_id == 0
    assert tok.id_to_token(0) == EOS_TOKEN and tok.token_to_id(EOS_TOKEN) == 0
    assert tok.encode_batch(["a b", "c"]) == [tok.encode("a b"), tok.encode("c")]


def test_no_bos_or_eos_added(tok):
    assert tok.eos_id not in tok.encode("Hello there.")


def test_save_load_round_trip(trained, tmp_path):
    out = save(trained, tmp_path / "model", model_max_length=512)
    assert out == tmp_path / "model"
    assert sorted(p.name for p in out.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert cfg["eos_token"] == EOS_TOKEN
    assert cfg["add_prefix_space"] is False
    assert cfg["model_max_length"] == 512
    assert cfg["added_tokens_decoder"]["0"]["content"] == EOS_TOKEN

    loaded = Tokenizer.from_dir(out)
    assert loaded.vocab_size == 512 and loaded.eos_id == 0
    assert loaded.config["eos_token"] == EOS_TOKEN
    text = "\n".join(t for _, t in corpus.generate(20, seed=3))
    assert loaded.encode(text) == Tokenizer(trained).encode(text)
    assert loaded.decode(loaded.encode(text)) == text
    # saving the wrapper again gives the same bytes
    save(loaded, tmp_path / "again", model_max_length=512)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "again" / name).read_bytes() == (out / name).read_bytes()


def test_save_overwrites_atomically(trained, tmp_path):
    (tmp_path / "tokenizer.json").write_text("old")
    save(trained, tmp_path)
    assert Tokenizer.from_dir(tmp_path).vocab_size == 512
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert leftovers == []


def test_save_rejects_unknown_eos(trained, tmp_path):
    with pytest.raises(UsageError, match="not in the tokenizer's vocabulary"):
        save(trained, tmp_path, eos_token="</s>")


def test_missing_tokenizer_json(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError) as exc:
        Tokenizer.from_dir(tmp_path)
    msg = str(exc.value)
    assert "tokenizer.json" in msg and str(tmp_path) in msg and "missing" in msg


def test_not_a_directory(tmp_path):
    with pytest.raises(CheckpointError, match="not a directory"):
        Tokenizer.from_dir(tmp_path / "nowhere")


def test_corrupt_files(trained, tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    with pytest.raises(CheckpointError, match="tokenizer.json: cannot load tokenizer"):
        Tokenizer.from_dir(tmp_path)
    save(trained, tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="tokenizer_config.json: not valid JSON"):
        Tokenizer.from_dir(tmp_path)


def test_eos_from_config_when_no_endoftext(texts, tmp_path):
    raw = train_bpe(texts[:200], vocab_size=300, special_tokens=("<|im_start|>", "<|im_end|>"))
    assert Tokenizer(raw).eos_id is None
    save(raw, tmp_path, eos_token="<|im_end|>")
    assert Tokenizer.from_dir(tmp_path).eos_id == 1
    # older configs write special tokens as {"content": ...}
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["eos_token"] = {"content": "<|im_end|>", "lstrip": False}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert Tokenizer.from_dir(tmp_path).eos_id == 1
    (tmp_path / "tokenizer_config.json").unlink()
    assert Tokenizer.from_dir(tmp_path).eos_id is None


def test_loads_qwen_style_tokenizer_json(texts, tmp_path):
    """A tokenizer.json built like Qwen's (NFC normaliser, digit-splitting regex + ByteLevel
    without regex, extra special tokens, <|endoftext|> not at id 0) loads through from_dir."""
    raw = train_bpe(texts[:300], vocab_size=400, special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>"))
    data = json.loads(raw.to_str())
    qwen_like = tokenizers.Tokenizer.from_str(json.dumps(data))
    qwen_like.normalizer = normalizers.NFC()
    qwen_like.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(
            tokenizers.Regex(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
            behavior="isolated",
        ),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    qwen_like.decoder = decoders.ByteLevel()
    qwen_like.add_special_tokens(["<|fim_prefix|>"])
    (tmp_path / "tokenizer.json").write_text(qwen_like.to_str())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.eos_id == 0  # <|endoftext|> wins over the config's chat eos
    assert tok.vocab_size == 401
    text = "Tom has 12 apples.\nAnna: Hi!"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert [tok.id_to_token(i) for i in tok.encode("12")] == ["1", "2"]


def test_training_is_deterministic_in_process(texts):
    a = train_bpe(texts[:600], vocab_size=600).to_str()
    b = train_bpe(texts[:600], vocab_size=600).to_str()
    assert a == b


_TRAIN_SCRIPT = """
import hashlib, sys, tempfile, pathlib
from qmtp.tiny import corpus
from qmtp.tiny.bpe import train_bpe
from qmtp.tokenizer import save
d = pathlib.Path(tempfile.mkdtemp())
save(train_bpe((t for _, t in corpus.iter_documents(600, seed=0)), vocab_size=600), d)
print(hashlib.sha256((d / "tokenizer.json").read_bytes()).hexdigest())
"""


def test_training_is_deterministic_across_processes():
    """Rust HashMaps are seeded per process; the trained file must not depend on that."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    digests = set()
    for threads in ("1", "2"):
        env["RAYON_NUM_THREADS"] = threads
        out = subprocess.run(
            [sys.executable, "-c", _TRAIN_SCRIPT], env=env, capture_output=True, text=True, check=True
        )
        digests.add(out.stdout.strip())
    assert len(digests) == 1


def test_train_bad_input():
    with pytest.raises(UsageError, match="vocab_size must be an integer >= 257"):
        train_bpe(["abc"], vocab_size=100)
    with pytest.raises(UsageError, match="not a single string"):
        train_bpe("some text")
    with pytest.raises(UsageError, match="distinct"):
        train_bpe(["abc"], special_tokens=("<a>", "<a>"))


def test_wrapper_rejects_wrong_types(tok):
    with pytest.raises(UsageError):
        Tokenizer("tokenizer.json")
    with pytest.raises(UsageError):
        tok.encode(b"bytes")


def test_transformers_accepts_saved_directory(trained, tmp_path):
    transformers = pytest.importorskip("transformers")
    save(trained, tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    ours = Tokenizer.from_dir(tmp_path)
    text = "Once upon a time, a little fox named Tom lived near the river."
    assert hf(text)["input_ids"] == ours.encode(text)
    assert hf.eos_token_id == ours.eos_id
    assert hf.decode(ours.encode(text)) == text


def test_saved_files_have_the_usual_permissions(trained, tmp_path):
    """Not mkstemp's private 0600: a model directory saved for others must be readable like any file."""
    (tmp_path / "plain").write_text("x")
    usual = (tmp_path / "plain").stat().st_mode & 0o777
    save(trained, tmp_path / "tok")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "tok" / name).stat().st_mode & 0o777 == usual, name
