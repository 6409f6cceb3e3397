"""What is checked before a checkpoint loads: that it is of this model, this precision and this optimizer -- each
mismatch refused naming what differs and what to pass -- and which of its hyper-parameters replace this run's."""
from __future__ import annotations

from pathlib import Path

from .files import CheckpointError


def unverified(manifest: dict) -> list[str]:
    return [manifest["unverified"]] if "unverified" in manifest else []


def check_optimizer(manifest: dict, directory: Path, mine: type) -> None:
    """Another optimizer class would load state it does not understand: AdamW's moments into SGD ran on with
    the checkpoint's lr and no momentum, silently, under ZeRO, and failed with KeyError under ddp."""
    theirs = manifest["optimizer"].get("class")
    if theirs is not None and theirs != mine.__name__:  # (format version 1 did not record it)
        raise CheckpointError(f"{directory}: saved with optimizer {theirs}, this run's is {mine.__name__}; build "
                              f"the optimizer the saved run used ({theirs}), or take only the model, from a "
                              f"consolidated checkpoint's 'model'")


def settings_followed(stage, saved: dict) -> list[str]:
    """What the checkpoint's hyper-parameters replace in this run's optimizer, as torch's
    ``Optimizer.load_state_dict`` does (a scheduler's learning rate is state): followed, and said."""
    notes = []
    for i, (group, theirs) in enumerate(zip(stage.optimizer.param_groups, saved["param_groups"], strict=True)):
        for key, value in theirs.items():
            if key != "params" and key in group and group[key] != value:
                notes.append(f"optimizer group {i}: {key} {value!r} from the checkpoint replaces this run's "
                             f"{group[key]!r} (as torch's load_state_dict does)")
    return notes


def check_fits(manifest: dict, directory: Path, mine: dict, precision: str) -> None:
    if manifest["precision"] != precision:
        raise CheckpointError(f"{directory}: saved with precision {manifest['precision']}, this run uses "
                              f"{precision}; resume with --precision {manifest['precision']} (a run "
                              f"cannot change precision while resuming)")
    for name in [*mine, *(n for n in manifest["state"] if n not in mine)]:
        theirs, ours = manifest["state"].get(name), mine.get(name)
        if theirs is None or ours is None or tuple(theirs[0]) != tuple(ours[0]) or theirs[1] != ours[1]:
            raise CheckpointError(
                f"{directory}: a checkpoint of another model: '{name}' is {_describe(theirs)} in the checkpoint "
                f"and {_describe(ours)} in this model; resume with the --model it was saved with")


def _describe(entry) -> str:
    return "absent" if entry is None else f"{entry[1].replace('torch.', '')} {list(entry[0])}"
