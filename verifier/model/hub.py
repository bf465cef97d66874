"""A model folder from a local path or a Hugging Face Hub id, found as transformers finds one.

A path that exists is used as it is. Anything else that reads as a Hub id (``ORG/NAME`` or ``NAME``) goes through
``huggingface_hub.snapshot_download``: downloaded into the Hugging Face cache where the network allows, read from
that cache offline (``HF_HUB_OFFLINE=1``, or ``local_files_only``). Only the files a model folder needs come down:
the configs, tokenizer files and the safetensors weights, or ``pytorch_model.bin`` when the repository has no
safetensors (as mamba_ssm's own checkpoints).
"""

from __future__ import annotations

import os
from pathlib import Path

_FOLDER_FILES = ["*.json", "tokenizer*", "model.safetensors", "model-*-of-*.safetensors"]
_BIN_FILES = ["pytorch_model.bin"]
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


def is_hub_id(name: str) -> bool:
    """Whether ``name`` has the shape of a Hugging Face Hub repository id."""
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except ValueError:
        return False
    return True


def resolve_model_dir(name: str | os.PathLike, revision: str | None = None,
                      local_files_only: bool = False) -> Path:
    """The local folder holding model ``name``: the path itself when it exists, else the Hub id's snapshot.

    A FileNotFoundError says which of the two failed and why (no such folder; offline and not in the cache; no
    such repository; the network unreachable).
    """
    path = Path(name).expanduser()
    if path.exists():
        return path
    text = os.fspath(name)
    if not is_hub_id(text):
        raise FileNotFoundError(f"{text}: checkpoint directory does not exist")
    return _snapshot(text, revision, local_files_only)


def _snapshot(repo_id: str, revision: str | None, local_files_only: bool) -> Path:
    from huggingface_hub import constants, snapshot_download

    offline = local_files_only or constants.HF_HUB_OFFLINE
    try:
        folder = Path(snapshot_download(repo_id, revision=revision, allow_patterns=_FOLDER_FILES,
                                        local_files_only=local_files_only))
        if not any((folder / w).exists() for w in _WEIGHT_FILES):
            folder = Path(snapshot_download(repo_id, revision=revision, allow_patterns=_BIN_FILES,
                                            local_files_only=local_files_only))
    except Exception as exc:  # huggingface_hub's errors: offline miss, no such repo, gated, network down
        if offline:
            how = ("offline (local_files_only=True)" if local_files_only else "offline (HF_HUB_OFFLINE is set)")
            reason = (f"{how}, and the Hugging Face cache ({constants.HF_HUB_CACHE}) has no snapshot of it; "
                      "download it once with network access, or give a local folder")
        else:
            reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'no detail'}"
        raise FileNotFoundError(f"{repo_id!r} is neither a local folder nor a Hugging Face Hub model that could be "
                                f"fetched: {reason}") from exc
    return folder


class ModelFolder(str):
    """A model folder's local path (a ``str``) that remembers what was asked for: a path or a Hub id."""

    requested: str

    def __new__(cls, folder: str | os.PathLike, requested: str | None = None) -> "ModelFolder":
        obj = super().__new__(cls, os.fspath(folder))
        obj.requested = os.fspath(folder) if requested is None else requested
        return obj

    def __reduce__(self):
        return ModelFolder, (str(self), self.requested)

    @property
    def display_name(self) -> str:
        """The Hub id when one was asked for, else the folder's name (a served model's default id)."""
        return self.requested if self.requested != os.fspath(self) and is_hub_id(self.requested) else Path(self).name


def model_folder_arg(value: str) -> ModelFolder:
    """``argparse`` type of a command-line model argument (a folder or a Hub id); when neither works, an
    ``ArgumentTypeError``, which argparse reports with the argument's name."""
    import argparse

    try:
        return ModelFolder(resolve_model_dir(value), value)
    except FileNotFoundError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
