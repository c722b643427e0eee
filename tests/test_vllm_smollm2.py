"""The shipped SmolLM2 experiment with `rollout: {backend: openai_server}` on a real vLLM (CPU build),
started the way a run starts it, with the command `dagster_rl.tasks.lm.rollout.vllm_serving` derives from the
experiment (the converted folder served under its `builtin:` name, --max-lora-rank, --max-model-len
1024): two steps at a tiny batch are on-policy in float32 (max |logp_trainer - logp_vllm| <= 1e-3),
and step 0001 samples with the adapter of step 0000 loaded as its own version."""

from dagster_rl.tasks.lm.experiment import LMExperiment
from dagster_rl.tasks.lm.rollout.vllm_serving import vllm_command_for
from resources import RolloutEnvironment
from tests.harness import failure_message, new_dagster_home, open_lab
from tests.lm_fixtures import FLOAT32_TOLERANCE
from tests.machine import free_port
from tests.settings import shipped_settings, write_experiments
from tests.smollm2 import SMOLLM2_EXPERIMENT, TINY_BATCH, require_smollm2
from tests.vllm_server import LOADED, STARTUP_TIMEOUT_S, require_vllm


def test_two_steps_on_vllm_are_on_policy_and_serve_each_version_as_its_own_adapter(tmp_path):
    python = require_vllm()
    require_smollm2()
    raw = shipped_settings(SMOLLM2_EXPERIMENT, **{**TINY_BATCH, "n_steps": 2, "rollout": {"backend": "openai_server"}})
    exp = LMExperiment.model_validate(raw)
    port = free_port()
    command = vllm_command_for(exp, port, python=python)
    assert (
        "--max-model-len=1024" in command
        and "--max-lora-rank=16" in command
        and "--served-model-name=builtin:smollm2-135m-instruct" in command
    )
    server = RolloutEnvironment(
        base_url=f"http://127.0.0.1:{port}/v1", server_command=command, server_startup_timeout_s=STARTUP_TIMEOUT_S
    )
    server.endpoint().start([])
    home = new_dagster_home(tmp_path / "home")
    lab = open_lab(
        home,
        write_experiments(home / "experiments", raw),
        rollout=RolloutEnvironment(base_url=server.base_url, request_timeout_s=300),
    )
    try:
        result = lab.run(SMOLLM2_EXPERIMENT, "0000", "0001", raise_on_error=False)
        assert result.success, failure_message(result)
        weights = [lab.latest(SMOLLM2_EXPERIMENT, "weights", s) for s in ("0000", "0001")]
        log = server._server.log_path.read_text(errors="replace")
    finally:
        lab.close()
        server.teardown_after_execution(None)
    devs = [w["logp_max_dev"] for w in weights]
    print(f"\nSmolLM2 on vLLM, float32: max |logp_trainer - logp_vllm| per step {[f'{d:.2e}' for d in devs]}")
    assert all(0.0 <= d <= FLOAT32_TOLERANCE for d in devs), devs
    assert [w["weights_version"] for w in weights] == [1, 2]
    assert [name for name, _ in LOADED.findall(log)] == [f"{SMOLLM2_EXPERIMENT}-v0", f"{SMOLLM2_EXPERIMENT}-v1"]
