"""Continue training from the stored accelerator instead of starting from nothing.

The pipeline loads the method's checkpoint for this model (engine.drafters.accelerators refuses one
built for another model, a newer format or a corrupt file) into a Resume; each method's
trainer then calls start_from on every module it builds, right after building it fresh.
Where the stored tensors do not fit the new module (another head count, another layout)
the module keeps its fresh start and the run says so in one line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.drafters.accelerators import load_checkpoint
from engine.errors import AcceleratorError
from engine.progress import Progress, ProgressFn, ignore


@dataclass
class Resume:
    """The checkpoint a continued run starts from, and what each module made of it."""

    folder: Path  # the checkpoint folder (left untouched until the new one is saved)
    tensors: dict[str, torch.Tensor]  # its safetensors, by checkpoint name, on the CPU
    settings: dict  # its drafter.json settings (e.g. Kangaroo's exit_layer)
    # one line per module start_from saw: "continued ..." or why it started fresh
    outcomes: list[str] = field(default_factory=list)

    @property
    def continued(self) -> int:
        """How many modules started from the stored weights."""
        return sum(line.startswith("continued") for line in self.outcomes)


def load_resume(lm, method: str) -> tuple[Resume | None, str]:
    """(the stored `method` checkpoint of `lm`, "") or (None, why training starts fresh)."""
    try:
        ckpt = load_checkpoint(lm, method)
    except AcceleratorError as exc:
        return None, f"starting fresh: {exc}"
    return Resume(ckpt.folder, ckpt.tensors, ckpt.info.get("settings", {})), ""


def start_from(module: torch.nn.Module, options, progress: ProgressFn = ignore,
               prefix: str = "", fresh: tuple[str, ...] = (), **settings) -> bool:
    """Load options.resume's tensors named `prefix` + a state_dict key into `module`.

    Every parameter must be stored with its shape, and the checkpoint's settings must equal
    `settings` (e.g. exit_layer=2: an adapter trained for another exit reads other states);
    otherwise the module keeps its fresh start and a one-line notice says why. Buffers (e.g.
    a draft vocabulary) are loaded where their shape matches and kept fresh where it does
    not, so tensors indexed by a stored buffer stay aligned with it; `fresh` names buffers
    the module keeps from its fresh start (e.g. a draft vocabulary chosen from the new data
    that no parameter is aligned to). Returns True when the module continues from the
    stored weights; False (silently) when nothing is resumed.
    """
    resume: Resume | None = options.resume
    if resume is None:
        return False
    why = _mismatch(module, resume, prefix, settings)
    if why:
        line = f"{prefix.rstrip('.') or 'module'} starts fresh: {why}"
        resume.outcomes.append(line)
        progress(Progress("train", 0, 1, line))
        return False
    state = module.state_dict()
    with torch.no_grad():
        for name, value in state.items():
            stored = None if name in fresh else resume.tensors.get(prefix + name)
            if stored is not None and stored.shape == value.shape:
                value.copy_(stored.to(value.dtype))  # state_dict values share the storage
    resume.outcomes.append(f"continued {prefix.rstrip('.') or 'module'} from {resume.folder}")
    return True


def _mismatch(module: torch.nn.Module, resume: Resume, prefix: str, settings: dict) -> str:
    """Why the stored weights cannot start `module` ("" when they can)."""
    for key, wanted in settings.items():
        if resume.settings.get(key) != wanted:
            return f"the stored one has {key} {resume.settings.get(key)!r}, this run {wanted!r}"
    for name, param in module.named_parameters():
        stored = resume.tensors.get(prefix + name)
        if stored is None:
            return f"the stored one has no {prefix + name}"
        if stored.shape != param.shape:
            return (f"the stored {prefix + name} has shape {tuple(stored.shape)}, "
                    f"this run {tuple(param.shape)}")
    return ""
