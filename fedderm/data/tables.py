"""CSV tables with an image folder: an ISIC 2019 ground-truth CSV or the HAM10000 metadata
(:func:`load_csv`)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from fedderm.data.cache import _cache_key, _cached, _fingerprint
from fedderm.data.decode import (
    _check_classes,
    _check_image_size,
    _decode_listing,
    _encode,
    _existing_path,
    _group_codes,
    _has_ext,
    _label_indices,
    _Listing,
    _raise_or_skip,
    _split_code,
    _walk_images,
    unknown_classes,
)
from fedderm.data.pool import DataError, ImagePool

if TYPE_CHECKING:  # pandas is imported where a CSV is read: most processes never need it
    import pandas as pd

logger = logging.getLogger("fedderm.data")

#: Image files looked up for the extension-less ids of a CSV (compared case-insensitively).
CSV_IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png")
_ISIC_ID, _HAM_ID, _HAM_LABEL, _GROUP_COLUMN, _AUTO_SITE_COLUMN = (
    "image",
    "image_id",
    "dx",
    "lesion_id",
    "dataset",
)
#: Column holding the data's own train/val/test split (header compared case-insensitively).
_SPLIT_COLUMN = "split"


def load_csv(
    csv_path: str | Path,
    image_size: int,
    *,
    skip_bad_files: bool = False,
    cache_dir: str | Path | None = None,
    classes: Sequence[str] | None = None,
    image_dir: str | Path | None = None,
    site_column: str | None = "auto",
) -> ImagePool:
    """Load an ISIC 2019 ground-truth CSV or the HAM10000 metadata with their images.

    Layouts (detected from the columns; the file may have no extension):

    * ISIC 2019: ``image`` + one-hot float columns (``MEL,NV,...,UNK``). Classes are those
      columns in file order (every column except ``image``, ``lesion_id`` and the site
      column); each row must hold exactly one ``1`` and zeros elsewhere.
    * HAM10000: ``image_id`` + ``dx``; classes are the sorted ``dx`` values. ``lesion_id``
      (either layout) gives ``pool.groups``.

    A ``split`` column (either layout, header in any case) is the data's own split: each value
    ``train``, ``val`` or ``test`` (any case; also ``validation``/``valid``, ``training``,
    ``testing``) goes into ``pool.splits``; any other value, or none, is a bad row.

    Image ids have no extension: ``<id>.jpg|.jpeg|.png`` (any case) is looked up among all
    files under ``image_dir``, searched recursively once.

    Args:
        csv_path: the ground-truth / metadata file.
        image_size: side of the square images in the returned pool.
        skip_bad_files: skip (and list in ``pool.skipped``) bad rows, missing and unreadable
            images instead of raising :class:`DataError`.
        cache_dir: where to keep the decoded pool between runs; ``None`` disables caching.
        classes: the class list (label order); a label outside it is an error.
        image_dir: folder holding the images; default: the CSV's folder.
        site_column: column giving each image's site: ``"auto"`` uses ``dataset`` when
            present (HAM10000), ``""`` or ``None`` means no sites.

    Raises:
        DataError: unknown layout, missing column, bad row, missing or unreadable image.
    """
    _check_image_size(image_size)
    wanted = _check_classes(classes)
    csv_path = _existing_path(csv_path, "CSV file")
    image_dir = (
        csv_path.parent if image_dir is None else _existing_path(image_dir, "image folder", want_dir=True)
    )
    image_files = _walk_images(image_dir, CSV_IMAGE_EXTENSIONS)
    key = _cache_key(
        "csv",
        csv_path,
        image_size,
        skip_bad_files,
        wanted,
        files=_fingerprint([csv_path], csv_path.parent) + _fingerprint(image_files, image_dir),
        image_dir=str(image_dir),
        site_column=site_column,
    )

    def build() -> ImagePool:
        table = _read_table(csv_path, site_column)
        rows = _parse_rows(table, csv_path, _resolve_site_column(table, csv_path, site_column))
        listing = _csv_listing(rows, wanted, _index_by_stem(image_files), csv_path, image_dir, skip_bad_files)
        return _decode_listing(listing, image_size, skip_bad_files, source=csv_path)

    return _cached(cache_dir, key, build)


@dataclass
class _Rows:
    """What a CSV says about each image; ``None`` labels mark invalid rows."""

    csv_classes: list[str] | None  # classes defined by the file (ISIC), else None
    ids: list[str]
    labels: list[str | None]
    problems: dict[int, str]  # row position -> why its label is invalid
    sites: list[str | None] | None
    groups: list[str | None] | None
    splits: list[int | None] | None = None  # the ``split`` column's code of each row


def _line(row: int) -> int:
    """File line of 0-based data row ``row`` (line 1 is the header)."""
    return row + 2


def _read_table(csv_path: Path, site_column: str | None) -> pd.DataFrame:
    """The CSV with its id, label, group and site columns read as text."""
    import pandas as pd

    named = (_ISIC_ID, _HAM_ID, _HAM_LABEL, _GROUP_COLUMN, _AUTO_SITE_COLUMN, site_column)
    text_columns = {c: str for c in named if c and c != "auto"}
    try:
        table = pd.read_csv(csv_path, dtype=text_columns, encoding="utf-8-sig", skipinitialspace=True)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError, ValueError) as exc:
        raise DataError(f"cannot read CSV {csv_path}: {exc}") from exc
    table.columns = [str(c).strip() for c in table.columns]
    if table.empty:
        raise DataError(f"CSV {csv_path} has no data rows (columns: {list(table.columns)})")
    return table


def _resolve_site_column(table: pd.DataFrame, csv_path: Path, site_column: str | None) -> str | None:
    if site_column == "auto":
        return _AUTO_SITE_COLUMN if _AUTO_SITE_COLUMN in table.columns else None
    if not site_column:
        return None
    if site_column not in table.columns:
        raise DataError(
            f"site column {site_column!r} not found in {csv_path}; columns: {list(table.columns)}"
        )
    return site_column


def _text(table: pd.DataFrame, column: str) -> list[str | None]:
    """Column values as stripped strings, ``None`` where empty."""
    import pandas as pd

    return [
        None if pd.isna(v) or not str(v).strip() else str(v).strip()
        for v in table[column].to_numpy(dtype=object)
    ]


def _parse_rows(table: pd.DataFrame, csv_path: Path, site_column: str | None) -> _Rows:
    """Detect the layout of ``table`` and extract ids, label names, sites and groups."""
    import pandas as pd

    columns = list(table.columns)
    split_column = next((c for c in columns if c.lower() == _SPLIT_COLUMN), None)
    reserved = {_ISIC_ID, _GROUP_COLUMN, site_column, split_column}
    one_hot = [c for c in columns if c not in reserved and not c.startswith("Unnamed: ")]
    if _ISIC_ID in columns and one_hot and all(pd.api.types.is_numeric_dtype(table[c]) for c in one_hot):
        ids = _text(table, _ISIC_ID)
        csv_classes = one_hot
        labels, problems = _one_hot_labels(table, one_hot)
    elif _HAM_ID in columns and _HAM_LABEL in columns:
        ids = _text(table, _HAM_ID)
        csv_classes, labels = None, _text(table, _HAM_LABEL)
        problems = {i: f"empty {_HAM_LABEL!r}" for i, v in enumerate(labels) if v is None}
    else:
        raise DataError(_layout_error(table, csv_path, one_hot))
    for i, v in enumerate(ids):
        if v is None:
            problems.setdefault(i, "empty image id")
    sites = None if site_column is None else _text(table, site_column)
    for i, v in enumerate(sites or []):
        if v is None:
            problems.setdefault(i, f"empty site column {site_column!r}")
    groups = _text(table, _GROUP_COLUMN) if _GROUP_COLUMN in columns else None
    splits = None
    if split_column is not None:
        values = _text(table, split_column)
        splits = [_split_code(v) for v in values]
        for i in (i for i, code in enumerate(splits) if code is None):
            problems.setdefault(i, f"{split_column!r} is {values[i]!r}, expected train, val or test")
    return _Rows(
        csv_classes=csv_classes,
        ids=ids,
        labels=labels,
        problems=problems,
        sites=sites,
        groups=groups,
        splits=splits,
    )


def _one_hot_labels(table: pd.DataFrame, columns: list[str]) -> tuple[list[str | None], dict[int, str]]:
    """Label name of each one-hot row; rows without exactly one 1 (rest 0) are problems."""
    values = table[columns].to_numpy(dtype=np.float64)
    valid = np.isin(values, (0.0, 1.0)).all(axis=1) & ((values == 1.0).sum(axis=1) == 1)
    winners = values.argmax(axis=1)
    labels = [columns[w] if ok else None for w, ok in zip(winners, valid)]
    problems = {
        int(i): "expected exactly one 1.0 among the class columns, got "
        + ", ".join(f"{c}={v:g}" for c, v in zip(columns, values[i]))
        for i in np.flatnonzero(~valid)
    }
    return labels, problems


def _layout_error(table: pd.DataFrame, csv_path: Path, one_hot: list[str]) -> str:
    import pandas as pd

    msg = (
        f"unrecognised CSV layout in {csv_path}: found columns {list(table.columns)}; "
        f"expected {_ISIC_ID!r} + one-hot numeric class columns (ISIC 2019 ground truth) "
        f"or {_HAM_ID!r} + {_HAM_LABEL!r} (HAM10000 metadata)"
    )
    text = [c for c in one_hot if not pd.api.types.is_numeric_dtype(table[c])]
    if _ISIC_ID in table.columns and text:
        msg += (
            f"; non-numeric columns {text} cannot be one-hot classes "
            "(if one holds sites, pass site_column=<its name>)"
        )
    return msg


def _index_by_stem(files: Sequence[Path]) -> dict[str, Path]:
    """Map file name without extension to path; on duplicates the first path (sorted) wins."""
    index: dict[str, Path] = {}
    dupes = 0
    for p in files:
        if p.stem in index:
            dupes += 1
        else:
            index[p.stem] = p
    if dupes:
        logger.warning(
            "%d image files share a name with another file; using the first path "
            "of each name in sorted order",
            dupes,
        )
    return index


def _find_image(image_id: str, index: dict[str, Path]) -> Path | None:
    """The file of ``image_id``, also accepting ids written with an image extension."""
    if image_id in index:
        return index[image_id]
    if _has_ext(image_id, CSV_IMAGE_EXTENSIONS):
        return index.get(Path(image_id).stem)
    return None


def _csv_listing(
    rows: _Rows,
    wanted: list[str] | None,
    index: dict[str, Path],
    csv_path: Path,
    image_dir: Path,
    skip_bad: bool,
) -> _Listing:
    """Match rows to image files; report bad rows, then missing images."""
    n = len(rows.ids)
    if wanted is not None:
        classes = wanted
    elif rows.csv_classes is not None:
        classes = rows.csv_classes
    else:
        classes = sorted({v for v in rows.labels if v is not None})
    labels, unknown = _label_indices([v or "" for v in rows.labels], classes)

    def where(i: int) -> str:
        return f"line {_line(i)} (image {rows.ids[i]!r})"

    if wanted is not None and not skip_bad:  # each unlisted label once, not each of its rows
        unlisted = [
            (rows.labels[i], where(i))
            for i in np.flatnonzero(unknown)
            if i not in rows.problems and rows.labels[i]
        ]
        if unlisted:
            raise unknown_classes(unlisted, classes, f"labels in {csv_path}")

    problems = dict(rows.problems)
    for i in np.flatnonzero(unknown):
        problems.setdefault(int(i), f"label {rows.labels[i]!r} is not in the classes {classes}")
    skipped = _raise_or_skip(
        [(where(i), why) for i, why in sorted(problems.items())],
        skip_bad,
        f"bad rows in {csv_path}",
        prefix=f"{csv_path} ",
    )

    paths = [None if i in problems else _find_image(rows.ids[i], index) for i in range(n)]
    missing = [i for i in range(n) if i not in problems and paths[i] is None]
    exts = "/".join(CSV_IMAGE_EXTENSIONS)
    header = (
        f"images listed in {csv_path} not found in {image_dir} (searched recursively "
        f"for <id>{exts}; {len(index)} image files there)"
    )
    skipped += _raise_or_skip(
        [(where(i), "no such file") for i in missing], skip_bad, header, prefix=f"{csv_path} "
    )

    keep = np.asarray([i for i in range(n) if paths[i] is not None], dtype=np.int64)
    if keep.size == 0:
        raise DataError(f"no usable rows in {csv_path} ({len(skipped)} skipped)")
    sites, site_names = None, []
    if rows.sites is not None:
        site_names, sites = _encode([rows.sites[i] for i in keep])
    groups = None
    if rows.groups is not None:
        groups = _group_codes([rows.groups[i] for i in keep])
    splits = None if rows.splits is None else np.asarray([rows.splits[i] for i in keep], dtype=np.int64)
    return _Listing(
        paths=[paths[i] for i in keep],
        labels=labels[keep],
        classes=classes,
        sites=sites,
        site_names=site_names,
        groups=groups,
        skipped=skipped,
        splits=splits,
    )
