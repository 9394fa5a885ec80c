"""Conversation context: the ConversationStore on a real SQLite file (and on a real PostgreSQL 15
for concurrent appends) and the ContextFitter with the tiny model's real tokenizer as the counter.

Covers: a 40-exchange conversation that never exceeds the budget at any step, with the summary in
place and the latest whole exchanges verbatim; incremental summarization (the fake summarizer
records which turns it received: each turn exactly once, with the previous summary); the cached
summary reused without a summarizer call; a too-long summary cut to fit (own tokens bounded);
summarizer failures, empty answers and no summarizer → dropping; context_length_exceeded; the
binary search's count calls on 1,000 turns and the bounded catch-up; tenant isolation;
concurrent appends (50 at once, one or two replicas; PostgreSQL too) losing nothing; id and
message validation; save_summary's compare-and-set; the turn/byte limits (summarized turns
dropped, else 400 "conversation too long"); expiry over an injected clock.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from paved.gateway.access.limits import InProcessLimiter
from paved.gateway.access.state import GatewayStore
from paved.gateway.errors import GatewayError
from paved.gateway.metrics import GatewayMetrics
from paved.gateway.orchestration.context import (
    CONVERSATION_ID_RE,
    SUMMARY_HEADER,
    ContextFitter,
    Conversation,
    ConversationStore,
    Fitted,
    SummaryRefused,
    summary_message,
    summary_request,
)
from paved.gateway.orchestration.orchestrate import InternalClient, Orchestrator
from paved.gateway.orchestration.tokens import TokenCounter
from paved.gateway.routing.router import Router
from paved.gateway.routing.routes import parse_routes
from paved.gateway.types import Limits, Principal, Tenant
from paved.runfiles import tiny_model_dir

TENANT = "acme"
# Summarizer input bound for tests about other things than the catch-up.
BIG = 1_000_000
SYSTEM = [{"role": "system", "content": "You are a careful assistant for the acme support desk."}]


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def tok() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir())


def tokens_of(tok: Any, messages: list[dict]) -> int:
    """The model's own prompt count, as paved.gateway.orchestration.tokens counts chat requests."""
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return len(tok.encode(rendered, add_special_tokens=False))


class Counter:
    """The caller's Count: the real tokenizer, with the number of calls recorded."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok
        self.calls = 0

    async def __call__(self, messages: list[dict]) -> int:
        self.calls += 1
        return tokens_of(self.tok, messages)


TAG = re.compile(r"<t(\d+)>")


@dataclass(frozen=True)
class Call:
    tags: list[int]  # the turns the request carried
    previous: str  # the previous summary it folds them into
    max_tokens: int
    messages: list[dict]


class FakeSummarizer:
    """Records each request (the tags of its turns, the previous summary); answers a short
    summary naming how many turns it has seen, a fixed reply, or an error."""

    def __init__(self, reply: str | None = None, fail: bool = False) -> None:
        self.calls: list[Call] = []
        self.reply = reply
        self.fail = fail

    async def __call__(self, messages: list[dict], max_tokens: int) -> str:
        body = messages[-1]["content"]
        previous, _, turns_part = body.partition("New turns:\n")
        previous = previous.removeprefix("Previous summary:\n").strip()
        tags = [int(t) for t in TAG.findall(turns_part)]
        self.calls.append(Call(tags, previous, max_tokens, messages))
        if self.fail:
            raise RuntimeError("the summarizer model is down")
        if self.reply is not None:
            return self.reply
        seen = sum(len(c.tags) for c in self.calls)
        return f"The user and the assistant discussed {seen} turns, the last one numbered {tags[-1]}."

    @property
    def tags(self) -> list[int]:
        return [t for call in self.calls for t in call.tags]


WORDS = [
    "order",
    "shipment",
    "invoice",
    "refund",
    "warehouse",
    "ticket",
    "customer",
    "parcel",
    "delay",
    "address",
]


def user(i: int, words: int = 12) -> dict:
    return {
        "role": "user",
        "content": f"<t{i}> question {i}: " + " ".join(WORDS[(i + k) % 10] for k in range(words)),
    }


def assistant(i: int, words: int = 14) -> dict:
    return {
        "role": "assistant",
        "content": f"<t{i}> answer {i}: " + " ".join(WORDS[(i * 3 + k) % 10] for k in range(words)),
    }


@pytest.fixture
def gateway_store(tmp_path: Path) -> Iterator[GatewayStore]:
    store = GatewayStore(f"sqlite:///{tmp_path / 'gw.db'}")
    run(store.start())
    yield store
    run(store.close())


@pytest.fixture
def conversations(gateway_store: GatewayStore) -> ConversationStore:
    c = ConversationStore(gateway_store)
    run(c.start())
    return c


async def fill(
    conversations: ConversationStore, conversation_id: str, exchanges: int, tenant: str = TENANT
) -> None:
    for k in range(exchanges):
        await conversations.append(tenant, conversation_id, [user(2 * k), assistant(2 * k + 1)])


async def fit(
    fitter: ContextFitter,
    tok: Any,
    *,
    budget: int,
    summarize: Any,
    new: list[dict] | None = None,
    conversation_id: str = "c",
    tenant: str = TENANT,
) -> Fitted:
    """`fitter.fit` with SYSTEM first and `new` (by default one user message) last, counted with
    the tiny model's tokenizer."""
    return await fitter.fit(
        tenant=tenant,
        conversation_id=conversation_id,
        system=SYSTEM,
        new=[user(100)] if new is None else new,
        budget=budget,
        count=Counter(tok),
        summarize=summarize,
    )


# -- the fitter ----------------------------------------------------------------------------


def test_forty_exchanges_never_exceed_the_budget_and_summarize_each_turn_once(conversations, tok):
    budget = 400
    fitter = ContextFitter(
        conversations, summary_share=0.25, max_summary_tokens=512, max_summary_input_tokens=BIG
    )
    cap = int(0.25 * budget)
    summarizer = FakeSummarizer()
    count = Counter(tok)

    async def go():
        summarized_before = 0
        for step in range(40):
            new = [user(2 * step)]
            calls_before = len(summarizer.calls)
            conv = await conversations.load(TENANT, "c1")
            fitted = await fitter.fit(
                tenant=TENANT,
                conversation_id="c1",
                system=SYSTEM,
                new=new,
                budget=budget,
                count=count,
                summarize=summarizer,
            )
            # The bound, recounted independently with the model's tokenizer.
            assert tokens_of(tok, fitted.messages) == fitted.prompt_tokens <= budget
            assert fitted.messages[: len(SYSTEM)] == SYSTEM and fitted.messages[-1] == new[0]
            cut = fitted.summarized_turns
            assert cut >= summarized_before  # the cut never moves back
            if cut == 0:
                assert fitted.summary is None
                assert fitted.messages == [*SYSTEM, *conv.turns, *new]
            else:
                assert fitted.summary is not None and fitted.summary.startswith("The user and the assistant")
                assert fitted.messages[len(SYSTEM)] == summary_message(fitted.summary)
                verbatim = fitted.messages[len(SYSTEM) + 1 : -1]
                assert verbatim == list(conv.turns[cut:])
                # Whole exchanges: the verbatim history starts with the user's side.
                assert not verbatim or verbatim[0]["role"] == "user"
                # The cached summary covers exactly the cut; the summarizer ran only for new turns.
                stored = await conversations.load(TENANT, "c1")
                assert stored.summary == fitted.summary and stored.summary_upto == cut
                if cut == summarized_before:
                    assert len(summarizer.calls) == calls_before
                else:
                    assert len(summarizer.calls) == calls_before + 1
                    call = summarizer.calls[-1]
                    # Incremental: only turns[previous cut:cut], folded into the previous summary.
                    assert call.tags == list(range(summarized_before, cut))
                    assert call.previous == (
                        conv.summary or "(none yet: these are the conversation's first turns)"
                    )
                    assert call.max_tokens == cap
                    # As many as fit: one exchange more would not have left the summary its room.
                    one_more = [*SYSTEM, summary_message(""), *conv.turns[cut - 2 :], *new]
                    assert tokens_of(tok, one_more) + cap > budget
            summarized_before = cut
            await conversations.append(TENANT, "c1", [*new, assistant(2 * step + 1)])
        # Every summarized turn went to the summarizer exactly once, in order.
        assert summarizer.tags == list(range(summarized_before))
        assert summarized_before > 40  # the summary covers most of the 80 turns

    run(go())


def test_cached_summary_is_reused_without_a_summarizer_call(conversations, tok):
    fitter = ContextFitter(conversations, max_summary_input_tokens=BIG)
    summarizer = FakeSummarizer()

    async def go():
        await fill(conversations, "c", 12)
        kwargs = dict(tenant=TENANT, conversation_id="c", system=SYSTEM, new=[user(100)], count=Counter(tok))
        first = await fitter.fit(**kwargs, budget=600, summarize=summarizer)
        assert first.summarized_turns > 0 and len(summarizer.calls) == 1
        again = await fitter.fit(**kwargs, budget=600, summarize=summarizer)
        assert again == first and len(summarizer.calls) == 1
        # A larger budget still starts at the cached cut: nothing new to summarize, no call.
        wider = await fitter.fit(**kwargs, budget=2000, summarize=summarizer)
        assert wider.summarized_turns == first.summarized_turns and wider.summary == first.summary
        assert len(summarizer.calls) == 1
        # A smaller budget cuts further and folds only the newly cut turns.
        narrow = await fitter.fit(**kwargs, budget=400, summarize=summarizer)
        assert narrow.summarized_turns > first.summarized_turns and len(summarizer.calls) == 2
        assert summarizer.calls[1].tags == list(range(first.summarized_turns, narrow.summarized_turns))
        assert summarizer.calls[1].previous == first.summary
        assert tokens_of(tok, narrow.messages) <= 400

    run(go())


def test_a_too_long_summary_is_cut_to_fit(conversations, tok):
    budget, cap = 400, 60
    fitter = ContextFitter(conversations, max_summary_tokens=cap, max_summary_input_tokens=BIG)
    long_reply = " ".join(f"fact{i} is {i * 7}" for i in range(2000))
    summarizer = FakeSummarizer(reply=long_reply)

    async def go():
        await fill(conversations, "c", 15)
        fitted = await fit(fitter, tok, budget=budget, summarize=summarizer)
        assert fitted.summary is not None and long_reply.startswith(fitted.summary)
        assert 0 < len(fitted.summary) < len(long_reply)
        assert not fitted.summary.endswith(" ")
        assert tokens_of(tok, fitted.messages) == fitted.prompt_tokens <= budget
        rest = fitted.messages[len(SYSTEM) + 1 :]
        own = tokens_of(tok, [*SYSTEM, summary_message(fitted.summary), *rest])
        empty = tokens_of(tok, [*SYSTEM, summary_message(""), *rest])
        assert own - empty <= cap
        # The summarizer was asked for at most cap tokens, and the cut summary is what is cached.
        assert summarizer.calls[0].max_tokens == cap
        stored = await conversations.load(TENANT, "c")
        assert stored.summary == fitted.summary and stored.summary_upto == fitted.summarized_turns

    run(go())


@pytest.mark.parametrize("mode", ["fails", "empty", "none"])
def test_without_a_working_summarizer_the_oldest_turns_are_dropped(conversations, tok, caplog, mode):
    fitter = ContextFitter(conversations)
    summarizer = {"fails": FakeSummarizer(fail=True), "empty": FakeSummarizer(reply="  "), "none": None}[mode]

    async def go():
        await fill(conversations, "c", 15)
        if mode == "none":
            # A cached summary is not used without a summarizer either: dropping is the mode.
            assert await conversations.save_summary(TENANT, "c", "old summary", 4, expected_revision=15)
        conv = await conversations.load(TENANT, "c")
        with caplog.at_level(logging.WARNING, logger="paved.gateway.orchestration.context"):
            fitted = await fit(fitter, tok, budget=300, summarize=summarizer)
        cut = fitted.summarized_turns
        assert cut > 0 and fitted.summary is None
        assert fitted.messages == [*SYSTEM, *conv.turns[cut:], user(100)]
        assert conv.turns[cut]["role"] == "user"
        assert tokens_of(tok, fitted.messages) == fitted.prompt_tokens <= 300
        # As many as fit: one exchange more would not.
        assert tokens_of(tok, [*SYSTEM, *conv.turns[cut - 2 :], user(100)]) > 300
        warned = [r for r in caplog.records if "summarizer failed" in r.getMessage()]
        assert len(warned) == (1 if mode == "fails" else 0)
        # Nothing was cached by a failed summary.
        stored = await conversations.load(TENANT, "c")
        assert stored.summary == conv.summary and stored.revision == conv.revision

    run(go())


class RefusingSummarizer(FakeSummarizer):
    """Answers the first `allowed` requests, then raises SummaryRefused (the caller's tokens/min
    budget is spent)."""

    def __init__(self, allowed: int) -> None:
        super().__init__()
        self.allowed = allowed
        self.refused = 0

    async def __call__(self, messages: list[dict], max_tokens: int) -> str:
        if len(self.calls) >= self.allowed:
            self.refused += 1
            raise SummaryRefused("tenant 'acme' has no tokens left")
        return await super().__call__(messages, max_tokens)


def test_a_refused_summarizer_drops_turns_without_a_warning(conversations, tok, caplog):
    fitter = ContextFitter(conversations)
    summarizer = RefusingSummarizer(allowed=0)

    async def go():
        await fill(conversations, "c", 15)
        conv = await conversations.load(TENANT, "c")
        with caplog.at_level(logging.INFO, logger="paved.gateway.orchestration.context"):
            fitted = await fit(fitter, tok, budget=300, summarize=summarizer)
        cut = fitted.summarized_turns
        assert summarizer.refused == 1 and summarizer.calls == []
        assert cut > 0 and fitted.summary is None
        assert fitted.messages == [*SYSTEM, *conv.turns[cut:], user(100)]
        ours = [r for r in caplog.records if r.name == "paved.gateway.orchestration.context"]
        assert not [r for r in ours if r.levelno >= logging.WARNING]
        assert any("may not run" in r.getMessage() for r in ours)
        assert (await conversations.load(TENANT, "c")).summary is None

    run(go())


def test_a_summarizer_refused_midway_keeps_what_it_folded(conversations, tok):
    # A tight input bound makes the catch-up take several calls; the second is refused.
    fitter = ContextFitter(conversations, max_summary_input_tokens=400)
    summarizer = RefusingSummarizer(allowed=1)

    async def go():
        await fill(conversations, "c", 30)
        fitted = await fit(fitter, tok, budget=500, summarize=summarizer)
        assert len(summarizer.calls) == 1 and summarizer.refused == 1
        # The first call's summary is sent and cached, covering only the turns it received.
        assert fitted.summary is not None and fitted.summary.startswith("The user and the assistant")
        stored = await conversations.load(TENANT, "c")
        assert stored.summary == fitted.summary and stored.summary_upto == len(summarizer.tags)
        assert 0 < stored.summary_upto < fitted.summarized_turns
        assert tokens_of(tok, fitted.messages) == fitted.prompt_tokens <= 500

    run(go())


# -- the summarizer's tokens are the tenant's ------------------------------------------------

SUMMARY_USAGE = {"prompt_tokens": 123, "completion_tokens": 9, "total_tokens": 132}


class FakeInternal(InternalClient):
    """The platform's answers to the gateway's own calls (with the usage an engine reports);
    records every call. No HTTP: `_post` is the one method that would reach a backend."""

    def __init__(self, router: Router, metrics: GatewayMetrics) -> None:
        super().__init__(router, lambda: None, metrics)  # type: ignore[arg-type,return-value]
        self.calls: list[tuple[str, str, dict]] = []

    async def _post(self, purpose: str, model: str, path: str, body: dict, timeout_s: float) -> Any:
        self.calls.append((purpose, model, body))
        assert path == "/v1/chat/completions"
        return {"choices": [{"message": {"content": "They discussed orders."}}], "usage": SUMMARY_USAGE}


def _orchestration(conversations: ConversationStore, tenant_limits: Limits):
    router = Router(
        parse_routes(
            {
                "models": [
                    {
                        "alias": "chat",
                        "max_model_len": 1200,
                        "summarizer": "summ",
                        "backends": [{"id": "c", "url": "http://127.0.0.1:9", "version": "v1"}],
                    },
                    {
                        "alias": "summ",
                        "max_model_len": 4000,
                        "backends": [{"id": "s", "url": "http://127.0.0.1:9", "version": "v1"}],
                    },
                ]
            }
        )
    )
    metrics = GatewayMetrics()
    internal = FakeInternal(router, metrics)
    orchestrator = Orchestrator(
        router=router,
        tokens=TokenCounter(),
        metrics=metrics,
        internal=internal,
        conversations=conversations,
        fitter=ContextFitter(conversations),
    )
    principal = Principal("k1", "key", Tenant("t1", TENANT, limits=tenant_limits))
    # A clock that stands still: no refill between the charge and the check.
    limiter = InProcessLimiter(clock=lambda: 1000.0)
    return orchestrator, internal, metrics, principal, limiter


async def _turn(orchestrator: Orchestrator, principal: Principal, limiter: InProcessLimiter) -> tuple:
    body = {"model": "chat", "messages": [*SYSTEM, user(100)], "max_tokens": 50, "conversation_id": "c"}
    route = orchestrator.router.route("chat")
    plan = await orchestrator.prepare(principal, "chat", body, "chat", route, {}, "r1", limiter=limiter)
    return plan, body


def _tokens_metric(metrics: GatewayMetrics, model: str, kind: str) -> float | None:
    return metrics.registry.get_sample_value(
        "paved_gateway_tokens_total", {"tenant": TENANT, "model": model, "kind": kind}
    )


def test_the_summarizers_tokens_are_charged_to_the_tenant(conversations):
    limits = Limits(requests_per_min=10, tokens_per_min=100_000, max_concurrent=1)
    orchestrator, internal, metrics, principal, limiter = _orchestration(conversations, limits)

    async def go():
        await fill(conversations, "c", 20)
        plan, body = await _turn(orchestrator, principal, limiter)
        calls = len(internal.calls)
        assert calls >= 1 and all(c[:2] == ("summary", "summ") for c in internal.calls)
        assert int(plan.headers["x-paved-context-summarized-turns"]) > 0
        assert any(m["content"].startswith(SUMMARY_HEADER) for m in body["messages"])
        tenant = (await limiter.snapshot(principal))["tenant"]
        # Exactly what the summarizer reported, on the tokens/min bucket only: the summary is
        # not a request of the tenant's, nor a concurrent slot.
        assert tenant["tokens_per_min"]["remaining"] == 100_000 - calls * SUMMARY_USAGE["total_tokens"]
        assert tenant["requests_per_min"]["remaining"] == 10
        assert tenant["max_concurrent"]["in_use"] == 0
        # Counted in the tenant's usage under the summarizer's alias.
        assert _tokens_metric(metrics, "summ", "prompt") == calls * SUMMARY_USAGE["prompt_tokens"]
        assert _tokens_metric(metrics, "summ", "completion") == calls * SUMMARY_USAGE["completion_tokens"]
        assert _tokens_metric(metrics, "chat", "prompt") is None

    run(go())


def test_a_tenant_without_tokens_left_gets_no_summary(conversations):
    orchestrator, internal, metrics, principal, limiter = _orchestration(
        conversations, Limits(tokens_per_min=2000)
    )

    async def go():
        await fill(conversations, "c", 20)
        await limiter.acquire(principal, 2000)  # the tenant's minute is spent
        plan, body = await _turn(orchestrator, principal, limiter)
        # No call was made; the oldest turns were dropped instead, and nothing more charged.
        assert internal.calls == []
        assert int(plan.headers["x-paved-context-summarized-turns"]) > 0
        assert not any(m["content"].startswith(SUMMARY_HEADER) for m in body["messages"])
        assert (await limiter.snapshot(principal))["tenant"]["tokens_per_min"]["remaining"] == 0
        assert _tokens_metric(metrics, "summ", "prompt") is None

    run(go())


def test_system_and_new_alone_over_the_budget_is_context_length_exceeded(conversations, tok):
    fitter = ContextFitter(conversations)
    big = {"role": "user", "content": " ".join(WORDS * 40)}
    need = tokens_of(tok, [*SYSTEM, big])

    async def go():
        await fill(conversations, "c", 2)
        with pytest.raises(GatewayError) as err:
            await fit(fitter, tok, budget=need - 1, summarize=FakeSummarizer(), new=[big])
        assert err.value.status == 400 and err.value.code == "context_length_exceeded"
        assert str(need) in err.value.message and str(need - 1) in err.value.message
        # Exactly at the budget it fits, every stored turn summarized or dropped.
        fitted = await fit(fitter, tok, budget=need, summarize=FakeSummarizer(), new=[big])
        assert fitted.messages == [*SYSTEM, big] and fitted.summarized_turns == 4
        assert fitted.prompt_tokens == need

    run(go())


def test_an_empty_conversation_is_the_request_itself(conversations, tok):
    summarizer = FakeSummarizer()

    async def go():
        fitted = await ContextFitter(conversations).fit(
            tenant=TENANT,
            conversation_id="fresh",
            system=SYSTEM,
            new=[user(0)],
            budget=500,
            count=Counter(tok),
            summarize=summarizer,
        )
        assert fitted == Fitted([*SYSTEM, user(0)], 0, tokens_of(tok, [*SYSTEM, user(0)]), None)
        assert summarizer.calls == []

    run(go())


def test_a_thousand_turns_take_a_logarithmic_number_of_counts_and_a_bounded_catch_up(conversations, tok):
    fitter = ContextFitter(conversations, max_summary_calls=4)
    summarizer = FakeSummarizer()

    async def go():
        await conversations.append(
            TENANT, "long", [m for k in range(500) for m in (user(2 * k, 3), assistant(2 * k + 1, 3))]
        )
        budget = 600
        dropping = Counter(tok)
        dropped = await fitter.fit(
            tenant=TENANT,
            conversation_id="long",
            system=SYSTEM,
            new=[user(5000)],
            budget=budget,
            count=dropping,
            summarize=None,
        )
        assert dropped.summarized_turns > 900 and tokens_of(tok, dropped.messages) <= budget
        assert dropping.calls <= 12  # base + log2(501 cuts) + 1, not one per turn

        counting = Counter(tok)
        first = await fitter.fit(
            tenant=TENANT,
            conversation_id="long",
            system=SYSTEM,
            new=[user(5000)],
            budget=budget,
            count=counting,
            summarize=summarizer,
        )
        assert tokens_of(tok, first.messages) <= budget and first.summary is not None
        # The ~1,000 turns to fold exceed one summarizer request (bounded by the budget): four
        # requests at most, each within the bound, and the catch-up resumes next time.
        assert len(summarizer.calls) == 4
        for call in summarizer.calls:
            assert call.tags and tokens_of(tok, call.messages) <= budget
        assert counting.calls <= 4 * 2 * 11 + 30
        stored = await conversations.load(TENANT, "long")
        covered = stored.summary_upto
        assert summarizer.tags == list(range(covered)) and covered < first.summarized_turns
        calls = len(summarizer.calls)
        while stored.summary_upto < first.summarized_turns:
            await fit(
                fitter, tok, budget=budget, summarize=summarizer, new=[user(5000)], conversation_id="long"
            )
            stored = await conversations.load(TENANT, "long")
            assert len(summarizer.calls) > calls  # progress on every fit
            calls = len(summarizer.calls)
        assert summarizer.tags == list(range(stored.summary_upto))

    run(go())


def test_a_summary_after_dropped_turns_stays_in_place(gateway_store, tok):
    async def go():
        conversations = ConversationStore(gateway_store, max_turns=8)
        await conversations.start()
        fitter = ContextFitter(conversations, max_summary_input_tokens=BIG)
        summarizer = FakeSummarizer()
        await fill(conversations, "c", 4)
        first = await fit(fitter, tok, budget=220, summarize=summarizer, new=[user(8)])
        assert first.summarized_turns >= 4
        await conversations.append(TENANT, "c", [user(8), assistant(9)])  # drops summarized turns
        conv = await conversations.load(TENANT, "c")
        assert len(conv.turns) <= 8 and conv.summary == first.summary
        again = await fit(fitter, tok, budget=5000, summarize=summarizer, new=[user(10)])
        # Even with room for every stored turn, the summary of the dropped ones is kept.
        assert again.summary == first.summary
        assert again.messages == [
            *SYSTEM,
            summary_message(first.summary),
            *conv.turns[conv.summary_upto :],
            user(10),
        ]

    run(go())


def test_fit_validates_its_inputs(conversations, tok):
    fitter = ContextFitter(conversations)

    async def go():
        for bad_id in ("", "a b", "x" * 129, "é", "a/b", None, 5):
            with pytest.raises(GatewayError) as err:
                await fit(fitter, tok, budget=500, summarize=None, new=[user(0)], conversation_id=bad_id)
            assert err.value.status == 400 and err.value.param == "conversation_id"
        with pytest.raises(GatewayError) as err:
            await fit(
                fitter,
                tok,
                budget=500,
                summarize=None,
                new=[{"role": "system", "content": "late system prompt"}],
            )
        assert err.value.status == 400 and err.value.param == "messages"

    run(go())


def test_summary_request_folds_turns_into_the_previous_summary():
    turns = [
        user(1),
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"function": {"name": "lookup", "arguments": '{"id": 42}'}}],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "order 42 shipped on 2024-05-01"},
        {"role": "user", "content": [{"type": "text", "text": "and the invoice?"}, {"type": "image_url"}]},
    ]
    messages = summary_request("The user is Ada, order 42.", turns, 128)
    assert [m["role"] for m in messages] == ["system", "user"]
    instructions, body = messages[0]["content"], messages[1]["content"]
    for needed in ("fact", "name", "number", "decision", "open question", "128 tokens"):
        assert needed in instructions
    assert "The user is Ada, order 42." in body
    assert 'lookup({"id": 42})' in body and "order 42 shipped on 2024-05-01" in body
    assert "and the invoice?" in body and "[image_url]" in body and "<t1>" in body
    assert "(none yet" in summary_request(None, turns, 64)[1]["content"]
    assert summary_message("s") == {"role": "system", "content": SUMMARY_HEADER + "s"}


# -- the store -----------------------------------------------------------------------------


def test_append_and_load_round_trip(conversations):
    async def go():
        empty = await conversations.load(TENANT, "c")
        assert empty == Conversation(TENANT, "c", (), None, 0, 0)
        tool_turn = {"role": "tool", "tool_call_id": "x", "content": "ünïcødé ✓"}
        after = await conversations.append(TENANT, "c", [user(0), assistant(1), tool_turn])
        assert after.turns == (user(0), assistant(1), tool_turn) and after.revision == 1
        assert await conversations.load(TENANT, "c") == after
        assert (await conversations.append(TENANT, "c", [])) == after

    run(go())


def test_tenants_never_see_each_others_conversations(conversations):
    async def go():
        await conversations.append("tenant-a", "shared-id", [user(0), assistant(1)])
        assert await conversations.save_summary("tenant-a", "shared-id", "A's secret", 2, expected_revision=1)
        b = await conversations.load("tenant-b", "shared-id")
        assert b.turns == () and b.summary is None and b.revision == 0
        assert not await conversations.save_summary("tenant-b", "shared-id", "B", 1, expected_revision=1)
        assert not await conversations.delete("tenant-b", "shared-id")
        await conversations.append("tenant-b", "shared-id", [user(7)])
        a = await conversations.load("tenant-a", "shared-id")
        assert a.turns == (user(0), assistant(1)) and a.summary == "A's secret" and a.revision == 2
        assert (await conversations.load("tenant-b", "shared-id")).turns == (user(7),)

    run(go())


def test_tenant_isolation_through_the_fitter(conversations, tok):
    fitter = ContextFitter(conversations)

    async def go():
        await fill(conversations, "same", 3, tenant="tenant-a")
        fitted = await fit(
            fitter,
            tok,
            budget=5000,
            summarize=FakeSummarizer(),
            new=[user(99)],
            conversation_id="same",
            tenant="tenant-b",
        )
        assert fitted.messages == [*SYSTEM, user(99)]

    run(go())


def test_fifty_concurrent_appends_lose_no_turn(conversations):
    async def go():
        results = await asyncio.gather(*(conversations.append(TENANT, "busy", [user(i)]) for i in range(50)))
        conv = await conversations.load(TENANT, "busy")
        assert sorted(t["content"] for t in conv.turns) == sorted(user(i)["content"] for i in range(50))
        assert conv.revision == 50
        # Each append saw its own turn last, on top of exactly the turns before it.
        assert sorted(r.revision for r in results) == list(range(1, 51))
        for r in results:
            assert r.turns == conv.turns[: r.revision]

    run(go())


def test_two_replicas_on_one_sqlite_file_lose_no_turn(tmp_path):
    async def go():
        stores = [GatewayStore(f"sqlite:///{tmp_path / 'shared.db'}") for _ in range(2)]
        await asyncio.gather(*(s.start() for s in stores))
        replicas = [ConversationStore(s) for s in stores]
        await asyncio.gather(*(r.start() for r in replicas))
        await asyncio.gather(
            *(replicas[i % 2].append(TENANT, "busy", [user(i), assistant(i)]) for i in range(50))
        )
        conv = await replicas[0].load(TENANT, "busy")
        assert len(conv.turns) == 100 and conv.revision == 50
        # Every exchange stayed together: appends never interleave.
        for k in range(0, 100, 2):
            assert conv.turns[k]["role"] == "user"
            assert conv.turns[k]["content"].split(" ")[0] == conv.turns[k + 1]["content"].split(" ")[0]
        await asyncio.gather(*(s.close() for s in stores))

    run(go())


def test_ids_and_messages_are_validated(conversations):
    async def go():
        assert CONVERSATION_ID_RE.fullmatch("user-42:session_7.a")
        for bad in ("", "a b", "x" * 129, "é", "a/b", "a\n", None, 5):
            for call in (
                conversations.load(TENANT, bad),
                conversations.append(TENANT, bad, [user(0)]),
                conversations.save_summary(TENANT, bad, "s", 1, expected_revision=1),
                conversations.delete(TENANT, bad),
            ):
                with pytest.raises(GatewayError) as err:
                    await call
                assert err.value.status == 400 and err.value.param == "conversation_id"
        assert await conversations.load(TENANT, "x" * 128) == Conversation(TENANT, "x" * 128, (), None, 0, 0)
        for bad_messages in (
            [{"role": "system", "content": "no"}],
            [{"content": "no role"}],
            ["not a dict"],
            [{"role": "user", "content": {1, 2}}],
            [{"role": "user", "content": float("nan")}],
            "a string",
        ):
            with pytest.raises(GatewayError) as err:
                await conversations.append(TENANT, "c", bad_messages)
            assert err.value.status == 400 and err.value.param == "messages"
        for bad_tenant in ("", "t" * 65, None):
            with pytest.raises(GatewayError) as err:
                await conversations.load(bad_tenant, "c")
            assert err.value.param == "tenant"
        assert (await conversations.load(TENANT, "c")).revision == 0  # nothing was written

    run(go())


def test_save_summary_is_compare_and_set(gateway_store):
    async def go():
        conversations = ConversationStore(gateway_store, max_turns=6)
        await conversations.start()
        assert not await conversations.save_summary(TENANT, "c", "s", 0, expected_revision=0)  # unknown
        await fill(conversations, "c", 2)
        conv = await conversations.load(TENANT, "c")
        assert await conversations.save_summary(TENANT, "c", "s2", 2, expected_revision=conv.revision)
        # summary_upto only grows
        assert not await conversations.save_summary(TENANT, "c", "again", 2, expected_revision=conv.revision)
        assert not await conversations.save_summary(TENANT, "c", "less", 1, expected_revision=conv.revision)
        # A concurrent append does not invalidate a summary of leading turns.
        await conversations.append(TENANT, "c", [user(4)])
        assert await conversations.save_summary(TENANT, "c", "s4", 4, expected_revision=conv.revision)
        state = await conversations.load(TENANT, "c")
        assert (state.summary, state.summary_upto, state.revision) == ("s4", 4, conv.revision + 3)
        with pytest.raises(GatewayError) as err:
            await conversations.save_summary(TENANT, "c", "too far", 9, expected_revision=state.revision)
        assert err.value.param == "upto"
        with pytest.raises(GatewayError):
            await conversations.save_summary(TENANT, "c", "", 5, expected_revision=state.revision)
        # Appending past max_turns drops the summarized turns: a summary computed from a load
        # before the drop indexes moved turns and is refused.
        before_drop = await conversations.load(TENANT, "c")
        await conversations.append(TENANT, "c", [assistant(5), user(6)])
        after_drop = await conversations.load(TENANT, "c")
        assert after_drop.turns == (assistant(1), user(2), assistant(3), user(4), assistant(5), user(6))
        assert after_drop.summary_upto == 3
        assert not await conversations.save_summary(
            TENANT, "c", "stale", 5, expected_revision=before_drop.revision
        )
        assert await conversations.save_summary(
            TENANT, "c", "fresh", 5, expected_revision=after_drop.revision
        )
        # A delete invalidates every earlier load, even once the id is reused.
        loaded = await conversations.load(TENANT, "c")
        assert await conversations.delete(TENANT, "c")
        assert not await conversations.delete(TENANT, "c")
        await fill(conversations, "c", 3)
        assert not await conversations.save_summary(
            TENANT, "c", "stale", 6, expected_revision=loaded.revision
        )
        reused = await conversations.load(TENANT, "c")
        assert reused.summary is None and len(reused.turns) == 6

    run(go())


def test_limits_drop_summarized_turns_else_refuse(gateway_store):
    async def go():
        conversations = ConversationStore(gateway_store, max_turns=6, max_bytes=4000)
        await conversations.start()
        await fill(conversations, "c", 3)
        with pytest.raises(GatewayError) as err:
            await conversations.append(TENANT, "c", [user(6)])
        assert err.value.status == 400 and err.value.message.startswith("conversation too long")
        assert err.value.code == "conversation_too_long" and err.value.param == "conversation_id"
        unchanged = await conversations.load(TENANT, "c")
        assert len(unchanged.turns) == 6 and unchanged.revision == 3
        assert await conversations.save_summary(TENANT, "c", "first four", 4, expected_revision=3)
        after = await conversations.append(TENANT, "c", [user(6), assistant(7)])
        # The two oldest (summarized) turns went; the summary now covers 2 of the stored turns.
        assert after.turns == (user(2), assistant(3), user(4), assistant(5), user(6), assistant(7))
        assert after.summary == "first four" and after.summary_upto == 2
        # More than the summary covers cannot be dropped.
        with pytest.raises(GatewayError):
            await conversations.append(TENANT, "c", [user(8), assistant(9), user(10)])
        # Bytes: one message over max_bytes is refused before the database.
        huge = {"role": "user", "content": "x" * 5000}
        with pytest.raises(GatewayError) as err:
            await conversations.append(TENANT, "other", [huge])
        assert err.value.code == "conversation_too_long"
        # Bytes over the limit drop summarized turns too.
        await conversations.append(TENANT, "bytes", [{"role": "user", "content": "y" * 1500}, assistant(1)])
        assert await conversations.save_summary(TENANT, "bytes", "the y's", 1, expected_revision=1)
        grown = await conversations.append(TENANT, "bytes", [{"role": "user", "content": "z" * 2600}])
        assert [t["role"] for t in grown.turns] == ["assistant", "user"] and grown.summary_upto == 0
        assert grown.summary == "the y's"

    run(go())


def test_conversations_expire_after_ttl(gateway_store):
    class Clock:
        now = datetime(2025, 1, 1, tzinfo=UTC)

        def __call__(self) -> datetime:
            return self.now

    clock = Clock()

    async def go():
        conversations = ConversationStore(gateway_store, ttl_s=60, now=clock)
        await conversations.start()
        await fill(conversations, "c", 2)
        assert await conversations.save_summary(TENANT, "c", "s", 2, expected_revision=2)
        clock.now += timedelta(seconds=59)
        await conversations.append(TENANT, "c", [user(4)])  # activity extends the TTL
        clock.now += timedelta(seconds=59)
        assert len((await conversations.load(TENANT, "c")).turns) == 5
        clock.now += timedelta(seconds=2)
        gone = await conversations.load(TENANT, "c")
        assert gone.turns == () and gone.summary is None
        assert not await conversations.save_summary(TENANT, "c", "late", 1, expected_revision=gone.revision)
        assert await conversations.purge_expired() == 0  # expired a second ago: within the grace period
        # Appending to an expired conversation starts it afresh.
        fresh = await conversations.append(TENANT, "c", [user(10)])
        assert fresh.turns == (user(10),) and fresh.summary is None and fresh.summary_upto == 0
        await fill(conversations, "old", 1)
        clock.now += timedelta(hours=2)
        assert await conversations.purge_expired() == 2
        assert await conversations.load(TENANT, "c") == Conversation(TENANT, "c", (), None, 0, 0)

    run(go())


# -- PostgreSQL ----------------------------------------------------------------------------

_db_names = itertools.count()


@pytest.fixture(scope="module")
def pg_server() -> Iterator[str]:
    from paved.testing.postgres import postgres_server

    with postgres_server() as url:
        yield url


def test_concurrent_appends_from_two_replicas_on_postgresql(pg_server):
    from paved.testing.postgres import create_database

    url = create_database(pg_server, f"conv_{next(_db_names)}")

    async def go():
        stores = [GatewayStore(url) for _ in range(2)]
        await asyncio.gather(*(s.start() for s in stores))
        replicas = [ConversationStore(s) for s in stores]
        await asyncio.gather(*(r.start() for r in replicas))
        # The first append creates the row: both replicas race to create it.
        await asyncio.gather(
            *(replicas[i % 2].append(TENANT, "busy", [user(i), assistant(i)]) for i in range(50))
        )
        conv = await replicas[1].load(TENANT, "busy")
        assert len(conv.turns) == 100 and conv.revision == 50
        assert sorted(t["content"] for t in conv.turns[::2]) == sorted(user(i)["content"] for i in range(50))
        for k in range(0, 100, 2):
            assert conv.turns[k]["content"].split(" ")[0] == conv.turns[k + 1]["content"].split(" ")[0]
        # Compare-and-set across replicas: one wins, the other's equal coverage is refused.
        wins = await asyncio.gather(
            *(
                r.save_summary(TENANT, "busy", f"by {i}", 10, expected_revision=50)
                for i, r in enumerate(replicas)
            )
        )
        assert sorted(wins) == [False, True]
        assert (await replicas[0].load("other-tenant", "busy")).turns == ()
        await asyncio.gather(*(s.close() for s in stores))

    run(go())


def test_recording_an_answer_never_fails_the_answered_request():
    """Orchestrator.complete runs after the client has its answer: a store refusing the record
    with anything, not only a GatewayError (PostgreSQL refusing a lone surrogate's UTF-8 in a
    conversation, say), is logged, and the request is not failed after the fact."""
    import json
    from types import SimpleNamespace

    from paved.gateway.orchestration.orchestrate import Orchestrator, Plan

    appended: list[str] = []

    class Refusing:
        async def append(self, tenant, conversation_id, messages):
            appended.append(conversation_id)
            raise UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed")

    orchestrator = SimpleNamespace(exact=None, semantic=None, conversations=Refusing(), recorder=None)
    plan = Plan(model="tiny", alias="tiny", endpoint="chat", tenant="t", conversation=("c1", []))
    answer = {"choices": [{"message": {"role": "assistant", "content": "\ud800"}}]}
    data = json.dumps(answer).encode()
    asyncio.run(Orchestrator.complete(orchestrator, plan, 200, data, 0.1))  # type: ignore[arg-type]
    assert appended == ["c1"] and plan.completed
