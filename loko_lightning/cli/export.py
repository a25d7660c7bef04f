"""``loko export``: a trained checkpoint as a peft adapter directory or a merged plain model."""

from __future__ import annotations

import argparse
from argparse import ArgumentError

from loko_lightning.learner.checkpoint_io import load_learner
from loko_lightning.learner.export import export, loading_code, read_export


def export_main(args: list[str]) -> None:
    """``loko export``: a trained checkpoint as a peft adapter directory, or a merged plain model (``--merge``)."""
    parser = argparse.ArgumentParser(
        prog="loko export",
        description=(
            "Write a checkpoint's network as a peft adapter for the stock timm/transformers backbone "
            "(PeftModel.from_pretrained), or with --merge as a plain model with the adapter merged "
            "(timm.create_model('local-dir:DIR', pretrained=True) / AutoModelForSequenceClassification.from_pretrained"
            "(DIR)). Weights are safetensors; class names and preprocessing go with them (loko_export.json)."
        ),
        exit_on_error=False,
    )
    parser.add_argument("--ckpt_path", required=True, help="a checkpoint written by loko fit")
    parser.add_argument("--out", required=True, help="the directory to write (new, or empty)")
    parser.add_argument("--merge", action="store_true", help="merge the adapter into the backbone")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing, non-empty --out")
    try:
        options = parser.parse_args(args)
    except ArgumentError as err:
        raise ValueError(f"{err.message}. See `loko export --help`.") from None
    learner = load_learner(options.ckpt_path)
    out = export(learner, options.out, merge=options.merge, overwrite=options.overwrite)
    pooling = getattr(learner.network, "pooling", "pooler")
    code = loading_code(learner.network_factory, options.merge, read_export(out)["preprocessing"], options.out, pooling)
    print(f"loko: exported {'a merged model' if options.merge else 'a peft adapter'} to {out}; load it in Python with:")
    print(code)
