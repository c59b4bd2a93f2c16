"""fedderm ClientApp: routes each message by (method, message type) through the registry.

Under stock Flower every message starts a new ClientApp process that imports this module, so it
imports only what every message needs (Flower, torch, the mods, the client session); a method's
handlers (``clients/<method>.py``, with timm, torchvision or transformers where its model needs
them) are imported when a message of that method comes (``python -m bench.cold_start``).
"""

import importlib

from flwr.app import Context, Message, MetricRecord
from flwr.clientapp import ClientApp

import registry
from clients.audit import audit_mod
from clients.common import evaluate_split, info, session
from clients.state import state_mod
from clients.transport import pack_mod, transport_mod
from fedderm.train import GpuPeak, use_bn_stats, use_precision
from wire import GPU_PEAK, PEFT_BACKBONE, VAL_METRICS, VAL_ROUND, ray_out_of_band

# audit_mod wraps transport_mod: the audit log shows the arrays exactly as they leave the hospital
# (pack_mod, outermost, only joins them into one Array for the trip: the same bytes)
MODS = [pack_mod, state_mod, audit_mod, transport_mod]
ray_out_of_band(only_in_ray=True)  # a simulation's ClientApp actor: replies leave through Ray out of band
app = ClientApp(mods=MODS)


#: Message types every method's clients handle -> the module whose ``HANDLERS`` has the handler,
#: imported when such a message comes: fine-tuning on a held-out centre (``holdout-centre``),
#: encoder probes during pre-training (``probe-every``), the frozen backbone of ``peft``.
SHARED_CLIENTS = {
    "train.holdout": "clients.holdout",
    "query.probe": "clients.probe",
    PEFT_BACKBONE: "clients.peft",
}


def handler(method: str, kind: str):
    """The handler of message type ``kind`` for ``method``: its ``clients/<method>.py``'s, else the
    shared one of :data:`SHARED_CLIENTS` (each module imported here, on first use)."""
    handlers = importlib.import_module(registry.get_method(method).client).HANDLERS
    if kind in handlers:
        return handlers[kind]
    if kind in SHARED_CLIENTS:
        return importlib.import_module(SHARED_CLIENTS[kind]).HANDLERS[kind]
    raise ValueError(
        f"method {method!r} has no client handler for message type {kind!r}; "
        f"it handles {sorted({*handlers, *SHARED_CLIENTS})}"
    )


def dispatch(msg: Message, context: Context) -> Message:
    """Hand ``msg`` to ``clients/<method>.py``'s handler for its message type."""
    client = session(context)  # raises naming 'precision' when fp16 is asked for without CUDA
    cfg = client.cfg
    kind = msg.metadata.message_type
    handle = handler(cfg.method, kind)
    # val-in-train: the val evaluation of the model this train message carries (the previous round's
    # global model), before training on it: what an evaluate message with split "val" would return
    ride = kind == "train" and "config" in msg.content.config_records and VAL_ROUND in msg.content["config"]
    with use_precision(cfg.precision), use_bn_stats(cfg.bn_stats), GpuPeak(client.device) as peak:
        val = evaluate_split(client, msg.content["arrays"], "val") if ride else None
        reply = handle(msg, context)  # every local loop of this message (fedderm.train.Amp)
    if peak.mib is not None and reply.has_content() and "metrics" in reply.content:
        reply.content["metrics"][GPU_PEAK] = peak.mib  # summary.json ``gpu_peak_mib``
    if val is not None and reply.has_content():
        reply.content[VAL_METRICS] = MetricRecord(val)
    return reply


#: Every "category.action" message type some method handles: the shared stages, plus what the
#: registry declares (e.g. "train.gan" of ssl-flbt).  Plain "train"/"evaluate" are registered too.
ACTIONS = sorted(
    {"query.features", "train.pretrain", "train.finetune", *SHARED_CLIENTS}
    | {k for m in registry.METHODS.values() for k in m.messages if "." in k}
)


def register(client_app: ClientApp) -> ClientApp:
    """Route every message type fedderm uses on ``client_app`` through :func:`dispatch`."""
    client_app.query("info")(info)
    client_app.train()(dispatch)
    client_app.evaluate()(dispatch)
    for kind in ACTIONS:
        category, action = kind.split(".", 1)
        getattr(client_app, category)(action)(dispatch)
    return client_app


register(app)
