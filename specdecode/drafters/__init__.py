"""Drafters: `none` (normal decoding), `ngram`, `draft-model`, the shipped `default`, and trained drafters
loaded from a folder."""

from pathlib import Path

from specdecode.drafters.base import Drafter, Proposal, TargetFeatures
from specdecode.errors import SpecDecodeError
from specdecode.models.target import Target

BUILTIN_DRAFTERS = ("default", "none", "ngram", "draft-model")

__all__ = ["BUILTIN_DRAFTERS", "Drafter", "Proposal", "TargetFeatures", "build_drafter"]


def build_drafter(spec: str, target: Target, draft_model: str | None = None) -> Drafter:
    """Make the drafter named by `spec` for `target`; `default` is the shipped drafter, else `ngram`."""
    if spec == "default":
        from specdecode.drafters.shipped import shipped_drafter

        shipped = shipped_drafter(target.name)
        spec = str(shipped) if shipped else "ngram"
    if spec == "none":
        return Drafter()
    if spec == "ngram":
        from specdecode.drafters.ngram import NgramDrafter

        return NgramDrafter()
    if spec == "draft-model":
        from specdecode.drafters.draft_model import DraftModelDrafter

        return DraftModelDrafter(target, draft_model)
    if Path(spec).expanduser().is_dir():
        from specdecode.drafters.checkpoint import load_drafter

        return load_drafter(Path(spec).expanduser(), target)
    raise SpecDecodeError(
        f"unknown drafter '{spec}'; choose one of {', '.join(BUILTIN_DRAFTERS)} or a trained drafter's folder"
    )
