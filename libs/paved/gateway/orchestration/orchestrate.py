"""The orchestration and cache layers: what happens to a request between admission and
forwarding, and to its answer on the way back.

Per request, in this order (each step only when configured and asked for):
  1. an A/B experiment running on the alias assigns an arm (sticky by user or key hash), which
     may pin a model version, choose a template and override sampling parameters;
  2. the request's `template` (or the arm's, the route's, the tenant's default) renders in the
     sandbox; the tenant's system prompt goes first;
  3. `conversation_id` loads the conversation and fits it to the model's context (max_model_len
     minus the completion budget, counted with the model's own tokenizer), older turns replaced
     by a summary the route's `summarizer` model writes through the platform;
  4. the version that will serve is fixed ("alias@version"), so caches are keyed by it;
  5. after admission: the exact cache, then the semantic cache (the last user message embedded
     by the route's `embedding_model` through the platform, looked up in the index of exactly
     this tenant and scope); a hit is answered without an engine;
  6. on a complete 200 answer: cached (exact and semantic), appended to the conversation, and
     recorded for the experiment's arm; errors are recorded for the arm and never cached.

Extension fields (`template`, `variables`, `conversation_id`, `cache`) are removed before the
body goes upstream. `Cache-Control: no-cache` skips the lookup (the fresh answer is stored);
`no-store` skips both.

Invariants:
- A cache hit only ever comes from the same tenant, model version, template version,
  response_format, sampling parameters and earlier turns (see paved.gateway.caching.cache).
- The caches never fail a request: an embedding or cache-store outage is a miss.
- The gateway's own calls (summaries, embeddings) go through the router to the platform's
  backends with deadlines (metered in `paved_gateway_internal_call_duration_seconds`), and their
  tokens are the caller's: each call first reserves its prompt + max_tokens from the key's and
  tenant's tokens/min buckets (`Limiter.acquire(..., tokens_only=True)`: no request counted, no
  concurrent slot) and settles with the usage it reports, which is also counted in
  `paved_gateway_tokens` under the summarizer's or embedding model's alias. A refused
  reservation skips the call as if it had failed: the summary stops (the oldest turns are
  dropped) and the semantic lookup is a miss; the request itself goes on to its own admission.
- A conversation is appended before the answer's last byte reaches the client, so a client
  that sends its next turn as soon as it has read the answer sees its previous turn.
- Operator configuration that does not resolve never fails a request with a client error:
  a route's `template` (or the tenant's default_template, or an arm's template) that the
  registry does not have is skipped, falling through to the next of them, and an experiment
  arm whose version no longer appears in the alias's routes is not applied (the request is
  routed as if no experiment ran, and is not recorded for the arm). Each is logged once per
  replica and counted in `paved_gateway_misconfigured_total{kind, model}`. A template the
  client names itself stays a 404 (template_not_found).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import aiohttp
import anyio
import numpy as np

from paved.gateway.caching import cache as cachelib
from paved.gateway.errors import GatewayError

if TYPE_CHECKING:
    from paved.gateway.access.limits import Limiter, Reservation
    from paved.gateway.experiments.experiments import Arm, Experiment, ExperimentRecorder, ExperimentRegistry
    from paved.gateway.metrics import GatewayMetrics
    from paved.gateway.orchestration.context import ContextFitter, ConversationStore
    from paved.gateway.orchestration.templates import PromptTemplate, TemplateRegistry
    from paved.gateway.orchestration.tokens import PromptCount, TokenCounter
    from paved.gateway.routing.router import Router
    from paved.gateway.routing.routes import CachePolicy, ModelRoute
    from paved.gateway.types import Principal

logger = logging.getLogger("paved.gateway")

EXTENSION_FIELDS = ("template", "variables", "conversation_id", "cache")
_INTERNAL_KEY = "paved-internal"
# Distinct misconfigurations warned about per orchestrator (past this they are only counted).
_MAX_WARNED = 1000


@dataclass(frozen=True)
class ChatAnswer:
    text: str
    prompt_tokens: int | None  # the answer's reported usage (None when it reported none)
    completion_tokens: int | None


@dataclass(frozen=True)
class Embedding:
    vector: np.ndarray  # unit length
    prompt_tokens: int | None


class _Refused(Exception):
    """The caller's token limits refuse an internal call on its behalf."""


class InternalClient:
    """The gateway's own calls through the platform: routed like any request (router pick,
    begin/end, another backend on a connect error), with a deadline on every call."""

    def __init__(
        self,
        router: Router,
        session: Callable[[], aiohttp.ClientSession],
        metrics: GatewayMetrics,
        *,
        timeout_s: float = 30.0,
        embed_timeout_s: float = 5.0,
    ):
        self._router = router
        self._session = session
        self._metrics = metrics
        self._timeout_s = timeout_s
        self._embed_timeout_s = embed_timeout_s
        self._context: dict[tuple[str, str], int] = {}

    async def _post(self, purpose: str, model: str, path: str, body: dict[str, Any], timeout_s: float) -> Any:
        started = time.perf_counter()
        excluded: set[str] = set()
        outcome = "error"
        try:
            for _ in range(2):
                pick = self._router.pick(model, sticky_key=_INTERNAL_KEY, exclude=excluded)
                backend = pick.backend
                payload = {**body, "model": backend.upstream_model}
                self._router.begin(backend.id)
                ok = True
                try:
                    async with asyncio.timeout(timeout_s):
                        async with self._session().post(
                            backend.url + path, json=payload, headers={"x-paved-internal": purpose}
                        ) as resp:
                            data = await resp.read()
                            ok = resp.status < 500 or resp.status == 503
                            if resp.status != 200:
                                raise GatewayError(
                                    502, f"{purpose} call answered {resp.status}", code="internal_call_failed"
                                )
                            try:
                                answer = json.loads(data)
                            except ValueError:
                                # A 200 that is not JSON (a proxy's error page) fails like a 5xx:
                                # as a GatewayError, which is what the callers' fallbacks catch.
                                ok = False
                                raise GatewayError(
                                    502,
                                    f"{purpose} call answered a body that is not JSON",
                                    code="internal_call_failed",
                                ) from None
                            outcome = "ok"
                            return answer
                except (aiohttp.ClientConnectionError, OSError) as e:
                    ok = False
                    if isinstance(e, TimeoutError) and not isinstance(e, aiohttp.ClientError):
                        # The call's own deadline (TimeoutError is an OSError): spent, not to be
                        # spent again on another backend.
                        raise GatewayError(
                            504, f"{purpose} call timed out", code="internal_call_failed"
                        ) from None
                    excluded.add(backend.id)
                    logger.warning(
                        "%s call to %s failed (%s); trying another backend", purpose, backend.id, e
                    )
                except aiohttp.ClientError as e:
                    # A body cut off before its Content-Length (ClientPayloadError) and the like.
                    ok = False
                    raise GatewayError(
                        502, f"{purpose} call failed: {type(e).__name__}", code="internal_call_failed"
                    ) from None
                finally:
                    self._router.end(backend.id, ok=ok)
            raise GatewayError(502, f"{purpose} call found no backend", code="internal_call_failed")
        finally:
            self._metrics.internal.labels(purpose, outcome).observe(time.perf_counter() - started)

    async def chat(
        self, model: str, messages: list[dict[str, Any]], max_tokens: int, *, temperature: float = 0.0
    ) -> ChatAnswer:
        body = {"messages": messages, "max_tokens": max_tokens, "temperature": temperature}
        answer = await self._post("summary", model, "/v1/chat/completions", body, self._timeout_s)
        try:
            content = answer["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise GatewayError(
                502, "the summarizer's answer has no message", code="internal_call_failed"
            ) from None
        usage = _usage(answer)
        return ChatAnswer(
            content if isinstance(content, str) else "",
            _int(usage.get("prompt_tokens")),
            _int(usage.get("completion_tokens")),
        )

    async def embed(self, model: str, text: str) -> Embedding:
        answer = await self._post(
            "embedding", model, "/v1/embeddings", {"input": text}, self._embed_timeout_s
        )
        try:
            vector = np.asarray(answer["data"][0]["embedding"], dtype=np.float32)
        except (KeyError, IndexError, TypeError, ValueError):
            raise GatewayError(
                502, "the embedding answer has no vector", code="internal_call_failed"
            ) from None
        norm = float(np.linalg.norm(vector))
        if vector.ndim != 1 or not np.isfinite(norm) or norm == 0:
            raise GatewayError(
                502, "the embedding model returned an unusable vector", code="internal_call_failed"
            )
        return Embedding(vector / norm, _int(_usage(answer).get("prompt_tokens")))

    async def max_model_len(self, model: str) -> int | None:
        """The serving backend's context length as its /v1/models reports it (cached per
        backend and upstream model)."""
        pick = self._router.pick(model, sticky_key=_INTERNAL_KEY)
        backend = pick.backend
        key = (backend.id, backend.upstream_model)
        if key in self._context:
            return self._context[key]
        try:
            async with asyncio.timeout(self._embed_timeout_s):
                async with self._session().get(backend.url + "/v1/models") as resp:
                    listing = json.loads(await resp.read()) if resp.status == 200 else {}
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
            return None
        cards = listing.get("data") if isinstance(listing, dict) else None
        for card in cards if isinstance(cards, list) else []:
            if isinstance(card, dict) and card.get("id") == backend.upstream_model:
                value = card.get("max_model_len")
                if isinstance(value, int) and value > 0:
                    self._context[key] = value
                    return value
        return None


@dataclass
class Plan:
    """What `Orchestrator.prepare` decided for one request; read by the proxy."""

    model: str  # what the router picks for ("alias" or "alias@version")
    alias: str
    endpoint: str
    tenant: str
    request_id: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    template: str | None = None  # the rendered template's "name@N"
    conversation: tuple[str, list[dict[str, Any]]] | None = None  # (id, the turn's new messages)
    experiment: tuple[Experiment, Arm] | None = None
    policy: CachePolicy | None = None
    keys: cachelib.CacheKeys | None = None
    lookup: bool = False
    store: bool = False
    vector: np.ndarray | None = None
    completed: bool = False
    # Whom the gateway's own calls for this request are charged to (None: not charged).
    principal: Principal | None = field(default=None, repr=False)
    limiter: Limiter | None = field(default=None, repr=False)

    @property
    def capture(self) -> bool:
        """Whether the proxy must hand the answer back (cache, conversation or experiment)."""
        return self.store or self.conversation is not None or self.experiment is not None


@dataclass(frozen=True)
class Hit:
    answer: cachelib.CachedAnswer
    header: str  # x-paved-cache
    entry: str  # x-paved-cache-entry: what a false-hit report names


@dataclass
class Orchestrator:
    router: Router
    tokens: TokenCounter
    metrics: GatewayMetrics
    internal: InternalClient
    templates: TemplateRegistry | None = None
    conversations: ConversationStore | None = None
    fitter: ContextFitter | None = None
    exact: cachelib.ExactCache | None = None
    semantic: cachelib.SemanticCache | None = None
    # Signs x-paved-cache-entry ids; the server passes one over the state store (shared secret).
    entry_ids: cachelib.EntryIds = field(default_factory=cachelib.EntryIds)
    experiments: ExperimentRegistry | None = None
    recorder: ExperimentRecorder | None = None
    default_max_tokens: int = 256
    _warned: set[tuple[str, ...]] = field(default_factory=set, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.experiments is not None:
            router = self.router
            self.experiments.bind(lambda alias: router.table.models.get(alias), self.templates)

    def _misconfiguration(self, kind: str, model: str, detail: tuple[str, ...], message: str) -> None:
        """Count a request served around configuration that did not resolve; warn once."""
        self.metrics.misconfigured.labels(kind, model).inc()
        key = (kind, model, *detail)
        if key not in self._warned and len(self._warned) < _MAX_WARNED:
            self._warned.add(key)
            logger.warning(
                "%s (further occurrences are counted in paved_gateway_misconfigured_total)", message
            )

    async def start(self) -> None:
        for part in (self.entry_ids, self.templates, self.conversations, self.experiments, self.recorder):
            if part is not None:
                await part.start()

    async def stop(self) -> None:
        if self.recorder is not None:
            await self.recorder.stop()

    # -- before admission --------------------------------------------------------------------
    async def prepare(
        self,
        principal: Principal,
        endpoint: str,
        body: dict[str, Any],
        model: str,
        route: ModelRoute,
        headers: Mapping[str, str],
        request_id: str = "",
        limiter: Limiter | None = None,
    ) -> Plan:
        """Apply experiments, templates and conversation context to `body` (in place) and
        decide the caches; GatewayError(400) for bad extension fields. The tokens of the calls
        made for this request (summaries, embeddings) are charged to `principal` on `limiter`."""
        extension = {name: body.pop(name) for name in EXTENSION_FIELDS if name in body}
        alias, pinned = self.router.split_model(model)
        tenant = principal.tenant.name
        plan = Plan(
            model=model,
            alias=alias,
            endpoint=endpoint,
            tenant=tenant,
            request_id=request_id,
            principal=principal,
            limiter=limiter,
        )
        chat = endpoint == "chat"
        for name in ("template", "variables", "conversation_id"):
            if name in extension and not chat:
                raise GatewayError(400, f"{name} applies only to chat completions", param=name)
        opt_in = extension.get("cache")
        if opt_in is not None and not isinstance(opt_in, bool):
            raise GatewayError(400, "cache must be true or false", param="cache")
        user = body.get("user")
        sticky = user if isinstance(user, str) else principal.key_id

        template_ref = extension.get("template")
        arm_template: str | None = None
        if template_ref is not None and not isinstance(template_ref, str):
            raise GatewayError(400, "template must be a string: name or name@version", param="template")
        if self.experiments is not None and endpoint in ("chat", "completions"):
            experiment = await self.experiments.running_for(tenant, alias)
            if experiment is not None and pinned is None:
                from paved.gateway.experiments.experiments import assign, unit_key

                unit = unit_key(
                    experiment,
                    tenant=tenant,
                    key_id=principal.key_id,
                    user=user if isinstance(user, str) else None,
                )
                arm = assign(experiment, unit)
                if arm.version is not None and arm.version not in route.versions:
                    # Checked when the experiment was created; the version has left the
                    # routes since. Serving the alias as usual beats a 404 for this user, and
                    # the arm's numbers must not count requests it did not serve.
                    self._misconfiguration(
                        "arm_version",
                        alias,
                        (experiment.name, arm.name, arm.version),
                        f"experiment '{experiment.name}' arm '{arm.name}' pins {alias}@{arm.version}, "
                        f"which is not in the routes; serving '{alias}' without the experiment",
                    )
                else:
                    plan.experiment = (experiment, arm)
                    plan.headers["x-paved-experiment"] = f"{experiment.name};arm={arm.name}"
                    if arm.version is not None:
                        plan.model = f"{alias}@{arm.version}"
                    if arm.template is not None and template_ref is None and chat:
                        arm_template = arm.template
                    body.update(dict(arm.params))

        if chat:
            await self._render(
                plan, principal, body, template_ref, extension.get("variables"), route, arm_template
            )
            if "conversation_id" in extension:
                await self._fit(plan, body, extension["conversation_id"], route)

        version = self.router.resolve_version(plan.model, sticky_key=str(sticky))
        policy = route.cache
        if policy is None or endpoint not in ("chat", "completions") or opt_in is False:
            return plan
        cache_control = (headers.get("cache-control") or "").lower()
        if version is None or not cachelib.is_deterministic(body, opt_in=opt_in is True):
            plan.headers["x-paved-cache"] = "bypass"
            return plan
        plan.model = f"{alias}@{version}"
        plan.policy = policy
        plan.keys = cachelib.cache_keys(
            tenant=tenant, model=plan.model, template=plan.template, endpoint=endpoint, body=body
        )
        plan.store = "no-store" not in cache_control and (policy.exact or policy.semantic)
        plan.lookup = plan.store and "no-cache" not in cache_control
        if not plan.lookup:
            plan.headers["x-paved-cache"] = "bypass"
        return plan

    async def _render(
        self,
        plan: Plan,
        principal: Principal,
        body: dict[str, Any],
        ref: str | None,
        variables: Any,
        route: ModelRoute,
        arm_template: str | None = None,
    ) -> None:
        """Render the client's template `ref` (a 404 when it does not exist) or, naming none,
        the first configured one that exists: the arm's, the route's, the tenant's default."""
        if self.templates is None:
            if ref is not None or variables is not None:
                raise GatewayError(400, "this gateway has no template registry", param="template")
            return
        prompting = await self.templates.tenant_prompting(plan.tenant)
        configured = [
            (kind, r)
            for kind, r in (
                ("arm_template", arm_template),
                ("route_template", route.template),
                ("tenant_template", prompting.default_template),
            )
            if r
        ]
        if variables is not None and ref is None and not configured:
            raise GatewayError(400, "variables need a template", param="variables")
        messages = body.get("messages")
        if messages is None and (ref is not None or configured):
            messages = []
        if not isinstance(messages, list):
            return  # the upstream answers the real validation error
        template: PromptTemplate | None = None
        if ref is not None:
            template = await self.templates.get(ref)
        else:
            for kind, configured_ref in configured:
                try:
                    template = await self.templates.get(configured_ref)
                    break
                except GatewayError as exc:
                    if exc.status != 404:
                        raise
                    self._misconfiguration(
                        kind,
                        plan.alias,
                        (configured_ref,),
                        f"the {kind.replace('_', ' ')} '{configured_ref}' of '{plan.alias}' does not "
                        "exist in the template registry; skipping it",
                    )
        if template is None and body.get("messages") is None:
            return  # every configured template was skipped: as if none were configured
        if template is not None:
            rendered = await self.templates.render(template, {} if variables is None else variables)
            messages = [*rendered, *messages]
            plan.template = template.ref
            plan.headers["x-paved-template"] = template.ref
        if prompting.system_prompt:
            messages = [{"role": "system", "content": prompting.system_prompt}, *messages]
        body["messages"] = messages

    async def _fit(self, plan: Plan, body: dict[str, Any], conversation_id: Any, route: ModelRoute) -> None:
        if self.fitter is None or self.conversations is None:
            raise GatewayError(400, "this gateway keeps no conversations", param="conversation_id")
        from paved.gateway.orchestration.context import CONVERSATION_ID_RE

        if not isinstance(conversation_id, str) or not CONVERSATION_ID_RE.fullmatch(conversation_id):
            raise GatewayError(
                400, f"conversation_id must match {CONVERSATION_ID_RE.pattern}", param="conversation_id"
            )
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise GatewayError(400, "messages must be a list of objects", param="messages")
        lead = 0
        while lead < len(messages) and messages[lead].get("role") in ("system", "developer"):
            lead += 1
        system, new = messages[:lead], messages[lead:]
        if not new:
            raise GatewayError(400, "a conversation turn needs at least one new message", param="messages")
        max_model_len = route.max_model_len or await self.internal.max_model_len(plan.model)
        if max_model_len is None:
            raise GatewayError(
                503,
                f"the context length of '{plan.alias}' is unknown: set max_model_len on its route",
                code="context_unavailable",
            )
        completion = body.get("max_completion_tokens", body.get("max_tokens"))
        if not isinstance(completion, int) or isinstance(completion, bool) or completion < 0:
            completion = self.default_max_tokens
            body.setdefault("max_tokens", completion)
        budget = max_model_len - completion
        if budget <= 0:
            raise GatewayError(
                400,
                f"max_tokens {completion} leaves no room for a prompt in the model's context "
                f"({max_model_len} tokens)",
                param="max_tokens",
                code="context_length_exceeded",
            )
        tokenizer = route.tokenizer

        async def count(msgs: list[dict[str, Any]]) -> int:
            return (await self.tokens.count(tokenizer, "chat", {"messages": msgs}, 1)).tokens

        summarize = None
        summarizer_context = None
        if route.summarizer is not None:
            summarizer = route.summarizer
            temperature = route.summarizer_temperature or 0.0
            summarizer_route = self.router.route(summarizer)
            summarizer_context = summarizer_route.max_model_len or await self.internal.max_model_len(
                summarizer
            )

            async def summarize(msgs: list[dict[str, Any]], max_tokens: int) -> str:
                from paved.gateway.orchestration.context import SummaryRefused

                prompt = await self.tokens.count(summarizer_route.tokenizer, "chat", {"messages": msgs}, 1)
                try:
                    reservation = await self._reserve(plan, _reservation_size(prompt) + max_tokens)
                except _Refused as e:
                    raise SummaryRefused(str(e)) from None
                answer: ChatAnswer | None = None
                try:
                    answer = await self.internal.chat(summarizer, msgs, max_tokens, temperature=temperature)
                finally:
                    usage = None if answer is None else (answer.prompt_tokens, answer.completion_tokens)
                    await self._settle(plan, reservation, summarizer, usage)
                return answer.text

        fitted = await self.fitter.fit(
            tenant=plan.tenant,
            conversation_id=conversation_id,
            system=system,
            new=new,
            budget=budget,
            count=count,
            summarize=summarize,
            summarizer_context=summarizer_context,
        )
        body["messages"] = fitted.messages
        plan.conversation = (conversation_id, new)
        plan.headers["x-paved-context-summarized-turns"] = str(fitted.summarized_turns)
        plan.headers["x-paved-context-tokens"] = str(fitted.prompt_tokens)
        if fitted.summarized_turns:
            self.metrics.summarized_turns.labels(plan.alias).inc(fitted.summarized_turns)

    # -- after admission ---------------------------------------------------------------------
    async def lookup(self, plan: Plan) -> Hit | None:
        """The cached answer for this request, if any (never raises)."""
        if not plan.lookup or plan.keys is None or plan.policy is None:
            return None
        policy, keys = plan.policy, plan.keys
        if policy.exact and self.exact is not None:
            answer = await self.exact.get(keys.exact)
            if answer is not None:
                self.metrics.cache.labels(plan.tenant, plan.alias, "exact").inc()
                return Hit(answer, "exact", self.entry_ids.exact(plan.tenant, keys.exact))
        if policy.semantic and self.semantic is not None and keys.text and policy.embedding_model:
            try:
                plan.vector = await self._embed(plan, policy.embedding_model, keys.text)
            except GatewayError as e:
                logger.warning("semantic cache skipped: %s", e.message)
            except _Refused as e:
                logger.info("semantic cache skipped: %s", e)
            if plan.vector is not None:
                hit = await self.semantic.lookup(plan.tenant, keys.scope, plan.vector, policy.threshold)
                if hit is not None:
                    self.metrics.cache.labels(plan.tenant, plan.alias, "semantic").inc()
                    entry = self.entry_ids.semantic(plan.tenant, hit.entry_id)
                    return Hit(hit.answer, f"semantic;score={hit.score:.4f}", entry)
        self.metrics.cache.labels(plan.tenant, plan.alias, "miss").inc()
        plan.headers["x-paved-cache"] = "miss"
        return None

    # -- the gateway's own calls, charged to the caller --------------------------------------
    async def _embed(self, plan: Plan, model: str, text: str) -> np.ndarray:
        tokenizer = self.router.route(model).tokenizer
        need = _reservation_size(await self.tokens.count(tokenizer, "embeddings", {"input": text}, 1))
        reservation = await self._reserve(plan, need)
        answer: Embedding | None = None
        try:
            answer = await self.internal.embed(model, text)
        finally:
            usage = None if answer is None else (answer.prompt_tokens, 0)
            await self._settle(plan, reservation, model, usage)
        return answer.vector

    async def _reserve(self, plan: Plan, need: int) -> Reservation | None:
        """`need` tokens from the caller's tokens/min buckets; _Refused when they cannot give
        them (or the limiter is down: an internal call is never made unmetered)."""
        if plan.limiter is None or plan.principal is None:
            return None
        try:
            return await plan.limiter.acquire(plan.principal, need, tokens_only=True)
        except GatewayError as e:
            raise _Refused(e.message) from None

    async def _settle(
        self,
        plan: Plan,
        reservation: Reservation | None,
        model: str,
        usage: tuple[int | None, int | None] | None,
    ) -> None:
        """Settle an internal call with the (prompt, completion) tokens it reported; `usage`
        None: it failed, and is refunded like a request that failed before its usage was known.
        A call that ran but reported no prompt tokens keeps its whole reservation charged."""
        used: int | None = None
        if usage is not None:
            prompt, completion = usage
            alias = self.router.split_model(model)[0]  # a pinned "alias@version": its alias
            if prompt is not None:
                self.metrics.tokens.labels(plan.tenant, alias, "prompt").inc(prompt)
            if completion:
                self.metrics.tokens.labels(plan.tenant, alias, "completion").inc(completion)
            if prompt is not None:
                used = prompt + (completion or 0)
            elif reservation is not None:
                used = reservation.tokens
        if reservation is None or plan.limiter is None:
            return
        try:
            # Shielded like the proxy's own settle: a request cancelled during the call would
            # otherwise leave the whole reservation charged.
            with anyio.CancelScope(shield=True):
                await plan.limiter.finish(reservation, used)
        except GatewayError as e:
            logger.warning("could not settle reservation %s: %s", reservation.id, e.message)

    async def complete(self, plan: Plan, status: int, data: bytes | None, latency_s: float) -> None:
        """Record an answer (once): cache it when complete, append it to the conversation,
        count it for the experiment's arm. Never raises."""
        if plan.completed:
            return
        plan.completed = True
        good = data is not None and cachelib.is_cacheable_answer(status, data)
        answer = _json(data) if data is not None and status == 200 else None
        try:
            if good and data is not None and plan.store and plan.keys is not None and plan.policy is not None:
                cached = cachelib.CachedAnswer(data, time.time())
                if plan.policy.exact and self.exact is not None:
                    await self.exact.put(plan.keys.exact, cached, plan.policy.ttl_s)
                if plan.policy.semantic and self.semantic is not None and plan.vector is not None:
                    await self.semantic.insert(
                        plan.tenant, plan.keys.scope, plan.vector, cached, ttl_s=plan.policy.ttl_s
                    )
            if plan.conversation is not None and answer is not None and self.conversations is not None:
                message = _assistant_message(answer)
                if message is not None:
                    conversation_id, new = plan.conversation
                    await self.conversations.append(plan.tenant, conversation_id, [*new, message])
        except GatewayError as e:
            logger.warning("could not record the answer of a %s request: %s", plan.alias, e.message)
        except Exception:  # the answer is the client's already: a store's refusal must not fail it
            # (e.g. a backend's text with a lone surrogate, which PostgreSQL's UTF-8 refuses)
            logger.exception("could not record the answer of a %s request", plan.alias)
        if plan.experiment is not None and self.recorder is not None:
            usage = answer.get("usage") if isinstance(answer, dict) else None
            usage = usage if isinstance(usage, dict) else {}
            experiment, arm = plan.experiment
            self.recorder.record(
                experiment,
                arm,
                tenant=plan.tenant,
                request_id=plan.request_id,
                latency_s=latency_s,
                prompt_tokens=_int(usage.get("prompt_tokens")),
                completion_tokens=_int(usage.get("completion_tokens")),
                error=status != 200 or answer is None,
            )


def _json(data: bytes) -> dict[str, Any] | None:
    try:
        value = json.loads(data)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _assistant_message(answer: dict[str, Any]) -> dict[str, Any] | None:
    choices = answer.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return None
    message = choices[0].get("message")
    if not isinstance(message, dict):
        return None
    kept: dict[str, Any] = {"role": "assistant", "content": message.get("content") or ""}
    if message.get("tool_calls"):
        kept["tool_calls"] = message["tool_calls"]
    return kept


def _usage(answer: Any) -> dict[str, Any]:
    usage = answer.get("usage") if isinstance(answer, dict) else None
    return usage if isinstance(usage, dict) else {}


def _int(value: Any) -> int | None:
    """A reported token count: a non-negative int, else None (as if not reported)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _reservation_size(count: PromptCount) -> int:
    """What an internal call reserves for its prompt. Without a tokenizer the count is the
    byte upper bound, 3-4x the tokens of typical text: reserved whole it would refuse every
    summary of a long conversation to a tenant whose tokens/min is below that bound, so a
    quarter of it is reserved and the call is settled with the usage it reports."""
    return count.tokens if count.exact else -(-count.tokens // 4)
