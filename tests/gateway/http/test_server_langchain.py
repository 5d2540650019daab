"""LangChain's OpenAI chat model against the server, on the real SmolLM2: `with_structured_output`
(a JSON schema from a pydantic model, sent as response_format) gives a valid object, and
`bind_tools` with a required or named tool_choice gives tool calls whose arguments follow the
tool's schema."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, Field

from server_helpers import MODEL, real_server


class Person(BaseModel):
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=120)


def get_weather(city: str, days: int) -> str:
    """The weather in a city over the next days."""
    return "sunny"


@pytest.fixture(scope="module")
def llm():
    from langchain_openai import ChatOpenAI

    with real_server("--max-model-len", "1024") as server:
        yield ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model=MODEL, temperature=0.7, seed=3,
                         frequency_penalty=0.5, max_tokens=200)


@pytest.mark.slow
def test_with_structured_output_gives_the_pydantic_object(llm):
    person = llm.with_structured_output(Person).invoke("Describe a person.")
    assert isinstance(person, Person) and 0 <= person.age <= 120


@pytest.mark.slow
@pytest.mark.parametrize("tool_choice", ["required", "get_weather"])
def test_bind_tools_gives_tool_calls_with_typed_arguments(llm, tool_choice):
    message = llm.bind_tools([get_weather], tool_choice=tool_choice).invoke("Weather in Paris this week?")
    (call,) = message.tool_calls
    assert call["name"] == "get_weather"
    assert isinstance(call["args"]["city"], str) and isinstance(call["args"]["days"], int)
