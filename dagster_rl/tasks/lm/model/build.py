"""Building a model, one thread at a time: transformers patches process-wide state while it builds.

For as long as `from_pretrained` (and `from_config`) builds a model, transformers 5 replaces
process-wide objects and puts back, at the end, what it found when it started:
`PreTrainedModel.tie_weights` by a no-op, the `torch.nn.init` functions by no-ops, and torch's
default dtype by the model's. Two threads that build at once interleave those patches. The one that
enters second saves the first one's no-op as "the original" and puts it back as it leaves, so
`tie_weights` stays a no-op for the life of the process: a model with tied embeddings (SmolLM2,
Qwen2.5-0.5B) then loads with `lm_head.weight` untied and left on the meta device, in that load and
in every later one (measured: transformers 5.24, two threads). A model built meanwhile in another
thread (a PEFT adapter's LoRA init too) would draw its weights under the other's patches.

In the driver the held-out evaluation of step k loads a policy in a thread while step k+1's
rollouts load theirs; `dagster-rl serve` loads adapters while it answers. So every construction of
a model or adapter in this package holds `BUILD_LOCK` (`building()`), and a loaded base is checked
whole (`check_whole`): no weight on the meta device, tied weights tied.
"""

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from transformers import PreTrainedModel

from dagster_rl.base.errors import DagsterRLError

BUILD_LOCK = threading.RLock()  # re-entrant: a build may build (PEFT over a base, a conversion)


@contextmanager
def building() -> Iterator[None]:
    """Hold the process's model-building lock for the block."""
    with BUILD_LOCK:
        yield


def check_whole(model: PreTrainedModel, name: str) -> None:
    """Refuse a model with a weight left on the meta device, or with embeddings its config ties
    that are not the same tensor."""
    meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]
    if meta:
        raise DagsterRLError(
            f"model {name!r} loaded with {len(meta)} weights on the meta device (no data), e.g. {meta[:3]}: the checkpoint "
            "lacks them, or another thread built a model at the same time without dagster_rl.tasks.lm.model.build.building()"
        )
    config = getattr(model, "config", None)
    get_text_config = getattr(config, "get_text_config", None)
    text = get_text_config() if callable(get_text_config) else config
    if getattr(text, "tie_word_embeddings", False):
        out, inp = model.get_output_embeddings(), model.get_input_embeddings()
        if out is not None and inp is not None and out.weight is not inp.weight:
            raise DagsterRLError(
                f"model {name!r} ties its word embeddings (tie_word_embeddings: true) but loaded them as two tensors: "
                "another thread built a model at the same time without dagster_rl.tasks.lm.model.build.building()"
            )
