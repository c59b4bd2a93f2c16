"""Local CL client: MoCo on the client's own images only (the server sends ``config["local"]``),
then fine-tuning from the client's own pre-trained backbone.

The fine-tuning stage's first model (round-0 evaluation and round-1 training) comes from the
server with the initial backbone; this client swaps in the backbone it pre-trained itself
(``context.state``), for federated and local fine-tuning alike.  Later rounds are the shared
fine-tuning unchanged.
"""

from __future__ import annotations

from functools import partial

from flwr.app import ArrayRecord, Context, Message

from . import fedclf, finetune


def with_own_backbone(msg: Message, context: Context) -> Message:
    """Replace the ``backbone.*`` weights of the instruction's classifier by this client's
    pre-trained ones."""
    if "arrays" not in msg.content or fedclf.OWN_MODEL not in context.state:
        return msg
    own = context.state[fedclf.OWN_MODEL]
    arrays = msg.content["arrays"]
    msg.content["arrays"] = ArrayRecord({k: own[k] if k.startswith("backbone.") else v for k, v in arrays.items()})
    return msg


def train(msg: Message, context: Context) -> Message:
    if int(msg.content["config"]["server-round"]) == 1:
        msg = with_own_backbone(msg, context)
    return finetune.train(msg, context)


def evaluate(msg: Message, context: Context) -> Message:
    if int(msg.content["config"].get("server-round", 0)) == 0:
        msg = with_own_backbone(msg, context)
    return finetune.evaluate(msg, context)


HANDLERS = {"train.pretrain": partial(fedclf.pretrain, feature_sharing=False),
            "train.finetune": train, "evaluate": evaluate}
