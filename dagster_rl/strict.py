"""The base of every settings record: unknown fields are errors, values never change after validation."""

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    """Settings: unknown fields are errors, values never change after validation."""

    model_config = ConfigDict(extra="forbid", frozen=True)
