"""The instance's stateless `POST /v1/responses` with the official openai client over the
simulated engine: a whole answer, the typed stream the SDK parses, a json_schema text format,
and 400s naming what only the gateway serves (stored responses, background, chaining)."""

from __future__ import annotations

import json

import openai
import pytest
from servers import ServerProcess

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}},
    "required": ["name"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def client():
    server = ServerProcess("--engine", "sim://tiny?tokens_per_s=5000", ready_timeout_s=120)
    try:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    finally:
        server.terminate()


def test_whole_and_streamed_answers(client):
    whole = client.responses.create(model="tiny", input="hi", instructions="Be brief.", max_output_tokens=6)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.store is False and len(whole.output_text) > 0
    assert whole.usage.output_tokens == 6
    with client.responses.create(
        model="tiny", input=[{"role": "user", "content": "yo"}], max_output_tokens=4, stream=True
    ) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added",
    ]  # fmt: skip
    assert kinds[-4:] == [
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.incomplete",
    ]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert events[-1].response.output_text == deltas


def test_json_schema_text_format_is_structured_output(client):
    answer = client.responses.create(
        model="tiny", input="name?", max_output_tokens=200,
        text={"format": {"type": "json_schema", "name": "n", "schema": SCHEMA, "strict": True}},
    )  # fmt: skip
    assert set(json.loads(answer.output_text)) == {"name"}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("store", True),
        ("background", True),
        ("previous_response_id", "resp_x"),
        ("reasoning", {"effort": "low"}),
    ],
)
def test_what_only_the_gateway_serves_is_a_400_naming_it(client, field, value):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="tiny", input="hi", extra_body={field: value})
    assert e.value.body["param"] == field
