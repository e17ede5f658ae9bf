"""Is everything a run needs on this host? Checked once in the parent, before any run: a GPU host often has no
network, and without this check every run of a plan would fail on its own, one after another, minutes each.

- model: a random-weight builder (nothing to fetch), a local folder with config.json and weights, or a hub id whose
  config and weights are in the local Hugging Face cache;
- tokenizer: the random-weight builders use Llama's SentencePiece model shipped in `mistral-common` (or UTF-8 bytes
  when it is not installed: offline either way, and the record says which); a hub model's own tokenizer files;
- data: `auto` is what `workloads.local_text` finds (the Alpaca subset committed in `data/alpaca/`, data/README.md,
  then `../shared`'s texts), or a local file.

`allow_download=True` (reproduce/llama7b.py --allow-download) accepts a hub model or hub data that is not cached:
the runs then fetch it, as before.
"""

from __future__ import annotations

from pathlib import Path

from zenflow.harness.workloads import RANDOM_MODELS, REPO_ALPACA, local_text

WEIGHTS = ("*.safetensors", "*.bin", "*.pt")
TOKENIZER = ("tokenizer.json", "tokenizer.model")


def problem(model: str, data: str, allow_download: bool = False) -> str | None:
    """Why the runs could not find model, tokenizer or data on this host (one line), or None."""
    if model not in RANDOM_MODELS:
        missing = _model_missing(model)
        if missing and not allow_download:
            return (f"model {model!r}: {missing}; this host may have no network: pass a local folder, download it "
                    "first (huggingface-cli download), run the random-weight scenario (--shape llama2-7b), or let "
                    "the runs fetch it (--allow-download)")
    if data == "auto" and local_text() is None and not allow_download:
        return (f"--data auto: the Alpaca subset {REPO_ALPACA} is missing from this checkout; restore it (git "
                "checkout data/), pass --data PATH, or let the runs fetch Alpaca (--allow-download)")
    return None


def model_folder(model: str) -> Path | None:
    """Where a model's files are on this host: the local folder it names, or a hub id's snapshot in the local
    Hugging Face cache (never fetched); None when neither."""
    folder = Path(model).expanduser()
    return folder if folder.is_dir() else _cached_snapshot(model)


def _model_missing(model: str) -> str | None:
    """What of a hub id or local folder is not here, or None."""
    folder = model_folder(model)
    if folder is None:
        return "not a local folder and not in the local Hugging Face cache"
    if not (folder / "config.json").is_file():
        return f"{folder} has no config.json"
    if not any(any(folder.glob(pattern)) for pattern in WEIGHTS):
        return f"{folder} has no weights ({', '.join(WEIGHTS)})"
    if not any((folder / name).is_file() for name in TOKENIZER):
        return f"{folder} has no tokenizer ({' or '.join(TOKENIZER)})"
    return None


def _cached_snapshot(model: str) -> Path | None:
    """The snapshot folder of a hub id in the local cache (never fetched)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    cached = try_to_load_from_cache(model, "config.json")
    return Path(cached).parent if isinstance(cached, str) else None
