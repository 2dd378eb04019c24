"""GGUF models other apps already downloaded: LM Studio's model folders and Ollama's store.

LM Studio keeps plain `.gguf` files under `<root>/<publisher>/<repo>/`. Ollama keeps
content-addressed blobs (`blobs/sha256-<hex>`, no extension) behind JSON manifests under
`manifests/<registry>/<namespace>/<name>/<tag>`; the manifest's model layer names the blob,
so the list shows `name:tag`, never the hash.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
OLLAMA_REGISTRY = "registry.ollama.ai"
LMSTUDIO_DEPTH = 4  # publisher/repo/file, plus one level of slack for older layouts


@dataclass(frozen=True)
class FoundModel:
    """A GGUF file found in another app's model folder."""

    app: str  # "LM Studio" | "Ollama"
    name: str  # what that app calls it: "publisher/repo/file.gguf" or Ollama's "name:tag"
    path: Path  # the GGUF file itself (what --model takes)
    size: int  # bytes on disk


@dataclass(frozen=True)
class ModelFolders:
    """Where to look; the defaults are each app's usual places on this machine."""

    lmstudio: tuple[Path, ...] = ()  # LM Studio download folders
    ollama: tuple[Path, ...] = ()  # Ollama model stores (holding manifests/ and blobs/)

    @classmethod
    def default(cls, home: Path | None = None) -> ModelFolders:
        home = home or Path.home()
        ollama = [Path(os.environ["OLLAMA_MODELS"])] if os.environ.get("OLLAMA_MODELS") else []
        ollama += [home / ".ollama" / "models", Path("/usr/share/ollama/.ollama/models")]
        lmstudio = [home / ".lmstudio" / "models", home / ".cache" / "lm-studio" / "models"]
        return cls(tuple(lmstudio), tuple(ollama))


def find_models(folders: ModelFolders | None = None) -> list[FoundModel]:
    """Every GGUF model in the folders that exist, LM Studio's first, each sorted by name."""
    folders = folders or ModelFolders.default()
    found: list[FoundModel] = []
    for roots, scan in ((folders.lmstudio, _lmstudio), (folders.ollama, _ollama)):
        for root in _existing(roots):
            found += sorted(scan(root), key=lambda m: m.name.lower())
    return found


def _existing(roots: tuple[Path, ...]) -> list[Path]:
    """The folders of `roots` that exist, each once (of two paths to one folder, the first)."""
    found: dict[Path, Path] = {}  # resolved -> as given
    for root in roots:
        try:
            if root.is_dir():
                found.setdefault(root.resolve(), root)
        except OSError:  # unreadable (another user's folder): not ours to list
            continue
    return list(found.values())


def _lmstudio(root: Path) -> list[FoundModel]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        depth = len(Path(dirpath).relative_to(root).parts)
        if depth >= LMSTUDIO_DEPTH:
            dirnames.clear()
        for name in filenames:
            if name.lower().endswith(".gguf"):
                path = Path(dirpath) / name
                out.append(FoundModel("LM Studio", path.relative_to(root).as_posix(), path,
                                      path.stat().st_size))
    return out


def _ollama(root: Path) -> list[FoundModel]:
    manifests = root / "manifests"
    out = []
    for manifest in sorted(p for p in manifests.rglob("*") if p.is_file()):
        blob = _model_blob(manifest, root)
        if blob is not None:
            out.append(FoundModel("Ollama", ollama_name(manifest.relative_to(manifests)), blob,
                                  blob.stat().st_size))
    return out


def _model_blob(manifest: Path, root: Path) -> Path | None:
    """The model layer's blob of a manifest, when the manifest and the blob are sound."""
    try:
        layers = json.loads(manifest.read_text(encoding="utf-8")).get("layers", [])
        digest = next(layer["digest"] for layer in layers
                      if layer.get("mediaType") == OLLAMA_MODEL_LAYER)
    except (OSError, ValueError, AttributeError, KeyError, StopIteration, TypeError):
        log.info("skipping %s: not an Ollama model manifest", manifest)
        return None
    blob = root / "blobs" / str(digest).replace(":", "-")
    return blob if blob.is_file() else None


def ollama_name(relative: Path) -> str:
    """manifests/registry.ollama.ai/library/llama3.2/1b -> "llama3.2:1b", as `ollama list`
    shows it; other namespaces and registries keep their prefix."""
    parts = relative.parts
    if len(parts) < 4:
        return relative.as_posix()
    *prefix, name, tag = parts
    if prefix[0] == OLLAMA_REGISTRY:
        prefix = prefix[1:]
        if prefix == ["library"]:
            prefix = []
    return "/".join([*prefix, name]) + f":{tag}"
