"""Workloads: a model, a tokenizer and a deterministic stream of token batches.

- `cpu-scale`: a Llama-architecture model built from `LlamaConfig` (random init), the real Llama SentencePiece
  tokenizer shipped in `mistral-common`, real Alpaca records (or tiny-shakespeare, or generated text).
- `llama2-7b-shape`: the same builder at Llama-2-7B's layer shapes (hidden 4096, intermediate 11008, 32 heads, vocab
  32000) with `layers` of them: random weights, no download (reproduce/llama7b.py --shape llama2-7b --layers N).
- anything else in `model`: a Hugging Face causal LM (hub id or local path) with its own tokenizer.

Data: `auto` reads the Alpaca records committed in `data/alpaca/` (so no host needs a network or `../shared`), then
`../shared`'s texts; `datasets` (`tatsu-lab/alpaca`) only for a hub model when neither exists.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

CHECKOUT = Path(__file__).resolve().parents[2]
REPO_ALPACA = CHECKOUT / "data" / "alpaca" / "alpaca_data_1k.json"  # travels with the checkout (data/README.md)
SHARED_TEXT = CHECKOUT.parent / "shared" / "data" / "text"
# Models built from LlamaConfig with random weights (no download): the workload's shape fields give the size.
RANDOM_MODELS = ("cpu-scale", "llama2-7b-shape")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Stanford Alpaca's prompt template (the DeepSpeedExamples Llama-2 fine-tuning uses the same records).
PROMPT = ("Below is an instruction that describes a task, paired with an input that provides further context. "
          "Write a response that appropriately completes the request.\n\n"
          "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n")
PROMPT_NO_INPUT = ("Below is an instruction that describes a task. Write a response that appropriately completes "
                   "the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n")


class WorkloadError(ValueError):
    """A workload that cannot be built (unknown dtype, missing data, a model that does not load)."""


@dataclass(frozen=True)
class Workload:
    model: str = "cpu-scale"     # one of RANDOM_MODELS, or a Hugging Face id / local path
    dtype: str = "bf16"
    seq_len: int = 32
    micro_batch: int = 1
    data: str = "auto"           # "auto", "synthetic", or a path to an Alpaca-format JSON / a text file
    seed: int = 1234
    device: str = "auto"         # "auto" (CUDA when available, else CPU), "cpu", "cuda[:N]": engines.resolve_device
    # cpu-scale model shape (≈58M parameters: 32k vocab x 512 embeddings and head, 8 layers)
    hidden: int = 512
    layers: int = 8
    intermediate: int = 1408
    heads: int = 8
    freeze_embedding: bool = False  # the input embedding is frozen in every engine (the exact N-layer variant)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise WorkloadError(f"workload.dtype = {self.dtype!r} is not allowed: expected one of {list(DTYPES)}")
        if not isinstance(self.device, str) or self.device.split(":")[0] not in ("auto", "cpu", "cuda"):
            raise WorkloadError(f"workload.device = {self.device!r} is not allowed: expected 'auto', 'cpu' or "
                                "'cuda[:N]'")
        for name in ("seq_len", "micro_batch", "hidden", "layers", "intermediate", "heads"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise WorkloadError(f"workload.{name} = {getattr(self, name)!r} is not allowed: expected an int >= 1")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def build_model(w: Workload) -> torch.nn.Module:
    """The model, seeded, in the workload dtype (input embedding frozen when the workload says so)."""
    torch.manual_seed(w.seed)
    if w.model in RANDOM_MODELS:
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(vocab_size=CPU_SCALE_VOCAB, hidden_size=w.hidden, intermediate_size=w.intermediate,
                             num_hidden_layers=w.layers, num_attention_heads=w.heads, num_key_value_heads=w.heads,
                             max_position_embeddings=max(512, w.seq_len), tie_word_embeddings=False)
        model = LlamaForCausalLM(config).to(w.torch_dtype)
    else:
        from transformers import AutoModelForCausalLM

        try:
            model = AutoModelForCausalLM.from_pretrained(w.model, dtype=w.torch_dtype)
        except (OSError, ValueError) as exc:
            raise WorkloadError(f"workload.model = {w.model!r} does not load as a causal LM: {exc}") from exc
    if w.freeze_embedding:  # every engine then neither offloads nor updates it (docs/llama7b-gpu.md)
        model.get_input_embeddings().weight.requires_grad_(False)
    return model


# The byte fallback of the cpu-scale tokenizer: ids 3..258 (0-2 are Llama's unk/bos/eos), inside Llama's vocabulary
# of 32,000, so the model's shape does not change.
CPU_SCALE_VOCAB, BYTE_EOS, BYTE_OFFSET = 32000, 2, 3


class Tokenizer:
    """encode(text) -> ids, plus eos; the cpu-scale one is Llama's SentencePiece model from mistral-common."""

    def __init__(self, w: Workload) -> None:
        if w.model in RANDOM_MODELS:
            try:
                import sentencepiece
                from mistral_common import __file__ as mc_file
            except ImportError as exc:  # a GPU host's own environment often lacks both: train on bytes, say so
                self.eos_id, self.vocab_size = BYTE_EOS, CPU_SCALE_VOCAB
                self.name = f"utf-8 bytes ({exc.name} not installed; the Llama tokenizer needs sentencepiece and " \
                            "mistral-common)"
                self.encode = lambda text: [BYTE_OFFSET + b for b in text.encode()]
                return
            path = Path(mc_file).parent / "data" / "tokenizer.model.v1"
            self._sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
            self.eos_id, self.vocab_size, self.name = self._sp.eos_id(), self._sp.get_piece_size(), str(path.name)
            self.encode = self._sp.encode
        else:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(w.model)
            self.eos_id, self.vocab_size, self.name = tok.eos_token_id, len(tok), w.model
            self.encode = lambda text: tok(text, add_special_tokens=True)["input_ids"]


def local_text() -> tuple[Path, str] | None:
    """What `--data auto` reads on this host, and how records name it: the committed Alpaca subset, else
    `../shared`'s texts; None when neither is here (local_inputs.py refuses that before any run)."""
    if REPO_ALPACA.exists():
        return REPO_ALPACA, str(REPO_ALPACA.relative_to(CHECKOUT))
    for candidate in (SHARED_TEXT / "alpaca" / "alpaca_data_200.json", SHARED_TEXT / "tinyshakespeare" / "input.txt"):
        if candidate.exists():
            return candidate, str(candidate.relative_to(SHARED_TEXT.parent.parent))
    return None


def load_texts(w: Workload) -> tuple[list[str], str]:
    """Training texts and where they came from (recorded, so a run says what it trained on)."""
    if w.data == "synthetic":
        return _generated_texts(w.seed), "generated"
    if w.data != "auto":
        return _texts_from(Path(w.data)), w.data
    local = local_text()
    if local is not None:
        return _texts_from(local[0]), local[1]
    if w.model not in RANDOM_MODELS:  # a hub model without local data: Alpaca from the hub
        from datasets import load_dataset

        records = load_dataset("tatsu-lab/alpaca", split="train")
        return [_alpaca_prompt(r) for r in records], "datasets:tatsu-lab/alpaca"
    return _generated_texts(w.seed), "generated"


def check_data(data: str) -> None:
    """`Workload.data` checked before any run (the reproduce scripts' --data): "auto", "synthetic", or a readable
    file, an Alpaca JSON list when it ends in .json. Raises WorkloadError saying what was found and what is allowed."""
    if data in ("auto", "synthetic"):
        return
    path = Path(data).expanduser()
    allowed = "expected 'auto', 'synthetic', or an Alpaca JSON / text file"
    if not path.is_file():
        raise WorkloadError(f"{data!r}: {'a folder, not a file' if path.is_dir() else 'file not found'}; {allowed}")
    try:
        texts = _texts_from(path)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WorkloadError(f"{data!r} cannot be read ({type(exc).__name__}: {exc}); {allowed}") from None
    if not any(texts):
        raise WorkloadError(f"{data!r} holds no text; {allowed}")


def _texts_from(path: Path) -> list[str]:
    if not path.exists():
        raise WorkloadError(f"workload.data = {str(path)!r}: file not found")
    if path.suffix == ".json":
        records = json.loads(path.read_text())
        if not isinstance(records, list) or not all(isinstance(r, dict) and "instruction" in r for r in records):
            raise WorkloadError(f"workload.data = {str(path)!r}: expected an Alpaca JSON list of "
                                "{instruction, input, output} records")
        return [_alpaca_prompt(r) for r in records]
    text = path.read_text()
    return [text[i:i + 2000] for i in range(0, len(text), 2000)]


def _alpaca_prompt(record: dict) -> str:
    template = PROMPT if record.get("input") else PROMPT_NO_INPUT
    return template.format(**{"input": "", **record}) + record.get("output", "")


def _generated_texts(seed: int) -> list[str]:
    rng = random.Random(seed)
    words = "the model trains on columns while the host updates the rest of every weight in the background".split()
    return [" ".join(rng.choice(words) for _ in range(200)) for _ in range(200)]


def batches(w: Workload, tokenizer: Tokenizer, texts: list[str], rank: int | None = None,
            world_size: int | None = None) -> Iterator[torch.Tensor]:
    """Packed token batches [micro_batch, seq_len], deterministic in the seed, cycling over the data forever.

    Sharded by rank: every rank shuffles the same batch starts with the same seed and takes every
    `world_size`-th one from its `rank` on, so the ranks of a multi-GPU run train on disjoint batches (as
    DistributedSampler does). `rank` and `world_size` default to the RANK and WORLD_SIZE the DeepSpeed launcher sets
    (0 and 1 otherwise: a single process sees exactly the unsharded stream)."""
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    if not 0 <= rank < world_size:
        raise WorkloadError(f"rank = {rank}, world_size = {world_size}: expected 0 <= rank < world_size")
    stream: list[int] = []
    for text in texts:
        stream += list(tokenizer.encode(text)) + [tokenizer.eos_id]
    per_batch = w.micro_batch * w.seq_len
    if len(stream) < per_batch * world_size:
        ranks = f" on each of {world_size} ranks" if world_size > 1 else ""
        raise WorkloadError(f"workload data has {len(stream)} tokens: expected at least {per_batch * world_size} "
                            f"for one batch{ranks}")
    starts = list(range(0, len(stream) - per_batch + 1, per_batch))
    random.Random(w.seed).shuffle(starts)
    starts = starts[rank::world_size]
    while True:
        for start in starts:
            yield torch.tensor(stream[start:start + per_batch]).view(w.micro_batch, w.seq_len)
