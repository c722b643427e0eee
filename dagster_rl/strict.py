"""The base of every settings record: unknown fields are errors, numbers are finite, values never
change after validation."""

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    """Settings: unknown fields are errors, numbers are finite (no inf, no nan), values never change
    after validation."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
