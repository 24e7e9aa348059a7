"""The option matrix (issue 24): every combination of the edge's options runs, or is refused before
the first round with a message that names the two options that conflict and why.

The matrix (tests/option_matrix.py): same vocabulary or across × chain / tree / auto × no work
during the round trip / proactive / pipeline / continuations × q none / fixed / float × greedy /
top-k / top-p × the verifier batching, serial, or batching with KV parking, on a synthetic pair
(1134 combinations); and on llama.cpp (tiny GGUF models, one vocabulary: 567 combinations).

Checked per combination:
- greedy: the ids equal the verifier's own cloud-only stream (Generate) for the same prompt ids
  (on llama.cpp a difference at a near-tie of the top two logits is an xfail, as in test_e2e_grpc);
- sampled: the same seed gives the same ids twice (pipelined or not) unless an option follows
  measured timings (Speculation.timing_dependent: adaptive γ, tree auto, pipelined chains with continuations for more
  than one outcome); on the synthetic pair, unseeded, N = 800 tokens pass a chi-square of their token
  transitions against the target's processed bigram distribution at p > 1e-4 (cells with expected
  count < 5 pooled per row). Negative control (must fail at the same N and threshold, in the
  median of 9 runs): the edge ships a uniform q over the drawn support instead of the q it drew from.

The fast suite draws samples with hypothesis (12 synthetic combinations plus explicit ones for the
crash of issue 24; 6 on llama.cpp); the whole matrix is behind a documented command (about an hour
on 2 cores, nearly all of it the synthetic pair's chi-square runs):

    HYBRIDSPEC_MATRIX=all .venv/bin/python -m pytest -q tests/test_option_matrix.py -k whole
    bash scripts/option_matrix.sh          # the same, then the real-model CLI check
"""
from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, Phase, example, given, note, settings
from hypothesis.control import currently_in_test_context
from hypothesis import strategies as st

from edge_client import cli
from edge_client.drafters import PromptLookupDrafter, SyntheticDrafter
from edge_client.options import (OptionConflict, Speculation, refuse_conflicts,
                                 refuse_drafter_conflicts)
from option_matrix import (BATCHINGS, QS, SAMPLINGS, SHAPES, VOCABS, WORKS, Combo, WrongQ,
                           all_combos, llama_combos, run_combo, seeded_ids_by_work)

P_MIN = 1e-4
N_TOKENS = 800
WHOLE = os.environ.get("HYBRIDSPEC_MATRIX") == "all"


@pytest.fixture(autouse=True)
def vocab_cache(tmp_path, monkeypatch):
    from edge_client import crossvocab
    monkeypatch.setenv("HYBRIDSPEC_CACHE", str(tmp_path))
    crossvocab._VOCABS.clear()


def check_combo(combo: Combo, tokens: int = N_TOKENS, models: dict | None = None) -> None:
    got = run_combo(combo, tokens, models=models)
    if currently_in_test_context():
        note(f"{combo}: {got}")
    if combo.greedy:
        assert len(got["ids"]) == 40
        if combo.backend == "llama.cpp":
            from test_e2e_grpc import check_same_or_near_tie
            check_same_or_near_tie(str(models["target"]), got["prompt_ids"], got["ids"], got["reference"])
        assert got["ids"] == got["reference"], f"{combo}: greedy output differs from the cloud-only stream"
        return
    a, b = got["seeded"]
    assert len(a) == len(b) == 24
    if not Speculation(**combo.edge_fields()).timing_dependent():
        assert a == b, f"{combo}: the same seed gave {a} and {b}"
    if combo.backend != "synthetic":
        return
    p, n = got["chi2"]
    assert n == tokens
    assert p > P_MIN, f"{combo}: chi-square p = {p:.2e} over {n} transitions"


# --- refusals: the one rule, its messages --------------------------------------------------------------

def test_no_combination_of_the_matrix_is_refused():
    for combo in all_combos():
        spec = Speculation(**combo.edge_fields())
        refuse_conflicts(spec, "synthetic", True)
        refuse_conflicts(spec, "gguf", True)


def test_a_tree_with_the_lookup_drafter_is_refused_naming_both():
    with pytest.raises(OptionConflict) as e:
        refuse_drafter_conflicts(Speculation(tree="auto", plan="off"), PromptLookupDrafter())
    assert e.value.options == ("tree=auto", "drafter=lookup")
    assert str(e.value).startswith("tree=auto conflicts with drafter=lookup: the lookup drafter here proposes chains only")
    refuse_drafter_conflicts(Speculation(tree="off", plan="off"), PromptLookupDrafter())            # chains: fine
    refuse_drafter_conflicts(Speculation(tree="auto", plan="off"), SyntheticDrafter(8))             # a model drafter: fine


def test_target_vocab_with_strict_tokenizer_is_refused_naming_both():
    with pytest.raises(OptionConflict, match="target_vocab conflicts with strict_tokenizer: .*drafts? across"):
        Speculation(strict_tokenizer=True, target_vocab="target.gguf", plan="off")
    Speculation(strict_tokenizer=True, plan="off")
    Speculation(target_vocab="target.gguf", plan="off")


@pytest.mark.parametrize("argv, flags", [
    (["--drafter", "lookup", "--tree", "auto"], ("argument --tree auto", "argument --drafter lookup")),
    (["--drafter", "lookup", "--tree", "budget=8,depth=3"],
     ("argument --tree budget=8,depth=3,branching=2,width=4", "argument --drafter lookup")),
    (["--strict-tokenizer", "--target-vocab", "t.gguf"], ("argument --target-vocab", "argument --strict-tokenizer")),
])
def test_the_cli_refuses_a_conflict_before_any_model_loads(argv, flags, capsys):
    # No verifier is listening and no draft file exists: the refusal comes first.
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--server", "127.0.0.1:9", "--draft", "/nonexistent.gguf", *argv, "--prompt", "hello"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"{flags[0]} conflicts with {flags[1]}: " in err, err


def test_timing_dependent_options():
    assert Speculation(gamma=4, plan="off").timing_dependent() == ()
    assert Speculation(gamma=4, pipeline=True, max_continuations=1, plan="off").timing_dependent() == ()
    assert Speculation(gamma=4, proactive=True, max_continuations=1, tree="budget=6,depth=3", plan="off").timing_dependent() == ()
    assert Speculation(gamma=4, max_continuations=8, plan="off").timing_dependent() == ()   # nothing drafted ahead
    assert Speculation(gamma="adaptive", tree="auto", plan="off").timing_dependent() == ("gamma", "tree")
    assert Speculation(gamma=4, pipeline=True, max_continuations=8, plan="off").timing_dependent() == ("max_continuations",)
    assert Speculation(gamma=4, proactive=True, max_continuations=8, plan="off").timing_dependent() == ()
    assert Speculation(gamma=4, pipeline=True, max_continuations=8, tree="budget=6,depth=3", plan="off").timing_dependent() == ()
    assert Speculation(gamma=4, proactive=True, tree="budget=6,depth=3", plan="off").timing_dependent() == ()
    # The planner follows measured timings, unless its inputs are pinned: then it chooses once.
    assert Speculation().timing_dependent() == ("plan", "gamma", "tree")
    assert Speculation(gamma=4).timing_dependent() == ("plan", "tree")
    assert Speculation(plan_inputs="rtt_ms=300,alpha=0.6").timing_dependent() == ()
    assert Speculation(gamma="adaptive", plan_inputs="rtt_ms=300").timing_dependent() == ("gamma",)


def test_the_planner_chooses_once_from_pinned_inputs():
    """Pinned inputs give one shape, by the planner's cost model (plan_round on the pinned estimates):
    a long round trip with a cheap verifier per node asks for longer chains than a short one with an
    expensive verifier (the control); untried trees count as their chain and cost more, so chains."""
    from edge_client.planner import Budget, pinned_estimates, plan_round

    def pinned(inputs: str, **fields):
        spec = Speculation(plan_inputs=inputs, **fields)
        return plan_round(pinned_estimates(spec.plan_inputs), spec, Budget(10_000))
    far = pinned("rtt_ms=600,draft_ms=2,verify_ms=20,node_ms=0.05,alpha=0.8")
    near = pinned("rtt_ms=5,draft_ms=2,verify_ms=20,node_ms=8,alpha=0.8")
    assert far.shape is None and near.shape is None
    assert far.gamma > near.gamma >= 1
    assert pinned("rtt_ms=600", gamma=3).gamma == 3


@pytest.mark.parametrize("combo", [Combo("same", "auto", "auto-pinned", "float", "top-k", "batched"),
                                   Combo("cross", "auto", "auto-pinned", "fixed", "top-p", "serial")], ids=str)
def test_a_seeded_auto_run_repeats_when_the_planners_inputs_are_pinned(combo):
    """The default edge (every shape the planner's) with --plan-inputs: the same seed twice, each on a
    fresh verifier, gives the same ids, whichever rounds went ahead or were kept in time."""
    first = seeded_ids_by_work(combo, ("auto-pinned",), tokens=40, seed=11)
    again = seeded_ids_by_work(combo, ("auto-pinned",), tokens=40, seed=11)
    assert first == again and len(first["auto-pinned"]) == 40, (first, again)


# --- the matrix: a sample in the fast suite ----------------------------------------------------------

COMBOS = st.builds(Combo, st.sampled_from(VOCABS), st.sampled_from(SHAPES), st.sampled_from(WORKS),
                   st.sampled_from(QS), st.sampled_from(SAMPLINGS), st.sampled_from(BATCHINGS))


@settings(max_examples=12, deadline=None, database=None, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(combo=COMBOS)
# Issue 24's crash: a sparse float q wider than the restricted support, across vocabularies, with
# top-k / top-p and the continuation probe (pipeline, proactive).
@example(combo=Combo("cross", "chain", "pipeline", "float", "top-k", "serial"))
@example(combo=Combo("cross", "tree", "proactive", "float", "top-p", "batched"))
@example(combo=Combo("cross", "auto", "continuations", "fixed", "greedy", "batched"))
@example(combo=Combo("same", "tree", "window", "float", "top-p", "batched"))
def test_a_sample_of_the_matrix_runs_and_is_exact(combo):
    check_combo(combo)


LLAMA_COMBOS = st.builds(Combo, st.just("same"), st.sampled_from(SHAPES), st.sampled_from(WORKS), st.sampled_from(QS),
                         st.sampled_from(SAMPLINGS), st.sampled_from(BATCHINGS), st.just("llama.cpp"))


@settings(max_examples=6, deadline=None, database=None, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(combo=LLAMA_COMBOS)
@example(combo=Combo("same", "tree", "continuations", "float", "top-p", "kv-park", "llama.cpp"))
def test_a_sample_of_the_matrix_on_llama_cpp(tiny_models, combo):
    pytest.importorskip("llama_cpp")
    check_combo(combo, models=tiny_models)


@pytest.mark.parametrize("combo", [Combo("same", "chain", "none", "float", "top-k", "batched"),
                                   Combo("cross", "chain", "none", "fixed", "top-p", "serial"),
                                   Combo("same", "tree", "none", "none", "top-p", "serial"),
                                   Combo("cross", "tree", "none", "float", "top-k", "batched")], ids=str)
def test_the_same_seed_gives_the_same_ids_pipelined_or_not(combo):
    """A round's draft and the verifier's draws depend only on the seed and the committed tokens, so
    drafting during the round trip (proactive) and sending it early (pipeline) change nothing.
    (Continuations for several outcomes: the next test, for fixed trees.)"""
    ids = seeded_ids_by_work(combo, ("none", "proactive", "pipeline"), tokens=40, seed=11)
    assert ids["proactive"] == ids["none"] and ids["pipeline"] == ids["none"], ids
    assert len(ids["none"]) == 40


@pytest.mark.parametrize("combo", [Combo("same", "tree", "none", "fixed", "top-k", "serial"),
                                   Combo("cross", "tree", "none", "float", "top-p", "batched")], ids=str)
def test_the_same_seed_gives_the_same_ids_with_continuations_for_fixed_trees(combo):
    """A continuation for an outcome is drafted with the plan a fresh round after that outcome would
    have (RoundPlan.within), so near max_new_tokens a guessed round is as deep as a fresh one and a
    fixed tree's output does not depend on which outcomes were guessed in time. (Pipelined chains with
    several outcomes stay timing-dependent: their length is chosen from measured timings.) Before the
    cut, the first combination differed at position 37 of 40."""
    ids = seeded_ids_by_work(combo, ("none", "continuations"), tokens=40, seed=11)
    assert ids["continuations"] == ids["none"], ids
    assert len(ids["none"]) == 40


CONTROL_RUNS = 9


def test_negative_control_a_wrong_q_fails_the_chi_square():
    """The control has power at the same N and threshold, but one run is a draw: over 100 runs of
    800 tokens (Xeon, 2026-12-06) a wrong q gave a median log10 p of -7.3, and 6 of the 100 passed
    (p up to 4.9e-4; CI once saw 1.4e-4). So the median of CONTROL_RUNS independent runs must fail:
    at 6 % a run, five of nine pass about once in 12,000."""
    combo = Combo("same", "chain", "none", "float", "top-p", "serial")
    ps = []
    for _ in range(CONTROL_RUNS):
        p, n = run_combo(combo, N_TOKENS, check_seed=False, wrap=WrongQ)["chi2"]
        assert n == N_TOKENS
        ps.append(p)
    assert sorted(ps)[CONTROL_RUNS // 2] < P_MIN, f"the control passed: p = {', '.join(f'{p:.2e}' for p in ps)}"


# --- the whole matrix (documented command) --------------------------------------------------------------

# Collected only when asked (an empty parameter set is one skip, not 1134 of them).
@pytest.mark.skipif(not WHOLE, reason="the whole matrix: HYBRIDSPEC_MATRIX=all (about an hour on 2 cores)")
@pytest.mark.parametrize("combo", all_combos() if WHOLE else [], ids=str)
def test_whole_matrix(combo):
    check_combo(combo)


@pytest.mark.skipif(not WHOLE, reason="the whole matrix: HYBRIDSPEC_MATRIX=all")
@pytest.mark.parametrize("combo", llama_combos() if WHOLE else [], ids=str)
def test_whole_matrix_on_llama_cpp(tiny_models, combo):
    check_combo(combo, models=tiny_models)
