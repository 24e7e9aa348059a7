"""The per-model batch-invariant cut (llama_runtime.model.GGUFModel.invariant_ubatch) is probed once
and kept on disk, keyed by what it depends on; a damaged or foreign cache entry is probed again."""
from __future__ import annotations

import json

from llama_runtime.invariance import PROBE_CUTS
from llama_runtime.model import GGUFModel


def test_the_probe_is_cached_and_a_bad_entry_is_probed_again(tiny_models, tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDSPEC_CACHE", str(tmp_path))
    probed = GGUFModel(tiny_models["target"], n_threads=1).invariant_ubatch
    assert probed in PROBE_CUTS
    (entry,) = (tmp_path / "invariant").glob("*.json")
    assert json.loads(entry.read_text())["invariant_ubatch"] == probed

    other = next(c for c in PROBE_CUTS if c != probed)     # the cache is read, not the probe redone
    entry.write_text(json.dumps({"invariant_ubatch": other}))
    assert GGUFModel(tiny_models["target"], n_threads=1).invariant_ubatch == other

    entry.write_text("not json")                              # damaged: probed again, and rewritten
    assert GGUFModel(tiny_models["target"], n_threads=1).invariant_ubatch == probed
    entry.write_text(json.dumps({"invariant_ubatch": 5}))     # not a cut the probe can give
    assert GGUFModel(tiny_models["target"], n_threads=1).invariant_ubatch == probed

    # Another thread count is another key (the cut can depend on it): a second entry.
    GGUFModel(tiny_models["target"], n_threads=2).invariant_ubatch
    assert len(list((tmp_path / "invariant").glob("*.json"))) == 2
