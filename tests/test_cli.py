"""`dagster-rl status` and `dagster-rl lineage` against a real instance."""

import json

from assets.cli import main


def test_status_lists_every_step_with_cache_and_reward(uninterrupted, monkeypatch, capsys):
    monkeypatch.setenv("DAGSTER_HOME", str(uninterrupted.home))
    monkeypatch.setenv("DAGSTER_RL_EXPERIMENTS", str(uninterrupted.home / "experiments"))
    main(["status", "demo"])
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "experiment demo: 8 of 16 steps materialized"
    rows = [line.split() for line in out[2:]]
    assert [r[0] for r in rows] == [f"{i:04d}" for i in range(9)]
    assert rows[8] == ["0008", "-"]
    md = uninterrupted.latest("demo", "weights", "0007")
    assert rows[7][3] == "24/24" and float(rows[7][4]) == round(md["mean_reward"], 3) and rows[7][7] == "8"


def test_lineage_walks_every_behavior_policy_back_to_step_0(uninterrupted, monkeypatch, capsys):
    monkeypatch.setenv("DAGSTER_HOME", str(uninterrupted.home))
    monkeypatch.setenv("DAGSTER_RL_EXPERIMENTS", str(uninterrupted.home / "experiments"))
    main(["lineage", "demo", "5", "--json"])
    chain = json.loads(capsys.readouterr().out)
    assert [s["step"] for s in chain] == [5, 4, 3, 2, 1, 0]
    for newer, older in zip(chain, chain[1:]):
        assert newer["behavior_policy"]["content_hash"] == older["weights_hash"]
    assert chain[-1]["behavior_policy"]["partition"] == "initial"
    for s in chain:
        md = {a: uninterrupted.latest("demo", a, f"{s['step']:04d}") for a in ("rollouts", "rewards", "weights")}
        assert s["weights_hash"] == md["weights"]["content_hash"]
        assert s["rewards_hash"] == md["rewards"]["content_hash"]
        assert s["rollouts_hash"] == md["rollouts"]["content_hash"]
        assert s["rubric"]["name"] == "default" and len(s["seeds"]) == 24 and s["experiment"] == "demo"
    main(["lineage", "demo", "1"])
    text = capsys.readouterr().out
    assert "step 0001  weights v2" in text and "<- behavior policy: weights initial v0" in text
