"""The policy: a base causal LM (frozen) plus a LoRA adapter (trained), and its checkpoints.

A checkpoint is a dict of file name -> bytes, the shape the artifact store keeps:

- `adapter_model.safetensors`, `adapter_config.json`: the adapter in PEFT's format (PEFT and vLLM
  load the folder as it is);
- `optimizer.safetensors`: AdamW's moments and step count per trainable parameter, by name;
- `trainer_state.json`: the adapter version, the base model and the LoRA settings.

Nothing random is left out: the LoRA init is seeded, and a train step draws nothing at random that
it does not seed itself, so loading a checkpoint and training on is bit-identical to never stopping.
The initial policy (version 0, no checkpoint) equals the base: LoRA B starts at 0.
"""

import json
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import LoraConfig, LoraModel, PeftModel, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from peft.tuners.lora import Linear as LoraLinear
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from dagster_rl.base.errors import DagsterRLError
from dagster_rl.base.hashing import canonical_json, content_hash, sha256_hex
from dagster_rl.tasks.lm.model.build import building, check_whole
from dagster_rl.tasks.lm.model.cpu_bf16 import check_bf16_cpu
from dagster_rl.tasks.lm.model.tiny import resolve_model
from dagster_rl.tasks.lm.settings import GRPOLMSettings, LoRASettings, PolicySettings

ADAPTER = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
OPTIMIZER = "optimizer.safetensors"
STATE = "trainer_state.json"
CHECKPOINT_FILES = (ADAPTER, ADAPTER_CONFIG, OPTIMIZER, STATE)
FORMAT = 1
ADAPTER_NAME = "default"  # PEFT's name of the one adapter a policy has
hf_logging.disable_progress_bar()


class CheckpointError(DagsterRLError):
    """A checkpoint is incomplete or does not fit the policy it is loaded into."""


@dataclass
class Policy:
    model: PeftModel
    tokenizer: PreTrainedTokenizerBase
    version: int
    settings: PolicySettings
    checkpointing: bool = False  # activation checkpointing of the decoder layers, on or off

    def trainable(self) -> list[tuple[str, torch.nn.Parameter]]:
        """The adapter's parameters, in a fixed order (the optimizer's order)."""
        return [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]

    def mode(self, training: bool) -> PeftModel:
        """The model in train or eval mode; a no-op when it is in it already (a switch walks every module)."""
        if self.model.training != training:
            self.model.train(training)
        return self.model

    def activation_checkpointing(self, on: bool) -> None:
        """Turn recomputation of the decoder layers' activations in the backward on or off."""
        if self.checkpointing != on:
            base = self.model.get_base_model()
            assert isinstance(base, PreTrainedModel)  # what `load_base` loads; PEFT types it as any module
            if on:
                base.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                base.activation_checkpointing_disable()
            self.checkpointing = on

    @contextmanager
    def merged(self) -> Iterator[PeftModel]:
        """The model with the adapter folded into new weight tensors, W + scale B A, until the block
        ends: what sampling runs, a forward without LoRA's small matmuls per layer. The base's own
        tensors are not touched and are put back after, so training and the reference see the base
        bit for bit. A float32 base only: in bfloat16 the fold would round the adapter's small delta
        away, so there the adapter stays apart. Sampled log-probs then differ from the trainer's
        unfolded forward by float rounding, which the ratio's tolerance covers."""
        layers = [m for m in self.model.modules() if isinstance(m, LoraLinear) and not m.merged]
        if self.settings.dtype != "float32" or self.model.training:
            yield self.model
            return
        folded = []
        try:
            with torch.no_grad():
                for layer in layers:
                    base = layer.get_base_layer()
                    weight = base.get_parameter("weight")
                    folded.append((layer, base, weight))
                    base.weight = torch.nn.Parameter(weight + layer.get_delta_weight(ADAPTER_NAME), requires_grad=False)
                    layer.merged_adapters.append(ADAPTER_NAME)
            yield self.model
        finally:
            for layer, base, weight in folded:
                base.weight = weight
                layer.merged_adapters.remove(ADAPTER_NAME)

    @contextmanager
    def adapter_disabled(self) -> Iterator[PeftModel]:
        """The base model: the adapter's layers off until the block ends. (PEFT's `disable_adapter()`
        does the same plus a status walk of the whole model each time, several times the cost of a
        forward of a small model.)"""
        lora = self.model.base_model
        assert isinstance(lora, LoraModel)  # what `attach_lora` wraps the base in; PEFT types it as any module
        lora.disable_adapter_layers()
        try:
            yield self.model
        finally:
            lora.enable_adapter_layers()


def load_base(base_model: str, dtype: str = "float32") -> tuple[torch.nn.Module, PreTrainedTokenizerBase]:
    if base_model.startswith(("/", "./", "../", "~")) and not Path(base_model).expanduser().is_dir():
        raise DagsterRLError(
            f"cannot load base model {base_model!r}: no such folder. Give a local model folder (config.json and weights), "
            "or a hub id that is in the local Hugging Face cache when HF_HUB_OFFLINE=1."
        )
    try:
        path = resolve_model(base_model)
        with building():
            model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
            tokenizer = AutoTokenizer.from_pretrained(path)
    except OSError as e:
        raise DagsterRLError(
            f"cannot load base model {base_model!r}: {str(e).rstrip('.')}. Give a local model folder, or a hub id that is "
            "in the local Hugging Face cache when HF_HUB_OFFLINE=1."
        ) from None
    check_whole(model, base_model)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def lora_config(lora: LoRASettings) -> LoraConfig:
    """PEFT's config of the adapter the settings describe (B initialized to 0)."""
    return LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,  # type: ignore[arg-type]  # PEFT annotates int; it scales by lora_alpha / r, a float works
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
        init_lora_weights=True,
    )


def attach_lora(model: torch.nn.Module, lora: LoRASettings) -> PeftModel:
    """Wrap `model` with a fresh adapter: A drawn from lora.init_seed (global RNG untouched), B = 0."""
    hidden = getattr(getattr(model, "config", None), "hidden_size", None)
    if isinstance(hidden, int) and lora.rank > hidden:  # sizes multiply: rank x hidden per adapted matrix
        raise DagsterRLError(
            f"policy.lora.rank {lora.rank} is more than the base model's hidden size {hidden}: the adapter would be larger "
            f"than the layers it adapts (see dagster_rl.base.bounds). Use a rank of at most {hidden}."
        )
    config = lora_config(lora)
    with building(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(lora.init_seed)
        try:
            with warnings.catch_warnings():  # peft 0.21 reads transformers' deprecated `is_gradient_checkpointing`
                warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
                return get_peft_model(model, config)
        except ValueError as e:
            raise DagsterRLError(f"cannot attach LoRA to this model: {e}. Check lora.target_modules.") from None


def resolve_device(setting: str, index: int | None = None) -> torch.device:
    """`policy.device` as a torch device: auto is cuda when this process sees a GPU, else cpu.
    `index`: the GPU of this process (its LOCAL_RANK under torchrun); default the current one."""
    if setting == "cpu":
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device() if index is None else index)
    if setting == "cuda":
        raise DagsterRLError(
            "policy.device is cuda but this process sees no GPU (torch.cuda.is_available() is False); "
            "set policy.device to auto or cpu, or run where a GPU and a CUDA build of torch are"
        )
    return torch.device("cpu")


def load_policy(
    settings: PolicySettings, checkpoint: dict[str, bytes] | None = None, device: torch.device | None = None
) -> Policy:
    """The base with the checkpoint's adapter, or with a fresh one (version 0) when there is none, on
    `device` (default: the settings' device)."""
    device = device or resolve_device(settings.device)
    if settings.dtype == "bfloat16" and device.type == "cpu":
        check_bf16_cpu("policy.dtype")
    base, tokenizer = load_base(settings.base_model, settings.dtype)
    model = attach_lora(base, settings.lora)  # on the CPU: LoRA A is drawn from the CPU generator everywhere
    model.to(device)
    policy = Policy(model=model, tokenizer=tokenizer, version=0, settings=settings)
    if checkpoint is not None:
        load_adapter(policy, checkpoint)
    return policy


def load_adapter(policy: Policy, checkpoint: dict[str, bytes]) -> Policy:
    """Put the checkpoint's adapter and version into a loaded policy (the base stays as it is):
    the same policy, bit for bit, as loading the base afresh with that checkpoint."""
    state = read_state(checkpoint)
    version = state["version"]
    lora = policy.settings.lora.model_dump(mode="json")
    if state["lora"] != lora:
        raise CheckpointError(
            f"checkpoint v{version} was trained with LoRA settings {state['lora']}, not {lora}; load it with the settings it was made with"
        )
    adapter = load_safetensors(checkpoint[ADAPTER])
    trainable = len(policy.trainable())
    if len(adapter) != trainable:
        raise CheckpointError(f"checkpoint adapter holds {len(adapter)} tensors for the policy's {trainable} adapter weights")
    result = set_peft_model_state_dict(policy.model, adapter)
    unexpected = list(getattr(result, "unexpected_keys", []) or [])
    if unexpected:
        raise CheckpointError(f"checkpoint adapter has weights this model lacks: {unexpected[:3]}...")
    policy.version = version
    return policy


def make_optimizer(policy: Policy, grpo: GRPOLMSettings, checkpoint: dict[str, bytes] | None = None) -> torch.optim.AdamW:
    """AdamW over the adapter, with the checkpoint's moments and step counts when given."""
    named = policy.trainable()
    opt = torch.optim.AdamW(
        [p for _, p in named],
        lr=grpo.learning_rate,
        betas=grpo.betas,
        eps=grpo.adam_eps,
        weight_decay=grpo.weight_decay,
        foreach=False,
    )
    if checkpoint is not None and checkpoint.get(OPTIMIZER):
        tensors = load_safetensors(checkpoint[OPTIMIZER])
        saved = {k.rsplit("::", 1)[0] for k in tensors}
        names = {n for n, _ in named}
        if saved and saved != names:
            raise CheckpointError(
                f"optimizer state names {len(saved)} parameters that do not match the adapter's {len(names)}; "
                "the checkpoint belongs to another LoRA layout"
            )
        sd = opt.state_dict()
        sd["state"] = {
            i: {k: tensors[f"{n}::{k}"].clone() for k in ("step", "exp_avg", "exp_avg_sq")}
            for i, (n, _) in enumerate(named)
            if f"{n}::step" in tensors
        }
        opt.load_state_dict(sd)
    return opt


def checkpoint_bytes(policy: Policy, optimizer: torch.optim.Optimizer | None) -> dict[str, bytes]:
    """The policy's adapter, optimizer state and version as file name -> bytes."""
    adapter = {
        k: v.detach().cpu().contiguous() for k, v in get_peft_model_state_dict(policy.model, save_embedding_layers=False).items()
    }
    moments: dict[str, torch.Tensor] = {}
    if optimizer is not None:
        index = {id(p): n for n, p in policy.trainable()}
        for p, st in optimizer.state.items():
            for k in ("step", "exp_avg", "exp_avg_sq"):
                moments[f"{index[id(p)]}::{k}"] = st[k].detach().cpu().contiguous()
    peft_config = policy.model.peft_config[ADAPTER_NAME].to_dict()
    state = {
        "format": FORMAT,
        "version": policy.version,
        "base_model": policy.settings.base_model,
        "lora": policy.settings.lora.model_dump(mode="json"),
    }
    return {
        ADAPTER: save_safetensors(adapter),
        ADAPTER_CONFIG: json.dumps(peft_config, sort_keys=True, indent=2, default=_jsonable).encode(),
        OPTIMIZER: save_safetensors(moments),
        STATE: canonical_json(state),
    }


def checkpoint_hash(files: dict[str, bytes]) -> str:
    """The content hash of a checkpoint: of its files' sha256 by name."""
    return content_hash({name: sha256_hex(data) for name, data in sorted(files.items())})


def _jsonable(value):
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    raise TypeError(f"{type(value).__name__} is not JSON")


def read_state(checkpoint: dict[str, bytes]) -> dict:
    missing = [f for f in CHECKPOINT_FILES if f not in checkpoint]
    if missing:
        raise CheckpointError(f"checkpoint lacks {missing}; it holds {sorted(checkpoint)}. Re-run the step that wrote it.")
    state = json.loads(checkpoint[STATE])
    if state.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint format {state.get('format')} is not {FORMAT}, the one this code reads")
    return state


def save_checkpoint(directory: Path | str, files: dict[str, bytes]) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (directory / name).write_bytes(data)
    return directory


def load_checkpoint(directory: Path | str) -> dict[str, bytes]:
    directory = Path(directory)
    files = {name: (directory / name).read_bytes() for name in CHECKPOINT_FILES if (directory / name).exists()}
    read_state(files)
    return files
