"""Loading the run config: the examples, overrides, and one-line errors that name the key."""

import dataclasses
import re

import pytest

from node.process.config import DEFAULT_CONFIG, EXAMPLES_DIR, load_config, shared_fields
from node.training.model import ModelConfig, build_model, count_parameters
from protocols.errors import ConfigError
from protocols.manifest import fields_hash

TINY = EXAMPLES_DIR / "tiny.toml"
SMALL = EXAMPLES_DIR / "small.toml"


def write(tmp_path, text: str):
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def config_error(*args, **kwargs) -> str:
    with pytest.raises(ConfigError) as raised:
        load_config(*args, **kwargs)
    message = str(raised.value)
    assert "\n" not in message, message  # the CLI prints it as one line
    return message


def gpt_parameters(model: ModelConfig) -> int:
    """Parameters of the built-in GPT: tied embeddings, biased linears, two LayerNorms per block."""
    d, hidden = model.d_model, model.mlp_ratio * model.d_model
    block = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * hidden + hidden) + (hidden * d + d)
    return model.vocab_size * d + model.seq_len * d + model.n_layer * block + 2 * d


# -- the examples ------------------------------------------------------------------------------
def test_the_default_is_the_tiny_example():
    assert DEFAULT_CONFIG == TINY
    config = load_config()
    assert config == load_config(TINY)
    assert config.run_id == "shoal-tiny"
    assert (config.model.d_model, config.model.n_layer, config.model.n_head, config.model.seq_len) == (64, 2, 4, 64)
    assert config.train.torch_threads == 1  # a value that differs from the dataclass default: the file was read
    assert config.inner.total_rounds == 100.0


def test_the_parameter_formula_matches_the_built_model():
    model = ModelConfig(d_model=48, n_layer=3, n_head=4, seq_len=24)
    assert count_parameters(build_model(model, seed=0)) == gpt_parameters(model)


def test_the_small_example_has_tens_of_millions_of_parameters():
    config = load_config(SMALL)
    assert config.run_id == "shoal-small"
    assert 10_000_000 <= gpt_parameters(config.model) <= 100_000_000
    assert config.averaging.request_timeout < config.averaging.matchmaking_seconds


# -- errors ------------------------------------------------------------------------------------
def test_an_unknown_key_is_named_with_the_known_ones(tmp_path):
    message = config_error(write(tmp_path, "[model]\ndmodel = 64\n"))
    assert "unknown key 'model.dmodel'" in message
    assert "d_model" in message and "n_head" in message


def test_an_unknown_section_or_top_level_key_is_named(tmp_path):
    assert "unknown key 'modle'" in config_error(write(tmp_path, "[modle]\nd_model = 64\n"))
    assert "unknown key 'runid'" in config_error(write(tmp_path, 'runid = "x"\n'))


@pytest.mark.parametrize(
    ("toml", "match"),
    [
        ('[model]\nd_model = "64"\n', "'model.d_model' must be int, got '64'"),
        ("[model]\nd_model = 64.0\n", "'model.d_model' must be int"),
        ("[train]\nseed = true\n", "'train.seed' must be int, got True"),
        ("[round]\nseconds = true\n", "'round.seconds' must be float, got True"),
        ('[round]\nseconds = "10"\n', "'round.seconds' must be float"),
        ("[outer]\nnesterov = 1\n", "'outer.nesterov' must be bool, got 1"),
        ('[data]\npaths = "*.txt"\n', "'data.paths' must be list"),
        ("[data]\npaths = [1]\n", "'data.paths' must be str"),
        ("run_id = 5\n", "'run_id' must be str"),
        ("model = 5\n", r"\[model\] must be a table"),
    ],
)
def test_a_wrong_type_is_named(tmp_path, toml, match):
    message = config_error(write(tmp_path, toml))
    assert re.search(match, message), message


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"round.seconds": 0}, "round.seconds"),
        ({"round.seconds": 1e6}, "round.seconds"),
        ({"averaging.request_timeout": 3.0}, "averaging.request_timeout"),  # == matchmaking_seconds
        ({"averaging.request_timeout": 5.0}, "averaging.request_timeout"),
        ({"averaging.compression": "int3"}, "averaging.compression"),
        ({"averaging.return_compression": "int2"}, "averaging.return_compression"),
        ({"averaging.block_size": -1}, "averaging.block_size"),
        ({"averaging.target_group_size": 1}, "averaging.target_group_size"),  # groups of one: nobody averages
        ({"model.d_model": 66}, "model.d_model"),  # not divisible by n_head = 4
        ({"model.n_layer": 0}, "model.n_layer"),
        ({"train.device": "tpu"}, "train.device"),
        ({"train.device": "cuda:x"}, "train.device"),
        ({"train.precision": "fp8"}, "train.precision"),
        ({"inner.lr": 1.5}, "inner.lr"),
        ({"inner.total_rounds": 1.0}, "inner.total_rounds"),  # not above warmup_rounds = 1
        ({"inner.min_lr_ratio": 2.0}, "inner.min_lr_ratio"),
        ({"outer.lr": 0}, "outer.lr"),
        ({"outer.momentum": 1}, "outer.momentum"),
        ({"data.batch_size": 0}, "data.batch_size"),
        ({"run_id": "has space"}, "run id"),
    ],
)
def test_an_invalid_value_names_the_field(overrides, field):
    message = config_error(TINY, overrides)
    assert field in message
    assert str(TINY) in message  # and the file it came from


def test_a_missing_file_is_a_config_error(tmp_path):
    message = config_error(tmp_path / "nope.toml")
    assert "nope.toml" in message and "does not exist" in message


def test_a_directory_is_a_config_error(tmp_path):
    assert "cannot be read" in config_error(tmp_path)


@pytest.mark.parametrize("text", ["[model\nd_model = 64\n", "a = \n", 'x = "unterminated\n', "a = 1\na = 2\n"])
def test_invalid_toml_is_a_config_error(tmp_path, text):
    assert "is not valid TOML" in config_error(write(tmp_path, text))


# -- overrides and coercion --------------------------------------------------------------------
def test_overrides_are_applied_on_top_of_the_file():
    config = load_config(TINY, {"round.seconds": 5.0, "run_id": "x", "train.device": "cpu", "inner.lr": 1e-3})
    assert (config.round.seconds, config.run_id, config.train.device, config.inner.lr) == (5.0, "x", "cpu", 1e-3)
    assert config.model == load_config(TINY).model  # the rest is untouched


def test_overrides_may_add_a_key_the_file_does_not_set(tmp_path):
    config = load_config(write(tmp_path, 'run_id = "r"\n'), {"averaging.min_group_size": 3})
    assert config.averaging.min_group_size == 3
    assert config.model == ModelConfig()  # sections absent from the file take the defaults


def test_an_int_is_accepted_for_a_float_field(tmp_path):
    config = load_config(write(tmp_path, "[round]\nseconds = 5\n[outer]\nlr = 1\n"))
    assert config.round.seconds == 5.0 and type(config.round.seconds) is float
    assert config.outer.lr == 1.0 and type(config.outer.lr) is float
    assert type(load_config(TINY, {"round.seconds": 7}).round.seconds) is float


# -- what peers must share ---------------------------------------------------------------------
def test_shared_fields_cover_the_sections_peers_must_agree_on():
    config = load_config(TINY)
    shared = shared_fields(config)
    for section in ("model", "inner", "outer", "round"):
        for f in dataclasses.fields(getattr(config, section)):
            if section == "model" and f.name in ("config", "init", "hf"):  # paths and hf tables: by content
                assert f"model.{f.name}" not in shared
                continue
            assert shared[f"{section}.{f.name}"] == getattr(getattr(config, section), f.name)
    assert shared["data.batch_size"] == 16 and shared["round.seconds"] == 10.0
    assert not any(key.startswith("train.device") or key.startswith("averaging.request") for key in shared)
    assert "data.paths" not in shared


@pytest.mark.parametrize(
    "change",
    [{"inner.lr": 1e-3}, {"model.n_layer": 3}, {"outer.momentum": 0.8}, {"round.seconds": 11.0},
     {"data.batch_size": 8}, {"outer.nesterov": False}, {"data.shard_stripe_bytes": 65536}],
)
def test_config_hash_changes_with_a_shared_field(change):
    base = fields_hash(shared_fields(load_config(TINY)))
    assert fields_hash(shared_fields(load_config(TINY))) == base  # deterministic
    assert fields_hash(shared_fields(load_config(TINY, change))) != base


@pytest.mark.parametrize("change", [{"train.device": "cpu"}, {"train.torch_threads": 4}, {"run_id": "other"},
                                    {"averaging.allreduce_timeout": 5.0}])
def test_config_hash_ignores_local_fields(change):
    assert fields_hash(shared_fields(load_config(TINY, change))) == fields_hash(shared_fields(load_config(TINY)))


def test_an_installed_wheel_finds_the_example_configs_under_its_prefix(tmp_path):
    from node.process.config import examples_dir

    installed = tmp_path / "venv" / "share" / "shoal" / "configs"
    installed.mkdir(parents=True)
    assert examples_dir(checkout=tmp_path / "site-packages", prefix=str(tmp_path / "venv")) == installed
    assert examples_dir(prefix=str(tmp_path / "venv")) == EXAMPLES_DIR  # a checkout wins
