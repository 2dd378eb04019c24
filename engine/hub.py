"""The Hugging Face hub in one place: a repo's model folder (only what loading reads, never
pickles) or one of its files, from the ordinary Hugging Face cache when it is there,
downloaded into it otherwise; the hub client's errors become one-line ModelLoadErrors."""

from __future__ import annotations

from pathlib import Path

from engine.errors import ModelLoadError

# What a model folder download keeps: configs, safetensors weights, tokenizer files.
HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model", "*.txt"]


def cached(repo_id: str, filename: str | None = None,
           revision: str | None = None) -> Path | None:
    """The repo's folder (or `filename` in it) in the cache; None when it is not there or
    `repo_id` names no repo."""
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return _get(repo_id, filename, revision, local_files_only=True)
    except (LocalEntryNotFoundError, OSError, ValueError):
        return None


def fetch(repo_id: str, filename: str | None = None, revision: str | None = None) -> Path:
    """The repo's folder (or `filename` in it), downloaded into the cache unless it is there."""
    return cached(repo_id, filename, revision) or download(repo_id, filename, revision)


def download(repo_id: str, filename: str | None = None, revision: str | None = None,
             tqdm_class=None) -> Path:
    """Download the repo's folder (or `filename` in it) into the cache (`tqdm_class`
    reports the bytes; the default shows tqdm on stderr)."""
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    name = f"{repo_id}:{filename}" if filename else repo_id
    try:
        return _get(repo_id, filename, revision, tqdm_class=tqdm_class)
    except GatedRepoError as exc:
        raise ModelLoadError(f"{repo_id} is gated: accept its licence and log in") from exc
    except LocalEntryNotFoundError as exc:  # a subclass of EntryNotFoundError: first
        raise ModelLoadError(f"{name} is not in the Hugging Face cache and the hub cannot be "
                             "reached (offline?)") from exc
    except EntryNotFoundError as exc:
        raise ModelLoadError(f"{repo_id} has no file {filename!r}") from exc
    except (RepositoryNotFoundError, RevisionNotFoundError) as exc:
        raise ModelLoadError(f"no model {repo_id!r} on the Hugging Face hub") from exc
    except Exception as exc:  # network stacks raise many types; all mean the same here
        raise ModelLoadError(f"could not download {name}: {type(exc).__name__}: "
                             f"{exc}".splitlines()[0]) from exc


def _get(repo_id: str, filename: str | None, revision: str | None, **kwargs) -> Path:
    from huggingface_hub import hf_hub_download, snapshot_download

    if kwargs.get("tqdm_class") is None:
        kwargs.pop("tqdm_class", None)
    if filename is not None:
        return Path(hf_hub_download(repo_id=repo_id, filename=filename, revision=revision,
                                    **kwargs))
    return Path(snapshot_download(repo_id=repo_id, revision=revision,
                                  allow_patterns=HUB_PATTERNS, **kwargs))
