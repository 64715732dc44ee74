"""Training losses; each follows :class:`~nemo_rl.algorithms.loss.interfaces.LossFunction`."""

from nemo_rl.algorithms.loss.clipped_pg import ClippedPGLossConfig, ClippedPGLossFn
from nemo_rl.algorithms.loss.distillation import DistillationLossConfig, DistillationLossFn
from nemo_rl.algorithms.loss.dpo import DPOLossConfig, DPOLossFn
from nemo_rl.algorithms.loss.draft import DraftCrossEntropyLoss
from nemo_rl.algorithms.loss.interfaces import LossFunction, LossInputType, LossType
from nemo_rl.algorithms.loss.nll import NLLLoss
from nemo_rl.algorithms.loss.preference import PreferenceLossFn
from nemo_rl.algorithms.loss.value import MseValueLossConfig, MseValueLossFn

__all__ = [
    "ClippedPGLossConfig",
    "ClippedPGLossFn",
    "DPOLossConfig",
    "DPOLossFn",
    "DistillationLossConfig",
    "DistillationLossFn",
    "DraftCrossEntropyLoss",
    "LossFunction",
    "LossInputType",
    "LossType",
    "MseValueLossConfig",
    "MseValueLossFn",
    "NLLLoss",
    "PreferenceLossFn",
]
