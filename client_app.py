"""fedderm ClientApp: routes each message by (method, message type) through the registry."""

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

import registry
from clients.common import info, session

app = ClientApp()


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
app.train()(dispatch)
app.evaluate()(dispatch)
# message types with an action that some method handles (e.g. "train.gan" of ssl-flbt)
for _kind in sorted({k for m in registry.METHODS.values() for k in m.messages if "." in k}):
    _category, _action = _kind.split(".", 1)
    getattr(app, _category)(_action)(dispatch)
