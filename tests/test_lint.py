"""The template linter (workbench.lint) on every real template of the real-template tier, with the
expected verdict per conversation shape written down: (verdict, the turn where it first happens)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from workbench import real_models as rm
from workbench.lint import SHAPES, lint

TR, HR = "seal:template_rewrite", "seal:history_rewritten"
EXPECTED = {
    # Qwen3, thinking on: a thinking model emits <think>...</think> in every turn and the template
    # drops it from history: an empty block at once, a non-empty one when a new user turn arrives.
    "qwen3": {"plain": (TR, 2), "tool_one": (TR, 2), "tool_many": (TR, 2), "reasoning_on": (TR, 3),
              "reasoning_off": (TR, 2), "system_changed": (HR, 2), "max_tokens_cut": (TR, 2)},
    # Qwen3, enable_thinking=False: the generation prompt holds an empty think block that the history
    # render drops ('reasoning_on' is the same request path: the block is in the prompt, not sampled).
    "qwen3-nothink": {"plain": (TR, 2), "tool_one": (TR, 2), "tool_many": (TR, 2), "reasoning_on": (TR, 2),
                      "reasoning_off": (TR, 2), "system_changed": (HR, 2), "max_tokens_cut": (TR, 2)},
    # Llama 3.1: the exact prefix extends everywhere; the template refuses two calls in one turn.
    "llama3.1": {"plain": ("extends", None), "tool_one": ("extends", None), "tool_many": ("error", 1),
                 "reasoning_on": ("extends", None), "reasoning_off": ("extends", None), "system_changed": (HR, 2),
                 "max_tokens_cut": ("extends", None)},
    # Mistral v3: the system prompt rides on the LAST user message (it moves every user turn); tool
    # turns need 9-character call ids, which the accumulator's canonical messages drop.
    "mistral-v3": {"plain": (TR, 2), "tool_one": ("error", 1), "tool_many": ("error", 1), "reasoning_on": ("error", 1),
                   "reasoning_off": ("error", 1), "system_changed": (HR, 2), "max_tokens_cut": ("extends", None)},
    # gpt-oss: a final answer's <|return|> comes back as <|end|>; a call ends with <|call|>, not the
    # ChatFormat's end of turn; a cut reply's closing text is <|return|> and becomes <|end|>.
    "gpt-oss": {"plain": (TR, 2), "tool_one": (TR, 2), "tool_many": (TR, 2), "reasoning_on": (TR, 2),
                "reasoning_off": (TR, 2), "system_changed": (HR, 2), "max_tokens_cut": (TR, 2)},
    # DeepSeek V3.1: plain chat extends; its template concatenates tool-call arguments as a string,
    # and canonical messages hold a dict.
    "deepseek-v3.1": {"plain": ("extends", None), "tool_one": ("error", 1), "tool_many": ("error", 1),
                      "reasoning_on": ("error", 1), "reasoning_off": ("error", 1), "system_changed": (HR, 2),
                      "max_tokens_cut": ("extends", None)},
}
TRAPS = {  # the traps found per template
    "qwen3": {"special_in_text"}, "qwen3-nothink": {"special_in_text"},
    "llama3.1": {"bos_doubling", "special_in_text"}, "mistral-v3": {"bos_doubling", "special_in_text"},
    "gpt-oss": {"special_in_text"}, "deepseek-v3.1": {"special_in_text"},
}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_lint_verdicts_per_real_template(name):
    report = lint(name)
    got = {s.shape: (s.verdict, s.first.turn if s.verdict != "extends" else None) for s in report.shapes}
    assert got == EXPECTED[name], report.table()
    assert {t for t, found in report.traps_found().items() if found} == TRAPS[name], report.table()
    assert set(report.verdicts()) == set(SHAPES)
    for s in report.shapes:  # a seal always names the first differing token in context
        if s.verdict.startswith("seal"):
            assert s.first.diff_at is not None and " vs render " in s.first.context
    text, page = report.table(), report._repr_html_()
    assert name in text and "first differing token" in text and "<table" in page
    json.dumps(report.to_dict())


def test_lint_shows_the_think_seal_in_context():
    report = lint("qwen3", ["reasoning_on"])
    s = report.shapes[0]
    assert [t.verdict for t in s.turns] == ["start", "extends", TR]
    assert "recorded '<think>" in s.first.context  # the earlier turn's <think> is what the template drops


def test_lint_catches_the_leading_space_of_a_legacy_sentencepiece():
    """The same Mistral v3 vocabulary with the older 'legacy' normalizer: text after a control token
    gets an extra '▁' when encoded alone, so the linter reports the trap."""
    from transformers import PreTrainedTokenizerFast

    fam = rm.load_family("mistral-v3")
    tok = PreTrainedTokenizerFast(tokenizer_object=rm._build_mistral_v3(legacy=True), bos_token="<s>", eos_token="</s>",
                                  unk_token="<unk>", chat_template=fam.tokenizer.chat_template)
    report = lint(tok, ["plain", "max_tokens_cut"])
    assert report.traps_found()["leading_space"] and not lint("mistral-v3", ["plain"]).traps_found()["leading_space"]


def test_lint_a_tokenizer_directory_and_the_cli(tmp_path):
    d = rm.load_family("llama3.1").save(tmp_path / "llama")
    assert lint(str(d), ["plain"]).verdicts() == {"plain": "extends"}
    out = subprocess.run([sys.executable, "-m", "workbench.lint", "qwen3", "--shape", "reasoning_on", "--json"],
                         capture_output=True, text=True, check=True).stdout
    assert json.loads(out)[0]["verdicts"] == {"reasoning_on": TR}
    with pytest.raises(FileNotFoundError):
        lint(str(tmp_path / "nothing"))
