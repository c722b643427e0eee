"""The engine of `dagster-rl serve`: the base model, its tokenizer, the LoRA adapters loaded by name
(from allowed folders only, each load complete or undone), and the generation of one batch with
the `hf` rollout backend's sampler, continuing the KV cache of any sequence it served that the
request's prompt begins with (`prefix_cache`)."""

import logging
import os
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from http import HTTPStatus
from pathlib import Path
from typing import Any, cast

import torch
from peft import PeftModel
from peft.tuners.tuners_utils import BaseTunerLayer
from transformers import PreTrainedModel

from dagster_rl.inference.server_process import ADAPTER_ROOTS_ENV
from dagster_rl.tasks.lm.model.build import building
from dagster_rl.tasks.lm.model.policy import ADAPTER, ADAPTER_CONFIG, load_base
from dagster_rl.tasks.lm.rollout.kv_cache import BatchKV
from dagster_rl.tasks.lm.rollout.sampling import generate_cached
from dagster_rl.tasks.lm.serve.batcher import BatchCancelled
from dagster_rl.tasks.lm.serve.errors import AdapterLoadError, APIError
from dagster_rl.tasks.lm.serve.prefix_cache import PrefixCache
from dagster_rl.tasks.lm.serve.protocol import CompletionRequest, CompletionResult
from dagster_rl.tasks.lm.settings import SamplingSettings

log = logging.getLogger("dagster_rl.serve")


class Engine:
    """The base model, its tokenizer, and the LoRA adapters loaded by name.

    Adapters load only from folders under `adapter_roots` (resolved: a link out of them is outside).
    Each is a PEFT adapter under an internal name (`a<n>`), so any name a client gives is servable,
    and a load either completes or leaves the model as it was: a load that fails is undone, and
    unloading the last adapter returns the model to its base."""

    def __init__(
        self,
        model: str,
        served_name: str | None = None,
        dtype: str = "float32",
        adapter_roots: Sequence[str] = (),
        prefix_cache_mib: int = 1024,
    ):
        self.model_arg, self.name = model, served_name or model
        base, self.tokenizer = load_base(model, dtype)
        self.base = base.eval()
        self.peft: PeftModel | None = None
        self.adapters: dict[str, str] = {}  # name -> path
        self._internal: dict[str, str] = {}  # name -> PEFT's adapter name
        self._loads = 0
        self.adapter_roots = tuple(dict.fromkeys(os.path.realpath(r) for r in adapter_roots if r))
        embeddings = cast(torch.nn.Embedding, cast(PreTrainedModel, base).get_input_embeddings())
        self.vocab = int(embeddings.num_embeddings)  # the ids the model has rows for
        self.max_model_len = int(getattr(base.config, "max_position_embeddings", 0) or 0) or None
        self.lock = threading.Lock()  # the model: one batch or one adapter change at a time
        # the KV cache of what it served, by token prefix (None: off): an episode's next turn computes only its new tokens
        self.prefixes = PrefixCache(prefix_cache_mib * 2**20) if prefix_cache_mib > 0 else None

    # ---- adapters ----------------------------------------------------------------------------
    def check_adapter_folder(self, name: str, path: str) -> Path:
        """The adapter folder `path`, resolved, if this server may load it: under an allowed root,
        with its two files under that root too."""
        if not self.adapter_roots:
            raise AdapterLoadError(
                HTTPStatus.FORBIDDEN,
                f"Loading lora {name} failed: this server loads adapters only from the folders given with --adapter-root "
                f"(or ${ADAPTER_ROOTS_ENV}), and none was given: restart it with --adapter-root <folder>",
                "PermissionDeniedError",
                "lora_path",
            )
        folder = os.path.realpath(path)
        files = [os.path.realpath(os.path.join(folder, f)) for f in (ADAPTER_CONFIG, ADAPTER)]
        root = next((r for r in self.adapter_roots if _under(folder, r)), None)
        if root is None or not all(_under(f, root) for f in files):
            where = folder if root is None else next(f for f in files if not _under(f, root))
            raise AdapterLoadError(
                HTTPStatus.FORBIDDEN,
                f"Loading lora {name} failed: {path} is outside the folders this server loads adapters from "
                f"({', '.join(self.adapter_roots)}): it resolves to {where}",
                "PermissionDeniedError",
                "lora_path",
            )
        if not all(os.path.isfile(f) for f in files):
            raise AdapterLoadError(
                HTTPStatus.NOT_FOUND, f"Loading lora {name} failed: No adapter found for {path}", "NotFoundError", "lora_path"
            )
        return Path(folder)

    def load_adapter(self, name: str, path: str, inplace: bool = False) -> None:
        if not name or not path:
            raise APIError(HTTPStatus.BAD_REQUEST, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput")
        folder = self.check_adapter_folder(name, path)
        with self.lock, building():  # PEFT builds the adapter's layers
            if name in self.adapters and not inplace:
                raise APIError(
                    HTTPStatus.BAD_REQUEST,
                    f"The lora adapter '{name}' has already been loaded. If you want to load the adapter in place, set 'load_inplace' to True.",
                    "InvalidUserInput",
                )
            self._loads += 1
            internal = f"a{self._loads}"
            try:
                if self.peft is None:
                    self.peft = PeftModel.from_pretrained(self.base, str(folder), adapter_name=internal).eval()
                else:
                    self.peft.load_adapter(str(folder), adapter_name=internal)
                    self.peft.eval()
            except Exception as e:  # any failure of PEFT's load is undone, then reported
                self._undo(internal)
                raise AdapterLoadError(
                    HTTPStatus.BAD_REQUEST,
                    f"Loading lora {name} failed: {path} is not a LoRA adapter of {self.name} this server can load "
                    f"({type(e).__name__}: {str(e)[:300]}); nothing was loaded",
                    "BadRequestError",
                    "lora_path",
                ) from None
            if name in self._internal:  # load_inplace: the new weights replace the old ones
                self._delete(self._internal[name])
                self._forget(self._internal[name])
            self.adapters[name], self._internal[name] = path, internal
        log.info("Loaded new LoRA adapter: name '%s', path '%s'", name, path)

    def unload_adapter(self, name: str) -> None:
        if not name:
            raise APIError(
                HTTPStatus.BAD_REQUEST, "'lora_name' needs to be provided to unload a LoRA adapter.", "InvalidUserInput"
            )
        with self.lock:
            if name not in self.adapters:
                raise APIError(HTTPStatus.NOT_FOUND, f"The lora adapter '{name}' cannot be found.", "NotFoundError", "lora_name")
            del self.adapters[name]
            internal = self._internal.pop(name)
            self._delete(internal)
            self._forget(internal)
        log.info("Removed LoRA adapter: name '%s'", name)

    def _delete(self, internal: str) -> None:
        """Remove one PEFT adapter; the last one gone, the model is its base again (no LoRA layer left)."""
        assert self.peft is not None
        if not self._internal:
            self._to_base()
            return
        with warnings.catch_warnings():  # PEFT warns when the active adapter goes: the next batch sets its own
            warnings.filterwarnings("ignore", message="Adapter .* was active which is now deleted")
            self.peft.delete_adapter(internal)

    def _forget(self, internal: str) -> None:
        """Drop the prefix cache's entries of an adapter that is gone (its internal name is never reused)."""
        if self.prefixes is not None:
            self.prefixes.drop(internal)

    def _undo(self, internal: str) -> None:
        """Remove what a failed load of `internal` left: its adapter, or every LoRA layer when it was the first."""
        if self.peft is None or not self._internal:
            self._to_base()
            return
        try:
            if internal in self.peft.peft_config:
                self._delete(internal)
        except Exception:  # PEFT could not remove it: rebuild from the adapters' folders
            log.exception("could not remove the failed adapter; reloading the loaded ones")
            loaded = {n: (self.adapters[n], i) for n, i in self._internal.items()}
            self._to_base()
            for path, i in loaded.values():
                if self.peft is None:
                    self.peft = PeftModel.from_pretrained(self.base, path, adapter_name=i).eval()
                else:
                    self.peft.load_adapter(path, adapter_name=i)

    def _to_base(self) -> None:
        """The model without LoRA: every PEFT layer replaced by the layer it wraps, PEFT's record removed."""
        for module in list(self.base.modules()):
            for child_name, child in list(module.named_children()):
                if isinstance(child, BaseTunerLayer):
                    setattr(module, child_name, child.get_base_layer())
        if "peft_config" in vars(self.base):
            delattr(self.base, "peft_config")
        self.peft = None
        self.base.eval()

    def model_cards(self) -> list[dict[str, Any]]:
        created = int(time.time())
        base = {"id": self.name, "object": "model", "created": created, "owned_by": "dagster-rl", "root": self.model_arg,
                "parent": None, "max_model_len": self.max_model_len, "permission": []}  # fmt: skip
        loras: list[dict[str, Any]] = [
            {
                "id": n,
                "object": "model",
                "created": created,
                "owned_by": "dagster-rl",
                "root": p,
                "parent": self.name,
                "max_model_len": None,
                "permission": [],
            }  # fmt: skip
            for n, p in list(self.adapters.items())
        ]
        return [base, *loras]

    def check_model(self, name: str) -> None:
        if name != self.name and name not in self.adapters:
            raise APIError(HTTPStatus.NOT_FOUND, f"The model `{name}` does not exist.", "NotFoundError", "model")

    # ---- generation --------------------------------------------------------------------------
    def run_batch(self, batch: list[CompletionRequest], cancelled: Callable[[], bool] = lambda: False) -> list[CompletionResult]:
        """Sample a batch of one group: the `hf` engine's sampler and log-probabilities; stops
        (`BatchCancelled`) between two tokens once `cancelled()` says every request went away."""
        first = batch[0]
        sampling = SamplingSettings(temperature=first.temperature, top_p=first.top_p, max_new_tokens=first.max_tokens)
        tok = self.tokenizer
        with self.lock, torch.inference_mode():
            if first.model not in self.adapters:  # the base model (or an adapter unloaded meanwhile)
                self.check_model(first.model)
            model = _Forward(
                self._select(first.model), cancelled, base_only=first.model not in self.adapters and self.peft is not None
            )
            top = max(r.logprobs or 0 for r in batch)
            # whose numbers the KV cache holds: the adapter's load, or the base (adapters disabled)
            computed_by = self._internal.get(first.model, "base")
            prompts = [r.prompt_ids for r in batch]
            past = BatchKV.stack([self.prefixes.lookup(computed_by, p) for p in prompts]) if self.prefixes else None
            gens, kept = generate_cached(
                model,
                prompts,
                [r.seed for r in batch],
                sampling,
                first.stop_id,
                tok.pad_token_id,
                top,
                past=past,
                keep=self.prefixes is not None,
            )
            if self.prefixes is not None and kept is not None:
                self.prefixes.store(computed_by, kept)
        return [
            CompletionResult(
                list(g.completion_ids), list(g.logprobs), g.finish_reason, g.top and [t[: r.logprobs] for t in g.top]
            )
            for g, r in zip(gens, batch, strict=True)
        ]

    def _select(self, name: str) -> torch.nn.Module:
        if name in self.adapters:
            assert self.peft is not None
            self.peft.set_adapter(self._internal[name])
            return self.peft
        return self.base if self.peft is None else self.peft


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


class _Forward(torch.nn.Module):
    """The model a batch generates with: its forward stops the batch (`BatchCancelled`) once every
    request went away, and with `base_only` runs the PEFT model with its adapters disabled (the base's numbers)."""

    def __init__(self, model: torch.nn.Module, cancelled: Callable[[], bool], base_only: bool = False):
        super().__init__()
        self.model, self.cancelled, self.base_only = model, cancelled, base_only

    def forward(self, *args, **kwargs):
        if self.cancelled():
            raise BatchCancelled()
        if self.base_only:
            assert isinstance(self.model, PeftModel)
            with self.model.disable_adapter():
                return self.model(*args, **kwargs)
        return self.model(*args, **kwargs)
