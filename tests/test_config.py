"""config.json in its three spellings (nested multimodal, flat text-only, flat Qwen3-Next) and its errors."""

import json

import pytest

from conftest import small_config
import qmtp
from qmtp.tiny import synthetic
from qmtp.config import FULL, LINEAR, ModelConfig
from qmtp.errors import ConfigError

SMALL = small_config()


def write_json(tmp_path, raw):
    path = tmp_path / "config.json"
    path.write_text(raw if isinstance(raw, str) else json.dumps(raw))
    return path


def released(config=SMALL) -> dict:
    """config.json as Qwen3.6-35B-A3B ships it: text fields under `text_config`."""
    return config.to_released_dict()


def flat_text(config=SMALL) -> dict:
    """A text-only export: the same fields, flat, model_type qwen3_5_moe_text."""
    text = config.to_text_dict()
    text["model_type"] = "qwen3_5_moe_text"
    return text


def flat_next(config=SMALL) -> dict:
    """Qwen3-Next: flat, rope_theta and partial_rotary_factor at the top level, no rope_parameters."""
    text = config.to_text_dict()
    del text["rope_parameters"]
    del text["layer_types"]  # Qwen3-Next configs give only full_attention_interval
    text.update(model_type="qwen3_next", rope_theta=123_456.0, partial_rotary_factor=0.5,
                num_nextn_predict_layers=1)
    del text["mtp_num_hidden_layers"]
    return text


# ---- the three spellings -------------------------------------------------------------------------------
def test_nested_text_config(tmp_path):
    raw = released()
    assert raw["model_type"] == "qwen3_5_moe" and "hidden_size" not in raw
    config = ModelConfig.from_file(write_json(tmp_path, raw))
    assert config == SMALL
    assert config.projection_layout == "split"


def test_nested_text_config_without_inner_model_type(tmp_path):
    raw = released()
    del raw["text_config"]["model_type"]
    config = ModelConfig.from_file(write_json(tmp_path, raw))
    assert config.model_type == "qwen3_5_moe_text"
    assert config.hidden_size == SMALL.hidden_size


def test_flat_text_only(tmp_path):
    config = ModelConfig.from_file(write_json(tmp_path, flat_text()))
    assert config == SMALL


def test_flat_qwen3_next_reads_top_level_rope_fields(tmp_path):
    config = ModelConfig.from_file(write_json(tmp_path, flat_next()))
    assert config.model_type == "qwen3_next"
    assert config.projection_layout == "fused"
    assert config.rope_theta == 123_456.0
    assert config.partial_rotary_factor == 0.5
    assert config.rotary_dims == SMALL.head_dim // 2
    assert config.mtp_num_hidden_layers == 1
    # layer_types rebuilt from full_attention_interval
    assert config.layer_types == SMALL.layer_types
    assert config.hidden_size == SMALL.hidden_size and config.num_experts == SMALL.num_experts


def test_rope_parameters_override_defaults(tmp_path):
    raw = released()
    raw["text_config"]["rope_parameters"].update(rope_theta=5e5, partial_rotary_factor=0.5)
    config = ModelConfig.from_file(write_json(tmp_path, raw))
    assert (config.rope_theta, config.partial_rotary_factor) == (5e5, 0.5)


def test_from_file_accepts_a_directory(tmp_path):
    write_json(tmp_path, released())
    assert ModelConfig.from_file(tmp_path) == SMALL


@pytest.mark.parametrize("layout", synthetic.LAYOUTS)
def test_synthetic_config_json_of_every_layout_parses_back(tmp_path, layout):
    path = synthetic.write_checkpoint(tmp_path, SMALL, layout=layout, dtype="F32")
    config = ModelConfig.from_file(path)
    expected_type = {"released": "qwen3_5_moe_text", "text": "qwen3_5_moe_text", "next": "qwen3_next"}[layout]
    assert config == SMALL.replace(model_type=expected_type)


# ---- the real model's numbers --------------------------------------------------------------------------
def test_qwen36_35b_a3b_has_the_reference_numbers():
    c = qmtp.QWEN36_35B_A3B
    assert c.hidden_size == 2048
    assert c.num_hidden_layers == 40
    assert c.vocab_size == 248_320
    assert (c.num_experts, c.num_experts_per_tok) == (256, 8)
    assert c.moe_intermediate_size == 512 and c.shared_expert_intermediate_size == 512
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (16, 2, 256)
    assert c.full_attention_layers == list(range(3, 40, 4))
    assert len(c.layer_types) == 40
    assert c.layer_types.count(LINEAR) == 30 and c.layer_types.count(FULL) == 10
    assert c.rotary_dims == 64
    assert c.linear_conv_dim == 8192 and c.linear_value_dim == 4096
    assert c.has_mtp and c.mtp_num_hidden_layers == 1
    assert not c.tie_word_embeddings


@pytest.mark.parametrize("config", [qmtp.QWEN36_35B_A3B, SMALL], ids=["qwen36", "small"])
def test_released_dict_round_trips(config):
    raw = config.to_released_dict()
    assert raw["model_type"] == "qwen3_5_moe"
    assert raw["text_config"]["model_type"] == "qwen3_5_moe_text"
    assert ModelConfig.from_dict(raw) == config
    # ... and through JSON text, as it would be on disk
    assert ModelConfig.from_dict(json.loads(json.dumps(raw))) == config


def test_released_dict_of_the_real_model_spells_hugging_face_fields():
    text = qmtp.QWEN36_35B_A3B.to_released_dict()["text_config"]
    assert text["rope_parameters"]["rope_theta"] == 10_000_000.0
    assert text["rope_parameters"]["partial_rotary_factor"] == 0.25
    assert text["full_attention_interval"] == 4
    assert "rope_theta" not in text


# ---- errors --------------------------------------------------------------------------------------------
def assert_config_error(path, *fragments):
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_file(path)
    message = str(info.value)
    assert str(path) in message, message
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_unknown_model_type_nested(tmp_path):
    raw = released()
    raw["model_type"] = "llama"
    del raw["text_config"]["model_type"]
    assert_config_error(write_json(tmp_path, raw), "'llama'", "not supported")


def test_unknown_model_type_flat(tmp_path):
    raw = flat_text()
    raw["model_type"] = "llama"
    assert_config_error(write_json(tmp_path, raw), "'llama'", "not supported")


def test_missing_model_type(tmp_path):
    raw = flat_text()
    del raw["model_type"]
    assert_config_error(write_json(tmp_path, raw), "config.json has no model_type")


@pytest.mark.parametrize("field", ["hidden_size", "num_experts", "vocab_size"])
def test_missing_required_field(tmp_path, field):
    raw = released()
    del raw["text_config"][field]
    assert_config_error(write_json(tmp_path, raw), "missing required fields", field)


def test_layer_types_length_disagrees_with_num_hidden_layers(tmp_path):
    raw = released()
    raw["text_config"]["layer_types"] = raw["text_config"]["layer_types"][:-1]
    assert_config_error(write_json(tmp_path, raw), "layer_types has 3 entries", "num_hidden_layers is 4")


def test_unknown_layer_type(tmp_path):
    raw = released()
    raw["text_config"]["layer_types"][0] = "sliding_attention"
    assert_config_error(write_json(tmp_path, raw), "sliding_attention")


def test_more_experts_per_token_than_experts(tmp_path):
    raw = released()
    raw["text_config"]["num_experts_per_tok"] = 9
    assert_config_error(write_json(tmp_path, raw), "num_experts_per_tok=9", "num_experts=8")


def test_heads_not_a_multiple_of_kv_heads(tmp_path):
    raw = released()
    raw["text_config"]["num_key_value_heads"] = 3
    assert_config_error(write_json(tmp_path, raw), "num_key_value_heads=3")


def test_all_problems_reported_at_once(tmp_path):
    raw = released()
    raw["text_config"]["num_experts_per_tok"] = 9
    raw["text_config"]["layer_types"] = raw["text_config"]["layer_types"][:2]
    message = assert_config_error(write_json(tmp_path, raw), "num_experts_per_tok=9", "layer_types has 2")
    assert message.count(str(tmp_path)) == 1


@pytest.mark.parametrize("field,value", [
    ("hidden_size", -1),
    ("vocab_size", 0),
    ("num_hidden_layers", 0),
    ("moe_intermediate_size", 0),
    ("num_experts", 0),
    ("num_key_value_heads", 0),  # once a ZeroDivisionError (num_attention_heads % 0)
    ("linear_num_key_heads", 0),
    ("num_attention_heads", 0),
    ("num_experts_per_tok", 2.5),  # a float where an integer is needed
    ("hidden_size", None),  # once Python's "'<=' not supported between 'NoneType' and 'int'"
    ("num_hidden_layers", True),  # a JSON true is not an integer
    ("head_dim", "256"),
])
def test_nonsense_integer_is_a_config_error_naming_the_field(tmp_path, field, value):
    raw = released()
    raw["text_config"][field] = value
    assert_config_error(write_json(tmp_path, raw), f"{field}={value!r} must be a positive integer")


@pytest.mark.parametrize("field,value", [
    ("rms_norm_eps", 0),
    ("rms_norm_eps", None),
    ("rope_theta", "1e7"),
    ("partial_rotary_factor", -0.25),
])
def test_nonsense_float_is_a_config_error_naming_the_field(tmp_path, field, value):
    raw = released()
    if field in raw["text_config"]["rope_parameters"]:
        raw["text_config"]["rope_parameters"][field] = value
    else:
        raw["text_config"][field] = value
    assert_config_error(write_json(tmp_path, raw), f"{field}={value!r} must be a positive number")


def test_integer_where_a_float_is_expected_is_fine(tmp_path):
    raw = released()
    raw["text_config"]["rope_parameters"]["rope_theta"] = 1_000_000
    assert ModelConfig.from_file(write_json(tmp_path, raw)).rope_theta == 1_000_000


def test_bad_values_are_reported_together_before_any_arithmetic(tmp_path):
    raw = released()
    raw["text_config"].update(num_key_value_heads=0, linear_num_key_heads=None, tie_word_embeddings="no")
    assert_config_error(write_json(tmp_path, raw), "num_key_value_heads=0", "linear_num_key_heads=None",
                        "tie_word_embeddings='no' must be true or false")


def test_layer_types_rebuilt_from_a_bad_interval_or_layer_count(tmp_path):
    raw = flat_next()
    raw["full_attention_interval"] = 0
    assert_config_error(write_json(tmp_path, raw), "full_attention_interval=0 must be a positive integer")
    raw = flat_next()
    raw["num_hidden_layers"] = "4"
    assert_config_error(write_json(tmp_path, raw), "num_hidden_layers='4' must be a positive integer")


def test_field_of_the_wrong_json_type(tmp_path):
    raw = released()
    raw["text_config"]["hidden_size"] = "2048"
    assert_config_error(write_json(tmp_path, raw))


def test_invalid_json(tmp_path):
    assert_config_error(write_json(tmp_path, '{"model_type": "qwen3_5_moe", '), "not valid JSON")


def test_json_that_is_not_an_object(tmp_path):
    assert_config_error(write_json(tmp_path, "[1, 2, 3]"), "expected a JSON object")


def test_text_config_that_is_not_an_object(tmp_path):
    assert_config_error(write_json(tmp_path, {"model_type": "qwen3_5_moe", "text_config": 3}), "text_config")


def test_missing_config_json(tmp_path):
    assert_config_error(tmp_path / "config.json", "file not found (every checkpoint directory needs a config.json)")
    with pytest.raises(ConfigError, match="config.json"):
        ModelConfig.from_file(tmp_path)  # the directory form names the file it looked for


def test_direct_construction_validates():
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        SMALL.replace(num_experts_per_tok=0)
    with pytest.raises(ConfigError, match="num_hidden_layers=None must be a positive integer"):
        SMALL.replace(num_hidden_layers=None, layer_types=[])
    with pytest.raises(ConfigError, match="mtp_num_hidden_layers"):
        SMALL.replace(mtp_num_hidden_layers=2)


def test_config_error_is_a_qmtp_error():
    assert issubclass(ConfigError, qmtp.QmtpError)
