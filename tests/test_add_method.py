"""Adding a method touches only its own files: this module is a whole method, "toy-shift", and
registers it from here (docs/architecture.md, "How to add a method").

toy-shift is FedAvg whose clients do not train: client ``i`` replies the global model ``w`` with
``i + 1`` added to every floating-point array and ``num-examples = i + 1``.  The server's weighted
mean is therefore ``w + sum((i+1)^2) / sum(i+1)``, i.e. ``w + 5/3`` per round with two clients,
so the model round ``r`` sends is ``w_1 + (r - 1) * 5/3``.  Its ``Method`` names this module as
both its strategy module (``build_strategy``) and its client module (``HANDLERS``); its one option
``toy-shift.scale`` multiplies the shift and has a check.  Nothing outside this file names it.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from flwr.app import Context, Message
from flwr.serverapp.strategy import FedAvg

import registry
import sim
from clients.common import evaluate_split, reply, session
from fedderm.config import Config, ConfigError
from fedderm.methods import METHODS, Method, need, register_method
from strategies.common import Tracked
from wire import to_record, values

#: what the toy's clients received in each train message: (server round, partition id, arrays)
RECEIVED: list[tuple[int, int, dict[str, np.ndarray]]] = []


# -- the server side (a strategy module: build_strategy) --
class ToyStrategy(Tracked, FedAvg):
    """Flower's FedAvg with fedderm's bookkeeping (weighted by the replies' ``num-examples``)."""


def build_strategy(cfg, recorder) -> ToyStrategy:
    n = cfg.min_clients
    return ToyStrategy(
        cfg=cfg, recorder=recorder, min_train_nodes=n, min_evaluate_nodes=n, min_available_nodes=n
    )


# -- the client side (a client module: HANDLERS) --
def train(msg: Message, context: Context) -> Message:
    s = session(context)
    shift = (s.partition_id + 1) * s.cfg.option("toy-shift.scale")
    received = {k: values(a).copy() for k, a in msg.content["arrays"].items()}
    RECEIVED.append((int(msg.content["config"]["server-round"]), s.partition_id, received))
    shifted = {k: v + np.float32(shift) if v.dtype.kind == "f" else v for k, v in received.items()}
    return reply(
        msg, {"num-examples": s.partition_id + 1, "partition-id": s.partition_id}, to_record(shifted)
    )


def evaluate(msg: Message, context: Context) -> Message:
    split = str(msg.content["config"].get("split", "val"))
    return reply(msg, evaluate_split(session(context), msg.content["arrays"], split))


HANDLERS = {"train": train, "evaluate": evaluate}


# -- the specification (a fedderm/methods/<m>.py: register_method) --
def check_toy(cfg: Config) -> None:
    need(cfg, cfg.option("toy-shift.scale") > 0, "toy-shift.scale", "must be > 0")


TOY = Method(
    "toy-shift",
    strategy=__name__,
    client=__name__,
    description="Toy: FedAvg of client models shifted by (partition id + 1), weighted by the same.",
    options={"toy-shift.scale": 1.0},
    docs={"toy-shift.scale": "multiplies every client's shift (partition id + 1)"},
    check=check_toy,
)


@pytest.fixture
def toy():
    """toy-shift registered for one test (the shipped methods register on import of ``methods``)."""
    RECEIVED.clear()
    method = register_method(TOY)
    yield method
    del METHODS[method.name]


def test_a_method_registered_from_one_module_runs_end_to_end(toy, in_process, tmp_path):
    """The rule above, through the real ServerApp and ClientApp (every mod) in this process."""
    run_dir = sim.simulate(
        {
            "method": "toy-shift",
            "model": "tiny-cnn",
            "image-size": 16,
            "synthetic-per-class": 6,
            "num-server-rounds": 3,
            "output-dir": str(tmp_path),
            "run-name": "toy",
        },
        num_supernodes=2,
    )
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "done"
    assert json.loads((run_dir / "config.json").read_text())["method"] == "toy-shift"
    assert sorted((r, p) for r, p, _ in RECEIVED) == [(r, p) for r in (1, 2, 3) for p in (0, 1)]
    first = next(a for r, p, a in RECEIVED if r == 1)
    floats = [k for k, v in first.items() if v.dtype.kind == "f"]
    assert floats
    for r, _, arrays in RECEIVED:  # both clients get the same model: w_1 + (r - 1) * 5/3
        assert arrays.keys() == first.keys()
        for k, v in arrays.items():
            want = first[k] + (r - 1) * 5 / 3 if k in floats else first[k]
            np.testing.assert_allclose(v, want, rtol=0, atol=1e-5, err_msg=f"round {r}, {k}")


def test_the_registered_method_is_a_valid_method_with_its_own_option_checked(toy):
    cfg = registry.load_config({"method": "toy-shift", "toy-shift.scale": 2.0})
    assert cfg.option("toy-shift.scale") == 2.0
    assert registry.method_options()["toy-shift.scale"] == 1.0
    with pytest.raises(ConfigError, match="'toy-shift.scale' must be > 0, got 0.0"):
        registry.load_config({"method": "toy-shift", "toy-shift.scale": 0.0})


def test_its_option_and_description_reach_the_generated_run_config_reference(toy):
    """What ``python -m config_docs`` would write with toy-shift registered: its option's row."""
    import config_docs

    page = config_docs.render(config_docs.registry_options(), method_docs=config_docs.registry_docs())
    rows = [line for line in page.splitlines() if line.startswith("| `toy-shift.scale`")]
    assert rows == [
        "| `toy-shift.scale` | `1.0` | float |  | multiplies every client's shift (partition id + 1) |"
    ]
    assert '"toy-shift.scale" = 1.0' in config_docs.app_config_table(config_docs.registry_options())


def test_a_second_method_of_the_same_name_a_clashing_default_or_an_undocumented_option_is_refused(toy):
    with pytest.raises(ValueError, match="'toy-shift' is registered twice"):
        register_method(TOY)
    clash = Method("toy-two", __name__, __name__, "", options={"toy-shift.scale": 2.0}, docs=TOY.docs)
    with pytest.raises(ValueError, match="'toy-shift.scale' = 2.0, but method 'toy-shift'"):
        register_method(clash)
    bare = Method("toy-two", __name__, __name__, "", options={"toy-two.k": 1})
    with pytest.raises(ValueError, match=r"without a line: \['toy-two.k'\]"):
        register_method(bare)
    assert "toy-two" not in METHODS


def test_unregistered_the_method_is_unknown_again():
    assert "toy-shift" not in METHODS
    with pytest.raises(ConfigError, match="unknown method 'toy-shift'"):
        registry.load_config({"method": "toy-shift"})
