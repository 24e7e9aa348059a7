"""Draft models made from the target itself (no training, no model hub): requantized copies,
layer-skipped copies and both, and the evaluation that says which one to ship.

  layers.py    GGUF layer skipping with the gguf package (raw tensor bytes, renumbered blocks)
  quantize.py  llama.cpp requantization
  search.py    greedy choice of the skipped blocks on measured agreement
  make.py      make-draft: the methods and their provenance file
  evaluate.py  eval-draft: acceptance per category and temperature, speed, and the hybrid
               figure of merit on a weak link
"""
# Loaded on first use (PEP 562): `edge-client generate` registers the make-draft/eval-draft
# commands without importing gguf or rich, which only the `draft` extra installs.
_EXPORTS = {
    "EvalReport": "evaluate", "evaluate_draft": "evaluate", "load_prompts": "evaluate",
    "GGUFSource": "layers", "format_blocks": "layers", "parse_blocks": "layers", "skip_layers": "layers",
    "METHODS": "make", "DraftSpec": "make", "make_draft": "make",
    "FTYPES": "quantize", "requantize": "quantize",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
