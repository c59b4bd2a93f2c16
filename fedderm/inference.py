"""Use a trained model: load a run's ``model.pt`` (or ``model-best.pt``) and label images.

    from fedderm.inference import load_model
    clf = load_model("~/fedderm-results/fedavg-npz-.../model-best.pt")
    clf.classes                          # ['actinic keratosis', ...] in label order
    clf.predict(images)                  # [('melanoma', 0.91), ...]

The class names and the network (``model``, ``image-size``) come from the model file's metadata
(``state_dict._metadata["fedderm"]``, written by :class:`fedderm.results.RunRecorder`).  Images are
``uint8`` tensors N×3×S×S at the run's ``image-size`` (as the data pipeline makes them) or PIL images,
which are resized as the data sources do (:func:`fedderm.data.pool.resize_square`).

From the command line (``fedderm-predict`` is the same command)::

    python -m fedderm.inference RUN_FOLDER/model-best.pt /data/new-images -o predictions.csv

writes one CSV row per image file (folders are searched recursively): ``image``, ``predicted``,
``probability`` (of the predicted class) and ``p:<class>`` for every class in label order.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import importlib
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .data.pool import resize_square
from .methods import METHODS
from .models import create_model
from .train import predict

__all__ = ["Classifier", "image_files", "load_model", "main", "model_metadata", "predict_files"]


#: what to pass instead of a file that is no model
_PASS = "pass a run's model-best.pt (the model that was tested) or model.pt (the last round's)"
#: the keys and the file name of a per-round checkpoint (fedderm.checkpoint.save_checkpoint)
_CHECKPOINT_KEYS = {"stage", "round", "arrays"}
_CHECKPOINT_NAME = re.compile(r"checkpoint.*-round-\d+\.pt")


def _checkpoint_error(path: Path) -> ValueError:
    return ValueError(
        f"{path} is a per-round checkpoint, which resumes a run; pass the run's model-best.pt "
        f"(the model that was tested) or model.pt (the last round's): {path.parent / 'model-best.pt'}"
    )


def model_metadata(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(state dict, fedderm metadata) of a model file; raises naming the file when it has none."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ValueError(f"model file {path} {'is a folder' if path.is_dir() else 'does not exist'}")
    if _CHECKPOINT_NAME.fullmatch(path.name):  # told apart before torch reads it
        raise _checkpoint_error(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - torch raises many types for a file that is no model
        raise ValueError(
            f"{path} is not a model file (PyTorch cannot read it: {type(err).__name__}); {_PASS}"
        ) from None
    if not isinstance(state, dict):
        raise ValueError(f"{path} holds a {type(state).__name__}, not a model's state dict; {_PASS}")
    if _CHECKPOINT_KEYS <= set(state):  # a checkpoint under another name
        raise _checkpoint_error(path)
    meta = dict((getattr(state, "_metadata", None) or {}).get("fedderm") or {})
    if not meta.get("classes"):
        raise ValueError(
            f"{path} carries no fedderm metadata (class names); it was written before "
            "fedderm recorded them, or is not a model.pt / model-best.pt of a run"
        )
    return state, meta


@dataclass
class Classifier:
    """A loaded model with its class names; :meth:`predict` labels images."""

    model: torch.nn.Module
    classes: list[str]
    image_size: int
    meta: dict[str, Any]

    def probabilities(self, images) -> torch.Tensor:
        """Softmax probabilities (N, C) in ``classes`` order."""
        return predict(self.model, self._tensor(images))

    def predict(self, images) -> list[tuple[str, float]]:
        """(class name, probability) of the most likely class of every image."""
        probs = self.probabilities(images)
        conf, idx = probs.max(dim=1)
        return [(self.classes[int(i)], float(c)) for i, c in zip(idx, conf)]

    def _tensor(self, images) -> torch.Tensor:
        if isinstance(images, torch.Tensor):
            x = images if images.ndim == 4 else images.unsqueeze(0)
            if x.dtype != torch.uint8 or tuple(x.shape[1:]) != (3, self.image_size, self.image_size):
                raise ValueError(
                    f"images must be uint8 N×3×{self.image_size}×{self.image_size} "
                    f"(the run's image-size), got {x.dtype} {tuple(x.shape)}"
                )
            return x
        pics = images if isinstance(images, (list, tuple)) else [images]
        arrays = np.stack([resize_square(p, self.image_size) for p in pics])
        return torch.from_numpy(arrays).permute(0, 3, 1, 2).contiguous()


def load_model(path: str | Path) -> Classifier:
    """The classifier in ``path`` with its class names, ready to :meth:`Classifier.predict`."""
    state, meta = model_metadata(path)
    classes, network = list(meta["classes"]), meta.get("network", "classifier")
    size = int(meta["image_size"])
    method = METHODS.get(str(meta.get("method", "")))
    if method is not None and method.rebuild:  # the method rebuilds its own network
        module, name = method.rebuild.split(":")
        model = getattr(importlib.import_module(module), name)(state, meta)
    elif network == "classifier":
        model = create_model(meta["model"], len(classes), size, vit_pool=meta.get("vit_pool", "avg"))
    elif network == "projected":
        from .flbt import build_projected_net

        model = build_projected_net(meta["model"], len(classes), size, int(meta["proj_dim"]))
    else:
        raise ValueError(
            f"{path}: method {meta.get('method')!r} saves no plain classifier "
            f"(network {network!r}); fedderm.inference cannot rebuild it"
        )
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as err:
        first = str(err).splitlines()[0] if str(err) else ""
        raise ValueError(
            f"{path}: its weights do not fit model {meta['model']!r} with {len(classes)} classes "
            f"({first.rstrip(':')})"
        ) from None
    return Classifier(model=model.eval(), classes=classes, image_size=size, meta=meta)


def image_files(inputs: Sequence[str | Path]) -> list[Path]:
    """The image files named in ``inputs``: files as given, folders searched recursively for
    :data:`fedderm.data.folder.IMAGE_EXTENSIONS` (sorted by path); raises naming a missing input."""
    from .data.decode import _walk_images
    from .data.folder import IMAGE_EXTENSIONS

    files: list[Path] = []
    for given in inputs:
        path = Path(given).expanduser()
        if path.is_dir():
            found = _walk_images(path, IMAGE_EXTENSIONS)
            if not found:
                raise ValueError(f"no image files ({', '.join(IMAGE_EXTENSIONS)}) found in {path}")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise ValueError(f"image file or folder {path} does not exist")
    return files


def predict_files(
    clf: Classifier,
    files: Sequence[Path],
    batch_size: int = 64,
    skip_bad: bool = False,
    progress=None,
) -> tuple[list[tuple[Path, torch.Tensor]], list[str]]:
    """(file, class probabilities) of every readable file in ``files``, and the skipped files.

    Files are decoded as the data sources decode them (:func:`fedderm.data.decode._read_image`:
    the run's ``image-size``, shorter side resized, centre crop).  An unreadable file raises a
    :class:`fedderm.data.DataError` naming it unless ``skip_bad``.  ``progress(done, total)`` is
    called after every batch."""
    from .data.decode import _read_image
    from .data.pool import DataError

    out: list[tuple[Path, torch.Tensor]] = []
    skipped: list[str] = []
    for start in range(0, len(files), batch_size):
        batch, arrays = [], []
        for path in files[start : start + batch_size]:
            try:
                arrays.append(_read_image(path, clf.image_size))
                batch.append(path)
            except DataError as err:
                if not skip_bad:
                    raise DataError(f"{err} (--skip-bad-files skips unreadable images)") from None
                skipped.append(f"{err}")
        if arrays:
            x = torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).contiguous()
            out.extend(zip(batch, clf.probabilities(x)))
        if progress is not None:
            progress(min(start + batch_size, len(files)), len(files))
    return out, skipped


def _progress_printer(stream):
    """Progress lines on ``stream`` for more than one batch: at most every tenth of the files."""
    state = {"next": 0.0}

    def report(done: int, total: int) -> None:
        if done >= state["next"] or done == total:
            print(f"labelled {done}/{total} images", file=stream, flush=True)
            state["next"] = done + total / 10

    return report


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m fedderm.inference MODEL IMAGES... [-o CSV]``: label image files with a run's
    model; one ``error:`` line naming the file at fault (exit 1) when a file is wrong."""
    parser = argparse.ArgumentParser(
        prog="fedderm-predict",
        description="Label images with a fedderm model: one CSV row per image with the predicted "
        "class, its probability and every class's probability.",
    )
    parser.add_argument(
        "model", help="a run's model-best.pt or model.pt (or the run folder: its model-best.pt)"
    )
    parser.add_argument("images", nargs="+", help="image files and/or folders (searched recursively)")
    parser.add_argument(
        "-o", "--output", default="-", help="the CSV file to write (default: standard output)"
    )
    parser.add_argument("--batch-size", type=int, default=64, help="images decoded and labelled at once")
    parser.add_argument(
        "--skip-bad-files",
        action="store_true",
        help="skip unreadable images (listed on stderr) instead of stopping",
    )
    args = parser.parse_args(argv)
    if args.batch_size < 1:
        parser.error(f"--batch-size must be >= 1, got {args.batch_size}")
    from .data.pool import DataError

    model_path = Path(args.model).expanduser()
    if model_path.is_dir():  # a run folder: the model that was tested
        best = model_path / "model-best.pt"
        model_path = best if best.is_file() else model_path / "model.pt"
    try:
        clf = load_model(model_path)
        files = image_files(args.images)
        many = len(files) > args.batch_size
        results, skipped = predict_files(
            clf, files, args.batch_size, args.skip_bad_files, _progress_printer(sys.stderr) if many else None
        )
    except (ValueError, DataError, OSError) as err:
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
        return 1
    for line in skipped:
        print(f"skipped: {line}", file=sys.stderr)
    header = ["image", "predicted", "probability", *(f"p:{name}" for name in clf.classes)]
    try:
        fh = sys.stdout if args.output == "-" else open(Path(args.output).expanduser(), "w", newline="")
    except OSError as err:
        print(f"error: cannot write {args.output}: {err.strerror or err}", file=sys.stderr)
        return 1
    with fh if fh is not sys.stdout else contextlib.nullcontext(fh):
        writer = csv.writer(fh, lineterminator="\n")  # csv's default is "\r\n"
        writer.writerow(header)
        for path, probs in results:
            best = int(probs.argmax())
            writer.writerow(
                [
                    str(path),
                    clf.classes[best],
                    f"{float(probs[best]):.6f}",
                    *(f"{float(p):.6f}" for p in probs),
                ]
            )
    if args.output != "-":
        print(f"predictions: {len(results)} images -> {Path(args.output).expanduser()}", file=sys.stderr)
    return 0


def predict_entry() -> None:
    """The ``fedderm-predict`` console script."""
    sys.exit(main())


if __name__ == "__main__":
    sys.exit(main())
