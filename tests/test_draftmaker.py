"""make-draft / eval-draft on tiny GGUF models (tests/tiny_gguf.py), plus one slow run on the bundled target."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from gguf import GGUFReader
from tiny_gguf import write_tiny_llama

from edge_client.draftmaker import DraftSpec, GGUFSource, evaluate_draft, make_draft, requantize
from edge_client.draftmaker.evaluate import LINK_3G, Prompt, evaluate_drafts
from edge_client.draftmaker.layers import format_blocks, parse_blocks
from edge_client.draftmaker.search import greedy_skip_search
from llama_runtime import GGUFModel

PROMPTS = [Prompt("code", "def list"), Prompt("chat", "hello world"), Prompt("chat", "the list of it")]
# The keys the eval-draft JSON documents (edge_client/draftmaker/evaluate.py).
REPORT_KEYS = {"target", "draft", "settings", "overall", "categories", "per_prompt", "expected_tokens_per_round",
               "speed", "verify", "hybrid", "vocabulary", "elapsed_s", "chain", "chain_by_category", "ngram",
               "ngram_by_category"}
HYBRID_KEYS = {"link", "rtt_s", "uplink_bytes_per_s", "bytes_per_draft_token", "temperature", "alpha",
               "draft_threads", "t_draft_s", "best_gamma", "tokens_per_s", "tokens_per_s_by_gamma",
               "cloud_only_tokens_per_s"}


@pytest.fixture(scope="module")
def tiny4(tmp_path_factory):
    """A 4-block target, a noisy draft of it, and a model with another tokenizer."""
    d = tmp_path_factory.mktemp("draftmaker")
    return {
        "target": write_tiny_llama(d / "target4.gguf", seed=3, n_layer=4),
        "noisy": write_tiny_llama(d / "noisy4.gguf", seed=4, base_seed=3, noise=0.7, n_layer=4),
        "other_vocab": write_tiny_llama(d / "other4.gguf", seed=3, n_layer=4, vocab_variant=1),
    }


def _fingerprint(path) -> str:
    m = GGUFModel(path, vocab_only=True)
    try:
        return m.fingerprint
    finally:
        m.close()


def _block_count(path) -> int:
    m = GGUFModel(path, n_threads=1)
    try:
        return int(m.metadata("llama.block_count"))
    finally:
        m.close()


def test_block_lists_parse_and_format():
    assert parse_blocks("0-3,7, 10-11") == [0, 1, 2, 3, 7, 10, 11]
    assert parse_blocks("5,4,4") == [4, 5]
    assert format_blocks([0, 1, 2, 3, 7, 10, 11]) == "0-3,7,10-11"
    assert parse_blocks(format_blocks([1, 3, 4, 5, 9])) == [1, 3, 4, 5, 9]
    with pytest.raises(ValueError, match="does not exist"):
        parse_blocks("0-4", n_blocks=4)
    with pytest.raises(ValueError, match="bad block"):
        parse_blocks("3-1")


def test_layer_skip_writes_a_loadable_renumbered_gguf(tiny4, tmp_path):
    out = GGUFSource(tiny4["target"]).write_subset(tmp_path / "skip.gguf", [0, 2, 3])
    assert _block_count(out) == 3
    assert _fingerprint(out) == _fingerprint(tiny4["target"])
    src, dst = GGUFReader(tiny4["target"]), GGUFReader(out)
    names = {t.name for t in dst.tensors}
    assert {f"blk.{i}.attn_q.weight" for i in range(3)} <= names and "blk.3.attn_q.weight" not in names
    by_name = {t.name: t for t in src.tensors}
    # New block 1 is old block 2, byte for byte.
    new_b1 = next(t for t in dst.tensors if t.name == "blk.1.ffn_down.weight")
    np.testing.assert_array_equal(np.asarray(new_b1.data), np.asarray(by_name["blk.2.ffn_down.weight"].data))
    assert not (tmp_path / "skip.gguf.part").exists()


def test_layer_skip_refuses_bad_blocks(tiny4, tmp_path):
    src = GGUFSource(tiny4["target"])
    with pytest.raises(ValueError, match="blocks must be in 0-3"):
        src.write_subset(tmp_path / "x.gguf", [0, 4])
    with pytest.raises(ValueError, match="at least one"):
        src.write_subset(tmp_path / "x.gguf", [])


def test_requant_produces_a_loadable_smaller_file(tiny4, tmp_path):
    out = requantize(tiny4["target"], tmp_path / "q4.gguf", "Q4_0")
    assert out.stat().st_size < tiny4["target"].stat().st_size
    assert _fingerprint(out) == _fingerprint(tiny4["target"])
    assert _block_count(out) == 4
    types = {t.tensor_type.name for t in GGUFReader(out).tensors if t.name.endswith("ffn_up.weight")}
    assert types == {"Q4_0"}
    with pytest.raises(ValueError, match="unknown quantization type"):
        requantize(tiny4["target"], tmp_path / "bad.gguf", "Q9_9")


def test_make_draft_skip_plus_requant_records_provenance(tiny4, tmp_path):
    out = tmp_path / "d.gguf"
    info = make_draft(tiny4["target"], out, DraftSpec(method="skip+requant", drop=[1], ftype="Q4_0"))
    assert info["blocks"] == 3 and info["kept_blocks"] == "0,2-3" and info["ftype"] == "Q4_0"
    assert json.loads((tmp_path / "d.gguf.json").read_text())["dropped_blocks"] == "1"
    assert _block_count(out) == 3
    assert info["fingerprint"] == _fingerprint(tiny4["target"])
    with pytest.raises(ValueError, match="does not exist"):
        make_draft(tiny4["target"], tmp_path / "e.gguf", DraftSpec(method="skip", drop=[7]))


def test_make_draft_copy_and_search_plus_requant(tiny4, tmp_path):
    info = make_draft(tiny4["target"], tmp_path / "c.gguf", DraftSpec(method="copy"))
    assert "stand-in" in info["note"] and info["bytes"] == info["target_bytes"]
    info = make_draft(tiny4["target"], tmp_path / "s.gguf",
                      DraftSpec(method="search+requant", search_blocks=3, calib_prompts=1, calib_tokens=4))
    assert info["blocks"] == 3 and info["ftype"] == "Q4_0"
    assert info["search"]["candidates_evaluated"] == 4 and len(info["search"]["steps"]) == 1
    assert info["dropped_blocks"] == str(info["search"]["steps"][0]["removed"])
    assert _block_count(tmp_path / "s.gguf") == 3


def test_eval_of_a_model_against_itself_accepts_everything(tiny4, tmp_path):
    same = tmp_path / "same.gguf"
    shutil.copyfile(tiny4["target"], same)
    rep = evaluate_draft(tiny4["target"], same, PROMPTS, max_new_tokens=6, speed_tokens=3, speed_repeats=1,
                         speed_threads=(1,), verify_repeats=1, max_gamma=3).to_json()
    assert set(rep) == REPORT_KEYS
    assert set(rep["hybrid"]) == HYBRID_KEYS
    alpha = rep["overall"]["alpha"]
    assert set(alpha) == {"0", "0.7", "1"}
    assert alpha["0"] == 1.0 and rep["overall"]["greedy_agreement"] == 1.0
    assert alpha["0.7"] == pytest.approx(1.0, abs=1e-9) and alpha["1"] == pytest.approx(1.0, abs=1e-9)
    assert set(rep["categories"]) == {"code", "chat"} and rep["categories"]["chat"]["prompts"] == 2
    assert rep["expected_tokens_per_round"]["0"]["8"] == pytest.approx(9.0)
    # The chain walked over the continuations: every draft accepted at every position (the end of a
    # continuation is not counted against a position), so τ(γ) = γ + 1.
    assert rep["chain"]["0"]["reach"]["3"] == [1.0, 1.0, 1.0] and rep["chain"]["0"]["tokens_per_step"]["3"] == 4.0
    assert set(rep["chain_by_category"]) == {"code", "chat"}
    assert 0.0 <= rep["ngram"]["proposed_share"]["3"] <= 1.0
    assert set(rep["speed"]["draft"]) == {"1"} and rep["speed"]["draft"]["1"] > 0
    assert 1 <= rep["hybrid"]["best_gamma"] <= 3 and rep["hybrid"]["tokens_per_s"] > 0
    json.dumps(rep)  # the report is plain JSON


def test_eval_of_a_noisy_draft_and_tokenizer_mismatch(tiny4):
    noisy, = evaluate_drafts(tiny4["target"], [tiny4["noisy"]], PROMPTS, max_new_tokens=8, measure_speed=False)
    alpha = noisy.overall["alpha"]
    assert 0.0 <= alpha["0"] < 1.0 and 0.0 < alpha["1"] < 1.0
    assert noisy.speed is None and noisy.hybrid is None
    positions = noisy.overall["positions"]
    assert positions["0"] == sum(r["positions"]["0"] for r in noisy.per_prompt)
    assert noisy.vocabulary is None and "coverage" not in noisy.overall  # same tokenizer
    # A chain cannot accept its k-th draft more often than its (k-1)-th; τ(γ) <= γ + 1.
    for t, chain in noisy.chain.items():
        for g, reach in chain["reach"].items():
            assert all(a >= b for a, b in zip(reach, reach[1:])) and chain["tokens_per_step"][g] <= int(g) + 1
    # Another tokenizer is scored across vocabularies (tests/test_pair.py), unless asked to refuse it.
    with pytest.raises(ValueError, match="do not share a tokenizer"):
        evaluate_drafts(tiny4["target"], [tiny4["other_vocab"]], PROMPTS, max_new_tokens=4, measure_speed=False,
                        cross_vocab=False)


def test_greedy_search_drops_blocks_and_logs_each_step(tiny4):
    result = greedy_skip_search(GGUFSource(tiny4["target"]), target_blocks=2, prompts=PROMPTS[:2], n_tokens=6,
                                threads=1)
    assert len(result.kept) == 2 and len(result.steps) == 2
    assert result.candidates_evaluated == 4 + 3
    assert sorted(result.kept + result.skipped) == [0, 1, 2, 3]
    assert sorted(s.removed for s in result.steps) == result.skipped
    assert [s.blocks_left for s in result.steps] == [3, 2]
    assert all(0.0 <= s.agreement <= 1.0 for s in result.steps)
    assert result.stopped == "reached 2 blocks"
    # An agreement floor above what any removal keeps stops the search before the first step.
    strict = greedy_skip_search(GGUFSource(tiny4["target"]), target_blocks=1, min_agreement=1.01,
                                prompts=PROMPTS[:1], n_tokens=4, threads=1)
    assert strict.kept == [0, 1, 2, 3] and strict.steps == [] and "would give agreement" in strict.stopped


def test_cli_make_and_eval_draft(tiny4, tmp_path, capsys):
    from edge_client.cli import main
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"category": p.category, "prompt": p.text}) + "\n" for p in PROMPTS))
    out = tmp_path / "cli.gguf"
    assert main(["make-draft", "--target", str(tiny4["target"]), "--out", str(out), "--method", "skip",
                 "--keep", "0,3", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["blocks"] == 2 and info["dropped_blocks"] == "1-2"
    assert main(["eval-draft", "--target", str(tiny4["target"]), "--draft", str(out), "--prompts", str(prompts),
                 "--tokens", "4", "--no-speed", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert set(rep) == REPORT_KEYS and rep["draft"]["name"] == "cli.gguf"
    assert main(["make-draft", "--target", str(tiny4["target"]), "--out", str(tmp_path / "bad.gguf"),
                 "--method", "skip", "--drop", "9"]) == 2


@pytest.mark.slow
def test_bundled_target_requant_q4_0_is_a_usable_draft(tmp_path):
    from llama_runtime import bundled_model_path
    target = bundled_model_path()
    out = tmp_path / "q4_0.gguf"
    make_draft(target, out, DraftSpec(method="requant", ftype="Q4_0"))
    rep = evaluate_draft(target, out, [Prompt("code", "Write a Python function that reverses a list.")],
                         max_new_tokens=16, measure_speed=False)
    assert rep.overall["greedy_agreement"] > 0.4


def test_default_link_is_netsims_3g_profile():
    # The draftmaker does not import netsim; its default link must still be netsim's "3g".
    from edge_client.draftcli import link_figures
    assert link_figures("3g") == LINK_3G
    with pytest.raises(KeyError, match="unknown profile"):
        link_figures("5g-mmwave")
