"""Every kind of prompt source an experiment's `task.source` may be, chosen by its `kind`."""

from typing import Annotated

from pydantic import Field

from dagster_rl.tasks.lm.data.files import DataFilePrompts
from dagster_rl.tasks.lm.data.gym import ReasoningGymPrompts
from dagster_rl.tasks.lm.data.prompts import GSM8KPrompts, SyntheticPrompts

AnySource = SyntheticPrompts | GSM8KPrompts | DataFilePrompts | ReasoningGymPrompts
PromptSource = Annotated[AnySource, Field(discriminator="kind")]
