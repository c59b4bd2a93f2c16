"""Real names of known label sets: MedMNIST's classes by ``.npz`` file name, and the diagnosis
codes of HAM10000 / ISIC 2019 spelled out.

The MedMNIST names are those of MedMNIST v2's ``INFO[<flag>]["label"]`` (``medmnist/info.py``),
copied here so that no download and no ``medmnist`` package are needed.  SiFT (002 §2.2, "t_c can
be simply the class name") embeds these names instead of the digits ``"0" … "10"`` a bare ``.npz``
gives.  ChestMNIST (multi-label) and RetinaMNIST (grades ``"0" … "4"``) are left out: fedderm
refuses multi-label files, and RetinaMNIST's INFO names are the digits themselves.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

__all__ = ["CODE_NAMES", "MEDMNIST_LABELS", "medmnist_names", "readable_name", "readable_names"]

_ORGANS = (
    "bladder",
    "femur-left",
    "femur-right",
    "heart",
    "kidney-left",
    "kidney-right",
    "liver",
    "lung-left",
    "lung-right",
    "pancreas",
    "spleen",
)

#: MedMNIST v2 flag -> class names in label order (``INFO[flag]["label"]``).
MEDMNIST_LABELS: dict[str, tuple[str, ...]] = {
    "pathmnist": (
        "adipose",
        "background",
        "debris",
        "lymphocytes",
        "mucus",
        "smooth muscle",
        "normal colon mucosa",
        "cancer-associated stroma",
        "colorectal adenocarcinoma epithelium",
    ),
    "dermamnist": (
        "actinic keratoses and intraepithelial carcinoma",
        "basal cell carcinoma",
        "benign keratosis-like lesions",
        "dermatofibroma",
        "melanoma",
        "melanocytic nevi",
        "vascular lesions",
    ),
    "octmnist": ("choroidal neovascularization", "diabetic macular edema", "drusen", "normal"),
    "pneumoniamnist": ("normal", "pneumonia"),
    "breastmnist": ("malignant", "normal, benign"),
    "bloodmnist": (
        "basophil",
        "eosinophil",
        "erythroblast",
        "immature granulocytes(myelocytes, metamyelocytes and promyelocytes)",
        "lymphocyte",
        "monocyte",
        "neutrophil",
        "platelet",
    ),
    "tissuemnist": (
        "Collecting Duct, Connecting Tubule",
        "Distal Convoluted Tubule",
        "Glomerular endothelial cells",
        "Interstitial endothelial cells",
        "Leukocytes",
        "Podocytes",
        "Proximal Tubule Segments",
        "Thick Ascending Limb",
    ),
    "organamnist": _ORGANS,
    "organcmnist": _ORGANS,
    "organsmnist": _ORGANS,
}

#: HAM10000 ``dx`` codes and ISIC 2019 ground-truth columns (compared case-insensitively) ->
#: the diagnosis they stand for (HAM10000 paper, Tschandl et al. 2018; ISIC 2019 task page).
CODE_NAMES: dict[str, str] = {
    "akiec": "actinic keratosis or intraepithelial carcinoma",
    "ak": "actinic keratosis",
    "bcc": "basal cell carcinoma",
    "bkl": "benign keratosis",
    "df": "dermatofibroma",
    "mel": "melanoma",
    "nv": "melanocytic nevus",
    "vasc": "vascular lesion",
    "scc": "squamous cell carcinoma",
    "unk": "unknown lesion",
}

# MedMNIST+ files carry the image size: dermamnist_64.npz, dermamnist_224.npz
_SIZE_SUFFIX = re.compile(r"_\d+$")


def medmnist_names(path: str | Path) -> list[str] | None:
    """The class names of a MedMNIST ``.npz`` named after its flag (``dermamnist.npz``,
    ``organcmnist_224.npz``), or ``None`` for any other file name."""
    flag = _SIZE_SUFFIX.sub("", Path(path).stem.lower())
    names = MEDMNIST_LABELS.get(flag)
    return list(names) if names else None


def readable_name(name: str) -> str:
    """A class name as words: a known diagnosis code spelled out (``mel`` -> ``melanoma``), else the
    name with underscores as spaces."""
    return CODE_NAMES.get(str(name).strip().lower(), str(name).replace("_", " "))


def readable_names(classes: Sequence[str]) -> list[str]:
    return [readable_name(c) for c in classes]
