"""The run folder's figures hold every label: confusion.png of two classes with long names keeps its
panel titles and its "predicted" axis label inside the image."""

from PIL import Image

from fedderm.results import RunRecorder


def test_confusion_png_holds_every_label(tmp_path, monkeypatch):
    recorder = RunRecorder(tmp_path / "run", "fedavg", {})
    figures = []
    save = RunRecorder._save_figure

    def keep(self, fig, name):
        figures.append(fig)
        return save(self, fig, name)

    monkeypatch.setattr(RunRecorder, "_save_figure", keep)
    cm = [[5, 1], [2, 7]]
    sets = [("pooled-test", None, {"confusion_matrix": cm})] + [
        ("test", str(c), {"confusion_matrix": cm}) for c in range(2)
    ]
    path = recorder._plot_confusion(sets, ["melanoma", "melanocytic nevus"])
    (fig,) = figures
    renderer = fig.canvas.get_renderer()
    needed = fig.get_tightbbox(renderer)  # inches: every artist, titles and axis labels included
    width, height = Image.open(path).size
    assert width >= needed.width * 100 - 2 and height >= needed.height * 100 - 2, (width, height, needed)
