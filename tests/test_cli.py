"""LightningCLI builds AttentionMonitor from YAML: examples/attention_monitor.yaml through the examples/cli.py app."""

import importlib.util
import sys
from pathlib import Path

import pytest
import yaml

pytest.importorskip("jsonargparse")  # LightningCLI needs the [cli] extra (part of [test])

from attn_callbacks import AttentionMonitor
from attn_callbacks.base.config import parse_bytes

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
CONFIG = EXAMPLES / "attention_monitor.yaml"


def _load_example():
    spec = importlib.util.spec_from_file_location("attention_monitor_cli_example", EXAMPLES / "cli.py")
    module = importlib.util.module_from_spec(spec)
    # Registered as a module is: jsonargparse < 4.51 resolves its postponed annotations through sys.modules.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)  # puts examples/ on sys.path for toy_translation
    return module


example = _load_example()
toy = importlib.import_module("toy_translation")


@pytest.fixture(autouse=True)
def _in_tmp_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the example logs to ./runs: keep it out of the repository
    monkeypatch.setattr(sys, "argv", ["cli.py"])  # LightningCLI warns when given args besides a command line


# Importable by these tests' module name, for the callable-valued arguments below.
def source_word(token_id: int) -> str:
    return f"fr{token_id}"


class BatchKey:
    """A callable class: jsonargparse builds it from ``class_path`` and ``init_args``."""

    def __init__(self, key: str) -> None:
        self.key = key

    def __call__(self, batch):
        return batch[self.key]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BatchKey) and other.key == self.key

    __hash__ = None


def build(config: Path):
    """The example's CLI, parsed and instantiated without running a subcommand."""
    return example.main(["--config", str(config)], run=False)


def monitor_of(cli) -> AttentionMonitor:
    [monitor] = [c for c in cli.trainer.callbacks if isinstance(c, AttentionMonitor)]
    return monitor


def example_init_args() -> dict:
    [entry] = yaml.safe_load(CONFIG.read_text())["trainer"]["callbacks"]
    assert entry["class_path"] == "attn_callbacks.AttentionMonitor"
    return entry["init_args"]


def write_config(path: Path, **init_args) -> Path:
    """The example config with some AttentionMonitor arguments replaced."""
    config = yaml.safe_load(CONFIG.read_text())
    config["trainer"]["callbacks"][0]["init_args"].update(init_args)
    path.write_text(yaml.safe_dump(config))
    return path


def resolved(monitor: AttentionMonitor) -> dict:
    """What the constructor made of its arguments, for comparing two monitors."""
    state = {k: v for k, v in vars(monitor).items() if not k.startswith("_")}
    for name in ("getters", "masks", "vocab", "labels", "sinks", "track_limit"):
        state[name] = getattr(monitor._streams, name)
    state["tracked"] = {stream: ids.tolist() for stream, ids in monitor._streams.tracked.items()}
    return state


def test_example_config_builds_the_monitor_it_describes():
    given = example_init_args()
    cli = build(CONFIG)
    monitor = monitor_of(cli)

    assert monitor._streams.getters == given["token_ids"]
    assert monitor._streams.vocab == given["vocab_size"]
    assert monitor._streams.labels == given["id_to_token"]
    assert monitor.attention_streams == {pattern: tuple(pair) for pattern, pair in given["attention_streams"].items()}
    assert monitor._streams.sinks == {stream: given["sink_ids"].get(stream, []) for stream in given["token_ids"]}
    assert monitor._streams.track_limit == {} and given["max_tracked_tokens"] is None
    assert monitor.memory_budget == parse_bytes("memory_budget", given["memory_budget"]) == 2**30
    special = {"token_ids", "vocab_size", "id_to_token", "attention_streams", "sink_ids", "max_tracked_tokens"}
    special.add("memory_budget")
    for name in given.keys() - special:  # stored as given
        assert getattr(monitor, name) == given[name], name

    # The YAML agrees with the example's model and data.
    assert given["id_to_token"] == {"src": toy.SRC_VOCAB, "tgt_in": toy.TGT_VOCAB, "tgt_out": toy.TGT_VOCAB}
    assert given["vocab_size"] == {
        "src": len(toy.SRC_VOCAB),
        "tgt_in": len(toy.TGT_VOCAB),
        "tgt_out": len(toy.TGT_VOCAB),
    }
    assert (cli.model.src_embed.num_embeddings, cli.model.tgt_embed.num_embeddings) == (21, 23)
    assert given["ignore_ids"] == [toy.PAD] and given["sink_ids"] == {"tgt_in": [toy.BOS]}


def test_dict_and_callable_arguments_round_trip_through_a_saved_config(tmp_path):
    module = __name__
    config = write_config(
        tmp_path / "custom.yaml",
        token_ids={"src": "src", "tgt_in": {"class_path": f"{module}.BatchKey", "init_args": {"key": "tgt_in"}}},
        token_mask={"src": "src_mask", "tgt_in": {"class_path": f"{module}.BatchKey", "init_args": {"key": "mask"}}},
        vocab_size={"src": 21, "tgt_in": 23},
        id_to_token={"src": f"{module}.source_word", "tgt_in": {0: "<pad>", 1: "<bos>"}},  # tgt_in ids otherwise
        attention_streams={"transformer.encoder.*": ["src", "src"], "*decoder*": ["tgt_in", "tgt_in"]},
        sink_ids={"src": [], "tgt_in": [1]},
        max_tracked_tokens={"src": 8},
        tracked_ids={"tgt_in": [3, 4]},
        memory_budget=2.5e8,
    )
    cli = build(config)
    monitor = monitor_of(cli)
    assert monitor._streams.getters == {"src": "src", "tgt_in": BatchKey("tgt_in")}
    assert monitor._streams.masks == {"src": "src_mask", "tgt_in": BatchKey("mask")}
    assert monitor._streams.labels == {"src": source_word, "tgt_in": {0: "<pad>", 1: "<bos>"}}
    assert monitor.attention_streams == {"transformer.encoder.*": ("src", "src"), "*decoder*": ("tgt_in", "tgt_in")}
    assert monitor._streams.track_limit == {"src": 8}
    assert monitor._streams.tracked["tgt_in"].tolist() == [1, 3, 4]  # sink ids first
    assert monitor.memory_budget == 250_000_000

    # Dumped as SaveConfigCallback does, then read back: the same monitor.
    saved = tmp_path / "saved.yaml"
    saved.write_text(cli.parser.dump(cli.config, skip_none=False))
    [entry] = yaml.safe_load(saved.read_text())["trainer"]["callbacks"]
    assert entry["init_args"]["id_to_token"]["src"] == f"{module}.source_word"
    assert entry["init_args"]["token_ids"]["tgt_in"] == {
        "class_path": f"{module}.BatchKey",
        "init_args": {"key": "tgt_in"},
    }
    assert resolved(monitor_of(build(saved))) == resolved(monitor)


@pytest.mark.parametrize("key", ["input_ids", f"{__name__}.source_word", 0])
def test_token_ids_keys_stay_batch_keys(tmp_path, key):
    """A string is a batch key even when it names an importable function; an int is a sequence index."""
    config = write_config(
        tmp_path / "key.yaml", token_ids=key, vocab_size=21, id_to_token=None, attention_streams=None, sink_ids=[]
    )
    getter = monitor_of(build(config))._streams.getters["tokens"]
    assert getter == key and type(getter) is type(key)


def test_bad_value_fails_with_the_callbacks_message(tmp_path):
    config = write_config(tmp_path / "bad.yaml", top_k=0)
    with pytest.raises(ValueError, match=r"`top_k` to be a positive integer, but got 0"):
        build(config)


def test_fit_through_the_cli_logs_attention_scalars(tmp_path):
    # Quicker: no per-head image grids (half the drawing), no export files.
    config = write_config(tmp_path / "fit.yaml", per_head=False, export=None)
    cli = example.main(
        [
            "fit",
            f"--config={config}",
            f"--trainer.logger.init_args.save_dir={tmp_path}",
            "--trainer.max_epochs=1",
            "--trainer.limit_train_batches=2",
            "--trainer.limit_val_batches=1",
            "--trainer.num_sanity_val_steps=0",
            "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false",
            "--data.train_size=32",
            "--data.val_size=16",
            "--data.batch_size=8",
        ]
    )
    metrics = cli.trainer.callback_metrics
    for tag in (
        "attention_entropy/transformer.decoder.layers.1.multihead_attn",
        "attention_lift/transformer.decoder.layers.1.multihead_attn",
        "attention_asymmetry/transformer.encoder.layers.0.self_attn",
        "attention_position/sink_mass/transformer.decoder.layers.0.self_attn",  # sink_ids: {tgt_in: [1]}
    ):
        assert tag in metrics, sorted(metrics)
    log_dir = Path(cli.trainer.log_dir)
    assert log_dir.is_relative_to(tmp_path)
    # The config that SaveConfigCallback wrote holds the monitor's arguments as given.
    [given] = yaml.safe_load(config.read_text())["trainer"]["callbacks"]
    [saved] = yaml.safe_load((log_dir / "config.yaml").read_text())["trainer"]["callbacks"]
    assert {k: saved["init_args"][k] for k in given["init_args"]} == given["init_args"]
