"""LangChain's `ChatOpenAI.with_structured_output` against a real `brine serve`: `json_schema` (its default),
and `function_calling` (a forced named tool call) return the pydantic object. (`json_mode` promises JSON, not
the schema, so a small model's answer may not validate: not tested here; json_object is in
test_e2e_structured.)"""

from __future__ import annotations

import langchain_openai
import pytest
from e2e_server import BrineServer
from pydantic import BaseModel, Field


class City(BaseModel):
    """A city and its country."""

    name: str
    country: str
    population_millions: int = Field(ge=0, le=50)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output_returns_the_pydantic_object(brine_server: BrineServer, method: str) -> None:
    llm = langchain_openai.ChatOpenAI(
        model=brine_server.model,
        base_url=f"{brine_server.base_url}/v1",
        api_key=brine_server.api_key,
        max_retries=0,
        temperature=0,
        max_tokens=120,
    )
    structured = llm.with_structured_output(City, method=method)
    city = structured.invoke("Describe Paris as JSON with name, country and population_millions.")
    assert isinstance(city, City)
