"""Local CL client: MoCo on the client's own images only (the server sends ``config["local"]``),
then fine-tuning from the client's own pre-trained backbone.

The server only knows the initial model, so the classifier it sends for fine-tuning (round-0
evaluation, round-1 training, and a test of round 0 if that was the best round) has the initial
backbone.  This client recognises that backbone (a digest of the ``backbone.*`` arrays recorded
in pre-training round 1) and swaps in the backbone it pre-trained itself; any other weights
(e.g. a FedAvg of fine-tuned models) are used as sent.
"""

from __future__ import annotations

import hashlib

from flwr.app import ArrayRecord, Context, Message

from wire import to_array, to_state_dict, values

from . import fedclf, finetune
from .state import client_state

INITIAL = "localcl-initial-backbone"  # client state: digest of the initial backbone


def backbone_digest(arrays: ArrayRecord) -> str:
    h = hashlib.sha256()
    for key in sorted(k for k in arrays.keys() if k.startswith("backbone.")):
        h.update(key.encode())
        h.update(values(arrays[key]).tobytes())
    return h.hexdigest()


def pretrain(msg: Message, context: Context) -> Message:
    """Local MoCo (no features shared); remembers the initial backbone of round 1."""
    state = client_state(context)
    if INITIAL not in state and "arrays" in msg.content and len(msg.content["arrays"]):
        state.put(INITIAL, meta={"digest": backbone_digest(msg.content["arrays"])})
    return fedclf.pretrain(msg, context, feature_sharing=False)


def with_own_backbone(msg: Message, context: Context) -> Message:
    """If the instruction's classifier has the initial backbone, replace its ``backbone.*``
    weights by this client's pre-trained ones (the new head is kept)."""
    state = client_state(context)
    if "arrays" not in msg.content or fedclf.OWN_MODEL not in state or INITIAL not in state:
        return msg
    arrays = msg.content["arrays"]
    if not len(arrays) or backbone_digest(arrays) != state.meta(INITIAL)["digest"]:
        return msg
    own = state.tensors(fedclf.OWN_MODEL)
    msg.content["arrays"] = ArrayRecord(
        {k: to_array(own[k]) if k.startswith("backbone.") else v for k, v in arrays.items()}
    )
    return msg


def probe_state(msg: Message, context: Context) -> dict:
    """The encoder a probe scores (``probe-every``): this client's own pre-trained model (the
    server only has the initial one)."""
    own = client_state(context).tensors(fedclf.OWN_MODEL)
    return dict(own) if own is not None else to_state_dict(msg.content["arrays"])


def train(msg: Message, context: Context) -> Message:
    return finetune.train(with_own_backbone(msg, context), context)


def evaluate(msg: Message, context: Context) -> Message:
    return finetune.evaluate(with_own_backbone(msg, context), context)


HANDLERS = {"train.pretrain": pretrain, "train.finetune": train, "evaluate": evaluate}
