"""The reference policy of the KL term: the base (the adapter switched off) or the warm-up's adapter.

`kl_reference: base` (the default) is the original base model: the adapter's layers switched off
(`Policy.adapter_disabled`), no extra weights. `kl_reference: sft` is the supervised warm-up's adapter (`lm.warmup`), loaded beside the
trained one as a second, frozen PEFT adapter named `reference`; its forwards switch the active
adapter to it and back. Switching makes PEFT flip `requires_grad` of both adapters, and switching
back flips it back, so the trainable parameters (and the optimizer's view of them) are unchanged.
"""

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

from peft import set_peft_model_state_dict
from safetensors.torch import load as load_safetensors

from dagster_rl.tasks.lm.model.policy import ADAPTER, CheckpointError, Policy, lora_config, read_state

REFERENCE = "reference"
BEHAVIOR = "behavior"  # the behavior weights' adapter of a stale step (grpo.mismatch)
Reference = Callable[[], AbstractContextManager]  # enter: forwards of the model are the reference's


def base_reference(policy: Policy) -> Reference:
    return policy.adapter_disabled


def adapter_reference(policy: Policy, checkpoint: dict[str, bytes], name: str = REFERENCE) -> Reference:
    """Load `checkpoint`'s adapter as the frozen adapter `name` (`reference`: the KL term's;
    `behavior`: the weights that sampled a stale step, `lm.train.corrections`); return how to switch
    to it. The trainable parameters stay the trained adapter's."""
    what = "the KL reference adapter" if name == REFERENCE else f"the {name} adapter"
    state = read_state(checkpoint)
    if state["lora"] != policy.settings.lora.model_dump(mode="json"):
        raise CheckpointError(
            f"{what} was made with LoRA settings {state['lora']}, the policy has "
            f"{policy.settings.lora.model_dump(mode='json')}: a warm-up and its GRPO steps share one adapter layout"
        )
    model = policy.model
    active = model.active_adapter
    if name not in model.peft_config:
        trainable = [n for n, _ in policy.trainable()]
        model.add_adapter(name, lora_config(policy.settings.lora))
        model.set_adapter(active)  # only the trained adapter requires grad, as before
        if [n for n, _ in policy.trainable()] != trainable:
            raise CheckpointError(f"loading {what} changed the trainable parameters")
    result = set_peft_model_state_dict(model, load_safetensors(checkpoint[ADAPTER]), adapter_name=name)
    unexpected = list(getattr(result, "unexpected_keys", []) or [])
    if unexpected:
        raise CheckpointError(f"{what} has weights this model lacks: {unexpected[:3]}...")

    @contextmanager
    def switched() -> Iterator[None]:
        model.set_adapter(name)
        try:
            yield
        finally:
            model.set_adapter(active)

    return switched


def reference_of(policy: Policy, checkpoint: dict[str, bytes] | None) -> Reference:
    """The base when `checkpoint` is None, else that checkpoint's adapter."""
    return base_reference(policy) if checkpoint is None else adapter_reference(policy, checkpoint)
