"""The base of every settings record: unknown fields are errors, numbers are finite and are numbers
(never text or booleans coerced), values never change after validation.

Pydantic's configuration does three of these (`extra="forbid"`, `allow_inf_nan=False`,
`frozen=True`: "Extra inputs are not permitted", "Input should be a finite number"). Numbers are
checked here, because pydantic's strict mode (`strict=True`, `StrictInt`, `StrictFloat`) is another
rule: it refuses a whole float for an int (`seed: 5e3` in YAML is 5000 here), and, model-wide, a
list for a tuple (YAML has no tuples: `target_modules`, `ops`, `tolerations` come as lists); and
its "Input should be a valid integer" does not say what to do, where this names the value and the
fix ("a number is required, not the text '4': write it without quotes")."""

import types
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError, ValidationError


def _numeric(annotation: Any) -> bool:
    """Whether a field's type is a number (int, float, or an optional or annotated one)."""
    if annotation in (int, float):
        return True
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _numeric(args[0])
    if origin in (typing.Union, types.UnionType):
        kinds = [a for a in args if a is not type(None)]
        return bool(kinds) and all(_numeric(a) for a in kinds)
    return False


def _numeric_items(annotation: Any) -> bool:
    """Whether a field is a tuple or list of numbers (e.g. Adam's betas)."""
    if typing.get_origin(annotation) not in (tuple, list):
        return False
    return all(_numeric(a) for a in typing.get_args(annotation) if a is not Ellipsis)


def _not_a_number(value: Any) -> str | None:
    """Why `value`, given for a number, is refused (text and booleans are not coerced), or None."""
    if isinstance(value, bool):
        return f"a number is required, not the boolean {value!r}"
    if isinstance(value, str):
        return f"a number is required, not the text {value!r}: write it without quotes"
    return None


class Strict(BaseModel):
    """Settings: unknown fields are errors, numbers are finite (no inf, no nan) and are numbers (text
    such as `n_steps: "4"` is refused, not coerced), values never change after validation."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _numbers_are_numbers(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        errors = []
        for name, value in data.items():
            field = cls.model_fields.get(name) if isinstance(name, str) else None
            if field is None:
                continue  # an unknown field: refused as such
            items: list[tuple[tuple[str | int, ...], Any]]
            if _numeric(field.annotation):
                items = [((name,), value)]
            elif _numeric_items(field.annotation) and isinstance(value, (list, tuple)):
                items = [((name, i), item) for i, item in enumerate(value)]
            else:
                continue
            for loc, item in items:
                if (why := _not_a_number(item)) is not None:
                    errors.append(InitErrorDetails(type=PydanticCustomError("number_type", why), loc=loc, input=item))
        if errors:
            raise ValidationError.from_exception_data(cls.__name__, errors)
        return data


class Record(BaseModel):
    """The base of every stored record: unknown fields are errors."""

    model_config = ConfigDict(extra="forbid")
