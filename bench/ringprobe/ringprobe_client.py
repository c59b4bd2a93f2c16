"""The ring probe's ClientApp: add 1 to the array and pass it back."""

from flwr.app import Array, ArrayRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()


@app.query("hop")
def hop(msg: Message, context: Context) -> Message:
    if msg.content["config"]["import-fedderm"]:
        import client_app  # noqa: F401  fedderm's ClientApp module: the real per-process start-up cost

    x = msg.content["arrays"]["x"].numpy()
    return Message(RecordDict({"arrays": ArrayRecord({"x": Array(x + 1)})}), reply_to=msg)
