"""FedMoCo (000 §V baseline, Fig. 6 "W/o FE"): FedCLF's local MoCo averaged by FedAvg, with
no feature relay — identical to ``method="fedclf"`` with ``fedclf.feature-sharing=false``."""

from . import fedclf


def build_strategy(cfg, recorder) -> fedclf.FedCLFStrategy:
    return fedclf.build_strategy(cfg, recorder, feature_sharing=False)


def run(grid, cfg, recorder, classes) -> None:
    fedclf.run(grid, cfg, recorder, classes, feature_sharing=False)
