"""One trial's turn loop: its environment in its sandbox, and its one growing token sequence.

An `Episode` does not sample: whoever samples (the in-process batch of `agent.rollout_hf`, one turn
of every live trial per forward pass; or, on a server, one request per turn of this trial) asks it
for the ids to continue (`ids`) and the turn's seed (`turn_seed`), and hands back what was sampled
(`advance`). The episode appends the sampled ids as they are, gives their decoded text to the
environment, and appends the environment's answer in the chat template's turn markers (mask 0).

Turn t of a trial draws from `seed_of(trial seed, "turn", t)`: a retried trial replays its turns.
The turn budget ends an episode as `turn_budget` (a trajectory); the environment's own exception, or
a trial that outlives its timeout, is a failure of the trial (`TrialFailed`: retried, never cached).
The sandbox is made fresh when the episode starts and removed when it closes, however it ends.
"""

import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from dagster_rl.core.hashing import seed_of
from dagster_rl.tasks.agent.chat import ChatTurns
from dagster_rl.tasks.agent.environment import EnvironmentSettings, EnvironmentSpec, TextEnvironment, World
from dagster_rl.tasks.agent.records import AgentTrajectory, EpisodeRequest, Turn


class TrialTimeout(TimeoutError):
    """A trial ran longer than `task.episode.trial_timeout_s`."""


class Episode:
    def __init__(
        self,
        request: EpisodeRequest,
        spec: EnvironmentSpec,
        settings: EnvironmentSettings,
        chat: ChatTurns,
        max_turns: int,
        timeout_s: float,
        sandbox_root: Path,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.request, self.chat, self.max_turns, self.timeout_s, self.clock = request, chat, max_turns, timeout_s, clock
        self.started = clock()
        sandbox_root.mkdir(parents=True, exist_ok=True)
        self.sandbox = Path(tempfile.mkdtemp(prefix=f"{request.trial_id}-", dir=sandbox_root))
        self.env: TextEnvironment | None = None
        try:
            self.env = spec.make(settings, World(request.world_id, request.world_seed), request.seed, self.sandbox)
            self.first_observation = self.env.reset()
        except BaseException:
            self.close()
            raise
        self.prompt_ids = chat.prompt(self.first_observation)
        self.completion: list[int] = []
        self.mask: list[int] = []
        self.logprobs: list[float] = []
        self.turns: list[Turn] = []
        self.end_reason: str | None = None

    @property
    def live(self) -> bool:
        return self.end_reason is None

    @property
    def ids(self) -> list[int]:
        """The sequence the next action continues."""
        return [*self.prompt_ids, *self.completion]

    @property
    def seconds_left(self) -> float:
        """What is left of the trial's time limit (`task.episode.trial_timeout_s`)."""
        return self.timeout_s - (self.clock() - self.started)

    @property
    def turn_seed(self) -> int:
        return seed_of(self.request.seed, "turn", len(self.turns))

    def advance(self, sampled: list[int], logprobs: list[float], finish_reason: str) -> None:
        """One turn: the sampled ids (as sampled) and their log-probs; the environment's answer."""
        if not self.live or self.env is None:
            raise RuntimeError(f"trial {self.request.trial_id} has ended ({self.end_reason}); it takes no more turns")
        if len(sampled) != len(logprobs):
            raise ValueError(f"{len(sampled)} sampled ids with {len(logprobs)} log-probs")
        start = len(self.completion)
        self.completion += sampled
        self.mask += [1] * len(sampled)
        self.logprobs += logprobs
        action = str(self.chat.tokenizer.decode(sampled, skip_special_tokens=True))  # one sequence: one string
        outcome = self.env.step(action)
        end = len(self.completion)
        if outcome.done:
            self.end_reason = outcome.end_reason or "done"
        elif len(self.turns) + 1 >= self.max_turns:
            self.end_reason = "turn_budget"
        else:
            following = self.chat.after_action(sampled, outcome.observation)
            self.completion += following
            self.mask += [0] * len(following)
        self.turns.append(
            Turn(
                action_start=start,
                action_end=end,
                observation_end=len(self.completion),
                action=action,
                finish_reason=finish_reason,
                tool=outcome.tool,
                argument=outcome.argument,
                observation=outcome.observation,
            )
        )
        self.check_time()

    def check_time(self) -> None:
        """A `TrialTimeout` once the trial has run longer than its timeout."""
        if self.seconds_left < 0:
            raise TrialTimeout(
                f"trial {self.request.trial_id} ran longer than its timeout of {self.timeout_s} s (task.episode.trial_timeout_s)"
            )

    def trajectory(self, temperature: float, top_p: float, behavior_version: int) -> AgentTrajectory:
        """The finished episode's record (with the environment's verdict)."""
        if self.live or self.env is None:
            raise RuntimeError(f"trial {self.request.trial_id} has not ended")
        r = self.request
        return AgentTrajectory(
            trial_id=r.trial_id,
            step=r.step,
            prompt=r.prompt,
            sample=r.sample,
            world_id=r.world_id,
            seed=r.seed,
            first_observation=self.first_observation,
            prompt_token_ids=self.prompt_ids,
            completion_token_ids=self.completion,
            completion_mask=self.mask,
            sampling_logprobs=self.logprobs,
            turns=self.turns,
            end_reason=self.end_reason or "done",
            verdict=self.env.verdict(),
            temperature=temperature,
            top_p=top_p,
            behavior_version=behavior_version,
        )

    def close(self) -> None:
        """Close the environment and remove the sandbox (both, whatever the first raises)."""
        try:
            if self.env is not None:
                self.env.close()
        finally:
            shutil.rmtree(self.sandbox, ignore_errors=True)
