import pytest
import tomllib

import config_docs
import registry
from fedderm.config import Config, ConfigError, default_config, parse_config

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


def test_pyproject_table_and_run_config_page_are_the_generated_ones(tmp_path):
    """pyproject.toml's [tool.flwr.app.config] and docs/run-config.md are what ``python -m config_docs``
    writes from the typed declarations (Config, the registry's options), and the table carries
    exactly those defaults; a changed declaration makes ``--check`` fail."""
    assert config_docs.main(["--check"]) == 0, "stale: run `python -m config_docs`"
    with open(ROOT / "pyproject.toml", "rb") as f:
        app_config = tomllib.load(f)["tool"]["flwr"]["app"]["config"]
    assert app_config == {**default_config(), **registry.method_options()}
    assert list(app_config)[: len(default_config())] == list(default_config())

    options = config_docs.registry_options()
    changed = {**options, "fedclf": {**options["fedclf"], "fedclf.queue-size": 2048}}
    text = (ROOT / "pyproject.toml").read_text()
    stale = config_docs.render_pyproject(text, config_docs.app_config_table(changed))
    assert tomllib.loads(stale)["tool"]["flwr"]["app"]["config"]["fedclf.queue-size"] == 2048
    assert stale.replace("2048", "1024") == text  # only that value differs, the rest byte for byte
    (tmp_path / "pyproject.toml").write_text(stale)
    (tmp_path / "run-config.md").write_text((ROOT / "docs" / "run-config.md").read_text())
    argv = [
        "--check",
        "--pyproject",
        str(tmp_path / "pyproject.toml"),
        "--output",
        str(tmp_path / "run-config.md"),
    ]
    assert config_docs.main(argv) == 1
    (tmp_path / "run-config.md").write_text("# Run config\n")
    (tmp_path / "pyproject.toml").write_text(text)
    assert config_docs.main(argv) == 1
    assert config_docs.main(argv[1:]) == 0 and config_docs.main(argv) == 0  # written, then up to date


def test_parse_types_and_defaults():
    cfg = registry.load_config({"method": "fedprox", "lr": 1, "proximal-mu": 0.01, "num-server-rounds": 3})
    assert isinstance(cfg, Config)
    assert cfg.method == "fedprox" and cfg.num_server_rounds == 3
    assert cfg.lr == 1.0 and isinstance(cfg.lr, float)  # TOML int accepted for a float key
    assert cfg.batch_size == Config().batch_size


def test_unknown_key_names_it_and_lists_valid_keys():
    with pytest.raises(ConfigError) as err:
        registry.load_config({"num-server-round": 3})
    msg = str(err.value)
    assert "'num-server-round'" in msg and "Did you mean 'num-server-rounds'" in msg
    assert "batch-size" in msg and "dirichlet-alpha" in msg


def test_wrong_type_and_range_name_the_key():
    with pytest.raises(ConfigError, match="'batch-size' must be int"):
        registry.load_config({"batch-size": "32"})
    with pytest.raises(ConfigError, match="'skip-bad-files' must be bool"):
        registry.load_config({"skip-bad-files": 1})
    with pytest.raises(ConfigError, match="'partition' must be one of"):
        registry.load_config({"partition": "dirichet"})
    with pytest.raises(ConfigError, match="'label-fraction'"):
        registry.load_config({"label-fraction": 0.0})
    with pytest.raises(ConfigError, match="'data-path'"):
        registry.load_config({"dataset": "npz"})


def test_unknown_method_lists_methods():
    with pytest.raises(ConfigError, match="unknown method 'fedav'.*Did you mean 'fedavg'"):
        registry.load_config({"method": "fedav"})


def test_method_options_are_namespaced_and_typed():
    cfg = parse_config({"demo.k": 7}, methods=["fedavg"], method_options={"demo.k": 3, "demo.t": 0.5})
    assert cfg.option("demo.k") == 7 and cfg.option("demo.t") == 0.5
    with pytest.raises(ConfigError, match="'demo.k' must be int"):
        parse_config({"demo.k": 0.5}, methods=["fedavg"], method_options={"demo.k": 3})


def test_class_list_and_flat_round_trip():
    cfg = registry.load_config({"classes": "mel, nv ,bcc"})
    assert cfg.class_list == ["mel", "nv", "bcc"]
    assert registry.load_config(cfg.to_flat()) == cfg


@pytest.mark.parametrize("method", sorted(registry.METHODS))
def test_every_methods_smallest_run_is_a_valid_config(method):
    """registry.smallest_run: the shared tiny settings, the method's own, then the caller's."""
    cfg = registry.load_config(registry.smallest_run(method, **{"num-server-rounds": 2}))
    assert cfg.method == method and cfg.num_server_rounds == 2 and cfg.image_size == 16
    assert cfg.model == registry.METHODS[method].smallest.get("model", "tiny-cnn")
