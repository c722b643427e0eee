"""The records of a language-model agent's step: episodes planned, and one trajectory per trial.

A trajectory is ONE growing token sequence: the first prompt (the chat template around the
environment's first observation), then, turn after turn, the ids the model sampled, exactly as
sampled (never decoded and re-encoded), and the environment's answer wrapped in the chat template's
turn markers. `completion_mask` says which is which: 1 on the model's sampled ids, 0 on the turn
markers and observations. The sampler's log-probability of each sampled id is kept (in order, one
per 1 of the mask), so the trainer's loss, its `on_policy` check and its KL read the mask, never
the text. Each turn's boundaries in the sequence, its action text, the tool call the environment
read in it and the environment's answer are kept for people (and for the judge, with the
environment's verdict).

The field names the trainer reads are a single-turn rollout's (`dagster_rl.tasks.lm.records.LMRollout`):
`prompt_token_ids`, `completion_token_ids`, `sampling_logprobs`, `temperature`, with the mask
beside them.
"""

from pydantic import Field, model_validator

from dagster_rl.core.records import Record
from dagster_rl.tasks.agent.environment import JudgeValue


class EpisodeRequest(Record):
    """One planned trial: the world it plays and its seed (each turn's draws are seeded from it)."""

    trial_id: str  # s{step}-p{prompt}-n{sample}
    step: int
    prompt: int  # the world's index in its step: the GRPO group
    sample: int
    world_id: str
    world_seed: int
    seed: int


class ToolCall(Record):
    """A program the environment ran in the trial's sandbox during a turn (a tool call): what ran,
    what it printed (each stream as kept: `*_cut` bytes more were not) and how it ended
    (`dagster_rl.sandbox.calls`). Its wall time is kept beside the trajectory, not in it."""

    program: str  # the Python source, or the command's arguments joined by spaces
    stdout: str
    stderr: str
    stdout_cut: int
    stderr_cut: int
    exit_status: int | None
    signal: int | None
    outcome: str  # exit, timeout, memory, output_limit, file_size, disk_limit, killed


class Turn(Record):
    """One turn: the action's sampled ids are completion_token_ids[action_start:action_end], the
    turn markers and observation after it [action_end:observation_end] (empty on the last turn)."""

    action_start: int
    action_end: int
    observation_end: int
    action: str  # the sampled ids decoded (special tokens dropped): what the environment read
    finish_reason: str  # stop: the model ended its turn; length: the per-turn token budget cut it
    tool: str | None  # the tool call the environment read in the action (None: none)
    argument: str | None
    observation: str  # the environment's answer (not in the sequence when the episode ended on this turn)
    # the programs the environment ran for this turn; absent from the record when none ran (every turn of
    # an environment without tools reads as it did before programs ran in sandboxes)
    calls: list[ToolCall] = Field(default_factory=list, exclude_if=lambda calls: not calls)


class AgentTrajectory(Record):
    trial_id: str
    step: int
    prompt: int
    sample: int
    world_id: str
    seed: int
    first_observation: str
    prompt_token_ids: list[int]
    completion_token_ids: list[int]  # every turn's action and observation ids, in order
    completion_mask: list[int]  # 1 on the sampled ids, 0 on turn markers and observations
    sampling_logprobs: list[float]  # one per sampled id: log softmax(logits / temperature), before top-p
    turns: list[Turn]
    end_reason: str  # the environment's (answered, bad_action, ...) or turn_budget
    verdict: dict[str, JudgeValue]  # what the environment gives the judge: `success` at least
    temperature: float
    top_p: float
    behavior_version: int

    @model_validator(mode="after")
    def _consistent(self) -> "AgentTrajectory":
        if len(self.completion_mask) != len(self.completion_token_ids):
            raise ValueError(f"{len(self.completion_mask)} mask values for {len(self.completion_token_ids)} completion ids")
        if sum(self.completion_mask) != len(self.sampling_logprobs):
            raise ValueError(f"{len(self.sampling_logprobs)} sampling log-probs for {sum(self.completion_mask)} sampled ids")
        return self

    @property
    def token_ids(self) -> list[int]:
        """The whole sequence: prompt, then every turn."""
        return [*self.prompt_token_ids, *self.completion_token_ids]

    @property
    def mask(self) -> list[int]:
        """The whole sequence's mask: 0 on the prompt, then the completion's."""
        return [0] * len(self.prompt_token_ids) + list(self.completion_mask)

    @property
    def n_turns(self) -> int:
        return len(self.turns)

    @property
    def success(self) -> bool:
        return bool(self.verdict.get("success", False))


class AgentReward(Record):
    trial_id: str
    step: int
    prompt: int
    world_id: str
    correct: bool  # the environment's verdict: the episode succeeded
    turns: int
    end_reason: str
    components: dict[str, float]
    reward: float
