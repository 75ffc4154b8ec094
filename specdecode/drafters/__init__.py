"""Drafters: `none` (normal decoding), `ngram`, `suffix`, `draft-model`, trained drafters loaded from a
folder (ours, or a DFlash/DSpark folder in vLLM's format), `suffix+FOLDER` (a hybrid), and `default`: the
hybrid of suffix decoding and the target's shipped drafter, or suffix decoding alone for a target that
ships none."""

from pathlib import Path

from specdecode.drafters.base import Drafter, Proposal, TargetFeatures
from specdecode.errors import SpecDecodeError
from specdecode.models.target import Target

BUILTIN_DRAFTERS = ("default", "none", "ngram", "suffix", "draft-model")
HYBRID_PREFIX = "suffix+"

__all__ = ["BUILTIN_DRAFTERS", "Drafter", "Proposal", "TargetFeatures", "build_drafter"]


def build_drafter(spec: str, target: Target, draft_model: str | None = None) -> Drafter:
    """Make the drafter named by `spec` for `target` (see the module docstring for the names)."""
    if spec == "default":
        from specdecode.drafters.shipped import shipped_drafter

        shipped = shipped_drafter(target.name)
        spec = f"{HYBRID_PREFIX}{shipped}" if shipped else "suffix"
    if spec.startswith(HYBRID_PREFIX) and spec != HYBRID_PREFIX:
        from specdecode.drafters.hybrid import HybridDrafter

        return HybridDrafter(build_drafter(spec[len(HYBRID_PREFIX) :], target, draft_model))
    if spec == "none":
        return Drafter()
    if spec == "ngram":
        from specdecode.drafters.ngram import NgramDrafter

        return NgramDrafter()
    if spec == "suffix":
        from specdecode.drafters.suffix import SuffixDrafter

        return SuffixDrafter()
    if spec == "draft-model":
        from specdecode.drafters.draft_model import DraftModelDrafter

        return DraftModelDrafter(target, draft_model)
    folder = Path(spec).expanduser()
    if folder.is_dir():
        from specdecode.drafters.block_export import is_engine_folder, load_engine_drafter
        from specdecode.drafters.checkpoint import load_drafter

        return load_engine_drafter(folder, target) if is_engine_folder(folder) else load_drafter(folder, target)
    raise SpecDecodeError(
        f"unknown drafter '{spec}'; choose one of {', '.join(BUILTIN_DRAFTERS)}, a trained drafter's folder, "
        f"or {HYBRID_PREFIX}<one of those> for a hybrid with suffix decoding"
    )
