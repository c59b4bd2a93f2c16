"""Paired differences, what an experiment could detect, and the four-way verdict.

A comparison's evidence is the paired difference d_i = x_i − r_i over the n seeds both arms ran,
its mean and the 95 % t-interval mean ± t_{.975, n−1}·SD/√n
(:func:`fedderm.sweep_tables.paired_difference`, the same code the sweep tables use).

**Detectable effect.** The ledger uses one definition: the true paired effect that a two-sided
paired t-test at α = 0.05 detects with 80 % power, approximately
(t_{.975, n−1} + t_{.80, n−1})·SD/√n, with SD the observed SD of the paired differences.  With
n = 3 that is 5.37·SD/√3 ≈ 3.1·SD; the interval's half-width is 4.30·SD/√3 ≈ 2.5·SD.

**Verdict** against the paper's effect e (signed, in the direction the paper claims, in points):

* *reproduced*: the interval excludes 0 on e's side;
* *contradicted*: the interval excludes 0 on the other side;
* *smaller than the paper's*: the interval contains 0 but not e;
* *underpowered*: the interval contains both 0 and e;
* *not tested*: fewer than 2 pairs (no interval), or the paper gives only a direction (a figure
  without numbers) and the interval contains 0.

Interval ends are inclusive: an end at exactly 0 (or e) contains it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

#: two-sided level of every interval the ledger prints
LEVEL = 0.95
#: power at which the detectable effect is stated
POWER = 0.80

REPRODUCED = "reproduced"
CONTRADICTED = "contradicted"
SMALLER = "smaller than the paper's"
UNDERPOWERED = "underpowered"
NOT_TESTED = "not tested"
VERDICTS = (REPRODUCED, CONTRADICTED, SMALLER, UNDERPOWERED, NOT_TESTED)


def t_quantile(p: float, df: int) -> float:
    from scipy.stats import t

    return float(t.ppf(p, df))


def half_width(sd: float, n: int, level: float = LEVEL) -> float:
    """Half-width of the paired t-interval: t_{(1+level)/2, n−1}·SD/√n."""
    return t_quantile(0.5 + level / 2, n - 1) * sd / math.sqrt(n)


def detectable_effect(sd: float | None, n: int, level: float = LEVEL, power: float = POWER) -> float | None:
    """(t_{(1+level)/2, n−1} + t_{power, n−1})·SD/√n: the paired effect detected with ``power``
    by a two-sided test at 1 − ``level`` (the usual normal-shift approximation with t quantiles);
    None without an SD (n < 2)."""
    if sd is None or n < 2:
        return None
    return (t_quantile(0.5 + level / 2, n - 1) + t_quantile(power, n - 1)) * sd / math.sqrt(n)


def verdict(ci: Sequence[float] | None, paper_effect: float | None, direction: int | None = None) -> str:
    """The four-way verdict of an interval ``ci`` = (low, high) against the paper's signed effect.

    ``direction`` (+1 or −1) is the paper's side when it gives no size (``paper_effect`` None: a
    figure without numbers); then an interval that contains 0 is *not tested* (neither smaller nor
    underpowered can be told)."""
    if ci is None:
        return NOT_TESTED
    low, high = ci
    if low > high:
        raise ValueError(f"interval {ci}: low end above high end")
    if paper_effect is not None:
        if paper_effect == 0:
            raise ValueError("a paper effect of 0 has no direction")
        direction = 1 if paper_effect > 0 else -1
    if direction not in (1, -1):
        raise ValueError("give the paper's effect or its direction (+1 or -1)")
    if low > 0 or high < 0:
        side = 1 if low > 0 else -1
        return REPRODUCED if side == direction else CONTRADICTED
    if paper_effect is None:
        return NOT_TESTED
    return UNDERPOWERED if low <= paper_effect <= high else SMALLER


#: how a claim's comparisons combine when not all are reproduced: the verdicts checked in order, the
#: first one present wins.  ``underpowered-first`` (the default): any comparison this experiment
#: could not tell leaves the claim open.  ``smaller-first``: a comparison that rules out the paper's
#: effect decides before one that cannot tell (the rule some sweep files pre-register).
COMBINE_RULES = {
    "underpowered-first": (CONTRADICTED, UNDERPOWERED, NOT_TESTED, SMALLER),
    "smaller-first": (CONTRADICTED, SMALLER, UNDERPOWERED, NOT_TESTED),
}


def combine(verdicts: Sequence[str], rule: str = "underpowered-first") -> str:
    """A claim made of several comparisons that must all hold (e.g. "above every baseline"):
    reproduced when every one is, contradicted when any is; else, by ``rule``
    (:data:`COMBINE_RULES`), underpowered when any is (the experiment could not tell), else not
    tested when any is, else smaller than the paper's; or, ``smaller-first``, smaller than the
    paper's when any is, else underpowered, else not tested."""
    if rule not in COMBINE_RULES:
        raise ValueError(f"combine rule {rule!r}: one of {', '.join(COMBINE_RULES)}")
    if not verdicts:
        return NOT_TESTED
    if all(v == REPRODUCED for v in verdicts):
        return REPRODUCED
    for v in COMBINE_RULES[rule]:
        if v in verdicts:
            return v
    raise ValueError(f"unknown verdicts among {list(verdicts)}")


def expected_false_exclusions(n_intervals: int, level: float = LEVEL) -> float:
    """How many of ``n_intervals`` independent intervals exclude 0 by chance when no effect exists."""
    return n_intervals * (1 - level)
