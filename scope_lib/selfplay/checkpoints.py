"""Mid-stage resume of a GRPO stage (`run.checkpoint_steps`, docs/runs.md).

Every `run.checkpoint_steps` optimiser steps the trainer writes `iter_NN/<role>/trainer/checkpoint-<k>/`: the
role's weights (our `Policy.save`: only the role being trained, never the other adapter), the optimiser,
scheduler and RNG states and the trainer state (transformers' own files). When everything is written, a
marker `scope_checkpoint.json` records the sha256 of each file; a checkpoint without a valid marker (a kill
during the save, a damaged file) is skipped. A stage killed after step k resumes from the newest complete
checkpoint: the role's weights are put back, transformers restores the optimiser, scheduler and RNG and skips
the k batches already trained, and the stage's records of later steps are dropped and redone. The final
weights equal an uninterrupted run's (tests/test_resume.py: bit-identical on CPU).
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

from scope_lib.runs import atomic_write_json, folder_checksums, sha256_file

log = logging.getLogger(__name__)

MARKER = "scope_checkpoint.json"


def checkpoint_step(folder: str | os.PathLike) -> int:
    match = re.fullmatch(r"checkpoint-(\d+)", Path(folder).name)
    return int(match.group(1)) if match else -1


def latest_checkpoint(trainer_dir: str | os.PathLike) -> Path | None:
    """The newest complete, undamaged checkpoint under a stage's trainer folder (None if there is none)."""
    folders = sorted(Path(trainer_dir).glob("checkpoint-*"), key=checkpoint_step, reverse=True)
    for folder in folders:
        try:
            checksums = json.loads((folder / MARKER).read_text())["checksums"]
        except (OSError, ValueError, KeyError, TypeError):
            log.warning("%s: incomplete (no %s; the process died while saving it): skipped", folder, MARKER)
            continue
        bad = [name for name, digest in checksums.items()
               if not (folder / name).is_file() or sha256_file(folder / name) != digest]
        if bad:
            log.warning("%s: %s does not match its checksum: checkpoint skipped", folder, bad[0])
            continue
        return folder
    return None


def marker_callback():
    """A TrainerCallback that seals each checkpoint transformers has finished writing with its checksums."""
    from transformers import TrainerCallback

    class SealCheckpoint(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            if folder.is_dir():
                atomic_write_json(folder / MARKER, {"step": state.global_step,
                                                    "checksums": folder_checksums(folder, folder)})

    return SealCheckpoint()


def role_folder(checkpoint: str | os.PathLike) -> Path:
    """Where `Policy.save` put the role's weights inside a checkpoint."""
    checkpoint = Path(checkpoint)
    return checkpoint / "adapter" if (checkpoint / "adapter").is_dir() else checkpoint / "model"
