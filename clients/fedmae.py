"""FedMAE / Fed-MAE client: MAE pre-training on all training images (labels unused).

The parameters named by ``fedmae.exclude`` stay here: the client keeps them in
its state store (:func:`clients.state.client_state`, across processes and resumes), puts them back
over the global values it receives, and leaves them out of its reply.  When the server marks
the last round (``send-local``) it also sends them, as the ``local-arrays`` record, to be
averaged once into the final model (000 §IV-D).
"""

from flwr.app import ArrayRecord, Context, Message

from fedderm.mae import MAEOptions, build_mae, excluded_keys
from fedderm.train import to_input, train_epochs
from wire import LOCAL_RECORD, to_record

from . import finetune
from .common import reply, session
from .state import client_state

KEPT = "fedmae-kept"  # client-state entry of this client's excluded parameters


def receive(context: Context, arrays: ArrayRecord):
    """The client's MAE at the start of a round: the global ``arrays`` with this client's own
    copies of the excluded parameters put back (from round 2 on); returns (model, excluded keys)."""
    s = session(context)
    model = s.model(arrays, key="mae", factory=lambda: build_mae(s.cfg))
    kept = excluded_keys(model, MAEOptions.from_config(s.cfg).exclude)
    own = client_state(context).tensors(KEPT)
    if kept and own is not None:
        model.load_state_dict({**model.state_dict(), **own}, strict=True)
    return model, kept


def pretrain(msg: Message, context: Context) -> Message:
    s = session(context)
    cfg, config = s.cfg, msg.content["config"]
    server_round = int(config["server-round"])
    options = MAEOptions.from_config(cfg)
    model, kept = receive(context, msg.content["arrays"])
    augment = s.augment("pretrain")

    def loss_fn(m, xb, yb, generator):
        x = to_input(augment(xb, generator), s.device)
        return m(x, options.mask_ratio, generator)[0]

    images, labels = s.data.tensors("train")
    metrics = train_epochs(
        model, images, labels, loss_fn, **s.mim_kwargs(server_round, int(config["num-rounds"]))
    )
    metrics["partition-id"] = s.partition_id
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    extra = {}
    if kept:
        own = to_record({k: state[k] for k in kept})
        client_state(context).put(KEPT, {k: state[k] for k in kept})
        if bool(config.get("send-local", False)):
            extra[LOCAL_RECORD] = own
    shared = to_record({k: v for k, v in state.items() if k not in kept})
    return reply(msg, metrics, shared, **extra)


def probe_state(msg: Message, context: Context) -> dict:
    """The encoder a probe scores (``probe-every``): the global model with this client's kept
    parameters put back, as its next round would train it."""
    model, _ = receive(context, msg.content["arrays"])
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


HANDLERS = {"train.pretrain": pretrain, **finetune.HANDLERS}
