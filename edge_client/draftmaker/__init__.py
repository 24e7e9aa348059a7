"""Draft models made from the target itself (no training, no model hub): requantized copies,
layer-skipped copies and both, and the evaluation that says which one to ship.

  layers.py    GGUF layer skipping with the gguf package (raw tensor bytes, renumbered blocks)
  quantize.py  llama.cpp requantization
  search.py    greedy choice of the skipped blocks on measured agreement
  make.py      make-draft: the methods and their provenance file
  evaluate.py  eval-draft: acceptance per category and temperature, speed, and the hybrid
               figure of merit on a weak link
"""
from edge_client.draftmaker.evaluate import EvalReport, evaluate_draft, load_prompts
from edge_client.draftmaker.layers import GGUFSource, format_blocks, parse_blocks, skip_layers
from edge_client.draftmaker.make import METHODS, DraftSpec, make_draft
from edge_client.draftmaker.quantize import FTYPES, requantize

__all__ = ["DraftSpec", "EvalReport", "FTYPES", "GGUFSource", "METHODS", "evaluate_draft", "format_blocks",
           "load_prompts", "make_draft", "parse_blocks", "requantize", "skip_layers"]
