"""fedderm ClientApp: routes each message by (method, message type) through the registry."""

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

import registry
from clients.audit import audit_mod
from clients.common import info, session

app = ClientApp(mods=[audit_mod])


def dispatch(msg: Message, context: Context) -> Message:
    """Hand ``msg`` to ``clients/<method>.py``'s handler for its message type."""
    cfg = session(context).cfg
    handlers = registry.get_method(cfg.method).client_module().HANDLERS
    kind = msg.metadata.message_type
    if kind not in handlers:
        raise ValueError(f"method {cfg.method!r} has no client handler for message type {kind!r}; "
                         f"it handles {sorted(handlers)}")
    return handlers[kind](msg, context)


app.query("info")(info)
app.query("features")(dispatch)
app.train()(dispatch)
app.train("pretrain")(dispatch)
app.train("finetune")(dispatch)
app.evaluate()(dispatch)
