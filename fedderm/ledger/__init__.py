"""The claims ledger that checks itself: raw run records in the repository, tables and figures
generated from them, and a verifier that recomputes every number the docs print.

    python -m fedderm.ledger import DIR --sweep-file sweeps/claims/x.toml   # a sweep folder -> records
    python -m fedderm.ledger render                                        # regenerate docs blocks + plots
    python -m fedderm.ledger verify                                        # fail on any drift

* :mod:`fedderm.ledger.records`: one compact JSON record per run (config, seed, commit, machine,
  torch version, per-round validation metrics, final test metrics; no predictions, no models) under
  ``ledger/records/<sweep id>/``, imported from a ``sim.py --sweep`` / ``bench.sweep_pool`` folder.
* :mod:`fedderm.ledger.sources`: a sweep's numbers from its records, or, for runs recorded nowhere,
  from the table a page printed (marked *unrecorded* with its commit wherever it appears).
* :mod:`fedderm.ledger.stats`: paired differences, the power arithmetic and the four-way verdict.
* :mod:`fedderm.ledger.claims`: the claims registry (``ledger/claims.toml``: each comparison, the
  paper's effect and where it is from) and the verdicts.
* :mod:`fedderm.ledger.docs`: the ``<!--L ...-->`` markers in the docs, render and verify;
  :mod:`fedderm.ledger.fmt` how numbers are written.
"""

from __future__ import annotations

from pathlib import Path


class LedgerError(ValueError):
    """Bad ledger input or a failed check; the message names the file, the key or the marker."""


def default_root() -> Path:
    """The repository root: the current directory when it holds ``ledger/``, else this package's."""
    cwd = Path.cwd()
    if (cwd / "ledger").is_dir():
        return cwd
    return Path(__file__).resolve().parents[2]
