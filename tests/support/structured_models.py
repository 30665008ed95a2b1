"""The pydantic models that structured-output requests are checked against, in the tests and in bench/structured.py.

A nested schema with what a grammar must get right: a pattern, an integer range, an enum, an
array with bounds of enums, a nested object, and no extra keys anywhere. Only pydantic here,
so bench/structured.py imports it (as tests.support.structured_models, as bench/abuse.py imports
tests.support.router) without taking in any test machinery.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class Address(BaseModel):
    model_config = ConfigDict(extra="forbid")
    city: str = Field(max_length=24)
    postcode: str = Field(pattern=r"^[0-9]{5}$")


class Person(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[A-Z][a-z]{1,11}$")
    age: int = Field(ge=18, le=99)
    role: Literal["engineer", "artist", "doctor"]
    skills: list[Literal["python", "painting", "surgery", "go"]] = Field(min_length=1, max_length=3)
    address: Address
